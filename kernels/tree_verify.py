"""The Bole verifier: every node of a proposal tree through one GDN layer, in parallel.

Two kernels compute Theorem 1 of the seed (../shared/DESIGN.md §2); `pick_variant` chooses per batch:
the resident kernel (`tree_verify_resident.py`, trees of at most 64 nodes, one program per head) once
the batch has enough heads to fill the GPU, and otherwise this file's fused kernel, which takes any
tree size. In both nothing T x T touches device memory.

The fused kernel runs one program per (value tile, value head, request) and walks its request's nodes
in blocks of ``B_T`` rows:

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

import warnings

import torch
import triton
import triton.language as tl

from bole_tune.config import KernelConfig, node_block
from bole_tune.database import batch_bucket, tree_bucket
from bole_tune.tree import TreeBatch
from .common import (SWEEP_F16_MAX_DEPTH, TreeVerifyResult, check_verify_inputs, dot_precision, gram_dtype,
                     result_buffers, state_split, sweep_f16, token_head_strides, use_triton)
from .tree_verify_resident import RESIDENT_MAX_NODES, resident_split, state_products, tree_verify_resident_kernel

VARIANTS = ("fused", "resident")
# the resident kernel runs one program per (request, head): it needs enough of them to fill an H200.
# Measured there (9B, bf16; BENCHMARKS.md): from 512 (batch bucket x heads) it beats the fused kernel
# (B=16 T=64: 63 against 87 us; T=16: 23 against 26 us); from 256 only on trees of more than 32 nodes
# (B=8 T=64: 32 against 45 us, but B=8 T=8: 13.5 against 12.1 us); below, the fused kernel's dv / b_v
# programs per head win (B=4 T=64: 25 against 24 us, B=1 T=64: 17 against 16 us).
RESIDENT_MIN_HEADS = 512
RESIDENT_MIN_HEADS_LARGE_TREES = 256


def pick_variant(num_requests: int, hv: int, max_tree_size: int) -> str:
    """The kernel ``tree_verify(variant=None)`` runs: "resident" or "fused".

    Decided on the batch's and the tree's buckets (`bole_tune.database`), not their exact sizes, so a
    tuned config is always launched on the kernel it was tuned for.
    """
    heads, size = batch_bucket(num_requests) * hv, tree_bucket(max_tree_size)
    if max_tree_size <= RESIDENT_MAX_NODES and (heads >= RESIDENT_MIN_HEADS or
                                                (heads >= RESIDENT_MIN_HEADS_LARGE_TREES and size > 32)):
        return "resident"
    return "fused"


def resolve_launch(shape, dtype, tree: TreeBatch, device, config: KernelConfig | None = None,
                   variant: str | None = None) -> tuple[KernelConfig, str]:
    """The (config, variant) `tree_verify` launches with for these arguments (before its self-check).

    ``config=None`` takes the tuned config for this GPU and bucket, and with ``variant=None`` the kernel
    that config was tuned (and checked) on; otherwise the variant follows `pick_variant`.
    """
    if config is None:
        from bole_tune.lookup import launch_for
        config, tuned_on = launch_for(shape, dtype, tree, device)
        if variant is None and tuned_on in VARIANTS and (tuned_on == "fused" or tree.max_tree_size <= RESIDENT_MAX_NODES):
            variant = tuned_on
    if variant is None:
        variant = pick_variant(shape.num_requests, shape.hv, tree.max_tree_size)
    return config, variant


_RESIDENT_CHECKS: dict[tuple, bool] = {}


def resident_config_ok(config: KernelConfig, b_t: int, shape, q_dtype, gate_dtype, use_qk_l2norm: bool,
                       device: torch.device, v_split: int = 1, deep: bool = False) -> bool:
    """Whether the resident kernel computes correctly with ``config`` for this specialisation.

    Triton 3.6 miscompiles a few of the resident kernel's configs on the H200 (b_k <= 32 with 3 or
    more stages and 128-wide value tiles came out with relative error 1.4e-2, every time; BENCHMARKS.md).
    So on a GPU the first launch of each compiled variant in a process is checked once, on a
    one-request instance of the same specialisation, against the float64 reference; a config that
    fails runs on the fused kernel instead (right for every config), with one warning. Inside a CUDA
    graph capture no check can run: an unchecked config then runs on the fused kernel. ``deep``: the
    batch has a tree deeper than `common.SWEEP_F16_MAX_DEPTH` (another specialisation, checked on a chain).
    """
    if device.type != "cuda":
        return True  # the CPU interpreter runs the kernel's semantics, not a compiled binary
    key = (config, b_t, v_split, shape.hk, shape.hv, shape.dk, shape.dv, shape.scale, q_dtype, gate_dtype,
           use_qk_l2norm, device, deep)
    ok = _RESIDENT_CHECKS.get(key)
    if ok is None:
        if torch.cuda.is_current_stream_capturing():
            return False
        error, tolerance = check_resident(config, b_t, shape, q_dtype, gate_dtype, use_qk_l2norm, device, v_split,
                                          deep)
        ok = _RESIDENT_CHECKS[key] = error <= tolerance
        if not ok:
            warnings.warn(f"bole-tune: the resident tree_verify kernel computes wrongly with {config} "
                          f"(value split {v_split}) at {b_t}-row trees on {torch.cuda.get_device_name(device)} (relative error {error:.1e} "
                          f"against the float64 reference; a Triton miscompile); running the fused kernel "
                          f"for this config instead", stacklevel=3)
    return ok


def check_resident(config, b_t, shape, q_dtype, gate_dtype, use_qk_l2norm, device, v_split=1,
                   deep=False) -> tuple[float, float]:
    """(relative error, allowed error) of the resident kernel on one random ``b_t``-node request (a chain
    when ``deep``), with ``shape``'s scale: the same specialisation as the launch it vouches for."""
    from bole_tune.bench import accepted_error
    from bole_tune.workloads import make_inputs, make_tree, relative_error

    from .common import VerifyShape
    from .reference import verify_reference

    tree = make_tree([b_t], kind="chain" if deep else "random", seed=12345, device=device)
    x = make_inputs(tree, shape.hk, shape.hv, shape.dk, shape.dv, q_dtype, device, gate_dtype=gate_dtype, seed=12345)
    one = VerifyShape(tree.num_nodes, 1, x.state.shape[0], shape.hk, shape.hv, shape.dk, shape.dv, shape.scale)
    res = result_buffers(one, q_dtype, device, tree, None)
    strides = (x.q.stride(0), x.q.stride(1), x.k.stride(0), x.k.stride(1), x.v.stride(0), x.v.stride(1))
    _launch("resident", x.q, x.k, x.v, x.g, x.beta, x.state, x.state_indices, tree, one, res, config,
            use_qk_l2norm, strides, v_split)
    ref = verify_reference(*x.args(tree), scale=shape.scale, use_qk_l2norm=use_qk_l2norm, keep_states=False)
    # correct configs land near 2e-3 with 16-bit inputs, the miscompiled ones at 1.4e-2
    return relative_error(res.o, ref.o), accepted_error(q_dtype)


