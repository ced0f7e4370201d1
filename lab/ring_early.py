"""Issue 17, twelfth session: a ring read round's corrections with their operands requested before the state's
stream instead of after it (a text patch of `resident.py`'s state-first branch, `CORRECT` only).

The shipped read round (`blocks.pending_corrections`) loads, after the state's stream, the rows' whole q and k, the
pending tokens' keys ``Kp`` and their weighted values ``w_j u_j``; only then can it take ``Q Kp^T``, ``K Kp^T`` and
the two small products. At B=32 (8-node chains, 24 pending tokens) that read costs 48.8 us against the verify's 30.5
(BENCHMARKS.md, "Eleventh session"): one exposed round trip per program after its stream, over ~4096 programs. Here:

  kpu    the tokens' keys and weighted values requested before the stream (held in registers across it), q and k
         read again after it (recently streamed, near the SM)
  all    q and k's whole rows too, before the stream
  dots   q, k and the keys before the stream and ``Q Kp^T``, ``K Kp^T`` taken there; the values too

Each patched launch checked against the shipped kernel over five ring rounds (outputs and the flushed slots; the
patch changes the read round only), then the ring's rounds (R = 4, 24 layers) timed side by side (9B heads, bf16,
CUDA graphs).

    python3 lab/ring_early.py [--json OUT] [--repeats 10]
    TRITON_INTERPRET=1 python3 lab/ring_early.py --smoke
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
from lab_rows import release, ring_check, save, show, with_resident
from patched_kernel import patched_resident_kernel

BEFORE_STREAM = """        if FOLD and not CORRECT:
            b_upw = fold_updates(rows_p, m_p, weight_p, o_v, i_h, fold_u_ptr, H_V, D_V)
        for i_k in range(0, D_K, B_K):
            o_k = i_k + tl.arange(0, B_K)
            b_s = tl.load(p_state + o_v[:, None] * stride_s_v + o_k[None, :])
"""
AFTER_STREAM = """        if CORRECT:  # run.py never pairs CORRECT with ROWS_FIRST
            b_qs, b_ks = pending_corrections(
                b_qs, b_ks, q_ptr, k_ptr, rows, m_i, i_hk, stride_q_n, stride_q_h, stride_k_n, stride_k_h,
                rows_p, m_p, weight_p, decay_p, o_v, i_h, fold_u_ptr, fold_k_ptr, H_V, H_K, D_K, D_V,
                GRAM_DTYPE, DOT_PRECISION, FOLD_DOT)
