"""The resident Bole verifier for trees of at most 64 nodes: one program per (value head, request).

The fused kernel (`fused.py`) gives each of a head's ``dv / b_v`` programs its own copy of the
factor work and runs the substitution sweeps on ``[T, b_v]`` value tiles; at 64 nodes its 8-warp
programs need every register of an SM. Here the work is split where the math splits
(docs/math.md §3), inside one program per head:

1. the factors, once: ``logP``, the norms, ``G`` and ``C``, then

       W = (I + G)^-1 D_beta          (level sweeps X <- I - G X on T x T, one per tree level)
       M = C (I + G)^-1 D_beta        (the readout of the solved rows)

   and the row factors ``a_q = P r_q``, ``a_k = P r_k`` (decay times norm scale). ``W`` and ``M`` are
   exact blocks of the inverse, never powers of ``G``. With ``SWEEP_F16`` (the planner's choice: 16-bit
   inputs, L2-normalised keys, trees of depth at most 12) the sweeps and ``C X`` run on fp16 tensor cores;
2. ``S_pre`` streamed one ``b_v``-row value tile at a time, ``b_k`` columns per step, with ``W`` and
   ``M`` kept resident:

       R' = V - a_k (K S_pre^T)      U = W R'      O = a_q (Q S_pre^T) + M R'

   (`blocks.state_products`, with S_pre split in two bf16 parts under ``STATE_SPLIT``).

With ``STATE_FIRST`` (the planner's "stream" variant: one ``b_v`` tile per program, ``V_SPLIT = dv / b_v``) the
order is reversed: the program's state tiles stream first, the Gram products and norms of step 1 taken in the
same key steps as the state products (q and k read once), and the factors are solved after the stream, so the
state's loads do not wait on the factor chain; the readout is the same. With ``ROWS_FIRST`` (run.py's choice for
the folded launch) the state products are taken the other way round, ``S Q^T`` as ``[b_v, b_k] x [b_k, B_T]``: the
state tile, already in registers for the fold, is the left operand with its ``b_v`` rows where the tensor cores
want many rows, and the readout works on ``[b_v, B_T]`` tiles.

The sweeps cost ``T^3`` per head instead of ``T^2 dv`` and nothing ``T x T`` leaves the SM. With one
program per head it needs many heads to fill a GPU, and ``V_SPLIT`` programs share a head's value rows
(each recomputing the factors) where a launch would be too small; the planner decides both
(BENCHMARKS.md, "Choosing the kernel and its switches").
"""

from __future__ import annotations

import triton
import triton.language as tl

from .blocks import (ancestry, floored, fold_apply, fold_updates, norm_scales, pending_corrections, pending_tokens,
                     qk_chunk_gram, solve_factors, stacked_chunk_gram, stacked_corrections, state_products,
                     state_products_rows_first)

RESIDENT_MAX_NODES = 64
"""The largest tree the resident kernel takes: its node block is the whole tree."""


