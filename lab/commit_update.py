"""Issue 17: the all-layer commit's ways of finding and applying the accepted path, side by side on the H200.

Modes: "search" (each program gathers its path 16 nodes at a time, as `tree_commit` does), "table" (the paths
worked out once per launch, `tree_commit.path_table`, read by every program) and "table-tf32x3" (the path's
product on tensor cores, `tree_commit.COMMIT_UPDATE`). Each is checked against the closed form
(`CommitBench.check`) before it is timed, for a few tiles, at one launch for all 24 layers of Qwen3.5-9B, per
layer; beside them, the same bytes copied (`copy_` into another buffer) and scaled in place (`mul_`), the floors a
commit can approach (per layer, one set of the rotation).

    python3 lab/commit_update.py [--json OUT] [--repeats N]

The switches it sets (`tree_commit.COMMIT_PATH_TABLE`, `COMMIT_UPDATE`) exist at commit 5fb36eb only: neither
gained at the tuned tiles (BENCHMARKS.md, "A layer's round", fifth session), so main keeps the searching kernel
without them. Run it from a checkout of that commit (`git worktree add /tmp/c 5fb36eb`).
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
CONFIGS = [CommitConfig(128, 16, 128, 2, 3), CommitConfig(128, 32, 128, 4, 3), CommitConfig(64, 16, 128, 2, 3),
           CommitConfig(32, 128, 128, 4, 1), CommitConfig(64, 64, 64, 4, 1), CommitConfig(128, 32, 32, 4, 1),
           CommitConfig(64, 32, 32, 2, 1), CommitConfig(32, 64, 64, 2, 1), CommitConfig(128, 16, 16, 2, 1),
           CommitConfig(64, 128, 128, 8, 1), CommitConfig(128, 16, 64, 2, 3), CommitConfig(32, 32, 32, 1, 1)]
MODES = {"search": (False, "ieee"), "table": (True, "ieee"), "table-tf32x3": (True, "tf32x3")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--layers", type=int, default=24)
    args = parser.parse_args()
    if not hasattr(tc, "COMMIT_PATH_TABLE"):
        raise SystemExit("lab/commit_update.py: this kernel has no commit switches; run it at commit 5fb36eb")
    rows = []
    for batch, size in CASES:
        key = CommitKey.bucketed(HEADS, "bf16", size, batch, layers=args.layers)
        bench = CommitBench(key, "cuda")
        tuned = tuned_commit(HEADS.hk, HEADS.hv, HEADS.dk, HEADS.dv, torch.bfloat16, size, batch, args.layers,
                             torch.device("cuda"))
        _, states, _, _, _ = bench.sets()
        one_set = states[:, :batch]
        other = torch.empty_like(one_set)
        copy = time_launches(lambda _: other.copy_(one_set), 1, "cuda", repeats=args.repeats).p50_us / args.layers
        scale = time_launches(lambda _: one_set.mul_(1.0), 1, "cuda", repeats=args.repeats).p50_us / args.layers
        row = {"batch": batch, "tree_size": size, "layers": args.layers, "tuned": tuned.text if tuned else None,
               "copy_us_per_layer": round(copy, 2), "in_place_us_per_layer": round(scale, 2), "times": {}}
        for config in dict.fromkeys(([tuned] if tuned else []) + CONFIGS):
            for mode, (table, update) in MODES.items():
                tc.COMMIT_PATH_TABLE, tc.COMMIT_UPDATE = table, update
                name = f"{mode} {config.b_k}/{config.b_v}/{config.v_span}/{config.num_warps}/{config.num_stages}"
                try:
                    error = bench.check(config)
                    t = bench.time(config, repeats=args.repeats).p50_us / args.layers
                    row["times"][name] = {"us_per_layer": round(t, 2), "error": error}
                except Exception as e:  # noqa: BLE001 - a lab sweep records what failed and goes on
                    row["times"][name] = {"failed": f"{type(e).__name__}: {str(e)[:160]}"}
        tc.COMMIT_PATH_TABLE, tc.COMMIT_UPDATE = True, "ieee"
        rows.append(row)
        ok = sorted((v["us_per_layer"], k) for k, v in row["times"].items() if "us_per_layer" in v)
        best = {m: min((t for t, k in ok if k.startswith(m + " ")), default=float("nan")) for m in MODES}
        print(f"B={batch:>2} T={size} L={args.layers}: copy {copy:.1f}, in place {scale:.1f} us/layer | best " +
              " ".join(f"{m} {best[m]:.1f}" for m in MODES) + f" | overall {ok[0][1]} {ok[0][0]:.1f}"
              f" ({ok[0][0] / copy:.2f}x copy)", flush=True)
        del bench, states, other, one_set
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