# head counts and the block table's width vary per model and batch without changing the code:
# leaving them unspecialised lets one compiled kernel serve every model with the same head sizes
@triton.jit(do_not_specialize=["max_blocks", "H_V", "H_K"])
def tree_verify_fwd_kernel(
    # inputs
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, state_indices_ptr,
    # tree topology
    offsets_ptr, dfs_enter_ptr, dfs_exit_ptr, block_depth_ptr,
    # outputs
    o_ptr, u_ptr, logp_ptr, k_out_ptr, k_scale_ptr,
    # scalars and strides
    scale, max_blocks, H_V, H_K,
    stride_q_n, stride_q_h, stride_k_n, stride_k_h, stride_v_n, stride_v_h,
    stride_g_n, stride_g_h, stride_beta_n, stride_beta_h,
    stride_s_slot, stride_s_h, stride_s_v,
    # sizes and meta-parameters
    D_K: tl.constexpr, D_V: tl.constexpr, B_T: tl.constexpr, B_K: tl.constexpr, B_V: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr, GRAM_DTYPE: tl.constexpr,
):
    i_v = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_r = tl.program_id(2).to(tl.int64)
    i_hk = i_h // (H_V // H_K)
    bos = tl.load(offsets_ptr + i_r).to(tl.int64)
    num_nodes = tl.load(offsets_ptr + i_r + 1).to(tl.int64) - bos
    slot = tl.load(state_indices_ptr + i_r).to(tl.int64)
    # the keys (raw, plus their scale) are kept for the commit by one program per key head
    write_keys = (i_v == 0) & (i_h % (H_V // H_K) == 0)

    o_v = i_v * B_V + tl.arange(0, B_V)
    p_state = state_ptr + slot * stride_s_slot + i_h * stride_s_h + o_v[:, None] * stride_s_v

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
            b_q = tl.load(q_ptr + rows[:, None] * stride_q_n + i_hk * stride_q_h + o_k[None, :],
                          mask=m_i[:, None], other=0)
            b_k = tl.load(k_ptr + rows[:, None] * stride_k_n + i_hk * stride_k_h + o_k[None, :],
                          mask=m_i[:, None], other=0)
            b_s = tl.load(p_state + o_k[None, :])
            # one tf32 product (`state_split` is the resident kernel's: here it was slower and miscompiled)
            b_qs, b_ks = state_products(b_q, b_k, b_s, b_qs, b_ks, DOT_PRECISION, GRAM_DTYPE, False)
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

        # 2. logP_i: sum of g over the node and its ancestors (all in this or earlier blocks)
        b_logp = tl.zeros([B_T], dtype=tl.float32)
        for j_b in range(0, i_b + 1):
            o_j = j_b * B_T + tl.arange(0, B_T)
            m_j = o_j < num_nodes
            enter_j = tl.load(dfs_enter_ptr + bos + o_j, mask=m_j, other=-1)
            exit_j = tl.load(dfs_exit_ptr + bos + o_j, mask=m_j, other=-2)
            b_g = tl.load(g_ptr + (bos + o_j) * stride_g_n + i_h * stride_g_h, mask=m_j, other=0).to(tl.float32)
            m_anc = (enter_j[None, :] <= enter_i[:, None]) & (enter_i[:, None] <= exit_j[None, :])
            b_logp += tl.sum(tl.where(m_anc, b_g[None, :], 0.0), axis=1)

        b_decay = tl.exp(b_logp)
        b_v = tl.load(v_ptr + rows[:, None] * stride_v_n + i_h * stride_v_h + o_v[None, :],
                      mask=m_i[:, None], other=0).to(tl.float32)
        b_o = (b_decay * r_q)[:, None] * b_qs
        b_r = b_beta[:, None] * (b_v - (b_decay * r_k)[:, None] * b_ks)

        # 3. contributions of the already solved rows of earlier blocks
        for j_b in range(0, i_b):
            o_j = j_b * B_T + tl.arange(0, B_T)
            rows_j = bos + o_j
            enter_j = tl.load(dfs_enter_ptr + rows_j, mask=o_j < num_nodes, other=-1)
            exit_j = tl.load(dfs_exit_ptr + rows_j, mask=o_j < num_nodes, other=-2)
            logp_j = tl.load(logp_ptr + rows_j * H_V + i_h, mask=o_j < num_nodes, other=0)
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
                               mask=(o_j < num_nodes)[:, None], other=0)
                b_kj = b_kj.to(GRAM_DTYPE)
                b_qk_ij = tl.dot(b_q.to(GRAM_DTYPE), tl.trans(b_kj), b_qk_ij, input_precision=DOT_PRECISION)
                b_kk_ij = tl.dot(b_k.to(GRAM_DTYPE), tl.trans(b_kj), b_kk_ij, input_precision=DOT_PRECISION)
                if USE_QK_L2NORM:
                    ssq_kj += tl.sum(b_kj.to(tl.float32) * b_kj.to(tl.float32), axis=1)
            if USE_QK_L2NORM:
                r_kj = 1.0 / tl.sqrt(ssq_kj + 1e-6)
            else:
                r_kj = tl.full([B_T], 1.0, dtype=tl.float32)
            m_anc = (enter_j[None, :] <= enter_i[:, None]) & (enter_i[:, None] <= exit_j[None, :])
            decay_ij = tl.exp(tl.where(m_anc, b_logp[:, None] - logp_j[None, :], float("-inf")))
            b_g_ij = (b_beta * r_k)[:, None] * decay_ij * r_kj[None, :] * b_kk_ij
            b_c_ij = r_q[:, None] * decay_ij * r_kj[None, :] * b_qk_ij
            b_u_j = tl.load(u_ptr + rows_j[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :],
                            mask=(o_j < num_nodes)[:, None], other=0)
            b_r -= tl.dot(b_g_ij, b_u_j, input_precision=DOT_PRECISION)
            b_o = tl.dot(b_c_ij, b_u_j, b_o, input_precision=DOT_PRECISION)

        # 4. the block's own system, one substitution sweep per level of its forest
        m_anc = (enter_i[None, :] <= enter_i[:, None]) & (enter_i[:, None] <= exit_i[None, :])
        decay_ii = tl.exp(tl.where(m_anc, b_logp[:, None] - b_logp[None, :], float("-inf")))
        m_strict = m_anc & (o_i[:, None] != o_i[None, :])
        b_g_ii = tl.where(m_strict, (b_beta * r_k)[:, None] * decay_ii * r_k[None, :] * b_kk, 0.0)
        b_c_ii = r_q[:, None] * decay_ii * r_k[None, :] * b_qk
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


def tree_verify(q, k, v, g, beta, state, state_indices, tree: TreeBatch, scale=None, use_qk_l2norm=True,
                config: KernelConfig | None = None, validate: bool | None = None,
                out: TreeVerifyResult | None = None, variant: str | None = None,
                v_split: int | None = None) -> TreeVerifyResult:
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
        variant: "fused" (any tree size), "resident" (trees of at most 64 nodes, one program per head)
            or None: with ``config=None`` the kernel the database's config was tuned on, else
            `pick_variant` by batch and tree size. Both give the same results.
        v_split: the resident kernel's programs per head (a power of two, at most ``dv / b_v``); None:
            `resident_split` of the batch's bucket (what the tuner timed). Ignored by the fused kernel.

    Returns:
        `TreeVerifyResult`: ``o`` ``[N, Hv, dv]`` in v's dtype and the factors for `tree_commit`.
    """
    shape = check_verify_inputs(q, k, v, g, beta, state, state_indices, tree, scale, validate)
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {VARIANTS} or None, got {variant!r}")
    if v_split is not None and not (isinstance(v_split, int) and not isinstance(v_split, bool) and v_split >= 1
                                    and v_split & (v_split - 1) == 0):
        raise ValueError(f"v_split: expected a power of two (programs per head) or None, got {v_split!r}")
    if variant == "resident" and tree.max_tree_size > RESIDENT_MAX_NODES:
        raise ValueError(f"variant: 'resident' takes trees of at most {RESIDENT_MAX_NODES} nodes per request; "
                         f"this batch has a tree of {tree.max_tree_size}")
    if not use_triton(q.device):
        from .reference import verify_closed_form
        return verify_closed_form(q, k, v, g, beta, state, state_indices, tree, shape.scale, use_qk_l2norm,
                                  validate=False, out=out)
    config, variant = resolve_launch(shape, q.dtype, tree, q.device, config, variant)
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config: expected a KernelConfig or None, got {type(config).__name__}")
    if not config.fits(shape.dk, shape.dv):
        raise ValueError(f"config: tiles b_k={config.b_k}, b_v={config.b_v} must divide dk={shape.dk}, dv={shape.dv}")
    q, sq_n, sq_h = token_head_strides(q)
    k, sk_n, sk_h = token_head_strides(k)
    v, sv_n, sv_h = token_head_strides(v)
    res = result_buffers(shape, q.dtype, q.device, tree, out)
    if v_split is None:
        v_split = resident_split(batch_bucket(shape.num_requests), shape.hv, shape.dv, config.b_v)
    elif v_split * config.b_v > shape.dv:
        raise ValueError(f"v_split: expected a power of two with v_split * b_v <= dv = {shape.dv} "
                         f"(b_v = {config.b_v}), got {v_split!r}")
    if variant == "resident" and not resident_config_ok(config, node_block(tree.max_tree_size), shape, q.dtype,
                                                        g.dtype, bool(use_qk_l2norm), q.device, v_split,
                                                        deep=tree.depth > SWEEP_F16_MAX_DEPTH):
        variant = "fused"
    _launch(variant, q, k, v, g, beta, state, state_indices, tree, shape, res, config, bool(use_qk_l2norm),
            (sq_n, sq_h, sk_n, sk_h, sv_n, sv_h), v_split)
    return res


def _launch(variant, q, k, v, g, beta, state, state_indices, tree, shape, res, config, use_qk_l2norm, strides,
            v_split):
    """Launch one of the two kernels; they take the same arguments but for the fused one's block table width
    and the resident one's value split (``v_split`` programs per head; the fused kernel ignores it)."""
    hv, hk, dk, dv = shape.hv, shape.hk, shape.dk, shape.dv
    b_t = node_block(tree.max_tree_size)
    block_depth, max_blocks = tree.block_depths(b_t)
    if variant == "resident":
        kernel = tree_verify_resident_kernel[(hv * v_split, shape.num_requests)]
        extra = {"V_SPLIT": v_split, "STATE_SPLIT": state_split(q.dtype, b_t),
                 "SWEEP_F16": sweep_f16(q.dtype, use_qk_l2norm, tree.depth, shape.scale)}
        blocks = ()
    else:
        kernel, blocks, extra = tree_verify_fwd_kernel[(dv // config.b_v, hv, shape.num_requests)], (max_blocks,), {}
    kernel(
        q, k, v, g, beta, state, state_indices,
        tree.offsets, tree.dfs_enter, tree.dfs_exit, block_depth,
        res.o, res.u, res.log_decay, res.k, res.k_scale,
        shape.scale, *blocks, hv, hk, *strides,
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        state.stride(0), state.stride(1), state.stride(2),
        D_K=dk, D_V=dv, B_T=b_t, B_K=config.b_k, B_V=config.b_v, **extra,
        USE_QK_L2NORM=use_qk_l2norm, DOT_PRECISION=dot_precision(q.dtype), GRAM_DTYPE=gram_dtype(q),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