@triton.jit(do_not_specialize=["H_V", "H_K", "fold_word"])
def tree_verify_resident_kernel(
    # inputs
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, state_indices_ptr,
    # tree topology
    offsets_ptr, dfs_enter_ptr, dfs_exit_ptr, block_depth_ptr,
    # outputs
    o_ptr, u_ptr, logp_ptr, k_out_ptr, k_scale_ptr, committed_ptr,
    # the previous round's accepted paths, committed into S_pre first (FOLD; `blocks.pending_path`); with RING the
    # pending tokens of a `PendingRing` (map: its row table, rows: its flags, the rest its arena; `blocks.ring_tokens`);
    # fold_word: the commit's epoch, or the ring table's row length
    fold_map_ptr, fold_rows_ptr, fold_u_ptr, fold_logp_ptr, fold_k_ptr, fold_k_scale_ptr, fold_committed_ptr,
    fold_word,
    # scalars and strides
    scale, H_V, H_K,
    stride_q_n, stride_q_h, stride_k_n, stride_k_h, stride_v_n, stride_v_h,
    stride_g_n, stride_g_h, stride_beta_n, stride_beta_h,
    stride_s_slot, stride_s_h, stride_s_v,
    # sizes and meta-parameters
    D_K: tl.constexpr, D_V: tl.constexpr, B_T: tl.constexpr, B_K: tl.constexpr, B_V: tl.constexpr,
    V_SPLIT: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr, GRAM_DTYPE: tl.constexpr,
    STATE_SPLIT: tl.constexpr = False, SWEEP_F16: tl.constexpr = False, STATE_FIRST: tl.constexpr = False,
    FOLD: tl.constexpr = False, B_P: tl.constexpr = 16, FOLD_DOT: tl.constexpr = "ieee",
    ROWS_FIRST: tl.constexpr = False, RING: tl.constexpr = False, CORRECT: tl.constexpr = False,
    CORRECT_FIRST: tl.constexpr = False, STATE_HINT: tl.constexpr = "", STACK: tl.constexpr = False,
):
    # program (V_SPLIT * head + part, request): part streams rows [part, part + 1) * D_V / V_SPLIT
    i_h = tl.program_id(0).to(tl.int64) // V_SPLIT
    i_part = tl.program_id(0).to(tl.int64) % V_SPLIT
    i_r = tl.program_id(1).to(tl.int64)
    i_hk = i_h // (H_V // H_K)
    bos = tl.load(offsets_ptr + i_r).to(tl.int64)
    num_nodes = tl.load(offsets_ptr + i_r + 1).to(tl.int64) - bos
    slot = tl.load(state_indices_ptr + i_r).to(tl.int64)
    tl.store(committed_ptr + i_r, 0, mask=(i_h == 0) & (i_part == 0))  # a fresh result: nothing committed yet
    # one program per key head writes the keys and their scales, the first part of each head logP
    write_keys = (i_h % (H_V // H_K) == 0) & (i_part == 0)

    o_i = tl.arange(0, B_T)
    if STACK:  # row r holds node r % (B_T / 2): its q on the top half of the tile, its k on the bottom half
        tl.static_assert(STATE_FIRST and not STATE_SPLIT, "STACK: the state-first order without the state split")
        is_k = o_i >= B_T // 2
        node_i = o_i % (B_T // 2)
    else:
        node_i = o_i
    m_i = node_i < num_nodes
    rows = bos + node_i
    enter_i = tl.load(dfs_enter_ptr + rows, mask=m_i, other=-1)
    exit_i = tl.load(dfs_exit_ptr + rows, mask=m_i, other=-2)
    b_beta = tl.load(beta_ptr + rows * stride_beta_n + i_h * stride_beta_h, mask=m_i, other=0).to(tl.float32)
    b_g = floored(tl.load(g_ptr + rows * stride_g_n + i_h * stride_g_h, mask=m_i, other=0).to(tl.float32))

    p_state = state_ptr + slot * stride_s_slot + i_h * stride_s_h
    # FOLD: pending tokens, written into the slot as it is read; with CORRECT applied to the products instead
    # (`blocks.pending_corrections`; the slot is not written)
    if FOLD:
        rows_p, m_p, weight_p, decay_p, pending = pending_tokens(
            RING, i_r, slot, i_h, i_hk, fold_map_ptr, fold_rows_ptr, fold_logp_ptr, fold_k_scale_ptr, fold_committed_ptr,
            fold_word, H_V, H_K, B_P)
    b_qk = tl.zeros([B_T, B_T], dtype=tl.float32)
    b_kk = tl.zeros([B_T, B_T], dtype=tl.float32)
    ssq_q = tl.zeros([B_T], dtype=tl.float32)
    ssq_k = tl.zeros([B_T], dtype=tl.float32)
    if STACK:
        # trees of at most B_T / 2 nodes (docs/math.md §3, "Stacked rows"): X = [Q; K] in one B_T-row tile, so the
        # state products, the Gram products, the corrections and the readout are one product each, not two
        o_v = i_part * B_V + tl.arange(0, B_V)
        if ROWS_FIRST:
            b_zs = tl.zeros([B_V, B_T], dtype=tl.float32)
        else:
            b_zs = tl.zeros([B_T, B_V], dtype=tl.float32)
        b_xx = tl.zeros([B_T, B_T], dtype=tl.float32)
        ssq_x = tl.zeros([B_T], dtype=tl.float32)
        if FOLD and not CORRECT:
            b_upw = fold_updates(rows_p, m_p, weight_p, o_v, i_h, fold_u_ptr, H_V, D_V)
        if CORRECT and CORRECT_FIRST:
            b_zs = stacked_corrections(
                b_zs, q_ptr, k_ptr, rows, m_i, is_k, i_hk, stride_q_n, stride_q_h, stride_k_n, stride_k_h,
                rows_p, m_p, weight_p, decay_p, o_v, i_h, fold_u_ptr, fold_k_ptr, H_V, H_K, D_K, D_V,
                GRAM_DTYPE, DOT_PRECISION, FOLD_DOT)
        for i_k in range(0, D_K, B_K):
            o_k = i_k + tl.arange(0, B_K)
            b_s = tl.load(p_state + o_v[:, None] * stride_s_v + o_k[None, :], eviction_policy=STATE_HINT)
            if CORRECT and CORRECT_FIRST:
                b_s = decay_p * b_s
            b_x, b_xx, ssq_x = stacked_chunk_gram(
                q_ptr, k_ptr, k_out_ptr, rows, m_i, is_k, o_k, i_hk, write_keys,
                stride_q_n, stride_q_h, stride_k_n, stride_k_h, H_K, b_xx, ssq_x,
                D_K, USE_QK_L2NORM, DOT_PRECISION, GRAM_DTYPE)
            if FOLD and not CORRECT:
                b_s = fold_apply(b_s, b_upw, rows_p, m_p, decay_p, o_k, i_hk, fold_k_ptr, H_K, D_K, FOLD_DOT)
                tl.store(p_state + o_v[:, None] * stride_s_v + o_k[None, :], b_s, mask=pending)
            if ROWS_FIRST:
                b_zs = tl.dot(b_s, tl.trans(b_x.to(tl.float32)), b_zs, input_precision=DOT_PRECISION)
            else:
                b_zs = tl.dot(b_x.to(tl.float32), tl.trans(b_s), b_zs, input_precision=DOT_PRECISION)
        if CORRECT and not CORRECT_FIRST:
            b_zs = stacked_corrections(
                b_zs, q_ptr, k_ptr, rows, m_i, is_k, i_hk, stride_q_n, stride_q_h, stride_k_n, stride_k_h,
                rows_p, m_p, weight_p, decay_p, o_v, i_h, fold_u_ptr, fold_k_ptr, H_V, H_K, D_K, D_V,
                GRAM_DTYPE, DOT_PRECISION, FOLD_DOT)
        b_v = value_tile(v_ptr, rows, m_i & is_k, o_v, i_h, stride_v_n, stride_v_h, ROWS_FIRST)
        b_am, c_x = stacked_factors(
            b_xx, ssq_x, is_k, enter_i, exit_i, b_beta, b_g, tl.load(block_depth_ptr + i_r), scale,
            logp_ptr, k_scale_ptr, rows, m_i, i_h, i_hk, i_part, write_keys, H_V, H_K,
            B_T, USE_QK_L2NORM, DOT_PRECISION, SWEEP_F16)
        stacked_readout(b_zs, c_x, is_k, b_am, b_v, u_ptr, o_ptr, rows, m_i, o_v, i_h, H_V, D_V, DOT_PRECISION,
                        ROWS_FIRST)
    elif STATE_FIRST:
        # one value tile per program (B_V = D_V / V_SPLIT): S_pre's stream starts at once, the Gram products ride
        # along in the same key steps (q and k read once), and the factors follow the stream
        # (ROWS_FIRST: the products as ``S Q^T``, ``[b_v, B_T]`` tiles, the state tile the left operand)
        o_v = i_part * B_V + tl.arange(0, B_V)
        if ROWS_FIRST:
            b_qs = tl.zeros([B_V, B_T], dtype=tl.float32)
            b_ks = tl.zeros([B_V, B_T], dtype=tl.float32)
        else:
            b_qs = tl.zeros([B_T, B_V], dtype=tl.float32)
            b_ks = tl.zeros([B_T, B_V], dtype=tl.float32)
        if FOLD and not CORRECT:
            b_upw = fold_updates(rows_p, m_p, weight_p, o_v, i_h, fold_u_ptr, H_V, D_V)
        if CORRECT and CORRECT_FIRST:  # the corrections start the products; the stream then reads P S, not S
            b_qs, b_ks = pending_corrections(
                b_qs, b_ks, q_ptr, k_ptr, rows, m_i, i_hk, stride_q_n, stride_q_h, stride_k_n, stride_k_h,
                rows_p, m_p, weight_p, decay_p, o_v, i_h, fold_u_ptr, fold_k_ptr, H_V, H_K, D_K, D_V,
                GRAM_DTYPE, DOT_PRECISION, FOLD_DOT)
        for i_k in range(0, D_K, B_K):
            o_k = i_k + tl.arange(0, B_K)
            b_s = tl.load(p_state + o_v[:, None] * stride_s_v + o_k[None, :], eviction_policy=STATE_HINT)
            if CORRECT and CORRECT_FIRST:
                b_s = decay_p * b_s
            b_q, b_k, b_qk, b_kk, ssq_q, ssq_k = qk_chunk_gram(
                q_ptr, k_ptr, k_out_ptr, rows, m_i, o_k, i_hk, write_keys,
                stride_q_n, stride_q_h, stride_k_n, stride_k_h, H_K, b_qk, b_kk, ssq_q, ssq_k,
                D_K, USE_QK_L2NORM, DOT_PRECISION, GRAM_DTYPE)
            if FOLD and not CORRECT:
                b_s = fold_apply(b_s, b_upw, rows_p, m_p, decay_p, o_k, i_hk, fold_k_ptr, H_K, D_K, FOLD_DOT)
                tl.store(p_state + o_v[:, None] * stride_s_v + o_k[None, :], b_s, mask=pending)
            if ROWS_FIRST:
                b_qs, b_ks = state_products_rows_first(b_q, b_k, b_s, b_qs, b_ks, DOT_PRECISION)
            else:
                b_qs, b_ks = state_products(b_q, b_k, b_s, b_qs, b_ks, DOT_PRECISION, GRAM_DTYPE, STATE_SPLIT)
        if CORRECT and not CORRECT_FIRST:  # run.py never pairs CORRECT with ROWS_FIRST
            b_qs, b_ks = pending_corrections(
                b_qs, b_ks, q_ptr, k_ptr, rows, m_i, i_hk, stride_q_n, stride_q_h, stride_k_n, stride_k_h,
                rows_p, m_p, weight_p, decay_p, o_v, i_h, fold_u_ptr, fold_k_ptr, H_V, H_K, D_K, D_V,
                GRAM_DTYPE, DOT_PRECISION, FOLD_DOT)
        # the value rows are requested before the factors, whose chain hides their latency (`lab/v_first.py`)
        b_v = value_tile(v_ptr, rows, m_i, o_v, i_h, stride_v_n, stride_v_h, ROWS_FIRST)
        b_w, b_m, a_q, a_k = head_factors(
            b_qk, b_kk, ssq_q, ssq_k, enter_i, exit_i, b_beta, b_g, tl.load(block_depth_ptr + i_r), scale,
            logp_ptr, k_scale_ptr, rows, m_i, i_h, i_hk, i_part, write_keys, H_V, H_K,
            B_T, USE_QK_L2NORM, DOT_PRECISION, SWEEP_F16)
        if ROWS_FIRST:
            readout_rows_first(b_qs, b_ks, a_q, a_k, b_w, b_m, b_v, u_ptr, o_ptr, rows, m_i, o_v, i_h, H_V, D_V,
                               DOT_PRECISION)
        else:
            readout(b_qs, b_ks, a_q, a_k, b_w, b_m, b_v, u_ptr, o_ptr, rows, m_i, o_v, i_h, H_V, D_V, DOT_PRECISION)
    else:
        # 1. the factors, once per head: Gram matrices, logP, G and C, W = (I + G)^-1 D_beta, M = C W
        for i_k in range(0, D_K, B_K):
            o_k = i_k + tl.arange(0, B_K)
            _, _, b_qk, b_kk, ssq_q, ssq_k = qk_chunk_gram(
                q_ptr, k_ptr, k_out_ptr, rows, m_i, o_k, i_hk, write_keys,
                stride_q_n, stride_q_h, stride_k_n, stride_k_h, H_K, b_qk, b_kk, ssq_q, ssq_k,
                D_K, USE_QK_L2NORM, DOT_PRECISION, GRAM_DTYPE)
        b_w, b_m, a_q, a_k = head_factors(
            b_qk, b_kk, ssq_q, ssq_k, enter_i, exit_i, b_beta, b_g, tl.load(block_depth_ptr + i_r), scale,
            logp_ptr, k_scale_ptr, rows, m_i, i_h, i_hk, i_part, write_keys, H_V, H_K,
            B_T, USE_QK_L2NORM, DOT_PRECISION, SWEEP_F16)
        # 2. stream S_pre one value tile at a time: R' = V - a_k (K S^T), U = W R', O = a_q (Q S^T) + M R'
        # (with FOLD, each tile first becomes the committed state of the previous round, written back)
        for i_v in range(0, D_V // V_SPLIT, B_V):
            o_v = i_part * (D_V // V_SPLIT) + i_v + tl.arange(0, B_V)
            b_qs = tl.zeros([B_T, B_V], dtype=tl.float32)
            b_ks = tl.zeros([B_T, B_V], dtype=tl.float32)
            if FOLD and not CORRECT:
                b_upw = fold_updates(rows_p, m_p, weight_p, o_v, i_h, fold_u_ptr, H_V, D_V)
            for i_k in range(0, D_K, B_K):
                o_k = i_k + tl.arange(0, B_K)
                b_q = tl.load(q_ptr + rows[:, None] * stride_q_n + i_hk * stride_q_h + o_k[None, :],
                              mask=m_i[:, None], other=0)
                b_k = tl.load(k_ptr + rows[:, None] * stride_k_n + i_hk * stride_k_h + o_k[None, :],
                              mask=m_i[:, None], other=0)
                b_s = tl.load(p_state + o_v[:, None] * stride_s_v + o_k[None, :], eviction_policy=STATE_HINT)
                if FOLD and not CORRECT:
                    b_s = fold_apply(b_s, b_upw, rows_p, m_p, decay_p, o_k, i_hk, fold_k_ptr, H_K, D_K, FOLD_DOT)
                    tl.store(p_state + o_v[:, None] * stride_s_v + o_k[None, :], b_s, mask=pending)
                b_qs, b_ks = state_products(b_q, b_k, b_s, b_qs, b_ks, DOT_PRECISION, GRAM_DTYPE, STATE_SPLIT)
            if CORRECT:
                b_qs, b_ks = pending_corrections(
                    b_qs, b_ks, q_ptr, k_ptr, rows, m_i, i_hk, stride_q_n, stride_q_h, stride_k_n, stride_k_h,
                    rows_p, m_p, weight_p, decay_p, o_v, i_h, fold_u_ptr, fold_k_ptr, H_V, H_K, D_K, D_V,
                    GRAM_DTYPE, DOT_PRECISION, FOLD_DOT)
            b_v = value_tile(v_ptr, rows, m_i, o_v, i_h, stride_v_n, stride_v_h, False)
            readout(b_qs, b_ks, a_q, a_k, b_w, b_m, b_v, u_ptr, o_ptr, rows, m_i, o_v, i_h, H_V, D_V, DOT_PRECISION)


@triton.jit
def head_factors(b_qk, b_kk, ssq_q, ssq_k, enter_i, exit_i, b_beta, b_g, num_sweeps, scale,
                 logp_ptr, k_scale_ptr, rows, m_i, i_h, i_hk, i_part, write_keys, H_V, H_K,
                 B_T: tl.constexpr, USE_QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 SWEEP_F16: tl.constexpr):
    """A head's factors from its Gram products (docs/math.md §3): logP, G and C, ``W = (I + G)^-1 D_beta``,
    ``M = C W`` and the row factors ``a_q``, ``a_k``; stores logP (first part) and the key scales (key writer).
    Returns (W, M, a_q, a_k)."""
    o_i = tl.arange(0, B_T)
    r_q, r_k = norm_scales(ssq_q, ssq_k, scale, B_T, USE_QK_L2NORM)
    m_anc = ancestry(enter_i, enter_i, exit_i)
    b_logp = tl.sum(tl.where(m_anc, b_g[None, :], 0.0), axis=1)
    b_gm, b_c = solve_factors(m_anc, b_logp, b_logp, b_beta, r_q, r_k, r_k, b_qk, b_kk)
    b_gm = tl.where(m_anc & (o_i[:, None] != o_i[None, :]), b_gm, 0.0)
    eye = (o_i[:, None] == o_i[None, :]).to(tl.float32)
    b_x = eye
    if SWEEP_F16:
        # fp16 operands: with L2-normalised keys and depth <= 12 every operand entry, partial Neumann
        # sums included, stays far inside fp16's range (docs/math.md §3)
        b_g16 = b_gm.to(tl.float16)
        for _ in range(0, num_sweeps):
            b_x = eye - tl.dot(b_g16, b_x.to(tl.float16))
        b_m = tl.dot(b_c.to(tl.float16), b_x.to(tl.float16)) * b_beta[None, :]
    else:
        for _ in range(0, num_sweeps):
            b_x = eye - tl.dot(b_gm, b_x, input_precision=DOT_PRECISION)
        b_m = tl.dot(b_c, b_x, input_precision=DOT_PRECISION) * b_beta[None, :]
    b_w = b_x * b_beta[None, :]
    b_decay = tl.exp(b_logp)
    tl.store(logp_ptr + rows * H_V + i_h, b_logp, mask=m_i & (i_part == 0))
    tl.store(k_scale_ptr + rows * H_K + i_hk, r_k, mask=m_i & write_keys)
    return b_w, b_m, b_decay * r_q, b_decay * r_k


@triton.jit
def value_tile(v_ptr, rows, m_i, o_v, i_h, stride_v_n, stride_v_h, TRANSPOSED: tl.constexpr):
    """The rows' values on value channels ``o_v``, ``[B_T, b_v]`` (``TRANSPOSED``: ``[b_v, B_T]``, for
    `readout_rows_first`), in the inputs' dtype."""
    if TRANSPOSED:
        return tl.load(v_ptr + rows[None, :] * stride_v_n + i_h * stride_v_h + o_v[:, None], mask=m_i[None, :],
                       other=0)
    else:
        return tl.load(v_ptr + rows[:, None] * stride_v_n + i_h * stride_v_h + o_v[None, :], mask=m_i[:, None],
                       other=0)


@triton.jit
def readout(b_qs, b_ks, a_q, a_k, b_w, b_m, b_v, u_ptr, o_ptr, rows, m_i, o_v, i_h, H_V, D_V: tl.constexpr,
            DOT_PRECISION: tl.constexpr):
    """One value tile's ``R' = V - a_k (K S^T)``, ``U = W R'`` and ``O = a_q (Q S^T) + M R'``, stored (``b_v``: the
    tile's values, `value_tile`)."""
    b_r = b_v.to(tl.float32) - a_k[:, None] * b_ks
    b_u = tl.dot(b_w, b_r, input_precision=DOT_PRECISION)
    b_o = tl.dot(b_m, b_r, a_q[:, None] * b_qs, input_precision=DOT_PRECISION)
    tl.store(u_ptr + rows[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :], b_u, mask=m_i[:, None])
    tl.store(o_ptr + rows[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :],
             b_o.to(o_ptr.dtype.element_ty), mask=m_i[:, None])


@triton.jit
def readout_rows_first(b_qs, b_ks, a_q, a_k, b_w, b_m, b_v, u_ptr, o_ptr, rows, m_i, o_v, i_h, H_V,
                       D_V: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """`readout` on ``[b_v, B_T]`` tiles (``ROWS_FIRST``): ``R'^T = V^T - (K S^T)^T a_k``, ``U^T = R'^T W^T``,
    ``O^T = (Q S^T)^T a_q + R'^T M^T``, stored (``b_v``: `value_tile` transposed)."""
    b_r = b_v.to(tl.float32) - b_ks * a_k[None, :]
    b_u = tl.dot(b_r, tl.trans(b_w), input_precision=DOT_PRECISION)
    b_o = tl.dot(b_r, tl.trans(b_m), b_qs * a_q[None, :], input_precision=DOT_PRECISION)
    tl.store(u_ptr + rows[None, :] * (H_V * D_V) + i_h * D_V + o_v[:, None], b_u, mask=m_i[None, :])
    tl.store(o_ptr + rows[None, :] * (H_V * D_V) + i_h * D_V + o_v[:, None],
             b_o.to(o_ptr.dtype.element_ty), mask=m_i[None, :])


@triton.jit
def stacked_factors(b_xx, ssq, is_k, enter_i, exit_i, b_beta, b_g, num_sweeps, scale,
                    logp_ptr, k_scale_ptr, rows, m_i, i_h, i_hk, i_part, write_keys, H_V, H_K,
                    B_T: tl.constexpr, USE_QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    SWEEP_F16: tl.constexpr):
    """`head_factors` on stacked rows (``STACK``; docs/math.md §3, "Stacked rows"): from the Gram product ``X X^T``
    of ``X = [Q; K]``, the one readout matrix ``A = [[M], [W]]`` (``M`` on the q rows, ``W`` on the k rows, both in
    the k columns) with ``[O; U] = A [0; R'] + [a_q Q S^T; 0]``, and the row factors ``c`` (``a_q`` on the q rows,
    ``-a_k`` on the k rows). ``G`` lives on the k rows' block and ``C`` on the q rows' k columns, so with ``X = (I +
    G)^-1`` (identity on the q rows) the q rows of ``C X D_beta`` are ``M`` and the k rows of ``X D_beta`` are ``W``.
    Stores logP and the key scales as `head_factors`. Returns (A, c)."""
    o_i = tl.arange(0, B_T)
    if USE_QK_L2NORM:
        r_x = tl.where(is_k, 1.0, scale) / tl.sqrt(ssq + 1e-6)
    else:
        r_x = tl.where(is_k, 1.0, scale)
    m_anc = ancestry(enter_i, enter_i, exit_i) & is_k[None, :]  # node j is i or an ancestor, read in the k columns
    b_logp = tl.sum(tl.where(m_anc, b_g[None, :], 0.0), axis=1)
    decay = tl.exp(tl.where(m_anc, b_logp[:, None] - b_logp[None, :], float("-inf")))
    b_f = r_x[:, None] * decay * r_x[None, :] * b_xx
    eye = (o_i[:, None] == o_i[None, :]).to(tl.float32)
    b_gm = tl.where(is_k[:, None] & (o_i[:, None] != o_i[None, :]), b_beta[:, None] * b_f, 0.0)
    b_x = eye
    if SWEEP_F16:  # head_factors' fp16 sweeps on the same entries
        b_g16 = b_gm.to(tl.float16)
        for _ in range(0, num_sweeps):
            b_x = eye - tl.dot(b_g16, b_x.to(tl.float16))
        b_m = tl.dot(b_f.to(tl.float16), b_x.to(tl.float16))
    else:
        for _ in range(0, num_sweeps):
            b_x = eye - tl.dot(b_gm, b_x, input_precision=DOT_PRECISION)
        b_m = tl.dot(b_f, b_x, input_precision=DOT_PRECISION)
    # the q rows of b_f are C (its k rows, discarded here, G without beta); the k rows of X are the solved rows
    b_am = tl.where(is_k[:, None], b_x, b_m) * b_beta[None, :]
    tl.store(logp_ptr + rows * H_V + i_h, b_logp, mask=m_i & is_k & (i_part == 0))
    tl.store(k_scale_ptr + rows * H_K + i_hk, r_x, mask=m_i & is_k & write_keys)
    return b_am, tl.where(is_k, -1.0, 1.0) * tl.exp(b_logp) * r_x


@triton.jit
def stacked_readout(b_zs, c_x, is_k, b_am, b_v, u_ptr, o_ptr, rows, m_i, o_v, i_h, H_V, D_V: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, ROWS_FIRST: tl.constexpr):
    """`readout` on stacked rows: ``R' = V - a_k (K S^T)`` on the k rows, then ``[O; U] = A [0; R'] + [a_q Q S^T; 0]``
    in one product (``a_q Q S^T`` its exact fp32 accumulator), O stored from the q rows and U from the k rows
    (``ROWS_FIRST``: every tile transposed, ``b_zs`` ``[b_v, B_T]``)."""
    if ROWS_FIRST:
        b_zc = b_zs * c_x[None, :]
        b_r = tl.where(is_k[None, :], b_v.to(tl.float32) + b_zc, 0.0)
        b_out = tl.dot(b_r, tl.trans(b_am), tl.where(is_k[None, :], 0.0, b_zc), input_precision=DOT_PRECISION)
        p_out = rows[None, :] * (H_V * D_V) + i_h * D_V + o_v[:, None]
        tl.store(u_ptr + p_out, b_out, mask=(m_i & is_k)[None, :])
        tl.store(o_ptr + p_out, b_out.to(o_ptr.dtype.element_ty), mask=(m_i & ~is_k)[None, :])
    else:
        b_zc = c_x[:, None] * b_zs
        b_r = tl.where(is_k[:, None], b_v.to(tl.float32) + b_zc, 0.0)
        b_out = tl.dot(b_am, b_r, tl.where(is_k[:, None], 0.0, b_zc), input_precision=DOT_PRECISION)
        p_out = rows[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :]
        tl.store(u_ptr + p_out, b_out, mask=(m_i & is_k)[:, None])
        tl.store(o_ptr + p_out, b_out.to(o_ptr.dtype.element_ty), mask=(m_i & ~is_k)[:, None])
