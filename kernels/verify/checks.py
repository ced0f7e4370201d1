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
from .result import (RECORD_NBYTES, RECORD_POINTERS, PendingCommit, PendingPaths, TreeVerifyResult, VerifyShape,
                     checked_paths, checked_result, factors_fit, result_fits, result_stamp_of, stamp_paths,
                     stamp_result)
from .ring import RingRead, RingResults, RingRound


_F32 = torch.float32
_SHAPES: dict[tuple, VerifyShape] = {}


def check_verify_inputs(q, k, v, g, beta, state, state_indices, tree, scale, validate) -> VerifyShape:
    """Check the arguments of `tree_verify` / `serial_verify`; raise naming the bad one.

    Every call first runs `_verify_shape`, the same conditions as plain comparisons (a few us of host time, the
    common case); only where one fails do the checks below run, to name the argument."""
    shape = _verify_shape(q, k, v, g, beta, state, state_indices, tree, scale)
    if shape is None:
        shape = _explained_verify_shape(q, k, v, g, beta, state, state_indices, tree, scale)
    if validation_enabled(validate):
        raise_first([
            *((~torch.isfinite(x).all(), f"{name}: contains NaN or inf") for name, x in (("q", q), ("k", k), ("v", v))),
            (torch.isnan(g).any() | (g == float("inf")).any(), "g: contains NaN or +inf (a log-decay is <= 0)"),
            ((g > 0).any(), "g: has positive entries (g is a log-decay and must be <= 0)"),
            (~torch.isfinite(beta).all(), "beta: contains NaN or inf"),
            (((beta < 0) | (beta > 1)).any(), "beta: has entries outside [0, 1]"),
            *slot_checks(state_indices, state.shape[0]),
        ])
    return shape


def _verify_shape(q, k, v, g, beta, state, state_indices, tree, scale) -> VerifyShape | None:
    """The call's `VerifyShape` where every host-side condition of `_explained_verify_shape` holds, else None."""
    tensor = torch.Tensor
    if not (type(tree) is TreeBatch and isinstance(q, tensor) and isinstance(k, tensor) and isinstance(v, tensor)
            and isinstance(g, tensor) and isinstance(beta, tensor) and isinstance(state, tensor)
            and isinstance(state_indices, tensor)):
        return None
    qs, vs, ss = q.shape, v.shape, state.shape
    if len(qs) != 3 or len(vs) != 3 or len(ss) != 4:
        return None
    n, hk, dk = qs
    nv, hv, dv = vs
    num_requests = len(tree.sizes)
    dtype, device = q.dtype, q.device
    if not (n == tree.num_nodes and nv == n and k.shape == qs and hk > 0 and hv % hk == 0
            and g.shape == (n, hv) and beta.shape == (n, hv) and ss[1] == hv and ss[2] == dv and ss[3] == dk
            and state_indices.shape == (num_requests,) and dk in SUPPORTED_HEAD_DIMS and dv in SUPPORTED_HEAD_DIMS
            and dtype in INPUT_DTYPES and k.dtype == dtype and v.dtype == dtype
            and (g.dtype == _F32 or g.dtype == dtype) and (beta.dtype == _F32 or beta.dtype == dtype)
            and state.dtype == _F32 and state_indices.dtype in INDEX_DTYPES and state.stride(3) == 1
            and state_indices.stride(0) == 1
            and k.device == device and v.device == device and g.device == device and beta.device == device
            and state.device == device and state_indices.device == device and tree.offsets.device == device):
        return None
    if scale is None:
        scale = dk ** -0.5
    elif type(scale) is not float or not 0 < scale < math.inf:
        return None
    key = (n, hk, hv, dk, dv, num_requests, ss[0], scale)
    shape = _SHAPES.get(key)
    if shape is None:
        if len(_SHAPES) >= 4096:  # a process whose shapes keep changing keeps a bounded table
            _SHAPES.clear()
        shape = _SHAPES[key] = VerifyShape(heads=_head_shape(hk, hv, dk, dv), num_nodes=n,
                                           num_requests=num_requests, num_slots=ss[0], scale=scale)
    return shape


def _explained_verify_shape(q, k, v, g, beta, state, state_indices, tree, scale) -> VerifyShape:
    """`check_verify_inputs`' host-side checks one by one, raising with the argument's name."""
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
    if state_indices.shape[0] > 1 and state_indices.stride(0) != 1:
        raise ValueError(f"state_indices: must be contiguous (stride 1), got stride {state_indices.stride(0)}")
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
    return VerifyShape(heads=HeadShape(hk=hk, hv=hv, dk=dk, dv=dv), num_nodes=n, num_requests=tree.num_requests,
                       num_slots=state.shape[0], scale=float(scale))


