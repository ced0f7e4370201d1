"""Launch one planned verification (`planner.Launch`) on the fused or the resident kernel (the Gluon verify,
`gluon.py`, for a launch marked ``gluon`` whose tensors it takes)."""

from __future__ import annotations

from functools import reduce
from operator import or_

import torch

from bole_tune.tree import TreeBatch

from ..common import dot_precision, gram_dtype
from ..launcher import FastLauncher, misaligned
from .fused import tree_verify_fused_kernel
from .gluon import gluon_launch, gluon_takes
from .planner import Launch
from .resident import tree_verify_resident_kernel

from .result import (PATHS_BITS, PATHS_MAP_DTYPE, PATHS_POINTERS, RECORD_BITS, RECORD_K_DTYPE, RECORD_POINTERS,
                     PendingCommit, TreeVerifyResult, VerifyShape, commit_epoch)
from .ring import RingRead

RESIDENT = FastLauncher(tree_verify_resident_kernel)
FUSED = FastLauncher(tree_verify_fused_kernel)
_data_ptr = torch.Tensor.data_ptr


FOLD_DOT_PRECISION = "tf32x3"
"""Precision of the fold's product (`blocks.fold_apply`): three tf32 tensor-core passes, about fp32's accuracy
(H200, 9B heads: the committed state within 1.1e-7 of the closed form, fp32 FMAs 6.8e-8) and faster than fp32
FMAs ("ieee"): a B=16 round of 4-node chains 41.0 against 53.6 us, of 64-node trees 96.8 against 111.1 us
(BENCHMARKS.md, "A layer's round")."""


CORRECT_DOT_PRECISION: str | None = None
"""Precision of a ring read round's correction products (``[B_T, B_P] x [B_P, b_v]``, `blocks.pending_corrections`).
None: the verify's own state products' (`common.dot_precision`: tf32 for 16-bit inputs), what the corrections stand
in for (``S' x`` read through the pending tokens instead of ``S x``); "tf32x3": three tf32 passes, as the write
round's fold (`FOLD_DOT_PRECISION`). Compiled for sm_90, the 9B B=32 read launch (32/128/4/3) holds 166 registers a
thread with None against 226 with "tf32x3" (3 programs per SM instead of 2). Measured side by side on the H200
(`lab/ring_correct_dot.py`, 9B bf16, R = 4, 24 layers): the read round B=32 8-node chains 43.7 against 48.7 us,
B=16 8-node trees 20.4 against 25.8, B=16 4-node chains 18.4 against 20.4, B=1 7.7 against 7.8; the outputs and
flushed slots the same distance from float64 (1.8e-3 / 7e-4 either way: the verify's own tf32 products set it)."""

CORRECT_BEFORE_STREAM = False
"""Where a ring read round's stream launch (the resident kernel's state-first order) takes its corrections: True,
before the state's stream, as the products' starting values, the stream then reading ``P S`` (each state tile
scaled by the pending tokens' decay as it arrives: 150 registers a thread at the launch above); False, after it.
Exact either way (the CPU tests run both). After is faster on the H200 in every case measured (B=32 8-node chains
43.7 against 47.7 us, B=16 8-node trees 20.4 against 21.8; `lab/ring_correct_dot.py`): fewer registers did not
make up for the scaling on the stream's critical path."""

STATE_HINTS = {"verify": "evict_first", "fold": "evict_first", "read": "evict_first"}
"""The resident kernel's state loads' eviction policy ("" none, "evict_first", "evict_last"), for the verify, a launch
that folds and writes the tiles back (the folded verify, a ring's write round) and a ring's read round. Each tile is
read once; marked "evict_first" it leaves L2 to the factors and the tokens' rows the launch reads again. Measured on
the H200 (`lab/state_hints.py`, 9B bf16, one CUDA graph over rotating sets, every launch checked against float64; all
three set at once, three turns in alternating order): at B=1 the verify 5.20-5.22 us against 5.76-5.79 without hints
(4-node chains; 8-node trees 5.24-5.28 against 5.84-5.85), the ring's read round 6.25-6.93 against 7.63-7.68, the
folded verify unchanged (9.08-9.20 either way); at B=16-32 within 1% either way (B=32 8-node chains: ring round
53.45-53.81 against 53.82-54.3, folded 73.65-73.88 against 73.46-73.54). "evict_last" was no faster than none."""

