"""Issue 17, sixteenth session: the stream launch on stacked rows (``STACK``: for trees of at most 8 nodes, each node's
q and k in one 16-row tile, so the state products, Gram products, corrections and readout are one tensor-core product
each instead of two; docs/math.md §3, "Stacked rows") against the same launch on two tiles, side by side.

Per case (9B heads, bf16) and each way: the verify checked against the float64 reference, the folded launch's outputs
and committed slots against float64 and the closed form, the ring's outputs over five rounds (R = 2) and its flushed
slots against the float64 recurrence; then timed in one run (one CUDA graph over rotating sets, median per launch):
the verify, the folded verify, and the ring's rounds (R = 2 and 4, 24 layers), at the database's tiles. With
``--tiles`` the stacked verify and folded verify are also timed at other tiles (stacked rows use fewer registers, so
other tiles may win).

    python3 lab/stacked_rows.py [--json OUT] [--repeats 10] [--tiles]
    TRITON_INTERPRET=1 python3 lab/stacked_rows.py --smoke
"""

from __future__ import annotations

import argparse

import torch

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.config import KernelConfig
from bole_tune.kernels import tree_verify
from bole_tune.shapes import HeadShape
from lab_rows import release, save, show

CASES = [(32, 8, "chain"), (32, 4, "chain"), (16, 4, "chain"), (16, 8, "random"), (16, 8, "chain")]
TILES = ["32/128/2/3", "32/128/4/3", "64/128/4/3", "32/64/2/3", "64/64/2/3", "32/128/2/2"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--tiles", action="store_true")
    args = parser.parse_args()
    heads = HeadShape(hk=2, hv=4, dk=32, dv=32) if args.smoke else HeadShape(hk=16, hv=32, dk=128, dv=128)
    device = "cpu" if args.smoke else "cuda"
    rows = []
    for batch, size, kind in [(2, 8, "chain")] if args.smoke else CASES:
        bench = CaseBench(BenchCase(heads, batch, size, torch.bfloat16, 8, label="qwen3.5-9b", kind=kind), device)
        forced = "stream" if args.smoke else None  # the CPU has no tuned configs: the stream launch asked for
        verify, fold = bench.launch(variant=forced), bench.launch(variant=forced, fold=True)
        for stacked in (True, False):
            read, write = verify.replace(stack_qk=stacked), fold.replace(stack_qk=stacked)
            row = {"batch": batch, "tree_size": size, "kind": kind, "stacked": stacked,
                   "verify_tiles": str(read.config), "fold_tiles": str(write.config)}
            try:
                row["verify_error"] = bench.check(tree_verify, read)
                row["fold_o_error"], row["fold_state_error"] = bench.fold_errors(write)
                row["ring_o_error"], row["ring_state_error"] = bench.ring_errors(read, write, rounds=4, steps=5)
                if not args.smoke:
                    row["verify"] = bench.time_verify(tree_verify, read, args.repeats)[0].p50_us
                    row["folded"] = bench.time_folded(write, args.repeats).p50_us
                    for r in (2, 4):
                        times = bench.time_ring(r, 24, args.repeats, read_launch=read, write_launch=write)
                        row.update({f"{k}_R{r}": t.p50_us for k, t in times.items() if k != "ring_end"})
            except Exception as e:  # noqa: BLE001 - a lab sweep records what failed and goes on
                row["failed"] = f"{type(e).__name__}: {str(e)[:200]}"
            show(row, rows)
        if args.tiles and not args.smoke:
            for text in TILES:
                config = KernelConfig(*map(int, text.split("/")))
                launch = bench.launch(config=config, variant="stream")
                row = {"batch": batch, "tree_size": size, "kind": kind, "stacked": launch.stack_qk, "tiles": text}
                try:
                    row["verify_error"] = bench.check(tree_verify, launch)
                    row["fold_o_error"], row["fold_state_error"] = bench.fold_errors(launch)
                    row["verify"] = bench.time_verify(tree_verify, launch, args.repeats)[0].p50_us
                    row["folded"] = bench.time_folded(launch, args.repeats).p50_us
                except Exception as e:  # noqa: BLE001
                    row["failed"] = f"{type(e).__name__}: {str(e)[:200]}"
                show(row, rows)
        bench = None
        release(device)
    save(args.json, rows)


if __name__ == "__main__":
    main()
