"""What a verification call returns (the outputs and the factors the commit needs), and its buffers."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from bole_tune.shapes import HeadShape
from bole_tune.tree import TreeBatch

from .pending import pending_path_rows


@dataclass
class TreeVerifyResult:
    """Outputs of one verification call and the factors `tree_commit` needs (docs/math.md §4).

    o: ``[N, Hv, dv]`` in v's dtype, every node's output.
    u: ``[N, Hv, dv]`` float32, the factorized updates ``U = (I + G)^-1 R``.
    log_decay: ``[N, Hv]`` float32, ``logP`` (path cumulative sum of g).
    k: ``[N, Hk, dk]`` in k's dtype, a copy of the raw keys (inputs may be reused before commit).
    k_scale: ``[N, Hk]`` float32, the factor that normalises each key (1 without L2 norm).
    committed: ``[B]`` int32, 0 until a request's path is committed, then the commit's `commit_epoch`: a
        commit (or fold) skips a request already committed by an earlier one, so committing twice is a no-op.
    tree: the trees verified.
    """

    o: torch.Tensor
    u: torch.Tensor
    log_decay: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor
    committed: torch.Tensor
    tree: TreeBatch


@dataclass(frozen=True)
class PendingPaths:
    """A round's accepted paths not yet committed, once per round for every layer (docs/math.md §4).

    tree, accepted: that round's trees and accepted node per request (-1: nothing accepted).
    request_map: ``[B]`` int32, for each request of the next round the request of the same slot in that
    round, or -1 (a request that joined). Build it with `between_rounds`.
    path_rows: ``[B, width]`` int32, for each request of the next round the packed rows (in ``tree``) of its
    slot's pending path by depth (root first), -1 past the accepted node and for a request with nothing
    pending; ``width`` a power of two >= 16 above ``tree.depth``. Worked out on the device from the other
    fields when not given (`pending.pending_path_rows`: one launch, once per round for all layers), so the
    verify kernels read a path instead of searching the tree for it. Build new paths after changing
    ``accepted``.
    """

    tree: TreeBatch
    accepted: torch.Tensor
    request_map: torch.Tensor
    path_rows: torch.Tensor | None = None

    def __post_init__(self):
        if self.path_rows is None and isinstance(self.tree, TreeBatch) and isinstance(self.accepted, torch.Tensor) \
                and isinstance(self.request_map, torch.Tensor) and self.accepted.shape == (self.tree.num_requests,):
            object.__setattr__(self, "path_rows", pending_path_rows(self.tree, self.accepted, self.request_map))

    @classmethod
    def between_rounds(cls, tree: TreeBatch, accepted, state_indices, next_state_indices,
                       num_slots: int) -> "PendingPaths":
        """From a round's ``(tree, accepted, state_indices)`` and the next round's slots (device work only)."""
        device = tree.device
        inverse = torch.full((num_slots,), -1, dtype=torch.int32, device=device)
        inverse[state_indices.long()] = torch.arange(len(state_indices), dtype=torch.int32, device=device)
        return cls(tree, accepted, inverse[next_state_indices.long()])


@dataclass(frozen=True)
class PendingCommit:
    """What one layer's `tree_verify(..., pending=...)` commits into its pool before verifying: the round's
    `PendingPaths` and this layer's `TreeVerifyResult` of that round (not the buffers being written now)."""

    paths: PendingPaths
    result: TreeVerifyResult


@dataclass(frozen=True)
class VerifyShape:
    """The sizes of one verification call: its head shape, nodes, requests, pool slots and q scale."""

    heads: HeadShape
    num_nodes: int
    num_requests: int
    num_slots: int
    scale: float


_epochs = itertools.count(1)


def commit_epoch() -> int:
    """A number no earlier commit launch of this process used (below 2^31): the launch marks the requests
    it commits with it, and each of its programs proceeds where the mark is 0 or its own."""
    return next(_epochs) % (2 ** 31 - 1) + 1


def result_buffers(shape: VerifyShape, dtype: torch.dtype, device, tree: TreeBatch,
                   out: TreeVerifyResult | None) -> TreeVerifyResult:
    """Fresh output buffers, or ``out`` (for example reused across layers) after checking it fits."""
    h, n = shape.heads, shape.num_nodes
    if type(device) is not torch.device:
        device = torch.device(device)
    if out is None:  # the default call: six fresh buffers, nothing else (a call's host time counts)
        f32, hv, hk = torch.float32, h.hv, h.hk
        return TreeVerifyResult(torch.empty((n, hv, h.dv), dtype=dtype, device=device),
                                torch.empty((n, hv, h.dv), dtype=f32, device=device),
                                torch.empty((n, hv), dtype=f32, device=device),
                                torch.empty((n, hk, h.dk), dtype=dtype, device=device),
                                torch.empty((n, hk), dtype=f32, device=device),
                                torch.empty((shape.num_requests,), dtype=torch.int32, device=device), tree)
    if type(out) is TreeVerifyResult:  # the same conditions as below as plain comparisons, the common case
        f32, hv, hk = torch.float32, h.hv, h.hk
        o, u, log_decay, k, k_scale, committed = out.o, out.u, out.log_decay, out.k, out.k_scale, out.committed
        if (isinstance(o, torch.Tensor) and isinstance(u, torch.Tensor) and isinstance(log_decay, torch.Tensor)
                and isinstance(k, torch.Tensor) and isinstance(k_scale, torch.Tensor)
                and isinstance(committed, torch.Tensor)
                and o.shape == (n, hv, h.dv) and u.shape == (n, hv, h.dv) and log_decay.shape == (n, hv)
                and k.shape == (n, hk, h.dk) and k_scale.shape == (n, hk) and committed.shape == (shape.num_requests,)
                and o.dtype == dtype and u.dtype == f32 and log_decay.dtype == f32 and k.dtype == dtype
                and k_scale.dtype == f32 and committed.dtype == torch.int32
                and o.device == device and u.device == device and log_decay.device == device and k.device == device
                and k_scale.device == device and committed.device == device
                and o.is_contiguous() and u.is_contiguous() and log_decay.is_contiguous() and k.is_contiguous()
                and k_scale.is_contiguous() and committed.is_contiguous()):
            out.tree = tree
            return out
    expected = {
        "o": ((n, h.hv, h.dv), dtype),
        "u": ((n, h.hv, h.dv), torch.float32),
        "log_decay": ((n, h.hv), torch.float32),
        "k": ((n, h.hk, h.dk), dtype),
        "k_scale": ((n, h.hk), torch.float32),
        "committed": ((shape.num_requests,), torch.int32),
    }
    if not isinstance(out, TreeVerifyResult):
        raise TypeError(f"out: expected a TreeVerifyResult to write into, got {type(out).__name__}")
    for name, (size, dt) in expected.items():
        x = getattr(out, name)
        if tuple(x.shape) != size or x.dtype != dt or x.device != torch.device(device) or not x.is_contiguous():
            raise ValueError(f"out.{name}: expected a contiguous {dt} tensor of shape {size} on {device}, "
                             f"got {x.dtype} {tuple(x.shape)} on {x.device}")
    out.tree = tree
    return out