FUSED_STATE_HINTS = {"one_block": "", "blocks": ""}
"""The fused kernel's state loads' eviction policy, for launches whose trees fit one node block (each state tile read
once, as in the resident kernel, where "evict_first" made the verify 10% faster at B=1: `STATE_HINTS`) and for
launches of several blocks (each block reads the tiles again: L2 may be holding them for the next). The fused kernel
serves B=1 trees of more than 32 nodes and B=3-8 trees. Timed on the H200 (`python3 lab/state_hints.py --fused`, 9B
bf16, B=2 64-node trees, B=4-8 trees of 8-16 nodes, B=4 chains, two turns): "evict_first" and "evict_last" within
0.1-0.2 us of none in every case (B=8 8-node trees: verify 11.30-11.38 us whatever the hint), so none is set."""

ROWS_FIRST = {"verify": False, "fold": True}
"""Whether a "stream" launch (without the state split) takes its state products as ``S Q^T`` (`resident.py`,
``ROWS_FIRST``), for the verify and for the folded verify. H200, 9B, bf16 (`lab/rows_first.py`,
BENCHMARKS.md "Seventh session"; both orders at the same eight tiles): the folded round of B=16 4-node chains 36.1
against 39.5 us at the best tiles of each, B=32 8-node chains 74.0 against 79.5; the verify alone gains nothing
(16.4 against 15.9 us), so it keeps the other order."""

_NO_FOLD = (None,) * 7 + (0,)

RING_NARROW_FUSED_BLOCK = 32
"""A ring round reads only the table entries its held rounds can fill (`RingRound.width`: 16 of a 32-wide table in the
first read round of a ring of three rounds of 9-node paths, 32 of 64 in a ring of four's third) on the resident kernel
(the Gluon verify's too) and on the fused kernel with node blocks of at most this many rows; with larger blocks the
fused kernel reads at least `RING_FUSED_MIN_COLUMNS`. Measured on the H200 (`bole-tune bench --model qwen3.5-9b`, 9B
bf16, trees of depth <= 8, rings of 3-4 rounds; BENCHMARKS.md "Twenty-ninth session"): a 16-entry read round against
a 32-entry one (worked out from the cycle's mean read and its fullest), B=16 64-node trees (the Gluon verify) 55.2
against 56.8 us, B=16 16-node trees (resident) 17.5 against 21.7, the fused kernel with 16- and 32-row blocks (B=4
16- and 32-node trees) 11.5 against 14.9 and 19.9 against 21.2; with 64-row blocks the same or slower (B=1 64-node
trees 20.6 either way, B=4 64-node trees 39.6 against 36.9, B=16 128-node trees 299.5 against 279.9), and 64 entries
far slower than 32 (B=16 128-node trees 364.0 against 279.9, B=4 64-node trees 46.7 against 36.9)."""
RING_FUSED_MIN_COLUMNS = 32
"""The fewest table entries the fused kernel with blocks of more than `RING_NARROW_FUSED_BLOCK` rows reads."""


def ring_columns(launch: Launch, step_width: int, table_width: int) -> int:
    """The table entries a ring round of ``launch`` reads (its kernel's ``B_P``): the round's own width, at least
    `RING_FUSED_MIN_COLUMNS` on the fused kernel's large blocks (`RING_NARROW_FUSED_BLOCK`), at most the table's."""
    if launch.variant != "fused" or launch.node_block <= RING_NARROW_FUSED_BLOCK:
        return step_width
    return min(table_width, max(step_width, RING_FUSED_MIN_COLUMNS))


