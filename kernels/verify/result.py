"""What a verification call returns (the outputs and the factors the commit needs), and its buffers."""

from __future__ import annotations

import itertools
import os
import sys
import threading
from dataclasses import dataclass

import torch

from bole_tune.shapes import HeadShape
from bole_tune.tree import TreeBatch

from ..common import INPUT_DTYPES, raise_first, require_index_vector, slot_checks, validation_enabled
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
                       num_slots: int, validate: bool | None = None) -> "PendingPaths":
        """From a round's ``(tree, accepted, state_indices)`` and the next round's slots (device work only).

        The arguments' types, shapes, dtypes and devices are checked on the host; their values (slots in
        ``[0, num_slots)``, each named once a round, accepted nodes in range) with ``validate`` (or
        ``BOLE_TUNE_VALIDATE=1``), as the verify's are. Unchecked, a slot out of range pairs with nothing: a
        next-round request on one has nothing pending, and a previous request on one is left out (no index
        outside the tables is ever read or written)."""
        if not isinstance(tree, TreeBatch):
            raise TypeError(f"tree: expected the previous round's TreeBatch, got {type(tree).__name__}")
        if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 1:
            raise ValueError(f"num_slots: expected a positive int (the pool's slots), got {num_slots!r}")
        device, b = tree.device, tree.num_requests
        require_index_vector("accepted", accepted, device, b)
        require_index_vector("state_indices", state_indices, device, b)
        require_index_vector("next_state_indices", next_state_indices, device)
        if validation_enabled(validate):
            sizes = (tree.offsets[1:] - tree.offsets[:-1]).to(accepted.dtype)
            raise_first([*slot_checks(state_indices, num_slots), *slot_checks(next_state_indices, num_slots,
                                                                              "next_state_indices"),
                         (((accepted < -1) | (accepted >= sizes)).any(),
                          "accepted: has an entry out of range (expected -1 or a local node index)")])
        prev, following = state_indices.long(), next_state_indices.long()
        # one entry past the pool's: where slots out of range land, -1 whatever lands there
        inverse = torch.full((num_slots + 1,), -1, dtype=torch.int32, device=device)
        inverse[torch.where((prev >= 0) & (prev < num_slots), prev, num_slots)] = torch.arange(
            b, dtype=torch.int32, device=device)
        inverse[num_slots] = -1
        return cls(tree, accepted, inverse[torch.where((following >= 0) & (following < num_slots), following,
                                                       num_slots)])


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


_STAMP = "_checked"
"""The attribute under which a `TreeVerifyResult` / `PendingPaths` keeps the record of its last full check."""

# what a result's record (a tuple, `stamp_result`) holds past its key, six tensors and their six versions
RECORD_POINTERS, RECORD_BITS, RECORD_NBYTES, RECORD_O_DTYPE, RECORD_K_DTYPE = 13, 14, 15, 16, 17
# and a paths' record (`stamp_paths`) past its key, four objects and three versions
PATHS_POINTERS, PATHS_BITS, PATHS_MAP_DTYPE = 8, 9, 10


def stamp_result(res: TreeVerifyResult, key: tuple) -> tuple:
    """Record that ``res``'s six buffers passed the full check for ``key`` (heads, nodes, requests, device), so the
    next call that gets the same object checks the record instead (`checked_result`): about a quarter of the host
    time of the comparisons.

    The record holds the six tensors, their version counters, their addresses (OR-ed for the launch's alignment
    key) and the byte spans of the four factors (the overlap check of ``out`` and ``pending``). It stays valid while
    every field is the same tensor object at the same version: reassigning a field fails the identity test, and
    every in-place change of a tensor's shape, strides or storage (``resize_``, ``set_``, ``as_strided_``,
    ``t_`` ...) moves its version counter, as does any write through torch. The kernels' own writes (Triton) do not,
    so a result reused across rounds keeps its record. One way around it is not seen: assigning a tensor's ``.data``
    (PyTorch's escape hatch from its own tracking) moves no counter."""
    stamp = _result_stamp(key, res.o, res.u, res.log_decay, res.k, res.k_scale, res.committed)
    res.__dict__[_STAMP] = stamp
    return stamp


