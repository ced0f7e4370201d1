"""The "stream" variant in two launches: a head's factors once, then its state streamed by many small programs.

The resident kernel (`resident.py`) solves a head's factors inside the program that streams its state, so every
program carries the ``T x T`` factor chain (dependent small products and layout changes) and its registers; at
B >= 16 that chain, repeated by each program of a head that splits its value rows, is what the verify's time
follows (BENCHMARKS.md, "The resident kernel"). Here the work is split where the math splits (docs/math.md §3):

1. `head_factors_kernel`, one program per (value head, request): the Gram products and norms over the key
   steps, then ``W = (I + G)^-1 D_beta``, ``M = C W`` and the row factors ``a_q``, ``a_k`` (`resident.head_factors`,
   the same code), written to a small scratch (``2 T^2 + 2 T`` floats per head, from L2 in step 2); it also writes
   what the commit needs (logP, the raw keys and their scales).
2. `tree_verify_stream_kernel`, one program per (value tile of ``b_v`` rows, value head, request): streams its
   ``[b_v, dk]`` rows of S_pre ``b_k`` columns per step (with ``pending``, each tile first becomes the committed
   state of the previous round and is written back: `blocks.fold_apply`), takes ``Q S^T`` and ``K S^T`` on them
   and reads out ``R' = V - a_k (K S^T)``, ``U = W R'``, ``O = a_q (Q S^T) + M R'`` with the factors of step 1.

A stream program holds no ``T x T`` work until its readout, so its registers stay few and many programs share an
SM, hiding each other's loads; the factors are solved once per head instead of once per program.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .blocks import floored, fold_apply, fold_updates, pending_path, qk_chunk_gram, state_products
from .resident import head_factors, readout


@triton.jit
def factor_offsets(i_r, i_h, H_V, B_T: tl.constexpr):
    """Where a head's factors lie in the scratch: ``W`` ``[B_T, B_T]``, ``M`` ``[B_T, B_T]``, ``a_q``, ``a_k``."""
    return (i_r * H_V + i_h) * (2 * B_T * B_T + 2 * B_T)


