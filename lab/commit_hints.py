"""Issue 17, thirteenth session: the all-layer commit with cache hints on its state tiles
(`tree_commit.COMMIT_STATE_HINTS`: the loads' eviction policy, the stores' cache modifier).

Every state tile is read once and written once; the path factors (`u`, `k` rows) are read by every program of a
head. Per batch (9B heads, bf16, 8-node trees, 24 layers per launch, the bucket's tuned config): each hint pair
checked against the float64 closed form (`CommitBench.check`), then timed (one CUDA graph over pools rotating past
L2, median per launch, per layer), all pairs twice in turn to show the noise; beside them the copy floor
(`mul_(1.0)` over a contiguous buffer of the same bytes) the issue's <= 1.25x is stated against.

    python3 lab/commit_hints.py [--json OUT] [--batch 16,32] [--repeats 20] [--second --configs 128/16/128/2/2,...]
    TRITON_INTERPRET=1 python3 lab/commit_hints.py --smoke
"""

from __future__ import annotations

import argparse

from bole_tune.config import CommitConfig
from bole_tune.kernels.verify import tree_commit as commit_module
from bole_tune.shapes import HeadShape
from commit_lean import commit_case, copy_floor_row
from lab_rows import release, save, show

HINTS = [("", ""), ("evict_first", ""), ("", ".cs"), ("evict_first", ".cs"), ("evict_last", ""), ("", ".cg")]
SECOND = [("evict_last", ""), ("evict_last", ".wb"), ("evict_last", ".cg"), ("evict_last", ".cs")]
"""``--second``: the shipped load hint with each store modifier, at the tuned config and at ``--configs``."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--batch", default="16,32")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--second", action="store_true", help="the load hint evict_last with each store modifier")
    parser.add_argument("--configs", default="", help="more configs, b_k/b_v/v_span/warps/stages, comma separated")
    args = parser.parse_args()
    heads = HeadShape(hk=2, hv=4, dk=32, dv=32) if args.smoke else HeadShape(hk=16, hv=32, dk=128, dv=128)
    device = "cpu" if args.smoke else "cuda"
    layers = 2 if args.smoke else args.layers
    rows, shipped = [], commit_module.COMMIT_STATE_HINTS
    for batch in [2] if args.smoke else [int(b) for b in args.batch.split(",")]:
        bench, tuned = commit_case(heads, batch, layers, device, args.smoke)
        configs = [tuned] + [CommitConfig(*map(int, c.split("/"))) for c in args.configs.split(",") if c]
        runs = [(c, h) for c in configs for h in SECOND] if args.second else [(tuned, h) for h in HINTS]
        for turn in range(1 if args.smoke else 2):
            for config, hints in runs:
                base = {"batch": batch, "layers": layers, "config": config.text}
                commit_module.COMMIT_STATE_HINTS = hints
                row = dict(base, hints="/".join(h or "-" for h in hints), turn=turn)
                try:
                    row["error"] = bench.check(config)
                    if not args.smoke:
                        row["us_per_layer"] = bench.time(config, args.repeats).p50_us / layers
                except Exception as e:  # noqa: BLE001 - a lab sweep records what failed and goes on
                    row["failed"] = f"{type(e).__name__}: {str(e)[:200]}"
                show(row, rows)
            commit_module.COMMIT_STATE_HINTS = shipped
        if not args.smoke:
            copy_floor_row(heads, batch, layers, device, args.repeats, rows, key="hints")
        bench = None
        release(device)
    save(args.json, rows)


if __name__ == "__main__":
    main()
