"""Issue 17, thirteenth session: the resident kernel's state loads with an eviction policy (`run.STATE_HINTS`).

The all-layer commit gained 1.2-1.3% at B >= 16 from loading its state tiles with ``evict_last`` (the write-back of
the same lines lands in L2; `lab/commit_hints.py`). The resident kernel reads the same tiles in three kinds of
launch: the verify (read only), a launch that folds and writes them back (the folded verify, a ring's write round)
and a ring's read round (read only, corrections added). Here each hint ("", "evict_first", "evict_last") is set for
all three at once and each case is timed side by side (one CUDA graph over rotating sets, median per launch): the
verify (`CaseBench.time_verify`, checked against float64 first), the folded round (`time_folded`) and a ring of four
rounds (`time_ring`, 24 layers, its outputs and flushed slots checked against the float64 recurrence first).

    python3 lab/state_hints.py [--json OUT] [--repeats 20] [--cases 1/4/chain,16/8/random] [--turns 3]
    python3 lab/state_hints.py --fused      # run.FUSED_STATE_HINTS on the cases the fused kernel serves
    TRITON_INTERPRET=1 python3 lab/state_hints.py --smoke
"""

from __future__ import annotations

import argparse

import torch

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.kernels import tree_verify
from bole_tune.kernels.verify import run as run_module
from bole_tune.shapes import HeadShape
from lab_rows import release, save, show
from ring_correct_dot import against_float64

CASES = [(16, 4, "chain"), (32, 8, "chain"), (16, 64, "random"), (16, 8, "random"), (1, 4, "chain")]
FUSED_CASES = [(1, 64, "random"), (4, 8, "random"), (8, 8, "random"), (8, 16, "random"), (4, 4, "chain"),
               (2, 64, "random")]
"""Cases the planner runs on the fused kernel (9B): `--fused` times `run.FUSED_STATE_HINTS` on them."""
HINTS = ["", "evict_first", "evict_last"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--turns", type=int, default=2, help="turns; odd ones take the hints in reverse order")
    parser.add_argument("--cases", help="batch/size/kind,... (default: all five, or FUSED_CASES with --fused)")
    parser.add_argument("--fused", action="store_true",
                        help="set run.FUSED_STATE_HINTS (both keys) instead of run.STATE_HINTS")
    args = parser.parse_args()
    heads = HeadShape(hk=2, hv=4, dk=32, dv=32) if args.smoke else HeadShape(hk=16, hv=32, dk=128, dv=128)
    device = "cpu" if args.smoke else "cuda"
    hints = run_module.FUSED_STATE_HINTS if args.fused else run_module.STATE_HINTS
    rows, shipped = [], dict(hints)
    cases = ([(int(b), int(n), k) for b, n, k in (c.split("/") for c in args.cases.split(","))] if args.cases
             else FUSED_CASES if args.fused else CASES)
    smoke_cases = [(1, 40, "random")] if args.fused else [(2, 8, "chain")]  # fused / resident under the planner
    for batch, size, kind in smoke_cases if args.smoke else cases:
        bench = CaseBench(BenchCase(heads, batch, size, torch.bfloat16, 8, label="qwen3.5-9b", kind=kind), device)
        read, write = bench.launch(), bench.launch(fold=True)
        for turn in range(1 if args.smoke else args.turns):
            for hint in HINTS[::-1] if turn % 2 else HINTS:
                hints.update({key: hint for key in hints})
                row = {"batch": batch, "tree_size": size, "kind": kind, "variant": read.variant,
                       "fold_variant": write.variant, "hint": hint or "-", "turn": turn}
                try:
                    row["verify_error"] = bench.check(tree_verify, read)
                    if turn == 0:
                        row["ring_o_error"], row["ring_state_error"] = against_float64(bench, read, write)
                    if not args.smoke:
                        row["verify_us"] = bench.time_verify(tree_verify, read, args.repeats)[0].p50_us
                        row["folded_us"] = bench.time_folded(write, args.repeats).p50_us
                        if size <= 16:
                            ring = bench.time_ring(4, 24, args.repeats // 2, read_launch=read, write_launch=write)
                            row.update({k: t.p50_us for k, t in ring.items() if k != "ring_end"})
                except Exception as e:  # noqa: BLE001 - a lab sweep records what failed and goes on
                    row["failed"] = f"{type(e).__name__}: {str(e)[:200]}"
                show(row, rows)
        hints.update(shipped)
        bench = None
        release(device)
    save(args.json, rows)


if __name__ == "__main__":
    main()
