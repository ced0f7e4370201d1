"""Issue 17, B=16 64-node trees: the resident verify written in Gluon, its factors kept in shared memory.

The shipped resident kernel (`kernels/verify/resident.py`) holds a head's 64 x 64 factors ``W`` and ``M`` in registers
through its whole state stream: every tile compiles to 253-255 registers a thread, two 4-warp programs an SM, and the
B=16 launch's 512 programs run in two waves of about 28 us each (B=8 29.5 us, B=16 57.1, B=32 110.2: time scales
with waves). Triton's ``tl.dot`` decides where its operands live; Gluon lets a kernel say it. Here, in one 4-warp
program per (value head, request), as the resident kernel's order (docs/math.md §3):

- q and k rows of the tree go to shared memory once (bf16, ``[D_K / B_K, 64, B_K]``) and feed every wgmma from there:
  the Gram products ``Q K^T`` and ``K K^T``, and the state products ``Q S^T`` and ``K S^T`` of every value tile;
- the factors as the resident kernel's: ``logP``, the norms, ``G`` and ``C``; ``X = (I + G)^-1`` by level sweeps on
  fp16 wgmma (``X`` through shared memory, ``G`` from registers), ``M = C X D_beta`` and ``W = X D_beta``, both
  stored to shared memory as fp16 (the A operands of the readout) and dropped from registers;
- ``S_pre`` streamed one ``[B_V, B_K]`` tile at a time (the next tile's load issued before the current tile's
  products), split into two bf16 parts (``hi``, ``lo``: the shipped state split) in shared memory;
- per value tile ``R' = V - a_k (K S^T)``, scaled by its largest magnitude into fp16 in shared memory, then
  ``U = W R'`` and ``O = a_q (Q S^T) + M R'`` on fp16 wgmma (fp16 keeps tf32's 11 significant bits; the scale keeps
  it in range).

What it answers: with the factors out of the registers, how many programs share an SM (`--compile` reports registers
and shared memory, compiled for sm_90 without a GPU) and whether that makes B=16 a single wave. Outputs are checked
against the float64 reference (and the committed state of every request's deepest node) before anything is timed.

    python3 lab/gluon_resident.py --compile [--b-v 64 --b-k 32]    # CPU: registers, spills, shared memory
    python3 lab/gluon_resident.py [--json OUT] [--repeats 30]      # H200: check, then time against the shipped
    python3 lab/gluon_resident.py --ablate | --trace | --fold      # H200, B=16: parts left out (timed only), each
                                                                   # program's phases, the commit folded in
    python3 lab/gluon_resident.py --ring [--quick] | --warps8 | --l2 [--batch B]  # H200: a ring's rounds, 8 warps,
                                                                   # the next wave's inputs in L2
    python3 lab/gluon_resident.py --real-ring [--batch 4]          # a real ring's rounds (H200: Gluon; CPU: shipped)

Later options (twentieth session): ``prefetch`` (every q, k and v row of the tree requested at once by cp.async,
rows past the tree zero-filled), ``coalesce`` (u and o stored through row-contiguous layouts), ``ablate`` / ``pad``
(`ABLATIONS`, for timing only), ``trace`` (global-timer stamps per phase) and ``fold`` (the previous round's accepted
paths applied to each state tile on wgmma, the pool written in place).
Twenty-first session: ``ring`` (a ring read round: pending tokens' corrections ``exp(L) S x + sum_j w_j (k_j . x) u_j``
on wgmma, nothing written; ``ring_async`` brings their keys and updates by cp.async and opens each value tile's
accumulation with them), ``fold`` of such tokens as one path (a ring's write round), `ring_run` (``--ring``: both
checked against float64 on synthetic tokens, `ring_tokens` / `ring_state`, and timed), ``warps`` 8 (``--warps8``) and
``l2_ahead`` (``--l2``: each program prefetches into L2 the inputs of the program that many launch positions later).

Twenty-second session: the fold's options (``fold_store``: how its tiles are written, by TMA among them;
``fold_async``, ``fold_ahead``, ``fold_smem``, ``fold_late``, ``fold_parts``; ``fold_w``: its weights given, a ring's
write round of several rounds), `ring_sequences` (a ring's rounds timed back to back), `alternating`, and
``--real-ring``: consecutive rounds of a shipped `PendingRing` on real tables (`ring_tables`, `real_ring_rounds`),
the Gluon read and write rounds checked against float64 each round on the H200, the shipped kernels (and the tables
against the shipped ring's states) on the CPU.

Only 16-bit inputs with L2-normalised q and k on trees of at most 64 nodes and depth at most 12 (the shipped planner's
fp16-sweep conditions).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from bole_tune.kernels.common import LOG_DECAY_FLOOR
from bole_tune.kernels.verify.gluon import _blocked, bf16_parts, fold_operands, table_rows
from bole_tune.kernels.verify.gluon import compile_sm90 as shipped_compile_sm90
from bole_tune.kernels.verify.result import VerifyShape, result_buffers
from bole_tune.shapes import HeadShape

B_T = 64
HEADS_9B = HeadShape(hk=16, hv=32, dk=128, dv=128)


@gluon.jit
def gluon_resident_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, state_indices_ptr,
    offsets_ptr, dfs_enter_ptr, dfs_exit_ptr, block_depth_ptr,
    o_ptr, u_ptr, logp_ptr, k_out_ptr, k_scale_ptr, committed_ptr, s_desc, trace_ptr,
    path_rows_ptr, prev_u_ptr, prev_k_ptr, prev_k_scale_ptr, prev_logp_ptr, ring_w_ptr, ring_decay_ptr,
    scale, H_V, H_K, n_programs,
    stride_q_n, stride_q_h, stride_k_n, stride_k_h, stride_v_n, stride_v_h,
    stride_g_n, stride_g_h, stride_beta_n, stride_beta_h,
    stride_s_slot, stride_s_h, stride_s_v,
    D_K: gl.constexpr, D_V: gl.constexpr, B_T: gl.constexpr, B_K: gl.constexpr, B_V: gl.constexpr,
    G_FLOOR: gl.constexpr, ALIAS_R: gl.constexpr, ROWS: gl.constexpr, TMA_STAGES: gl.constexpr,
    S32_SHARED: gl.constexpr, ABLATE: gl.constexpr, PAD: gl.constexpr,
    PREFETCH: gl.constexpr, COALESCE: gl.constexpr, LD_V: gl.constexpr, LD_U: gl.constexpr, LD_O: gl.constexpr,
    V_SHARED: gl.constexpr, TRACE: gl.constexpr, FOLD: gl.constexpr, B_P: gl.constexpr, LD_P: gl.constexpr,
    KP_SHARED: gl.constexpr, RING: gl.constexpr, RING_ASYNC: gl.constexpr, MMA_P: gl.constexpr, DP_SHARED: gl.constexpr,
    UP_SHARED: gl.constexpr, LD_UP: gl.constexpr, LD_KP: gl.constexpr, L2_AHEAD: gl.constexpr, LD_L2: gl.constexpr,
    FOLD_STORE: gl.constexpr, LD_SC: gl.constexpr, FOLD_ASYNC: gl.constexpr, FOLD_AHEAD: gl.constexpr,
    FOLD_SMEM: gl.constexpr, FOLD_PARTS: gl.constexpr, UPT_SHARED: gl.constexpr, FOLD_LATE: gl.constexpr,
    FOLD_W: gl.constexpr,
    MMA: gl.constexpr, MMA_V: gl.constexpr, LD: gl.constexpr, LD_S: gl.constexpr,
    QK_SHARED: gl.constexpr, X_SHARED: gl.constexpr, S_SHARED: gl.constexpr, R_SHARED: gl.constexpr,
    num_warps: gl.constexpr,
):
    NK: gl.constexpr = D_K // B_K
    NV: gl.constexpr = D_V // B_V
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    COL: gl.constexpr = gl.SliceLayout(0, MMA)
    ROW_V: gl.constexpr = gl.SliceLayout(1, MMA_V)
    COL_V: gl.constexpr = gl.SliceLayout(0, MMA_V)

    i_h = gl.program_id(0).to(gl.int64)
    i_r = gl.program_id(1).to(gl.int64)
    p_trace = trace_ptr + (i_r * H_V + i_h) * 8
    stamp(p_trace, 0, i_r, TRACE)
    if TRACE:
        gl.store(p_trace + 7, gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,l", [i_r], dtype=gl.int32,
                                                        is_pure=False, pack=1).to(gl.int64))
    group = H_V // H_K
    i_hk = i_h // group
    bos = gl.load(offsets_ptr + i_r).to(gl.int64)
    num_nodes = gl.load(offsets_ptr + i_r + 1).to(gl.int64) - bos
    slot = gl.load(state_indices_ptr + i_r).to(gl.int64)
    gl.store(committed_ptr + i_r, 0, mask=i_h == 0)
    write_keys = (i_h % group) == 0
    if PAD > 0:
        # shared memory held for the whole program (read back at the end), so that `--ablate` runs keep two programs
        # an SM whatever they leave out
        pad = gl.allocate_shared_memory(gl.int32, [PAD, 1024], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        PAD_LD: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        pad.index(0).store(gl.zeros([1024], gl.int32, layout=PAD_LD))

    # the first state tile is requested before anything else: its latency hides behind the factors
    p_state = state_ptr + slot * stride_s_slot + i_h * stride_s_h
    o_sv = gl.arange(0, B_V, layout=gl.SliceLayout(1, LD_S))
    o_sk = gl.arange(0, B_K, layout=gl.SliceLayout(0, LD_S))
    s_offsets = o_sv[:, None] * stride_s_v + o_sk[None, :]
    s_row = ((slot * H_V + i_h) * D_V).to(gl.int32)  # the head's first row of the pool's TMA view ([-1, D_K])
    if TMA_STAGES > 0:
        # a ring of TMA_STAGES state tiles in shared memory, the first TMA_STAGES requested now (they arrive while
        # the factors are worked out), each later one as soon as its stage is read
        s_ring = gl.allocate_shared_memory(gl.float32, [TMA_STAGES, B_V, B_K], S32_SHARED)
        s_bars = gl.allocate_shared_memory(gl.int64, [TMA_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(TMA_STAGES):
            mbarrier.init(s_bars.index(i), count=1)
        for i in gl.static_range(TMA_STAGES):
            if i < (D_V // B_V) * (D_K // B_K):
                mbarrier.expect(s_bars.index(i), B_V * B_K * 4)
                tma.async_copy_global_to_shared(s_desc, [s_row + (i // (D_K // B_K)) * B_V, (i % (D_K // B_K)) * B_K],
                                                s_bars.index(i), s_ring.index(i))
        b_s = gl.zeros([B_V, B_K], gl.float32, layout=LD_S)  # unused: every tile comes from the ring
    else:
        s_ring = 0  # unused without the ring (`state_tile`)
        s_bars = 0
        if (ABLATE & 4) != 0:
            b_s = gl.zeros([B_V, B_K], gl.float32, layout=LD_S)
        else:
            b_s = gl.load(p_state + s_offsets, eviction_policy="evict_first")  # int32 offsets from a scalar base

    # q and k rows into shared memory, chunk by chunk; their squared norms; the raw keys for the commit
    q_smem = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [NK, B_T, B_K], QK_SHARED)
    k_smem = gl.allocate_shared_memory(k_ptr.dtype.element_ty, [NK, B_T, B_K], QK_SHARED)
    o_t = gl.arange(0, B_T, layout=gl.SliceLayout(1, LD))
    m_t = o_t < num_nodes
    p_q = q_ptr + bos * stride_q_n + i_hk * stride_q_h
    p_k = k_ptr + bos * stride_k_n + i_hk * stride_k_h
    p_kout = k_out_ptr + bos * (H_K * D_K) + i_hk * D_K
    p_v = v_ptr + bos * stride_v_n + i_h * stride_v_h
    ssq_q = gl.zeros([B_T], gl.float32, layout=gl.SliceLayout(1, LD))
    ssq_k = gl.zeros([B_T], gl.float32, layout=gl.SliceLayout(1, LD))
    if PREFETCH:
        # every q, k and v row of the tree requested at once (cp.async, rows past the tree zero-filled): one memory
        # latency for all of them, the v tiles arriving while the factors and the state stream run
        for c in gl.static_range(NK):
            o_k = c * B_K + gl.arange(0, B_K, layout=gl.SliceLayout(0, LD))
            async_copy.async_copy_global_to_shared(q_smem.index(c), p_q + o_t[:, None] * stride_q_n + o_k[None, :],
                                                   mask=m_t[:, None])
            async_copy.async_copy_global_to_shared(k_smem.index(c), p_k + o_t[:, None] * stride_k_n + o_k[None, :],
                                                   mask=m_t[:, None])
        if RING_ASYNC or (FOLD_ASYNC and not FOLD_LATE):
            # a ring read round's (or a fold's) token keys join the first group
            rows_p, m_p = table_rows(path_rows_ptr + i_r * B_P, B_P, gl.SliceLayout(1, LD_KP))
            kp_smem = gl.allocate_shared_memory(gl.bfloat16, [NK, B_P, B_K], KP_SHARED)
            token_keys(kp_smem, prev_k_ptr + i_hk * D_K, rows_p, m_p, H_K * D_K, B_K, NK, LD_KP, True)
        async_copy.commit_group()
        v_smem = gl.allocate_shared_memory(v_ptr.dtype.element_ty, [NV, B_T, B_V], V_SHARED)
        o_tv = gl.arange(0, B_T, layout=gl.SliceLayout(1, LD_V))
        for t in gl.static_range(NV):
            o_vl = t * B_V + gl.arange(0, B_V, layout=gl.SliceLayout(0, LD_V))
            async_copy.async_copy_global_to_shared(v_smem.index(t), p_v + o_tv[:, None] * stride_v_n + o_vl[None, :],
                                                   mask=(o_tv < num_nodes)[:, None])
        if RING_ASYNC or FOLD_ASYNC:
            # and their fp32 updates, every value tile, the second group
            if FOLD_SMEM:
                # in the bytes of the weighted updates' bf16 parts, which replace them before the stream
                up_parts = gl.allocate_shared_memory(gl.bfloat16, [3 * NV, B_V, B_P], UPT_SHARED)
                u32_smem = up_parts._reinterpret(gl.float32, [NV, B_P, B_V], V_SHARED)
            else:
                u32_smem = gl.allocate_shared_memory(gl.float32, [NV, B_P, B_V], V_SHARED)
            rows_u, m_u = table_rows(path_rows_ptr + i_r * B_P, B_P, gl.SliceLayout(1, LD_UP))
            for t in gl.static_range(NV):
                o_vu = t * B_V + gl.arange(0, B_V, layout=gl.SliceLayout(0, LD_UP))
                async_copy.async_copy_global_to_shared(
                    u32_smem.index(t), prev_u_ptr + rows_u[:, None] * (H_V * D_V) + i_h * D_V + o_vu[None, :],
                    mask=m_u[:, None])
        if FOLD_LATE:
            # a fold needs its tokens' keys only in the stream: they join the second group, behind the tree's rows
            rows_p, m_p = table_rows(path_rows_ptr + i_r * B_P, B_P, gl.SliceLayout(1, LD_KP))
            kp_smem = gl.allocate_shared_memory(gl.bfloat16, [NK, B_P, B_K], KP_SHARED)
            token_keys(kp_smem, prev_k_ptr + i_hk * D_K, rows_p, m_p, H_K * D_K, B_K, NK, LD_KP, True)
        async_copy.commit_group()
    else:
        v_smem = 0  # unused: v tiles loaded in the readout
    if FOLD_LATE:
        # the fold's per-token loads (rows, logP, key scales; the path's last logP) issued now, their dependent
        # latencies behind the q/k rows' arrival; the weights and decay are worked out after the q/k rows
        rows_pc, m_pc = table_rows(path_rows_ptr + i_r * B_P, B_P, gl.SliceLayout(0, LD_P))
        logp_pc = gl.load(prev_logp_ptr + rows_pc * H_V + i_h, mask=m_pc, other=0.0)
        scale_pc = gl.load(prev_k_scale_ptr + rows_pc * H_K + i_hk, mask=m_pc, other=0.0)
        row_a = gl.max(gl.where(m_pc, rows_pc, -1), axis=0)
        logp_a = gl.load(prev_logp_ptr + gl.maximum(row_a, 0) * H_V + i_h)
    # the tree's rows (i) and columns (j)
    o_i = gl.arange(0, B_T, layout=ROW)
    o_j = gl.arange(0, B_T, layout=COL)
    m_i = o_i < num_nodes
    m_j = o_j < num_nodes
    enter_i = gl.load(dfs_enter_ptr + bos + o_i, mask=m_i, other=-1)
    enter_j = gl.load(dfs_enter_ptr + bos + o_j, mask=m_j, other=-1)
    exit_j = gl.load(dfs_exit_ptr + bos + o_j, mask=m_j, other=-2)
    beta_i = gl.load(beta_ptr + (bos + o_i) * stride_beta_n + i_h * stride_beta_h, mask=m_i, other=0).to(gl.float32)
    beta_j = gl.load(beta_ptr + (bos + o_j) * stride_beta_n + i_h * stride_beta_h, mask=m_j, other=0).to(gl.float32)
    g_j = gl.maximum(gl.load(g_ptr + (bos + o_j) * stride_g_n + i_h * stride_g_h, mask=m_j, other=0).to(gl.float32),
                     G_FLOOR)
    if PREFETCH:
        async_copy.wait_group(1)
        gl.thread_barrier()
    for c in gl.static_range(NK):
        o_k = c * B_K + gl.arange(0, B_K, layout=gl.SliceLayout(0, LD))
        if PREFETCH:
            b_q = q_smem.index(c).load(LD)
            b_k = k_smem.index(c).load(LD)
        else:
            b_q = gl.load(p_q + o_t[:, None] * stride_q_n + o_k[None, :], mask=m_t[:, None], other=0.0)
            b_k = gl.load(p_k + o_t[:, None] * stride_k_n + o_k[None, :], mask=m_t[:, None], other=0.0)
            q_smem.index(c).store(b_q)
            k_smem.index(c).store(b_k)
        ssq_q += gl.sum(b_q.to(gl.float32) * b_q.to(gl.float32), axis=1)
        ssq_k += gl.sum(b_k.to(gl.float32) * b_k.to(gl.float32), axis=1)
        gl.store(p_kout + o_t[:, None] * (H_K * D_K) + o_k[None, :], b_k, mask=m_t[:, None] & write_keys)
    if FOLD:
        # the previous round's accepted path of this slot (docs/math.md §4): its rows, weights
        # w_j = exp(logP_a - logP_j) * k_scale_j and decay P_a = exp(logP_a) (1 and no rows: nothing pending); its keys
        # to shared memory as the fold's B operand
        if not FOLD_LATE:
            rows_p, m_p = table_rows(path_rows_ptr + i_r * B_P, B_P, gl.SliceLayout(1, LD_P))
            row_a = gl.max(gl.where(m_p, rows_p, -1), axis=0)
            logp_a = gl.load(prev_logp_ptr + gl.maximum(row_a, 0) * H_V + i_h)
            if not FOLD_ASYNC:
                kp_smem = gl.allocate_shared_memory(gl.bfloat16, [NK, B_P, B_K], KP_SHARED)
                token_keys(kp_smem, prev_k_ptr + i_hk * D_K, rows_p, m_p, H_K * D_K, B_K, NK, LD_P, False)
            rows_pc, m_pc = table_rows(path_rows_ptr + i_r * B_P, B_P, gl.SliceLayout(0, LD_P))
            logp_pc = gl.load(prev_logp_ptr + rows_pc * H_V + i_h, mask=m_pc, other=0.0)
            scale_pc = gl.load(prev_k_scale_ptr + rows_pc * H_K + i_hk, mask=m_pc, other=0.0)
        if FOLD_W:
            # a ring's write round: several rounds' paths, their weights and decay given (`ring_tables`)
            weight_pc = gl.load(ring_w_ptr + (i_r * B_P + gl.arange(0, B_P, layout=gl.SliceLayout(0, LD_P))) * H_V + i_h)
            fold_decay = gl.load(ring_decay_ptr + i_r * H_V + i_h)
        else:
            fold_decay = gl.where(row_a >= 0, gl.exp(logp_a), 1.0)
            weight_pc = gl.where(m_pc, gl.exp(logp_a - logp_pc) * scale_pc, 0.0)
    elif RING:
        # a ring read round's pending tokens j (rows of the earlier rounds' results; -1: none): their raw keys to
        # shared memory (the B operand of Q K_p^T and K K_p^T), weights w_j = exp(L - L_j) r_k,j, decay exp(L)
        if not RING_ASYNC:
            rows_p, m_p = table_rows(path_rows_ptr + i_r * B_P, B_P, gl.SliceLayout(1, LD_P))
            kp_smem = gl.allocate_shared_memory(gl.bfloat16, [NK, B_P, B_K], KP_SHARED)
            token_keys(kp_smem, prev_k_ptr + i_hk * D_K, rows_p, m_p, H_K * D_K, B_K, NK, LD_P, False)
        o_pc = gl.arange(0, B_P, layout=gl.SliceLayout(0, MMA_P))
        ring_w = gl.load(ring_w_ptr + (i_r * B_P + o_pc) * H_V + i_h)
        ring_decay = gl.load(ring_decay_ptr + i_r * H_V + i_h)
        fold_decay = 1.0
    else:
        kp_smem = 0
        fold_decay = 1.0
    fence_async_shared()
    gl.thread_barrier()
    if L2_AHEAD > 0:
        # the inputs of the program L2_AHEAD launch positions later (the next wave's on this SM, roughly) requested
        # into L2 while this one works: its q, k and v rows and its state, 128 bytes a prefetch
        l2_ahead(i_r * H_V + i_h + L2_AHEAD, H_V, group, offsets_ptr, state_indices_ptr, q_ptr, k_ptr, v_ptr,
                 state_ptr, stride_q_n, stride_q_h, stride_k_n, stride_k_h, stride_v_n, stride_v_h, stride_s_slot,
                 stride_s_h, n_programs, D_K, D_V, B_T, LD_L2)
    stamp(p_trace, 1, i_r, TRACE)

    # Gram products on bf16 wgmma, from shared memory
    b_qk = gl.zeros([B_T, B_T], gl.float32, layout=MMA)
    b_kk = gl.zeros([B_T, B_T], gl.float32, layout=MMA)
    if (ABLATE & 64) == 0:
        for c in gl.static_range(NK):
            b_qk = warpgroup_mma(q_smem.index(c), k_smem.index(c).permute((1, 0)), b_qk, is_async=True)
            b_kk = warpgroup_mma(k_smem.index(c), k_smem.index(c).permute((1, 0)), b_kk, is_async=True)

    r_q_i = scale / gl.sqrt(gl.convert_layout(ssq_q, ROW) + 1e-6)
    r_k_i = 1.0 / gl.sqrt(gl.convert_layout(ssq_k, ROW) + 1e-6)
    r_k_j = 1.0 / gl.sqrt(gl.convert_layout(ssq_k, COL) + 1e-6)
    m_anc = (enter_j[None, :] <= enter_i[:, None]) & (enter_i[:, None] <= exit_j[None, :])
    logp_i = gl.sum(gl.where(m_anc, g_j[None, :], 0.0), axis=1)
    logp_j = gl.convert_layout(logp_i, COL)
    decay = gl.exp(gl.where(m_anc, logp_i[:, None] - logp_j[None, :], float("-inf")))
    if (ABLATE & 64) == 0:
        b_qk, b_kk = warpgroup_mma_wait(num_outstanding=0, deps=(b_qk, b_kk))
    if RING:
        # D_q = Q K_p^T diag(w), D_k = K K_p^T diag(w) (raw q and k: a_q, a_k scale the rows later), each scaled by
        # its largest magnitude into fp16 in shared memory: the A operands of the corrections D U_p
        b_dq = gl.zeros([B_T, B_P], gl.float32, layout=MMA_P)
        b_dk = gl.zeros([B_T, B_P], gl.float32, layout=MMA_P)
        for c in gl.static_range(NK):
            b_dq = warpgroup_mma(q_smem.index(c), kp_smem.index(c).permute((1, 0)), b_dq, is_async=True)
            b_dk = warpgroup_mma(k_smem.index(c), kp_smem.index(c).permute((1, 0)), b_dk, is_async=True)
        b_dq, b_dk = warpgroup_mma_wait(num_outstanding=0, deps=(b_dq, b_dk))
        b_dq = b_dq * ring_w[None, :]
        b_dk = b_dk * ring_w[None, :]
        ds_q = gl.max(gl.max(gl.abs(b_dq), axis=1), axis=0)
        ds_q = gl.where(ds_q > 0.0, ds_q, 1.0)
        ds_k = gl.max(gl.max(gl.abs(b_dk), axis=1), axis=0)
        ds_k = gl.where(ds_k > 0.0, ds_k, 1.0)
        if RING_ASYNC:  # one scale for both: the corrections share the state products' accumulation chain
            ds_q = gl.maximum(ds_q, ds_k)
            ds_k = ds_q
        dq_smem = gl.allocate_shared_memory(gl.float16, [B_T, B_P], DP_SHARED)
        dk_smem = gl.allocate_shared_memory(gl.float16, [B_T, B_P], DP_SHARED)
        dq_smem.store((b_dq / ds_q).to(gl.float16))
        dk_smem.store((b_dk / ds_k).to(gl.float16))
    stamp(p_trace, 2, i_r, TRACE)
    # G (negated) and C to shared memory as fp16 wgmma operands; after the sweeps their buffers take W and M
    w_smem = gl.allocate_shared_memory(gl.float16, [B_T, B_T], X_SHARED)
    m_smem = gl.allocate_shared_memory(gl.float16, [B_T, B_T], X_SHARED)
    x_smem = gl.allocate_shared_memory(gl.float16, [B_T, B_T], X_SHARED)
    zeros_t = gl.zeros([B_T, B_T], gl.float32, layout=MMA)
    solve_factors(w_smem, m_smem, x_smem, b_qk, b_kk, m_anc, o_i, o_j, beta_i, beta_j, r_q_i, r_k_i, r_k_j, decay,
                  block_depth_ptr + i_r, zeros_t, 1 - (ABLATE & 1))
    if RING_ASYNC:
        # the tokens' updates (arrived by cp.async) scaled by their largest magnitude into fp16, every value tile:
        # the B operands of D U_p, which open each tile's accumulation; the state tiles are scaled by
        # exp(L) / (ds us) as they are split, and the tile's products by ds us after it
        async_copy.wait_group(0)
        gl.thread_barrier()
        us = 0.0
        for t in gl.static_range(NV):
            us = gl.maximum(us, gl.max(gl.max(gl.abs(u32_smem.index(t).load(LD_UP)), axis=1), axis=0))
        us = gl.where(us > 0.0, us, 1.0)
        up16_smem = gl.allocate_shared_memory(gl.float16, [NV, B_P, B_V], UP_SHARED)
        for t in gl.static_range(NV):
            up16_smem.index(t).store((u32_smem.index(t).load(LD_UP) / us).to(gl.float16))
        fence_async_shared()
        gl.thread_barrier()
        ring_c = ds_q * us
        ring_f = ring_decay / ring_c
    if FOLD_ASYNC:
        # the fold's updates (and v) arrived by cp.async before the stream's first tile needs them
        async_copy.wait_group(0)
        gl.thread_barrier()
        if FOLD_SMEM:
            # the weighted updates of every value tile split into their bf16 parts once, in shared memory: the fold's
            # A operands straight from there (no layout conversion a value tile)
            gl.static_assert(NV == 2, "FOLD_SMEM: two value tiles")
            w_up0 = u32_smem.index(0).permute((1, 0)).load(LD_P) * weight_pc[None, :]
            w_up1 = u32_smem.index(1).permute((1, 0)).load(LD_P) * weight_pc[None, :]
            gl.thread_barrier()
            fold_parts(up_parts, 0, w_up0)
            fold_parts(up_parts, 3, w_up1)
            fence_async_shared()
            gl.thread_barrier()
    stamp(p_trace, 3, i_r, TRACE)
    b_decay = gl.exp(logp_i)
    gl.store(logp_ptr + (bos + o_i) * H_V + i_h, logp_i, mask=m_i)
    gl.store(k_scale_ptr + (bos + o_i) * H_K + i_hk, r_k_i, mask=m_i & write_keys)
    a_q = gl.convert_layout(b_decay * r_q_i, ROW_V)
    a_k = gl.convert_layout(b_decay * r_k_i, ROW_V)

    if ROWS:
        gl.static_assert(not PREFETCH and not COALESCE and not FOLD and not RING,
                         "ROWS: no prefetch, coalesced stores, fold or ring")
        # the products the other way round, S Q^T and S K^T as [B_V, B_T] tiles: the state tile (its two bf16
        # parts) is the wgmma's A operand straight from registers, q and k its B operands in shared memory, so a
        # state tile never goes through shared memory and the stream has no barrier; R'^T is the readout's A
        # operand from registers the same way, W^T and M^T (the stored W and M, transposed views) its B operands
        gl.static_assert(B_V == B_T, "ROWS: one 64-row value tile a product")
        o_vr = gl.arange(0, B_V, layout=ROW)
        o_n = gl.arange(0, B_T, layout=COL)
        m_n = o_n < num_nodes
        a_qn = gl.convert_layout(b_decay * r_q_i, COL)
        a_kn = gl.convert_layout(b_decay * r_k_i, COL)
        p_v = v_ptr + bos * stride_v_n + i_h * stride_v_h
        p_u = u_ptr + bos * (H_V * D_V) + i_h * D_V
        p_o = o_ptr + bos * (H_V * D_V) + i_h * D_V
        zeros_t2 = gl.zeros([B_V, B_T], gl.float32, layout=MMA)
        for t in gl.static_range(NV):
            b_qs = zeros_t2
            b_ks = zeros_t2
            for c in gl.static_range(NK):
                n = t * NK + c
                b_s, b_s_next = state_tile(n, b_s, s_desc, s_ring, s_bars, s_row, p_state, s_offsets, stride_s_v,
                                           NV * NK, NK, B_V, B_K, TMA_STAGES, LD_S, ABLATE)
                b_hi = b_s.to(gl.bfloat16)
                b_lo = (b_s - b_hi.to(gl.float32)).to(gl.bfloat16)
                b_qs = warpgroup_mma(b_hi, q_smem.index(c).permute((1, 0)), b_qs, is_async=True)
                b_qs = warpgroup_mma(b_lo, q_smem.index(c).permute((1, 0)), b_qs, is_async=True)
                b_ks = warpgroup_mma(b_hi, k_smem.index(c).permute((1, 0)), b_ks, is_async=True)
                b_ks = warpgroup_mma(b_lo, k_smem.index(c).permute((1, 0)), b_ks, is_async=True)
                b_qs, b_ks = warpgroup_mma_wait(num_outstanding=0, deps=(b_qs, b_ks))
                b_s = b_s_next
            o_vv = t * B_V + o_vr
            b_v = gl.load(p_v + o_vv[:, None] + o_n[None, :] * stride_v_n, mask=m_n[None, :], other=0.0)
            b_r = b_v.to(gl.float32) - b_ks * a_kn[None, :]
            r_max = gl.max(gl.max(gl.abs(b_r), axis=1), axis=0)
            r_scale = gl.where(r_max > 0.0, r_max, 1.0)
            b_r16 = gl.convert_layout((b_r / r_scale).to(gl.float16), LD_S)
            # O^T = (Q S^T)^T a_q + R'^T M^T, accumulated in place on the scaled products
            b_o = warpgroup_mma(b_r16, m_smem.permute((1, 0)), b_qs * (a_qn / r_scale)[None, :], is_async=True)
            b_u = warpgroup_mma(b_r16, w_smem.permute((1, 0)), zeros_t2, use_acc=False, is_async=True)
            b_o, b_u = warpgroup_mma_wait(num_outstanding=0, deps=(b_o, b_u))
            out_offsets = o_vv[:, None] + o_n[None, :] * (H_V * D_V)
            gl.store(p_u + out_offsets, b_u * r_scale, mask=m_n[None, :])
            gl.store(p_o + out_offsets, (b_o * r_scale).to(o_ptr.dtype.element_ty), mask=m_n[None, :])
    else:
        # the state stream: per value tile Q S^T and K S^T on the two bf16 parts of S, then the readout
        s_smem = gl.allocate_shared_memory(gl.bfloat16, [2, B_V, B_K], S_SHARED)
        if ALIAS_R:  # R' takes the state parts' bytes (written after the tile's products, read before the next tile's)
            gl.static_assert(2 * B_V * B_K == B_T * B_V, "ALIAS_R: the state parts and R' must be the same size")
            r_smem = s_smem._reinterpret(gl.float16, [B_T, B_V], R_SHARED)
        else:
            r_smem = gl.allocate_shared_memory(gl.float16, [B_T, B_V], R_SHARED)
        o_iv = gl.arange(0, B_T, layout=ROW_V)
        p_u = u_ptr + bos * (H_V * D_V) + i_h * D_V
        p_o = o_ptr + bos * (H_V * D_V) + i_h * D_V
        m_iv = o_iv < num_nodes
        zeros_v = gl.zeros([B_T, B_V], gl.float32, layout=MMA_V)
        if FOLD and FOLD_STORE == 1:
            # the folded tiles leave by TMA from two fp32 staging buffers (the pool's view as in the TMA ring)
            s_out = gl.allocate_shared_memory(gl.float32, [2, B_V, B_K], S32_SHARED)
        elif FOLD and FOLD_STORE == 4:
            # one staging buffer in the bytes of X (free once the factors are solved)
            gl.static_assert(B_V * B_K == B_T * B_T // 2, "FOLD_STORE 4: a state tile the size of X")
            s_out = x_smem._reinterpret(gl.float32, [1, B_V, B_K], S32_SHARED)
        else:
            s_out = 0
        if FOLD and FOLD_STORE == 2:
            o_scv = gl.arange(0, B_V, layout=gl.SliceLayout(1, LD_SC))
            o_sck = gl.arange(0, B_K, layout=gl.SliceLayout(0, LD_SC))
            sc_offsets = o_scv[:, None] * stride_s_v + o_sck[None, :]
        else:
            sc_offsets = 0
        A_FOLD: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=LD_S, k_width=2)
        zeros_s = gl.zeros([B_V, B_K], gl.float32, layout=LD_S)
        if FOLD and FOLD_AHEAD == 2:
            # every chunk's update a tile ahead, across value tiles too: the first value tile's operands and its first
            # chunk's update issued before the stream
            gl.static_assert(FOLD_ASYNC and not FOLD_SMEM, "FOLD_AHEAD 2: with FOLD_ASYNC, not FOLD_SMEM")
            up_hi, up_mid, up_lo = fold_operands(u32_smem.index(0).permute((1, 0)).load(LD_P), weight_pc, A_FOLD)
            d_next = fold_update(up_hi, up_mid, up_lo, kp_smem.index(0), zeros_s, FOLD_PARTS)
        for t in gl.static_range(NV):
            b_qs = zeros_v
            b_ks = zeros_v
            if RING_ASYNC:
                b_qs = warpgroup_mma(dq_smem, up16_smem.index(t), zeros_v, use_acc=False, is_async=True)
                b_ks = warpgroup_mma(dk_smem, up16_smem.index(t), zeros_v, use_acc=False, is_async=True)
            if RING and not RING_ASYNC:
                rows_u, m_u = table_rows(path_rows_ptr + i_r * B_P, B_P, gl.SliceLayout(1, LD_UP))
                o_vu = t * B_V + gl.arange(0, B_V, layout=gl.SliceLayout(0, LD_UP))
                b_up = gl.load(prev_u_ptr + rows_u[:, None] * (H_V * D_V) + i_h * D_V + o_vu[None, :],
                               mask=m_u[:, None], other=0.0)
            if FOLD and FOLD_AHEAD == 2:
                if t > 0:  # made during the previous value tile's last chunk
                    up_hi = nxt_hi
                    up_mid = nxt_mid
                    up_lo = nxt_lo
            elif FOLD and FOLD_SMEM:
                up_hi = up_parts.index(3 * t)
                up_mid = up_parts.index(3 * t + 1)
                up_lo = up_parts.index(3 * t + 2)
            elif FOLD:
                # the path's weighted updates w_j u_j of this value tile, [B_V, B_P], in three bf16 parts that sum to
                # them (8 + 8 + 8 significant bits): with 16-bit keys each part's products are exact
                if FOLD_ASYNC:  # from shared memory (rows past the path zero-filled)
                    b_up = u32_smem.index(t).permute((1, 0)).load(LD_P)
                else:
                    o_vp = t * B_V + gl.arange(0, B_V, layout=gl.SliceLayout(1, LD_P))
                    b_up = gl.load(prev_u_ptr + rows_pc[None, :] * (H_V * D_V) + i_h * D_V + o_vp[:, None],
                                   mask=m_pc[None, :], other=0.0)
                up_hi, up_mid, up_lo = fold_operands(b_up, weight_pc, A_FOLD)
            for c in gl.static_range(NK):
                n = t * NK + c
                b_s, b_s_next = state_tile(n, b_s, s_desc, s_ring, s_bars, s_row, p_state, s_offsets, stride_s_v,
                                           NV * NK, NK, B_V, B_K, TMA_STAGES, LD_S, ABLATE)
                if FOLD:
                    # S' = P_a S + sum_j (w_j u_j) k_j^T on this tile (LD_S is the wgmma accumulator layout here),
                    # written back to the pool in place: the committed state, this round's S_pre
                    if FOLD_AHEAD:
                        # the update sum_j (w_j u_j) k_j^T does not depend on S: the next chunk's is issued before
                        # this tile's products (done by the time they are) and only the first chunk's of each value
                        # tile waits on the tensor cores; S' = P_a S + update elementwise
                        if c == 0 and FOLD_AHEAD == 1:
                            d_cur = fold_update(up_hi, up_mid, up_lo, kp_smem.index(0), zeros_s, FOLD_PARTS)
                        else:
                            d_cur = d_next
                        d_cur = warpgroup_mma_wait(num_outstanding=0, deps=(d_cur,))
                        if c + 1 < NK:
                            d_next = fold_update(up_hi, up_mid, up_lo, kp_smem.index(c + 1), zeros_s, FOLD_PARTS)
                        elif FOLD_AHEAD == 2 and t + 1 < NV:
                            nxt_hi, nxt_mid, nxt_lo = fold_operands(u32_smem.index(t + 1).permute((1, 0)).load(LD_P),
                                                                    weight_pc, A_FOLD)
                            d_next = fold_update(nxt_hi, nxt_mid, nxt_lo, kp_smem.index(0), zeros_s, FOLD_PARTS)
                        b_s = b_s * fold_decay + d_cur
                    else:
                        b_s = warpgroup_mma(up_hi, kp_smem.index(c), b_s * fold_decay, is_async=True)
                        b_s = warpgroup_mma(up_mid, kp_smem.index(c), b_s, is_async=True)
                        if FOLD_PARTS == 3:
                            b_s = warpgroup_mma(up_lo, kp_smem.index(c), b_s, is_async=True)
                        b_s = warpgroup_mma_wait(num_outstanding=0, deps=(b_s,))
                    if FOLD_STORE == 0:  # from the accumulator's layout: 8-byte stores
                        gl.store(p_state + (t * B_V * stride_s_v + c * B_K) + s_offsets, b_s)
                    elif FOLD_STORE == 1 or FOLD_STORE == 4:
                        # staged in shared memory, stored by TMA (the stage's previous tile read out first)
                        tma.store_wait(1 if FOLD_STORE == 1 else 0)
                        gl.thread_barrier()
                        stage = s_out.index(n % 2 if FOLD_STORE == 1 else 0)
                        stage.store(b_s)
                        fence_async_shared()
                        gl.thread_barrier()
                        tma.async_copy_shared_to_global(s_desc, [s_row + t * B_V, c * B_K], stage)
                    elif FOLD_STORE == 2:  # through a row-contiguous layout: 16-byte stores
                        gl.store(p_state + (t * B_V * stride_s_v + c * B_K) + sc_offsets, gl.convert_layout(b_s, LD_SC))
                    # FOLD_STORE 3: not written (timing only, `--fold`'s ablation)
                if RING_ASYNC:
                    b_s = b_s * ring_f
                b_hi = b_s.to(gl.bfloat16)
                b_lo = (b_s - b_hi.to(gl.float32)).to(gl.bfloat16)
                gl.thread_barrier()
                s_smem.index(0).store(b_hi)
                s_smem.index(1).store(b_lo)
                fence_async_shared()
                gl.thread_barrier()
                if (ABLATE & 2) == 0:
                    b_qs = warpgroup_mma(q_smem.index(c), s_smem.index(0).permute((1, 0)), b_qs, is_async=True)
                    b_qs = warpgroup_mma(q_smem.index(c), s_smem.index(1).permute((1, 0)), b_qs, is_async=True)
                    b_ks = warpgroup_mma(k_smem.index(c), s_smem.index(0).permute((1, 0)), b_ks, is_async=True)
                    b_ks = warpgroup_mma(k_smem.index(c), s_smem.index(1).permute((1, 0)), b_ks, is_async=True)
                    b_qs, b_ks = warpgroup_mma_wait(num_outstanding=0, deps=(b_qs, b_ks))
                b_s = b_s_next
            if RING_ASYNC:
                b_qs = b_qs * ring_c
                b_ks = b_ks * ring_c
            if RING and not RING_ASYNC:
                # S' x = exp(L) (S x) + sum_j w_j (k_j . x) u_j: the products with the state as it is, scaled, plus
                # D U_p on fp16 wgmma (the updates scaled by their largest magnitude, in R''s shared memory)
                us = gl.max(gl.max(gl.abs(b_up), axis=1), axis=0)
                us = gl.where(us > 0.0, us, 1.0)
                up_smem = r_smem._reinterpret(gl.float16, [B_P, B_V], UP_SHARED)
                gl.thread_barrier()
                up_smem.store((b_up / us).to(gl.float16))
                fence_async_shared()
                gl.thread_barrier()
                c_q = ds_q * us
                c_k = ds_k * us
                b_qs = warpgroup_mma(dq_smem, up_smem, b_qs * (ring_decay / c_q), is_async=True)
                b_ks = warpgroup_mma(dk_smem, up_smem, b_ks * (ring_decay / c_k), is_async=True)
                b_qs, b_ks = warpgroup_mma_wait(num_outstanding=0, deps=(b_qs, b_ks))
                b_qs = b_qs * c_q
                b_ks = b_ks * c_k
            # readout of this value tile
            if t == 0:
                stamp(p_trace, 4, i_r, TRACE)
            o_vv = t * B_V + gl.arange(0, B_V, layout=COL_V)
            if PREFETCH:
                if t == 0:
                    async_copy.wait_group(0)
                    gl.thread_barrier()
                b_v = v_smem.index(t).load(MMA_V).to(gl.float32)
            else:
                b_v = gl.load(p_v + o_iv[:, None] * stride_v_n + o_vv[None, :], mask=m_iv[:, None],
                              other=0.0).to(gl.float32)
            b_r = b_v - a_k[:, None] * b_ks
            r_max = gl.max(gl.max(gl.abs(b_r), axis=1), axis=0)
            r_scale = gl.where(r_max > 0.0, r_max, 1.0)
            gl.thread_barrier()
            r_smem.store((b_r / r_scale).to(gl.float16))
            fence_async_shared()
            gl.thread_barrier()
            if (ABLATE & 32) == 0:
                b_u = warpgroup_mma(w_smem, r_smem, zeros_v, use_acc=False, is_async=True)
                b_o = warpgroup_mma(m_smem, r_smem, zeros_v, use_acc=False, is_async=True)
                b_u, b_o = warpgroup_mma_wait(num_outstanding=0, deps=(b_u, b_o))
            else:
                b_u = b_r
                b_o = b_r
            b_u = b_u * r_scale
            b_o = b_o * r_scale + a_q[:, None] * b_qs
            if COALESCE:
                # through shared memory into row-contiguous layouts: 16-byte stores, whole rows a warp
                o_iu = gl.arange(0, B_T, layout=gl.SliceLayout(1, LD_U))
                o_vu = t * B_V + gl.arange(0, B_V, layout=gl.SliceLayout(0, LD_U))
                if (ABLATE & 8) == 0:
                    gl.store(p_u + o_iu[:, None] * (H_V * D_V) + o_vu[None, :], gl.convert_layout(b_u, LD_U),
                             mask=(o_iu < num_nodes)[:, None])
                o_io = gl.arange(0, B_T, layout=gl.SliceLayout(1, LD_O))
                o_vo = t * B_V + gl.arange(0, B_V, layout=gl.SliceLayout(0, LD_O))
                if (ABLATE & 16) == 0:
                    gl.store(p_o + o_io[:, None] * (H_V * D_V) + o_vo[None, :],
                             gl.convert_layout(b_o.to(o_ptr.dtype.element_ty), LD_O), mask=(o_io < num_nodes)[:, None])
            else:
                out_offsets = o_iv[:, None] * (H_V * D_V) + o_vv[None, :]
                if (ABLATE & 8) == 0:
                    gl.store(p_u + out_offsets, b_u, mask=m_iv[:, None])
                if (ABLATE & 16) == 0:
                    gl.store(p_o + out_offsets, b_o.to(o_ptr.dtype.element_ty), mask=m_iv[:, None])
            if t == 0:
                stamp(p_trace, 5, i_r, TRACE)
    if FOLD and (FOLD_STORE == 1 or FOLD_STORE == 4):
        tma.store_wait(0)
    stamp(p_trace, 6, i_r, TRACE)
    if PAD > 0:
        gl.thread_barrier()
        gl.store(committed_ptr + i_r, gl.sum(pad.index(PAD - 1).load(PAD_LD), axis=0), mask=H_V < 0)


@gluon.jit
def fold_update(up_hi, up_mid, up_lo, kp, zeros, PARTS: gl.constexpr = 3):
    """A fold's update of one state tile, ``(w u)^T K_p`` from the weighted updates' bf16 parts (``PARTS`` of them:
    3, or 2 to see what the last costs) and the tokens' keys ``kp`` (shared memory), issued and not waited for."""
    d = warpgroup_mma(up_hi, kp, zeros, use_acc=False, is_async=True)
    d = warpgroup_mma(up_mid, kp, d, is_async=True)
    if PARTS == 3:
        d = warpgroup_mma(up_lo, kp, d, is_async=True)
    return d


