"""Issue 17, thirteenth session: a ring write round whose products are taken as a read round takes them
(`run.WRITE_ROUND_CORRECTS`): from the state tiles as they are plus the pending tokens' corrections, each tile folded
and written beside them, off the products' path; against the shipped write round (the tile folded, written, then
multiplied).

Compiled for sm_90 on the CPU (`lab/sass_stats.py --ring write`, the switch set) the 9B B=32 write launch at the
fold's tuned 32/64/2/3 spills (400 bytes of stack against 32), at 32/64/4/3 it holds 233 registers without spilling;
so the switch is timed at the shipped write config and at 4-warp ones.

Per case (9B heads, bf16): the ring's outputs over five rounds and the flushed slots against the float64 recurrence
(`ring_correct_dot.against_float64`), then its rounds timed (`CaseBench.time_ring`, 24 layers, one CUDA graph, median
per launch) at R = 2 and 4; read rounds at the shipped launch.

Measured on the H200 (BENCHMARKS.md, "Thirteenth session"; benchmarks/h200-2026-12-02h/ring_write_corrected.*): the
switch was 1.3-2x slower in every case and at every tile, so it was removed again; this script runs at 3488941, the commit
that had it.

    python3 lab/ring_write_corrected.py [--json OUT] [--repeats 10]
    TRITON_INTERPRET=1 python3 lab/ring_write_corrected.py --smoke
"""

from __future__ import annotations

import argparse

import torch

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.config import KernelConfig as K
from bole_tune.kernels.verify import run as run_module
from bole_tune.shapes import HeadShape
from lab_rows import release, save, show
from ring_correct_dot import against_float64

CASES = [(32, 8, "chain"), (16, 4, "chain"), (16, 8, "random"), (32, 4, "chain")]
WRITE_CONFIGS = [None, K(32, 64, 4, 3), K(32, 128, 4, 3), K(64, 64, 4, 2)]
"""None: the folded verify's tuned launch (as shipped)."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", default="2,4")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    heads = HeadShape(hk=2, hv=4, dk=32, dv=32) if args.smoke else HeadShape(hk=16, hv=32, dk=128, dv=128)
    device = "cpu" if args.smoke else "cuda"
    rows, shipped = [], run_module.WRITE_ROUND_CORRECTS
    for batch, size, kind in [(2, 8, "chain")] if args.smoke else CASES:
        bench = CaseBench(BenchCase(heads, batch, size, torch.bfloat16, 8, label="qwen3.5-9b", kind=kind), device)
        read = bench.launch()
        for switch in (False, True):
            for config in [None, K(16, 16, 4, 1)] if args.smoke else WRITE_CONFIGS:
                if config is not None and not switch:
                    continue  # the shipped write round at its own tuned launch only
                run_module.WRITE_ROUND_CORRECTS = switch
                write = bench.launch(config, variant="stream" if config else None, fold=True)
                row = {"batch": batch, "tree_size": size, "kind": kind, "write_corrected": switch,
                       "write_config": write.config.text, "write_variant": write.variant}
                try:
                    row["o_error"], row["state_error"] = against_float64(bench, read, write)
                    for r in [] if args.smoke else map(int, args.rounds.split(",")):
                        times = bench.time_ring(r, 24, args.repeats, read_launch=read, write_launch=write)
                        row.update({f"{k}_R{r}": t.p50_us for k, t in times.items() if k != "ring_end"})
                except Exception as e:  # noqa: BLE001 - a lab sweep records what failed and goes on
                    row["failed"] = f"{type(e).__name__}: {str(e)[:200]}"
                show(row, rows)
        run_module.WRITE_ROUND_CORRECTS = shipped
        bench = None
        release(device)
    save(args.json, rows)


if __name__ == "__main__":
    main()