def run_launch(launch: Launch, q, k, v, g, beta, state, state_indices, tree: TreeBatch, shape: VerifyShape,
               res: TreeVerifyResult, use_qk_l2norm: bool, pending: PendingCommit | None = None,
               ring: RingRead | None = None, records: tuple | None = None) -> TreeVerifyResult:
    """Run ``launch`` on checked inputs, writing into ``res``. The two kernels take the same arguments
    but for the fused one's block-table width and the resident one's value split and switches; with
    ``pending``, both first commit the previous round's accepted paths into the slots they read; with ``ring``, they
    read the slots through a `PendingRing`'s pending tokens (a write round: fold them in and write the slots).
    ``records``: the check records this call's checks made or confirmed (`result.stamp_result` of ``res``, and of
    ``pending``'s paths and result, each None where there is none): their addresses stand for the tensors'.

    The launch is keyed (`FastLauncher.launch_keyed`) on what decides its binary beyond the checked shapes and
    dtypes: the launch, the input, gate and index dtypes, the strides, and which tensors are not 16-byte aligned
    (`launcher.misaligned`: Triton specialises on it)."""
    h, config = shape.heads, launch.config
    sq, sk, sv = q.stride(), k.stride(), v.stride()
    if sq[2] != 1:
        q, sq = _last_contiguous(q)
    if sk[2] != 1:
        k, sk = _last_contiguous(k)
    if sv[2] != 1:
        v, sv = _last_contiguous(v)
    if launch.gluon and gluon_takes(launch, q, k, v, state, shape, ring, pending):
        gluon_launch(q, k, v, g, beta, state, state_indices, tree, shape, res, config, ring)
        return res
    block_depth, max_blocks, tree_addresses, tree_bits = tree_launch_table(tree, launch.node_block)
    resident = launch.variant != "fused"
    if resident:
        kernel, grid, blocks = RESIDENT, (h.hv * launch.v_split, shape.num_requests), ()
    else:
        kernel, grid, blocks = FUSED, (h.dv // config.b_v, h.hv, shape.num_requests), (max_blocks,)
    offsets, enter, leave = tree.offsets, tree.dfs_enter, tree.dfs_exit
    o, u, log_decay, k_out, k_scale, committed = res.o, res.u, res.log_decay, res.k, res.k_scale, res.committed
    tensors = (q, k, v, g, beta, state, state_indices, offsets, enter, leave, block_depth,
               o, u, log_decay, k_out, k_scale, committed)
    res_record, paths_record, prev_record = records or (None, None, None)
    # each tensor's device address: the inputs' taken now, the tree's kept with the tree, a checked result's from
    # its record (`result.stamp_result`)
    pointers = (_data_ptr(q), _data_ptr(k), _data_ptr(v), _data_ptr(g), _data_ptr(beta), _data_ptr(state),
                _data_ptr(state_indices))
    bits = (pointers[0] | pointers[1] | pointers[2] | pointers[3] | pointers[4] | pointers[5] | pointers[6]
            | tree_bits)
    pointers += tree_addresses
    if res_record is not None:
        pointers += res_record[RECORD_POINTERS]
        bits |= res_record[RECORD_BITS]
    else:
        more = tuple(map(_data_ptr, tensors[11:]))
        pointers += more
        bits |= reduce(or_, more)
    correct = False
    if ring is not None:  # the ring's tables and this layer's arena take the fold's arguments (`blocks.ring_tokens`)
        table, arena, correct = ring.step.ring, ring.results, not ring.step.write
        # the table's rows whole (their length), the round's first `RingRound.width` entries read
        fold = (table.rows, table.last, arena.u, arena.log_decay, arena.k, arena.k_scale, table.count, table.width)
        width = ring_columns(launch, ring.step.width, table.width)
        fold_dot = (CORRECT_DOT_PRECISION or dot_precision(q.dtype)) if correct else FOLD_DOT_PRECISION
        fold_key = ("ring", correct, arena.k.dtype, width, fold_dot, CORRECT_BEFORE_STREAM)
        tensors += fold[:7]
        more = tuple(map(_data_ptr, fold[:7]))
        pointers += more
        bits |= reduce(or_, more)
    elif pending is None:  # the fold's pointers are never read: None keeps the launch short
        fold, fold_key, width, fold_dot = _NO_FOLD, None, 16, FOLD_DOT_PRECISION
    else:
        paths, prev = pending.paths, pending.result
        fold = (paths.request_map, paths.path_rows, prev.u, prev.log_decay, prev.k, prev.k_scale, prev.committed,
                commit_epoch())
        tensors += fold[:7]
        if paths_record is not None and prev_record is not None:
            width = paths.path_rows.shape[1]
            fold_key = (paths_record[PATHS_MAP_DTYPE], prev_record[RECORD_K_DTYPE])
            pointers += (*paths_record[PATHS_POINTERS], *prev_record[RECORD_POINTERS][1:])  # all but the outputs'
            bits |= paths_record[PATHS_BITS] | prev_record[RECORD_BITS]
        else:
            width, fold_key = paths.path_rows.shape[1], (paths.request_map.dtype, prev.k.dtype)
            more = tuple(map(_data_ptr, fold[:7]))
            pointers += more
            bits |= reduce(or_, more)
        fold_dot = FOLD_DOT_PRECISION
        fold_key += (width, fold_dot)
    gs, bs, ss = g.stride(), beta.stride(), state.stride()
    sizes = (h.hv, h.hk, sq[0], sq[1], sk[0], sk[1], sv[0], sv[1], gs[0], gs[1], bs[0], bs[1], ss[0], ss[1], ss[2])
    scalars = (shape.scale, *blocks, *sizes)
    if pending is None and ring is None:
        fast_args = (*pointers, *_NO_FOLD, *scalars)
    else:
        fast_args = (*pointers, fold[7], *scalars)
    rows_first = (launch.variant == "stream" and not launch.state_split and not correct
                  and ROWS_FIRST["verify" if pending is None and ring is None else "fold"])
    if resident:
        state_hint = STATE_HINTS["verify" if pending is None and ring is None else "read" if correct else "fold"]
    else:
        state_hint = FUSED_STATE_HINTS["one_block" if max_blocks == 1 else "blocks"]
    key = (launch_number(launch), h.dk, h.dv, q.dtype, q.is_cuda, g.dtype, beta.dtype, state_indices.dtype,
           use_qk_l2norm, fold_key, rows_first, state_hint, misaligned(pointers, bits), *sizes)

    def args() -> tuple:
        return (*tensors[:17], *fold, *scalars)

    def meta() -> dict:
        if resident:
            extra = {"V_SPLIT": launch.v_split, "STATE_SPLIT": launch.state_split, "SWEEP_F16": launch.sweep_f16,
                     "STATE_FIRST": launch.variant == "stream", "ROWS_FIRST": rows_first,
                     "CORRECT_FIRST": correct and CORRECT_BEFORE_STREAM, "STATE_HINT": state_hint,
                     "STACK": launch.stack_qk}
        else:
            extra = {"STATE_HINT": state_hint}
        if pending is None and ring is None:
            extra.update(FOLD=False)
        else:
            extra.update(FOLD=True, FOLD_DOT=fold_dot, B_P=width, RING=ring is not None, CORRECT=correct)
        return dict(D_K=h.dk, D_V=h.dv, B_T=launch.node_block, B_K=config.b_k, B_V=config.b_v, **extra,
                    USE_QK_L2NORM=bool(use_qk_l2norm), DOT_PRECISION=dot_precision(q.dtype), GRAM_DTYPE=gram_dtype(q),
                    num_warps=config.num_warps, num_stages=config.num_stages)

    kernel.launch_keyed(key, grid, fast_args, args, meta)
    return res


_NUMBER_OF: dict[Launch, int] = {}  # each launch value seen, numbered in order (never renumbered)
_NUMBER_BY_ID: dict[int, tuple] = {}  # id(launch) -> (launch, its number): the launch kept, so its id stays its own


def launch_number(launch: Launch) -> int:
    """A number for ``launch``'s value, the same for equal launches: in the launch's key it stands for the launch
    without hashing its fields on every call (the planner hands out one object per plan)."""
    kept = _NUMBER_BY_ID.get(id(launch))
    if kept is not None:
        return kept[1]
    if len(_NUMBER_BY_ID) >= 4096:  # launches made afresh on every call (launch= built by the caller)
        _NUMBER_BY_ID.clear()
    number = _NUMBER_OF.setdefault(launch, len(_NUMBER_OF))
    _NUMBER_BY_ID[id(launch)] = (launch, number)
    return number


def tree_launch_table(tree: TreeBatch, node_block: int) -> tuple:
    """``(block_depth, max_blocks, addresses, bits)``: the tree's `TreeBatch.block_depths` for ``node_block``, the
    device addresses of its offsets, depth-first intervals and that table, and their OR (the alignment key), kept
    with the tree (its tensors are its own, made when it was built, and never replaced)."""
    key = ("launch", node_block)
    kept = tree._cache.get(key)
    if kept is None:
        block_depth, max_blocks = tree.block_depths(node_block)
        addresses = (tree.offsets.data_ptr(), tree.dfs_enter.data_ptr(), tree.dfs_exit.data_ptr(),
                     block_depth.data_ptr())
        kept = tree._cache[key] = (block_depth, max_blocks, addresses, reduce(or_, addresses))
    return kept


def _last_contiguous(x):
    x = x.contiguous()
    return x, x.stride()