@gluon.jit
def fold_parts(up_parts, first: gl.constexpr, b_up):
    """``b_up``'s three bf16 parts into ``up_parts[first:first+3]``."""
    hi, mid, lo = bf16_parts(b_up)
    up_parts.index(first).store(hi)
    up_parts.index(first + 1).store(mid)
    up_parts.index(first + 2).store(lo)


@gluon.jit
def solve_factors(w_smem, m_smem, x_smem, b_qk, b_kk, m_anc, o_i, o_j, beta_i, beta_j, r_q_i, r_k_i, r_k_j, decay,
                  p_depth, zeros_t, SWEEPS: gl.constexpr = 1):
    """A head's factors into shared memory as fp16 wgmma operands: ``G`` (negated) and ``C`` first, then
    ``X = (I + G)^-1 = I + Y`` by level sweeps ``Y <- -G (I + Y)`` (fp16 operands, fp32 accumulation; the diagonal of
    ``G X`` is 0: ``G`` links a node to its proper ancestors only, ``X`` a node to itself and its ancestors), leaving
    ``W = X D_beta`` in ``w_smem`` and ``M = C X D_beta`` in ``m_smem`` (``x_smem`` the sweeps' scratch). The number
    of sweeps is the tree's block depth at ``p_depth`` (none with ``SWEEPS`` 0: `ABLATIONS`)."""
    w_smem.store(gl.where(m_anc & (o_i[:, None] != o_j[None, :]),
                          -(beta_i * r_k_i)[:, None] * decay * r_k_j[None, :] * b_kk, 0.0).to(gl.float16))
    m_smem.store((r_q_i[:, None] * decay * r_k_j[None, :] * b_qk).to(gl.float16))
    b_y = zeros_t
    for _ in range(gl.load(p_depth) * SWEEPS):
        gl.thread_barrier()
        x_smem.store(gl.where(o_i[:, None] == o_j[None, :], 1.0, b_y).to(gl.float16))
        fence_async_shared()
        gl.thread_barrier()
        b_y = warpgroup_mma(w_smem, x_smem, zeros_t, use_acc=False)
    gl.thread_barrier()
    b_x = gl.where(o_i[:, None] == o_j[None, :], 1.0, b_y)
    x_smem.store(b_x.to(gl.float16))
    fence_async_shared()
    gl.thread_barrier()
    b_m = warpgroup_mma(m_smem, x_smem, zeros_t, use_acc=False) * beta_j[None, :]
    gl.thread_barrier()
    w_smem.store((b_x * beta_j[None, :]).to(gl.float16))
    m_smem.store(b_m.to(gl.float16))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def token_keys(kp_smem, p_keys, rows, real, stride_row, B_K: gl.constexpr, NK: gl.constexpr, LD: gl.constexpr,
               ASYNC: gl.constexpr):
    """The tokens' raw keys (``rows`` of ``p_keys``, zero where not ``real``) into ``kp_smem`` ``[NK, B_P, B_K]``,
    chunk by chunk: by cp.async with ``ASYNC`` (the caller commits and waits), else loaded and stored."""
    for c in gl.static_range(NK):
        o_k = c * B_K + gl.arange(0, B_K, layout=gl.SliceLayout(0, LD))
        ptrs = p_keys + rows[:, None] * stride_row + o_k[None, :]
        if ASYNC:
            async_copy.async_copy_global_to_shared(kp_smem.index(c), ptrs, mask=real[:, None])
        else:
            kp_smem.index(c).store(gl.load(ptrs, mask=real[:, None], other=0.0))


