"""Stacked rows for trees of 9-16 nodes: the stream launch on a 32-row node block, each node's q and k in one tile.

The shipped stream launch stacks (``Launch.stack_qk``; docs/math.md §3, "Stacked rows") only trees of at most 8 nodes,
half its 16-row block; a 9-node chain, the shape most budgets in the database pick (91 of 216 entries), runs on a
16-row block with q and k in two tiles, two products for each one a stacked launch takes. The same launch on a
32-row block can stack trees of up to 16 nodes: one product per step where it took two, but the factors solved on
32 rows instead of 16. This times both side by side, at the database's tiles and a few others.

Per case (9B heads, bf16) and each way: the verify checked against the float64 reference, the folded launch against
float64 and the closed form, the ring's outputs over five rounds (R = 2) and its flushed slots against the float64
recurrence; then timed in one run (one CUDA graph over rotating sets, median per launch): the verify, the folded
verify, and the ring's rounds (R = 4, 24 layers).

    python3 lab/stack_wide.py [--json OUT] [--repeats 10]
    TRITON_INTERPRET=1 python3 lab/stack_wide.py --smoke
"""

from __future__ import annotations

import argparse

import torch

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.config import KernelConfig
from bole_tune.kernels.verify import planner
from bole_tune.kernels.verify import run as run_module
from bole_tune.shapes import HeadShape
from lab_rows import check_and_time, release, save, show

_SHIPPED_BLOCK = planner.node_block
WIDE = [False]


def _node_block(max_tree_size: int) -> int:
    """The shipped node block, but 32 for trees of 9-16 nodes while `WIDE` is set (what the planner's launch check
    expects: the lab's stacked launches run on 32-row blocks)."""
    return 32 if WIDE[0] and 8 < max_tree_size <= 16 else _SHIPPED_BLOCK(max_tree_size)


planner.node_block = _node_block

CASES = [(16, 9, "chain"), (32, 9, "chain"), (16, 16, "random")]
TILES = ["32/128/4/3", "32/128/2/3", "64/128/4/2", "32/64/4/3"]


def ways(verify, fold):
    """(label, read launch, write launch): as planned, and on a 32-row block with stacked rows."""
    yield "planned", verify, fold
    yield "stacked32", verify.replace(node_block=32, stack_qk=True), fold.replace(node_block=32, stack_qk=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    heads = HeadShape(hk=2, hv=4, dk=32, dv=32) if args.smoke else HeadShape(hk=16, hv=32, dk=128, dv=128)
    device = "cpu" if args.smoke else "cuda"
    rows = []
    for batch, size, kind in [(2, 9, "chain"), (2, 12, "random")] if args.smoke else CASES:
        bench = CaseBench(BenchCase(heads, batch, size, torch.bfloat16, 8, label="qwen3.5-9b", kind=kind), device)
        forced = "stream" if args.smoke else None  # the CPU has no tuned configs: the stream launch asked for
        WIDE[0] = False  # planned on the shipped blocks
        verify, fold = bench.launch(variant=forced), bench.launch(variant=forced, ring=True)
        candidates = list(ways(verify, fold))
        if not args.smoke:
            for text in TILES:
                config = KernelConfig(*map(int, text.split("/")))
                if config == verify.config:
                    continue
                launch = bench.launch(config=config, variant="stream")
                candidates.append((f"stacked32 {text}", launch.replace(node_block=32, stack_qk=True),
                                   launch.replace(node_block=32, stack_qk=True)))
        for label, read, write in candidates:
            WIDE[0] = read.node_block == 32
            row = {"batch": batch, "tree_size": size, "kind": kind, "way": label, "verify_tiles": str(read.config),
                   "write_tiles": str(write.config), "block": read.node_block, "stacked": read.stack_qk}
            if check_and_time(row, bench, run_module.RESIDENT, read, write, args.repeats, 4, timed=not args.smoke):
                try:
                    row["ring_o_error"], row["ring_state_error"] = bench.ring_errors(read, write, rounds=2, steps=5)
                except Exception as e:  # noqa: BLE001 - a lab sweep records what failed and goes on
                    row["failed"] = f"{type(e).__name__}: {str(e)[:300]}"
            show(row, rows)
        bench = None
        release(device)
    save(args.json, rows)


if __name__ == "__main__":
    main()