def _result_stamp(key, o, u, log_decay, k, k_scale, committed) -> tuple:
    pointers = (o.data_ptr(), u.data_ptr(), log_decay.data_ptr(), k.data_ptr(), k_scale.data_ptr(),
                committed.data_ptr())
    return (key, o, u, log_decay, k, k_scale, committed, o._version, u._version, log_decay._version, k._version,
            k_scale._version, committed._version, pointers, pointers[0] | pointers[1] | pointers[2] | pointers[3]
            | pointers[4] | pointers[5], (u.nbytes, log_decay.nbytes, k.nbytes, k_scale.nbytes), o.dtype, k.dtype)


def checked_result(res: TreeVerifyResult, key: tuple) -> tuple | None:
    """``res``'s record (`stamp_result`) where it was checked for ``key`` and nothing changed since, else None.
    ``res`` must be a `TreeVerifyResult` (the caller has tested its type)."""
    s = res.__dict__.get(_STAMP)
    if (s is not None and s[0] == key and res.o is s[1] and res.u is s[2] and res.log_decay is s[3]
            and res.k is s[4] and res.k_scale is s[5] and res.committed is s[6] and s[1]._version == s[7]
            and s[2]._version == s[8] and s[3]._version == s[9] and s[4]._version == s[10]
            and s[5]._version == s[11] and s[6]._version == s[12]):
        return s
    return None


def result_fits(res: TreeVerifyResult, key: tuple, dtype: torch.dtype | None) -> bool:
    """Whether ``res``'s six fields are contiguous tensors of a verification of ``key`` (heads, nodes, requests,
    device): outputs and keys in ``dtype`` (None: any one input dtype for both), the factors float32, the marks
    int32. Plain comparisons, no error: the callers explain a failure field by field."""
    o = res.o
    if dtype is None:
        dtype = getattr(res.k, "dtype", None)
        if dtype not in INPUT_DTYPES:
            return False
    h, n = key[0], key[1]
    return (isinstance(o, torch.Tensor) and o.shape == (n, h.hv, h.dv) and o.dtype == dtype and o.device == key[3]
            and o.is_contiguous() and factors_fit(res, key, dtype))


def factors_fit(res: TreeVerifyResult, key: tuple, dtype: torch.dtype | None = None) -> bool:
    """`result_fits` of the five fields a commit reads (``u``, ``log_decay``, ``k``, ``k_scale``, ``committed``;
    not the outputs ``o``): keys in ``dtype`` (None: any input dtype)."""
    h, n, b, device = key
    f32, hv, hk = torch.float32, h.hv, h.hk
    u, log_decay, k, k_scale, committed = res.u, res.log_decay, res.k, res.k_scale, res.committed
    return (isinstance(u, torch.Tensor) and isinstance(log_decay, torch.Tensor) and isinstance(k, torch.Tensor)
            and isinstance(k_scale, torch.Tensor) and isinstance(committed, torch.Tensor)
            and u.shape == (n, hv, h.dv) and log_decay.shape == (n, hv) and k.shape == (n, hk, h.dk)
            and k_scale.shape == (n, hk) and committed.shape == (b,)
            and u.dtype == f32 and log_decay.dtype == f32 and k_scale.dtype == f32 and committed.dtype == torch.int32
            and (k.dtype == dtype if dtype is not None else k.dtype in INPUT_DTYPES)
            and u.device == device and log_decay.device == device and k.device == device
            and k_scale.device == device and committed.device == device
            and u.is_contiguous() and log_decay.is_contiguous() and k.is_contiguous() and k_scale.is_contiguous()
            and committed.is_contiguous())


def result_stamp_of(res: TreeVerifyResult) -> tuple | None:
    """``res``'s record as it was last made (`stamp_result`), without testing it: for a result just checked."""
    return res.__dict__.get(_STAMP)


