"""Experiment (2026-11-29, sixth session): a resident verifier that computes the outputs only, and a
commit that replays the accepted path.

The shipped resident kernel computes, per value tile, ``R' = V - a_k (K S^T)``, ``U = W R'`` (kept for
the commit) and ``O = a_q (Q S^T) + M R'``. The outputs alone regroup as

    O = (D_aq Q - M D_ak K) S^T + M V = Qt S^T + M V

so a verifier that leaves ``U`` to the commit needs one state product instead of two, no ``W`` and no
``U = W R'`` product, and writes a 16-bit copy of ``v`` (and ``beta``) instead of an fp32 ``U``.
The commit then replays the serial recurrence along the accepted path on each state tile it holds
in registers (``u = beta (v - gamma S^T k)``, ``S <- gamma S + k u^T``): the state is still read once
and written once, and no per-node ``U`` is needed.

Not shipped. On the H200 (`scripts/kernel_lab.py --readout`, `readout-v1.json`, 9B bf16 B=16 T=64) the
verifier took 58.7 us against the shipped 62.7 and the replaying commit 49.0 against 28.7: together slower.
Trees of at most 64 nodes and paths of at most 16 nodes only; no input checks beyond the shipped ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from bole_tune.config import node_block
from bole_tune.kernels.common import check_verify_inputs, dot_precision, gram_dtype, token_head_strides
from bole_tune.tree import TreeBatch


@triton.jit(do_not_specialize=["H_V", "H_K"])
def tree_verify_readout_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, state_indices_ptr,
    offsets_ptr, dfs_enter_ptr, dfs_exit_ptr, block_depth_ptr,
    o_ptr, v_out_ptr, beta_out_ptr, logp_ptr, k_out_ptr, k_scale_ptr,
    scale, H_V, H_K,
    stride_q_n, stride_q_h, stride_k_n, stride_k_h, stride_v_n, stride_v_h,
    stride_g_n, stride_g_h, stride_beta_n, stride_beta_h,
    stride_s_slot, stride_s_h, stride_s_v,
    D_K: tl.constexpr, D_V: tl.constexpr, B_T: tl.constexpr, B_K: tl.constexpr, B_V: tl.constexpr,
    V_SPLIT: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr, GRAM_DTYPE: tl.constexpr,
):
    i_h = tl.program_id(0).to(tl.int64) // V_SPLIT
    i_part = tl.program_id(0).to(tl.int64) % V_SPLIT
    i_r = tl.program_id(1).to(tl.int64)
    i_hk = i_h // (H_V // H_K)
    bos = tl.load(offsets_ptr + i_r).to(tl.int64)
    num_nodes = tl.load(offsets_ptr + i_r + 1).to(tl.int64) - bos
    slot = tl.load(state_indices_ptr + i_r).to(tl.int64)
    write_keys = (i_h % (H_V // H_K) == 0) & (i_part == 0)

    o_i = tl.arange(0, B_T)
    m_i = o_i < num_nodes
    rows = bos + o_i
    enter_i = tl.load(dfs_enter_ptr + rows, mask=m_i, other=-1)
    exit_i = tl.load(dfs_exit_ptr + rows, mask=m_i, other=-2)
    b_beta = tl.load(beta_ptr + rows * stride_beta_n + i_h * stride_beta_h, mask=m_i, other=0).to(tl.float32)
    b_g = tl.load(g_ptr + rows * stride_g_n + i_h * stride_g_h, mask=m_i, other=0).to(tl.float32)

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
    m_anc = (enter_i[None, :] <= enter_i[:, None]) & (enter_i[:, None] <= exit_i[None, :])
    b_logp = tl.sum(tl.where(m_anc, b_g[None, :], 0.0), axis=1)
    decay = tl.exp(tl.where(m_anc, b_logp[:, None] - b_logp[None, :], float("-inf")))
    m_strict = m_anc & (o_i[:, None] != o_i[None, :])
    b_gm = tl.where(m_strict, (b_beta * r_k)[:, None] * decay * r_k[None, :] * b_kk, 0.0)
    b_c = r_q[:, None] * decay * r_k[None, :] * b_qk
    eye = (o_i[:, None] == o_i[None, :]).to(tl.float32)
    b_x = eye
    for _ in range(0, tl.load(block_depth_ptr + i_r)):
        b_x = eye - tl.dot(b_gm, b_x, input_precision=DOT_PRECISION)
    b_m = tl.dot(b_c, b_x, input_precision=DOT_PRECISION) * b_beta[None, :]
    b_decay = tl.exp(b_logp)
    a_q = b_decay * r_q
    a_k = b_decay * r_k
    tl.store(logp_ptr + rows * H_V + i_h, b_logp, mask=m_i & (i_part == 0))
    tl.store(beta_out_ptr + rows * H_V + i_h, b_beta, mask=m_i & (i_part == 0))
    tl.store(k_scale_ptr + rows * H_K + i_hk, r_k, mask=m_i & write_keys)

    # O = Qt S^T + M V with Qt = D_aq Q - M D_ak K
    p_state = state_ptr + slot * stride_s_slot + i_h * stride_s_h
    for i_v in range(0, D_V // V_SPLIT, B_V):
        o_v = i_part * (D_V // V_SPLIT) + i_v + tl.arange(0, B_V)
        b_v = tl.load(v_ptr + rows[:, None] * stride_v_n + i_h * stride_v_h + o_v[None, :],
                      mask=m_i[:, None], other=0)
        tl.store(v_out_ptr + rows[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :], b_v, mask=m_i[:, None])
        b_o = tl.dot(b_m, b_v.to(tl.float32), input_precision=DOT_PRECISION)
        for i_k in range(0, D_K, B_K):
            o_k = i_k + tl.arange(0, B_K)
            b_q = tl.load(q_ptr + rows[:, None] * stride_q_n + i_hk * stride_q_h + o_k[None, :],
                          mask=m_i[:, None], other=0).to(tl.float32)
            b_k = tl.load(k_ptr + rows[:, None] * stride_k_n + i_hk * stride_k_h + o_k[None, :],
                          mask=m_i[:, None], other=0).to(tl.float32)
            b_qt = a_q[:, None] * b_q - tl.dot(b_m, a_k[:, None] * b_k, input_precision=DOT_PRECISION)
            b_s = tl.load(p_state + o_v[:, None] * stride_s_v + o_k[None, :])
            b_o = tl.dot(b_qt, tl.trans(b_s), b_o, input_precision=DOT_PRECISION)
        tl.store(o_ptr + rows[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :],
                 b_o.to(o_ptr.dtype.element_ty), mask=m_i[:, None])


@dataclass
class ReadoutResult:
    o: torch.Tensor
    v: torch.Tensor
    beta: torch.Tensor
    log_decay: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor
    tree: TreeBatch


def tree_verify(q, k, v, g, beta, state, state_indices, tree: TreeBatch, scale=None, use_qk_l2norm=True,
                config=None, validate=False, out=None, v_split: int = 1, maxnreg=None):
    shape = check_verify_inputs(q, k, v, g, beta, state, state_indices, tree, scale, validate)
    if tree.max_tree_size > 64:
        raise ValueError("readout experiment: trees of at most 64 nodes")
    q, sq_n, sq_h = token_head_strides(q)
    k, sk_n, sk_h = token_head_strides(k)
    v, sv_n, sv_h = token_head_strides(v)
    n, hv, hk, dk, dv = shape.num_nodes, shape.hv, shape.hk, shape.dk, shape.dv
    dev = q.device
    res = ReadoutResult(o=torch.empty(n, hv, dv, dtype=q.dtype, device=dev),
                        v=torch.empty(n, hv, dv, dtype=q.dtype, device=dev),
                        beta=torch.empty(n, hv, dtype=torch.float32, device=dev),
                        log_decay=torch.empty(n, hv, dtype=torch.float32, device=dev),
                        k=torch.empty(n, hk, dk, dtype=q.dtype, device=dev),
                        k_scale=torch.empty(n, hk, dtype=torch.float32, device=dev), tree=tree)
    b_t = node_block(tree.max_tree_size)
    block_depth, _ = tree.block_depths(b_t)
    tree_verify_readout_kernel[(hv * v_split, shape.num_requests)](
        q, k, v, g, beta, state, state_indices,
        tree.offsets, tree.dfs_enter, tree.dfs_exit, block_depth,
        res.o, res.v, res.beta, res.log_decay, res.k, res.k_scale,
        shape.scale, hv, hk, sq_n, sq_h, sk_n, sk_h, sv_n, sv_h,
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        state.stride(0), state.stride(1), state.stride(2),
        D_K=dk, D_V=dv, B_T=b_t, B_K=config.b_k, B_V=config.b_v, V_SPLIT=v_split,
        USE_QK_L2NORM=bool(use_qk_l2norm), DOT_PRECISION=dot_precision(q.dtype), GRAM_DTYPE=gram_dtype(q),
        num_warps=config.num_warps, num_stages=config.num_stages,
        **({} if maxnreg is None else {"maxnreg": maxnreg}))
    return res


@triton.jit
def tree_commit_replay_kernel(
    state_ptr, state_indices_ptr, accepted_ptr, offsets_ptr, dfs_enter_ptr, dfs_exit_ptr, node_depth_ptr,
    v_ptr, beta_ptr, logp_ptr, k_ptr, k_scale_ptr,
    stride_s_slot, stride_s_h, stride_s_v,
    H_V: tl.constexpr, H_K: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr,
    B_T: tl.constexpr, B_V: tl.constexpr, V_SPAN: tl.constexpr, B_P: tl.constexpr,
):
    i_span = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_r = tl.program_id(2).to(tl.int64)
    i_hk = i_h // (H_V // H_K)
    accepted = tl.load(accepted_ptr + i_r).to(tl.int64)
    if accepted >= 0:
        bos = tl.load(offsets_ptr + i_r).to(tl.int64)
        slot = tl.load(state_indices_ptr + i_r).to(tl.int64)
        o_k = tl.arange(0, D_K)
        p_slab = state_ptr + slot * stride_s_slot + i_h * stride_s_h + i_span * V_SPAN * stride_s_v + o_k[None, :]
        enter_a = tl.load(dfs_enter_ptr + bos + accepted)
        depth_a = tl.load(node_depth_ptr + bos + accepted)
        # the path, one node per depth (paths of at most B_P nodes in this experiment)
        o_p = tl.arange(0, B_P)
        node = tl.zeros([B_P], dtype=tl.int64)
        for j_b in range(0, accepted // B_T + 1):
            o_j = j_b * B_T + tl.arange(0, B_T)
            m_j = o_j <= accepted
            enter_j = tl.load(dfs_enter_ptr + bos + o_j, mask=m_j, other=0)
            exit_j = tl.load(dfs_exit_ptr + bos + o_j, mask=m_j, other=-1)
            depth_j = tl.load(node_depth_ptr + bos + o_j, mask=m_j, other=-1)
            on_path = m_j & (enter_j <= enter_a) & (enter_a <= exit_j)
            hit = on_path[None, :] & (depth_j[None, :] == o_p[:, None])
            node += tl.sum(tl.where(hit, o_j[None, :], 0), axis=1)
        for i_c in range(0, V_SPAN // B_V):
            o_c = i_c * B_V + tl.arange(0, B_V)
            o_v = i_span * V_SPAN + o_c
            b_s = tl.load(p_slab + o_c[:, None] * stride_s_v)
            logp_prev = 0.0
            for d in range(0, depth_a + 1):
                row = bos + tl.sum(tl.where(o_p == d, node, 0))
                logp_d = tl.load(logp_ptr + row * H_V + i_h)
                beta_d = tl.load(beta_ptr + row * H_V + i_h)
                gamma = tl.exp(logp_d - logp_prev)
                b_k = tl.load(k_ptr + row * (H_K * D_K) + i_hk * D_K + o_k).to(tl.float32) * \
                    tl.load(k_scale_ptr + row * H_K + i_hk)
                b_vd = tl.load(v_ptr + row * (H_V * D_V) + i_h * D_V + o_v).to(tl.float32)
                b_s = gamma * b_s
                b_u = beta_d * (b_vd - tl.sum(b_s * b_k[None, :], axis=1))
                b_s += b_u[:, None] * b_k[None, :]
                logp_prev = logp_d
            tl.store(p_slab + o_c[:, None] * stride_s_v, b_s)


def tree_commit(state, state_indices, res: ReadoutResult, accepted, validate=False, b_v: int = 16,
                num_warps: int = 2, v_span: int = 128, num_stages: int = 3):
    tree = res.tree
    _, hv, dv = res.v.shape
    hk, dk = res.k.shape[1:]
    b_v, v_span = min(b_v, dv), min(v_span, dv)
    grid = (dv // v_span, hv, tree.num_requests)
    tree_commit_replay_kernel[grid](
        state, state_indices, accepted, tree.offsets, tree.dfs_enter, tree.dfs_exit, tree.node_depth,
        res.v, res.beta, res.log_decay, res.k, res.k_scale,
        state.stride(0), state.stride(1), state.stride(2),
        H_V=hv, H_K=hk, D_K=dk, D_V=dv, B_T=node_block(tree.max_tree_size), B_V=b_v, V_SPAN=v_span, B_P=16,
        num_warps=num_warps, num_stages=num_stages)
