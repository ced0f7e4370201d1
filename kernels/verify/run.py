"""Launch one planned verification (`planner.Launch`) on the fused or the resident kernel."""

from __future__ import annotations

from bole_tune.tree import TreeBatch

from ..common import dot_precision, gram_dtype, token_head_strides
from ..launcher import FastLauncher
from .fused import tree_verify_fused_kernel
from .planner import Launch
from .resident import tree_verify_resident_kernel

RESIDENT = FastLauncher(tree_verify_resident_kernel)
FUSED = FastLauncher(tree_verify_fused_kernel)
from .result import PendingCommit, TreeVerifyResult, VerifyShape, commit_epoch


FOLD_DOT_PRECISION = "tf32x3"
"""Precision of the fold's product (`blocks.fold_apply`): three tf32 tensor-core passes, about fp32's accuracy
(H200, 9B heads: the committed state within 1.1e-7 of the closed form, fp32 FMAs 6.8e-8) and faster than fp32
FMAs ("ieee"): a B=16 round of 4-node chains 41.0 against 53.6 us, of 64-node trees 96.8 against 111.1 us
(BENCHMARKS.md, "A layer's round")."""


def run_launch(launch: Launch, q, k, v, g, beta, state, state_indices, tree: TreeBatch, shape: VerifyShape,
               res: TreeVerifyResult, use_qk_l2norm: bool, pending: PendingCommit | None = None) -> TreeVerifyResult:
    """Run ``launch`` on checked inputs, writing into ``res``. The two kernels take the same arguments
    but for the fused one's block-table width and the resident one's value split and switches; with
    ``pending``, both first commit the previous round's accepted paths into the slots they read."""
    h, config = shape.heads, launch.config
    q, sq_n, sq_h = token_head_strides(q)
    k, sk_n, sk_h = token_head_strides(k)
    v, sv_n, sv_h = token_head_strides(v)
    block_depth, max_blocks = tree.block_depths(launch.node_block)
    if launch.variant in ("resident", "stream"):
        kernel, grid = RESIDENT, (h.hv * launch.v_split, shape.num_requests)
        blocks = ()
        extra = {"V_SPLIT": launch.v_split, "STATE_SPLIT": launch.state_split, "SWEEP_F16": launch.sweep_f16,
                 "STATE_FIRST": launch.variant == "stream"}
    else:
        kernel, grid = FUSED, (h.dv // config.b_v, h.hv, shape.num_requests)
        blocks, extra = (max_blocks,), {}
    if pending is None:  # the fold's pointers are never read: None keeps the launch short
        fold = (None,) * 7 + (0,)
        extra.update(FOLD=False)
    else:
        paths, prev = pending.paths, pending.result
        fold = (paths.request_map, paths.path_rows, prev.u, prev.log_decay, prev.k, prev.k_scale, prev.committed,
                commit_epoch())
        extra.update(FOLD=True, FOLD_DOT=FOLD_DOT_PRECISION, B_P=paths.path_rows.shape[1])
    kernel(
        grid, q, k, v, g, beta, state, state_indices,
        tree.offsets, tree.dfs_enter, tree.dfs_exit, block_depth,
        res.o, res.u, res.log_decay, res.k, res.k_scale, res.committed, *fold,
        shape.scale, *blocks, h.hv, h.hk, sq_n, sq_h, sk_n, sk_h, sv_n, sv_h,
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        state.stride(0), state.stride(1), state.stride(2),
        D_K=h.dk, D_V=h.dv, B_T=launch.node_block, B_K=config.b_k, B_V=config.b_v, **extra,
        USE_QK_L2NORM=bool(use_qk_l2norm), DOT_PRECISION=dot_precision(q.dtype), GRAM_DTYPE=gram_dtype(q),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return res