def stamp_paths(paths: "PendingPaths", key: tuple) -> tuple:
    """The same record for `PendingPaths` checked for ``key`` (requests of the verify, device): its tensors, their
    versions and the addresses the fold reads (request map, path rows). One `PendingPaths` serves every layer of a
    round, so its full check runs once a round."""
    request_map, accepted, rows = paths.request_map, paths.accepted, paths.path_rows
    pointers = (request_map.data_ptr(), rows.data_ptr())
    stamp = (key, request_map, accepted, rows, paths.tree, request_map._version, accepted._version, rows._version,
             pointers, pointers[0] | pointers[1], request_map.dtype)
    paths.__dict__[_STAMP] = stamp
    return stamp


def checked_paths(paths: "PendingPaths", key: tuple) -> tuple | None:
    """``paths``' record (`stamp_paths`) where it was checked for ``key`` and nothing changed since, else None."""
    s = paths.__dict__.get(_STAMP)
    if (s is not None and s[0] == key and paths.request_map is s[1] and paths.accepted is s[2]
            and paths.path_rows is s[3] and paths.tree is s[4] and s[1]._version == s[5] and s[2]._version == s[6]
            and s[3]._version == s[7]):
        return s
    return None


_epochs = itertools.count(1)


def commit_epoch() -> int:
    """A number no earlier commit launch of this process used (below 2^31): the launch marks the requests
    it commits with it, and each of its programs proceeds where the mark is 0 or its own."""
    return next(_epochs) % (2 ** 31 - 1) + 1


_ALIGN = 256  # each buffer of a recycled set starts on a 256-byte boundary of the set's one allocation


def _buffer_layout(shape: VerifyShape, dtype: torch.dtype) -> tuple:
    """The six buffers' ``(shape, dtype)`` in `TreeVerifyResult`'s order."""
    h, n, f32 = shape.heads, shape.num_nodes, torch.float32
    return (((n, h.hv, h.dv), dtype), ((n, h.hv, h.dv), f32), ((n, h.hv), f32), ((n, h.hk, h.dk), dtype),
            ((n, h.hk), f32), ((shape.num_requests,), torch.int32))


def _free(buffers: list, baseline: tuple) -> bool:
    """Whether a set shows only the pool's own holds again (`_holds` equals ``baseline``): the first buffer's
    references first, so a set a result still holds is passed over for about a tenth of the whole test."""
    first = buffers[0]  # counted as `_holds` counts its own first name
    if sys.getrefcount(first) != baseline[0]:
        return False
    del first
    return _holds(buffers) == baseline


def _holds(buffers: list) -> tuple:
    """What holds a recycled set: each tensor's Python references and its TensorImpl's owners, and how many
    tensors share the set's storage. Compared with the same figures taken when the set was made (only the pool
    holding it), so the figures' meaning per torch version does not matter."""
    refs = sys.getrefcount
    o, u, log_decay, k, k_scale, committed = buffers
    return (refs(o), refs(u), refs(log_decay), refs(k), refs(k_scale), refs(committed),
            o._use_count(), u._use_count(), log_decay._use_count(), k._use_count(), k_scale._use_count(),
            committed._use_count(), torch._C._storage_Use_Count(o.untyped_storage()._cdata))


class _Sets(list):
    """One shape's sets (``[buffers, holds when made, check record]`` each), the set handed out last, the one after
    it, when the shape last handed one out (the pool's call count) and the bytes of its sets: one dictionary access
    a call."""

    __slots__ = ("last", "turn", "used", "nbytes")

    def __init__(self):
        super().__init__()
        self.last = self.turn = self.used = self.nbytes = 0


