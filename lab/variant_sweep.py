"""Issue 17: which kernel verifies small trees fastest at each batch: the planner's launch (the tuned fused or
resident config) against the resident kernel with 128-wide key chunks (a whole key row per step, a tile shape
the tuner's space did not hold) and the slice kernel. Verify alone, 9B heads, bf16, CUDA graphs over rotating
sets; every launch is checked against the float64 reference first (CaseBench.check).

    python3 lab/variant_sweep.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json

import torch

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.config import KernelConfig
from bole_tune.kernels import tree_verify
from bole_tune.shapes import HeadShape

CASES = [(b, t, kind) for b in (1, 2, 4, 8, 16, 32) for t, kind in ((4, "chain"), (8, "random"), (16, "random"),
                                                                      (32, "random"))]
RESIDENT = [KernelConfig(128, 32, 4, 2), KernelConfig(128, 32, 2, 2), KernelConfig(128, 16, 4, 2),
            KernelConfig(128, 64, 4, 2), KernelConfig(64, 32, 4, 2), KernelConfig(32, 64, 2, 3)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    heads = HeadShape(hk=16, hv=32, dk=128, dv=128)
    rows = []
    for batch, size, kind in CASES:
        bench = CaseBench(BenchCase(heads, batch, size, torch.bfloat16, 8, label="qwen3.5-9b", kind=kind), "cuda")
        launch = bench.launch()
        row = {"batch": batch, "tree_size": size, "kind": kind, "planner": launch.variant,
               "planner_config": str(launch.config), "runs": {}}

        def timed(run_launch) -> float | str:
            try:
                bench.check(tree_verify, run_launch)
                return bench.time_verify(tree_verify, run_launch, repeats=args.repeats)[0].p50_us
            except Exception as e:  # noqa: BLE001 - a lab sweep records what failed and goes on
                return f"{type(e).__name__}: {str(e)[:120]}"

        row["runs"]["planner"] = timed(launch)
        for config in RESIDENT:
            other = bench.launch(config=config, variant="resident")
            name = f"resident {config.text} split {other.v_split}" + (" (fell back)" if other.fallback else "")
            row["runs"][name] = timed(other)
        rows.append(row)
        best = min(((v, k) for k, v in row["runs"].items() if isinstance(v, float)), default=None)
        print(f"B={batch:>2} T={size:>3} {kind:6s} planner {launch.variant} {launch.config.text}: "
              f"{row['runs']['planner'] if isinstance(row['runs']['planner'], str) else round(row['runs']['planner'], 1)}"
              f"  best {best[0]:.1f} {best[1]}", flush=True)
        del bench
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
