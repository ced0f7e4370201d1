"""Issue 17, tenth session: the stream launch with its programs taking the two orders in turn (`resident.py`'s
``ORDER_MIX``, `run.ORDER_MIX`), against every program state first. 9B heads, bf16, CUDA graphs, one run.

At B >= 16 the stream verify runs four 2-warp programs per SM in about two waves, all started together: every
program streams its state first, then solves its factors, so an SM's programs stream at the same time and then all
leave the memory idle while they solve. With ``ORDER_MIX = n`` the programs alternate, in runs of ``n`` program ids,
between state first and factors first (the resident kernel's other order, same grid), so half of an SM's programs
can solve while the other half stream. Each launch is checked first: the verify's outputs against the float64
reference, the folded launch's outputs and committed slots too (`CaseBench.check`, `fold_errors`); then the verify,
the folded round and the ring's read and write rounds are timed at each mix.

The switch lost everywhere (BENCHMARKS.md, "Tenth session") and was removed: run this at commit 852d41e, where
`resident.py` has ``ORDER_MIX`` (`git worktree add /tmp/mix 852d41e`, install it there).

    python3 lab/order_mix.py [--json OUT] [--repeats 30] [--mixes 0,1,66,132]
    TRITON_INTERPRET=1 python3 lab/order_mix.py --smoke      # the checks only, small heads on the CPU
"""

from __future__ import annotations

import argparse
import json

import torch

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.kernels import tree_verify
from bole_tune.kernels.verify import run as run_module
from bole_tune.shapes import HeadShape

CASES = [(16, 4, "chain"), (32, 8, "chain"), (16, 8, "random"), (32, 4, "chain"), (16, 64, "random")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--mixes", default="0,1,66,132")
    parser.add_argument("--rounds", type=int, default=4, help="the ring's R")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    mixes = [int(m) for m in args.mixes.split(",")]
    heads = HeadShape(hk=2, hv=4, dk=32, dv=32) if args.smoke else HeadShape(hk=16, hv=32, dk=128, dv=128)
    device = "cpu" if args.smoke else "cuda"
    cases = [(2, 4, "chain"), (3, 8, "random")] if args.smoke else CASES
    saved = dict(run_module.ORDER_MIX)
    rows = []
    try:
        for batch, size, kind in cases:
            case = BenchCase(heads, batch, size, torch.bfloat16, 8, label="qwen3.5-9b", kind=kind)
            bench = CaseBench(case, device)
            # the stream launch at the database's tiles (the smoke run: the planner's untuned stream launch)
            launch = bench.launch(variant="stream")
            flaunch = bench.launch(variant="stream", fold=True)
            for mix in mixes:
                run_module.ORDER_MIX.update(verify=mix, fold=mix, ring_read=mix)
                row = {"batch": batch, "tree_size": size, "kind": kind, "mix": mix, "config": str(launch.config),
                       "fold_config": str(flaunch.config)}
                row["verify_error"] = bench.check(tree_verify, launch)
                row["fold_error"], row["fold_state_error"] = bench.fold_errors(flaunch)
                if not args.smoke:
                    row["verify"] = bench.time_verify(tree_verify, launch, args.repeats)[0].p50_us
                    row["folded"] = bench.time_folded(flaunch, args.repeats).p50_us
                    ring = bench.time_ring(args.rounds, 24, args.repeats, read_launch=launch, write_launch=flaunch)
                    row.update({k: t.p50_us for k, t in ring.items()})
                print(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                      flush=True)
                rows.append(row)
            del bench
            if device == "cuda":
                torch.cuda.empty_cache()
    finally:
        run_module.ORDER_MIX.update(saved)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
