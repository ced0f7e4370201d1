"""The resident verify written in Gluon, for the H200 (sm_90): trees of 33-64 nodes, 16-bit inputs.

A GPU-only path (`gluon_ready`). The portable Triton resident kernel (`resident.py`) stays what CI proves under
``TRITON_INTERPRET=1`` and what every other launch runs; this one is checked against the float64 reference on the
GPU (tests/test_gluon_verify.py) and by the planner's self-check before its first use in a process (a failure runs the
Triton resident kernel instead). The work is the same closed form (docs/math.md §2-§4), one 4-warp program per
(value head, request); what differs is where operands live, which Triton's ``tl.dot`` decides and Gluon lets the
kernel say (docs/math.md, "The Gluon verify"):

- every q, k and v row of the tree is requested at once by cp.async into shared memory (rows past the tree
  zero-filled); q and k feed every wgmma from there: ``Q K^T``, ``K K^T``, and ``Q S^T``, ``K S^T`` per state tile;
- the factors: ``X = (I + G)^-1`` by doubling on fp16 wgmma (``ceil(log2(d + 1))`` dependent products for a block
  ``d`` deep), ``W = X D_beta`` and ``M = C X D_beta`` stored
  to shared memory as fp16 (the readout's A operands), out of the registers through the state stream;
- ``S_pre`` streamed one ``[B_V, B_K]`` fp32 tile at a time (the next tile's load issued before the current tile's
  products), split into two bf16 parts in shared memory;
- per value tile ``R' = V - a_k (K S^T)`` scaled by its largest magnitude into fp16, ``U = W R'`` and
  ``O = a_q (Q S^T) + M R'``; u and o stored through row-contiguous layouts (``COALESCE``).

Three modes (``MODE``):

- 0, the verify;
- 1, a `PendingRing` read round: the slot read through its pending tokens, ``S' x = exp(L) S x +
  sum_j w_j (k_j . x) u_j``; the corrections ``D = [Q; K] K_p^T`` on wgmma, scaled into fp16, open each value tile's
  accumulation with the tokens' weighted updates ``diag(w) U_p`` (brought by cp.async, scaled into fp16); nothing is
  written to the pool;
- 2, a ring's write round: each state tile folded, ``S' = exp(L) S + sum_j (w_j u_j) k_j^T`` (the weighted updates
  in three bf16 parts whose products with the 16-bit keys are exact; the next key chunk's update issued before this
  tile's products), written back in place by TMA, then verified.

In modes 1 and 2 the ring's weights ``w_j = exp(L - L_j) r_k,j`` and decay ``exp(L)`` are worked out in the kernel
from the slot's table (`ring_loads`, `ring_weights`), as the Triton kernels do, after the factors: their loads
depend on the table's rows, and a warp that issues a load whose address is not there yet waits (weights applied to
``D`` before the solve made the B=16 read round 2 us slower; BENCHMARKS.md, "Twenty-third session").
"""

from __future__ import annotations

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    GLUON_IMPORT_ERROR = ""
except ImportError as error:  # another Triton: the Triton kernels run
    gluon = None
    GLUON_IMPORT_ERROR = f"Gluon is not importable from this Triton ({error})"

from bole_tune.config import KernelConfig

from ..common import LOG_DECAY_FLOOR

B_T = 64
"""Rows a program solves: trees of at most 64 nodes (the planner sends it trees of 33-64)."""
TILES = (32, 64)
"""The ``b_k`` and ``b_v`` the kernel takes (`tile_refusal`): its tiles are a `KernelConfig`'s (``gluon=1``), tuned per
bucket like the Triton kernels' (profiles/search_space.yaml) and read from the tuning database by the planner."""
STAGES = (1, 2)
"""State tiles in flight (``num_stages``): 1 loads each ``[b_v, b_k]`` tile when its products start, 2 issues the next
tile's load before the current tile's products."""
RING_TILES = (32, 64)
"""The ``(b_k, b_v)`` a bucket's tuned Gluon config holds (`bole_tune.search_space.gluon_bucket_refusal`): a bucket's
verify config also runs a `PendingRing`'s read rounds, and its write rounds where the bucket's ring write is not
tuned apart. At 64/64 the read round spills (48 bytes) and the write round holds 135,168 B of shared memory (one
program an SM; 110,592 B at 32/64, with ``R'`` in the state parts' bytes): on the H200 at B=16 T=64 a ring of 3
rounds took 87.2 us a round with 64/64 against 59.9 with 32/64, though the verify alone is 4% faster at 64/64 (47.2
against 49.0 us); 32-wide value tiles do not run ring rounds (`tile_refusal`)."""
UNTUNED_CONFIG = KernelConfig(32, 64, 4, 2, gluon=1)
"""What a bucket without a tuned entry runs on this kernel (`planner.Planner.plan`): not a tuned value but the tiles
its first version was written and measured with (BENCHMARKS.md, "Twenty-third session"); a tuned entry replaces it."""
HEAD_DIMS = (128, 128)
"""``(dk, dv)`` this path was measured and checked on (Qwen3.5 / Qwen3-Next GDN heads)."""
MAX_RING_WIDTH = 32
"""The most table entries a `PendingRing` round may read (`RingRound.width`) and run on the Gluon verify (R = 3 rounds
of 9-node paths). A write round at width 32 holds 110,592 B of shared memory, two programs an SM; wider rounds run
the Triton kernels (a ring of four rounds of 9-node paths: its write round, its read rounds reading 16-32)."""
MODES = {"verify": 0, "read": 1, "write": 2}
L2_AHEAD_PER_SM = {"verify": 3, "read": 0, "write": 0}
"""How far ahead, in programs per multiprocessor, each program of a mode requests a later program's inputs into L2
(``prefetch.global.L2`` of its q, k and v rows and its state, after its own q and k rows have arrived): the launch
position ``i + L2_AHEAD_PER_SM * SMs`` is roughly the program that starts on this multiprocessor a wave or so later
(two programs an SM), so its memory latency passes while this one computes. 0: none. Measured on the H200
(`lab/gluon_l2.py`, 9B bf16, 64-node trees, medians of two alternating turns, BENCHMARKS.md "Twenty-ninth
session"): the verify at B=16 49.0 us with none, 47.4 / 47.3 / 47.2 at 2 / 3 / 4, at B=32 94.9 against 91.2 / 89.8 /
91.5; a ring's read round at B=16 56.9 against 55.9-57.3, at B=32 107.9 against 110.4-111.1 (slower: its tokens'
rows compete for L2); the write round unchanged at 0 and 1.7-4% slower at 3. Launches of one wave (B <= 8) have no
later program to prefetch for."""
H200_SMS = 132
"""Multiprocessors the launch's prefetch distance is worked out for where no GPU is asked (`compile_report` on the
CPU): the H200's."""