@triton.jit(do_not_specialize=["H_V", "H_K"])
def head_factors_kernel(
    q_ptr, k_ptr, g_ptr, beta_ptr,
    offsets_ptr, dfs_enter_ptr, dfs_exit_ptr, block_depth_ptr,
    logp_ptr, k_out_ptr, k_scale_ptr, committed_ptr, factors_ptr,
    scale, H_V, H_K,
    stride_q_n, stride_q_h, stride_k_n, stride_k_h, stride_g_n, stride_g_h, stride_beta_n, stride_beta_h,
    D_K: tl.constexpr, B_T: tl.constexpr, B_K: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr, GRAM_DTYPE: tl.constexpr,
    SWEEP_F16: tl.constexpr = False,
):
    i_h = tl.program_id(0).to(tl.int64)
    i_r = tl.program_id(1).to(tl.int64)
    i_hk = i_h // (H_V // H_K)
    bos = tl.load(offsets_ptr + i_r).to(tl.int64)
    num_nodes = tl.load(offsets_ptr + i_r + 1).to(tl.int64) - bos
    tl.store(committed_ptr + i_r, 0, mask=i_h == 0)  # a fresh result: nothing committed yet
    write_keys = i_h % (H_V // H_K) == 0  # one program per key head writes the keys and their scales

    o_i = tl.arange(0, B_T)
    m_i = o_i < num_nodes
    rows = bos + o_i
    enter_i = tl.load(dfs_enter_ptr + rows, mask=m_i, other=-1)
    exit_i = tl.load(dfs_exit_ptr + rows, mask=m_i, other=-2)
    b_beta = tl.load(beta_ptr + rows * stride_beta_n + i_h * stride_beta_h, mask=m_i, other=0).to(tl.float32)
    b_g = floored(tl.load(g_ptr + rows * stride_g_n + i_h * stride_g_h, mask=m_i, other=0).to(tl.float32))
    b_qk = tl.zeros([B_T, B_T], dtype=tl.float32)
    b_kk = tl.zeros([B_T, B_T], dtype=tl.float32)
    ssq_q = tl.zeros([B_T], dtype=tl.float32)
    ssq_k = tl.zeros([B_T], dtype=tl.float32)
    for i_k in range(0, D_K, B_K):
        o_k = i_k + tl.arange(0, B_K)
        _, _, b_qk, b_kk, ssq_q, ssq_k = qk_chunk_gram(
            q_ptr, k_ptr, k_out_ptr, rows, m_i, o_k, i_hk, write_keys,
            stride_q_n, stride_q_h, stride_k_n, stride_k_h, H_K, b_qk, b_kk, ssq_q, ssq_k,
            D_K, USE_QK_L2NORM, DOT_PRECISION, GRAM_DTYPE)
    b_w, b_m, a_q, a_k = head_factors(
        b_qk, b_kk, ssq_q, ssq_k, enter_i, exit_i, b_beta, b_g, tl.load(block_depth_ptr + i_r), scale,
        logp_ptr, k_scale_ptr, rows, m_i, i_h, i_hk, 0, write_keys, H_V, H_K,
        B_T, USE_QK_L2NORM, DOT_PRECISION, SWEEP_F16)
    p_f = factors_ptr + factor_offsets(i_r, i_h, H_V, B_T)
    square = o_i[:, None] * B_T + o_i[None, :]
    tl.store(p_f + square, b_w)
    tl.store(p_f + B_T * B_T + square, b_m)
    tl.store(p_f + 2 * B_T * B_T + o_i, a_q)
    tl.store(p_f + 2 * B_T * B_T + B_T + o_i, a_k)


@triton.jit(do_not_specialize=["H_V", "H_K", "epoch"])
def tree_verify_stream_kernel(
    q_ptr, k_ptr, v_ptr, state_ptr, state_indices_ptr, offsets_ptr, factors_ptr,
    o_ptr, u_ptr,
    # the previous round's accepted paths, committed into S_pre first (FOLD; `blocks.pending_path`)
    fold_map_ptr, fold_rows_ptr, fold_u_ptr, fold_logp_ptr, fold_k_ptr, fold_k_scale_ptr, fold_committed_ptr, epoch,
    H_V, H_K,
    stride_q_n, stride_q_h, stride_k_n, stride_k_h, stride_v_n, stride_v_h,
    stride_s_slot, stride_s_h, stride_s_v,
    D_K: tl.constexpr, D_V: tl.constexpr, B_T: tl.constexpr, B_K: tl.constexpr, B_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr, GRAM_DTYPE: tl.constexpr, STATE_SPLIT: tl.constexpr = False,
    FOLD: tl.constexpr = False, B_P: tl.constexpr = 16, FOLD_DOT: tl.constexpr = "ieee",
):
    # program (value tile, value head, request)
    i_v = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_r = tl.program_id(2).to(tl.int64)
    i_hk = i_h // (H_V // H_K)
    slot = tl.load(state_indices_ptr + i_r).to(tl.int64)
    bos = tl.load(offsets_ptr + i_r).to(tl.int64)
    num_nodes = tl.load(offsets_ptr + i_r + 1).to(tl.int64) - bos
    o_i = tl.arange(0, B_T)
    m_i = o_i < num_nodes
    rows = bos + o_i
    o_v = i_v * B_V + tl.arange(0, B_V)
    p_state = state_ptr + slot * stride_s_slot + i_h * stride_s_h
    if FOLD:
        rows_p, m_p, weight_p, decay_p, pending = pending_path(
            i_r, i_h, i_hk, fold_map_ptr, fold_rows_ptr, fold_logp_ptr, fold_k_scale_ptr, fold_committed_ptr, epoch,
            H_V, H_K, B_P, B_P)
        b_upw = fold_updates(rows_p, m_p, weight_p, o_v, i_h, fold_u_ptr, H_V, D_V)
    b_qs = tl.zeros([B_T, B_V], dtype=tl.float32)
    b_ks = tl.zeros([B_T, B_V], dtype=tl.float32)
    for i_k in range(0, D_K, B_K):
        o_k = i_k + tl.arange(0, B_K)
        b_s = tl.load(p_state + o_v[:, None] * stride_s_v + o_k[None, :])
        b_q = tl.load(q_ptr + rows[:, None] * stride_q_n + i_hk * stride_q_h + o_k[None, :], mask=m_i[:, None], other=0)
        b_k = tl.load(k_ptr + rows[:, None] * stride_k_n + i_hk * stride_k_h + o_k[None, :], mask=m_i[:, None], other=0)
        if FOLD:
            b_s = fold_apply(b_s, b_upw, rows_p, m_p, decay_p, o_k, i_hk, fold_k_ptr, H_K, D_K, FOLD_DOT)
            tl.store(p_state + o_v[:, None] * stride_s_v + o_k[None, :], b_s, mask=pending)
        b_qs, b_ks = state_products(b_q, b_k, b_s, b_qs, b_ks, DOT_PRECISION, GRAM_DTYPE, STATE_SPLIT)
    p_f = factors_ptr + factor_offsets(i_r, i_h, H_V, B_T)
    square = o_i[:, None] * B_T + o_i[None, :]
    b_w = tl.load(p_f + square)
    b_m = tl.load(p_f + B_T * B_T + square)
    a_q = tl.load(p_f + 2 * B_T * B_T + o_i)
    a_k = tl.load(p_f + 2 * B_T * B_T + B_T + o_i)
    readout(b_qs, b_ks, a_q, a_k, b_w, b_m, v_ptr, u_ptr, o_ptr, rows, m_i, o_v, i_h, stride_v_n, stride_v_h,
            H_V, D_V, DOT_PRECISION)


@triton.jit(do_not_specialize=["H_V", "H_K", "epoch"])
def tree_verify_chain_kernel(
    q_ptr, k_ptr, v_ptr, state_ptr, state_indices_ptr, offsets_ptr, factors_ptr,
    o_ptr, u_ptr,
    fold_map_ptr, fold_rows_ptr, fold_u_ptr, fold_logp_ptr, fold_k_ptr, fold_k_scale_ptr, fold_committed_ptr, epoch,
    H_V, H_K,
    stride_q_n, stride_q_h, stride_k_n, stride_k_h, stride_v_n, stride_v_h,
    stride_s_slot, stride_s_h, stride_s_v,
    D_K: tl.constexpr, D_V: tl.constexpr, B_T: tl.constexpr, T_P: tl.constexpr, B_K: tl.constexpr,
    B_V: tl.constexpr, FOLD: tl.constexpr = False, B_P: tl.constexpr = 16, N_P: tl.constexpr = 16,
):
    """`tree_verify_stream_kernel` for trees of at most ``T_P`` (<= 8) nodes: every product on fp32 FMAs over the
    tree's ``T_P`` rows (tensor cores would pad them to 16), the fold's over the ``N_P`` rows a pending path can
    have (its tree's depth + 1). The factors come from `head_factors_kernel` (``B_T``-row blocks, read ``T_P``)."""
    i_v = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_r = tl.program_id(2).to(tl.int64)
    i_hk = i_h // (H_V // H_K)
    slot = tl.load(state_indices_ptr + i_r).to(tl.int64)
    bos = tl.load(offsets_ptr + i_r).to(tl.int64)
    num_nodes = tl.load(offsets_ptr + i_r + 1).to(tl.int64) - bos
    o_i = tl.arange(0, T_P)
    m_i = o_i < num_nodes
    rows = bos + o_i
    o_v = i_v * B_V + tl.arange(0, B_V)
    p_state = state_ptr + slot * stride_s_slot + i_h * stride_s_h
    if FOLD:
        rows_p, m_p, weight_p, decay_p, pending = pending_path(
            i_r, i_h, i_hk, fold_map_ptr, fold_rows_ptr, fold_logp_ptr, fold_k_scale_ptr, fold_committed_ptr, epoch,
            H_V, H_K, B_P, N_P)
        b_upw = fold_updates(rows_p, m_p, weight_p, o_v, i_h, fold_u_ptr, H_V, D_V)
    b_qs = tl.zeros([T_P, B_V], dtype=tl.float32)
    b_ks = tl.zeros([T_P, B_V], dtype=tl.float32)
    for i_k in range(0, D_K, B_K):
        o_k = i_k + tl.arange(0, B_K)
        b_s = tl.load(p_state + o_v[:, None] * stride_s_v + o_k[None, :])
        b_q = tl.load(q_ptr + rows[:, None] * stride_q_n + i_hk * stride_q_h + o_k[None, :], mask=m_i[:, None],
                      other=0).to(tl.float32)
        b_k = tl.load(k_ptr + rows[:, None] * stride_k_n + i_hk * stride_k_h + o_k[None, :], mask=m_i[:, None],
                      other=0).to(tl.float32)
        if FOLD:
            b_kp = tl.load(fold_k_ptr + rows_p[:, None] * (H_K * D_K) + i_hk * D_K + o_k[None, :], mask=m_p[:, None],
                           other=0).to(tl.float32)
            b_s = decay_p * b_s + tl.sum(b_upw[:, :, None] * b_kp[None, :, :], axis=1)
            tl.store(p_state + o_v[:, None] * stride_s_v + o_k[None, :], b_s, mask=pending)
        b_qs += tl.sum(b_q[:, None, :] * b_s[None, :, :], axis=2)
        b_ks += tl.sum(b_k[:, None, :] * b_s[None, :, :], axis=2)
    p_f = factors_ptr + factor_offsets(i_r, i_h, H_V, B_T)
    square = o_i[:, None] * B_T + o_i[None, :]
    b_w = tl.load(p_f + square)
    b_m = tl.load(p_f + B_T * B_T + square)
    a_q = tl.load(p_f + 2 * B_T * B_T + o_i)
    a_k = tl.load(p_f + 2 * B_T * B_T + B_T + o_i)
    b_v = tl.load(v_ptr + rows[:, None] * stride_v_n + i_h * stride_v_h + o_v[None, :], mask=m_i[:, None],
                  other=0).to(tl.float32)
    b_r = b_v - a_k[:, None] * b_ks
    b_u = tl.sum(b_w[:, :, None] * b_r[None, :, :], axis=1)
    b_o = a_q[:, None] * b_qs + tl.sum(b_m[:, :, None] * b_r[None, :, :], axis=1)
    tl.store(u_ptr + rows[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :], b_u, mask=m_i[:, None])
    tl.store(o_ptr + rows[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :], b_o.to(o_ptr.dtype.element_ty),
             mask=m_i[:, None])
