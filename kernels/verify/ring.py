"""A ring of pending rounds (docs/math.md §4, "A ring of pending rounds"): the accepted paths of up to ``R`` rounds
stay pending per slot; each round's verify reads the state through them (`blocks.pending_corrections`, the slot not
written), and every ``R``-th round's verify folds them all into the state and writes it. A round then costs one
read of the state, and one write every ``R`` rounds, instead of one read and one write every round.

What an engine keeps:

- one `PendingRing` for the model (its tables are the same for every GDN layer): per slot, the arena rows of its
  pending tokens in the order they were accepted, a flag on each round's accepted node, and their count;
- per GDN layer, one `RingResults`: that layer's `TreeVerifyResult` buffers for ``R + 1`` rounds (the pending
  rounds' factors stay where their verify wrote them; nothing is copied).

Per round::

    step = ring.begin(tree)                                   # host only: the arena position, read or write
    for layer: res = tree_verify(..., ring=step.layer(results[layer]))
    ring.end(step, state_indices, accepted)                   # device only: the accepted paths join the tables

A request that leaves takes its pending tokens with it: `PendingRing.flush` writes them into its slot (every layer;
prefix caching, another kernel reading the pool) or `PendingRing.drop` forgets them (the state is discarded). A
slot with pending tokens must be in every round until then: a write round clears the tables of the slots it wrote.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from bole_tune.shapes import HeadShape
from bole_tune.tree import TreeBatch

from ..common import (INPUT_DTYPES, on_device_of, raise_first, require_index_vector, use_triton,
                      validation_enabled)
from ..launcher import FastLauncher
from .blocks import path_hits
from .pending import SEARCH_BLOCK, pending_path_rows
from .result import TreeVerifyResult


@triton.jit
def ring_append_kernel(slots_ptr, accepted_ptr, offsets_ptr, enter_ptr, exit_ptr, depth_ptr, rows_ptr, last_ptr,
                       count_ptr, base, WRITE: tl.constexpr, B_T: tl.constexpr, WIDTH: tl.constexpr):
    """`PendingRing.end` for one request (one program each): its slot's table row rebuilt in registers and stored
    once (after a write round: emptied first), the accepted path appended at the slot's count, its last token
    flagged. Column ``c`` takes the path's node at depth ``c - count``: the node whose depth-first interval holds
    the accepted node's pre-order number, at that depth."""
    i_r = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + i_r).to(tl.int64)
    accepted = tl.load(accepted_ptr + i_r).to(tl.int64)
    bos = tl.load(offsets_ptr + i_r).to(tl.int64)
    size = tl.load(offsets_ptr + i_r + 1).to(tl.int64) - bos
    ok = (accepted >= 0) & (accepted < size)
    accepted = tl.where(ok, accepted, -1)  # no search steps below
    enter_a = tl.load(enter_ptr + bos + tl.maximum(accepted, 0))
    n = tl.where(ok, tl.load(depth_ptr + bos + tl.maximum(accepted, 0)).to(tl.int64) + 1, 0)
    o_c = tl.arange(0, WIDTH)
    table = rows_ptr + slot * WIDTH + o_c
    flags = last_ptr + slot * WIDTH + o_c
    if WRITE:
        start = 0
        old_rows = tl.full([WIDTH], -1, dtype=tl.int32)
        old_last = tl.zeros([WIDTH], dtype=tl.int32)
    else:
        start = tl.load(count_ptr + slot).to(tl.int64)
        old_rows = tl.load(table)
        old_last = tl.load(flags)
    new = tl.full([WIDTH], -1, dtype=tl.int64)
    for j_b in range(0, (accepted + B_T) // B_T):
        o_j = j_b * B_T + tl.arange(0, B_T)
        hit = path_hits(enter_ptr, exit_ptr, depth_ptr, bos, o_j, o_j <= accepted, enter_a, o_c - start)
        new = tl.maximum(new, tl.max(tl.where(hit, bos + o_j[None, :], -1), axis=1))
    tl.store(table, tl.where(new >= 0, new + base, old_rows).to(tl.int32))
    tl.store(flags, tl.where((n > 0) & (o_c == start + n - 1), 1, old_last))
    tl.store(count_ptr + slot, tl.minimum(start + n, WIDTH).to(tl.int32))


RING_APPEND = FastLauncher(ring_append_kernel)


@dataclass
class RingResults:
    """One GDN layer's verification results of the ring's last ``R + 1`` rounds: `TreeVerifyResult`'s fields
    with a leading round position (``[R + 1, capacity, ...]``, ``committed`` ``[R + 1, max_requests]``). The
    verify of round position ``p`` writes ``at(p, tree)``; the pending tokens are read from here."""

    o: torch.Tensor
    u: torch.Tensor
    log_decay: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor
    committed: torch.Tensor
    # host-side caches: the views `at` returned, and what `checks.check_ring` last found these buffers fit
    _views: dict = field(default_factory=dict, repr=False, compare=False)
    checked: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def positions(self) -> int:
        return self.u.shape[0]

    @property
    def capacity(self) -> int:
        return self.u.shape[1]

    def at(self, position: int, tree: TreeBatch) -> TreeVerifyResult:
        """Round position ``position``'s buffers for ``tree`` (contiguous views of its first rows; made once per
        position and size, as slicing six tensors costs host time every call)."""
        key = (position, tree.num_nodes, tree.num_requests, self.u.data_ptr())
        res = self._views.get(key)
        if res is None:
            n, b = key[1], key[2]
            res = TreeVerifyResult(o=self.o[position, :n], u=self.u[position, :n],
                                   log_decay=self.log_decay[position, :n], k=self.k[position, :n],
                                   k_scale=self.k_scale[position, :n], committed=self.committed[position, :b], tree=tree)
            self._views[key] = res
        res.tree = tree
        return res


class PendingRing:
    """The pending tokens of every slot of a pool (the same for every GDN layer of the model).

    Args:
        num_slots: the pool's slots (``state.shape[0]``).
        rounds: ``R``, the rounds a slot's tokens stay pending; every ``R``-th round writes the state (R = 1 is the
            folded verify: every round writes).
        max_path: the longest accepted path a round can have (the deepest tree's depth + 1).
        capacity: the most nodes a round verifies (all requests together); max_requests: the most requests
            (rounded up to multiples of 16 and 4: every round's buffers then start 16-byte aligned, which the
            kernels' kept binaries are specialised on).
        device: where the tables live.

    Each slot's table has ``width = R * max_path`` entries (rounded up to a power of two, at least 16): the
    pending tokens of ``R`` rounds; the verify's corrections cost grows with it.
    """

    def __init__(self, num_slots: int, rounds: int, max_path: int, capacity: int, max_requests: int, device):
        for name, value in (("num_slots", num_slots), ("rounds", rounds), ("max_path", max_path),
                            ("capacity", capacity), ("max_requests", max_requests)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.num_slots, self.rounds, self.max_path = num_slots, rounds, max_path
        self.capacity, self.max_requests = -(-capacity // 16) * 16, -(-max_requests // 4) * 4
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # compare equal to the tensors' cuda:N
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.width = self.table_width(rounds, max_path)
        # flat tables with one spare entry past the end, where the appends of nothing land
        self._rows = torch.full((num_slots * self.width + 1,), -1, dtype=torch.int32, device=self.device)
        self._last = torch.zeros((num_slots * self.width + 1,), dtype=torch.int32, device=self.device)
        self.rows = self._rows[:-1].view(num_slots, self.width)
        self.last = self._last[:-1].view(num_slots, self.width)
        self.count = torch.zeros((num_slots,), dtype=torch.int32, device=self.device)
        self.held = 0  # rounds whose tokens the tables hold (host: no device read)
        self.rounds_begun = 0


    @staticmethod
    def table_width(rounds: int, max_path: int) -> int:
        """Entries of a slot's table for ``rounds`` rounds of paths of up to ``max_path`` nodes: ``rounds * max_path``
        rounded up to a power of two, at least 16."""
        return max(16, 1 << (rounds * max_path - 1).bit_length())

    def round_width(self, held: int) -> int:
        """The entries of each slot's table a round reads with ``held`` rounds pending: `table_width` of those rounds,
        at most the table's. A slot's tokens are packed from its first entry (a write round empties the table) and a
        round adds at most ``max_path``, so the rest are empty: a ring's first read rounds after a write read fewer
        columns (R = 3 of 9-node paths: 16 of 32 in the first), and their corrections cost less."""
        return min(self.width, self.table_width(max(held, 1), self.max_path))

    def results(self, heads: HeadShape, dtype: torch.dtype) -> RingResults:
        """Empty `RingResults` for one GDN layer of these heads (verify outputs in ``dtype``: the inputs')."""
        if not isinstance(heads, HeadShape):
            raise TypeError(f"heads: expected a HeadShape, got {type(heads).__name__}")
        if dtype not in INPUT_DTYPES:
            raise TypeError(f"dtype: {dtype} is not an input dtype of the verify (bfloat16, float16 or float32)")
        p, n, h, f32, dev = self.rounds + 1, self.capacity, heads, torch.float32, self.device
        return RingResults(o=torch.empty(p, n, h.hv, h.dv, dtype=dtype, device=dev),
                           u=torch.zeros(p, n, h.hv, h.dv, dtype=f32, device=dev),
                           log_decay=torch.zeros(p, n, h.hv, dtype=f32, device=dev),
                           k=torch.zeros(p, n, h.hk, h.dk, dtype=dtype, device=dev),
                           k_scale=torch.zeros(p, n, h.hk, dtype=f32, device=dev),
                           committed=torch.zeros(p, self.max_requests, dtype=torch.int32, device=dev))

    def begin(self, tree: TreeBatch, write: bool | None = None) -> "RingRound":
        """This round's plan (host only): its arena position, and whether its verify writes the pending tokens into
        the state or reads through them.

        ``write=None`` writes when the tables hold ``R`` rounds (every ``R``-th round); ``write=True`` writes now,
        whatever they hold: every slot this round verifies leaves it with its state as the recurrence has it (before
        this round's own tokens), in the launches the round runs anyway, where `flush` is a pass of its own (for
        example before another kernel reads the pool, or every second round where ``R = 2`` measures better);
        ``write=False`` refuses a round that must write. Like every write round, one asked for early must verify
        every slot that holds tokens (`flush` or `drop` the others first; `end` checks it with ``validate``)."""
        if write is not None and not isinstance(write, bool):
            raise TypeError(f"write: expected None, True or False, got {type(write).__name__}")
        if write is False and self.held >= self.rounds:
            raise ValueError(f"write=False: the tables already hold rounds={self.rounds} rounds, so this round writes")
        if not isinstance(tree, TreeBatch):
            raise TypeError(f"tree: expected a TreeBatch, got {type(tree).__name__}")
        if tree.depth + 1 > self.max_path:
            raise ValueError(f"tree: depth {tree.depth} gives paths of {tree.depth + 1} nodes, but the ring was built "
                             f"for max_path={self.max_path}")
        if tree.num_nodes > self.capacity:
            raise ValueError(f"tree: {tree.num_nodes} nodes, but the ring's arena holds capacity={self.capacity}")
        if tree.num_requests > self.max_requests:
            raise ValueError(f"tree: {tree.num_requests} requests, but the ring was built for "
                             f"max_requests={self.max_requests}")
        if tree.device != self.device:
            raise ValueError(f"tree: on device {tree.device} but the ring is on {self.device}")
        return RingRound(self, tree, self.rounds_begun % (self.rounds + 1),
                         self.held >= self.rounds if write is None else write, self.round_width(self.held))

    def end(self, step: "RingRound", state_indices: torch.Tensor, accepted: torch.Tensor,
            validate: bool | None = None) -> None:
        """After every layer verified ``step``'s round: each request's accepted path (``accepted[r]``, a local node,
        or -1 for none) joins its slot's table (after a write round, in place of what was written). Device work
        only (a CUDA graph can hold it); ``validate`` (or ``BOLE_TUNE_VALIDATE=1``) also checks the values."""
        if step.ring is not self:
            raise ValueError("step: from another ring")
        tree, b = step.tree, step.tree.num_requests
        for name, x in (("state_indices", state_indices), ("accepted", accepted)):
            if not isinstance(x, torch.Tensor) or x.shape != (b,) or x.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{name}: expected an int32 or int64 tensor of shape [{b}], got "
                                 f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
            if x.device != self.device:
                raise ValueError(f"{name}: on device {x.device} but the ring is on {self.device}")
        if validation_enabled(validate):
            slots = state_indices.long()
            sizes = (tree.offsets[1:] - tree.offsets[:-1]).to(accepted.dtype)
            if bool(((slots < 0) | (slots >= self.num_slots)).any()):
                raise ValueError(f"state_indices: has a slot out of range [0, {self.num_slots})")
            if bool(((accepted < -1) | (accepted >= sizes)).any()):
                raise ValueError("accepted: has an entry out of range (expected -1 or a local node index)")
            depth = tree.node_depth[tree.offsets[:-1].long() + accepted.clamp(min=0).long()]
            start = torch.zeros_like(depth) if step.write else self.count[slots]
            if bool((start + torch.where(accepted >= 0, depth + 1, 0) > self.width).any()):
                raise ValueError(f"accepted: a slot's pending tokens would exceed the ring's width {self.width} "
                                 f"(rounds={self.rounds} x max_path={self.max_path}): end() called twice for a round?")
            if step.write:
                absent = torch.ones(self.num_slots, dtype=torch.bool, device=self.device)
                absent[slots] = False
                if bool((self.count[absent] > 0).any()):
                    raise ValueError("state_indices: a slot with pending tokens is missing from a write round (flush "
                                     "or drop a request's tokens when it leaves)")
        if use_triton(self.device):
            if b:
                with on_device_of(self.count):  # Triton launches on the current device: make it the ring's
                    self._append(step, state_indices, accepted)
        else:
            self._append_torch(step, state_indices.long(), accepted)
        self.held = 1 if step.write else self.held + 1
        self.rounds_begun += 1

    def _append(self, step: "RingRound", state_indices: torch.Tensor, accepted: torch.Tensor) -> None:
        """`ring_append_kernel`, one program per request (`FastLauncher`: its kept binary after the first call of
        each specialisation)."""
        tree = step.tree
        # the kernel reads both by index (stride 1): a strided view is copied (on the device, no host read)
        state_indices, accepted = state_indices.contiguous(), accepted.contiguous()
        RING_APPEND((tree.num_requests,), state_indices, accepted, tree.offsets, tree.dfs_enter, tree.dfs_exit,
                    tree.node_depth, self.rows, self.last, self.count, step.position * self.capacity, WRITE=step.write,
                    B_T=min(SEARCH_BLOCK, triton.next_power_of_2(max(tree.max_tree_size, 16))), WIDTH=self.width)

    def _append_torch(self, step: "RingRound", slots: torch.Tensor, accepted: torch.Tensor) -> None:
        """`end`'s table update as batched torch operations (off a GPU without the interpreter)."""
        tree, b = step.tree, step.tree.num_requests
        if step.write:
            self.rows[slots] = -1
            self.last[slots] = 0
            self.count[slots] = 0
        path = pending_path_rows(tree, accepted, torch.arange(b, dtype=torch.int32, device=self.device)).long()
        width, spare = self.width, self.num_slots * self.width
        valid = path >= 0
        n = valid.sum(1)
        start = self.count[slots].long()
        column = start[:, None] + torch.arange(path.shape[1], device=self.device)[None, :]
        keep = valid & (column < width)
        target = torch.where(keep, slots[:, None] * width + column, spare)
        self._rows.scatter_(0, target.view(-1), (path + step.position * self.capacity).to(torch.int32).view(-1))
        end = start + n - 1
        last = torch.where((n > 0) & (end < width), slots * width + end, spare)
        self._last.scatter_(0, last, torch.ones_like(last, dtype=torch.int32))
        self.count[slots] = (start + n).clamp(max=width).to(torch.int32)
        self._rows[spare], self._last[spare] = -1, 0

    def _slots(self, slots, validate) -> torch.Tensor:
        """``slots`` (`drop`, `flush`) checked: a 1-D int tensor on the ring's device (always), its entries in
        ``[0, num_slots)`` (with ``validate``, or ``BOLE_TUNE_VALIDATE=1``: one device-to-host copy)."""
        require_index_vector("slots", slots, self.device)
        if validation_enabled(validate) and slots.numel():
            raise_first([(((slots < 0) | (slots >= self.num_slots)).any(),
                          f"slots: has a slot index out of range [0, {self.num_slots})")])
        return slots.long()

    def drop(self, slots: torch.Tensor, validate: bool | None = None) -> None:
        """Forget the pending tokens of ``slots`` (their states are discarded: a finished request's). ``validate``:
        check that every slot is in range (as the verify's value checks; unchecked, indexing with one out of range
        is an error of torch's, on a GPU a device-side assertion)."""
        self._forget(self._slots(slots, validate))

    def _forget(self, slots: torch.Tensor) -> None:
        """Empty the tables of ``slots`` (checked, int64)."""
        self.rows[slots] = -1
        self.last[slots] = 0
        self.count[slots] = 0

    def flush(self, slots: torch.Tensor, states, results, validate: bool | None = None) -> None:
        """Write the pending tokens of ``slots`` into their states in every layer (``states[l]`` the layer's pool
        ``[num_slots, Hv, dv, dk]`` float32, ``results[l]`` its `RingResults`), then forget them: what a leaving
        request whose state is kept needs (prefix caching), or before another kernel reads the pool. Batched torch
        operations (no host read); ``validate`` as for `drop`."""
        slots = self._slots(slots, validate)
        if len(states) != len(results):
            raise ValueError(f"states, results: one per layer, got {len(states)} and {len(results)}")
        for layer, (state, res) in enumerate(zip(states, results)):
            if not isinstance(res, RingResults):
                raise TypeError(f"results[{layer}]: expected a RingResults (ring.results(...)), got "
                                f"{type(res).__name__}")
            hv, dv, hk, dk = res.u.shape[2], res.u.shape[3], res.k.shape[2], res.k.shape[3]
            if (not isinstance(state, torch.Tensor) or state.dtype != torch.float32
                    or tuple(state.shape) != (self.num_slots, hv, dv, dk) or state.device != self.device):
                raise ValueError(f"states[{layer}]: expected a float32 pool [num_slots={self.num_slots}, Hv={hv}, "
                                 f"dv={dv}, dk={dk}] on {self.device} (its arena's heads), got "
                                 f"{getattr(state, 'dtype', type(state).__name__)} "
                                 f"{tuple(getattr(state, 'shape', ()))} on {getattr(state, 'device', None)}")
            if hv % hk:
                raise ValueError(f"results[{layer}]: value heads Hv={hv} are not a multiple of key heads Hk={hk}")
            state[slots] = ring_states(state, slots, self, res).to(state.dtype)
        self._forget(slots)

    def tokens(self, slots: torch.Tensor, res: RingResults):
        """The pending tokens of ``slots`` in one layer's arena, for the closed form: (weighted normalised keys
        ``[S, W, Hv, dk]`` fp32, updates ``[S, W, Hv, dv]``, weights ``[S, W, Hv]``, total decay ``[S, Hv]``)."""
        rows, last = self.rows[slots.long()].long(), self.last[slots.long()]
        m = rows >= 0
        rows = torch.where(m, rows, 0)
        hv, hk = res.u.shape[2], res.k.shape[2]
        u = res.u.reshape(-1, hv, res.u.shape[3])[rows]
        logp = res.log_decay.reshape(-1, hv)[rows]
        k = res.k.reshape(-1, hk, res.k.shape[3])[rows].float() * res.k_scale.reshape(-1, hk)[rows][..., None]
        k = k.repeat_interleave(hv // hk, dim=2)
        ends = torch.where(m[..., None] & (last[..., None] != 0), logp, 0.0)
        suffix = ends.flip(1).cumsum(1).flip(1)
        weight = torch.where(m[..., None], torch.exp(suffix - logp), 0.0)
        return k, u, weight, torch.exp(ends.sum(1))


def ring_states(state, slots, ring: PendingRing, res: RingResults) -> torch.Tensor:
    """The states ``S' = P S + sum_j w_j u_j k_j^T`` the pending tokens of ``slots`` would leave in one layer
    (``state`` its pool, ``res`` its arena), ``[S, Hv, dv, dk]`` fp32; nothing is written."""
    k, u, weight, decay = ring.tokens(slots, res)
    return decay[..., None, None] * state[slots.long()].float() + torch.einsum("swh,swhv,swhk->shvk", weight, u, k)


@dataclass(frozen=True)
class RingRound:
    """One round of a `PendingRing` (`PendingRing.begin`): its trees, the arena position its verifies write,
    whether they write the pending tokens into the state (``write``) or read through them, and how many of each slot's
    table entries they read (``width``, `PendingRing.round_width`; 0: all of them)."""

    ring: PendingRing
    tree: TreeBatch
    position: int
    write: bool
    width: int = 0

    def __post_init__(self):
        if not self.width:
            object.__setattr__(self, "width", self.ring.width)

    def layer(self, results: RingResults) -> "RingRead":
        """What one layer's `tree_verify(..., ring=...)` takes: this round with that layer's arena."""
        return RingRead(self, results)


@dataclass(frozen=True)
class RingRead:
    """`tree_verify`'s ``ring``: a `RingRound` and one layer's `RingResults`."""

    step: RingRound
    results: RingResults
