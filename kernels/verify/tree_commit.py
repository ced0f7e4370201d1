"""Commit of the accepted path: one launch writes every request's new state into its slot.

``S_new = P_a S_pre + sum_{j <= a} exp(logP_a - logP_j) u_j k_j^T`` (docs/math.md §4): each
program owns ``v_span`` rows (by default all of them) and ``b_k`` columns of one head's slot and
streams them in ``[b_v, b_k]`` tiles, each read once and written once, ``num_stages`` tiles in
flight. The path to the accepted node ``a`` holds the nodes whose depth-first interval contains
``a``, one per depth; the program gathers them 16 at a time by depth (no walk up the parents), once
for its whole span, so the sum is a dot product over the path alone, not over the whole tree.
On the H200 (9B, B=16) the default 128/16/2 warps/span 128/3 stages took 28.3 us against 41.7 us for
one 32-row tile per program (BENCHMARKS.md, "tree_commit").
"""

from __future__ import annotations

import triton
import triton.language as tl

from bole_tune.config import node_block

from ..common import use_triton
from ..reference import commit_closed_form
from .checks import check_commit_inputs
from .result import TreeVerifyResult


@triton.jit
def tree_commit_kernel(
    # state pool and request metadata
    state_ptr, state_indices_ptr, accepted_ptr, offsets_ptr, dfs_enter_ptr, dfs_exit_ptr, node_depth_ptr,
    # factors from the verification
    u_ptr, logp_ptr, k_ptr, k_scale_ptr,
    # strides
    stride_s_slot, stride_s_h, stride_s_v,
    # sizes and meta-parameters
    H_V: tl.constexpr, H_K: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr,
    B_T: tl.constexpr, B_K: tl.constexpr, B_V: tl.constexpr, V_SPAN: tl.constexpr, B_P: tl.constexpr,
):
    i_tile = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_r = tl.program_id(2).to(tl.int64)
    i_hk = i_h // (H_V // H_K)
    i_span = i_tile // (D_K // B_K)
    i_k = i_tile % (D_K // B_K)
    accepted = tl.load(accepted_ptr + i_r).to(tl.int64)
    bos = tl.load(offsets_ptr + i_r).to(tl.int64)
    num_nodes = tl.load(offsets_ptr + i_r + 1).to(tl.int64) - bos
    # -1 keeps the slot; so does a node out of range, which value checks (off by default) would refuse
    if (accepted >= 0) & (accepted < num_nodes):
        slot = tl.load(state_indices_ptr + i_r).to(tl.int64)
        o_k = i_k * B_K + tl.arange(0, B_K)
        p_slab = state_ptr + slot * stride_s_slot + i_h * stride_s_h + i_span * V_SPAN * stride_s_v + o_k[None, :]
        enter_a = tl.load(dfs_enter_ptr + bos + accepted)
        depth_a = tl.load(node_depth_ptr + bos + accepted)
        logp_a = tl.load(logp_ptr + (bos + accepted) * H_V + i_h)
        # the path holds one node per depth 0..depth_a: gather B_P of them at a time (one gather for
        # the drafters' trees of depth < B_P), then stream this program's V_SPAN rows of the state
        for i_p in range(0, depth_a // B_P + 1):
            o_p = i_p * B_P + tl.arange(0, B_P)
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
            m_p = o_p <= depth_a
            rows = bos + node
            logp_p = tl.load(logp_ptr + rows * H_V + i_h, mask=m_p, other=0)
            scale_p = tl.load(k_scale_ptr + rows * H_K + i_hk, mask=m_p, other=0)
            weight = tl.where(m_p, tl.exp(logp_a - logp_p) * scale_p, 0.0)
            b_k = tl.load(k_ptr + rows[:, None] * (H_K * D_K) + i_hk * D_K + o_k[None, :],
                          mask=m_p[:, None], other=0).to(tl.float32)
            # the first pass decays S_pre; later passes (paths deeper than B_P) add to what it wrote
            decay = tl.where(i_p == 0, tl.exp(logp_a), 1.0)
            for i_c in range(0, V_SPAN // B_V):
                o_c = i_c * B_V + tl.arange(0, B_V)
                o_v = i_span * V_SPAN + o_c
                b_s = tl.load(p_slab + o_c[:, None] * stride_s_v)
                b_u = tl.load(u_ptr + rows[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :],
                              mask=m_p[:, None], other=0)
                b_s = decay * b_s + tl.dot(tl.trans(b_u * weight[:, None]), b_k, input_precision="ieee")
                tl.store(p_slab + o_c[:, None] * stride_s_v, b_s)
            tl.debug_barrier()


def tree_commit(state, state_indices, res: TreeVerifyResult, accepted, validate: bool | None = None,
                b_k: int = 128, b_v: int = 16, num_warps: int = 2, v_span: int = 128, num_stages: int = 3) -> None:
    """Write in place, for each request, the state the recurrence reaches at its accepted node.

    Args:
        state: ``[num_slots, Hv, dv, dk]`` float32 pool (the one verified against).
        state_indices: ``[B]`` slot of each request.
        res: the `TreeVerifyResult` of `tree_verify` or `serial_verify`.
        accepted: ``[B]`` int, local index of each request's last accepted node; -1 leaves its slot as is.
        b_k, b_v, num_warps, v_span, num_stages: the launch (columns and rows per tile, rows per
            program); clipped to dk and dv.
    """
    check_commit_inputs(state, state_indices, res, accepted, validate)
    if not use_triton(state.device):
        commit_closed_form(state, state_indices, res, accepted, validate=False)
        return
    _, hv, dv = res.u.shape
    hk, dk = res.k.shape[1:]
    b_k, b_v = min(b_k, dk), min(b_v, dv)
    v_span = max(b_v, min(v_span, dv))
    for name, value, full in (("b_k", b_k, dk), ("b_v", b_v, v_span), ("v_span", v_span, dv)):
        if not isinstance(value, int) or value < 1 or value & (value - 1) or full % value:
            raise ValueError(f"{name}={value!r}: expected a power of two dividing {full}")
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r}: expected a positive integer")
    tree = res.tree
    grid = ((dv // v_span) * (dk // b_k), hv, tree.num_requests)
    tree_commit_kernel[grid](
        state, state_indices, accepted, tree.offsets, tree.dfs_enter, tree.dfs_exit, tree.node_depth,
        res.u, res.log_decay, res.k, res.k_scale,
        state.stride(0), state.stride(1), state.stride(2),
        H_V=hv, H_K=hk, D_K=dk, D_V=dv, B_T=node_block(tree.max_tree_size), B_K=b_k, B_V=b_v, V_SPAN=v_span, B_P=16,
        num_warps=num_warps, num_stages=num_stages,
    )
