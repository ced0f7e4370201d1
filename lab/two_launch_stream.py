"""Issue 17: the "stream" variant as two launches (`kernels/verify/stream.py`: the heads' factors once, then one
small program per value tile streaming the state) against the resident kernel's state-first order (one launch, the
factors solved in every program), verify and folded round, 9B heads, bf16, CUDA graphs, one run.

Every launch is first checked against the float64 reference on the case's reference instance (outputs; for the
folded launch also the committed slots against the closed-form commit). The folded launches are timed with one
commit mark for every launch (a pending path stays pending while timed: no memset of the previous result's marks
inside the timed graph). At the end, the bench's round rows for the tuned launch of each case (two launches):
verify + commit, the folded round (with the bench's memset), the all-layer commit and the serial round.

    python3 lab/two_launch_stream.py [--json OUT] [--repeats 30] [--no-sweep]
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

CASES = [(16, 4, "chain", True), (32, 8, "chain", True), (16, 8, "random", True), (32, 4, "chain", False),
         (64, 4, "chain", False), (16, 16, "random", False)]
SWEEP = [KernelConfig(b_k, b_v, w, 2) for b_v, b_k in ((16, 32), (16, 64), (16, 128), (32, 16), (32, 32), (32, 64),
                                                        (64, 32)) for w in (1, 2, 4)]
MODES = {"one launch": (False, 8), "two launches, tensor cores": (True, 0), "two launches, FMAs": (True, 8)}
"""The ways a "stream" launch runs: (run.TWO_LAUNCH_STREAM, run.CHAIN_MAX_NODES)."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="small heads on the CPU interpreter: the script runs")
    args = parser.parse_args()
    heads, device, cases, sweeps = HeadShape(hk=16, hv=32, dk=128, dv=128), "cuda", CASES, SWEEP
    if args.smoke:
        heads, device, cases, sweeps = HeadShape(hk=2, hv=4, dk=32, dv=32), "cpu", [(2, 4, "chain", True)], SWEEP[3:5]
        args.repeats, args.layers = 1, 2
    epoch = run_module.commit_epoch
    rows = []
    for batch, size, kind, sweep in cases:
        case = BenchCase(heads, batch, size, torch.bfloat16, 8, label="qwen3.5-9b", kind=kind)
        bench = CaseBench(case, device)
        tree, pool, inputs, slots = bench.sets(64)
        accepted = bench.deepest(tree)
        tuned, tuned_fold = bench.launch(), bench.launch(fold=True)
        prev = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=tuned)
                for i, x in enumerate(inputs)]
        outs = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=tuned)
                for i, x in enumerate(inputs)]
        pending = [PendingCommit(PendingPaths.between_rounds(tree, accepted, slots[i], slots[i], pool.shape[0]),
                                 prev[i]) for i in range(len(inputs))]
        before = pool.clone()

        def measure(launch, mode: str) -> dict:
            run_module.TWO_LAUNCH_STREAM, run_module.CHAIN_MAX_NODES = MODES[mode]
            try:
                entry = {"config": str(launch.config), "variant": launch.variant, "mode": mode}
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
                run_module.commit_epoch = lambda: 7
                try:
                    entry["folded"] = time_launches(folded, len(inputs), device, repeats=args.repeats).p50_us
                finally:
                    run_module.commit_epoch = epoch
                pool.copy_(before)
            except Exception as e:  # noqa: BLE001 - a lab sweep records what failed and goes on
                entry["status"] = f"{type(e).__name__}: {str(e)[:200]}"
                pool.copy_(before)
            finally:
                run_module.TWO_LAUNCH_STREAM, run_module.CHAIN_MAX_NODES = MODES["two launches, FMAs"]
            print("   ", " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in entry.items()),
                  flush=True)
            return entry

        row = {"batch": batch, "tree_size": size, "kind": kind, "tuned": str(tuned.config), "tuned_variant": tuned.variant,
               "tuned_fold": str(tuned_fold.config), "runs": []}
        print(f"B={batch} T={size} {kind}: tuned {tuned.variant} {tuned.config}, fold {tuned_fold.variant} "
              f"{tuned_fold.config}", flush=True)
        stream = [tuned.replace(variant="stream", v_split=heads.dv // tuned.config.b_v)]
        if tuned_fold.config != tuned.config:
            stream.append(tuned_fold.replace(variant="stream", v_split=heads.dv // tuned_fold.config.b_v))
        for launch in stream:  # the tuned tiles, each way
            for mode in MODES:
                row["runs"].append(measure(launch, mode))
        if sweep and not args.no_sweep:
            for config in sweeps:
                if not config.fits(heads.dk, heads.dv):
                    continue
                launch = bench.launch(config=config, variant="stream")
                row["runs"].append(measure(launch, "two launches, FMAs" if size <= 8 else "two launches, tensor cores"))
        ok = [r for r in row["runs"] if r["mode"] != "one launch" and "verify" in r]
        if ok:
            row["best_verify"] = min(ok, key=lambda r: r["verify"])
            row["best_folded"] = min(ok, key=lambda r: r["folded"])
        rounds = bench.time_rounds(args.layers, args.repeats)
        row["rounds"] = {name: t.p50_us for name, t in rounds.items()}
        print("  rounds (tuned launches, two-launch stream):",
              " ".join(f"{k} {v:.4g}" for k, v in row["rounds"].items()), flush=True)
        rows.append(row)
        del bench, tree, pool, inputs, prev, outs, pending, before
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    nan = float("nan")
    print("\n| case | tuned tiles, verify / folded: " + " | ".join(MODES) + " | best 2-launch verify | "
          "best 2-launch folded | all-layer commit |")
    print("|---|" + "---|" * (len(MODES) + 3))
    for row in rows:
        cells = []
        for mode in MODES:
            run = next((r for r in row["runs"] if r["mode"] == mode and "verify" in r), {})
            cells.append(f"{run.get('verify', nan):.1f} / {run.get('folded', nan):.1f}")
        bv, bf = row.get("best_verify", {}), row.get("best_folded", {})
        print(f"| B={row['batch']} T={row['tree_size']} {row['kind']} | " + " | ".join(cells) + " | "
              f"{bv.get('verify', nan):.1f} ({bv.get('config')}) | "
              f"{bf.get('folded', nan):.1f} ({bf.get('config')}) | {row['rounds'].get('tree_commit_layers', nan):.1f} |")


if __name__ == "__main__":
    main()
