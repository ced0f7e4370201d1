"""The resident Bole verifier for trees of at most 64 nodes: one program per (value head, request).

The fused kernel (`tree_verify.py`) gives each of a head's ``dv / b_v`` programs its own copy of the
factor work and runs the substitution sweeps on ``[T, b_v]`` value tiles; at 64 nodes its 8-warp
programs need every register of an SM. Here the work is split where the math splits
(../shared/DESIGN.md §2), inside one program per head:

1. the factors, once: ``logP``, the norms, ``G`` and ``C``, then

       W = (I + G)^-1 D_beta          (level sweeps X <- I - G X on T x T, one per tree level)
       M = C (I + G)^-1 D_beta        (the readout of the solved rows)

   and the row factors ``a_q = P r_q``, ``a_k = P r_k`` (decay times norm scale). ``W`` and ``M`` are
   exact blocks of the inverse (each entry is the response of one node's update to another node's
   value, bounded), never powers of ``G``. With 16-bit inputs, L2-normalised keys and trees of depth
   at most 12 the sweeps and ``C X`` run on fp16 tensor cores (`common.sweep_f16`);
2. ``S_pre`` streamed one ``b_v``-row value tile at a time, ``b_k`` columns per step, with ``W`` and
   ``M`` kept resident:

       R' = V - a_k (K S_pre^T)      U = W R'      O = a_q (Q S_pre^T) + M R'

   (`state_products`: for bf16 inputs on trees of more than 32 nodes S_pre enters the two state
   products as two bf16 parts, finer than tf32 and faster here; see `common.state_split`).

The sweeps cost ``T^3`` per head instead of ``T^2 dv`` and nothing ``T x T`` leaves the SM. With one
program per head it needs many heads to fill a GPU: `pick_variant` takes it from 512 (request, head)
pairs up, from 256 for trees of more than 32 nodes (measured on the H200, BENCHMARKS.md), and the fused
kernel below that. Where a launch would have fewer than 128 programs, `resident_split` gives each head's
value rows to 2 or more programs (each recomputes the factors).
"""

from __future__ import annotations

import triton
import triton.language as tl

RESIDENT_MAX_NODES = 64
# split a head's value rows over more programs while a launch has fewer than this many: on the H200
# (9B, B=1, T=64) 4 parts take 17.4 us against 24.8 us for one; at B=4 (128 programs) 2 parts gain nothing
RESIDENT_TARGET_PROGRAMS = 128


def resident_split(batch_bucket: int, hv: int, dv: int, b_v: int) -> int:
    """How many programs share one head's value rows: 1 at large batches, up to ``dv / b_v`` at small.

    Each part recomputes the head's factors (``T^3``) and streams ``dv / parts`` rows of ``S_pre``.
    Decided on the batch's bucket, so a tuned config always runs with the split it was tuned with.
    """
    parts = 1
    while 2 * parts * b_v <= dv and batch_bucket * hv * 2 * parts <= RESIDENT_TARGET_PROGRAMS:
        parts *= 2
    return parts


@triton.jit
def state_products(b_q, b_k, b_s, b_qs, b_ks, DOT_PRECISION: tl.constexpr, GRAM_DTYPE: tl.constexpr,
                   STATE_SPLIT: tl.constexpr):
    """``Q S^T`` and ``K S^T`` of one ``b_k`` chunk, added to ``b_qs`` and ``b_ks`` (both kernels call it;
    the fused one always without the split).

    With ``STATE_SPLIT`` (bf16 inputs on trees of more than 32 nodes, `common.state_split`) the fp32
    state tile is taken as two bf16 parts, ``hi = bf16(S)`` and ``lo = bf16(S - hi)``, each multiplied
    by the bf16 q/k tiles as they are: 16 significant bits of S (tf32 keeps 11), fp32 accumulation,
    bf16 tensor cores (twice the tf32 rate) and no q/k widening. Otherwise q/k are widened to fp32
    and multiplied at ``DOT_PRECISION``.
    ``GRAM_DTYPE`` is bf16 on a GPU and fp32 in the CPU interpreter (exact: see `common.gram_dtype`).
    """
    if STATE_SPLIT:
        b_hi = b_s.to(tl.bfloat16)
        b_lo = tl.trans((b_s - b_hi.to(tl.float32)).to(tl.bfloat16)).to(GRAM_DTYPE)
        b_hi = tl.trans(b_hi).to(GRAM_DTYPE)
        b_q = b_q.to(GRAM_DTYPE)
        b_k = b_k.to(GRAM_DTYPE)
        b_qs = tl.dot(b_q, b_lo, tl.dot(b_q, b_hi, b_qs))
        b_ks = tl.dot(b_k, b_lo, tl.dot(b_k, b_hi, b_ks))
    else:
        b_qs = tl.dot(b_q.to(tl.float32), tl.trans(b_s), b_qs, input_precision=DOT_PRECISION)
        b_ks = tl.dot(b_k.to(tl.float32), tl.trans(b_s), b_ks, input_precision=DOT_PRECISION)
    return b_qs, b_ks


