"""The Bole verifier: every node of a proposal tree through one GDN layer, in parallel.

Theorem 1 of the seed (../shared/DESIGN.md §2), fused into one kernel (factor construction and the
value-tiled solve share registers; nothing T x T touches device memory). One program per
(value tile, value head, request) walks its request's nodes in blocks of ``B_T`` rows:

1. a ``b_k``-chunked pass over dk reads ``S_pre`` once and forms ``Q S_pre``, ``K S_pre`` and the
   block's own Gram matrices ``Q K^T``, ``K K^T`` (plus the L2 norms);
2. ``logP`` is summed over the ancestor mask (a node's ancestors are the nodes whose depth-first
   interval contains it);
3. rows of earlier blocks contribute ``-G_ij U_j`` to the right-hand side and ``C_ij U_j`` to the
   output, reading back the ``U_j`` this program already stored;
4. the block's own unit-triangular system ``(I + G_bb) U_b = R_b`` is solved by as many substitution
   sweeps ``U <- R - G U`` as the block's forest is deep (8 for the depth-<=8 trees of drafters, 63
   for a 64-row stretch of a chain). After sweep m every row of depth < m is exact: this is forward
   substitution done level by level, with no powers of G whose entries grow like binomial
   coefficients, so deep chains and strongly correlated keys stay as accurate as shallow trees.
   (The seed's squaring form of the same polynomial was tried on the H200 on 2026-11-29: Triton
   3.6 failed to compile it for 2-warp and 16/32-row configs, and with tf32 products it lost the
   1e-2 bound on nearly equal keys; see BENCHMARKS.md.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bole_tune.config import KernelConfig, node_block
from bole_tune.tree import TreeBatch
from .common import TreeVerifyResult, check_verify_inputs, dot_precision, gram_dtype, result_buffers, token_head_strides, use_triton


# head counts and the block table's width vary per model and batch without changing the code:
# leaving them unspecialised lets one compiled kernel serve every model with the same head sizes
@triton.jit(do_not_specialize=["max_blocks", "H_V", "H_K"])
def tree_factor_kernel(
    # inputs
    q_ptr, k_ptr, g_ptr, beta_ptr,
    # tree topology
    offsets_ptr, dfs_enter_ptr, dfs_exit_ptr, block_depth_ptr,
    # outputs: the block's solve and readout matrices, logP, the key copy and the norm factors
    a_ptr, w_ptr, logp_ptr, k_out_ptr, k_scale_ptr, q_scale_ptr,
    # scalars and strides
    scale, max_blocks, H_V, H_K,
    stride_q_n, stride_q_h, stride_k_n, stride_k_h,
    stride_g_n, stride_g_h, stride_beta_n, stride_beta_h,
    # sizes and meta-parameters
    D_K: tl.constexpr, B_T: tl.constexpr, B_K: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr, GRAM_DTYPE: tl.constexpr,
):
    """Stage 1, one program per (node block, value head, request): ``A_b = (I + G_bb)^-1`` and
    ``W_b = C_bb A_b``, the factors of the block's own rows; nothing here depends on the values."""
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_r = tl.program_id(2).to(tl.int64)
    i_hk = i_h // (H_V // H_K)
    bos = tl.load(offsets_ptr + i_r).to(tl.int64)
    num_nodes = tl.load(offsets_ptr + i_r + 1).to(tl.int64) - bos
    if i_b * B_T < num_nodes:
        # the per-key-head outputs are written by the first value head of each group
        first = (i_h % (H_V // H_K)) == 0
        o_i = i_b * B_T + tl.arange(0, B_T)
        m_i = o_i < num_nodes
        rows = bos + o_i
        enter_i = tl.load(dfs_enter_ptr + rows, mask=m_i, other=-1)
        exit_i = tl.load(dfs_exit_ptr + rows, mask=m_i, other=-2)
        b_beta = tl.load(beta_ptr + rows * stride_beta_n + i_h * stride_beta_h, mask=m_i, other=0).to(tl.float32)

        # the block's Gram matrices and the squared norms, one pass over dk
        b_qk = tl.zeros([B_T, B_T], dtype=tl.float32)
        b_kk = tl.zeros([B_T, B_T], dtype=tl.float32)
        ssq_q = tl.zeros([B_T], dtype=tl.float32)
        ssq_k = tl.zeros([B_T], dtype=tl.float32)
        for i_k in range(0, D_K, B_K):
            o_k = i_k + tl.arange(0, B_K)
            b_q = tl.load(q_ptr + rows[:, None] * stride_q_n + i_hk * stride_q_h + o_k[None, :],
                          mask=m_i[:, None], other=0)
            b_k = tl.load(k_ptr + rows[:, None] * stride_k_n + i_hk * stride_k_h + o_k[None, :],
                          mask=m_i[:, None], other=0)
            b_qk = tl.dot(b_q.to(GRAM_DTYPE), tl.trans(b_k.to(GRAM_DTYPE)), b_qk, input_precision=DOT_PRECISION)
            b_kk = tl.dot(b_k.to(GRAM_DTYPE), tl.trans(b_k.to(GRAM_DTYPE)), b_kk, input_precision=DOT_PRECISION)
            if USE_QK_L2NORM:
                ssq_q += tl.sum(b_q.to(tl.float32) * b_q.to(tl.float32), axis=1)
                ssq_k += tl.sum(b_k.to(tl.float32) * b_k.to(tl.float32), axis=1)
            tl.store(k_out_ptr + rows[:, None] * (H_K * D_K) + i_hk * D_K + o_k[None, :], b_k,
                     mask=m_i[:, None] & first)
        if USE_QK_L2NORM:
            r_k = 1.0 / tl.sqrt(ssq_k + 1e-6)
            r_q = scale / tl.sqrt(ssq_q + 1e-6)
        else:
            r_k = tl.full([B_T], 1.0, dtype=tl.float32)
            r_q = tl.full([B_T], scale, dtype=tl.float32)

        # logP_i: sum of g over the node and its ancestors (all in this or earlier blocks)
        b_logp = tl.zeros([B_T], dtype=tl.float32)
        for j_b in range(0, i_b + 1):
            o_j = j_b * B_T + tl.arange(0, B_T)
            m_j = o_j < num_nodes
            enter_j = tl.load(dfs_enter_ptr + bos + o_j, mask=m_j, other=-1)
            exit_j = tl.load(dfs_exit_ptr + bos + o_j, mask=m_j, other=-2)
            b_g = tl.load(g_ptr + (bos + o_j) * stride_g_n + i_h * stride_g_h, mask=m_j, other=0).to(tl.float32)
            m_anc = (enter_j[None, :] <= enter_i[:, None]) & (enter_i[:, None] <= exit_j[None, :])
            b_logp += tl.sum(tl.where(m_anc, b_g[None, :], 0.0), axis=1)
        tl.store(logp_ptr + rows * H_V + i_h, b_logp, mask=m_i)
        tl.store(k_scale_ptr + rows * H_K + i_hk, r_k, mask=m_i & first)
        tl.store(q_scale_ptr + rows * H_K + i_hk, r_q, mask=m_i & first)

        # X = (I + G)^-1 - I by one substitution sweep per level of the block's forest,
        # X <- -(G + G X): after sweep m every row of depth < m is exact (forward substitution level
        # by level; no powers of G, whose entries grow like binomial coefficients)
        m_anc = (enter_i[None, :] <= enter_i[:, None]) & (enter_i[:, None] <= exit_i[None, :])
        decay_ii = tl.exp(tl.where(m_anc, b_logp[:, None] - b_logp[None, :], float("-inf")))
        o_t = tl.arange(0, B_T)
        p_f = ((i_r * max_blocks + i_b) * H_V + i_h) * (B_T * B_T) + o_t[:, None] * B_T + o_t[None, :]
        # C waits in the output buffer while the sweeps run (fewer live registers)
        tl.store(w_ptr + p_f, r_q[:, None] * decay_ii * r_k[None, :] * b_qk)
        m_strict = m_anc & (o_i[:, None] != o_i[None, :])
        b_g_ii = tl.where(m_strict, (b_beta * r_k)[:, None] * decay_ii * r_k[None, :] * b_kk, 0.0)
        b_x = -b_g_ii
        block_depth = tl.load(block_depth_ptr + i_r * max_blocks + i_b)
        for _ in range(1, block_depth):
            b_x = -tl.dot(b_g_ii, b_x, b_g_ii, input_precision=DOT_PRECISION)
        tl.store(a_ptr + p_f, b_x)
        # W = C (I + X), the readout of the block's own rows
        tl.debug_barrier()
        b_c_ii = tl.load(w_ptr + p_f)
        tl.store(w_ptr + p_f, tl.dot(b_c_ii, b_x, b_c_ii, input_precision=DOT_PRECISION))


@triton.jit(do_not_specialize=["max_blocks", "H_V", "H_K"])
def tree_value_kernel(
    # inputs
    q_ptr, k_ptr, v_ptr, beta_ptr, state_ptr, state_indices_ptr,
    # tree topology
    offsets_ptr, dfs_enter_ptr, dfs_exit_ptr,
    # stage 1's factors
    a_ptr, w_ptr, logp_ptr, k_scale_ptr, q_scale_ptr,
    # outputs
    o_ptr, u_ptr,
    # scalars and strides
    max_blocks, H_V, H_K,
    stride_q_n, stride_q_h, stride_k_n, stride_k_h, stride_v_n, stride_v_h,
    stride_beta_n, stride_beta_h, stride_s_slot, stride_s_h, stride_s_v,
    # sizes and meta-parameters
    D_K: tl.constexpr, D_V: tl.constexpr, B_T: tl.constexpr, B_K: tl.constexpr, B_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr, GRAM_DTYPE: tl.constexpr,
):
    """Stage 2, one program per (value tile, value head, request): the state products, the
    right-hand side, then ``U_b = A_b R_b`` and ``O_b += W_b R_b`` for each node block in order."""
    i_v = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_r = tl.program_id(2).to(tl.int64)
    i_hk = i_h // (H_V // H_K)
    bos = tl.load(offsets_ptr + i_r).to(tl.int64)
    num_nodes = tl.load(offsets_ptr + i_r + 1).to(tl.int64) - bos
    slot = tl.load(state_indices_ptr + i_r).to(tl.int64)

    o_v = i_v * B_V + tl.arange(0, B_V)
    o_t = tl.arange(0, B_T)
    p_state = state_ptr + slot * stride_s_slot + i_h * stride_s_h + o_v[:, None] * stride_s_v

    for i_b in range(0, tl.cdiv(num_nodes, B_T)):
        o_i = i_b * B_T + o_t
        m_i = o_i < num_nodes
        rows = bos + o_i
        b_beta = tl.load(beta_ptr + rows * stride_beta_n + i_h * stride_beta_h, mask=m_i, other=0).to(tl.float32)
        b_logp = tl.load(logp_ptr + rows * H_V + i_h, mask=m_i, other=0)
        r_k = tl.load(k_scale_ptr + rows * H_K + i_hk, mask=m_i, other=0)
        r_q = tl.load(q_scale_ptr + rows * H_K + i_hk, mask=m_i, other=0)

        # the state products Q S_pre and K S_pre, one pass over dk
        b_qs = tl.zeros([B_T, B_V], dtype=tl.float32)
        b_ks = tl.zeros([B_T, B_V], dtype=tl.float32)
        for i_k in range(0, D_K, B_K):
            o_k = i_k + tl.arange(0, B_K)
            b_q = tl.load(q_ptr + rows[:, None] * stride_q_n + i_hk * stride_q_h + o_k[None, :],
                          mask=m_i[:, None], other=0)
            b_k = tl.load(k_ptr + rows[:, None] * stride_k_n + i_hk * stride_k_h + o_k[None, :],
                          mask=m_i[:, None], other=0)
            b_s = tl.load(p_state + o_k[None, :])
            b_qs = tl.dot(b_q.to(tl.float32), tl.trans(b_s), b_qs, input_precision=DOT_PRECISION)
            b_ks = tl.dot(b_k.to(tl.float32), tl.trans(b_s), b_ks, input_precision=DOT_PRECISION)

        b_decay = tl.exp(b_logp)
        b_v = tl.load(v_ptr + rows[:, None] * stride_v_n + i_h * stride_v_h + o_v[None, :],
                      mask=m_i[:, None], other=0).to(tl.float32)
        b_o = (b_decay * r_q)[:, None] * b_qs
        b_r = b_beta[:, None] * (b_v - (b_decay * r_k)[:, None] * b_ks)

        # contributions of the already solved rows of earlier blocks (trees of more than B_T nodes)
        if i_b > 0:
            enter_i = tl.load(dfs_enter_ptr + rows, mask=m_i, other=-1)
            for j_b in range(0, i_b):
                o_j = j_b * B_T + o_t
                rows_j = bos + o_j
                enter_j = tl.load(dfs_enter_ptr + rows_j)
                exit_j = tl.load(dfs_exit_ptr + rows_j)
                logp_j = tl.load(logp_ptr + rows_j * H_V + i_h)
                r_kj = tl.load(k_scale_ptr + rows_j * H_K + i_hk)
                b_qk_ij = tl.zeros([B_T, B_T], dtype=tl.float32)
                b_kk_ij = tl.zeros([B_T, B_T], dtype=tl.float32)
                for i_k in range(0, D_K, B_K):
                    o_k = i_k + tl.arange(0, B_K)
                    b_q = tl.load(q_ptr + rows[:, None] * stride_q_n + i_hk * stride_q_h + o_k[None, :],
                                  mask=m_i[:, None], other=0)
                    b_k = tl.load(k_ptr + rows[:, None] * stride_k_n + i_hk * stride_k_h + o_k[None, :],
                                  mask=m_i[:, None], other=0)
                    b_kj = tl.load(k_ptr + rows_j[:, None] * stride_k_n + i_hk * stride_k_h + o_k[None, :])
                    b_kj = b_kj.to(GRAM_DTYPE)
                    b_qk_ij = tl.dot(b_q.to(GRAM_DTYPE), tl.trans(b_kj), b_qk_ij, input_precision=DOT_PRECISION)
                    b_kk_ij = tl.dot(b_k.to(GRAM_DTYPE), tl.trans(b_kj), b_kk_ij, input_precision=DOT_PRECISION)
                m_anc = (enter_j[None, :] <= enter_i[:, None]) & (enter_i[:, None] <= exit_j[None, :])
                decay_ij = tl.exp(tl.where(m_anc, b_logp[:, None] - logp_j[None, :], float("-inf")))
                b_g_ij = (b_beta * r_k)[:, None] * decay_ij * r_kj[None, :] * b_kk_ij
                b_c_ij = r_q[:, None] * decay_ij * r_kj[None, :] * b_qk_ij
                b_u_j = tl.load(u_ptr + rows_j[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :])
                b_r -= tl.dot(b_g_ij, b_u_j, input_precision=DOT_PRECISION)
                b_o = tl.dot(b_c_ij, b_u_j, b_o, input_precision=DOT_PRECISION)

        # the block's own rows: U_b = (I + X_b) R_b, O_b += C_bb U_b = W_b R_b
        p_f = ((i_r * max_blocks + i_b) * H_V + i_h) * (B_T * B_T) + o_t[:, None] * B_T + o_t[None, :]
        b_x = tl.load(a_ptr + p_f)
        b_w = tl.load(w_ptr + p_f)
        b_u = tl.dot(b_x, b_r, b_r, input_precision=DOT_PRECISION)
        b_o = tl.dot(b_w, b_r, b_o, input_precision=DOT_PRECISION)
        tl.store(u_ptr + rows[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :], b_u, mask=m_i[:, None])
        tl.store(o_ptr + rows[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :],
                 b_o.to(o_ptr.dtype.element_ty), mask=m_i[:, None])
        # later blocks read this block's U back
        tl.debug_barrier()


def factor_launch(b_t: int, dk: int) -> tuple[int, int, int]:
    """(b_k, num_warps, num_stages) of stage 1: a fixed rule (it has no value tiles to tune)."""
    return min(64, dk), (4 if b_t >= 64 else 2), 2


def tree_verify(q, k, v, g, beta, state, state_indices, tree: TreeBatch, scale=None, use_qk_l2norm=True,
                config: KernelConfig | None = None, validate: bool | None = None,
                out: TreeVerifyResult | None = None) -> TreeVerifyResult:
    """Verify every node of ``tree`` through one GDN layer; never writes ``state``.

    Args:
        q, k: ``[N, Hk, dk]``; v: ``[N, Hv, dv]`` (Hv a multiple of Hk); bf16, fp16 or fp32.
        g: ``[N, Hv]`` log-decay (<= 0); beta: ``[N, Hv]`` in [0, 1]; float32 or the inputs' dtype.
        state: ``[num_slots, Hv, dv, dk]`` float32 pool; state_indices: ``[B]`` slot of each request.
        tree: the proposal trees (`TreeBatch`), on the inputs' device.
        scale: multiplies q (default ``dk ** -0.5``); use_qk_l2norm: L2-normalise q and k first.
        config: tile configuration; None takes the tuned one for this GPU and shape.
        validate: check values (NaN gates, slot indices); None follows ``BOLE_TUNE_VALIDATE``.
        out: a `TreeVerifyResult` to write into instead of allocating (buffers reused across layers).

    Returns:
        `TreeVerifyResult`: ``o`` ``[N, Hv, dv]`` in v's dtype and the factors for `tree_commit`.
    """
    shape = check_verify_inputs(q, k, v, g, beta, state, state_indices, tree, scale, validate)
    if not use_triton(q.device):
        from .reference import verify_closed_form
        return verify_closed_form(q, k, v, g, beta, state, state_indices, tree, shape.scale, use_qk_l2norm,
                                  validate=False, out=out)
    if config is None:
        from bole_tune.lookup import config_for
        config = config_for(shape, q.dtype, tree, q.device)
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config: expected a KernelConfig or None, got {type(config).__name__}")
    if not config.fits(shape.dk, shape.dv):
        raise ValueError(f"config: tiles b_k={config.b_k}, b_v={config.b_v} must divide dk={shape.dk}, dv={shape.dv}")
    hv, hk, dk, dv = shape.hv, shape.hk, shape.dk, shape.dv
    q, sq_n, sq_h = token_head_strides(q)
    k, sk_n, sk_h = token_head_strides(k)
    v, sv_n, sv_h = token_head_strides(v)
    res = result_buffers(shape, q.dtype, q.device, tree, out)
    b_t = node_block(tree.max_tree_size)
    block_depth, max_blocks = tree.block_depths(b_t)
    f_b_k, f_warps, f_stages = factor_launch(b_t, dk)
    factors = torch.empty((2, shape.num_requests, max_blocks, hv, b_t, b_t), dtype=torch.float32, device=q.device)
    q_scale = torch.empty((shape.num_nodes, hk), dtype=torch.float32, device=q.device)
    tree_factor_kernel[(max_blocks, hv, shape.num_requests)](
        q, k, g, beta,
        tree.offsets, tree.dfs_enter, tree.dfs_exit, block_depth,
        factors[0], factors[1], res.log_decay, res.k, res.k_scale, q_scale,
        shape.scale, max_blocks, hv, hk,
        sq_n, sq_h, sk_n, sk_h,
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        D_K=dk, B_T=b_t, B_K=f_b_k,
        USE_QK_L2NORM=bool(use_qk_l2norm), DOT_PRECISION=dot_precision(q.dtype), GRAM_DTYPE=gram_dtype(q),
        num_warps=f_warps, num_stages=f_stages,
    )
    tree_value_kernel[(dv // config.b_v, hv, shape.num_requests)](
        q, k, v, beta, state, state_indices,
        tree.offsets, tree.dfs_enter, tree.dfs_exit,
        factors[0], factors[1], res.log_decay, res.k_scale, q_scale,
        res.o, res.u,
        max_blocks, hv, hk,
        sq_n, sq_h, sk_n, sk_h, sv_n, sv_h,
        beta.stride(0), beta.stride(1),
        state.stride(0), state.stride(1), state.stride(2),
        D_K=dk, D_V=dv, B_T=b_t, B_K=config.b_k, B_V=config.b_v,
        DOT_PRECISION=dot_precision(q.dtype), GRAM_DTYPE=gram_dtype(q),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return res
