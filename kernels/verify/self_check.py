"""The resident kernel's runtime self-check: one small instance of a launch's specialisation against
the float64 reference (the planner caches the result per specialisation)."""

from __future__ import annotations

import torch

from bole_tune.shapes import HeadShape
from bole_tune.workloads import make_inputs, make_tree, relative_error

from ..reference import verify_reference
from .planner import Launch
from .result import VerifyShape, result_buffers
from .run import run_launch

TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 1e-2, torch.float16: 1e-2}
"""The verifier's contract: relative error against the float64 reference, per input dtype."""

CHECK_SEED = 12345


def accepted_error(dtype: torch.dtype) -> float:
    """The relative error a launch may show on a check instance to be used, timed or recorded: half the
    contract's bound. Right configs land near 2e-3 with 16-bit inputs, while a Triton miscompile seen on
    the H200 came out at 1.3e-2 on one instance and under 1e-2 on another; nothing may pass on a lucky
    instance."""
    return TOLERANCE[dtype] / 2


def check_resident(launch: Launch, heads: HeadShape, dtype: torch.dtype, gate_dtype: torch.dtype, scale: float,
                   use_qk_l2norm: bool, device: torch.device, deep: bool) -> tuple[float, float]:
    """(relative error, allowed error) of ``launch`` on one random request of ``launch.node_block`` nodes (half
    that on stacked rows; a chain when ``deep``) with this head shape, dtypes and scale: the specialisation it vouches for."""
    size = launch.node_block // 2 if launch.stack_qk else launch.node_block  # stacked rows: half the block
    tree = make_tree([size], kind="chain" if deep else "random", seed=CHECK_SEED, device=device)
    x = make_inputs(tree, heads.hk, heads.hv, heads.dk, heads.dv, dtype, device, gate_dtype=gate_dtype,
                    seed=CHECK_SEED)
    shape = VerifyShape(heads=heads, num_nodes=tree.num_nodes, num_requests=1, num_slots=x.state.shape[0],
                        scale=scale)
    res = run_launch(launch, *x.args(tree), shape, result_buffers(shape, dtype, device, tree, None), use_qk_l2norm)
    ref = verify_reference(*x.args(tree), scale=scale, use_qk_l2norm=use_qk_l2norm, keep_states=False)
    return relative_error(res.o, ref.o), accepted_error(dtype)