@gluon.jit
def l2_ahead(lin, H_V, group, offsets_ptr, state_indices_ptr, q_ptr, k_ptr, v_ptr, state_ptr, stride_q_n, stride_q_h,
             stride_k_n, stride_k_h, stride_v_n, stride_v_h, stride_s_slot, stride_s_h, n_programs,
             D_K: gl.constexpr, D_V: gl.constexpr, B_T: gl.constexpr, LD_L2: gl.constexpr):
    """``prefetch.global.L2`` of program ``lin``'s inputs (nothing past the launch's ``n_programs``): the tree's q, k
    and v rows (128-byte lines of 16-bit rows) and the head's fp32 state (rows of ``D_K``: the lab's contiguous pool)."""
    if lin < n_programs:
        h = lin % H_V
        r = lin // H_V
        bos = gl.load(offsets_ptr + r).to(gl.int64)
        n = gl.load(offsets_ptr + r + 1).to(gl.int64) - bos
        slot = gl.load(state_indices_ptr + r).to(gl.int64)
        LINES: gl.constexpr = D_K * 2 // 128
        o_t = gl.arange(0, B_T, layout=gl.SliceLayout(1, LD_L2))
        o_l = gl.arange(0, LINES, layout=gl.SliceLayout(0, LD_L2)) * 64
        m = (o_t < n)[:, None] & (o_l >= 0)[None, :]
        rows = bos + o_t
        l2_prefetch(q_ptr + rows[:, None] * stride_q_n + (h // group) * stride_q_h + o_l[None, :], m)
        l2_prefetch(k_ptr + rows[:, None] * stride_k_n + (h // group) * stride_k_h + o_l[None, :], m)
        l2_prefetch(v_ptr + rows[:, None] * stride_v_n + h * stride_v_h + o_l[None, :], m)
        # the state: D_V rows of D_K fp32, B_T rows at a time
        S_LINES: gl.constexpr = D_K * 4 // 128
        o_s = gl.arange(0, S_LINES, layout=gl.SliceLayout(0, LD_L2)) * 32
        p_s = state_ptr + slot * stride_s_slot + h * stride_s_h
        for c in gl.static_range(D_V // B_T):
            l2_prefetch(p_s + (c * B_T + o_t)[:, None] * D_K + o_s[None, :], (o_t >= 0)[:, None] & (o_s >= 0)[None, :])


@gluon.jit
def l2_prefetch(ptrs, mask):
    """One ``prefetch.global.L2`` per masked-in pointer."""
    gl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                              "=r,l,r", [ptrs, mask.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def stamp(p_trace, idx: gl.constexpr, dep, TRACE: gl.constexpr):
    """With ``TRACE``, the global timer (ns) into ``p_trace[idx]``: where a program's time goes."""
    if TRACE:
        gl.thread_barrier()
        gl.store(p_trace + idx, gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [dep], dtype=gl.int64,
                                                          is_pure=False, pack=1))


@gluon.jit
def state_tile(n: gl.constexpr, b_s, s_desc, s_ring, s_bars, s_row, p_state, s_offsets, stride_s_v,
               NUM_TILES: gl.constexpr, NK: gl.constexpr, B_V: gl.constexpr, B_K: gl.constexpr,
               TMA_STAGES: gl.constexpr, LD_S: gl.constexpr, ABLATE: gl.constexpr = 0):
    """State tile ``n`` of the stream (value tile ``n // NK``, key chunk ``n % NK``) and the register tile to carry to
    the next: with ``TMA_STAGES`` tile ``n`` read from its ring stage once it has arrived, and tile ``n + TMA_STAGES``
    requested into that stage; without, ``b_s`` (loaded a tile earlier) and the next tile's load, issued before this
    tile's products (the last tile's wraps to the first: unused). Returns (tile n, carried tile)."""
    if TMA_STAGES > 0:
        mbarrier.wait(s_bars.index(n % TMA_STAGES), (n // TMA_STAGES) % 2)
        b_s = s_ring.index(n % TMA_STAGES).load(LD_S)
        if n + TMA_STAGES < NUM_TILES:
            gl.thread_barrier()
            fence_async_shared()
            mbarrier.expect(s_bars.index(n % TMA_STAGES), B_V * B_K * 4)
            tma.async_copy_global_to_shared(
                s_desc, [s_row + ((n + TMA_STAGES) // NK) * B_V, ((n + TMA_STAGES) % NK) * B_K],
                s_bars.index(n % TMA_STAGES), s_ring.index(n % TMA_STAGES))
        b_next = b_s
    else:
        t_next = ((n + 1) % NUM_TILES) // NK
        c_next = (n + 1) % NK
        if (ABLATE & 4) != 0:
            b_next = gl.zeros([B_V, B_K], gl.float32, layout=LD_S)
        else:
            b_next = gl.load(p_state + t_next * B_V * stride_s_v + c_next * B_K + s_offsets,
                             eviction_policy="evict_first")
    return b_s, b_next


def layouts(dtype: torch.dtype, b_k: int, b_v: int, num_warps: int = 4, rows: bool = False, fold: bool = False) -> dict:
    """The kernel's layout constexprs for 16-bit inputs (``rows``: the state tiles loaded as wgmma A operands)."""
    g16 = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    # 8 warps: two warpgroups, each holding half of every product's columns
    wg = num_warps // 4
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, wg], instr_shape=[16, B_T // wg, 16])
    mma_v = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, wg], instr_shape=[16, b_v // wg, 16])
    return dict(
        MMA=mma, MMA_V=mma_v,
        LD=_blocked(B_T, b_k, 2, num_warps),
        LD_S=(gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2) if rows else
              gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, b_k, 16]) if fold
              else _blocked(b_v, b_k, 4, num_warps)),
        QK_SHARED=gl.NVMMASharedLayout.get_default_for([B_T, b_k], g16),
        X_SHARED=gl.NVMMASharedLayout.get_default_for([B_T, B_T], gl.float16),
        S_SHARED=gl.NVMMASharedLayout.get_default_for([b_v, b_k], gl.bfloat16),
        R_SHARED=gl.NVMMASharedLayout.get_default_for([B_T, b_v], gl.float16),
        LD_V=_blocked(B_T, b_v, 2, num_warps), LD_U=_blocked(B_T, b_v, 4, num_warps), LD_O=_blocked(B_T, b_v, 2, num_warps),
        V_SHARED=gl.SwizzledSharedLayout(1, 1, 1, [1, 0]),
    )


def launch_args(q, k, v, g, beta, state, state_indices, tree, scale=None, b_k: int = 32, b_v: int = 64, out=None,
                alias_r: bool = False, rows: bool = False, tma_stages: int = 0, ablate: int = 0, pad: int = 0,
                prefetch: bool = False, coalesce: bool = False, trace=None, fold=None, ring=None,
                ring_async: bool = False, warps: int = 4, l2_ahead: int = 0, fold_store: int = 0,
                fold_async: bool = False, fold_ahead: int = 0, fold_smem: bool = False, fold_parts: int = 3,
                fold_late: bool = False, fold_w: bool = False):
    """(grid, args, meta, result) of one launch on checked-by-the-caller inputs (``ablate``: `ABLATIONS` bits, parts
    of the work left out, for timing only: the outputs are wrong; ``pad``: that many 4 KiB of shared memory held;
    ``fold_store``: how a fold writes its tiles, `FOLD_STORES`; ``fold_async``: its tokens' keys and updates by cp.async
    with the tree's rows, needs ``prefetch``; ``fold_ahead``: a fold's update of the next chunk issued before this
    tile's products, 2: across value tiles too; ``fold_smem``: the updates' bf16 parts made once, in shared memory,
    needs ``fold_async``; ``fold_parts`` 2: the third part left out, to see what it costs; ``fold_late``: the fold's
    keys in the second cp.async group and its per-token loads issued before the tree's, with ``fold_async``;
    ``fold_w``: the fold's weights and decay given (``fold[1].w``, ``.decay``: a ring's write round of several rounds'
    paths, `ring_tables`) instead of worked out from one path's log-decays)."""
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if tree.max_tree_size > B_T:
        raise ValueError(f"tree: the Gluon resident verify takes trees of at most {B_T} nodes")
    scale = dk ** -0.5 if scale is None else scale
    shape = VerifyShape(HeadShape(hk=hk, hv=hv, dk=dk, dv=dv), n, tree.num_requests, state.shape[0], scale)
    res = result_buffers(shape, q.dtype, q.device, tree, out)
    block_depth, _ = tree.block_depths(B_T)
    sq, sk, sv, sg, sb, ss = q.stride(), k.stride(), v.stride(), g.stride(), beta.stride(), state.stride()
    if not state.is_contiguous():
        raise ValueError("state: the lab's TMA descriptor wants a contiguous pool")
    s32 = gl.NVMMASharedLayout.get_default_for([b_v, b_k], gl.float32)
    pool = state.view(-1, dk)
    s_desc = TensorDescriptor(pool, list(pool.shape), list(pool.stride()), [b_v, b_k], s32)
    if fold is not None and ring is not None:
        raise ValueError("fold or ring, not both")
    if ring_async and not (ring is not None and prefetch):
        raise ValueError("ring_async: a ring read round with prefetch")
    if fold_async and not (fold is not None and prefetch):
        raise ValueError("fold_async: a fold with prefetch")
    if fold_w and fold is None:
        raise ValueError("fold_w: with a fold")
    if (fold_smem or fold_late) and not fold_async:
        raise ValueError("fold_smem, fold_late: with fold_async")
    if warps != 4 and (fold is not None or ring is not None or rows or tma_stages):
        raise ValueError("warps: 8 only for the plain verify")
    b_p = fold[0].shape[1] if fold is not None else ring.rows.shape[1] if ring is not None else 16
    args = (q, k, v, g, beta, state, state_indices, tree.offsets, tree.dfs_enter, tree.dfs_exit, block_depth,
            res.o, res.u, res.log_decay, res.k, res.k_scale, res.committed, s_desc,
            trace if trace is not None else res.committed,
            *((fold[0], fold[1].u, fold[1].k, fold[1].k_scale, fold[1].log_decay) if fold is not None
              else (ring.rows, ring.u, ring.k, res.k_scale, res.log_decay) if ring is not None
              else (res.committed, res.u, res.k, res.k_scale, res.log_decay)),
            *((ring.w, ring.decay) if ring is not None else (fold[1].w, fold[1].decay) if fold_w
              else (res.log_decay, res.log_decay)),
            scale, hv, hk, hv * tree.num_requests, sq[0], sq[1], sk[0], sk[1], sv[0], sv[1], sg[0], sg[1], sb[0], sb[1], ss[0], ss[1], ss[2])
    meta = dict(D_K=dk, D_V=dv, B_T=B_T, B_K=b_k, B_V=b_v, G_FLOOR=LOG_DECAY_FLOOR, ALIAS_R=alias_r, ROWS=rows,
                TMA_STAGES=tma_stages, S32_SHARED=s32, ABLATE=ablate, PAD=pad, PREFETCH=prefetch, COALESCE=coalesce, TRACE=trace is not None,
                FOLD=fold is not None, B_P=b_p,
                LD_P=gl.BlockedLayout([1, 1], [4, 8], [4, 1], [1, 0]),
                KP_SHARED=gl.NVMMASharedLayout.get_default_for([b_p, b_k], gl.bfloat16),
                RING=ring is not None, RING_ASYNC=ring is not None and ring_async,
                MMA_P=gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, b_p, 16]),
                DP_SHARED=gl.NVMMASharedLayout.get_default_for([B_T, b_p], gl.float16),
                UP_SHARED=gl.NVMMASharedLayout.get_default_for([b_p, b_v], gl.float16),
                LD_UP=_blocked(b_p, b_v, 4, 4), LD_KP=_blocked(b_p, b_k, 2, 4),
                L2_AHEAD=l2_ahead, LD_L2=gl.BlockedLayout([1, 1], [8, 4], [warps, 1], [1, 0]),
                FOLD_STORE=fold_store, LD_SC=_blocked(b_v, b_k, 4, warps), FOLD_ASYNC=fold is not None and fold_async,
                FOLD_AHEAD=fold is not None and fold_ahead, FOLD_SMEM=fold is not None and fold_smem,
                FOLD_PARTS=fold_parts, FOLD_LATE=fold is not None and fold_late, FOLD_W=fold_w,
                UPT_SHARED=gl.NVMMASharedLayout.get_default_for([b_v, b_p], gl.bfloat16),
                **layouts(q.dtype, b_k, b_v, num_warps=warps, rows=rows, fold=fold is not None),
                num_warps=warps)
    return (hv, tree.num_requests), args, meta, res


def gluon_verify(q, k, v, g, beta, state, state_indices, tree, scale=None, validate=False, b_k: int = 32,
                 b_v: int = 64, maxnreg: int | None = None, alias_r: bool = False, rows: bool = False,
                 tma_stages: int = 0, ablate: int = 0, pad: int = 0, prefetch: bool = False, coalesce: bool = False,
                 trace=None, fold=None, ring=None, ring_async: bool = False, warps: int = 4, l2_ahead: int = 0,
                 fold_store: int = 0, fold_async: bool = False, fold_ahead: int = 0, fold_smem: bool = False,
                 fold_parts: int = 3, fold_late: bool = False, fold_w: bool = False, out=None):
    """`tree_verify`'s outputs from the Gluon kernel (the lab's: no checks beyond the tree size)."""
    grid, args, meta, res = launch_args(q, k, v, g, beta, state, state_indices, tree, scale, b_k, b_v, out, alias_r,
                                        rows, tma_stages, ablate, pad, prefetch, coalesce, trace, fold, ring,
                                        ring_async, warps, l2_ahead, fold_store, fold_async, fold_ahead,
                                        fold_smem, fold_parts, fold_late, fold_w)
    if maxnreg:
        meta["maxnreg"] = maxnreg
    res.kernel = gluon_resident_kernel[grid](*args, **meta)
    return res


CASES = [16, 8, 32]  # batches of 64-node random trees of depth <= 8, 9B heads, bf16
# launch options (`gluon_verify`); sm_90 compiles (`--compile`, B=16): registers, stack bytes, shared memory ->
# programs per SM
CANDIDATES = [
    dict(b_k=32, b_v=64),                        # 210, none, 65552 B: 2 (tree loads before the q/k rows)
    dict(b_k=32, b_v=64, tma_stages=4),          # 205, none, 98448 B: 2 (51.9 us against 53.2 at B=16)
    dict(b_k=32, b_v=64, prefetch=True),         # 210, none, 81936 B: 2
    dict(b_k=32, b_v=64, coalesce=True),         # 254, none, 81920 B: 2
    dict(b_k=32, b_v=64, prefetch=True, coalesce=True),  # 254, none, 98304 B: 2
    dict(b_k=32, b_v=64, tma_stages=3, prefetch=True),
    dict(b_k=32, b_v=64, tma_stages=3, coalesce=True),
    dict(b_k=64, b_v=32, prefetch=True, coalesce=True),
]

# two warpgroups a program, each half of every product's columns (`--warps8`): 8 warps at 165 registers hold one
# program an SM, capped at 128 (40 B spilled) two
WARPS8_CANDIDATES = [
    dict(b_k=32, b_v=64, prefetch=True, coalesce=True),
    dict(b_k=32, b_v=64, prefetch=True, warps=8),
    dict(b_k=32, b_v=64, prefetch=True, warps=8, maxnreg=128),
    dict(b_k=32, b_v=64, prefetch=True, coalesce=True, warps=8, maxnreg=128),
]
# the next wave's inputs prefetched into L2 (`--l2`): each program requests those of the program this many launch
# positions later (two programs an SM on 132 SMs: 264 is the next wave's)
L2_CANDIDATES = [
    dict(b_k=32, b_v=64, prefetch=True, coalesce=True),
    dict(b_k=32, b_v=64, prefetch=True, coalesce=True, l2_ahead=264),
    dict(b_k=32, b_v=64, prefetch=True, coalesce=True, l2_ahead=132),
    dict(b_k=32, b_v=64, prefetch=True, coalesce=True, l2_ahead=396),
]

# parts of the work an `--ablate` run leaves out, one bit each (timing only: the outputs are wrong); not with ``rows``
ABLATIONS = {1: "level sweeps", 2: "state products", 4: "state loads (no TMA ring)", 8: "u stores", 16: "o stores",
             32: "readout products", 64: "Gram products"}
ABLATE_CONFIGS = [dict(b_k=32, b_v=64, prefetch=True, coalesce=True)]
TRACE_CONFIGS = [dict(b_k=32, b_v=64), dict(b_k=32, b_v=64, prefetch=True, coalesce=True),
                 dict(b_k=32, b_v=64, prefetch=True, coalesce=True, ablate=127, pad=8)]
ABLATE_SETS = [0, 1, 2, 4, 8, 16, 24, 32, 64, 2 | 4, 1 | 2 | 32 | 64, 1 | 2 | 4 | 8 | 16 | 32 | 64]


def ablate_run(repeats: int, batch: int = 16) -> list[dict]:
    """Verify time at ``batch`` with each `ABLATE_SETS` entry of work left out, per `ABLATE_CONFIGS`: where a
    program's time goes."""
    import functools

    from bole_tune.bench import BenchCase, CaseBench

    bench = CaseBench(BenchCase(HEADS_9B, batch, B_T, torch.bfloat16, 8, label="qwen3.5-9b", kind="random"), "cuda")
    rows = []
    for options in ABLATE_CONFIGS:
        for bits in ABLATE_SETS:
            if bits & 4 and options.get("tma_stages"):
                continue
            # pad each variant's shared memory to 80 KiB (no more than two programs an SM; registers <= 255 allow two)
            tree, x, _ = bench.reference()
            kernel = gluon_verify(*x.args(tree), ablate=bits, **options).kernel
            pad = max(0, (80 * 1024 - kernel.metadata.shared) // 4096 + 1)
            verify = functools.partial(gluon_verify, ablate=bits, pad=pad, **options)
            kernel = verify(*x.args(tree)).kernel
            us = bench.time_verify(verify, None, repeats=repeats)[0].p50_us
            left_out = ", ".join(name for bit, name in ABLATIONS.items() if bits & bit) or "nothing"
            rows.append(dict(options, ablate=bits, left_out=left_out, us=us, registers=kernel.n_regs,
                             shared=kernel.metadata.shared))
            print(f"{options} without {left_out}: {us:.1f} us ({kernel.n_regs} registers, "
                  f"{kernel.metadata.shared} B shared)", flush=True)
    return rows


PHASES = ["q/k rows", "Gram", "factors", "state stream, tile 0", "readout, tile 0", "tile 1 (stream, readout)"]


def trace_run(options_list: list[dict], batch: int = 16, launches: int = 4) -> list[dict]:
    """Each program's phases from global-timer stamps (``TRACE``), the last of ``launches`` back-to-back launches on
    rotating input sets: per phase the median ns, the kernel's span, the programs' start times (waves)."""
    from bole_tune.bench import BenchCase, CaseBench

    bench = CaseBench(BenchCase(HEADS_9B, batch, B_T, torch.bfloat16, 8, label="qwen3.5-9b", kind="random"), "cuda")
    tree, pool, inputs, slots = bench.sets(64)
    out = []
    for options in options_list:
        traces = [torch.zeros(batch * HEADS_9B.hv * 8, dtype=torch.int64, device="cuda") for _ in range(launches)]
        for i in range(launches):
            x = inputs[i % len(inputs)]
            gluon_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i % len(slots)], tree, trace=traces[i], **options)
        torch.cuda.synchronize()
        t = traces[-1].view(-1, 8).cpu()
        stamps, sm = t[:, :7].double(), t[:, 7]
        t0 = stamps[:, 0].min()
        start, end = stamps[:, 0] - t0, stamps[:, 6] - t0
        phases = torch.stack([stamps[:, 1] - stamps[:, 0], stamps[:, 2] - stamps[:, 1], stamps[:, 3] - stamps[:, 2],
                              stamps[:, 4] - stamps[:, 3], stamps[:, 5] - stamps[:, 4], stamps[:, 6] - stamps[:, 5]], 1)
        per_sm = torch.bincount(sm, minlength=int(sm.max()) + 1)
        q = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0], dtype=torch.float64)
        row = dict(options, span_us=float(end.max()) / 1e3,
                   program_us=dict(zip(["min", "p25", "p50", "p75", "max"], (torch.quantile(end - start, q) / 1e3).tolist())),
                   start_us=dict(zip(["min", "p25", "p50", "p75", "max"], (torch.quantile(start, q) / 1e3).tolist())),
                   phase_us_p50={name: float(phases[:, i].median()) / 1e3 for i, name in enumerate(PHASES)},
                   programs_per_sm=dict(zip(["min", "max"], [int(per_sm[per_sm > 0].min()), int(per_sm.max())])),
                   sms=int((per_sm > 0).sum()))
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


# how a fold writes its folded tiles back to the pool (``fold_store``); 3 is an ablation, timed but never checked
FOLD_STORES = {0: "from the accumulator layout", 1: "by TMA from two staging buffers",
               2: "through a row-contiguous layout", 3: "not written (timing only)",
               4: "by TMA from one staging buffer in X's bytes"}
# the twenty-second session's first call (B=16, us: folded round / fold's cost): the store's form hardly matters
# (accumulator 67.2 / 17.6, TMA 67.2 / 17.6, row-contiguous 66.3 / 16.6, TMA from X's bytes with coalesced u and o
# 65.7 / 15.9) and the fold costs 9.9-12.5 us with no store at all; so its tokens by cp.async (``fold_async``) and each
# chunk's update issued a tile ahead (``fold_ahead``)
FOLD_BASE = dict(b_k=32, b_v=64, prefetch=True)
# the second call's sweep (every pair of cp.async / ahead / coalesce over the store forms, 17 configurations) found
# ``fold_async`` + ``fold_ahead`` + the TMA store from X's bytes best (B=16 62.4, with ``l2_ahead`` 62.1; B=32 120.4);
# coalesced u and o cost a fold more than they save (shared memory over two programs an SM, or spills)
FOLD_BEST = dict(FOLD_BASE, fold_async=True, fold_ahead=True, fold_store=4)
# third call: the updates' bf16 parts made once in shared memory (``fold_smem``: slower, 64.5), R' in the state parts'
# bytes (``alias_r``, room for a width-32 ring's write round), the third part left out (costs 0.0-0.5 us; no store at
# all 60.3)
# fifth call: the fold's per-token loads issued before the tree's and its keys in the second group (``fold_late``);
# every chunk's update a tile ahead across value tiles too (``fold_ahead`` 2)
FOLD_CONFIGS = [FOLD_BEST, dict(FOLD_BEST, fold_late=True), dict(FOLD_BEST, fold_late=True, l2_ahead=396),
                dict(FOLD_BEST, fold_late=True, alias_r=True), dict(FOLD_BEST, fold_late=True, fold_store=0),
                dict(FOLD_BEST, fold_late=True, fold_store=2), dict(FOLD_BEST, fold_late=True, fold_store=3),
                dict(FOLD_BEST, fold_late=True, fold_ahead=2),
                dict(FOLD_BEST, fold_late=True, fold_ahead=2, alias_r=True),
                dict(FOLD_BEST, fold_late=True, fold_ahead=2, fold_store=3)]


def fold_run(repeats: int, batch: int = 16) -> dict:
    """The folded round in Gluon: this round's verify on the state the previous round's accepted paths leave, the
    pool written in place. Checked against the float64 reference of tree_commit then verify (paths of every length:
    none, the root only, the deepest nodes), then timed side by side with the shipped verify, the shipped folded
    verify and the Gluon verify alone."""
    import functools

    from bole_tune.bench import BenchCase, CaseBench
    from bole_tune.kernels import tree_commit, tree_verify
    from bole_tune.kernels.verify.pending import pending_path_rows
    from bole_tune.kernels.verify.self_check import accepted_error
    from bole_tune.kernels.reference import verify_reference
    from bole_tune.workloads import relative_error

    bench = CaseBench(BenchCase(HEADS_9B, batch, B_T, torch.bfloat16, 8, label="qwen3.5-9b", kind="random"), "cuda")
    tree, pool, inputs, slots = bench.sets(64)
    # the timed folds write the bench's pool in place: every check starts from this copy of it, the reference's
    # (the twenty-first session's "fold with prefetch and coalescing wrong" was this: its check ran on the pool the
    # previous configuration's timing had folded over and over)
    pool = pool.clone()
    request_map = torch.arange(batch, dtype=torch.int32, device="cuda")
    accepted = bench.deepest(tree).clone()
    accepted[0], accepted[1] = -1, 0  # nothing pending; the root only
    prev_x = inputs[1]
    prev = tree_verify(prev_x.q, prev_x.k, prev_x.v, prev_x.g, prev_x.beta, pool, slots[0], tree, validate=False)
    path_rows = pending_path_rows(tree, accepted, request_map)
    x = inputs[0]
    want_pool = pool.clone()
    tree_commit(want_pool, slots[0], prev, accepted, validate=False)
    ref = verify_reference(x.q, x.k, x.v, x.g, x.beta, want_pool, slots[0], tree)
    bound = accepted_error(torch.bfloat16)
    out = {"batch": batch, "runs": []}
    plain = {}  # the Gluon verify alone, once per set of its own options

    def plain_us(options: dict) -> float:
        key = tuple(sorted((k, v) for k, v in options.items() if not k.startswith("fold_")))
        if key not in plain:
            plain[key] = bench.time_verify(functools.partial(gluon_verify, **dict(key)), None,
                                           repeats=repeats)[0].p50_us
        return plain[key]

    for options in FOLD_CONFIGS:
        if options.get("fold_store") == 3:  # the ablation: wrong by design, timed only
            entry = dict(options, status="ablation: timed, not checked")
            entry["us"] = bench.time_verify(functools.partial(gluon_verify, fold=(path_rows, prev), **options), None,
                                            repeats=repeats)[0].p50_us
            entry["plain_us"] = plain_us(options)
            print(f"fold {entry}", flush=True)
            out["runs"].append(entry)
            continue

        def check(options=options) -> dict:
            got_pool = pool.clone()
            res = gluon_verify(x.q, x.k, x.v, x.g, x.beta, got_pool, slots[0], tree, fold=(path_rows, prev), **options)
            touched = slots[0].long()
            others = torch.ones(len(pool), dtype=torch.bool, device="cuda").index_fill_(0, touched, False)
            got = {"error": relative_error(res.o, ref.o),
                   "state_error": relative_error(got_pool[touched], want_pool[touched]),
                   "untouched_same": bool(torch.equal(got_pool[others], pool[others])),
                   "registers": res.kernel.n_regs, "spills": res.kernel.n_spills, "shared": res.kernel.metadata.shared}
            got["ok"] = max(got["error"], got["state_error"]) <= bound and got["untouched_same"]
            return got

        def time(options=options) -> dict:
            verify = functools.partial(gluon_verify, fold=(path_rows, prev), **options)
            return {"us": bench.time_verify(verify, None, repeats=repeats)[0].p50_us, "plain_us": plain_us(options)}

        entry = check_then_time(dict(options), check, time)
        print(f"fold {entry}", flush=True)
        out["runs"].append(entry)
    shipped = bench.launch()
    out["shipped_verify_us"] = bench.time_verify(tree_verify, shipped, repeats=repeats)[0].p50_us
    out["shipped_folded_us"] = bench.time_folded(repeats=repeats).p50_us
    print(f"shipped verify {out['shipped_verify_us']:.1f} us, shipped folded round {out['shipped_folded_us']:.1f} us",
          flush=True)
    # two launches alternating in one graph against each alone: what a switch between binaries costs (the ring's
    # rounds timed in sequence came out 4-9 us a round above their projection)
    fold_a = functools.partial(gluon_verify, fold=(path_rows, prev), **FOLD_CONFIGS[0])
    fold_b = functools.partial(gluon_verify, fold=(path_rows, prev), **FOLD_CONFIGS[1])
    plain_a = functools.partial(gluon_verify, **FOLD_BASE)
    out["alternating"] = [alternating(bench, pair, names, repeats)
                          for pair, names in (((fold_a, fold_a), ("fold 0", "fold 0")),
                                              ((fold_a, fold_b), ("fold 0", "fold 1")),
                                              ((plain_a, fold_a), ("plain", "fold 0")),
                                              ((plain_a, plain_a), ("plain", "plain")))]
    return out


def on_sets(bench, verify):
    """``launch(i)``: ``verify`` (`tree_verify`'s arguments) on the bench's input set ``i`` and its slots."""
    tree, pool, inputs, slots = bench.sets(64)

    def launch(i):
        x = inputs[i]
        verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, validate=False)
    return launch


