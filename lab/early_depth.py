"""Issue 17, tenth session (prepared, not run: the session's device time ran out): the stream launch's sweep count
(the tree's depth) requested at the program's start instead of where the sweeps wait on it, after the stream (a
text patch of `resident.py`'s state-first branch; the factor-first branch is left as it is: at 64-node trees its
binary spills more with the count held from the start, `lab/sass_stats.py`). The same kind of change as the value
rows requested before the factors (`v_first.py`, shipped). 9B heads, bf16, CUDA graphs; each launch checked against
the float64 reference first (verify and fold), then the verify, the folded round and the ring's rounds timed side by
side with the shipped kernel.

    python3 lab/early_depth.py [--json OUT] [--repeats 10]
    TRITON_INTERPRET=1 python3 lab/early_depth.py --smoke
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

import torch

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.kernels.launcher import FastLauncher
from bole_tune.kernels.verify import run as run_module
from bole_tune.shapes import HeadShape
from lab_rows import check_and_time, release, save, show
from patched_kernel import patched_resident_kernel

SLOT = "    slot = tl.load(state_indices_ptr + i_r).to(tl.int64)\n"
CALL_OLD = """        b_v = value_tile(v_ptr, rows, m_i, o_v, i_h, stride_v_n, stride_v_h, ROWS_FIRST)
        b_w, b_m, a_q, a_k = head_factors(
            b_qk, b_kk, ssq_q, ssq_k, enter_i, exit_i, b_beta, b_g, tl.load(block_depth_ptr + i_r), scale,"""
CALL_NEW = """        b_v = value_tile(v_ptr, rows, m_i, o_v, i_h, stride_v_n, stride_v_h, ROWS_FIRST)
        b_w, b_m, a_q, a_k = head_factors(
            b_qk, b_kk, ssq_q, ssq_k, enter_i, exit_i, b_beta, b_g, num_sweeps, scale,"""
PATCHES = [(SLOT, SLOT + "    if STATE_FIRST:\n        num_sweeps = tl.load(block_depth_ptr + i_r)\n"),
           (CALL_OLD, CALL_NEW)]
CASES = [(32, 8, "chain"), (16, 4, "chain"), (16, 8, "random")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    heads = HeadShape(hk=2, hv=4, dk=32, dv=32) if args.smoke else HeadShape(hk=16, hv=32, dk=128, dv=128)
    device = "cpu" if args.smoke else "cuda"
    early = FastLauncher(patched_resident_kernel(PATCHES, "early_depth", pathlib.Path(tempfile.mkdtemp())))
    rows = []
    for batch, size, kind in [(2, 8, "chain")] if args.smoke else CASES:
        bench = CaseBench(BenchCase(heads, batch, size, torch.bfloat16, 8, label="qwen3.5-9b", kind=kind), device)
        launch, flaunch = bench.launch(variant="stream"), bench.launch(variant="stream", fold=True)
        for name, kernel in (("shipped", run_module.RESIDENT), ("early", early)):
            row = {"batch": batch, "tree_size": size, "kind": kind, "kernel": name}
            check_and_time(row, bench, kernel, launch, flaunch, args.repeats, 4, not args.smoke)
            show(row, rows)
        bench = None  # its buffers go before the next case's
        release(device)
    save(args.json, rows)


if __name__ == "__main__":
    main()
