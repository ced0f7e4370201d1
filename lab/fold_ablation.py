"""Issue 17: where the folded round's time goes in the resident kernel, by ablation (wrong results on purpose:
timing only), and the resident kernel's folded round with 128-wide key chunks. 9B heads, bf16, CUDA graphs.

Ablations (each a copy of kernels/verify/resident.py with one part of the fold replaced):
  nopath:   the previous round's path is not read (fixed rows and weights instead of `pending_path`; the figures
            in benchmarks/h200-2026-12-01c/ablation.json are from commit fc3fac6, when the kernel still searched
            the previous tree for the path)
  noprod:   the fold's product is skipped (the tile is only scaled)
  nostore:  the folded tile is not written back
  none:     all three (the fold reduced to scaling the tile in registers)

The ablations' patches match the kernel at commit fc3fac6 (the fold has changed since): run the script from a
checkout of that commit; at a later one the patch check stops it.

    python3 lab/fold_ablation.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile

import torch

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.config import KernelConfig
from bole_tune.kernels import PendingCommit, PendingPaths, tree_verify
from bole_tune.kernels.launcher import FastLauncher
from bole_tune.kernels.verify import run as run_module
from bole_tune.shapes import HeadShape
from bole_tune.timing import time_launches
from patched_kernel import patched_resident_kernel

CASES = [(16, 4, "chain"), (32, 8, "chain"), (16, 64, "random"), (1, 4, "chain")]
CONFIGS = [KernelConfig(128, b_v, w, s) for b_v in (32, 64) for w in (2, 4) for s in (2, 3)]

PATH = """        rows_p, m_p, weight_p, decay_p, pending = pending_path(
            i_r, i_h, i_hk, fold_map_ptr, fold_rows_ptr, fold_logp_ptr, fold_k_scale_ptr, fold_committed_ptr, epoch,
            H_V, H_K, B_P)"""
NO_PATH = """        rows_p = tl.arange(0, B_P).to(tl.int64)
        m_p = rows_p < 4
        weight_p = tl.where(m_p, 0.5, 0.0)
        decay_p = 0.9
        pending = i_r >= 0"""
PROD = """                b_s = fold_tile(b_s, rows_p, m_p, weight_p, decay_p, o_v, o_k, i_h, i_hk, fold_u_ptr, fold_k_ptr,
                                H_V, H_K, D_K, D_V, FOLD_DOT)"""
NO_PROD = """                b_s = decay_p * b_s"""
STORE = """                tl.store(p_state + o_v[:, None] * stride_s_v + o_k[None, :], b_s, mask=pending)"""
ABLATIONS = {"nopath": [(PATH, NO_PATH)], "noprod": [(PROD, NO_PROD)], "nostore": [(STORE, "")],
             "none": [(PATH, NO_PATH), (PROD, NO_PROD), (STORE, "")]}


def ablated_kernel(name: str, workdir: pathlib.Path):
    return patched_resident_kernel(ABLATIONS[name], name, workdir)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    heads = HeadShape(hk=16, hv=32, dk=128, dv=128)
    workdir = pathlib.Path(tempfile.mkdtemp())
    kernels = {name: FastLauncher(ablated_kernel(name, workdir)) for name in ABLATIONS}
    shipped = run_module.RESIDENT
    rows = []
    for batch, size, kind in CASES:
        case = BenchCase(heads, batch, size, torch.bfloat16, 8, label="qwen3.5-9b", kind=kind)
        bench = CaseBench(case, "cuda")
        tree, pool, inputs, slots = bench.sets(64)
        launch, accepted = bench.launch(variant="resident"), bench.deepest(tree)
        prev = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=launch) for i, x in enumerate(inputs)]
        outs = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=launch) for i, x in enumerate(inputs)]
        pending = [PendingCommit(PendingPaths.between_rounds(tree, accepted, slots[i], slots[i], pool.shape[0]), prev[i])
                   for i in range(len(inputs))]
        n = len(inputs)

        def timed(run_launch, fold):
            def run(i):
                x = inputs[i]
                if fold:
                    prev[i].committed.zero_()
                tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=run_launch, out=outs[i],
                            pending=pending[i] if fold else None)
            return time_launches(run, n, "cuda", repeats=args.repeats).p50_us

        row = {"batch": batch, "tree_size": size, "kind": kind, "config": str(launch.config), "v_split": launch.v_split}
        row["verify"], row["folded"] = timed(launch, False), timed(launch, True)
        for name, kernel in kernels.items():
            run_module.RESIDENT = kernel  # the launcher run.py calls (a kernel is bound in it at import)
            try:
                row[f"folded_{name}"] = timed(launch, True)
            finally:
                run_module.RESIDENT = shipped
        print(f"B={batch:>2} T={size:>3} {kind:6s} resident {launch.config} split {launch.v_split}: " +
              " ".join(f"{k} {v:.1f}" for k, v in row.items() if isinstance(v, float)), flush=True)
        row["configs"] = []
        for config in CONFIGS:
            other = bench.launch(config=config, variant="resident")
            try:
                entry = {"config": str(config), "v_split": other.v_split, "fallback": other.fallback,
                         "verify": timed(other, False), "folded": timed(other, True)}
            except Exception as e:  # noqa: BLE001 - a lab sweep records what failed and goes on
                entry = {"config": str(config), "status": f"{type(e).__name__}: {str(e)[:200]}"}
            row["configs"].append(entry)
            print(f"    {config} split {other.v_split} {other.fallback[:30]}: " +
                  " ".join(f"{k} {v:.1f}" for k, v in entry.items() if isinstance(v, float)), flush=True)
        rows.append(row)
        del bench, tree, pool, inputs, prev, outs, pending
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
