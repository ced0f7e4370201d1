"""The serial tree verifier of production engines: the baseline Bole replaces.

One program per (value tile, value head, request) walks the request's nodes in order. Each node
reloads its parent's full ``[b_v, dk]`` state from a per-node fp32 snapshot buffer (or the slot, for
a root), applies the delta rule and writes its own snapshot: the parent-to-child chain and the
``[N, Hv, dv, dk]`` snapshot buffer (64 KiB per node and head at dk = dv = 128) are what Bole removes
(docs/math.md §4). It also produces the factors `tree_commit` needs, so both verifiers share one commit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bole_tune.tree import TreeBatch

from ..common import other_cuda_device, token_head_strides, use_triton
from ..reference import verify_closed_form
from .blocks import floored
from .checks import check_verify_inputs
from .result import TreeVerifyResult, result_buffers


@triton.jit
def serial_verify_kernel(
    # inputs
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, state_indices_ptr, offsets_ptr, parents_ptr,
    # outputs and the per-node snapshot buffer
    o_ptr, u_ptr, logp_ptr, k_out_ptr, k_scale_ptr, committed_ptr, snapshot_ptr,
    # scalars and strides
    scale,
    stride_q_n, stride_q_h, stride_k_n, stride_k_h, stride_v_n, stride_v_h,
    stride_g_n, stride_g_h, stride_beta_n, stride_beta_h,
    stride_s_slot, stride_s_h, stride_s_v,
    # sizes and meta-parameters
    H_V: tl.constexpr, H_K: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr, B_V: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
):
    i_v = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_r = tl.program_id(2).to(tl.int64)
    i_hk = i_h // (H_V // H_K)
    bos = tl.load(offsets_ptr + i_r).to(tl.int64)
    num_nodes = tl.load(offsets_ptr + i_r + 1).to(tl.int64) - bos
    slot = tl.load(state_indices_ptr + i_r).to(tl.int64)
    tl.store(committed_ptr + i_r, 0, mask=(i_v == 0) & (i_h == 0))  # a fresh result: nothing committed yet
    write_keys = (i_v == 0) & (i_h % (H_V // H_K) == 0)
    o_v = i_v * B_V + tl.arange(0, B_V)
    o_k = tl.arange(0, D_K)
    tile = o_v[:, None] * D_K + o_k[None, :]
    p_pre = state_ptr + slot * stride_s_slot + i_h * stride_s_h + o_v[:, None] * stride_s_v + o_k[None, :]
    m_all = tl.full([B_V, D_K], 1, dtype=tl.int1)
    for n in range(0, num_nodes):
        row = bos + n
        parent = tl.load(parents_ptr + row).to(tl.int64)
        p_parent = snapshot_ptr + ((bos + parent) * H_V + i_h) * (D_V * D_K) + tile
        is_root = parent < 0
        b_s = tl.load(p_pre, mask=m_all & is_root, other=0) + tl.load(p_parent, mask=m_all & (parent >= 0), other=0)
        logp_parent = tl.load(logp_ptr + (bos + parent) * H_V + i_h, mask=parent >= 0, other=0)
        b_q = tl.load(q_ptr + row * stride_q_n + i_hk * stride_q_h + o_k).to(tl.float32)
        b_k = tl.load(k_ptr + row * stride_k_n + i_hk * stride_k_h + o_k)
        r_k = 1.0
        if USE_QK_L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
            r_k = 1.0 / tl.sqrt(tl.sum(b_k.to(tl.float32) * b_k.to(tl.float32)) + 1e-6)
        b_q = b_q * scale
        b_kn = b_k.to(tl.float32) * r_k
        b_g = floored(tl.load(g_ptr + row * stride_g_n + i_h * stride_g_h).to(tl.float32))
        b_beta = tl.load(beta_ptr + row * stride_beta_n + i_h * stride_beta_h).to(tl.float32)
        b_v = tl.load(v_ptr + row * stride_v_n + i_h * stride_v_h + o_v).to(tl.float32)
        gamma = tl.exp(b_g)
        b_u = b_beta * (b_v - gamma * tl.sum(b_s * b_kn[None, :], axis=1))
        b_s = gamma * b_s + b_u[:, None] * b_kn[None, :]
        b_o = tl.sum(b_s * b_q[None, :], axis=1)
        tl.store(snapshot_ptr + (row * H_V + i_h) * (D_V * D_K) + tile, b_s)
        tl.store(o_ptr + row * (H_V * D_V) + i_h * D_V + o_v, b_o.to(o_ptr.dtype.element_ty))
        tl.store(u_ptr + row * (H_V * D_V) + i_h * D_V + o_v, b_u)
        tl.store(logp_ptr + row * H_V + i_h, logp_parent + b_g)
        tl.store(k_out_ptr + row * (H_K * D_K) + i_hk * D_K + o_k, b_k, mask=write_keys)
        tl.store(k_scale_ptr + row * H_K + i_hk, r_k, mask=write_keys)
        # the next nodes read this snapshot and logP back
        tl.debug_barrier()


def serial_verify(q, k, v, g, beta, state, state_indices, tree: TreeBatch, scale=None, use_qk_l2norm=True,
                  validate: bool | None = None, block_v: int = 16,
                  out: TreeVerifyResult | None = None) -> TreeVerifyResult:
    """Same inputs and result as `tree_verify`, computed the way serial engines do.

    ``block_v`` is the value tile (the engines' serial kernels use 16 or 32 columns per program with
    the whole dk resident).
    """
    if isinstance(q, torch.Tensor) and q.is_cuda and (elsewhere := other_cuda_device(q)) is not None:
        with torch.cuda.device(elsewhere):  # Triton launches on the current device: make it the inputs'
            return serial_verify(q, k, v, g, beta, state, state_indices, tree, scale, use_qk_l2norm, validate,
                                 block_v, out)
    shape = check_verify_inputs(q, k, v, g, beta, state, state_indices, tree, scale, validate)
    if not use_triton(q.device):
        return verify_closed_form(q, k, v, g, beta, state, state_indices, tree, shape.scale, use_qk_l2norm,
                                  validate=False, out=out)
    n, h = shape.num_nodes, shape.heads
    hv, hk, dk, dv = h.hv, h.hk, h.dk, h.dv
    block_v = min(block_v, dv)
    q, sq_n, sq_h = token_head_strides(q)
    k, sk_n, sk_h = token_head_strides(k)
    v, sv_n, sv_h = token_head_strides(v)
    res = result_buffers(shape, q.dtype, q.device, tree, out)
    snapshots = torch.empty(n, hv, dv, dk, dtype=torch.float32, device=v.device)
    grid = (dv // block_v, hv, shape.num_requests)
    serial_verify_kernel[grid](
        q, k, v, g, beta, state, state_indices, tree.offsets, tree.parents,
        res.o, res.u, res.log_decay, res.k, res.k_scale, res.committed, snapshots,
        shape.scale,
        sq_n, sq_h, sk_n, sk_h, sv_n, sv_h,
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        state.stride(0), state.stride(1), state.stride(2),
        H_V=hv, H_K=hk, D_K=dk, D_V=dv, B_V=block_v, USE_QK_L2NORM=bool(use_qk_l2norm),
        num_warps=4,
    )
    return res
