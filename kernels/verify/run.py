"""Launch one planned verification (`planner.Launch`) on the fused or the resident kernel."""

from __future__ import annotations

from bole_tune.tree import TreeBatch

from ..common import dot_precision, gram_dtype, token_head_strides
from .fused import tree_verify_fused_kernel
from .planner import Launch
from .resident import tree_verify_resident_kernel
from .result import TreeVerifyResult, VerifyShape


def run_launch(launch: Launch, q, k, v, g, beta, state, state_indices, tree: TreeBatch, shape: VerifyShape,
               res: TreeVerifyResult, use_qk_l2norm: bool) -> TreeVerifyResult:
    """Run ``launch`` on checked inputs, writing into ``res``. The two kernels take the same arguments
    but for the fused one's block-table width and the resident one's value split and switches."""
    h, config = shape.heads, launch.config
    q, sq_n, sq_h = token_head_strides(q)
    k, sk_n, sk_h = token_head_strides(k)
    v, sv_n, sv_h = token_head_strides(v)
    block_depth, max_blocks = tree.block_depths(launch.node_block)
    if launch.variant == "resident":
        kernel = tree_verify_resident_kernel[(h.hv * launch.v_split, shape.num_requests)]
        blocks = ()
        extra = {"V_SPLIT": launch.v_split, "STATE_SPLIT": launch.state_split, "SWEEP_F16": launch.sweep_f16}
    else:
        kernel = tree_verify_fused_kernel[(h.dv // config.b_v, h.hv, shape.num_requests)]
        blocks, extra = (max_blocks,), {}
    kernel(
        q, k, v, g, beta, state, state_indices,
        tree.offsets, tree.dfs_enter, tree.dfs_exit, block_depth,
        res.o, res.u, res.log_decay, res.k, res.k_scale,
        shape.scale, *blocks, h.hv, h.hk, sq_n, sq_h, sk_n, sk_h, sv_n, sv_h,
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        state.stride(0), state.stride(1), state.stride(2),
        D_K=h.dk, D_V=h.dv, B_T=launch.node_block, B_K=config.b_k, B_V=config.b_v, **extra,
        USE_QK_L2NORM=bool(use_qk_l2norm), DOT_PRECISION=dot_precision(q.dtype), GRAM_DTYPE=gram_dtype(q),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return res
