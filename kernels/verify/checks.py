"""Argument checks of the verify op (`tree_verify`, `serial_verify`, `tree_commit`): each error names
the argument and what was wrong, before anything reaches a kernel."""

from __future__ import annotations

import math

import torch

from bole_tune.shapes import SUPPORTED_HEAD_DIMS, HeadShape
from bole_tune.tree import TreeBatch

from ..common import (INDEX_DTYPES, INPUT_DTYPES, raise_first, require_dim, require_shape, require_tensor,
                      slot_checks, validation_enabled)
from .pending import path_width
from .result import PendingCommit, PendingPaths, TreeVerifyResult, VerifyShape


def check_verify_inputs(q, k, v, g, beta, state, state_indices, tree, scale, validate) -> VerifyShape:
    """Check the arguments of `tree_verify` / `serial_verify`; raise naming the bad one."""
    if not isinstance(tree, TreeBatch):
        raise TypeError(f"tree: expected a TreeBatch (TreeBatch.from_parents), got {type(tree).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state),
                    ("state_indices", state_indices)):
        require_tensor(name, x)
    require_dim("q", q, 3, "[N, Hk, dk]")
    require_dim("k", k, 3, "[N, Hk, dk]")
    require_dim("v", v, 3, "[N, Hv, dv]")
    require_dim("state", state, 4, "[num_slots, Hv, dv, dk]")
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if n != tree.num_nodes:
        raise ValueError(f"q: has {n} rows but the tree has {tree.num_nodes} nodes (q: [N, Hk, dk])")
    require_shape("k", k, (n, hk, dk), "[N, Hk, dk] like q")
    if v.shape[0] != n:
        raise ValueError(f"v: has {v.shape[0]} rows but the tree has {n} nodes (v: [N, Hv, dv])")
    if hk == 0 or hv % hk != 0:
        raise ValueError(f"v: value heads Hv={hv} must be a positive multiple of key heads Hk={hk}")
    require_shape("g", g, (n, hv), "[N, Hv]")
    require_shape("beta", beta, (n, hv), "[N, Hv]")
    require_shape("state", state, (state.shape[0], hv, dv, dk), "[num_slots, Hv, dv, dk]")
    require_shape("state_indices", state_indices, (tree.num_requests,), "[B] (one slot per request)")
    for name, size in (("dk", dk), ("dv", dv)):
        if size not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"{name}={size} is not supported (supported head sizes: {SUPPORTED_HEAD_DIMS})")
    if q.dtype not in INPUT_DTYPES:
        raise TypeError(f"q: dtype {q.dtype} is not supported (use bfloat16, float16 or float32)")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {x.dtype} differs from q's {q.dtype}; q, k and v must share one dtype")
    for name, x in (("g", g), ("beta", beta)):
        if x.dtype not in (torch.float32, v.dtype):
            raise TypeError(f"{name}: dtype {x.dtype}; expected float32 or the inputs' dtype {v.dtype}")
    if state.dtype != torch.float32:
        raise TypeError(f"state: dtype {state.dtype}; the state pool must be float32")
    if state_indices.dtype not in INDEX_DTYPES:
        raise TypeError(f"state_indices: dtype {state_indices.dtype}; expected int32 or int64")
    if state.stride(-1) != 1:
        raise ValueError("state: the last (dk) dimension must be contiguous (stride 1); the pool is updated in place")
    device = q.device
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state), ("state_indices", state_indices)):
        if x.device != device:
            raise ValueError(f"{name}: on device {x.device} but q is on {device}; all inputs must share one device")
    if tree.device.type != device.type or (device.type == "cuda" and tree.device != device):
        raise ValueError(f"tree: built for device {tree.device} but the inputs are on {device} "
                         "(pass device= to TreeBatch.from_parents or call tree.to(device))")
    if scale is None:
        scale = dk ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a positive finite number or None, got {scale!r}")
    if validation_enabled(validate):
        raise_first([
            *((~torch.isfinite(x).all(), f"{name}: contains NaN or inf") for name, x in (("q", q), ("k", k), ("v", v))),
            (torch.isnan(g).any() | (g == float("inf")).any(), "g: contains NaN or +inf (a log-decay is <= 0)"),
            ((g > 0).any(), "g: has positive entries (g is a log-decay and must be <= 0)"),
            (~torch.isfinite(beta).all(), "beta: contains NaN or inf"),
            (((beta < 0) | (beta > 1)).any(), "beta: has entries outside [0, 1]"),
            *slot_checks(state_indices, state.shape[0]),
        ])
    return VerifyShape(heads=HeadShape(hk=hk, hv=hv, dk=dk, dv=dv), num_nodes=n, num_requests=tree.num_requests,
                       num_slots=state.shape[0], scale=float(scale))