def check_commit_inputs(state, state_indices, result, accepted, validate) -> None:
    """Check the arguments of `tree_commit`; raise naming the bad one (the conditions as plain comparisons
    first, `_explain_commit_inputs` where one fails)."""
    if not _commit_inputs_hold(state, state_indices, result, accepted):
        _explain_commit_inputs(state, state_indices, result, accepted)
    if validation_enabled(validate):
        tree = result.tree
        sizes = (tree.offsets[1:] - tree.offsets[:-1]).to(accepted.dtype)
        out_of_range = (accepted < -1) | (accepted >= sizes)
        raise_first([
            *slot_checks(state_indices, state.shape[0]),
            (out_of_range.any(), lambda: _accepted_message(accepted, out_of_range, tree)),
        ])


def _commit_inputs_hold(state, state_indices, result, accepted) -> bool:
    tensor = torch.Tensor
    if not (type(result) is TreeVerifyResult and isinstance(state, tensor) and isinstance(state_indices, tensor)
            and isinstance(accepted, tensor) and isinstance(result.tree, TreeBatch)
            and isinstance(result.u, tensor) and isinstance(result.k, tensor)):
        return False
    us, ks, ss = result.u.shape, result.k.shape, state.shape
    if len(us) != 3 or len(ks) != 3 or len(ss) != 4:
        return False
    n, hv, dv = us
    hk, dk = ks[1], ks[2]
    b, device = len(result.tree.sizes), result.u.device
    if not (n == result.tree.num_nodes and ks[0] == n and ss[1] == hv and ss[2] == dv and ss[3] == dk
            and hv > 0 and dv > 0 and dk > 0 and hk > 0 and hv % hk == 0 and state.dtype == torch.float32
            and state.stride(3) == 1 and state_indices.shape == (b,) and accepted.shape == (b,)
            and state_indices.dtype in INDEX_DTYPES
            and accepted.dtype in INDEX_DTYPES and state_indices.stride(0) == 1 and accepted.stride(0) == 1
            and state_indices.device == device and accepted.device == device and state.device == device
            and result.tree.offsets.device == device):
        return False
    # the factors the kernel reads (their dtypes, shapes, devices and row-major layout): a result a verify made or
    # checked carries the record of that check (`result.stamp_result`), any other is compared field by field
    heads = _HEADS.get((hk, hv, dk, dv)) or _head_shape(hk, hv, dk, dv)
    key = (heads, n, b, device)
    return checked_result(result, key) is not None or factors_fit(result, key)


_HEADS: dict[tuple, HeadShape] = {}


def _head_shape(hk: int, hv: int, dk: int, dv: int) -> HeadShape:
    """One `HeadShape` object per head shape, shared by the verify's `VerifyShape` and the commit's record key: a
    record made by a verify is then matched by identity, not field by field."""
    heads = _HEADS.get((hk, hv, dk, dv))
    if heads is None:
        if len(_HEADS) >= 4096:  # a bounded table, as `_SHAPES`
            _HEADS.clear()
        heads = _HEADS[(hk, hv, dk, dv)] = HeadShape(hk=hk, hv=hv, dk=dk, dv=dv)
    return heads


