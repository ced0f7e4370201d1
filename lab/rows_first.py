"""Issue 17: the stream verify's state products with the state tile as the left operand (``ROWS_FIRST``).

The resident kernel's state-first order ("stream") takes ``Q S^T`` as ``[B_T, b_k] x [b_k, b_v]``: 16 rows of
nodes (a tree of 4 padded to 16) against the state tile transposed. Its transpose, ``S Q^T`` as ``[b_v, b_k] x
[b_k, B_T]``, puts the 128 value rows of the tile where the tensor cores want many rows and uses the tile as it
was loaded; the readout then works on ``[b_v, B_T]`` tiles (``U^T = R'^T W^T``, ``O^T = a_q Q S^T + R'^T M^T``).
This script times both orders (`run.ROWS_FIRST` set for the verify and the folded verify alike), verify and folded
round, at each bucket's tuned tiles and, for the swept cases, both orders at the same eight other tiles; one CUDA
graph over rotating input sets, after checking each launch against the float64 reference (outputs, and the folded
launch's committed slots).

    python3 lab/rows_first.py [--json OUT] [--repeats 30] [--no-sweep]
"""

from __future__ import annotations

import argparse
import json

import torch

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.config import KernelConfig
from bole_tune.kernels import PendingCommit, PendingPaths, tree_verify
from bole_tune.kernels.verify import run as run_module
from bole_tune.shapes import HeadShape
from bole_tune.timing import time_launches

CASES = [(16, 4, "chain", True), (32, 8, "chain", True), (16, 8, "random", False), (16, 16, "random", False),
         (32, 4, "chain", False)]
SWEEP = [KernelConfig(32, b_v, w, s) for b_v in (128, 64) for w in (2, 4) for s in (2, 3)]
ORDERS = {"shipped order": False, "rows first": True}

def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="small heads on the CPU interpreter: the script runs")
    args = parser.parse_args()
    heads, device, cases, sweep = HeadShape(hk=16, hv=32, dk=128, dv=128), "cuda", CASES, SWEEP
    if args.smoke:
        heads, device, cases, sweep = HeadShape(hk=2, hv=4, dk=32, dv=32), "cpu", [(2, 4, "chain", True)], \
            [KernelConfig(16, 32, 4, 1)]
        args.repeats = 1
    kernels = ORDERS
    shipped = dict(run_module.ROWS_FIRST)
    epoch = run_module.commit_epoch
    rows = []
    for batch, size, kind, sweeping in cases:
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

        def measure(launch, name: str) -> dict:
            entry = {"config": str(launch.config), "kernel": name}
            run_module.ROWS_FIRST.update(verify=kernels[name], fold=kernels[name])
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

                entry["verify"] = time_launches(verify, len(inputs), device, repeats=args.repeats).p50_us
                run_module.commit_epoch = lambda: 7  # a pending path stays pending while timed: no memset
                try:
                    entry["folded"] = time_launches(folded, len(inputs), device, repeats=args.repeats).p50_us
                finally:
                    run_module.commit_epoch = epoch
            except Exception as e:  # noqa: BLE001 - a lab sweep records what failed and goes on
                entry["status"] = f"{type(e).__name__}: {str(e)[:200]}"
            finally:
                run_module.ROWS_FIRST.update(shipped)
                pool.copy_(before)
            print("   ", " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in entry.items()),
                  flush=True)
            return entry

        print(f"B={batch} T={size} {kind}: tuned {tuned.variant} {tuned.config}, fold {tuned_fold.variant} "
              f"{tuned_fold.config}", flush=True)
        row = {"batch": batch, "tree_size": size, "kind": kind, "tuned": str(tuned.config),
               "tuned_fold": str(tuned_fold.config), "runs": []}
        stream = [tuned.replace(variant="stream", v_split=heads.dv // tuned.config.b_v)]
        if tuned_fold.config != tuned.config:
            stream.append(tuned_fold.replace(variant="stream", v_split=heads.dv // tuned_fold.config.b_v))
        for launch in stream:
            for name in kernels:
                row["runs"].append(measure(launch, name))
        if sweeping and not args.no_sweep:
            for config in sweep:
                if config.fits(heads.dk, heads.dv):
                    for name in kernels:
                        row["runs"].append(measure(bench.launch(config=config, variant="stream"), name))
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
    print("\n| 9B, us | verify: shipped / rows first (tuned tiles) | best verify: shipped / rows first | "
          "best folded: shipped / rows first |")
    print("|---|---|---|---|")
    for row in rows:
        first = [next((r.get("verify", nan) for r in row["runs"] if r["kernel"] == name), nan) for name in kernels]
        bv = [row.get(f"best_verify {name}", {}) for name in kernels]
        bf = [row.get(f"best_folded {name}", {}) for name in kernels]
        print(f"| B={row['batch']} T={row['tree_size']} {row['kind']} | {first[0]:.1f} / {first[1]:.1f} | "
              + " / ".join(f"{b.get('verify', nan):.1f} ({b.get('config', '')})" for b in bv) + " | "
              + " / ".join(f"{b.get('folded', nan):.1f} ({b.get('config', '')})" for b in bf) + " |")


if __name__ == "__main__":
    main()
