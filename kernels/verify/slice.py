"""The slice Bole verifier for small trees: one program per (value-row slice, value head, request).

The resident kernel (`resident.py`) computes a head's factors first and only then streams ``S_pre``: the
factors are a chain of dependent steps (tree tables, keys and gates, Gram products, the level sweeps), and
every program of a wave waits through that chain before its first state byte moves. For trees of up to a
few dozen nodes the state, not the solve, is the work: a program here owns ``b_v`` whole rows of one
head's state (``[b_v, dk]``, ``b_v * dk * 4`` bytes) and issues their load first, so the state moves while
the same program works out the factors (docs/math.md §3):

1. ``S = S_pre[rows]``, loaded at once;
2. the factors, as in the resident kernel: ``logP``, the norm scales, ``W = (I + G)^-1 D_beta`` and
   ``M = C W`` (each of a head's ``dv / b_v`` programs computes them; for small trees that is a few
   ``T x T`` products, against ``b_v x dk`` state products);
3. with ``FOLD``, the previous round's accepted path is committed into the slice
   (``P_a S + sum_j w_j u_j k_j^T``, `blocks.fold_tile`) and written back;
4. ``R' = V - a_k (K S^T)``, ``U = W R'``, ``O = a_q (Q S^T) + M R'`` on the slice's ``b_v`` columns.

``b_k`` is the key chunk of the Gram products (step 2); the state products take all of ``dk`` at once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .blocks import ancestry, floored, fold_tile, norm_scales, pending_path, qk_chunk_gram, solve_factors, state_products

SLICE_MAX_NODES = 64
"""The largest tree the slice kernel takes: its node block is the whole tree."""


@triton.jit(do_not_specialize=["H_V", "H_K", "epoch"])
def tree_verify_slice_kernel(
    # inputs
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, state_indices_ptr,
    # tree topology
    offsets_ptr, dfs_enter_ptr, dfs_exit_ptr, block_depth_ptr,
    # outputs
    o_ptr, u_ptr, logp_ptr, k_out_ptr, k_scale_ptr, committed_ptr,
    # the previous round's accepted paths, committed into S_pre first (FOLD; `blocks.pending_path`)
    fold_map_ptr, fold_accepted_ptr, fold_offsets_ptr, fold_enter_ptr, fold_exit_ptr, fold_depth_ptr,
    fold_u_ptr, fold_logp_ptr, fold_k_ptr, fold_k_scale_ptr, fold_committed_ptr, epoch,
    # scalars and strides
    scale, H_V, H_K,
    stride_q_n, stride_q_h, stride_k_n, stride_k_h, stride_v_n, stride_v_h,
    stride_g_n, stride_g_h, stride_beta_n, stride_beta_h,
    stride_s_slot, stride_s_h, stride_s_v,
    # sizes and meta-parameters
    D_K: tl.constexpr, D_V: tl.constexpr, B_T: tl.constexpr, B_K: tl.constexpr, B_V: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr, GRAM_DTYPE: tl.constexpr,
    STATE_SPLIT: tl.constexpr = False, SWEEP_F16: tl.constexpr = False,
    FOLD: tl.constexpr = False, B_TP: tl.constexpr = 16, B_P: tl.constexpr = 16, FOLD_DOT: tl.constexpr = "ieee",
):
    # program (slice * head, request): the slice owns value rows [slice, slice + 1) * B_V of the head
    i_h = tl.program_id(0).to(tl.int64) // (D_V // B_V)
    i_part = tl.program_id(0).to(tl.int64) % (D_V // B_V)
    i_r = tl.program_id(1).to(tl.int64)
    i_hk = i_h // (H_V // H_K)
    slot = tl.load(state_indices_ptr + i_r).to(tl.int64)
    o_v = i_part * B_V + tl.arange(0, B_V)
    o_kk = tl.arange(0, D_K)
    p_state = state_ptr + slot * stride_s_slot + i_h * stride_s_h + o_v[:, None] * stride_s_v + o_kk[None, :]
    # 1. the slice of S_pre, before anything it does not depend on
    b_s = tl.load(p_state)

    bos = tl.load(offsets_ptr + i_r).to(tl.int64)
    num_nodes = tl.load(offsets_ptr + i_r + 1).to(tl.int64) - bos
    tl.store(committed_ptr + i_r, 0, mask=(i_h == 0) & (i_part == 0))  # a fresh result: nothing committed yet
    write_keys = (i_h % (H_V // H_K) == 0) & (i_part == 0)
    o_i = tl.arange(0, B_T)
    m_i = o_i < num_nodes
    rows = bos + o_i
    enter_i = tl.load(dfs_enter_ptr + rows, mask=m_i, other=-1)
    exit_i = tl.load(dfs_exit_ptr + rows, mask=m_i, other=-2)
    b_beta = tl.load(beta_ptr + rows * stride_beta_n + i_h * stride_beta_h, mask=m_i, other=0).to(tl.float32)
    b_g = floored(tl.load(g_ptr + rows * stride_g_n + i_h * stride_g_h, mask=m_i, other=0).to(tl.float32))
    if FOLD:
        rows_p, m_p, weight_p, decay_p, pending = pending_path(
            i_r, i_h, i_hk, fold_map_ptr, fold_accepted_ptr, fold_offsets_ptr, fold_enter_ptr, fold_exit_ptr,
            fold_depth_ptr, fold_logp_ptr, fold_k_scale_ptr, fold_committed_ptr, epoch, H_V, H_K, B_TP, B_P)

    # 2. the factors: Gram matrices, logP, G and C, W = (I + G)^-1 D_beta, M = C W
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
    r_q, r_k = norm_scales(ssq_q, ssq_k, scale, B_T, USE_QK_L2NORM)
    m_anc = ancestry(enter_i, enter_i, exit_i)
    b_logp = tl.sum(tl.where(m_anc, b_g[None, :], 0.0), axis=1)
    b_gm, b_c = solve_factors(m_anc, b_logp, b_logp, b_beta, r_q, r_k, r_k, b_qk, b_kk)
    b_gm = tl.where(m_anc & (o_i[:, None] != o_i[None, :]), b_gm, 0.0)
    eye = (o_i[:, None] == o_i[None, :]).to(tl.float32)
    b_x = eye
    if SWEEP_F16:
        b_g16 = b_gm.to(tl.float16)
        for _ in range(0, tl.load(block_depth_ptr + i_r)):
            b_x = eye - tl.dot(b_g16, b_x.to(tl.float16))
        b_m = tl.dot(b_c.to(tl.float16), b_x.to(tl.float16)) * b_beta[None, :]
    else:
        for _ in range(0, tl.load(block_depth_ptr + i_r)):
            b_x = eye - tl.dot(b_gm, b_x, input_precision=DOT_PRECISION)
        b_m = tl.dot(b_c, b_x, input_precision=DOT_PRECISION) * b_beta[None, :]
    b_w = b_x * b_beta[None, :]
    b_decay = tl.exp(b_logp)
    a_q = b_decay * r_q
    a_k = b_decay * r_k
    tl.store(logp_ptr + rows * H_V + i_h, b_logp, mask=m_i & (i_part == 0))
    tl.store(k_scale_ptr + rows * H_K + i_hk, r_k, mask=m_i & write_keys)

    # 3. the previous round's commit, written back
    if FOLD:
        b_s = fold_tile(b_s, rows_p, m_p, weight_p, decay_p, o_v, o_kk, i_h, i_hk, fold_u_ptr, fold_k_ptr,
                        H_V, H_K, D_K, D_V, FOLD_DOT)
        tl.store(p_state, b_s, mask=pending)

    # 4. the slice's outputs
    b_q = tl.load(q_ptr + rows[:, None] * stride_q_n + i_hk * stride_q_h + o_kk[None, :], mask=m_i[:, None], other=0)
    b_k = tl.load(k_ptr + rows[:, None] * stride_k_n + i_hk * stride_k_h + o_kk[None, :], mask=m_i[:, None], other=0)
    b_qs, b_ks = state_products(b_q, b_k, b_s, tl.zeros([B_T, B_V], dtype=tl.float32),
                                tl.zeros([B_T, B_V], dtype=tl.float32), DOT_PRECISION, GRAM_DTYPE, STATE_SPLIT)
    b_v = tl.load(v_ptr + rows[:, None] * stride_v_n + i_h * stride_v_h + o_v[None, :],
                  mask=m_i[:, None], other=0).to(tl.float32)
    b_r = b_v - a_k[:, None] * b_ks
    b_u = tl.dot(b_w, b_r, input_precision=DOT_PRECISION)
    b_o = tl.dot(b_m, b_r, a_q[:, None] * b_qs, input_precision=DOT_PRECISION)
    tl.store(u_ptr + rows[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :], b_u, mask=m_i[:, None])
    tl.store(o_ptr + rows[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :],
             b_o.to(o_ptr.dtype.element_ty), mask=m_i[:, None])