def _explain_commit_inputs(state, state_indices, result, accepted) -> None:
    """`check_commit_inputs`' host-side checks one by one, raising with the argument's name."""
    if not isinstance(result, TreeVerifyResult):
        raise TypeError(f"res: expected the TreeVerifyResult of tree_verify/serial_verify, got {type(result).__name__}")
    for name, x in (("state", state), ("state_indices", state_indices), ("accepted", accepted)):
        require_tensor(name, x)
    tree = result.tree
    if not isinstance(tree, TreeBatch):
        raise TypeError(f"res.tree: expected the TreeBatch the result verified, got {type(tree).__name__}")
    for name in ("u", "log_decay", "k", "k_scale", "committed"):
        require_tensor(f"res.{name}", getattr(result, name))
    require_dim("res.u", result.u, 3, "[N, Hv, dv]")
    require_dim("res.k", result.k, 3, "[N, Hk, dk]")
    n, hv, dv = result.u.shape
    dk = result.k.shape[2]
    if n != tree.num_nodes or result.k.shape[0] != n:
        raise ValueError(f"res: its factors have {n} rows (u) and {result.k.shape[0]} (k) but its tree has "
                         f"{tree.num_nodes} nodes: commit a result with the tree it verified")
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
    for name in ("k", "log_decay", "k_scale", "committed"):
        if getattr(result, name).device != result.u.device:
            raise ValueError(f"res.{name}: on device {getattr(result, name).device} but res.u is on {result.u.device}")
    if tree.offsets.device != result.u.device:
        raise ValueError(f"res.tree: on device {tree.offsets.device} but res.u is on {result.u.device}")
    for name, x in (("state_indices", state_indices), ("accepted", accepted)):
        if x.stride(0) != 1 and x.shape[0] > 1:
            raise ValueError(f"{name}: must be contiguous (stride 1), got stride {x.stride(0)}")
    # the factors the kernel reads, each as `tree_verify` makes it
    hk = result.k.shape[1]
    if hk == 0 or hv == 0 or hv % hk:
        raise ValueError(f"res.k: has {hk} key heads; res.u's Hv={hv} value heads must be a positive multiple of them")
    if dv == 0 or dk == 0:
        raise ValueError(f"res: head sizes dv={dv} (u) and dk={dk} (k) must be positive")
    if result.k.dtype not in INPUT_DTYPES:
        raise TypeError(f"res.k: dtype {result.k.dtype}; expected the inputs' dtype (bfloat16, float16 or float32)")
    b = tree.num_requests
    for name, size, dtype, meaning in (("u", (n, hv, dv), _F32, "[N, Hv, dv]"), ("log_decay", (n, hv), _F32, "[N, Hv]"),
                                       ("k_scale", (n, hk), _F32, "[N, Hk]"), ("committed", (b,), torch.int32, "[B]")):
        x = getattr(result, name)
        require_shape(f"res.{name}", x, size, meaning)
        if x.dtype != dtype:
            raise TypeError(f"res.{name}: dtype {x.dtype}; expected {dtype} (as tree_verify makes it)")
    for name in ("u", "log_decay", "k", "k_scale", "committed"):
        if not getattr(result, name).is_contiguous():
            raise ValueError(f"res.{name}: must be contiguous (as tree_verify makes it; the commit reads its rows by "
                             "their sizes)")


def _accepted_message(accepted, out_of_range, tree) -> str:
    r = int(out_of_range.nonzero()[0, 0])
    return (f"accepted[{r}]={int(accepted[r])} is out of range for request {r} with {tree.sizes[r]} nodes "
            "(expected -1 or a local node index)")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def check_pending(pending, shape: VerifyShape, device, out: TreeVerifyResult | None, validate) -> tuple:
    """Check `tree_verify`'s ``pending`` (the previous round's commit to fold in); raise naming the field. Returns
    the check records (`result.stamp_paths`, `result.stamp_result`) of its paths and its result: the fold's
    addresses.

    The paths serve every layer of a round and each result is the previous round's output of a verify, so each is
    checked in full (plain comparisons, `_explain_pending` where one fails) the first time it comes and by its
    record after that. ``out``, when given, has been checked by `result.result_buffers` (its record holds its
    spans)."""
    paths_stamp = result_stamp = None
    if type(pending) is PendingCommit:
        paths, prev = pending.paths, pending.result
        if type(paths) is PendingPaths and type(prev) is TreeVerifyResult and type(paths.tree) is TreeBatch:
            tree = paths.tree
            paths_key = (shape.num_requests, device)
            paths_stamp = checked_paths(paths, paths_key)
            if paths_stamp is None and _paths_hold(paths, shape.num_requests, device):
                paths_stamp = stamp_paths(paths, paths_key)
            result_key = (shape.heads, tree.num_nodes, len(tree.sizes), device)
            result_stamp = checked_result(prev, result_key)
            if result_stamp is None and result_fits(prev, result_key, None):
                result_stamp = stamp_result(prev, result_key)
    if paths_stamp is None or result_stamp is None or (out is not None and _shares_factors(out, result_stamp)):
        _explain_pending(pending, shape, device, out)
    verified_on = pending.result.tree
    if verified_on is not pending.paths.tree and verified_on is not None:  # the same object: the common case
        _same_trees(verified_on, pending.paths.tree, validate)
    if validation_enabled(validate):
        paths = pending.paths
        sizes = (paths.tree.offsets[1:] - paths.tree.offsets[:-1]).to(paths.accepted.dtype)
        raise_first([(((paths.accepted < -1) | (paths.accepted >= sizes)).any(),
                      "pending.paths.accepted: has an entry out of range (expected -1 or a local node index)"),
                     (((paths.request_map < -1) | (paths.request_map >= paths.tree.num_requests)).any(),
                      "pending.paths.request_map: has an entry out of range")])
    return paths_stamp, result_stamp


