"""Issue 17: how the commit adds the accepted path's updates to a state tile, side by side on the H200.

`tree_commit.COMMIT_UPDATE` picks the product: "ieee" (the path's B_P rows, padded, in fp32 FMAs), "tf32x3" (the
same product on tensor cores, three tf32 passes) or "rank1" (one fp32 outer product per node the path really
has). Each is checked against the closed form (`CommitBench.check`) before it is timed, for a few tiles, at one
launch for all 24 layers of Qwen3.5-9B, per layer; beside it, an in-place-sized copy of the same bytes
(`torch.Tensor.copy_` of the layers' states), the floor a commit can approach.

    python3 lab/commit_update.py [--json OUT] [--repeats N]
"""

from __future__ import annotations

import argparse
import json

import torch

from bole_tune.commit_bench import CommitBench
from bole_tune.config import CommitConfig
from bole_tune.database import CommitKey
from bole_tune.kernels.verify import tree_commit as tc
from bole_tune.lookup import tuned_commit
from bole_tune.shapes import HeadShape
from bole_tune.timing import time_launches

HEADS = HeadShape(hk=16, hv=32, dk=128, dv=128)
CASES = [(16, 8), (32, 8), (1, 8)]
CONFIGS = [CommitConfig(128, 16, 128, 2, 3), CommitConfig(128, 16, 64, 2, 3), CommitConfig(128, 32, 128, 4, 3),
           CommitConfig(128, 32, 32, 4, 2), CommitConfig(64, 32, 64, 4, 3), CommitConfig(128, 64, 64, 4, 2),
           CommitConfig(128, 16, 16, 2, 1), CommitConfig(64, 16, 128, 2, 3)]
MODES = ("ieee", "tf32x3", "rank1")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--layers", type=int, default=24)
    args = parser.parse_args()
    rows = []
    for batch, size in CASES:
        key = CommitKey.bucketed(HEADS, "bf16", size, batch, layers=args.layers)
        bench = CommitBench(key, "cuda")
        tuned = tuned_commit(HEADS.hk, HEADS.hv, HEADS.dk, HEADS.dv, torch.bfloat16, size, batch, args.layers,
                             torch.device("cuda"))
        _, states, _, _, _ = bench.sets()
        other = torch.empty_like(states)
        copy = time_launches(lambda _: other.copy_(states), 1, "cuda", repeats=args.repeats).p50_us / args.layers
        row = {"batch": batch, "tree_size": size, "layers": args.layers, "tuned": tuned.text if tuned else None,
               "copy_us_per_layer": round(copy, 2), "times": {}}
        for config in dict.fromkeys(([tuned] if tuned else []) + CONFIGS):
            for mode in MODES:
                tc.COMMIT_UPDATE = mode
                name = f"{mode} {config.b_k}/{config.b_v}/{config.v_span}/{config.num_warps}/{config.num_stages}"
                try:
                    error = bench.check(config)
                    t = bench.time(config, repeats=args.repeats).p50_us / args.layers
                    row["times"][name] = {"us_per_layer": round(t, 2), "error": error}
                except Exception as e:  # noqa: BLE001 - a lab sweep records what failed and goes on
                    row["times"][name] = {"failed": f"{type(e).__name__}: {str(e)[:160]}"}
        tc.COMMIT_UPDATE = "ieee"
        rows.append(row)
        ok = sorted((v["us_per_layer"], k) for k, v in row["times"].items() if "us_per_layer" in v)
        best = {m: min((t for t, k in ok if k.startswith(m + " ")), default=float("nan")) for m in MODES}
        print(f"B={batch:>2} T={size} L={args.layers}: copy {copy:.1f} us/layer | best " +
              " ".join(f"{m} {best[m]:.1f}" for m in MODES) + f" | overall {ok[0][1]} {ok[0][0]:.1f}"
              f" ({ok[0][0] / copy:.2f}x copy)", flush=True)
        del bench, states, other
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
