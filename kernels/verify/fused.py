"""The fused Bole verifier: any tree size, one program per (value tile, value head, request).

It evaluates the closed form (docs/math.md §2) for ``b_v`` value columns of one head, walking the
request's nodes in blocks of ``B_T`` rows (the planner's node block: the padded tree size, at most 64):

1. a ``b_k``-chunked pass over dk reads ``S_pre`` once and forms ``Q S_pre``, ``K S_pre`` and the
   block's own Gram matrices ``Q K^T``, ``K K^T`` (plus the L2 norms);
2. ``logP`` is summed over the ancestor mask (a node's ancestors are the nodes whose depth-first
   interval contains it);
3. rows of earlier blocks contribute ``-G_ij U_j`` to the right-hand side and ``C_ij U_j`` to the
   output, reading back the ``U_j`` this program already stored;
4. the block's own unit-triangular system ``(I + G_bb) U_b = R_b`` is solved by as many substitution
   sweeps ``U <- R - G U`` as the block's forest is deep (docs/math.md §3): after sweep m every row of
   depth < m is exact, so deep chains and strongly correlated keys stay as accurate as shallow trees.

Nothing ``T x T`` touches device memory. The seed's squaring form of the same polynomial failed to
compile for 2-warp and 16/32-row configs under Triton 3.6 and lost the 1e-2 bound on nearly equal keys
with tf32 products (BENCHMARKS.md, "The fused kernel").
"""

from __future__ import annotations

import triton
import triton.language as tl

from .blocks import (ancestry, floored, fold_apply, fold_updates, norm_scales, pending_corrections, pending_tokens,
                     qk_chunk_gram, solve_factors, state_products)


