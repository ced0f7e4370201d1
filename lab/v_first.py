"""Issue 17, tenth session: the stream launch requesting its rows of ``v`` before the state's stream.

`split_stream.py --parts` timed the stream verify without its state (Gram products, factors, readout only): 23 us
at B=32 8-node chains against the whole launch's 31.5, and removing the level sweeps changed nothing: what is left
is each program's chain of dependent loads and products, four programs an SM. The readout's load of ``v`` is the last
link: it waits for the factors, then goes to memory. Here (a text patch of `resident.py`) the state-first branch
loads its ``v`` tile right after the tree rows, before the stream, and the readout takes it from registers. Each
launch is checked against the float64 reference (the folded one's committed slots too, and the ring against the
shipped kernel over five rounds), then timed beside the shipped kernel: verify, folded round, ring read and write.

The second variant (the load after the stream, before the factors) is what `resident.py` does since 2026-12-02e
(`value_tile`), so these patches match the kernel at 990bd8f only: run this in a worktree there.

    python3 lab/v_first.py [--json OUT] [--repeats 30]
    TRITON_INTERPRET=1 python3 lab/v_first.py --smoke      # the checks only, small heads on the CPU
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

PREFETCH_OLD = """        o_v = i_part * B_V + tl.arange(0, B_V)
        if ROWS_FIRST:
            b_qs = tl.zeros([B_V, B_T], dtype=tl.float32)"""
PREFETCH_NEW = """        o_v = i_part * B_V + tl.arange(0, B_V)
        if ROWS_FIRST:
            b_vv = tl.load(v_ptr + rows[None, :] * stride_v_n + i_h * stride_v_h + o_v[:, None], mask=m_i[None, :],
                           other=0)
        else:
            b_vv = tl.load(v_ptr + rows[:, None] * stride_v_n + i_h * stride_v_h + o_v[None, :], mask=m_i[:, None],
                           other=0)
        if ROWS_FIRST:
            b_qs = tl.zeros([B_V, B_T], dtype=tl.float32)"""
READOUT_OLD = """        if ROWS_FIRST:
            readout_rows_first(b_qs, b_ks, a_q, a_k, b_w, b_m, v_ptr, u_ptr, o_ptr, rows, m_i, o_v, i_h, stride_v_n,
                               stride_v_h, H_V, D_V, DOT_PRECISION)
        else:
            readout(b_qs, b_ks, a_q, a_k, b_w, b_m, v_ptr, u_ptr, o_ptr, rows, m_i, o_v, i_h, stride_v_n, stride_v_h,
                    H_V, D_V, DOT_PRECISION)
    else:"""
READOUT_NEW = """        if ROWS_FIRST:
            b_r = b_vv.to(tl.float32) - b_ks * a_k[None, :]
            b_u = tl.dot(b_r, tl.trans(b_w), input_precision=DOT_PRECISION)
            b_o = tl.dot(b_r, tl.trans(b_m), b_qs * a_q[None, :], input_precision=DOT_PRECISION)
            tl.store(u_ptr + rows[None, :] * (H_V * D_V) + i_h * D_V + o_v[:, None], b_u, mask=m_i[None, :])
            tl.store(o_ptr + rows[None, :] * (H_V * D_V) + i_h * D_V + o_v[:, None],
                     b_o.to(o_ptr.dtype.element_ty), mask=m_i[None, :])
        else:
            b_r = b_vv.to(tl.float32) - a_k[:, None] * b_ks
            b_u = tl.dot(b_w, b_r, input_precision=DOT_PRECISION)
            b_o = tl.dot(b_m, b_r, a_q[:, None] * b_qs, input_precision=DOT_PRECISION)
            tl.store(u_ptr + rows[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :], b_u, mask=m_i[:, None])
            tl.store(o_ptr + rows[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :],
                     b_o.to(o_ptr.dtype.element_ty), mask=m_i[:, None])
    else:"""
PATCHES = [(PREFETCH_OLD, PREFETCH_NEW), (READOUT_OLD, READOUT_NEW)]
# v_mid: the load right after the stream, before the factors (v is not live during the stream's key steps)
MID_OLD = """        b_w, b_m, a_q, a_k = head_factors(
            b_qk, b_kk, ssq_q, ssq_k, enter_i, exit_i, b_beta, b_g, tl.load(block_depth_ptr + i_r), scale,
            logp_ptr, k_scale_ptr, rows, m_i, i_h, i_hk, i_part, write_keys, H_V, H_K,
            B_T, USE_QK_L2NORM, DOT_PRECISION, SWEEP_F16)
        if ROWS_FIRST:
            readout_rows_first("""
MID_NEW = """        if ROWS_FIRST:
            b_vv = tl.load(v_ptr + rows[None, :] * stride_v_n + i_h * stride_v_h + o_v[:, None], mask=m_i[None, :],
                           other=0)
        else:
            b_vv = tl.load(v_ptr + rows[:, None] * stride_v_n + i_h * stride_v_h + o_v[None, :], mask=m_i[:, None],
                           other=0)
        b_w, b_m, a_q, a_k = head_factors(
            b_qk, b_kk, ssq_q, ssq_k, enter_i, exit_i, b_beta, b_g, tl.load(block_depth_ptr + i_r), scale,
            logp_ptr, k_scale_ptr, rows, m_i, i_h, i_hk, i_part, write_keys, H_V, H_K,
            B_T, USE_QK_L2NORM, DOT_PRECISION, SWEEP_F16)
        if ROWS_FIRST:
            readout_rows_first("""
MID_PATCHES = [(MID_OLD, MID_NEW), (READOUT_OLD.replace("readout_rows_first(", "readout_rows_first(", 1), READOUT_NEW)]

CASES = [(32, 8, "chain"), (16, 4, "chain"), (16, 8, "random")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    heads = HeadShape(hk=2, hv=4, dk=32, dv=32) if args.smoke else HeadShape(hk=16, hv=32, dk=128, dv=128)
    device = "cpu" if args.smoke else "cuda"
    cases = [(2, 4, "chain"), (3, 8, "random")] if args.smoke else CASES
    work = pathlib.Path(tempfile.mkdtemp())
    variants = (("v_first", FastLauncher(patched_resident_kernel(PATCHES, "v_first", work))),
                ("v_mid", FastLauncher(patched_resident_kernel(MID_PATCHES, "v_mid", work))))
    shipped = run_module.RESIDENT
    rows = []
    for batch, size, kind in cases:
        case = BenchCase(heads, batch, size, torch.bfloat16, 8, label="qwen3.5-9b", kind=kind)
        bench = CaseBench(case, device)
        launch = bench.launch(variant="stream")
        flaunch = bench.launch(variant="stream", fold=True)
        for name, kernel in (("shipped", shipped), *variants):
            row = {"batch": batch, "tree_size": size, "kind": kind, "kernel": name, "config": str(launch.config),
                   "fold_config": str(flaunch.config)}
            check_and_time(row, bench, kernel, launch, flaunch, args.repeats, args.rounds, not args.smoke,
                           ring_against=shipped)
            show(row, rows)
        bench = None  # its buffers go before the next case's
        release(device)
    save(args.json, rows)


if __name__ == "__main__":
    main()