class ResultPool:
    """The default call's result buffers, recycled once nothing outside the pool holds them.

    An eager `tree_verify` without ``out`` used to allocate six fresh tensors: six ``torch.empty`` calls, 18-39 us
    of host time at B=1 on the H200 machine (BENCHMARKS.md, the host path), more than the rest of the call. The
    pool keeps each set it made (one allocation, six views) and hands a set out again only when no Python
    reference, no other owner of its tensors and no other view of its storage remains: the caching allocator's
    contract (memory is reused once nothing refers to it), checked on the host without a sync in about 2 us. A set
    is handed out only on the stream it was made on (as the caching allocator keeps a block to its stream),
    never during CUDA-graph capture (a captured call gets fresh buffers from the graph's pool), and the kernels
    write every element of a result, so a recycled set never shows a value of an earlier call.

    A result the caller keeps (to commit it, or as the next round's ``pending``) keeps its set out of the pool;
    the pool then makes another, up to ``max_sets`` per shape and ``max_bytes`` in all (``BOLE_TUNE_RESULT_POOL_MB``,
    default 256; 0 turns the pool off). A new shape that does not fit makes the pool forget the shapes least
    recently used (an engine's batch size changes from step to step), and a set larger than the whole pool is
    allocated as before. `release` empties it. Engines that manage their own memory pass ``out`` (or a
    `PendingRing`'s arena) and never touch the pool. Threads may share it: one lock covers the look and the
    hand-out (about 0.2 us of a call on a CPU), so two threads never get one set.
    """

    def __init__(self, max_bytes: int, max_sets: int = 64):
        self.max_bytes = max_bytes
        self.max_sets = max_sets
        self.bytes = 0
        self._sets: dict[tuple, _Sets] = {}  # key -> [[buffers, holds when made, check record], ...]
        self._calls = 0
        self._lock = threading.Lock()

    def take(self, shape: VerifyShape, dtype: torch.dtype, device: torch.device) -> tuple:
        """Six buffers for one call's result: a free set of the pool's, a new pooled set, or fresh tensors."""
        return self.take_set(shape, dtype, device)[:6]

    def take_set(self, shape: VerifyShape, dtype: torch.dtype, device: torch.device) -> tuple:
        """`take`'s six buffers and a seventh entry: a pooled set's check record (`stamp_result`), else None."""
        stream = 0
        if device.type == "cuda":
            if torch._C._cuda_isCurrentStreamCapturing():
                return self.fresh(shape, dtype, device)
            if device.index is None:  # "cuda": the current device, one key with its numbered name
                device = torch.device("cuda", torch.cuda.current_device())
            stream = torch._C._cuda_getCurrentRawStream(device.index)
        key = (shape.num_nodes, shape.num_requests, shape.heads, dtype, device, stream)
        # one thread at a time from the look to the hand-out: two threads on one stream would otherwise both find
        # the same set free before either holds it, and write one set of buffers at once
        lock = self._lock
        lock.acquire()
        try:
            sets = self._sets.get(key)
            if sets is not None:
                count = len(sets)
                # the set handed out last first (free again in a loop that drops each result), then every set from
                # the one after it (in an engine's steady state, keeping a round's results, the first of those is
                # free): a set still held is passed over for about 0.1 us (`_free`), so all are looked at before a
                # new one is made
                j = sets.last
                if j < count and sets[j][1] is not None and _free(sets[j][0], sets[j][1]):
                    return self._hand_out(sets, j, shape, dtype, device)
                first = sets.turn
                for i in range(first, first + count):
                    j = i % count
                    entry = sets[j]
                    if entry[1] is not None and _free(entry[0], entry[1]):
                        return self._hand_out(sets, j, shape, dtype, device)
            return self.grow(key, shape, dtype, device)
        finally:
            lock.release()

    def _hand_out(self, sets: "_Sets", j: int, shape: VerifyShape, dtype: torch.dtype, device: torch.device) -> tuple:
        """Set ``j`` of ``sets`` (found free), with its check record, as `take_set` returns it."""
        sets.last, sets.turn = j, (j + 1) % len(sets)
        self._calls += 1
        sets.used = self._calls
        entry = sets[j]
        stamp = entry[2]
        if entry[0][0]._version != stamp[7]:  # written through torch since (the six views share one version
            # counter): checked again, as any result would be
            stamp = entry[2] = _result_stamp(stamp[0], *entry[0]) if result_fits(
                TreeVerifyResult(*entry[0], None), stamp[0], dtype) else None
            if stamp is None:  # reshaped in place: never handed out again
                entry[1] = None
                return self.fresh(shape, dtype, device)
        return (*entry[0], stamp)  # a new tuple: what the caller keeps of it counts as a hold

    def grow(self, key: tuple, shape: VerifyShape, dtype: torch.dtype, device: torch.device) -> tuple:
        layout = _buffer_layout(shape, dtype)
        sizes = [-(-torch.Size(size).numel() * dt.itemsize // _ALIGN) * _ALIGN for size, dt in layout]
        sets, need = self._sets.get(key) or _Sets(), sum(sizes)
        if len(sets) >= self.max_sets or sets.nbytes + need > self.max_bytes:
            return self.fresh(shape, dtype, device)
        while self.bytes + need > self.max_bytes:  # forget the shape least recently used (not this one)
            self.forget(min((k for k in self._sets if k != key), key=lambda k: self._sets[k].used))
        whole = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        buffers, start = [], 0
        for (size, dt), nbytes in zip(layout, sizes):
            count = torch.Size(size).numel()
            buffers.append(whole[start:start + count * dt.itemsize].view(dt).view(size))
            start += nbytes
        del whole
        # the pool keeps the list and the set's check record (`stamp_result`: its buffers fit the shape by
        # construction), the caller gets a tuple of its own
        sets.append([buffers, None, _result_stamp((shape.heads, shape.num_nodes, shape.num_requests, device),
                                                  *buffers)])
        sets[-1][1] = _holds(sets[-1][0])  # the pool's own holds: the baseline a free set shows again
        self._sets[key] = sets
        sets.last, sets.turn = len(sets) - 1, 0  # the oldest set next: in an engine's steady state the first one freed
        sets.nbytes += need
        self.bytes += need
        self._calls += 1
        sets.used = self._calls
        return (*buffers, sets[-1][2])

    def forget(self, key: tuple) -> None:
        """Stop recycling one shape's sets (their memory goes back to torch's allocator once no result holds it)."""
        self.bytes -= self._sets.pop(key).nbytes

    @staticmethod
    def fresh(shape: VerifyShape, dtype: torch.dtype, device: torch.device) -> tuple:
        """Six new buffers outside the pool, and None where a pooled set has its check record."""
        return (*(torch.empty(size, dtype=dt, device=device) for size, dt in _buffer_layout(shape, dtype)), None)

    def release(self) -> None:
        """Forget every set (their memory goes back to torch's allocator once the caller's results are gone)."""
        with self._lock:
            for key in list(self._sets):
                self.forget(key)


def pool_bytes_of_environment() -> int:
    """``BOLE_TUNE_RESULT_POOL_MB`` in bytes (default 256 MiB; 0: no pool)."""
    text = os.environ.get("BOLE_TUNE_RESULT_POOL_MB", "256")
    try:
        mib = float(text)
    except ValueError:
        mib = -1.0
    if not mib >= 0 or mib == float("inf"):
        raise ValueError(f"BOLE_TUNE_RESULT_POOL_MB: expected a number of MiB >= 0 (0 turns the pool of result "
                         f"buffers off), got {text!r}")
    return int(mib * 2 ** 20)


RESULT_POOL = ResultPool(pool_bytes_of_environment())
"""The process's pool of the default call's result buffers (`ResultPool`)."""


def release_result_pool() -> None:
    """Empty the pool of recycled result buffers (`ResultPool.release`)."""
    RESULT_POOL.release()


def result_buffers(shape: VerifyShape, dtype: torch.dtype, device, tree: TreeBatch,
                   out: TreeVerifyResult | None) -> TreeVerifyResult:
    """Recycled or fresh output buffers (`RESULT_POOL`), or ``out`` (for example reused across layers) after
    checking it fits."""
    h, n = shape.heads, shape.num_nodes
    if type(device) is not torch.device:
        device = torch.device(device)
    if out is None:  # the default call: a free set of the pool's, nothing else (a call's host time counts)
        o, u, log_decay, k, k_scale, committed, stamp = RESULT_POOL.take_set(shape, dtype, device)
        res = TreeVerifyResult(o, u, log_decay, k, k_scale, committed, tree)
        if stamp is not None:
            res.__dict__[_STAMP] = stamp
        return res
    if type(out) is TreeVerifyResult:  # the same conditions as below as plain comparisons, the common case
        key = (h, n, shape.num_requests, device)
        stamp = checked_result(out, key)
        if stamp is not None and stamp[RECORD_O_DTYPE] == dtype and stamp[RECORD_K_DTYPE] == dtype:  # unchanged
            out.tree = tree
            return out
        if result_fits(out, key, dtype):
            out.tree = tree
            stamp_result(out, key)
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
