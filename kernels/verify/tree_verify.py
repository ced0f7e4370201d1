"""`tree_verify`: the Bole verifier's public entry, and the process's launch planner.

The work is the closed form of docs/math.md §2 on one of two kernels (`fused.py`, any tree size;
`resident.py`, trees of at most 64 nodes, one program per head); `PLANNER` decides which, with which
tiles and switches (`planner.py`), and `run.py` launches it.
"""

from __future__ import annotations

import torch

from bole_tune.config import KernelConfig
from bole_tune.shapes import HeadShape
from bole_tune.tree import TreeBatch

from ..common import other_cuda_device, use_triton, validation_enabled
from ..reference import commit_pending_closed_form, verify_closed_form
from .checks import check_pending, check_ring, check_verify_inputs
from .planner import Launch, Planner
from .result import PendingCommit, TreeVerifyResult, result_buffers, result_stamp_of
from .ring import RingRead, ring_states
from .run import run_launch
from .self_check import check_resident

PLANNER = Planner(self_check=check_resident)
"""The planner every launch of this process goes through (one config source, one self-check cache)."""


def plan_launch(heads: HeadShape, dtype, **kwargs) -> Launch:
    """`Planner.plan` of the process's planner: what `tree_verify` would launch (keywords as there)."""
    return PLANNER.plan(heads, dtype, **kwargs)


def tree_verify(q, k, v, g, beta, state, state_indices, tree: TreeBatch, scale=None, use_qk_l2norm=True,
                config: KernelConfig | None = None, validate: bool | None = None,
                out: TreeVerifyResult | None = None, variant: str | None = None,
                v_split: int | None = None, launch: Launch | None = None,
                pending: PendingCommit | None = None, ring: RingRead | None = None) -> TreeVerifyResult:
    """Verify every node of ``tree`` through one GDN layer; never writes ``state``.

    Args:
        q, k: ``[N, Hk, dk]``; v: ``[N, Hv, dv]`` (Hv a multiple of Hk); bf16, fp16 or fp32.
        g: ``[N, Hv]`` log-decay (<= 0); beta: ``[N, Hv]`` in [0, 1]; float32 or the inputs' dtype.
        state: ``[num_slots, Hv, dv, dk]`` float32 pool; state_indices: ``[B]`` slot of each request.
        tree: the proposal trees (`TreeBatch`), on the inputs' device.
        scale: multiplies q (default ``dk ** -0.5``); use_qk_l2norm: L2-normalise q and k first.
        config: tile configuration; None takes the tuned one for this GPU and shape.
        validate: check values (NaN gates, slot indices); None follows ``BOLE_TUNE_VALIDATE``.
        out: a `TreeVerifyResult` to write into (buffers reused across layers): checked in full the first time,
            then by the record of that check while its tensors stay the same (`result.stamp_result`). None: a set of
            buffers recycled from an earlier call that nothing holds any more, else fresh ones (`result.ResultPool`).
        variant: "fused" (any tree size), "resident" (trees of at most 64 nodes, one program per head),
            "stream" (the resident kernel, one value tile of ``b_v`` rows per program, its state read first) or None: with ``config=None`` the kernel the database's config was tuned on, else the
            planner's choice by batch and tree size. Both give the same results.
        v_split: the resident kernel's programs per head (a power of two, at most ``dv / b_v``); None:
            the planner's for the batch's bucket (what the tuner timed). Ignored by the fused kernel.
        launch: a whole `Launch` (from `plan_launch`, perhaps with switches changed) instead of
            config/variant/v_split; it is checked against this batch.
        pending: the previous round's accepted paths of this layer (`PendingCommit`), committed into each
            request's slot in the same launch before it is read: the round's commit folded into this
            verify (one read and one write of the state instead of two launches). The slot then holds the
            committed state. Requests with nothing pending (-1 in the paths' request map) read their slot
            as it is; a slot whose request left must be committed with `tree_commit` (the flush). ``out``
            must not share memory with ``pending.result``: alternate two result buffers between rounds.
        ring: instead of ``pending``, this round of a `PendingRing` with this layer's arena
            (``ring.begin(tree).layer(results)``, `ring.py`): the slots are read through up to ``R`` rounds of
            pending tokens and not written, but in every ``R``-th round, which folds them in and writes the slots.
            The result is written into the arena (``out`` stays unset).

    Returns:
        `TreeVerifyResult`: ``o`` ``[N, Hv, dv]`` in v's dtype and the factors for `tree_commit`.
    """
    if isinstance(q, torch.Tensor) and q.is_cuda and (elsewhere := other_cuda_device(q)) is not None:
        with torch.cuda.device(elsewhere):  # Triton launches on the current device: make it the inputs'
            return tree_verify(q, k, v, g, beta, state, state_indices, tree, scale, use_qk_l2norm, config, validate,
                               out, variant, v_split, launch, pending, ring)
    validate = validation_enabled(validate)  # resolved once (the environment is read once per call)
    shape = check_verify_inputs(q, k, v, g, beta, state, state_indices, tree, scale, validate)
    res = stamps = None
    if ring is not None:
        check_ring(ring, shape, tree, q.dtype, q.device, out, pending)
        out = ring.results.at(ring.step.position, tree)
    elif pending is not None:
        if out is not None:  # checked first: the pending check compares the two results' spans from its record
            res = out = result_buffers(shape, q.dtype, q.device, tree, out)
        stamps = check_pending(pending, shape, q.device, out, validate)
    use_qk_l2norm = bool(use_qk_l2norm)
    if launch is None:
        launch = PLANNER.plan(shape.heads, q.dtype, num_requests=shape.num_requests,
                              max_tree_size=tree.max_tree_size, depth=tree.depth, device=q.device, config=config,
                              variant=variant, v_split=v_split, scale=shape.scale,
                              use_qk_l2norm=use_qk_l2norm, gate_dtype=g.dtype,
                              fold=pending is not None, ring=ring is not None and ring.step.write)
    else:
        if (config, variant, v_split) != (None, None, None):
            raise ValueError("launch: give either a launch or config/variant/v_split, not both")
        launch = PLANNER.given(launch, shape.heads, q.dtype, g.dtype, tree.max_tree_size, tree.depth, shape.scale,
                               use_qk_l2norm, q.device)
    if not use_triton(q.device):
        if pending is not None:
            commit_pending_closed_form(state, state_indices, pending)
        if ring is not None:  # the states through the pending tokens: written in a write round, else a copy read
            read = ring_states(state, state_indices, ring.step.ring, ring.results)
            if ring.step.write:
                state[state_indices.long()] = read
            else:
                state, state_indices = read, torch.arange(len(state_indices), device=state.device)
        return verify_closed_form(q, k, v, g, beta, state, state_indices, tree, shape.scale, use_qk_l2norm,
                                  validate=False, out=out)
    if res is None:
        res = result_buffers(shape, q.dtype, q.device, tree, out)
    # the records this call's checks made or confirmed (a result's, the pending paths' and result's): their addresses
    records = (result_stamp_of(res), *(stamps or (None, None)))
    return run_launch(launch, q, k, v, g, beta, state, state_indices, tree, shape, res, use_qk_l2norm, pending, ring,
                      records)
