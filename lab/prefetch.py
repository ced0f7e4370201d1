"""Issue 17: does the stream launch wait on its own loads? Its key loop unrolled, and its first state tiles
requested before the previous round's path is read.

The state-first branch of the resident kernel (`kernels/verify/resident.py`, ``STATE_FIRST``) walks the key
chunks of its value tile in a loop: each step loads a ``[b_v, b_k]`` state tile, and in the folded launch applies
the pending path to it and writes it back, before the next step's load is issued. Its folded launch first reads
the pending path (two dependent loads) before any state tile is requested. Variants, each a text-patched copy of
the kernel (`patched_kernel.py`), timed beside the shipped one:

  unroll:    the key loop as ``tl.static_range`` (one straight block: the compiler may issue every chunk's loads
             early)
  early2:    unrolled, and the first two chunks' state tiles requested at the top of the program, before the
             pending path and the first Gram chunk
  early_all: unrolled, every chunk's state tile requested at the top

Each launch is checked against the float64 reference first (outputs, and the folded launch's committed slots),
then timed in one CUDA graph over rotating input sets (folded: one commit mark for every launch, no memset).

    python3 lab/prefetch.py [--json OUT] [--repeats 30] [--smoke]
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

CASES = [(16, 4, "chain"), (32, 8, "chain"), (16, 8, "random")]
TILES = [KernelConfig(32, 64, 2, 3), KernelConfig(32, 128, 2, 3), KernelConfig(32, 64, 4, 3), KernelConfig(64, 64, 2, 3)]

LOOP = """        for i_k in range(0, D_K, B_K):
            o_k = i_k + tl.arange(0, B_K)
            b_s = tl.load(p_state + o_v[:, None] * stride_s_v + o_k[None, :])
"""
UNROLLED = """        for i_k in tl.static_range(0, D_K, B_K):
            o_k = i_k + tl.arange(0, B_K)
            b_s = tl.load(p_state + o_v[:, None] * stride_s_v + o_k[None, :])
"""
EARLY_LOOP = """        for i_k in tl.static_range(0, D_K, B_K):
            o_k = i_k + tl.arange(0, B_K)
            if i_k == 0:
                b_s = b_s0
            elif i_k == B_K:
                b_s = b_s1
            elif i_k == 2 * B_K and EARLY_ALL:
                b_s = b_s2
            elif i_k == 3 * B_K and EARLY_ALL:
                b_s = b_s3
            else:
                b_s = tl.load(p_state + o_v[:, None] * stride_s_v + o_k[None, :])