def check_commit_inputs(state, state_indices, result, accepted, validate) -> None:
    """Check the arguments of `tree_commit`; raise naming the bad one."""
    if not isinstance(result, TreeVerifyResult):
        raise TypeError(f"res: expected the TreeVerifyResult of tree_verify/serial_verify, got {type(result).__name__}")
    for name, x in (("state", state), ("state_indices", state_indices), ("accepted", accepted)):
        require_tensor(name, x)
    tree = result.tree
    n, hv, dv = result.u.shape
    dk = result.k.shape[2]
    require_dim("state", state, 4, "[num_slots, Hv, dv, dk]")
    require_shape("state", state, (state.shape[0], hv, dv, dk), "[num_slots, Hv, dv, dk] as verified")
    if state.dtype != torch.float32:
        raise TypeError(f"state: dtype {state.dtype}; the state pool must be float32")
    if state.stride(-1) != 1:
        raise ValueError("state: the last (dk) dimension must be contiguous (stride 1); the pool is updated in place")
    require_shape("state_indices", state_indices, (tree.num_requests,), "[B] (one slot per request)")
    require_shape("accepted", accepted, (tree.num_requests,), "[B] (one node per request)")
    require_shape("res.committed", result.committed, (tree.num_requests,), "[B] (one mark per request)")
    for name, x in (("state_indices", state_indices), ("accepted", accepted)):
        if x.dtype not in INDEX_DTYPES:
            raise TypeError(f"{name}: dtype {x.dtype}; expected int32 or int64")
        if x.device != result.u.device:
            raise ValueError(f"{name}: on device {x.device} but the verification result is on {result.u.device}")
    if state.device != result.u.device:
        raise ValueError(f"state: on device {state.device} but the verification result is on {result.u.device}")
    if validation_enabled(validate):
        sizes = (tree.offsets[1:] - tree.offsets[:-1]).to(accepted.dtype)
        out_of_range = (accepted < -1) | (accepted >= sizes)
        raise_first([
            *slot_checks(state_indices, state.shape[0]),
            (out_of_range.any(), lambda: _accepted_message(accepted, out_of_range, tree)),
        ])


def _accepted_message(accepted, out_of_range, tree) -> str:
    r = int(out_of_range.nonzero()[0, 0])
    return (f"accepted[{r}]={int(accepted[r])} is out of range for request {r} with {tree.sizes[r]} nodes "
            "(expected -1 or a local node index)")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def check_pending(pending, shape: VerifyShape, device, out: TreeVerifyResult | None, validate) -> None:
    """Check `tree_verify`'s ``pending`` (the previous round's commit to fold in); raise naming the field."""
    if not isinstance(pending, PendingCommit) or not isinstance(pending.paths, PendingPaths):
        raise TypeError(f"pending: expected a PendingCommit(PendingPaths, TreeVerifyResult), got {type(pending).__name__}")
    paths, prev = pending.paths, pending.result
    if not isinstance(prev, TreeVerifyResult) or not isinstance(paths.tree, TreeBatch):
        raise TypeError("pending.result: expected the previous round's TreeVerifyResult of this layer")
    h = shape.heads
    require_shape("pending.paths.request_map", paths.request_map, (shape.num_requests,),
                  "[B] (the previous round's request of each slot, or -1)")
    require_shape("pending.paths.accepted", paths.accepted, (paths.tree.num_requests,),
                  "[B_prev] (one node per request of the previous round)")
    if not isinstance(paths.path_rows, torch.Tensor):
        raise TypeError("pending.paths.path_rows: missing (build the paths with PendingPaths(tree, accepted, "
                        "request_map) or PendingPaths.between_rounds)")
    width = path_width(paths.tree)
    require_shape("pending.paths.path_rows", paths.path_rows, (shape.num_requests, width),
                  f"[B, {width}] (each request's pending path by depth)")
    if paths.path_rows.dtype != torch.int32 or not paths.path_rows.is_contiguous():
        raise TypeError(f"pending.paths.path_rows: expected a contiguous int32 tensor, got {paths.path_rows.dtype}")
    require_shape("pending.result.u", prev.u, (paths.tree.num_nodes, h.hv, h.dv), "[N_prev, Hv, dv]")
    require_shape("pending.result.k", prev.k, (paths.tree.num_nodes, h.hk, h.dk), "[N_prev, Hk, dk]")
    for name, x in (("request_map", paths.request_map), ("accepted", paths.accepted)):
        if x.dtype not in INDEX_DTYPES:
            raise TypeError(f"pending.paths.{name}: dtype {x.dtype}; expected int32 or int64")
    for name, x in (("paths.request_map", paths.request_map), ("paths.accepted", paths.accepted),
                    ("paths.path_rows", paths.path_rows),
                    ("result.u", prev.u), ("paths.tree", paths.tree.offsets)):
        if x.device != device:
            raise ValueError(f"pending.{name}: on device {x.device} but the inputs are on {device}")
    if out is not None and any(_overlap(getattr(prev, f), getattr(out, f)) for f in ("u", "log_decay", "k", "k_scale")):
        raise ValueError("out: shares memory with pending.result; the verification would overwrite the factors it "
                         "commits (alternate two result buffers between rounds)")
    if validation_enabled(validate):
        sizes = (paths.tree.offsets[1:] - paths.tree.offsets[:-1]).to(paths.accepted.dtype)
        raise_first([(((paths.accepted < -1) | (paths.accepted >= sizes)).any(),
                      "pending.paths.accepted: has an entry out of range (expected -1 or a local node index)"),
                     (((paths.request_map < -1) | (paths.request_map >= paths.tree.num_requests)).any(),
                      "pending.paths.request_map: has an entry out of range")])