"""
ANCHOR = "@triton.jit\ndef head_factors("
HELPERS = '''@triton.jit
def early_rows(q_ptr, k_ptr, rows, m_i, i_hk, stride_q_n, stride_q_h, stride_k_n, stride_k_h, D_K: tl.constexpr):
    o_d = tl.arange(0, D_K)
    b_q = tl.load(q_ptr + rows[:, None] * stride_q_n + i_hk * stride_q_h + o_d[None, :], mask=m_i[:, None], other=0)
    b_k = tl.load(k_ptr + rows[:, None] * stride_k_n + i_hk * stride_k_h + o_d[None, :], mask=m_i[:, None], other=0)
    return b_q, b_k


@triton.jit
def early_tokens(rows_p, m_p, weight_p, o_v, i_h, i_hk, u_ptr, kp_ptr, H_V, H_K, D_K: tl.constexpr,
                 D_V: tl.constexpr, GRAM_DTYPE: tl.constexpr):
    o_d = tl.arange(0, D_K)
    b_kp = tl.load(kp_ptr + rows_p[:, None] * (H_K * D_K) + i_hk * D_K + o_d[None, :], mask=m_p[:, None],
                   other=0).to(GRAM_DTYPE)
    b_up = tl.load(u_ptr + rows_p[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :], mask=m_p[:, None], other=0)
    return b_kp, b_up * weight_p[:, None]


@triton.jit
def early_dots(b_q, b_k, b_kp, GRAM_DTYPE: tl.constexpr, GRAM_DOT: tl.constexpr):
    b_qp = tl.dot(b_q.to(GRAM_DTYPE), tl.trans(b_kp), input_precision=GRAM_DOT)
    b_kq = tl.dot(b_k.to(GRAM_DTYPE), tl.trans(b_kp), input_precision=GRAM_DOT)
    return b_qp, b_kq


@triton.jit
def early_apply(b_qs, b_ks, b_qp, b_kq, b_up, decay_p, DOT: tl.constexpr):
    b_qs = decay_p * b_qs + tl.dot(b_qp, b_up, input_precision=DOT)
    b_ks = decay_p * b_ks + tl.dot(b_kq, b_up, input_precision=DOT)
    return b_qs, b_ks


'''
ROWS = "q_ptr, k_ptr, rows, m_i, i_hk, stride_q_n, stride_q_h, stride_k_n, stride_k_h, D_K"
TOKENS = "rows_p, m_p, weight_p, o_v, i_h, i_hk, fold_u_ptr, fold_k_ptr, H_V, H_K, D_K, D_V, GRAM_DTYPE"
EARLY = {
    "kpu": (f"            c_kp, c_up = early_tokens({TOKENS})\n",
            f"            c_q, c_k = early_rows({ROWS})\n"
            "            c_qp, c_kq = early_dots(c_q, c_k, c_kp, GRAM_DTYPE, DOT_PRECISION)\n"
            "            b_qs, b_ks = early_apply(b_qs, b_ks, c_qp, c_kq, c_up, decay_p, FOLD_DOT)\n"),
    "all": (f"            c_kp, c_up = early_tokens({TOKENS})\n            c_q, c_k = early_rows({ROWS})\n",
            "            c_qp, c_kq = early_dots(c_q, c_k, c_kp, GRAM_DTYPE, DOT_PRECISION)\n"
            "            b_qs, b_ks = early_apply(b_qs, b_ks, c_qp, c_kq, c_up, decay_p, FOLD_DOT)\n"),
    "dots": (f"            c_kp, c_up = early_tokens({TOKENS})\n            c_q, c_k = early_rows({ROWS})\n"
             "            c_qp, c_kq = early_dots(c_q, c_k, c_kp, GRAM_DTYPE, DOT_PRECISION)\n",
             "            b_qs, b_ks = early_apply(b_qs, b_ks, c_qp, c_kq, c_up, decay_p, FOLD_DOT)\n"),
}
CASES = [(32, 8, "chain"), (16, 4, "chain"), (32, 4, "chain")]


def patches(name: str) -> list:
    before, after = EARLY[name]
    head, tail = BEFORE_STREAM.split("        for i_k in range(0, D_K, B_K):\n")
    return [(BEFORE_STREAM, head + "        if CORRECT:\n" + before + "        for i_k in range(0, D_K, B_K):\n" + tail),
            (AFTER_STREAM, "        if CORRECT:\n" + after),
            (ANCHOR, HELPERS + ANCHOR)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    heads = HeadShape(hk=2, hv=4, dk=32, dv=32) if args.smoke else HeadShape(hk=16, hv=32, dk=128, dv=128)
    device = "cpu" if args.smoke else "cuda"
    work = pathlib.Path(tempfile.mkdtemp())
    kernels = {"shipped": run_module.RESIDENT}
    kernels.update({name: FastLauncher(patched_resident_kernel(patches(name), f"early_{name}", work)) for name in EARLY})
    rows = []
    for batch, size, kind in [(2, 8, "chain")] if args.smoke else CASES:
        bench = CaseBench(BenchCase(heads, batch, size, torch.bfloat16, 8, label="qwen3.5-9b", kind=kind), device)
        launch, flaunch = bench.launch(variant="stream"), bench.launch(variant="stream", fold=True)
        show({"batch": batch, "read_launch": str(launch)}, rows)
        for name, kernel in kernels.items():
            row = {"batch": batch, "tree_size": size, "kind": kind, "kernel": name}
            try:  # the read round is all the patch changes: checked against the shipped kernel, then the ring timed
                if name != "shipped":
                    row["ring_vs_shipped"] = ring_check(bench, launch, kernel, run_module.RESIDENT)
                if not args.smoke:
                    ring = with_resident(kernel, lambda: bench.time_ring(4, 24, args.repeats, read_launch=launch,
                                                                         write_launch=flaunch))
                    row.update({key: t.p50_us for key, t in ring.items()})
            except Exception as e:  # noqa: BLE001 - a lab sweep records what failed and goes on
                row["failed"] = f"{type(e).__name__}: {str(e)[:200]}"
            show(row, rows)
        bench = None  # its buffers go before the next case's
        release(device)
    save(args.json, rows)


if __name__ == "__main__":
    main()