def gluon_ring_rounds(max_path: int, most: int) -> int:
    """The most rounds, up to ``most``, a `PendingRing` of paths of up to ``max_path`` nodes may keep and still run
    its rounds on the Gluon verify (tables at most `MAX_RING_WIDTH` wide: 3 for 9-node paths, 4 for 8-node ones);
    0 where not even one round fits."""
    from .ring import PendingRing

    return max((r for r in range(1, most + 1) if PendingRing.table_width(r, max_path) <= MAX_RING_WIDTH), default=0)


def gluon_ready(device) -> str:
    """"" when the Gluon path can run on ``device``, else why not (no Gluon, not a CUDA device, not sm_90: the
    kernel's wgmma and TMA are Hopper's)."""
    if gluon is None:
        return GLUON_IMPORT_ERROR
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"not a CUDA device ({device})"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}; the Gluon verify is written for sm_90"
    return ""


def tile_refusal(config, mode: str = "verify") -> str:
    """"" when the kernel runs ``config``'s tiles in ``mode`` ("verify", "read", "write"), else why not: ``b_k`` and
    ``b_v`` in `TILES`, 4 warps (one warpgroup: every wgmma is the whole program's), ``num_stages`` in `STAGES`; a
    ring's rounds ``b_v`` 64 (a write round's fold has its state tiles as wgmma accumulators, 64 rows)."""
    if config.b_k not in TILES or config.b_v not in TILES:
        return f"the Gluon verify takes tiles b_k, b_v in {TILES}, not {config.b_k}/{config.b_v}"
    if config.num_warps != 4:
        return f"the Gluon verify runs 4 warps (one warpgroup), not {config.num_warps}"
    if config.num_stages not in STAGES:
        return f"the Gluon verify keeps {' or '.join(map(str, STAGES))} state tiles in flight, not {config.num_stages}"
    if mode in ("read", "write") and config.b_v != 64:
        # a write round folds [64, b_k] state tiles on wgmma (64 rows); a read round at 64/32 ran into an illegal
        # memory access on the H200 (32/32 did not; BENCHMARKS.md, "Twenty-fourth session"): Triton's kernel runs
        # ring rounds with 32-wide value tiles
        return f"a ring's {mode} round on the Gluon verify takes 64-wide value tiles, not b_v = {config.b_v}"
    return ""


