"""Issue 17: the stream launch's key loop with a deeper software pipeline (more stages, narrower key chunks).

`prefetch.py` showed that Triton pipelines the state-first branch's key loop (unrolled by hand it lost 25-45%):
its state tiles are requested ``num_stages - 1`` steps ahead. The tuner's search space stops at 3 stages and the
stream buckets chose 32-wide key chunks (4 steps). This sweeps 4-6 stages and 16-wide chunks (8 steps) for the
verify and the folded round of the shipped kernel, each launch checked against the float64 reference first
(`round_timing.RoundSets`).

With ``--state-split`` it times instead eight 32-wide-chunk tiles each with and without the state split (S_pre as
two bf16 parts, bf16 tensor cores; the planner takes it for trees of more than 32 nodes only).

    python3 lab/stream_sweep.py [--json OUT] [--repeats 30] [--smoke] [--state-split]
"""

from __future__ import annotations

import argparse
import json

from bole_tune.config import KernelConfig
from bole_tune.shapes import HeadShape
from round_timing import HEADS_9B, RoundSets, best_rows, print_best, show

CASES = [(16, 4, "chain"), (32, 8, "chain"), (16, 8, "random")]
CONFIGS = ([KernelConfig(32, b_v, 2, s) for b_v in (64, 128) for s in (3, 4, 5)] + [KernelConfig(32, 64, 4, 4)]
           + [KernelConfig(16, b_v, w, s) for b_v in (64, 128) for w in (2, 4) for s in (3, 4, 6)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--smoke", action="store_true", help="small heads on the CPU interpreter: the script runs")
    parser.add_argument("--state-split", action="store_true",
                        help="each config also with S_pre taken as two bf16 parts (the planner's state_split)")
    args = parser.parse_args()
    heads, device, cases, configs = HEADS_9B, "cuda", CASES, CONFIGS
    if args.state_split:
        configs = [KernelConfig(32, b_v, w, s) for b_v in (64, 128) for w in (2, 4) for s in (2, 3)]
    if args.smoke:
        heads, device, cases, configs = HeadShape(hk=2, hv=4, dk=64, dv=32), "cpu", [(2, 4, "chain")], \
            [KernelConfig(16, 32, 2, 5)]
    rows = []
    for batch, size, kind in cases:
        sets = RoundSets(heads, batch, size, kind, device)
        print(f"B={batch} T={size} {kind}: tuned {sets.tuned.variant} {sets.tuned.config}, fold "
              f"{sets.tuned_fold.variant} {sets.tuned_fold.config}", flush=True)
        row = {"batch": batch, "tree_size": size, "kind": kind, "tuned": str(sets.tuned.config),
               "tuned_fold": str(sets.tuned_fold.config), "runs": []}
        kinds = ("stream", "stream + state split") if args.state_split else ("stream",)
        for config in configs:
            for kernel in kinds:
                launch = sets.bench.launch(config=config, variant="stream")
                if kernel != "stream":
                    launch = launch.replace(state_split=True)
                entry = {"config": str(config), "kernel": kernel, **sets.measure(launch, args.repeats,
                                                                                  timed=not args.smoke)}
                print("   ", show(entry), flush=True)
                row["runs"].append(entry)
        rows.append(row)
        sets.release()
    best_rows(rows, kinds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print_best(rows, kinds)
    print("\nper config (verify / folded, us):")
    for row in rows:
        print(f"B={row['batch']} T={row['tree_size']} {row['kind']}: " + "; ".join(
            f"{r['kernel'][-5:]} {r['config'].replace('b_k=', '').replace(' b_v=', '/').replace(' warps=', '/').replace(' stages=', '/')}"
            f" {r.get('verify', float('nan')):.1f}/{r.get('folded', float('nan')):.1f}" for r in row["runs"]))


if __name__ == "__main__":
    main()