def _same_trees(verified_on, paths_tree: TreeBatch, validate) -> None:
    """The trees a folded verify's previous result was verified on (``pending.result.tree``) must be its paths' (a
    path's rows index that result): checked on the host by their sizes and depth and, where both were built from
    host parent lists, their parents; where either was built on the device, its parents with ``validate``."""
    if not isinstance(verified_on, TreeBatch):
        raise TypeError(f"pending.result.tree: expected the TreeBatch it was verified on, got "
                        f"{type(verified_on).__name__}")
    message = ("pending: pending.result was verified on other trees than pending.paths.tree (build the paths from "
               "the round that result belongs to: PendingPaths.between_rounds(that round's tree, ...))")
    if verified_on.sizes != paths_tree.sizes or verified_on.depth != paths_tree.depth:
        raise ValueError(f"{message}: sizes {list(verified_on.sizes)} and depth {verified_on.depth} against "
                         f"{list(paths_tree.sizes)} and {paths_tree.depth}")
    if verified_on._host_parents and paths_tree._host_parents:
        if verified_on._host_parents != paths_tree._host_parents:
            raise ValueError(f"{message}: the same sizes, other parents")
    elif validation_enabled(validate) and verified_on.parents.device == paths_tree.parents.device:
        raise_first([((verified_on.parents != paths_tree.parents).any(), f"{message}: the same sizes, other parents")])


def _paths_hold(paths: PendingPaths, num_requests: int, device) -> bool:
    request_map, accepted, rows, tree = paths.request_map, paths.accepted, paths.path_rows, paths.tree
    tensor = torch.Tensor
    return (isinstance(request_map, tensor) and isinstance(accepted, tensor) and isinstance(rows, tensor)
            and request_map.shape == (num_requests,) and accepted.shape == (len(tree.sizes),)
            and rows.shape == (num_requests, path_width(tree)) and rows.dtype == torch.int32 and rows.is_contiguous()
            and request_map.dtype in INDEX_DTYPES and accepted.dtype in INDEX_DTYPES
            and (request_map.stride(0) == 1 or num_requests < 2)
            and request_map.device == device and accepted.device == device and rows.device == device
            and tree.offsets.device == device)


def _shares_factors(out: TreeVerifyResult, prev_stamp: tuple) -> bool:
    """Whether ``out``'s factors overlap the previous result's (``prev_stamp``, `result.stamp_result`): the verify
    would overwrite what it folds in. ``out`` carries its record (`result.result_buffers` checked it)."""
    if type(out) is not TreeVerifyResult:
        return True
    out_stamp = result_stamp_of(out)
    if out_stamp is None:
        return True
    (_, a1, a2, a3, a4, _), (_, b1, b2, b3, b4, _) = prev_stamp[RECORD_POINTERS], out_stamp[RECORD_POINTERS]
    (n1, n2, n3, n4), (m1, m2, m3, m4) = prev_stamp[RECORD_NBYTES], out_stamp[RECORD_NBYTES]  # u, log_decay, k, k_scale
    return ((a1 < b1 + m1 and b1 < a1 + n1) or (a2 < b2 + m2 and b2 < a2 + n2) or (a3 < b3 + m3 and b3 < a3 + n3)
            or (a4 < b4 + m4 and b4 < a4 + n4))