if gluon is not None:

    @gluon.jit
    def gluon_verify_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, state_indices_ptr,
        offsets_ptr, dfs_enter_ptr, dfs_exit_ptr, block_depth_ptr,
        o_ptr, u_ptr, logp_ptr, k_out_ptr, k_scale_ptr, committed_ptr, s_desc,
        ring_rows_ptr, ring_last_ptr, ring_u_ptr, ring_k_ptr, ring_k_scale_ptr, ring_logp_ptr, ring_row,
        scale, H_V, H_K,
        stride_q_n, stride_q_h, stride_k_n, stride_k_h, stride_v_n, stride_v_h,
        stride_g_n, stride_g_h, stride_beta_n, stride_beta_h,
        stride_s_slot, stride_s_h, stride_s_v,
        D_K: gl.constexpr, D_V: gl.constexpr, B_T: gl.constexpr, B_K: gl.constexpr, B_V: gl.constexpr,
        G_FLOOR: gl.constexpr, MODE: gl.constexpr, B_P: gl.constexpr, COALESCE: gl.constexpr,
        ALIAS_R: gl.constexpr, PREFETCH: gl.constexpr,
        MMA: gl.constexpr, MMA_V: gl.constexpr, MMA_P: gl.constexpr, LD: gl.constexpr, LD_S: gl.constexpr,
        LD_V: gl.constexpr, LD_U: gl.constexpr, LD_O: gl.constexpr, LD_P: gl.constexpr, LD_UP: gl.constexpr,
        LD_KP: gl.constexpr, LD_W: gl.constexpr,
        QK_SHARED: gl.constexpr, X_SHARED: gl.constexpr, S_SHARED: gl.constexpr, R_SHARED: gl.constexpr,
        S32_SHARED: gl.constexpr, V_SHARED: gl.constexpr, KP_SHARED: gl.constexpr, DP_SHARED: gl.constexpr,
        UP_SHARED: gl.constexpr, L2_AHEAD: gl.constexpr, LD_L2: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        RING: gl.constexpr = MODE == 1
        FOLD: gl.constexpr = MODE == 2
        NK: gl.constexpr = D_K // B_K
        NV: gl.constexpr = D_V // B_V
        ROW: gl.constexpr = gl.SliceLayout(1, MMA)
        COL: gl.constexpr = gl.SliceLayout(0, MMA)
        ROW_V: gl.constexpr = gl.SliceLayout(1, MMA_V)
        COL_V: gl.constexpr = gl.SliceLayout(0, MMA_V)

        i_h = gl.program_id(0).to(gl.int64)
        i_r = gl.program_id(1).to(gl.int64)
        group = H_V // H_K
        i_hk = i_h // group
        bos = gl.load(offsets_ptr + i_r).to(gl.int64)
        num_nodes = gl.load(offsets_ptr + i_r + 1).to(gl.int64) - bos
        slot = gl.load(state_indices_ptr + i_r).to(gl.int64)
        gl.store(committed_ptr + i_r, 0, mask=i_h == 0)
        write_keys = (i_h % group) == 0

        # the first state tile is requested before anything else: its latency hides behind the factors
        p_state = state_ptr + slot * stride_s_slot + i_h * stride_s_h
        o_sv = gl.arange(0, B_V, layout=gl.SliceLayout(1, LD_S))
        o_sk = gl.arange(0, B_K, layout=gl.SliceLayout(0, LD_S))
        s_offsets = o_sv[:, None] * stride_s_v + o_sk[None, :]
        s_row = ((slot * H_V + i_h) * D_V).to(gl.int32)  # the head's first row of the pool's TMA view ([-1, D_K])
        b_s = gl.load(p_state + s_offsets, eviction_policy="evict_first")

        # every q, k and v row of the tree requested at once (cp.async; rows past the tree zero-filled): one memory
        # latency for all of them, the v tiles arriving while the factors and the state stream run
        q_smem = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [NK, B_T, B_K], QK_SHARED)
        k_smem = gl.allocate_shared_memory(k_ptr.dtype.element_ty, [NK, B_T, B_K], QK_SHARED)
        o_t = gl.arange(0, B_T, layout=gl.SliceLayout(1, LD))
        m_t = o_t < num_nodes
        p_q = q_ptr + bos * stride_q_n + i_hk * stride_q_h
        p_k = k_ptr + bos * stride_k_n + i_hk * stride_k_h
        p_kout = k_out_ptr + bos * (H_K * D_K) + i_hk * D_K
        p_v = v_ptr + bos * stride_v_n + i_h * stride_v_h
        for c in gl.static_range(NK):
            o_k = c * B_K + gl.arange(0, B_K, layout=gl.SliceLayout(0, LD))
            async_copy.async_copy_global_to_shared(q_smem.index(c), p_q + o_t[:, None] * stride_q_n + o_k[None, :],
                                                   mask=m_t[:, None])
            async_copy.async_copy_global_to_shared(k_smem.index(c), p_k + o_t[:, None] * stride_k_n + o_k[None, :],
                                                   mask=m_t[:, None])
        if RING or FOLD:
            # the slot's pending tokens' raw keys join the first group (the B operand of their products): the first
            # B_P entries of its table row (ring_row long)
            p_table = ring_rows_ptr + slot * ring_row
            rows_p, m_p = table_rows(p_table, B_P, gl.SliceLayout(1, LD_KP))
            kp_smem = gl.allocate_shared_memory(k_ptr.dtype.element_ty, [NK, B_P, B_K], KP_SHARED)
            for c in gl.static_range(NK):
                o_kp = c * B_K + gl.arange(0, B_K, layout=gl.SliceLayout(0, LD_KP))
                async_copy.async_copy_global_to_shared(
                    kp_smem.index(c), ring_k_ptr + i_hk * D_K + rows_p[:, None] * (H_K * D_K) + o_kp[None, :],
                    mask=m_p[:, None])
        async_copy.commit_group()
        v_smem = gl.allocate_shared_memory(v_ptr.dtype.element_ty, [NV, B_T, B_V], V_SHARED)
        o_tv = gl.arange(0, B_T, layout=gl.SliceLayout(1, LD_V))
        for t in gl.static_range(NV):
            o_vl = t * B_V + gl.arange(0, B_V, layout=gl.SliceLayout(0, LD_V))
            async_copy.async_copy_global_to_shared(v_smem.index(t), p_v + o_tv[:, None] * stride_v_n + o_vl[None, :],
                                                   mask=(o_tv < num_nodes)[:, None])
        if RING or FOLD:
            # and their fp32 updates, every value tile: the second group
            u32_smem = gl.allocate_shared_memory(gl.float32, [NV, B_P, B_V], V_SHARED)
            rows_u, m_u = table_rows(p_table, B_P, gl.SliceLayout(1, LD_UP))
            for t in gl.static_range(NV):
                o_vu = t * B_V + gl.arange(0, B_V, layout=gl.SliceLayout(0, LD_UP))
                async_copy.async_copy_global_to_shared(
                    u32_smem.index(t), ring_u_ptr + rows_u[:, None] * (H_V * D_V) + i_h * D_V + o_vu[None, :],
                    mask=m_u[:, None])
        async_copy.commit_group()

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
        async_copy.wait_group(1)
        gl.thread_barrier()
        ssq_q = gl.zeros([B_T], gl.float32, layout=gl.SliceLayout(1, LD))
        ssq_k = gl.zeros([B_T], gl.float32, layout=gl.SliceLayout(1, LD))
        for c in gl.static_range(NK):
            o_k = c * B_K + gl.arange(0, B_K, layout=gl.SliceLayout(0, LD))
            b_q = q_smem.index(c).load(LD)
            b_k = k_smem.index(c).load(LD)
            ssq_q += gl.sum(b_q.to(gl.float32) * b_q.to(gl.float32), axis=1)
            ssq_k += gl.sum(b_k.to(gl.float32) * b_k.to(gl.float32), axis=1)
            gl.store(p_kout + o_t[:, None] * (H_K * D_K) + o_k[None, :], b_k, mask=m_t[:, None] & write_keys)
        fence_async_shared()
        gl.thread_barrier()
        if L2_AHEAD > 0:
            # a later program's inputs requested into L2 while this one works (its own are in): about the program
            # that starts on this multiprocessor a wave later
            l2_ahead(i_r * H_V + i_h + L2_AHEAD, gl.num_programs(0) * gl.num_programs(1), H_V, group, offsets_ptr,
                     state_indices_ptr, q_ptr, k_ptr, v_ptr, state_ptr, stride_q_n, stride_q_h, stride_k_n,
                     stride_k_h, stride_v_n, stride_v_h, stride_s_slot, stride_s_h, stride_s_v, D_K, D_V, B_T,
                     2, LD_L2)  # 16-bit inputs

        # Gram products on wgmma, from shared memory
        b_qk = gl.zeros([B_T, B_T], gl.float32, layout=MMA)
        b_kk = gl.zeros([B_T, B_T], gl.float32, layout=MMA)
        for c in gl.static_range(NK):
            b_qk = warpgroup_mma(q_smem.index(c), k_smem.index(c).permute((1, 0)), b_qk, is_async=True)
            b_kk = warpgroup_mma(k_smem.index(c), k_smem.index(c).permute((1, 0)), b_kk, is_async=True)
        if RING or FOLD:
            # what the tokens' weights are worked out from, requested now (the table's rows arrived for the keys'
            # copies: nothing waits here) and used after the factors, their latency behind the solve
            w_loads = ring_loads(p_table, ring_last_ptr + slot * ring_row, ring_logp_ptr, ring_k_scale_ptr, i_h, i_hk,
                                 H_V, H_K, B_P, LD_W)
        r_q_i = scale / gl.sqrt(gl.convert_layout(ssq_q, ROW) + 1e-6)
        r_k_i = 1.0 / gl.sqrt(gl.convert_layout(ssq_k, ROW) + 1e-6)
        r_k_j = 1.0 / gl.sqrt(gl.convert_layout(ssq_k, COL) + 1e-6)
        m_anc = (enter_j[None, :] <= enter_i[:, None]) & (enter_i[:, None] <= exit_j[None, :])
        logp_i = gl.sum(gl.where(m_anc, g_j[None, :], 0.0), axis=1)
        logp_j = gl.convert_layout(logp_i, COL)
        decay = gl.exp(gl.where(m_anc, logp_i[:, None] - logp_j[None, :], float("-inf")))
        b_qk, b_kk = warpgroup_mma_wait(num_outstanding=0, deps=(b_qk, b_kk))
        if RING:
            # D_q = Q K_p^T, D_k = K K_p^T (raw q, k and keys: a_q, a_k scale the rows later, the weights the
            # updates), scaled by their largest magnitude into fp16 in shared memory: the A operands of D diag(w) U_p
            b_dq = gl.zeros([B_T, B_P], gl.float32, layout=MMA_P)
            b_dk = gl.zeros([B_T, B_P], gl.float32, layout=MMA_P)
            for c in gl.static_range(NK):
                b_dq = warpgroup_mma(q_smem.index(c), kp_smem.index(c).permute((1, 0)), b_dq, is_async=True)
                b_dk = warpgroup_mma(k_smem.index(c), kp_smem.index(c).permute((1, 0)), b_dk, is_async=True)
            b_dq, b_dk = warpgroup_mma_wait(num_outstanding=0, deps=(b_dq, b_dk))
            # one scale for both: the corrections open the state products' accumulation chain
            ds = gl.maximum(gl.max(gl.max(gl.abs(b_dq), axis=1), axis=0), gl.max(gl.max(gl.abs(b_dk), axis=1), axis=0))
            ds = gl.where(ds > 0.0, ds, 1.0)
            dq_smem = gl.allocate_shared_memory(gl.float16, [B_T, B_P], DP_SHARED)
            dk_smem = gl.allocate_shared_memory(gl.float16, [B_T, B_P], DP_SHARED)
            dq_smem.store((b_dq / ds).to(gl.float16))
            dk_smem.store((b_dk / ds).to(gl.float16))

        # the factors, into shared memory as fp16 wgmma operands (W and M)
        w_smem = gl.allocate_shared_memory(gl.float16, [B_T, B_T], X_SHARED)
        m_smem = gl.allocate_shared_memory(gl.float16, [B_T, B_T], X_SHARED)
        x_smem = gl.allocate_shared_memory(gl.float16, [B_T, B_T], X_SHARED)
        zeros_t = gl.zeros([B_T, B_T], gl.float32, layout=MMA)
        solve_factors(w_smem, m_smem, x_smem, b_qk, b_kk, m_anc, o_i, o_j, beta_i, beta_j, r_q_i, r_k_i, r_k_j, decay,
                      block_depth_ptr + i_r, zeros_t)
        async_copy.wait_group(0)
        gl.thread_barrier()
        if FOLD:
            weight_pc, fold_decay = ring_weights(w_loads, B_P, LD_W)
            weight_pc = gl.convert_layout(weight_pc, gl.SliceLayout(0, LD_P))
        if RING:
            # the tokens' weighted updates w_j u_j scaled by their largest magnitude into fp16, every value tile: the
            # B operands of D (diag(w) U_p), which open each tile's accumulation; the state tiles are scaled by
            # exp(L) / (ds us) as they are split, and the tile's products by ds us after it
            ring_w, ring_decay = ring_weights(w_loads, B_P, LD_W)
            ring_w = gl.convert_layout(ring_w, gl.SliceLayout(1, LD_UP))
            us = 0.0
            for t in gl.static_range(NV):
                us = gl.maximum(us, gl.max(gl.max(gl.abs(u32_smem.index(t).load(LD_UP) * ring_w[:, None]), axis=1),
                                           axis=0))
            us = gl.where(us > 0.0, us, 1.0)
            up16_smem = gl.allocate_shared_memory(gl.float16, [NV, B_P, B_V], UP_SHARED)
            for t in gl.static_range(NV):
                up16_smem.index(t).store((u32_smem.index(t).load(LD_UP) * (ring_w / us)[:, None]).to(gl.float16))
            fence_async_shared()
            gl.thread_barrier()
            ring_c = ds * us
            ring_f = ring_decay / ring_c
        b_decay = gl.exp(logp_i)
        gl.store(logp_ptr + (bos + o_i) * H_V + i_h, logp_i, mask=m_i)
        gl.store(k_scale_ptr + (bos + o_i) * H_K + i_hk, r_k_i, mask=m_i & write_keys)
        a_q = gl.convert_layout(b_decay * r_q_i, ROW_V)
        a_k = gl.convert_layout(b_decay * r_k_i, ROW_V)

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
        zeros_v = gl.zeros([B_V, B_K], gl.float32, layout=LD_S)
        zeros_o = gl.zeros([B_T, B_V], gl.float32, layout=MMA_V)
        if FOLD:
            # the folded tiles leave by TMA from one staging buffer, in the bytes of X (free once the factors are
            # solved) where a tile is X's size
            if B_V * B_K == B_T * B_T // 2:
                s_out = x_smem._reinterpret(gl.float32, [B_V, B_K], S32_SHARED)
            else:
                s_out = gl.allocate_shared_memory(gl.float32, [B_V, B_K], S32_SHARED)
        A_FOLD: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=LD_S, k_width=2)
        for t in gl.static_range(NV):
            b_qs = zeros_o
            b_ks = zeros_o
            if RING:
                b_qs = warpgroup_mma(dq_smem, up16_smem.index(t), zeros_o, use_acc=False, is_async=True)
                b_ks = warpgroup_mma(dk_smem, up16_smem.index(t), zeros_o, use_acc=False, is_async=True)
            if FOLD:
                # the tokens' weighted updates w_j u_j of this value tile, [B_V, B_P], in three bf16 parts that sum
                # to them: with 16-bit keys each part's products are exact
                up_hi, up_mid, up_lo = fold_operands(u32_smem.index(t).permute((1, 0)).load(LD_P), weight_pc, A_FOLD)
            for c in gl.static_range(NK):
                n = t * NK + c
                if PREFETCH:
                    # the next tile's load, issued before this tile's products (the last one wraps to the first:
                    # unused)
                    t_next = ((n + 1) % (NV * NK)) // NK
                    c_next = (n + 1) % NK
                    b_s_next = gl.load(p_state + t_next * B_V * stride_s_v + c_next * B_K + s_offsets,
                                       eviction_policy="evict_first")
                elif n > 0:  # this tile's load, now (the first one was issued before the factors)
                    b_s = gl.load(p_state + t * B_V * stride_s_v + c * B_K + s_offsets, eviction_policy="evict_first")
                if FOLD:
                    # S' = exp(L) S + sum_j (w_j u_j) k_j^T on this tile (LD_S is the wgmma accumulator layout here):
                    # the update does not depend on S, so the next chunk's is issued before this tile's products
                    if c == 0:
                        d_cur = fold_update(up_hi, up_mid, up_lo, kp_smem.index(0), zeros_v)
                    else:
                        d_cur = d_next
                    d_cur = warpgroup_mma_wait(num_outstanding=0, deps=(d_cur,))
                    if c + 1 < NK:
                        d_next = fold_update(up_hi, up_mid, up_lo, kp_smem.index(c + 1), zeros_v)
                    b_s = b_s * fold_decay + d_cur
                    # written back in place by TMA (the staging buffer's previous tile stored first)
                    tma.store_wait(0)
                    gl.thread_barrier()
                    s_out.store(b_s)
                    fence_async_shared()
                    gl.thread_barrier()
                    tma.async_copy_shared_to_global(s_desc, [s_row + t * B_V, c * B_K], s_out)
                if RING:
                    b_s = b_s * ring_f
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
                if PREFETCH:
                    b_s = b_s_next
            if RING:
                b_qs = b_qs * ring_c
                b_ks = b_ks * ring_c
            # the readout of this value tile
            o_vv = t * B_V + gl.arange(0, B_V, layout=COL_V)
            b_v = v_smem.index(t).load(MMA_V).to(gl.float32)
            b_r = b_v - a_k[:, None] * b_ks
            r_max = gl.max(gl.max(gl.abs(b_r), axis=1), axis=0)
            r_scale = gl.where(r_max > 0.0, r_max, 1.0)
            gl.thread_barrier()
            r_smem.store((b_r / r_scale).to(gl.float16))
            fence_async_shared()
            gl.thread_barrier()
            b_u = warpgroup_mma(w_smem, r_smem, zeros_o, use_acc=False, is_async=True)
            b_o = warpgroup_mma(m_smem, r_smem, zeros_o, use_acc=False, is_async=True)
            b_u, b_o = warpgroup_mma_wait(num_outstanding=0, deps=(b_u, b_o))
            b_u = b_u * r_scale
            b_o = b_o * r_scale + a_q[:, None] * b_qs
            if COALESCE:
                # through row-contiguous layouts: 16-byte stores, whole rows a warp
                o_iu = gl.arange(0, B_T, layout=gl.SliceLayout(1, LD_U))
                o_vu2 = t * B_V + gl.arange(0, B_V, layout=gl.SliceLayout(0, LD_U))
                gl.store(p_u + o_iu[:, None] * (H_V * D_V) + o_vu2[None, :], gl.convert_layout(b_u, LD_U),
                         mask=(o_iu < num_nodes)[:, None])
                o_io = gl.arange(0, B_T, layout=gl.SliceLayout(1, LD_O))
                o_vo = t * B_V + gl.arange(0, B_V, layout=gl.SliceLayout(0, LD_O))
                gl.store(p_o + o_io[:, None] * (H_V * D_V) + o_vo[None, :],
                         gl.convert_layout(b_o.to(o_ptr.dtype.element_ty), LD_O), mask=(o_io < num_nodes)[:, None])
            else:
                out_offsets = o_iv[:, None] * (H_V * D_V) + o_vv[None, :]
                gl.store(p_u + out_offsets, b_u, mask=m_iv[:, None])
                gl.store(p_o + out_offsets, b_o.to(o_ptr.dtype.element_ty), mask=m_iv[:, None])
        if FOLD:
            tma.store_wait(0)

    @gluon.jit
    def table_rows(p_table, B_P: gl.constexpr, LAYOUT: gl.constexpr):
        """A token table's ``B_P`` entries at ``p_table`` as rows (int64; an entry of -1, none, as row 0) and which
        are real."""
        rows = gl.load(p_table + gl.arange(0, B_P, layout=LAYOUT)).to(gl.int64)
        real = rows >= 0
        return gl.where(real, rows, 0), real

    @gluon.jit
    def ring_loads(p_rows, p_last, logp_ptr, k_scale_ptr, i_h, i_hk, H_V, H_K, B_P: gl.constexpr,
                   LAYOUT: gl.constexpr):
        """What `ring_weights` works from, requested for a `PendingRing` slot's table at ``p_rows`` / ``p_last``
        (``[B_P]`` in ``LAYOUT``): which entries are tokens, their ``last`` flags, ``logP`` and key scales."""
        rows, real = table_rows(p_rows, B_P, LAYOUT)
        last = gl.load(p_last + gl.arange(0, B_P, layout=LAYOUT))
        logp = gl.load(logp_ptr + rows * H_V + i_h, mask=real, other=0.0)
        scale = gl.load(k_scale_ptr + rows * H_K + i_hk, mask=real, other=0.0)
        return real, last, logp, scale

    @gluon.jit
    def ring_weights(loads, B_P: gl.constexpr, LAYOUT: gl.constexpr):
        """A `PendingRing` slot's token weights ``exp(L - L_j) r_k,j`` (``[B_P]`` in ``LAYOUT``, 0 past its tokens)
        and its decay ``exp(L)`` from `ring_loads` (docs/math.md §4, "A ring of pending rounds"): with ``t`` the
        accepted nodes' ``logP`` (the entries flagged ``last``, 0 elsewhere), ``L - L_j = sum_{i >= j} t_i - logP_j``
        and ``L = sum_i t_i`` (the suffix sums by a reversed scan)."""
        real, last, logp, scale = loads
        ends = gl.where(real & (last != 0), logp, 0.0)
        suffix = gl.associative_scan(ends, 0, _add, reverse=True)
        weight = gl.where(real, gl.exp(suffix - logp) * scale, 0.0)
        return weight, gl.exp(gl.sum(ends, axis=0))

    @gluon.jit
    def l2_ahead(lin, n_programs, H_V, group, offsets_ptr, state_indices_ptr, q_ptr, k_ptr, v_ptr, state_ptr,
                 stride_q_n, stride_q_h, stride_k_n, stride_k_h, stride_v_n, stride_v_h, stride_s_slot, stride_s_h,
                 stride_s_v, D_K: gl.constexpr, D_V: gl.constexpr, B_T: gl.constexpr, IN_BYTES: gl.constexpr,
                 LD_L2: gl.constexpr):
        """``prefetch.global.L2`` of the inputs of the program at launch position ``lin`` (none past the launch's
        ``n_programs``; the grid is (value head, request), heads fastest): its tree's q, k and v rows and its head's
        fp32 state, one prefetch per 128-byte line."""
        if lin < n_programs:
            h = lin % H_V
            r = lin // H_V
            bos = gl.load(offsets_ptr + r).to(gl.int64)
            n = gl.load(offsets_ptr + r + 1).to(gl.int64) - bos
            slot = gl.load(state_indices_ptr + r).to(gl.int64)
            K_LINES: gl.constexpr = D_K * IN_BYTES // 128
            V_LINES: gl.constexpr = D_V * IN_BYTES // 128
            S_LINES: gl.constexpr = D_K * 4 // 128
            o_t = gl.arange(0, B_T, layout=gl.SliceLayout(1, LD_L2))
            rows = bos + o_t
            o_kl = gl.arange(0, K_LINES, layout=gl.SliceLayout(0, LD_L2)) * (128 // IN_BYTES)
            m_k = (o_t < n)[:, None] & (o_kl >= 0)[None, :]
            l2_prefetch(q_ptr + rows[:, None] * stride_q_n + (h // group) * stride_q_h + o_kl[None, :], m_k)
            l2_prefetch(k_ptr + rows[:, None] * stride_k_n + (h // group) * stride_k_h + o_kl[None, :], m_k)
            o_vl = gl.arange(0, V_LINES, layout=gl.SliceLayout(0, LD_L2)) * (128 // IN_BYTES)
            l2_prefetch(v_ptr + rows[:, None] * stride_v_n + h * stride_v_h + o_vl[None, :],
                        (o_t < n)[:, None] & (o_vl >= 0)[None, :])
            o_sl = gl.arange(0, S_LINES, layout=gl.SliceLayout(0, LD_L2)) * 32
            p_s = state_ptr + slot * stride_s_slot + h * stride_s_h
            for c in gl.static_range(D_V // B_T):  # the head's D_V state rows, B_T at a time
                l2_prefetch(p_s + (c * B_T + o_t)[:, None] * stride_s_v + o_sl[None, :],
                            (o_t >= 0)[:, None] & (o_sl >= 0)[None, :])

    @gluon.jit
    def l2_prefetch(ptrs, mask):
        """One ``prefetch.global.L2`` per masked-in pointer (inline PTX: the GPU-only path)."""
        gl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                                  "=r,l,r", [ptrs, mask.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def bf16_parts(x):
        """fp32 ``x`` as three bf16 parts that sum to it (8 + 8 + 8 significant bits)."""
        hi = x.to(gl.bfloat16)
        rest = x - hi.to(gl.float32)
        mid = rest.to(gl.bfloat16)
        return hi, mid, (rest - mid.to(gl.float32)).to(gl.bfloat16)

    @gluon.jit
    def fold_operands(b_up, weight, A_FOLD: gl.constexpr):
        """A value tile's updates ``u_j`` (``b_up`` ``[B_V, B_P]`` fp32) weighted by ``w_j`` (``weight``), as their
        three bf16 parts in the fold's A-operand layout."""
        hi, mid, lo = bf16_parts(b_up * weight[None, :])
        return gl.convert_layout(hi, A_FOLD), gl.convert_layout(mid, A_FOLD), gl.convert_layout(lo, A_FOLD)

    @gluon.jit
    def fold_update(up_hi, up_mid, up_lo, kp, zeros):
        """A fold's update of one state tile, ``(w u)^T K_p`` from the weighted updates' three bf16 parts and the
        tokens' keys ``kp`` (shared memory), issued and not waited for."""
        d = warpgroup_mma(up_hi, kp, zeros, use_acc=False, is_async=True)
        d = warpgroup_mma(up_mid, kp, d, is_async=True)
        return warpgroup_mma(up_lo, kp, d, is_async=True)

    @gluon.jit
    def solve_factors(w_smem, m_smem, x_smem, b_qk, b_kk, m_anc, o_i, o_j, beta_i, beta_j, r_q_i, r_k_i, r_k_j,
                      decay, p_depth, zeros_t):
        """A head's factors into shared memory as fp16 wgmma operands: ``A = -G`` and ``C`` first, then
        ``X = (I + G)^-1`` by doubling, leaving ``W = X D_beta`` in ``w_smem`` and ``M = C X D_beta`` in ``m_smem``.

        ``G`` links a node to its proper ancestors only, so ``A^m = 0`` past the block's depth ``d`` (at ``p_depth``)
        and ``X = (I + T_0)(I + T_1) ... (I + T_{L-1})`` with ``T_0 = A``, ``T_l = T_{l-1}^2`` and ``2^L > d``. At each
        level the square ``T_l`` and the product's step ``P <- P + P T_{l-1}`` read ``T_{l-1}`` from shared memory
        and are issued together (``P``: fp32 accumulator, fp16 A operand from registers), so depth ``d`` costs
        ``ceil(log2(d + 1))`` dependent wgmma steps where level sweeps ``Y <- A (I + Y)`` cost ``d``. The powers sit
        in ``w_smem`` and ``x_smem`` by turns. Levels are static up to depth 63 (``B_T = 64``); each runs only where
        the block is that deep."""
        A_P: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=zeros_t.type.layout, k_width=2)
        diag = o_i[:, None] == o_j[None, :]
        b_a = gl.where(m_anc & (o_i[:, None] != o_j[None, :]),
                       -(beta_i * r_k_i)[:, None] * decay * r_k_j[None, :] * b_kk, 0.0).to(gl.float16)
        w_smem.store(b_a)
        m_smem.store((r_q_i[:, None] * decay * r_k_j[None, :] * b_qk).to(gl.float16))
        b_p = gl.where(diag, 1.0, b_a.to(gl.float32))  # P = I + T_0
        depth = gl.load(p_depth)
        fence_async_shared()
        gl.thread_barrier()
        for level in gl.static_range(1, 7):
            if level % 2 == 1:  # T_{level-1} in src; T_level, where it is not 0, into dst
                src = w_smem
                dst = x_smem
            else:
                src = x_smem
                dst = w_smem
            if (1 << level) <= depth:  # T_level is not 0; P takes T_{level-1} from level 2 on
                b_t = warpgroup_mma(src, src, zeros_t, use_acc=False, is_async=True)
                if level >= 2:
                    b_p = warpgroup_mma(gl.convert_layout(b_p.to(gl.float16), A_P), src, b_p, is_async=True)
                b_t = warpgroup_mma_wait(num_outstanding=0, deps=(b_t,))
                if level >= 2:
                    b_p = warpgroup_mma_wait(num_outstanding=0, deps=(b_p,))
                gl.thread_barrier()
                dst.store(b_t.to(gl.float16))
                fence_async_shared()
                gl.thread_barrier()
            elif (1 << level) <= 2 * depth:  # the last level (2^(level-1) <= d < 2^level): P takes T_{level-1}
                if level >= 2:
                    b_p = warpgroup_mma(gl.convert_layout(b_p.to(gl.float16), A_P), src, b_p, is_async=True)
                    b_p = warpgroup_mma_wait(num_outstanding=0, deps=(b_p,))
        gl.thread_barrier()
        x_smem.store(b_p.to(gl.float16))
        fence_async_shared()
        gl.thread_barrier()
        b_m = warpgroup_mma(m_smem, x_smem, zeros_t, use_acc=False) * beta_j[None, :]
        gl.thread_barrier()
        w_smem.store((b_p * beta_j[None, :]).to(gl.float16))
        m_smem.store(b_m.to(gl.float16))
        fence_async_shared()
        gl.thread_barrier()

    def _blocked(rows: int, cols: int, elem_bytes: int, num_warps: int = 4) -> "gl.BlockedLayout":
        """A coalesced layout for ``[rows, cols]`` accesses: 16 bytes a thread along the row."""
        vec = max(1, 16 // elem_bytes)
        tpw_c = max(1, min(32, cols // vec))
        return gl.BlockedLayout([1, vec], [32 // tpw_c, tpw_c], [num_warps, 1], [1, 0])

    def layouts(dtype: torch.dtype, mode: int, b_p: int, B_K: int, B_V: int) -> dict:
        """The kernel's layout constants for 16-bit inputs of ``dtype``, in ``mode``, with ring tables ``b_p`` wide and
        ``[B_V, B_K]`` state tiles."""
        g16 = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
        nvmma = gl.NVMMASharedLayout.get_default_for
        mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, B_T, 16])
        return dict(
            MMA=mma,
            MMA_V=gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, B_V, 16]),
            MMA_P=gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, b_p, 16]),
            LD=_blocked(B_T, B_K, 2),
            # a fold's state tiles are its wgmma's accumulators
            LD_S=(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, B_K, 16])
                  if mode == MODES["write"] else _blocked(B_V, B_K, 4)),
            LD_V=_blocked(B_T, B_V, 2), LD_U=_blocked(B_T, B_V, 4), LD_O=_blocked(B_T, B_V, 2),
            LD_P=gl.BlockedLayout([1, 1], [4, 8], [4, 1], [1, 0]),
            LD_UP=_blocked(b_p, B_V, 4), LD_KP=_blocked(b_p, B_K, 2),
            LD_W=gl.BlockedLayout([1], [32], [4], [0]),
            QK_SHARED=nvmma([B_T, B_K], g16), X_SHARED=nvmma([B_T, B_T], gl.float16),
            S_SHARED=nvmma([B_V, B_K], gl.bfloat16), R_SHARED=nvmma([B_T, B_V], gl.float16),
            S32_SHARED=nvmma([B_V, B_K], gl.float32), V_SHARED=gl.SwizzledSharedLayout(1, 1, 1, [1, 0]),
            KP_SHARED=nvmma([b_p, B_K], g16), DP_SHARED=nvmma([B_T, b_p], gl.float16),
            UP_SHARED=nvmma([b_p, B_V], gl.float16),
            LD_L2=gl.BlockedLayout([1, 1], [8, 4], [4, 1], [1, 0]),
        )


MODE_OPTIONS = {0: dict(COALESCE=True, ALIAS_R=False), 1: dict(COALESCE=True, ALIAS_R=False),
                2: dict(COALESCE=False, ALIAS_R=True)}
"""Each mode's switches, as measured best on the H200 (BENCHMARKS.md, twentieth to twenty-second sessions): the
verify and the read round store u and o through row-contiguous layouts; the write round keeps the accumulator's
layout for them and puts ``R'`` in the state parts' bytes where they are its size (``b_k = 32``: its shared memory
then fits two programs an SM)."""

_descriptors: dict = {}


def _pool_descriptor(state: torch.Tensor, b_k: int, b_v: int):
    """The pool's TMA descriptor (a ``[-1, dk]`` view, ``[b_v, b_k]`` fp32 blocks), kept per pool and tile."""
    key = (state.data_ptr(), tuple(state.shape), state.device, b_k, b_v)
    desc = _descriptors.get(key)
    if desc is None:
        if len(_descriptors) >= 256:
            _descriptors.clear()
        pool = state.view(-1, state.shape[-1])
        layout = gl.NVMMASharedLayout.get_default_for([b_v, b_k], gl.float32)
        desc = _descriptors[key] = TensorDescriptor(pool, list(pool.shape), list(pool.stride()), [b_v, b_k], layout)
    return desc


def launch_args(q, k, v, g, beta, state, state_indices, tree, shape, res, config, ring=None) -> tuple:
    """(grid, args, meta) of one launch writing into ``res`` with ``config``'s tiles (`tile_refusal` of its mode
    empty); ``ring`` a `RingRead` (mode 1 or 2 by its round) or None (the verify)."""
    h, b_k, b_v = shape.heads, config.b_k, config.b_v
    block_depth, _ = tree.block_depths(B_T)
    if ring is None:
        mode, b_p = MODES["verify"], 16
        tables = (res.committed, res.committed, res.u, res.k, res.k_scale, res.log_decay, 16)  # never read
    else:
        table, arena = ring.step.ring, ring.results
        # the round's first `RingRound.width` entries of each table row
        mode, b_p = MODES["write" if ring.step.write else "read"], ring.step.width
        tables = (table.rows, table.last, arena.u, arena.k, arena.k_scale, arena.log_decay, table.width)
    sq, sk, sv, sg, sb, ss = q.stride(), k.stride(), v.stride(), g.stride(), beta.stride(), state.stride()
    args = (q, k, v, g, beta, state, state_indices, tree.offsets, tree.dfs_enter, tree.dfs_exit, block_depth,
            res.o, res.u, res.log_decay, res.k, res.k_scale, res.committed, _pool_descriptor(state, b_k, b_v), *tables,
            shape.scale, h.hv, h.hk, sq[0], sq[1], sk[0], sk[1], sv[0], sv[1], sg[0], sg[1], sb[0], sb[1],
            ss[0], ss[1], ss[2])
    ahead = l2_ahead_programs(q.device, mode)
    meta_key = (q.dtype, mode, b_p, b_k, b_v, config.num_stages >= 2, h.dk, h.dv, ahead)
    meta = _metas.get(meta_key)
    if meta is None:  # its layout objects are built once per key: building them costs host time on every call
        options = dict(MODE_OPTIONS[mode])
        options["ALIAS_R"] = options["ALIAS_R"] and 2 * b_k == B_T  # R' in the state parts' bytes where their size
        meta = _metas[meta_key] = dict(D_K=h.dk, D_V=h.dv, B_T=B_T, B_K=b_k, B_V=b_v, G_FLOOR=LOG_DECAY_FLOOR,
                                       MODE=mode, B_P=b_p, PREFETCH=config.num_stages >= 2, L2_AHEAD=ahead,
                                       **options,
                                       **layouts(q.dtype, mode, b_p, b_k, b_v), num_warps=4)
    return (h.hv, shape.num_requests), args, meta


_metas: dict = {}
_launchers: list = []
_sms: dict = {}


def l2_ahead_programs(device: torch.device, mode: int) -> int:
    """The launch's prefetch distance in programs (`L2_AHEAD_PER_SM` of ``mode`` times the device's multiprocessors;
    `H200_SMS` for a device that is not a GPU)."""
    per_sm = L2_AHEAD_PER_SM[_MODE_NAMES[mode]]
    if not per_sm:
        return 0
    sms = _sms.get(device)
    if sms is None:
        sms = _sms[device] = (torch.cuda.get_device_properties(device).multi_processor_count
                              if device.type == "cuda" else H200_SMS)
    return per_sm * sms


_MODE_NAMES = {number: name for name, number in MODES.items()}


def gluon_launch(q, k, v, g, beta, state, state_indices, tree, shape, res, config, ring=None) -> None:
    """One launch with ``config``'s tiles on inputs `run.run_launch` has checked and `gluon_takes` accepted, writing
    into ``res``: keyed (`FastLauncher.launch_keyed`) on the tiles, the mode and table width, the dtypes and every
    integer argument (Triton specialises on them), with the tensors passed as their addresses where all are 16-byte
    aligned (else Triton's own specialisation by argument), so an eager call does not pay Triton's binder over the
    kernel's layout constants."""
    grid, args, meta = launch_args(q, k, v, g, beta, state, state_indices, tree, shape, res, config, ring)
    if not _launchers:
        from ..launcher import FastLauncher

        _launchers.append(FastLauncher(gluon_verify_kernel))
    fast, ints, bits = [], [], 0  # one pass: the tensors' addresses, and the integers Triton specialises on
    for a in args:
        if isinstance(a, torch.Tensor):
            address = a.data_ptr()
            bits |= address
            fast.append(address)
        else:
            fast.append(a)
            if type(a) is int:
                ints.append(a)
    key = None if bits & 15 else ("gluon", config, meta["MODE"], meta["B_P"], meta["L2_AHEAD"], q.dtype, g.dtype,
                                  beta.dtype, state_indices.dtype, *ints)
    _launchers[0].launch_keyed(key, grid, tuple(fast), lambda: args, lambda: meta)


def compile_sm90(args: tuple, meta: dict, fn=None):
    """Gluon kernel ``fn`` (default this one) compiled for sm_90 on these (CPU) arguments, without a GPU: Triton's
    compiled kernel (its ``metadata.shared``, ``asm["cubin"]``), for the CPU tests' check that every mode compiles
    and fits."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    fn = fn or gluon_verify_kernel
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, _ = binder(*args, **meta)
    options, signature, constexprs, attrs = fn._pack_args(backend, dict(meta), bound, specialization, None)
    return triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def gluon_takes(launch, q, k, v, state, shape, ring=None, pending=None) -> bool:
    """Whether a launch the planner marked ``gluon`` runs on this kernel with these tensors: no pending fold (the
    Triton kernels fold a `PendingCommit`), a ring table at most `MAX_RING_WIDTH` wide, the head dims it was
    measured on, the pool contiguous (its TMA view), and q, k, v and the pool 16-byte aligned with rows of whole
    16 bytes (the cp.async copies and the TMA descriptor move 16 bytes a thread; a view that is not, such as q cut
    at an odd offset out of a fused projection, runs the Triton kernel), and the config's tiles ones this round's
    mode takes (`tile_refusal`). q, k and v come with their last stride 1 (`run_launch`)."""
    if not launch.gluon or pending is not None:
        return False
    if ring is not None and ring.step.width > MAX_RING_WIDTH:
        return False
    if tile_refusal(launch.config, "verify" if ring is None else "write" if ring.step.write else "read"):
        return False
    if (shape.heads.dk, shape.heads.dv) != HEAD_DIMS or not state.is_contiguous():
        return False
    for x in (q, k, v):
        if x.data_ptr() % 16 or x.stride(0) % 8 or x.stride(1) % 8:
            return False
    return state.data_ptr() % 16 == 0


def compile_report(width: int = MAX_RING_WIDTH, config=None, fn=None, extra_args: tuple = ()) -> dict:
    """Each mode compiled for sm_90 here, without a GPU (a process without ``TRITON_INTERPRET``), on four 64-node
    trees of Qwen3.5-9B heads in bf16 with ring tables ``width`` wide and ``config``'s tiles (default
    `UNTUNED_CONFIG`): mode -> `bole_tune.binaries.binary_report` (registers, spilled bytes, shared memory) without
    its instruction counts; a mode whose tiles `tile_refusal` refuses is left out. ``fn``: another Gluon kernel with
    this one's parameters and then ``extra_args`` (the labs' variants of it), default this one."""
    from bole_tune.binaries import binary_report
    from bole_tune.shapes import HeadShape
    from bole_tune.workloads import make_inputs, make_tree

    from .result import VerifyShape, result_buffers
    from .ring import PendingRing, RingRead, RingRound

    heads = HeadShape(hk=16, hv=32, dk=HEAD_DIMS[0], dv=HEAD_DIMS[1])
    tree = make_tree([B_T] * 4, "random", max_depth=8, seed=1, device="cpu")
    x = make_inputs(tree, heads.hk, heads.hv, heads.dk, heads.dv, torch.bfloat16, "cpu", seed=1)
    shape = VerifyShape(heads, tree.num_nodes, 4, x.state.shape[0], heads.dk ** -0.5)
    res = result_buffers(shape, torch.bfloat16, "cpu", tree, None)
    ring = PendingRing(x.state.shape[0], 1, width, capacity=tree.num_nodes, max_requests=4, device="cpu")
    arena = ring.results(heads, torch.bfloat16)
    out, config = {}, config or UNTUNED_CONFIG
    for mode, write in (("verify", None), ("read", False), ("write", True)):
        if tile_refusal(config, mode):
            continue
        rr = None if write is None else RingRead(RingRound(ring, tree, 0, write), arena)
        _, args, meta = launch_args(*x.args(tree)[:7], tree, shape, res, config, rr)
        report = binary_report(compile_sm90(args + tuple(extra_args), meta, fn))
        report.pop("ops", None)
        out[mode] = report
    return out