# head counts and the block table's width vary per model and batch without changing the code:
# leaving them unspecialised lets one compiled kernel serve every model with the same head sizes
@triton.jit(do_not_specialize=["max_blocks", "H_V", "H_K", "fold_word"])
def tree_verify_fused_kernel(
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
    scale, max_blocks, H_V, H_K,
    stride_q_n, stride_q_h, stride_k_n, stride_k_h, stride_v_n, stride_v_h,
    stride_g_n, stride_g_h, stride_beta_n, stride_beta_h,
    stride_s_slot, stride_s_h, stride_s_v,
    # sizes and meta-parameters
    D_K: tl.constexpr, D_V: tl.constexpr, B_T: tl.constexpr, B_K: tl.constexpr, B_V: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr, GRAM_DTYPE: tl.constexpr,
    FOLD: tl.constexpr = False, B_P: tl.constexpr = 16, FOLD_DOT: tl.constexpr = "ieee",
    RING: tl.constexpr = False, CORRECT: tl.constexpr = False, STATE_HINT: tl.constexpr = "",
):
    i_v = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_r = tl.program_id(2).to(tl.int64)
    i_hk = i_h // (H_V // H_K)
    bos = tl.load(offsets_ptr + i_r).to(tl.int64)
    num_nodes = tl.load(offsets_ptr + i_r + 1).to(tl.int64) - bos
    slot = tl.load(state_indices_ptr + i_r).to(tl.int64)
    tl.store(committed_ptr + i_r, 0, mask=(i_v == 0) & (i_h == 0))  # a fresh result: nothing committed yet
    # the keys (raw, plus their scale) are kept for the commit by one program per key head
    write_keys = (i_v == 0) & (i_h % (H_V // H_K) == 0)

    o_v = i_v * B_V + tl.arange(0, B_V)
    p_state = state_ptr + slot * stride_s_slot + i_h * stride_s_h + o_v[:, None] * stride_s_v
    if FOLD:
        rows_p, m_p, weight_p, decay_p, pending = pending_tokens(
            RING, i_r, slot, i_h, i_hk, fold_map_ptr, fold_rows_ptr, fold_logp_ptr, fold_k_scale_ptr, fold_committed_ptr,
            fold_word, H_V, H_K, B_P)
        if not CORRECT:
            b_upw = fold_updates(rows_p, m_p, weight_p, o_v, i_h, fold_u_ptr, H_V, D_V)

    for i_b in range(0, tl.cdiv(num_nodes, B_T)):
        o_i = i_b * B_T + tl.arange(0, B_T)
        m_i = o_i < num_nodes
        rows = bos + o_i
        enter_i = tl.load(dfs_enter_ptr + rows, mask=m_i, other=-1)
        exit_i = tl.load(dfs_exit_ptr + rows, mask=m_i, other=-2)
        b_beta = tl.load(beta_ptr + rows * stride_beta_n + i_h * stride_beta_h, mask=m_i, other=0).to(tl.float32)

        # 1. one pass over dk: state products, the block's Gram matrices, squared norms
        b_qs = tl.zeros([B_T, B_V], dtype=tl.float32)
        b_ks = tl.zeros([B_T, B_V], dtype=tl.float32)
        b_qk = tl.zeros([B_T, B_T], dtype=tl.float32)
        b_kk = tl.zeros([B_T, B_T], dtype=tl.float32)
        ssq_q = tl.zeros([B_T], dtype=tl.float32)
        ssq_k = tl.zeros([B_T], dtype=tl.float32)
        for i_k in range(0, D_K, B_K):
            o_k = i_k + tl.arange(0, B_K)
            b_s = tl.load(p_state + o_k[None, :], eviction_policy=STATE_HINT)
            if FOLD and not CORRECT:  # the first block commits the pending tokens into the tile; later blocks read it
                fold_now = pending & (i_b == 0)
                b_s = fold_apply(b_s, b_upw, rows_p, m_p & fold_now, tl.where(fold_now, decay_p, 1.0), o_k, i_hk,
                                 fold_k_ptr, H_K, D_K, FOLD_DOT)
                tl.store(p_state + o_k[None, :], b_s, mask=fold_now)
            b_q, b_k, b_qk, b_kk, ssq_q, ssq_k = qk_chunk_gram(
                q_ptr, k_ptr, k_out_ptr, rows, m_i, o_k, i_hk, write_keys,
                stride_q_n, stride_q_h, stride_k_n, stride_k_h, H_K, b_qk, b_kk, ssq_q, ssq_k,
                D_K, USE_QK_L2NORM, DOT_PRECISION, GRAM_DTYPE)
            # one tf32 product: the resident kernel's state split was slower here and miscompiled
            b_qs, b_ks = state_products(b_q, b_k, b_s, b_qs, b_ks, DOT_PRECISION, GRAM_DTYPE, False)
        if CORRECT:  # every block reads the state through the pending tokens, which is never written
            b_qs, b_ks = pending_corrections(
                b_qs, b_ks, q_ptr, k_ptr, rows, m_i, i_hk, stride_q_n, stride_q_h, stride_k_n, stride_k_h,
                rows_p, m_p, weight_p, decay_p, o_v, i_h, fold_u_ptr, fold_k_ptr, H_V, H_K, D_K, D_V,
                GRAM_DTYPE, DOT_PRECISION, FOLD_DOT)
        r_q, r_k = norm_scales(ssq_q, ssq_k, scale, B_T, USE_QK_L2NORM)

        # 2. logP_i: sum of g over the node and its ancestors (all in this or earlier blocks)
        b_logp = tl.zeros([B_T], dtype=tl.float32)
        for j_b in range(0, i_b + 1):
            o_j = j_b * B_T + tl.arange(0, B_T)
            m_j = o_j < num_nodes
            enter_j = tl.load(dfs_enter_ptr + bos + o_j, mask=m_j, other=-1)
            exit_j = tl.load(dfs_exit_ptr + bos + o_j, mask=m_j, other=-2)
            b_g = floored(tl.load(g_ptr + (bos + o_j) * stride_g_n + i_h * stride_g_h, mask=m_j, other=0).to(tl.float32))
            b_logp += tl.sum(tl.where(ancestry(enter_i, enter_j, exit_j), b_g[None, :], 0.0), axis=1)

        b_decay = tl.exp(b_logp)
        b_v = tl.load(v_ptr + rows[:, None] * stride_v_n + i_h * stride_v_h + o_v[None, :],
                      mask=m_i[:, None], other=0).to(tl.float32)
        b_o = (b_decay * r_q)[:, None] * b_qs
        b_r = b_beta[:, None] * (b_v - (b_decay * r_k)[:, None] * b_ks)

        # 3. contributions of the already solved rows of earlier blocks
        for j_b in range(0, i_b):
            o_j = j_b * B_T + tl.arange(0, B_T)
            m_j = o_j < num_nodes
            rows_j = bos + o_j
            enter_j = tl.load(dfs_enter_ptr + rows_j, mask=m_j, other=-1)
            exit_j = tl.load(dfs_exit_ptr + rows_j, mask=m_j, other=-2)
            logp_j = tl.load(logp_ptr + rows_j * H_V + i_h, mask=m_j, other=0)
            b_qk_ij = tl.zeros([B_T, B_T], dtype=tl.float32)
            b_kk_ij = tl.zeros([B_T, B_T], dtype=tl.float32)
            ssq_kj = tl.zeros([B_T], dtype=tl.float32)
            for i_k in range(0, D_K, B_K):
                o_k = i_k + tl.arange(0, B_K)
                b_q = tl.load(q_ptr + rows[:, None] * stride_q_n + i_hk * stride_q_h + o_k[None, :],
                              mask=m_i[:, None], other=0)
                b_k = tl.load(k_ptr + rows[:, None] * stride_k_n + i_hk * stride_k_h + o_k[None, :],
                              mask=m_i[:, None], other=0)
                b_kj = tl.load(k_ptr + rows_j[:, None] * stride_k_n + i_hk * stride_k_h + o_k[None, :],
                               mask=m_j[:, None], other=0)
                b_kj = b_kj.to(GRAM_DTYPE)
                b_qk_ij = tl.dot(b_q.to(GRAM_DTYPE), tl.trans(b_kj), b_qk_ij, input_precision=DOT_PRECISION)
                b_kk_ij = tl.dot(b_k.to(GRAM_DTYPE), tl.trans(b_kj), b_kk_ij, input_precision=DOT_PRECISION)
                if USE_QK_L2NORM:
                    ssq_kj += tl.sum(b_kj.to(tl.float32) * b_kj.to(tl.float32), axis=1)
            _, r_kj = norm_scales(ssq_kj, ssq_kj, scale, B_T, USE_QK_L2NORM)
            b_g_ij, b_c_ij = solve_factors(ancestry(enter_i, enter_j, exit_j), b_logp, logp_j, b_beta, r_q, r_k,
                                           r_kj, b_qk_ij, b_kk_ij)
            b_u_j = tl.load(u_ptr + rows_j[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :],
                            mask=m_j[:, None], other=0)
            b_r -= tl.dot(b_g_ij, b_u_j, input_precision=DOT_PRECISION)
            b_o = tl.dot(b_c_ij, b_u_j, b_o, input_precision=DOT_PRECISION)

        # 4. the block's own system, one substitution sweep per level of its forest
        m_anc = ancestry(enter_i, enter_i, exit_i)
        b_g_ii, b_c_ii = solve_factors(m_anc, b_logp, b_logp, b_beta, r_q, r_k, r_k, b_qk, b_kk)
        b_g_ii = tl.where(m_anc & (o_i[:, None] != o_i[None, :]), b_g_ii, 0.0)
        block_depth = tl.load(block_depth_ptr + i_r * max_blocks + i_b)
        b_u = b_r
        for _ in range(0, block_depth):
            b_u = b_r - tl.dot(b_g_ii, b_u, input_precision=DOT_PRECISION)
        b_o = tl.dot(b_c_ii, b_u, b_o, input_precision=DOT_PRECISION)

        tl.store(u_ptr + rows[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :], b_u, mask=m_i[:, None])
        tl.store(o_ptr + rows[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :],
                 b_o.to(o_ptr.dtype.element_ty), mask=m_i[:, None])
        tl.store(logp_ptr + rows * H_V + i_h, b_logp, mask=m_i)
        tl.store(k_scale_ptr + rows * H_K + i_hk, r_k, mask=m_i & write_keys)
        # later blocks read this block's U and logP back
        tl.debug_barrier()