"""
PATH = """    p_state = state_ptr + slot * stride_s_slot + i_h * stride_s_h
    if FOLD:"""
EARLY = """    p_state = state_ptr + slot * stride_s_slot + i_h * stride_s_h
    if STATE_FIRST:  # the first state tiles requested before anything else is read
        o_v0 = i_part * B_V + tl.arange(0, B_V)
        o_k0 = tl.arange(0, B_K)
        b_s0 = tl.load(p_state + o_v0[:, None] * stride_s_v + o_k0[None, :])
        b_s1 = tl.load(p_state + o_v0[:, None] * stride_s_v + (B_K + o_k0[None, :]) % D_K)
        if EARLY_ALL:
            b_s2 = tl.load(p_state + o_v0[:, None] * stride_s_v + (2 * B_K + o_k0[None, :]) % D_K)
            b_s3 = tl.load(p_state + o_v0[:, None] * stride_s_v + (3 * B_K + o_k0[None, :]) % D_K)
    if FOLD:"""


def variants(workdir: pathlib.Path) -> dict:
    early = [(LOOP, EARLY_LOOP), (PATH, EARLY)]
    return {
        "shipped": run_module.RESIDENT,
        "unroll": FastLauncher(patched_resident_kernel([(LOOP, UNROLLED)], "unroll", workdir)),
        "early2": FastLauncher(patched_resident_kernel(early + [("    ROWS_FIRST: tl.constexpr = False,\n",
                                                                  "    ROWS_FIRST: tl.constexpr = False,\n"
                                                                  "    EARLY_ALL: tl.constexpr = False,\n")],
                                                       "early2", workdir)),
        "early_all": FastLauncher(patched_resident_kernel(early + [("    ROWS_FIRST: tl.constexpr = False,\n",
                                                                     "    ROWS_FIRST: tl.constexpr = False,\n"
                                                                     "    EARLY_ALL: tl.constexpr = True,\n")],
                                                          "early_all", workdir)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--smoke", action="store_true", help="small heads on the CPU interpreter: the script runs")
    args = parser.parse_args()
    heads, device, cases, tiles = HeadShape(hk=16, hv=32, dk=128, dv=128), "cuda", CASES, TILES
    if args.smoke:
        heads, device, cases, tiles = HeadShape(hk=2, hv=4, dk=64, dv=32), "cpu", [(2, 4, "chain")], \
            [KernelConfig(16, 32, 4, 1)]
        args.repeats = 1
    kernels = variants(pathlib.Path(tempfile.mkdtemp()))
    shipped, epoch = run_module.RESIDENT, run_module.commit_epoch
    rows = []
    for batch, size, kind in cases:
        case = BenchCase(heads, batch, size, torch.bfloat16, 8, label="qwen3.5-9b", kind=kind)
        bench = CaseBench(case, device)
        tree, pool, inputs, slots = bench.sets(64)
        accepted = bench.deepest(tree)
        tuned, tuned_fold = bench.launch(), bench.launch(fold=True)
        prev = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=tuned) for i, x in enumerate(inputs)]
        outs = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=tuned) for i, x in enumerate(inputs)]
        pending = [PendingCommit(PendingPaths.between_rounds(tree, accepted, slots[i], slots[i], pool.shape[0]),
                                 prev[i]) for i in range(len(inputs))]
        before = pool.clone()
        print(f"B={batch} T={size} {kind}: tuned {tuned.variant} {tuned.config}, fold {tuned_fold.variant} "
              f"{tuned_fold.config}", flush=True)
        row = {"batch": batch, "tree_size": size, "kind": kind, "tuned": str(tuned.config),
               "tuned_fold": str(tuned_fold.config), "runs": []}
        launches = [bench.launch(config=c, variant="stream") for c in tiles if c.fits(heads.dk, heads.dv)]
        for launch in launches:
            for name, kernel in kernels.items():
                entry = {"config": str(launch.config), "kernel": name}
                run_module.RESIDENT = kernel  # the launcher run.py calls
                try:
                    entry["error"] = bench.error(tree_verify, launch)
                    entry["fold_error"], entry["fold_state_error"] = bench.fold_errors(launch)

                    def verify(i):
                        x = inputs[i]
                        tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=launch, out=outs[i])

                    def folded(i):
                        x = inputs[i]
                        tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=launch, out=outs[i],
                                    pending=pending[i])

                    if not args.smoke:  # the interpreter: the patches apply and the results are right; no timing
                        entry["verify"] = time_launches(verify, len(inputs), device, repeats=args.repeats).p50_us
                        run_module.commit_epoch = lambda: 7  # a pending path stays pending while timed: no memset
                        try:
                            entry["folded"] = time_launches(folded, len(inputs), device, repeats=args.repeats).p50_us
                        finally:
                            run_module.commit_epoch = epoch
                except Exception as e:  # noqa: BLE001 - a lab sweep records what failed and goes on
                    entry["status"] = f"{type(e).__name__}: {str(e)[:300]}"
                finally:
                    run_module.RESIDENT = shipped
                    pool.copy_(before)
                print("   ", " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in entry.items()), flush=True)
                row["runs"].append(entry)
        for name in kernels:
            ok = [r for r in row["runs"] if r["kernel"] == name and "verify" in r]
            if ok:
                row[f"best_verify {name}"] = min(ok, key=lambda r: r["verify"])
                row[f"best_folded {name}"] = min(ok, key=lambda r: r["folded"])
        rows.append(row)
        del bench, tree, pool, inputs, prev, outs, pending, before
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    nan = float("nan")
    print("\n| 9B, us | best verify: " + " / ".join(kernels) + " | best folded: " + " / ".join(kernels) + " |")
    print("|---|---|---|")
    for row in rows:
        bv = [row.get(f"best_verify {name}", {}) for name in kernels]
        bf = [row.get(f"best_folded {name}", {}) for name in kernels]
        print(f"| B={row['batch']} T={row['tree_size']} {row['kind']} | "
              + " / ".join(f"{b.get('verify', nan):.1f} ({b.get('config', '')})" for b in bv) + " | "
              + " / ".join(f"{b.get('folded', nan):.1f} ({b.get('config', '')})" for b in bf) + " |")


if __name__ == "__main__":
    main()