def _explain_pending(pending, shape: VerifyShape, device, out: TreeVerifyResult | None) -> None:
    """`check_pending`'s host-side checks one by one, raising with the field's name."""
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
    if paths.request_map.shape[0] > 1 and paths.request_map.stride(0) != 1:
        raise ValueError("pending.paths.request_map: must be contiguous (stride 1)")
    for name, dtype in (("u", torch.float32), ("log_decay", torch.float32), ("k_scale", torch.float32),
                        ("committed", torch.int32)):
        if getattr(prev, name).dtype != dtype:
            raise TypeError(f"pending.result.{name}: dtype {getattr(prev, name).dtype}; expected {dtype} "
                            "(the previous round's TreeVerifyResult)")
    for name, x in (("paths.request_map", paths.request_map), ("paths.accepted", paths.accepted),
                    ("paths.path_rows", paths.path_rows),
                    ("result.u", prev.u), ("result.log_decay", prev.log_decay), ("result.k", prev.k),
                    ("result.k_scale", prev.k_scale), ("result.committed", prev.committed),
                    ("paths.tree", paths.tree.offsets)):
        if x.device != device:
            raise ValueError(f"pending.{name}: on device {x.device} but the inputs are on {device}")
    n_prev, b_prev = paths.tree.num_nodes, paths.tree.num_requests
    for name, size, what in (("o", (n_prev, h.hv, h.dv), "[N_prev, Hv, dv]"), ("log_decay", (n_prev, h.hv), "[N_prev, Hv]"),
                             ("k_scale", (n_prev, h.hk), "[N_prev, Hk]"), ("committed", (b_prev,), "[B_prev]")):
        require_shape(f"pending.result.{name}", getattr(prev, name), size, what)
    if prev.k.dtype not in INPUT_DTYPES or prev.o.dtype != prev.k.dtype:
        raise TypeError(f"pending.result.k: dtype {prev.k.dtype} (o: {prev.o.dtype}); expected one input dtype for "
                        "both (the previous round's TreeVerifyResult)")
    if prev.o.device != device:
        raise ValueError(f"pending.result.o: on device {prev.o.device} but the inputs are on {device}")
    for name in ("o", "u", "log_decay", "k", "k_scale", "committed"):
        if not getattr(prev, name).is_contiguous():
            raise ValueError(f"pending.result.{name}: must be contiguous (the previous round's TreeVerifyResult)")
    if not isinstance(paths.request_map, torch.Tensor) or not isinstance(paths.accepted, torch.Tensor):
        raise TypeError("pending.paths.request_map, pending.paths.accepted: expected tensors")
    if isinstance(out, TreeVerifyResult) and any(_overlap(getattr(prev, f), getattr(out, f)) for f in ("u", "log_decay", "k", "k_scale")):
        raise ValueError("out: shares memory with pending.result; the verification would overwrite the factors it "
                         "commits (alternate two result buffers between rounds)")
    raise TypeError("pending: expected a PendingCommit(PendingPaths, TreeVerifyResult) of exactly those classes, "
                    f"got {type(pending).__name__}({type(paths).__name__}, {type(prev).__name__})")


def check_ring(ring, shape: VerifyShape, tree: TreeBatch, dtype, device, out, pending) -> None:
    """Check `tree_verify`'s ``ring`` (a `RingRead`: this round of a `PendingRing` and one layer's arena); raise
    naming the field. Host-side only: the tables' values are the ring's own (`PendingRing.end` checks what it
    appends under validation)."""
    if not isinstance(ring, RingRead) or not isinstance(ring.step, RingRound) or not isinstance(ring.results, RingResults):
        raise TypeError(f"ring: expected a RingRead (PendingRing.begin(tree).layer(results)), got {type(ring).__name__}")
    if pending is not None:
        raise ValueError("ring, pending: give one (a ring keeps the pending rounds itself)")
    if out is not None:
        raise ValueError("out: with ring=, the result is written into the ring's arena (ring.results.at(position)); "
                         "leave out unset")
    step, arena, table = ring.step, ring.results, ring.step.ring
    if step.tree is not tree:
        raise ValueError("ring: planned for other trees (call PendingRing.begin with this round's tree)")
    fields = (arena.o, arena.u, arena.log_decay, arena.k, arena.k_scale, arena.committed)
    key = (shape.heads, shape.num_slots, dtype, device, table, *map(id, fields))
    if arena.checked == key:  # these buffers, this ring and these inputs' shapes were checked before
        return
    if shape.num_slots != table.num_slots:
        raise ValueError(f"ring: built for {table.num_slots} slots but the state pool has {shape.num_slots}")
    h, p, n = shape.heads, table.rounds + 1, table.capacity
    expected = {"o": ((p, n, h.hv, h.dv), dtype), "u": ((p, n, h.hv, h.dv), _F32), "log_decay": ((p, n, h.hv), _F32),
                "k": ((p, n, h.hk, h.dk), dtype), "k_scale": ((p, n, h.hk), _F32),
                "committed": ((p, table.max_requests), torch.int32)}
    for name, (size, dt) in expected.items():
        x = getattr(arena, name)
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != size or x.dtype != dt or not x.is_contiguous():
            raise ValueError(f"ring.results.{name}: expected a contiguous {dt} tensor of shape {size} "
                             f"(PendingRing.results(heads, dtype)), got {getattr(x, 'dtype', None)} "
                             f"{tuple(getattr(x, 'shape', ()))}")
        if x.device != device:
            raise ValueError(f"ring.results.{name}: on device {x.device} but the inputs are on {device}")
    if table.device != device:
        raise ValueError(f"ring: its tables are on device {table.device} but the inputs are on {device}")
    arena.checked = key
