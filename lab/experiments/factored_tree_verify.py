"""Experiment (2026-11-29, third session): the factored verifier, a factor kernel then a value kernel.

Not shipped; kept as the record of what `scripts/kernel_lab.py --factored` and `--factored-ablation`
ran (results: factored-*.json beside this file, summary in BENCHMARKS.md). Trees of at most 64 nodes:

1. ``tree_factor_kernel``, one program per (value head, request): ``logP``, the norms, ``G``, ``C``,
   ``W = (I + G)^-1 D_beta`` by level sweeps and ``M = C W``, written to a scratch buffer with the
   row factors ``a_q = P r_q`` and ``a_k = P r_k``;
2. ``tree_value_kernel``, one program per (value tile, value head, request):
   ``R' = V - a_k (K S^T)``, ``U = W R'``, ``O = a_q (Q S^T) + M R'``.

On the H200 it beat the fused kernel by 5-15% at B >= 8 and lost at B <= 2; the value kernel re-reads
q, k, W and M per value tile (L2-bound: 40 us alone at 9B B=16 T=64) and the factor kernel alone took
34 us. Configs with b_k <= 32 and 3+ stages came out wrong (relative error 1.4e-2, deterministic) in
the value kernel under Triton 3.6. The shipped resident kernel (kernels/tree_verify_resident.py) keeps
W and M in registers and streams the value tiles in one program per head instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bole_tune.config import node_block
from bole_tune.kernels.common import (check_verify_inputs, dot_precision, gram_dtype, result_buffers,
                                      token_head_strides)


@triton.jit(do_not_specialize=["H_V", "H_K"])
def tree_factor_kernel(
    # inputs
    q_ptr, k_ptr, g_ptr, beta_ptr,
    # tree topology
    offsets_ptr, dfs_enter_ptr, dfs_exit_ptr, block_depth_ptr,
    # outputs: factors for the value kernel, then what tree_commit keeps
    w_ptr, m_ptr, a_q_ptr, a_k_ptr, logp_ptr, k_out_ptr, k_scale_ptr,
    # scalars and strides
    scale, H_V, H_K,
    stride_q_n, stride_q_h, stride_k_n, stride_k_h,
    stride_g_n, stride_g_h, stride_beta_n, stride_beta_h,
    # sizes and meta-parameters
    D_K: tl.constexpr, B_T: tl.constexpr, B_K: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr, GRAM_DTYPE: tl.constexpr,
):
    i_h = tl.program_id(0).to(tl.int64)
    i_r = tl.program_id(1).to(tl.int64)
    i_hk = i_h // (H_V // H_K)
    bos = tl.load(offsets_ptr + i_r).to(tl.int64)
    num_nodes = tl.load(offsets_ptr + i_r + 1).to(tl.int64) - bos
    # the keys (raw, plus their scale) are kept for the commit by one program per key head
    write_keys = i_h % (H_V // H_K) == 0

    o_i = tl.arange(0, B_T)
    m_i = o_i < num_nodes
    rows = bos + o_i
    enter_i = tl.load(dfs_enter_ptr + rows, mask=m_i, other=-1)
    exit_i = tl.load(dfs_exit_ptr + rows, mask=m_i, other=-2)
    b_beta = tl.load(beta_ptr + rows * stride_beta_n + i_h * stride_beta_h, mask=m_i, other=0).to(tl.float32)
    b_g = tl.load(g_ptr + rows * stride_g_n + i_h * stride_g_h, mask=m_i, other=0).to(tl.float32)

    # Gram matrices and squared norms, one pass over dk
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
                 mask=m_i[:, None] & write_keys)
    if USE_QK_L2NORM:
        r_k = 1.0 / tl.sqrt(ssq_k + 1e-6)
        r_q = scale / tl.sqrt(ssq_q + 1e-6)
    else:
        r_k = tl.full([B_T], 1.0, dtype=tl.float32)
        r_q = tl.full([B_T], scale, dtype=tl.float32)

    # logP over the ancestor mask (j is an ancestor of i, or i, when i's entry lies in j's interval)
    m_anc = (enter_i[None, :] <= enter_i[:, None]) & (enter_i[:, None] <= exit_i[None, :])
    b_logp = tl.sum(tl.where(m_anc, b_g[None, :], 0.0), axis=1)
    decay = tl.exp(tl.where(m_anc, b_logp[:, None] - b_logp[None, :], float("-inf")))
    m_strict = m_anc & (o_i[:, None] != o_i[None, :])
    b_gm = tl.where(m_strict, (b_beta * r_k)[:, None] * decay * r_k[None, :] * b_kk, 0.0)
    b_c = r_q[:, None] * decay * r_k[None, :] * b_qk

    # (I + G)^-1 by level sweeps: after sweep m every row of depth <= m is exact
    eye = (o_i[:, None] == o_i[None, :]).to(tl.float32)
    b_x = eye
    for _ in range(0, tl.load(block_depth_ptr + i_r)):
        b_x = eye - tl.dot(b_gm, b_x, input_precision=DOT_PRECISION)
    b_m = tl.dot(b_c, b_x, input_precision=DOT_PRECISION)

    p_tt = (i_r * H_V + i_h) * (B_T * B_T) + o_i[:, None] * B_T + o_i[None, :]
    tl.store(w_ptr + p_tt, b_x * b_beta[None, :])
    tl.store(m_ptr + p_tt, b_m * b_beta[None, :])
    b_decay = tl.exp(b_logp)
    tl.store(a_q_ptr + rows * H_V + i_h, b_decay * r_q, mask=m_i)
    tl.store(a_k_ptr + rows * H_V + i_h, b_decay * r_k, mask=m_i)
    tl.store(logp_ptr + rows * H_V + i_h, b_logp, mask=m_i)
    tl.store(k_scale_ptr + rows * H_K + i_hk, r_k, mask=m_i & write_keys)


@triton.jit(do_not_specialize=["H_V", "H_K"])
def tree_value_kernel(
    # inputs
    q_ptr, k_ptr, v_ptr, state_ptr, state_indices_ptr, offsets_ptr,
    # factors from tree_factor_kernel
    w_ptr, m_ptr, a_q_ptr, a_k_ptr,
    # outputs
    o_ptr, u_ptr,
    # scalars and strides
    H_V, H_K,
    stride_q_n, stride_q_h, stride_k_n, stride_k_h, stride_v_n, stride_v_h,
    stride_s_slot, stride_s_h, stride_s_v,
    # sizes and meta-parameters
    D_K: tl.constexpr, D_V: tl.constexpr, B_T: tl.constexpr, B_K: tl.constexpr, B_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i_v = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_r = tl.program_id(2).to(tl.int64)
    i_hk = i_h // (H_V // H_K)
    bos = tl.load(offsets_ptr + i_r).to(tl.int64)
    num_nodes = tl.load(offsets_ptr + i_r + 1).to(tl.int64) - bos
    slot = tl.load(state_indices_ptr + i_r).to(tl.int64)

    o_i = tl.arange(0, B_T)
    m_i = o_i < num_nodes
    rows = bos + o_i
    o_v = i_v * B_V + tl.arange(0, B_V)
    p_state = state_ptr + slot * stride_s_slot + i_h * stride_s_h + o_v[:, None] * stride_s_v

    # the only pass over S_pre: Q S_pre^T and K S_pre^T for this value tile
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

    a_q = tl.load(a_q_ptr + rows * H_V + i_h, mask=m_i, other=0)
    a_k = tl.load(a_k_ptr + rows * H_V + i_h, mask=m_i, other=0)
    b_v = tl.load(v_ptr + rows[:, None] * stride_v_n + i_h * stride_v_h + o_v[None, :],
                  mask=m_i[:, None], other=0).to(tl.float32)
    b_r = b_v - a_k[:, None] * b_ks
    p_tt = (i_r * H_V + i_h) * (B_T * B_T) + o_i[:, None] * B_T + o_i[None, :]
    b_w = tl.load(w_ptr + p_tt)
    b_m = tl.load(m_ptr + p_tt)
    b_u = tl.dot(b_w, b_r, input_precision=DOT_PRECISION)
    b_o = tl.dot(b_m, b_r, a_q[:, None] * b_qs, input_precision=DOT_PRECISION)
    tl.store(u_ptr + rows[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :], b_u, mask=m_i[:, None])
    tl.store(o_ptr + rows[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :],
             b_o.to(o_ptr.dtype.element_ty), mask=m_i[:, None])


def factor_warps(b_t: int) -> int:
    """Warps of the factor kernel (4 at 64 rows measured best: 75 us against 84 us with 8 at 9B B=16 T=64)."""
    return {16: 2, 32: 4}.get(b_t, 4)




def tree_verify(q, k, v, g, beta, state, state_indices, tree, scale=None, use_qk_l2norm=True, config=None,
                validate=None, out=None, factor_launch=None, stages="fv"):
    """The factored verifier (trees of at most 64 nodes); ``factor_launch`` overrides the factor kernel's
    warps, ``stages`` ("f", "v" or "fv") launches one kernel alone for timing."""
    shape = check_verify_inputs(q, k, v, g, beta, state, state_indices, tree, scale, validate)
    assert tree.max_tree_size <= 64, "the factored experiment takes trees of at most 64 nodes"
    assert config.fits(shape.dk, shape.dv), f"{config} does not tile dk={shape.dk}, dv={shape.dv}"
    q, sq_n, sq_h = token_head_strides(q)
    k, sk_n, sk_h = token_head_strides(k)
    v, sv_n, sv_h = token_head_strides(v)
    res = result_buffers(shape, q.dtype, q.device, tree, out)
    hv, hk, dk, dv, b = shape.hv, shape.hk, shape.dk, shape.dv, shape.num_requests
    b_t = node_block(tree.max_tree_size)
    block_depth, _ = tree.block_depths(b_t)
    factors = torch.empty((2, b, hv, b_t, b_t), dtype=torch.float32, device=q.device)
    rows = torch.empty((2, shape.num_nodes, hv), dtype=torch.float32, device=q.device)
    precision = dot_precision(q.dtype)
    if "f" in stages:
        tree_factor_kernel[(hv, b)](
            q, k, g, beta, tree.offsets, tree.dfs_enter, tree.dfs_exit, block_depth,
            factors[0], factors[1], rows[0], rows[1], res.log_decay, res.k, res.k_scale,
            shape.scale, hv, hk, sq_n, sq_h, sk_n, sk_h,
            g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
            D_K=dk, B_T=b_t, B_K=min(dk, 64), USE_QK_L2NORM=bool(use_qk_l2norm), DOT_PRECISION=precision,
            GRAM_DTYPE=gram_dtype(q), num_warps=factor_launch or factor_warps(b_t), num_stages=1,
        )
    if "v" in stages:
        tree_value_kernel[(dv // config.b_v, hv, b)](
            q, k, v, state, state_indices, tree.offsets, factors[0], factors[1], rows[0], rows[1],
            res.o, res.u, hv, hk, sq_n, sq_h, sk_n, sk_h, sv_n, sv_h,
            state.stride(0), state.stride(1), state.stride(2),
            D_K=dk, D_V=dv, B_T=b_t, B_K=config.b_k, B_V=config.b_v, DOT_PRECISION=precision,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return res
