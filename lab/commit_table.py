"""Issue 17, twelfth session: the all-layer commit with its path read from a table against the path found in the
tree by every program (`tree_commit.PATH_TABLE_MIN_LAYERS`), side by side.

For B = 1, 16, 32 and the 9B's 24 GDN layers (`CommitBench`, random 8-node trees, input sets rotating past the L2
cache, one CUDA graph, median per launch, per layer; every config checked against the closed form before it is
timed; the table's own launch is timed with it), a few tile configs each way, alternating, and `mul_(1.0)` over a
contiguous buffer of the same bytes (the copy floor the issue's <= 1.25x is stated against).

    python3 lab/commit_table.py [--json OUT] [--repeats 15]
    TRITON_INTERPRET=1 python3 lab/commit_table.py --smoke

The switch exists at commit eb6a7ca only (the table gained 0-1% at B >= 16 and lost 5% at B=1, so main reverted
it): run this script from a checkout of that commit (`git worktree add /tmp/t eb6a7ca`).
"""

from __future__ import annotations

import argparse

import torch

from bole_tune.commit_bench import CommitBench
from bole_tune.config import CommitConfig as C
from bole_tune.database import CommitKey
from bole_tune.kernels.verify import tree_commit as tc
from bole_tune.lookup import tuned_commit
from bole_tune.shapes import HeadShape
from bole_tune.timing import time_launches
from lab_rows import release, save, show

CASES = [(16, 24), (32, 24), (1, 24)]
CONFIGS = [C(128, 16, 128, 2, 3), C(128, 16, 128, 2, 2), C(128, 32, 128, 4, 2), C(128, 32, 128, 4, 3)]
PATHS = {"table": 2, "search": 1 << 30}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if not hasattr(tc, "PATH_TABLE_MIN_LAYERS"):
        raise SystemExit("lab/commit_table.py: this kernel has no PATH_TABLE_MIN_LAYERS switch; run it at eb6a7ca")
    heads = HeadShape(hk=2, hv=4, dk=32, dv=32) if args.smoke else HeadShape(hk=16, hv=32, dk=128, dv=128)
    device = "cpu" if args.smoke else "cuda"
    rows = []
    shipped = tc.PATH_TABLE_MIN_LAYERS
    for batch, layers in [(2, 2)] if args.smoke else CASES:
        bench = CommitBench(CommitKey.bucketed(heads, "bf16", 8, batch, layers=layers), device,
                            most_sets=2 if args.smoke else None)
        configs = [C(32, 16, 32, 2, 1), C(16, 16, 32, 1, 2)] if args.smoke else list(CONFIGS)
        tuned = None if args.smoke else tuned_commit(heads.hk, heads.hv, heads.dk, heads.dv, torch.bfloat16, 8,
                                                     batch, layers, torch.device(device))
        if tuned is not None and tuned not in configs:
            configs.insert(0, tuned)
        for config in configs:
            for path, least in PATHS.items():
                tc.PATH_TABLE_MIN_LAYERS = least
                row = {"batch": batch, "layers": layers, "path": path, "config": config.text,
                       "tuned": config == tuned}
                try:
                    row["error"] = bench.check(config)
                    if not args.smoke:
                        row["us_per_layer"] = bench.time(config, args.repeats).p50_us / layers
                except Exception as e:  # noqa: BLE001 - a sweep records what failed and goes on
                    row["failed"] = f"{type(e).__name__}: {str(e)[:160]}"
                show(row, rows)
        tc.PATH_TABLE_MIN_LAYERS = shipped
        if not args.smoke:
            _, states, _, _, _ = bench.sets()
            flat = torch.empty(states[:, :batch].numel(), dtype=torch.float32, device=device)
            bufs = [flat, torch.empty_like(flat)]
            floor = time_launches(lambda i: bufs[i].mul_(1.0), 2, device, args.repeats).p50_us / layers
            show({"batch": batch, "layers": layers, "floor mul_ contiguous": floor}, rows)
            bufs = flat = states = None
        bench = None
        release(device)
    save(args.json, rows)


if __name__ == "__main__":
    main()
