"""Issue 17: the resident kernel with its state stream first (the "stream" variant: one value tile per program,
the Gram products taken in the same key steps as the state products, the factors after the stream) against the
planner's launch, verify alone and folded, 9B heads, bf16, CUDA graphs over rotating sets. Every launch is
checked against the float64 reference first (`CaseBench.check`, and `CaseBench.fold_errors` for the fold).

    python3 lab/state_first.py [--json OUT] [--quick] [--b-k 32,128]

Whole key rows (b_k = 128) were timed at commit d10e5b1 with the tile loaded at once, before the factors (fifth
session: slower everywhere, 23.3 against 16.2 us at B=16 4-chains; removed); on main they run the stream's one
key step.
"""

from __future__ import annotations

import argparse
import json

import torch

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.commit_bench import COMMIT_TOLERANCE
from bole_tune.config import KernelConfig
from bole_tune.kernels import tree_verify
from bole_tune.kernels.verify.self_check import accepted_error
from bole_tune.shapes import HeadShape

CASES = [(16, 4, "chain"), (32, 8, "chain"), (16, 16, "random"), (1, 4, "chain"), (16, 64, "random")]
CONFIGS = [KernelConfig(b_k, b_v, w, s) for b_v in (128, 64, 32) for b_k in (32, 64, 128) for w in (4, 8) for s in (1, 2, 3)
           if (b_k == 128) == (s == 1)]  # whole key rows: one key step, nothing to pipeline


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="two configs a case")
    parser.add_argument("--cases", type=int, default=len(CASES), help="the first N cases only")
    parser.add_argument("--b-v", default="128,64,32", help="value tiles of the state-first configs")
    parser.add_argument("--b-k", default="32,64,128", help="key steps of the state-first configs (128: whole rows)")
    args = parser.parse_args()
    heads = HeadShape(hk=16, hv=32, dk=128, dv=128)
    configs = [c for c in CONFIGS if str(c.b_v) in args.b_v.split(",") and str(c.b_k) in args.b_k.split(",")]
    configs = configs[:: len(configs) // 2] if args.quick else configs
    rows = []
    for batch, size, kind in CASES[:args.cases]:
        bench = CaseBench(BenchCase(heads, batch, size, torch.bfloat16, 8, label="qwen3.5-9b", kind=kind), "cuda")
        planned = bench.launch()
        row = {"batch": batch, "tree_size": size, "kind": kind, "planner": f"{planned.variant} {planned.config.text} "
               f"split {planned.v_split}", "verify": {}, "folded": {}}

        def timed(launch, fold: bool) -> float | str:
            try:
                if fold:
                    out_error, state_error = bench.fold_errors(launch)
                    if not (out_error <= accepted_error(torch.bfloat16) and state_error <= COMMIT_TOLERANCE):
                        return f"wrong: outputs {out_error:.1e}, state {state_error:.1e}"
                    return bench.time_folded(launch, repeats=args.repeats).p50_us
                bench.check(tree_verify, launch)
                return bench.time_verify(tree_verify, launch, repeats=args.repeats)[0].p50_us
            except Exception as e:  # noqa: BLE001 - a lab sweep records what failed and goes on
                return f"{type(e).__name__}: {str(e)[:160]}"

        row["verify"]["planner"] = timed(planned, False)
        row["folded"]["planner"] = timed(bench.launch(fold=True), True)
        for config in configs:
            if size > 16 and config.b_v == 128 and config.num_warps == 4:
                continue  # [64, 128] fp32 accumulators twice: past the registers of 4 warps
            launch = bench.launch(config=config, variant="stream")
            row["verify"][f"first {config.text}"] = timed(launch, False)
        best = sorted((v, k) for k, v in row["verify"].items() if isinstance(v, float) and k != "planner")[:3]
        for _, name in best:
            config = KernelConfig.from_text(name.split()[1])
            launch = bench.launch(config=config, variant="stream")
            row["folded"][name] = timed(launch, True)
        rows.append(row)
        fbest = min(((v, k) for k, v in row["folded"].items() if isinstance(v, float) and k != "planner"),
                    default=(float("nan"), "-"))
        fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else v[:40]  # noqa: E731
        print(f"B={batch:>2} T={size:>3} {kind:6s} {row['planner']}: verify {fmt(row['verify']['planner'])} "
              f"folded {fmt(row['folded']['planner'])} | state-first best verify {best[0][0] if best else '-'} "
              f"({best[0][1] if best else '-'}) folded {fbest[0]:.1f} ({fbest[1]})", flush=True)
        del bench
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