@triton.jit(do_not_specialize=["H_V", "H_K"])
def tree_verify_resident_kernel(
    # inputs
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, state_indices_ptr,
    # tree topology
    offsets_ptr, dfs_enter_ptr, dfs_exit_ptr, block_depth_ptr,
    # outputs
    o_ptr, u_ptr, logp_ptr, k_out_ptr, k_scale_ptr,
    # scalars and strides
    scale, H_V, H_K,
    stride_q_n, stride_q_h, stride_k_n, stride_k_h, stride_v_n, stride_v_h,
    stride_g_n, stride_g_h, stride_beta_n, stride_beta_h,
    stride_s_slot, stride_s_h, stride_s_v,
    # sizes and meta-parameters
    D_K: tl.constexpr, D_V: tl.constexpr, B_T: tl.constexpr, B_K: tl.constexpr, B_V: tl.constexpr,
    V_SPLIT: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr, GRAM_DTYPE: tl.constexpr,
    STATE_SPLIT: tl.constexpr = False, SWEEP_F16: tl.constexpr = False,
):
    # program (V_SPLIT * head + part, request): part streams rows [part, part + 1) * D_V / V_SPLIT
    i_h = tl.program_id(0).to(tl.int64) // V_SPLIT
    i_part = tl.program_id(0).to(tl.int64) % V_SPLIT
    i_r = tl.program_id(1).to(tl.int64)
    i_hk = i_h // (H_V // H_K)
    bos = tl.load(offsets_ptr + i_r).to(tl.int64)
    num_nodes = tl.load(offsets_ptr + i_r + 1).to(tl.int64) - bos
    slot = tl.load(state_indices_ptr + i_r).to(tl.int64)
    # one program per key head writes the keys and their scales, the first part of each head logP
    write_keys = (i_h % (H_V // H_K) == 0) & (i_part == 0)

    o_i = tl.arange(0, B_T)
    m_i = o_i < num_nodes
    rows = bos + o_i
    enter_i = tl.load(dfs_enter_ptr + rows, mask=m_i, other=-1)
    exit_i = tl.load(dfs_exit_ptr + rows, mask=m_i, other=-2)
    b_beta = tl.load(beta_ptr + rows * stride_beta_n + i_h * stride_beta_h, mask=m_i, other=0).to(tl.float32)
    b_g = tl.load(g_ptr + rows * stride_g_n + i_h * stride_g_h, mask=m_i, other=0).to(tl.float32)

    # 1. the factors, once per head: Gram matrices, logP, G and C, W = (I + G)^-1 D_beta, M = C W
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
    if SWEEP_F16:
        # fp16 operands (`common.sweep_f16`: 16-bit inputs, L2-normalised keys, trees of depth <= 12, where
        # every operand entry, partial Neumann sums included, stays far inside fp16's range)
        b_g16 = b_gm.to(tl.float16)
        for _ in range(0, tl.load(block_depth_ptr + i_r)):
            b_x = eye - tl.dot(b_g16, b_x.to(tl.float16))
        b_m = tl.dot(b_c.to(tl.float16), b_x.to(tl.float16)) * b_beta[None, :]
    else:
        for _ in range(0, tl.load(block_depth_ptr + i_r)):
            b_x = eye - tl.dot(b_gm, b_x, input_precision=DOT_PRECISION)
        b_m = tl.dot(b_c, b_x, input_precision=DOT_PRECISION) * b_beta[None, :]
    b_w = b_x * b_beta[None, :]
    b_decay = tl.exp(b_logp)
    a_q = b_decay * r_q
    a_k = b_decay * r_k
    tl.store(logp_ptr + rows * H_V + i_h, b_logp, mask=m_i & (i_part == 0))
    tl.store(k_scale_ptr + rows * H_K + i_hk, r_k, mask=m_i & write_keys)

    # 2. stream S_pre one value tile at a time: R' = V - a_k (K S^T), U = W R', O = a_q (Q S^T) + M R'
    p_state = state_ptr + slot * stride_s_slot + i_h * stride_s_h
    for i_v in range(0, D_V // V_SPLIT, B_V):
        o_v = i_part * (D_V // V_SPLIT) + i_v + tl.arange(0, B_V)
        b_qs = tl.zeros([B_T, B_V], dtype=tl.float32)
        b_ks = tl.zeros([B_T, B_V], dtype=tl.float32)
        for i_k in range(0, D_K, B_K):
            o_k = i_k + tl.arange(0, B_K)
            b_q = tl.load(q_ptr + rows[:, None] * stride_q_n + i_hk * stride_q_h + o_k[None, :],
                          mask=m_i[:, None], other=0)
            b_k = tl.load(k_ptr + rows[:, None] * stride_k_n + i_hk * stride_k_h + o_k[None, :],
                          mask=m_i[:, None], other=0)
            b_s = tl.load(p_state + o_v[:, None] * stride_s_v + o_k[None, :])
            b_qs, b_ks = state_products(b_q, b_k, b_s, b_qs, b_ks, DOT_PRECISION, GRAM_DTYPE, STATE_SPLIT)
        b_v = tl.load(v_ptr + rows[:, None] * stride_v_n + i_h * stride_v_h + o_v[None, :],
                      mask=m_i[:, None], other=0).to(tl.float32)
        b_r = b_v - a_k[:, None] * b_ks
        b_u = tl.dot(b_w, b_r, input_precision=DOT_PRECISION)
        b_o = tl.dot(b_m, b_r, a_q[:, None] * b_qs, input_precision=DOT_PRECISION)
        tl.store(u_ptr + rows[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :], b_u, mask=m_i[:, None])
        tl.store(o_ptr + rows[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :],
                 b_o.to(o_ptr.dtype.element_ty), mask=m_i[:, None])
