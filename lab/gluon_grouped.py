"""Issue 17, B=16 64-node trees: the Gluon resident verify with one program per (key head, request).

`gluon_resident.py --trace` showed where a program's time goes at B=16 (9B heads, 64-node trees; H200, median
program of 21.5 us, two programs an SM, 512 programs in two waves): 5.6 us until its q and k rows are in shared memory,
2.3 the Gram products, 3.3 the factors, 10.7 the state stream and readout of two value tiles. Each value head of a
key head (Qwen3.5: two value heads a key head) reloads the same q and k rows and takes the same Gram products.

Here one program serves all the value heads of a key head for one request (``GROUP`` of them, `H_V / H_K`): q and k
rows are loaded into shared memory once (cp.async, rows past the tree zero-filled), their norms and the raw keys for
the commit written once; then per value head, as `gluon_resident.py`'s kernel with ``prefetch`` and ``coalesce``:
the Gram products from shared memory (retaken: cheaper than holding them), the factors, the level sweeps on fp16
wgmma, the state stream (the next tile loaded one ahead, across heads too) split into two bf16 parts, and the readout,
stored through row-contiguous layouts. The next head's v tiles are requested as soon as this head's are read. At B=16
that is 256 programs: one wave at two programs an SM.

    python3 lab/gluon_grouped.py --compile            # CPU: registers, spills, shared memory for sm_90
    python3 lab/gluon_grouped.py [--json OUT]         # H200: check against float64, time against the shipped kernel
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from bole_tune.kernels.common import LOG_DECAY_FLOOR
from bole_tune.kernels.verify.result import VerifyShape, result_buffers
from bole_tune.shapes import HeadShape

from gluon_resident import (B_T, compile_instance, compile_sm90, dump, gpu_run, layouts, print_table,
                            solve_factors)


@gluon.jit
def grouped_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, state_indices_ptr,
    offsets_ptr, dfs_enter_ptr, dfs_exit_ptr, block_depth_ptr,
    o_ptr, u_ptr, logp_ptr, k_out_ptr, k_scale_ptr, committed_ptr,
    scale, H_V, H_K,
    stride_q_n, stride_q_h, stride_k_n, stride_k_h, stride_v_n, stride_v_h,
    stride_g_n, stride_g_h, stride_beta_n, stride_beta_h,
    stride_s_slot, stride_s_h, stride_s_v,
    D_K: gl.constexpr, D_V: gl.constexpr, B_T: gl.constexpr, B_K: gl.constexpr, B_V: gl.constexpr,
    GROUP: gl.constexpr, G_FLOOR: gl.constexpr, COALESCE: gl.constexpr,
    MMA: gl.constexpr, MMA_V: gl.constexpr, LD: gl.constexpr, LD_S: gl.constexpr, LD_V: gl.constexpr,
    LD_U: gl.constexpr, LD_O: gl.constexpr,
    QK_SHARED: gl.constexpr, X_SHARED: gl.constexpr, S_SHARED: gl.constexpr, R_SHARED: gl.constexpr,
    V_SHARED: gl.constexpr,
    num_warps: gl.constexpr,
):
    NK: gl.constexpr = D_K // B_K
    NV: gl.constexpr = D_V // B_V
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    COL: gl.constexpr = gl.SliceLayout(0, MMA)
    ROW_V: gl.constexpr = gl.SliceLayout(1, MMA_V)

    i_h0 = gl.program_id(0).to(gl.int64) * GROUP  # this program's first value head
    i_r = gl.program_id(1).to(gl.int64)
    i_hk = i_h0 // (H_V // H_K)
    bos = gl.load(offsets_ptr + i_r).to(gl.int64)
    num_nodes = gl.load(offsets_ptr + i_r + 1).to(gl.int64) - bos
    slot = gl.load(state_indices_ptr + i_r).to(gl.int64)
    gl.store(committed_ptr + i_r, 0, mask=i_h0 == 0)
    write_keys = (i_h0 % (H_V // H_K)) == 0

    # the first head's first state tile, then every q and k row and the first head's v rows, all in flight at once
    p_state = state_ptr + slot * stride_s_slot
    o_sv = gl.arange(0, B_V, layout=gl.SliceLayout(1, LD_S))
    o_sk = gl.arange(0, B_K, layout=gl.SliceLayout(0, LD_S))
    s_offsets = o_sv[:, None] * stride_s_v + o_sk[None, :]
    b_s = gl.load(p_state + i_h0 * stride_s_h + s_offsets, eviction_policy="evict_first")

    q_smem = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [NK, B_T, B_K], QK_SHARED)
    k_smem = gl.allocate_shared_memory(k_ptr.dtype.element_ty, [NK, B_T, B_K], QK_SHARED)
    v_smem = gl.allocate_shared_memory(v_ptr.dtype.element_ty, [NV, B_T, B_V], V_SHARED)
    w_smem = gl.allocate_shared_memory(gl.float16, [B_T, B_T], X_SHARED)
    m_smem = gl.allocate_shared_memory(gl.float16, [B_T, B_T], X_SHARED)
    x_smem = gl.allocate_shared_memory(gl.float16, [B_T, B_T], X_SHARED)
    s_smem = gl.allocate_shared_memory(gl.bfloat16, [2, B_V, B_K], S_SHARED)
    r_smem = gl.allocate_shared_memory(gl.float16, [B_T, B_V], R_SHARED)

    o_t = gl.arange(0, B_T, layout=gl.SliceLayout(1, LD))
    m_t = o_t < num_nodes
    p_q = q_ptr + bos * stride_q_n + i_hk * stride_q_h
    p_k = k_ptr + bos * stride_k_n + i_hk * stride_k_h
    for c in gl.static_range(NK):
        o_k = c * B_K + gl.arange(0, B_K, layout=gl.SliceLayout(0, LD))
        async_copy.async_copy_global_to_shared(q_smem.index(c), p_q + o_t[:, None] * stride_q_n + o_k[None, :],
                                               mask=m_t[:, None])
        async_copy.async_copy_global_to_shared(k_smem.index(c), p_k + o_t[:, None] * stride_k_n + o_k[None, :],
                                               mask=m_t[:, None])
    async_copy.commit_group()
    o_tv = gl.arange(0, B_T, layout=gl.SliceLayout(1, LD_V))
    m_tv = (o_tv < num_nodes)[:, None]
    p_v0 = v_ptr + bos * stride_v_n + i_h0 * stride_v_h
    for t in gl.static_range(NV):
        o_vl = t * B_V + gl.arange(0, B_V, layout=gl.SliceLayout(0, LD_V))
        async_copy.async_copy_global_to_shared(v_smem.index(t), p_v0 + o_tv[:, None] * stride_v_n + o_vl[None, :],
                                               mask=m_tv)
    async_copy.commit_group()

    o_i = gl.arange(0, B_T, layout=ROW)
    o_j = gl.arange(0, B_T, layout=COL)
    m_i = o_i < num_nodes
    m_j = o_j < num_nodes

    # q and k: norms (L2-normalised rows) and the raw keys for the commit, once for all the group's heads
    async_copy.wait_group(1)
    gl.thread_barrier()
    ssq_q = gl.zeros([B_T], gl.float32, layout=gl.SliceLayout(1, LD))
    ssq_k = gl.zeros([B_T], gl.float32, layout=gl.SliceLayout(1, LD))
    p_kout = k_out_ptr + bos * (H_K * D_K) + i_hk * D_K
    for c in gl.static_range(NK):
        o_k = c * B_K + gl.arange(0, B_K, layout=gl.SliceLayout(0, LD))
        b_q = q_smem.index(c).load(LD).to(gl.float32)
        b_k = k_smem.index(c).load(LD)
        ssq_q += gl.sum(b_q * b_q, axis=1)
        ssq_k += gl.sum(b_k.to(gl.float32) * b_k.to(gl.float32), axis=1)
        gl.store(p_kout + o_t[:, None] * (H_K * D_K) + o_k[None, :], b_k, mask=m_t[:, None] & write_keys)
    gl.store(k_scale_ptr + (bos + o_i) * H_K + i_hk, 1.0 / gl.sqrt(gl.convert_layout(ssq_k, ROW) + 1e-6),
             mask=m_i & write_keys)
    zeros_t = gl.zeros([B_T, B_T], gl.float32, layout=MMA)
    zeros_v = gl.zeros([B_T, B_V], gl.float32, layout=MMA_V)
    o_iv = gl.arange(0, B_T, layout=ROW_V)
    m_iv = o_iv < num_nodes

    for hh in range(GROUP):  # a loop, not unrolled: unrolled, the heads' live values overlap and spill
        i_h = i_h0 + hh
        # Gram products on bf16 wgmma, from shared memory (retaken per head)
        b_qk = zeros_t
        b_kk = zeros_t
        for c in gl.static_range(NK):
            b_qk = warpgroup_mma(q_smem.index(c), k_smem.index(c).permute((1, 0)), b_qk, is_async=True)
            b_kk = warpgroup_mma(k_smem.index(c), k_smem.index(c).permute((1, 0)), b_kk, is_async=True)
        # the tree (rows i, columns j) and the row scales, worked out again per head: held across heads they spill,
        # so they hang on a zero the compiler cannot see through (an asm statement), which keeps them in the loop
        hz = gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [hh], dtype=gl.int32, is_pure=False, pack=1)
        o_i = gl.arange(0, B_T, layout=ROW) + hz
        o_j = gl.arange(0, B_T, layout=COL) + hz
        m_i = o_i < num_nodes
        m_j = o_j < num_nodes
        enter_i = gl.load(dfs_enter_ptr + bos + o_i, mask=m_i, other=-1)
        enter_j = gl.load(dfs_enter_ptr + bos + o_j, mask=m_j, other=-1)
        exit_j = gl.load(dfs_exit_ptr + bos + o_j, mask=m_j, other=-2)
        m_anc = (enter_j[None, :] <= enter_i[:, None]) & (enter_i[:, None] <= exit_j[None, :])
        ssq_q_h = ssq_q + hz.to(gl.float32)
        ssq_k_h = ssq_k + hz.to(gl.float32)
        r_q_i = scale / gl.sqrt(gl.convert_layout(ssq_q_h, ROW) + 1e-6)
        r_k_i = 1.0 / gl.sqrt(gl.convert_layout(ssq_k_h, ROW) + 1e-6)
        r_k_j = 1.0 / gl.sqrt(gl.convert_layout(ssq_k_h, COL) + 1e-6)
        beta_i = gl.load(beta_ptr + (bos + o_i) * stride_beta_n + i_h * stride_beta_h, mask=m_i, other=0).to(gl.float32)
        beta_j = gl.load(beta_ptr + (bos + o_j) * stride_beta_n + i_h * stride_beta_h, mask=m_j, other=0).to(gl.float32)
        g_j = gl.maximum(gl.load(g_ptr + (bos + o_j) * stride_g_n + i_h * stride_g_h, mask=m_j, other=0).to(gl.float32),
                         G_FLOOR)
        logp_i = gl.sum(gl.where(m_anc, g_j[None, :], 0.0), axis=1)
        logp_j = gl.convert_layout(logp_i, COL)
        decay = gl.exp(gl.where(m_anc, logp_i[:, None] - logp_j[None, :], float("-inf")))
        b_qk, b_kk = warpgroup_mma_wait(num_outstanding=0, deps=(b_qk, b_kk))
        # the factors W and M into shared memory (after the previous head's readout has read them)
        gl.thread_barrier()
        solve_factors(w_smem, m_smem, x_smem, b_qk, b_kk, m_anc, o_i, o_j, beta_i, beta_j, r_q_i, r_k_i, r_k_j,
                      decay, block_depth_ptr + i_r, zeros_t)
        b_decay = gl.exp(logp_i)
        gl.store(logp_ptr + (bos + o_i) * H_V + i_h, logp_i, mask=m_i)
        a_q = gl.convert_layout(b_decay * r_q_i, ROW_V)
        a_k = gl.convert_layout(b_decay * r_k_i, ROW_V)

        # the state stream, per value tile Q S^T and K S^T on the two bf16 parts of S, then the readout
        p_u = u_ptr + bos * (H_V * D_V) + i_h * D_V
        p_o = o_ptr + bos * (H_V * D_V) + i_h * D_V
        for t in gl.static_range(NV):
            b_qs = zeros_v
            b_ks = zeros_v
            for c in gl.static_range(NK):
                # the next tile of the stream (this head's, else the next head's first) requested before this one's
                # products; past the group's last tile, a reload of this head's first (unused)
                if c + 1 < NK:
                    nxt = p_state + i_h * stride_s_h + t * B_V * stride_s_v + (c + 1) * B_K
                elif t + 1 < NV:
                    nxt = p_state + i_h * stride_s_h + (t + 1) * B_V * stride_s_v
                else:
                    nxt = p_state + (i_h + (hh + 1 < GROUP).to(gl.int64)) * stride_s_h
                b_s_next = gl.load(nxt + s_offsets, eviction_policy="evict_first")
                b_hi = b_s.to(gl.bfloat16)
                b_lo = (b_s - b_hi.to(gl.float32)).to(gl.bfloat16)
                gl.thread_barrier()
                s_smem.index(0).store(b_hi)
                s_smem.index(1).store(b_lo)
                fence_async_shared()
                gl.thread_barrier()
                b_qs = warpgroup_mma(q_smem.index(c), s_smem.index(0).permute((1, 0)), b_qs, is_async=True)
                b_qs = warpgroup_mma(q_smem.index(c), s_smem.index(1).permute((1, 0)), b_qs, is_async=True)
                b_ks = warpgroup_mma(k_smem.index(c), s_smem.index(0).permute((1, 0)), b_ks, is_async=True)
                b_ks = warpgroup_mma(k_smem.index(c), s_smem.index(1).permute((1, 0)), b_ks, is_async=True)
                b_qs, b_ks = warpgroup_mma_wait(num_outstanding=0, deps=(b_qs, b_ks))
                b_s = b_s_next
            # readout of this value tile: R' = V - a_k (K S^T), scaled into fp16; U = W R', O = a_q (Q S^T) + M R'
            if t == 0:
                async_copy.wait_group(0)
                gl.thread_barrier()
            b_v = v_smem.index(t).load(MMA_V).to(gl.float32)
            if t == NV - 1:
                # every v tile of this head is read: the next head's are requested into the same buffers (after the
                # group's last head, masked off: no memory read)
                gl.thread_barrier()
                p_vn = v_ptr + bos * stride_v_n + (i_h + 1) * stride_v_h
                m_vn = m_tv & (hh + 1 < GROUP)
                for tn in gl.static_range(NV):
                    o_vl = tn * B_V + gl.arange(0, B_V, layout=gl.SliceLayout(0, LD_V))
                    async_copy.async_copy_global_to_shared(
                        v_smem.index(tn), p_vn + o_tv[:, None] * stride_v_n + o_vl[None, :], mask=m_vn)
                async_copy.commit_group()
            b_r = b_v - a_k[:, None] * b_ks
            r_max = gl.max(gl.max(gl.where(m_iv[:, None], gl.abs(b_r), 0.0), axis=1), axis=0)
            r_scale = gl.where(r_max > 0.0, r_max, 1.0)
            gl.thread_barrier()
            r_smem.store((b_r / r_scale).to(gl.float16))
            fence_async_shared()
            gl.thread_barrier()
            b_u = warpgroup_mma(w_smem, r_smem, zeros_v, use_acc=False, is_async=True)
            b_o = warpgroup_mma(m_smem, r_smem, zeros_v, use_acc=False, is_async=True)
            b_u, b_o = warpgroup_mma_wait(num_outstanding=0, deps=(b_u, b_o))
            b_u = b_u * r_scale
            b_o = b_o * r_scale + a_q[:, None] * b_qs
            if COALESCE:
                # through shared memory into row-contiguous layouts: 16-byte stores, whole rows a warp
                o_iu = gl.arange(0, B_T, layout=gl.SliceLayout(1, LD_U))
                o_vu = t * B_V + gl.arange(0, B_V, layout=gl.SliceLayout(0, LD_U))
                gl.store(p_u + o_iu[:, None] * (H_V * D_V) + o_vu[None, :], gl.convert_layout(b_u, LD_U),
                         mask=(o_iu < num_nodes)[:, None])
                o_io = gl.arange(0, B_T, layout=gl.SliceLayout(1, LD_O))
                o_vo = t * B_V + gl.arange(0, B_V, layout=gl.SliceLayout(0, LD_O))
                gl.store(p_o + o_io[:, None] * (H_V * D_V) + o_vo[None, :],
                         gl.convert_layout(b_o.to(o_ptr.dtype.element_ty), LD_O), mask=(o_io < num_nodes)[:, None])
            else:
                o_vv = t * B_V + gl.arange(0, B_V, layout=gl.SliceLayout(0, MMA_V))
                out_offsets = o_iv[:, None] * (H_V * D_V) + o_vv[None, :]
                gl.store(p_u + out_offsets, b_u, mask=m_iv[:, None])
                gl.store(p_o + out_offsets, b_o.to(o_ptr.dtype.element_ty), mask=m_iv[:, None])


def launch_args(q, k, v, g, beta, state, state_indices, tree, scale=None, b_k: int = 32, b_v: int = 64,
                group: int | None = None, coalesce: bool = True, out=None):
    """(grid, args, meta, result) of one launch; ``group`` value heads a program (default: all of a key head's)."""
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if tree.max_tree_size > B_T:
        raise ValueError(f"tree: the Gluon grouped verify takes trees of at most {B_T} nodes")
    group = hv // hk if group is None else group
    if (hv // hk) % group:
        raise ValueError(f"group: {group} does not divide the {hv // hk} value heads of a key head")
    scale = dk ** -0.5 if scale is None else scale
    shape = VerifyShape(HeadShape(hk=hk, hv=hv, dk=dk, dv=dv), n, tree.num_requests, state.shape[0], scale)
    res = result_buffers(shape, q.dtype, q.device, tree, out)
    block_depth, _ = tree.block_depths(B_T)
    sq, sk, sv, sg, sb, ss = q.stride(), k.stride(), v.stride(), g.stride(), beta.stride(), state.stride()
    args = (q, k, v, g, beta, state, state_indices, tree.offsets, tree.dfs_enter, tree.dfs_exit, block_depth,
            res.o, res.u, res.log_decay, res.k, res.k_scale, res.committed,
            scale, hv, hk, sq[0], sq[1], sk[0], sk[1], sv[0], sv[1], sg[0], sg[1], sb[0], sb[1], ss[0], ss[1], ss[2])
    lay = layouts(q.dtype, b_k, b_v)
    meta = dict(D_K=dk, D_V=dv, B_T=B_T, B_K=b_k, B_V=b_v, GROUP=group, G_FLOOR=LOG_DECAY_FLOOR, COALESCE=coalesce,
                **{name: lay[name] for name in ("MMA", "MMA_V", "LD", "LD_S", "LD_V", "LD_U", "LD_O", "QK_SHARED",
                                                "X_SHARED", "S_SHARED", "R_SHARED", "V_SHARED")},
                num_warps=4)
    return (hv // group, tree.num_requests), args, meta, res


def grouped_verify(q, k, v, g, beta, state, state_indices, tree, scale=None, validate=False, b_k: int = 32,
                   b_v: int = 64, group: int | None = None, coalesce: bool = True, out=None):
    """`tree_verify`'s outputs from the grouped Gluon kernel (the lab's: no checks beyond the tree size)."""
    grid, args, meta, res = launch_args(q, k, v, g, beta, state, state_indices, tree, scale, b_k, b_v, group,
                                        coalesce, out)
    grouped_kernel[grid](*args, **meta)
    return res


CANDIDATES = [
    dict(b_k=32, b_v=64, group=1),
    dict(b_k=32, b_v=64),
    dict(b_k=32, b_v=64, coalesce=False),
    dict(b_k=64, b_v=32),
    dict(b_k=32, b_v=32),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true", help="compile every candidate for sm_90 here and report")
    parser.add_argument("--json")
    parser.add_argument("--batch", type=int, action="append", help="only this batch (repeatable)")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if args.compile:
        tree, x = compile_instance(16)
        for options in CANDIDATES:
            _, launch, meta, _ = launch_args(*x.args(tree)[:8], **options)
            print(options, json.dumps(compile_sm90(grouped_kernel, launch, meta)))
        return
    if not torch.cuda.is_available():
        sys.exit("no GPU here: run --compile, or on the H200")
    rows = gpu_run(args.repeats, args.batch, CANDIDATES, grouped_verify, "grouped", cases=[16, 8, 32])
    dump(rows, args.json)
    print_table(rows, CANDIDATES, "grouped")


if __name__ == "__main__":
    main()