def cycle_us(bench, steps, repeats: int, same_set: bool = False) -> float:
    """``steps`` (``launch(i)`` callables, `on_sets`) run in order as one cycle, cycled through one CUDA graph over
    the bench's rotating input sets: us a cycle. Each launch takes its own set, or with ``same_set`` every launch of
    a cycle the cycle's set."""
    from bole_tune.timing import time_launches

    num_sets = len(bench.sets(64)[2])
    k = len(steps)

    def launch(i):
        steps[i % k]((i // k if same_set else i) % num_sets)

    return k * time_launches(launch, k * num_sets, bench.device, repeats=repeats).p50_us


def alternating(bench, pair, names, repeats: int) -> dict:
    """``pair[0]`` and ``pair[1]`` alternating, each launch its own input set, in one CUDA graph: us a launch, and the
    mean of the two timed alone (the same way)."""
    alone = [bench.time_verify(fn, None, repeats=repeats)[0].p50_us for fn in pair]
    row = dict(names=list(names), alternating_us=cycle_us(bench, [on_sets(bench, fn) for fn in pair], repeats) / 2,
               alone_us=alone, mean_alone_us=sum(alone) / 2)
    print(f"alternating {names[0]} / {names[1]}: {row['alternating_us']:.1f} us a launch, alone "
          f"{alone[0]:.1f} / {alone[1]:.1f}", flush=True)
    return row


RING_CONFIGS = [dict(b_k=32, b_v=64, prefetch=True, coalesce=True, ring_async=True),
                dict(b_k=32, b_v=64, prefetch=True, coalesce=True, ring_async=True, l2_ahead=396),
                dict(b_k=32, b_v=64, prefetch=True, ring_async=True),
                dict(b_k=32, b_v=64, prefetch=True, coalesce=True), dict(b_k=32, b_v=64, prefetch=True)]
# a ring's write round (the fold of its tokens): before the twenty-second session ``prefetch`` (+ ``l2_ahead``,
# ``coalesce``); now the fold's best options, R' in the state parts' bytes so that a width-32 fold keeps two programs
# an SM (third call, B=16 widths 16 / 32: 62.9 / 67.1 us; with the parts in shared memory 64.5 / 70.7)
FOLD_WIDE_CONFIGS = [dict(FOLD_BEST, alias_r=True), dict(FOLD_BEST, alias_r=True, l2_ahead=396), FOLD_BEST]
# `--ring --quick`: the best read and write of the full sets, with and without the next wave's inputs in L2
RING_QUICK = ([RING_CONFIGS[0], RING_CONFIGS[1]], FOLD_WIDE_CONFIGS)


def ring_run(repeats: int, batch: int = 16, widths=(32, 16), layers: int = 24, quick: bool = False) -> dict:
    """A ring of pending rounds on the Gluon kernel: read rounds (the tokens' corrections on wgmma, nothing written)
    and write rounds (the same tokens folded, the pool written), each checked against float64 (outputs, and the state
    a commit of every request's deepest node leaves after it), then timed side by side with the shipped verify, the
    plain Gluon verify and the shipped all-layer commit; the projected round ((R - 1) reads + a write) / R."""
    import functools

    from bole_tune.bench import BenchCase, CaseBench
    from bole_tune.kernels import LayerResults, tree_commit, tree_commit_layers, tree_verify
    from bole_tune.kernels.reference import verify_reference
    from bole_tune.kernels.verify.self_check import accepted_error
    from bole_tune.timing import time_launches
    from bole_tune.workloads import relative_error

    bench = CaseBench(BenchCase(HEADS_9B, batch, B_T, torch.bfloat16, 8, label="qwen3.5-9b", kind="random"), "cuda")
    bound = accepted_error(torch.bfloat16)
    tree_c, x_c = bench.reference_instance()
    accepted_c = bench.deepest(tree_c)
    nc = tree_c.num_requests

    def check(kind: str, width: int, options: dict) -> dict:
        filled = [width, 0, 1, width // 2] + [width] * max(0, nc - 4)
        tokens = ring_tokens(nc, HEADS_9B, width, "cuda", filled=filled[:nc])
        want = ring_state(x_c.state, x_c.state_indices, tokens, HEADS_9B)
        ref = verify_reference(x_c.q, x_c.k, x_c.v, x_c.g, x_c.beta, want.float(), x_c.state_indices, tree_c,
                               keep_states=True)
        pool = x_c.state.clone()
        res = gluon_verify(*x_c.args(tree_c), **({"ring": tokens} if kind == "read" else
                                                  {"fold": (tokens.rows, tokens)}), **options)
        out = {"error": relative_error(res.o, ref.o)}
        touched = x_c.state_indices.long()
        if kind == "write":
            out["written_error"] = relative_error(x_c.state[touched], want.float()[touched])
            committed = x_c.state
        else:
            out["untouched"] = bool(torch.equal(pool, x_c.state))
            committed = want.float()
        committed = committed.clone()
        tree_commit(committed, x_c.state_indices, res, accepted_c, validate=False)
        out["state_error"] = relative_error(committed, ref.committed(want, x_c.state_indices, tree_c, accepted_c))
        x_c.state.copy_(pool)  # the write round wrote the reference instance's pool: back for the next check
        out["ok"] = (max(out["error"], out["state_error"], out.get("written_error", 0.0)) <= bound
                     and out.get("untouched", True))
        return out

    out = {"batch": batch, "layers": layers, "runs": []}
    shipped = bench.launch()
    out["shipped_verify_us"] = bench.time_verify(tree_verify, shipped, repeats=repeats)[0].p50_us
    out["gluon_verify_us"] = bench.time_verify(functools.partial(gluon_verify, b_k=32, b_v=64, prefetch=True,
                                                                 coalesce=True), None,
                                               repeats=repeats)[0].p50_us
    print(f"B={batch}: shipped verify {out['shipped_verify_us']:.1f} us, Gluon verify {out['gluon_verify_us']:.1f}",
          flush=True)
    for width in widths:
        tokens = ring_tokens(batch, HEADS_9B, width, "cuda")
        reads, writes = RING_QUICK if quick else (RING_CONFIGS, FOLD_WIDE_CONFIGS)
        for kind, configs in (("read", reads), ("write", writes)):
            for options in configs:
                extra = {"ring": tokens} if kind == "read" else {"fold": (tokens.rows, tokens)}
                entry = check_then_time(
                    dict(options, kind=kind, width=width),
                    lambda kind=kind, width=width, options=options: check(kind, width, options),
                    lambda extra=extra, options=options: {"us": bench.time_verify(
                        functools.partial(gluon_verify, **extra, **options), None, repeats=repeats)[0].p50_us})
                print(f"ring {entry}", flush=True)
                out["runs"].append(entry)
        out["sequences"] = out.get("sequences", []) + ring_sequences(bench, out["runs"], width, tokens, repeats)
    # the shipped all-layer commit of each request's deepest path, per layer (as `CaseBench.time_rounds` times it)
    tree, pool, inputs, slots = bench.sets(64)
    x = inputs[0]
    stacked = LayerResults.empty(layers, tree, HEADS_9B, torch.bfloat16, "cuda")
    states = torch.stack([pool[slots[0].long()]] * layers)
    own = torch.arange(batch, dtype=torch.int32, device="cuda")
    for layer in range(layers):
        tree_verify(x.q, x.k, x.v, x.g, x.beta, states[layer], own, tree, launch=shipped, out=stacked.layer(layer))
    accepted = bench.deepest(tree)
    whole = time_launches(lambda _: (stacked.committed.zero_(), tree_commit_layers(states, own, stacked, tree, accepted)),
                          1, torch.device("cuda"), repeats=repeats)
    out["commit_layers_us"] = whole.p50_us / layers
    print(f"all-layer commit {out['commit_layers_us']:.1f} us a layer", flush=True)
    return out


def print_ring(out: dict) -> None:
    """`ring_run`'s figures and the projected ring rounds as a markdown table (a write round: the faster of the Gluon
    fold of the tokens and the read round plus the shipped all-layer commit, whose paths are the deepest nodes')."""
    b = out["batch"]
    runs = [r for r in out["runs"] if "us" in r]
    print(f"\n| B={b} T=64, us per layer | " + " | ".join(("width", "read (best)", "write (best)", "R=2", "R=4", "R=8"))
          + " |\n|---|---|---|---|---|---|---|")
    print(f"| shipped verify {out['shipped_verify_us']:.1f} + all-layer commit {out['commit_layers_us']:.1f} = "
          f"{out['shipped_verify_us'] + out['commit_layers_us']:.1f}; Gluon verify {out['gluon_verify_us']:.1f} "
          f"+ commit = {out['gluon_verify_us'] + out['commit_layers_us']:.1f} |  |  |  |  |  |  |")
    for width in sorted({r["width"] for r in runs}):
        reads = [r["us"] for r in runs if r["width"] == width and r["kind"] == "read"]
        writes = [r["us"] for r in runs if r["width"] == width and r["kind"] == "write"]
        if not reads or not writes:
            continue
        rd, wr = min(reads), min(writes + [min(reads) + out["commit_layers_us"]])
        cells = [f"{((n - 1) * rd + wr) / n:.1f}" for n in (2, 4, 8)]
        print(f"| Gluon ring | {width} | {rd:.1f} | {wr:.1f} | " + " | ".join(cells) + " |")
    for seq in out.get("sequences", []):
        print(f"| Gluon ring, timed in sequence | {seq['width']} | R={seq['rounds']}: {seq['us']:.1f} us a round "
              f"(projected {seq['projected_us']:.1f}) |  |  |  |  |")


def ring_sequences(bench, runs: list[dict], width: int, tokens, repeats: int, rounds=(2, 3, 4)) -> list[dict]:
    """The ring's rounds timed back to back, not projected: ``R - 1`` read rounds then a write round, cycled
    through one CUDA graph over the bench's rotating input sets (`cycle_us`: each launch its own set), per round; the
    fastest checked read and write of ``width``. The tokens are the timed runs' (every table full: a conservative
    read)."""
    import functools

    def best(kind: str):
        done = [r for r in runs if r["width"] == width and r["kind"] == kind and "us" in r]
        return min(done, key=lambda r: r["us"]) if done else None

    read, write = best("read"), best("write")
    if read is None or write is None:
        return []
    options = {kind: {k: v for k, v in r.items() if k in LAUNCH_OPTIONS}
               for kind, r in (("read", read), ("write", write))}
    verify = {"read": functools.partial(gluon_verify, ring=tokens, **options["read"]),
              "write": functools.partial(gluon_verify, fold=(tokens.rows, tokens), **options["write"])}
    out = []
    for r in rounds:
        us = cycle_us(bench, [on_sets(bench, verify["read"])] * (r - 1) + [on_sets(bench, verify["write"])],
                      repeats) / r
        out.append(dict(width=width, rounds=r, us=us, projected_us=((r - 1) * read["us"] + write["us"]) / r,
                        read=options["read"], write=options["write"]))
        print(f"ring sequence width {width} R={r}: {us:.1f} us a round (projected "
              f"{out[-1]['projected_us']:.1f})", flush=True)
    return out


# `gluon_verify`'s launch options, as a sweep's entries name them
LAUNCH_OPTIONS = ("b_k", "b_v", "maxnreg", "alias_r", "rows", "tma_stages", "prefetch", "coalesce", "ring_async",
                  "warps", "l2_ahead", "fold_store", "fold_async", "fold_ahead", "fold_smem", "fold_parts", "fold_late",
                  "fold_w")


def print_fold(out: dict) -> None:
    """`fold_run`'s entries as a markdown table: the folded round, the same launch without the fold, the difference."""
    print(f"\n| B={out['batch']} T=64, us | folded round | verify alone | fold's cost | errors o / state |")
    print("|---|---|---|---|---|")
    print(f"| shipped | {out['shipped_folded_us']:.1f} | {out['shipped_verify_us']:.1f} | "
          f"{out['shipped_folded_us'] - out['shipped_verify_us']:.1f} |  |")
    for e in out["runs"]:
        name = " ".join(f"{k}={v}" for k, v in e.items()
                        if k in LAUNCH_OPTIONS[2:])
        if "us" not in e:
            print(f"| {name} | {e.get('status', '-')[:50]} |  |  |  |")
            continue
        errs = f"{e['error']:.1e} / {e['state_error']:.1e}" if "error" in e else e.get("status", "")
        print(f"| {name} | {e['us']:.1f} | {e['plain_us']:.1f} | {e['us'] - e['plain_us']:.1f} | {errs} |")


def check_then_time(entry: dict, check, time) -> dict:
    """A lab sweep's entry: ``check()`` (a dict of errors with ``ok``, merged in) and, when ``ok``, ``time()`` (a dict of
    timings, merged in); a wrong result is recorded as not timed, an exception as its message: the sweep goes on."""
    try:
        entry.update(check())
        if entry["ok"]:
            entry.update(time())
        else:
            entry["status"] = "wrong: not timed"
    except Exception as e:  # noqa: BLE001 - a lab sweep records what failed and goes on
        entry["status"] = f"{type(e).__name__}: {str(e)[:400]}"
    return entry


def errors(bench, verify) -> tuple[float, float]:
    """(outputs, committed state) relative errors of ``verify`` on the bench's reference instance against float64:
    the outputs, and the pool a commit of every request's deepest node leaves (so ``u``, logP and the keys too)."""
    from bole_tune.kernels import tree_commit
    from bole_tune.kernels.reference import verify_reference
    from bole_tune.workloads import relative_error

    tree, x, _ = bench.reference()
    ref = verify_reference(*x.args(tree), keep_states=True)
    res = verify(*x.args(tree), validate=False)
    accepted = bench.deepest(tree)
    pool = x.state.clone()
    tree_commit(pool, x.state_indices, res, accepted, validate=False)
    want = ref.committed(x.state, x.state_indices, tree, accepted)
    return relative_error(res.o, ref.o), relative_error(pool, want)


def gpu_run(repeats: int, only_batch=None, candidates=None, verify_fn=None, label: str = "gluon",
            cases=None) -> list[dict]:
    """Per batch of ``cases``: the shipped launch checked and timed, then each of ``candidates`` (``verify_fn``'s
    options) checked against float64 and timed if right."""
    import functools

    from bole_tune.bench import BenchCase, CaseBench
    from bole_tune.kernels import tree_verify
    from bole_tune.kernels.verify.self_check import accepted_error

    candidates, verify_fn = candidates or CANDIDATES, verify_fn or gluon_verify
    bound = accepted_error(torch.bfloat16)
    rows = []
    for batch in [b for b in (cases or CASES) if not only_batch or b in only_batch]:
        bench = CaseBench(BenchCase(HEADS_9B, batch, B_T, torch.bfloat16, 8, label="qwen3.5-9b", kind="random"), "cuda")
        shipped = bench.launch()
        row = {"batch": batch, "shipped": f"{shipped.variant} {shipped.config}", "runs": []}
        launch = functools.partial(tree_verify, launch=shipped)
        e_o, e_s = errors(bench, launch)
        timing, _ = bench.time_verify(tree_verify, shipped, repeats=repeats)
        row["shipped_us"], row["shipped_error"], row["shipped_state_error"] = timing.p50_us, e_o, e_s
        print(f"B={batch} T=64: shipped {row['shipped']} {timing.p50_us:.2f} us (errors {e_o:.1e} / {e_s:.1e})",
              flush=True)
        for options in candidates:
            verify = functools.partial(verify_fn, **options)

            def check(verify=verify) -> dict:
                e_o, e_s = errors(bench, verify)
                return {"error": e_o, "state_error": e_s, "ok": max(e_o, e_s) <= bound}

            entry = check_then_time(dict(options), check, lambda verify=verify: {
                "us": bench.time_verify(verify, None, repeats=repeats)[0].p50_us})
            print(f"    {label} {entry}", flush=True)
            row["runs"].append(entry)
        rows.append(row)
        del bench
        torch.cuda.empty_cache()
    return rows


def compile_report(b_k: int, b_v: int, batch: int = 16, maxnreg: int | None = None, alias_r: bool = False,
                   rows: bool = False, tma_stages: int = 0, ring_width: int = 0, fold_width: int = 0,
                   **options) -> dict:
    """Registers, spills and shared memory of the launch compiled for sm_90, on this machine (no GPU needed): a ring
    read round with ``ring_width``, a fold of that many tokens with ``fold_width``."""
    tree, x = compile_instance(batch)
    ring = ring_tokens(batch, HEADS_9B, ring_width, "cpu") if ring_width else None
    folded = ring_tokens(batch, HEADS_9B, fold_width, "cpu") if fold_width else None
    grid, args, meta, _ = launch_args(*x.args(tree)[:8], b_k=b_k, b_v=b_v, alias_r=alias_r, rows=rows,
                                      tma_stages=tma_stages, ring=ring,
                                      fold=(folded.rows, folded) if folded is not None else None, **options)
    if maxnreg:
        meta["maxnreg"] = maxnreg
    return compile_sm90(gluon_resident_kernel, args, meta)


def ring_tokens(batch: int, heads: HeadShape, width: int, device, seed: int = 7, filled: list[int] | None = None):
    """Pending tokens of a ring read round as the lab kernel takes them, and the same tokens as one folded path.

    Per request ``width`` table entries (``filled[r]`` of them real, default all; ``rows`` -1 past them), each a row
    of token buffers: raw bf16 keys ``k`` ``[N, hk * dk]``, fp32 updates ``u`` ``[N, hv, dv]``, their key norms
    ``k_scale`` ``[N, hk]`` and log-decays ``log_decay`` ``[N, hv]`` (decreasing along a request's entries, as along
    a chain of accepted paths). The ring's weights ``w`` ``[batch, width, hv]`` are ``exp(L - L_j) k_scale_j`` and its
    decays ``decay`` ``[batch, hv]`` are ``exp(L)``, ``L`` the last real entry's log-decay: exactly what the fold of
    the path ``rows`` (`gluon_verify(fold=(rows, tokens))`) applies, so one float64 state (`ring_state`) checks both."""
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(seed)
    filled = filled if filled is not None else [width] * batch
    n, g = batch * width, heads.hv // heads.hk
    k = torch.randn(n, heads.hk * heads.dk, generator=gen).to(torch.bfloat16)
    u = torch.randn(n, heads.hv, heads.dv, generator=gen) * 0.5
    k_scale = 1.0 / k.float().view(n, heads.hk, heads.dk).norm(dim=-1)
    log_decay = -(torch.rand(batch, width, heads.hv, generator=gen) * 0.05).cumsum(1)
    rows = torch.arange(n, dtype=torch.int32).view(batch, width).clone()
    w = torch.zeros(batch, width, heads.hv)
    decay = torch.ones(batch, heads.hv)
    for r, f in enumerate(filled):
        rows[r, f:] = -1
        if f:
            last = log_decay[r, f - 1]
            w[r, :f] = torch.exp(last - log_decay[r, :f]) * k_scale.view(batch, width, heads.hk)[r, :f].repeat_interleave(g, 1)
            decay[r] = torch.exp(last)
    return SimpleNamespace(rows=rows.to(device), u=u.to(device), k=k.to(device), k_scale=k_scale.to(device),
                           log_decay=log_decay.reshape(n, heads.hv).contiguous().to(device),
                           w=w.contiguous().to(device), decay=decay.to(device))


def ring_tables(ring, state_indices: torch.Tensor, arena):
    """The lab kernel's token table from a shipped `PendingRing` and one layer's `RingResults` ``arena``, in request
    order (``state_indices`` the round's slots): ``rows`` (arena rows, -1 none), the arena's raw keys ``k``, updates
    ``u``, ``k_scale`` and ``log_decay`` as flat rows, the weights ``w`` ``[B, width, hv]`` (the ring's
    ``exp(suffix - logP_j)`` times the key's scale) and decays ``decay`` ``[B, hv]``: what a Gluon read round
    (``ring=``) and a write round (``fold=(tables.rows, tables), fold_w=True``) take, so both run on real tables."""
    from types import SimpleNamespace

    slots = state_indices.long()
    _, _, weight, decay = ring.tokens(slots, arena)  # the shipped ring's weights (without the keys' scales)
    hv, dv, hk, dk = arena.u.shape[2], arena.u.shape[3], arena.k.shape[2], arena.k.shape[3]
    rows = ring.rows[slots]
    scale = arena.k_scale.reshape(-1, hk)[rows.clamp(min=0).long()].repeat_interleave(hv // hk, dim=2)
    return SimpleNamespace(rows=rows.to(torch.int32).contiguous(), u=arena.u.reshape(-1, hv, dv),
                           k=arena.k.reshape(-1, hk * dk), k_scale=arena.k_scale.reshape(-1, hk),
                           log_decay=arena.log_decay.reshape(-1, hv), w=(weight * scale).float().contiguous(),
                           decay=decay.float().contiguous())


def real_ring_rounds(read, write, device, heads: HeadShape = HEADS_9B, batch: int = 4, rounds: int = 3,
                     num_rounds: int = 8, max_size: int = 64, max_depth: int = 8, seed: int = 5) -> list[dict]:
    """A `PendingRing` of ``rounds`` rounds run for ``num_rounds`` consecutive rounds on real trees, the Gluon kernels
    fed from its tables (`ring_tables`): ``read(x, pool, slots, tree, ctx)`` for a read round, ``write(...)`` for a
    write round (``ctx``: the round's ``tables``, its arena position ``out`` where the launch writes its results, and
    the shipped ring's ``step`` and ``arena``). Every round is
    checked against the float64 recurrence run round after round: its outputs, the pool (untouched by a read round,
    the recurrence's state after a write round); each request accepts none, the root, its deepest or a random node.
    Returns each round's errors; raises on a wrong round. (`shipped_ring_launch` stands in for both launches on the
    CPU: it checks the tables and this harness.)"""
    import random
    from types import SimpleNamespace

    from bole_tune.kernels import PendingRing
    from bole_tune.kernels.reference import verify_reference
    from bole_tune.kernels.verify.self_check import accepted_error
    from bole_tune.workloads import make_inputs, make_tree, relative_error

    rng = random.Random(seed)
    ring = PendingRing(4 * batch, rounds, max_depth + 1, capacity=batch * max_size, max_requests=batch, device=device)
    arena = ring.results(heads, torch.bfloat16)
    pool = make_inputs(make_tree([1], device=device), heads.hk, heads.hv, heads.dk, heads.dv, torch.float32, device,
                       num_slots=4 * batch).state
    truth = pool.clone()
    slots = torch.tensor(rng.sample(range(4 * batch), batch), dtype=torch.int32, device=device)
    bound = accepted_error(torch.bfloat16)
    out = []
    for index in range(num_rounds):
        tree = make_tree([rng.randint(max_size // 2, max_size) for _ in range(batch)], "random", max_depth=max_depth,
                         seed=100 + index, device=device)
        x = make_inputs(tree, heads.hk, heads.hv, heads.dk, heads.dv, torch.bfloat16, device, seed=200 + index)
        step = ring.begin(tree)
        tables = ring_tables(ring, slots, arena)
        before = pool.clone()
        ctx = SimpleNamespace(tables=tables, out=arena.at(step.position, tree), step=step, arena=arena, heads=heads)
        res = (write if step.write else read)(x, pool, slots, tree, ctx)
        ref = verify_reference(x.q, x.k, x.v, x.g, x.beta, truth, slots, tree)
        row = {"round": index, "kind": "write" if step.write else "read", "tokens": int((tables.rows >= 0).sum()),
               "error": relative_error(res.o, ref.o)}
        if step.write:
            row["pool_error"] = relative_error(pool[slots.long()], truth[slots.long()])
        else:
            row["pool_untouched"] = bool(torch.equal(pool, before))
        out.append(row)
        print(f"real ring {row}", flush=True)
        if max(row["error"], row.get("pool_error", 0.0)) > bound or not row.get("pool_untouched", True):
            raise AssertionError(f"round {index}: {row}")
        sizes = tree.sizes
        choices = [rng.choice(["none", "root", "deepest", "any"]) for _ in range(batch)]
        depths = [tree.node_depth[tree.offsets[r]:tree.offsets[r + 1]].tolist() for r in range(batch)]
        accepted = torch.tensor([-1 if c == "none" else 0 if c == "root" else
                                 max(range(sizes[r]), key=depths[r].__getitem__) if c == "deepest" else
                                 rng.randrange(sizes[r]) for r, c in enumerate(choices)], device=device)
        truth = ref.committed(truth, slots, tree, accepted).float()
        ring.end(step, slots, accepted, validate=True)
    return out


def gluon_ring_launches(read_options: dict, write_options: dict):
    """(read, write) for `real_ring_rounds`: the Gluon ring read round and the Gluon fold of the tables' tokens."""
    def read(x, pool, slots, tree, ctx):
        return gluon_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots, tree, ring=ctx.tables, out=ctx.out,
                            **read_options)

    def write(x, pool, slots, tree, ctx):
        return gluon_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots, tree, fold=(ctx.tables.rows, ctx.tables),
                            fold_w=True, out=ctx.out, **write_options)
    return read, write


def shipped_ring_launch(x, pool, slots, tree, ctx):
    """`real_ring_rounds`' launch on any device: the shipped `tree_verify` on the ring's step, after checking that
    the state the round's `ring_tables` give (float64) is the shipped ring's `ring_states` (raises if not)."""
    from bole_tune.kernels import tree_verify
    from bole_tune.kernels.verify.ring import ring_states
    from bole_tune.workloads import relative_error

    if ctx.step.ring.held:
        mine = ring_state(pool, slots, ctx.tables, ctx.heads)[slots.long()]
        error = relative_error(mine, ring_states(pool, slots, ctx.step.ring, ctx.arena))
        if error > 1e-6:
            raise AssertionError(f"ring_tables: the tables' state is {error:.1e} from the shipped ring's")
    return tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots, tree, ring=ctx.step.layer(ctx.arena))


def ring_state(pool, slots, tokens, heads: HeadShape) -> torch.Tensor:
    """The pool a ring read round reads through, in float64: each request's slot ``exp(L) S + sum_j w_j u_j k_j^T``
    (``k_j`` the raw keys), the other slots as they are."""
    out = pool.double().clone()
    g = heads.hv // heads.hk
    for r, s in enumerate(slots.long().tolist()):
        rows = tokens.rows[r].long()
        m = rows >= 0
        rows = rows[m]
        k = tokens.k[rows].double().view(-1, heads.hk, heads.dk).repeat_interleave(g, dim=1)  # [m, hv, dk]
        u = tokens.u[rows].double() * tokens.w[r][m].double()[:, :, None]  # [m, hv, dv]
        out[s] = out[s] * tokens.decay[r].double()[:, None, None] + torch.einsum("jhv,jhk->hvk", u, k)
    return out


def compile_instance(batch: int):
    """(tree, inputs) on the CPU: a batch of 64-node random trees of 9B heads, what `compile_sm90` specialises on."""
    from bole_tune.workloads import make_inputs, make_tree

    tree = make_tree([B_T] * batch, "random", max_depth=8, seed=1, device="cpu")
    return tree, make_inputs(tree, HEADS_9B.hk, HEADS_9B.hv, HEADS_9B.dk, HEADS_9B.dv, torch.bfloat16, "cpu", seed=1)


def compile_sm90(fn, args, meta) -> dict:
    """`bole_tune.binaries.binary_report` of Gluon kernel ``fn`` compiled for sm_90 on ``args`` / ``meta``."""
    from bole_tune.binaries import binary_report

    report = binary_report(shipped_compile_sm90(args, meta, fn))
    report.pop("ops", None)
    return report


def dump(rows, path: str | None) -> None:
    """``rows`` as JSON to ``path`` (nothing without one)."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


def print_table(rows: list[dict], candidates: list[dict], label: str) -> None:
    """`gpu_run`'s rows as a markdown table: the shipped launch, then each candidate, per batch."""
    print("\n| 9B verify, us (errors o / state) | " + " | ".join(f"B={r['batch']} T=64" for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    print("| shipped | " + " | ".join(f"{r['shipped_us']:.1f} ({r['shipped_error']:.1e} / {r['shipped_state_error']:.1e})"
                                      for r in rows) + " |")
    for i, options in enumerate(candidates):
        cells = []
        for r in rows:
            e = r["runs"][i]
            cells.append(f"{e['us']:.1f} ({e['error']:.1e} / {e['state_error']:.1e})" if "us" in e
                         else e.get("status", "-")[:60])
        print(f"| {label} {' '.join(f'{k}={v}' for k, v in options.items())} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true", help="compile for sm_90 here and report registers")
    parser.add_argument("--b-k", type=int, default=32)
    parser.add_argument("--b-v", type=int, default=64)
    parser.add_argument("--maxnreg", type=int, help="--compile: cap the registers a thread at this")
    parser.add_argument("--alias-r", action="store_true", help="--compile: R' in the state parts' shared memory")
    parser.add_argument("--rows", action="store_true", help="--compile: the products as S Q^T, the state from registers")
    parser.add_argument("--tma", type=int, default=0, help="--compile: state tiles through a TMA ring of this many stages")
    parser.add_argument("--json")
    parser.add_argument("--batch", type=int, action="append", help="only this batch (repeatable)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--ablate", action="store_true", help="H200: time B=16 with parts of the work left out")
    parser.add_argument("--fold", action="store_true", help="H200: the folded round in Gluon at B=16, checked, timed")
    parser.add_argument("--quick", action="store_true", help="--ring: only the best read and write, with and without L2")
    parser.add_argument("--l2", action="store_true", help="H200: the next wave's inputs prefetched into L2")
    parser.add_argument("--warps8", action="store_true", help="H200: 8-warp programs (two warpgroups) against 4")
    parser.add_argument("--ring", action="store_true", help="H200: a ring's read and write rounds in Gluon, checked, timed")
    parser.add_argument("--trace", action="store_true", help="H200: each program's phases at B=16, global-timer stamps")
    parser.add_argument("--real-ring", action="store_true",
                        help="consecutive rounds of a shipped PendingRing (real tables) checked against float64: on "
                             "the H200 the Gluon read and write rounds, on the CPU the shipped kernels (the harness)")
    args = parser.parse_args()
    if args.compile:
        print(json.dumps(compile_report(args.b_k, args.b_v, maxnreg=args.maxnreg, alias_r=args.alias_r, rows=args.rows,
                                            tma_stages=args.tma)))
        return
    if args.real_ring:
        if torch.cuda.is_available():
            read, write = gluon_ring_launches(RING_CONFIGS[1], FOLD_WIDE_CONFIGS[0])
            rows = real_ring_rounds(read, write, "cuda", batch=(args.batch or [4])[0])
        else:
            rows = real_ring_rounds(shipped_ring_launch, shipped_ring_launch, "cpu",
                                    heads=HeadShape(hk=2, hv=4, dk=32, dv=32), batch=3, num_rounds=7, max_size=12,
                                    max_depth=4)
        dump(rows, args.json)
        return
    if not torch.cuda.is_available():
        sys.exit("no GPU here: run --compile, or on the H200")
    batch = (args.batch or [16])[0]
    if args.warps8 or args.l2:
        candidates = WARPS8_CANDIDATES if args.warps8 else L2_CANDIDATES
        rows = gpu_run(args.repeats, args.batch, candidates=candidates)
        dump(rows, args.json)
        print_table(rows, candidates, "gluon")
    elif args.ring:
        outs = [ring_run(args.repeats, b, quick=args.quick) for b in (args.batch or [16])]
        dump(outs, args.json)
        for o in outs:
            print_ring(o)
    elif args.fold:
        outs = [fold_run(args.repeats, b) for b in (args.batch or [16])]
        dump(outs, args.json)
        for out in outs:
            print_fold(out)
    elif args.trace:
        dump(trace_run(TRACE_CONFIGS, batch), args.json)
    elif args.ablate:
        dump(ablate_run(args.repeats, batch), args.json)
    else:
        rows = gpu_run(args.repeats, args.batch)
        dump(rows, args.json)
        print_table(rows, CANDIDATES, "gluon")


if __name__ == "__main__":
    main()
