"""Commit of the accepted path: one launch writes every request's new state into its slot, for one layer
(`tree_commit`) or for every GDN layer of a step at once (`tree_commit_layers`).

``S_new = P_a S_pre + sum_{j <= a} exp(logP_a - logP_j) u_j k_j^T`` (docs/math.md §4): each
program owns ``v_span`` rows and ``b_k`` columns of one head's slot and streams them in
``[b_v, b_k]`` tiles, each read once and written once, its first tile requested before anything but the
slot (it streams in while the path's dependent loads resolve). The path to the accepted node ``a`` holds
the nodes whose depth-first interval contains ``a``, one per depth; the program gathers them 16 at a time
by depth (no walk up the parents), once for its whole span, so the sum is a product over the path alone,
not over the whole tree, run on tensor cores in pieces that keep fp32's accuracy (`COMMIT_PRODUCT`,
`blocks.path_product`) and accumulated into the state tile itself.

**The launch** is a `bole_tune.config.CommitConfig` (``b_k``, ``b_v``, ``v_span``, ``num_warps``,
``num_stages``): the tuner's knobs, tuned per GPU, head shape, dtype, tree and batch bucket and the number
of layers one launch commits (the tuning database's ``commit_configs``). ``config=None`` takes the tuned
one from a *config source* (`DEFAULT_COMMIT_CONFIG_SOURCE`, a module path resolved on the first GPU launch
that needs it, as the verify planner does: the kernels never import the database layer themselves; engines
and tests pass their own with `set_commit_config_source`); off a GPU, and where the source has nothing,
the untuned fallback `bole_tune.config.default_commit_config` (the widest tiles that still give a launch
enough programs).

**State loads** (`CommitConfig.tma`, tuned like the tiles): by per-thread pointer loads (the first tile requested
early, one tile in flight in registers), or by TMA where `tma_state_loads` allows it (an sm_90+ GPU, a contiguous
16-byte aligned pool): a host tensor descriptor over the pool as ``[rows, dk]`` (built per launch, encoded by
Triton's launcher), each tile a bulk copy into shared memory, ``num_stages`` of them in flight (`commit_span_tma`),
the updated tile stored by pointers. On the H200 (9B heads, 8-node trees, 24 layers a launch, tiles 128/16/128/2/3)
TMA loads cut the all-layer commit from 20.2 to 19.4 us a layer at B=16 and from 40.3 to 38.2 at B=32 (1.22x and
1.21x the copy floor, was 1.27x); at one request and one tile a program they lose (6.3 against 5.9 us). Elsewhere
(an older GPU, a strided pool, the CPU) a ``tma=1`` launch reads by pointers, with the same result.

At one request a layer's commit is a 2 MiB state, too little to fill a GPU in one launch per layer;
`tree_commit_layers` commits the stacked pools and factors of all of a step's layers in one launch (a
fourth grid dimension: layer), with ``L`` times the programs, so it has its own tuned entries.
"""

from __future__ import annotations

import triton
import triton.language as tl

import importlib
import operator
from dataclasses import dataclass
from functools import reduce
from operator import or_
from typing import Callable

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from bole_tune.config import CommitConfig, default_commit_config, node_block
from bole_tune.shapes import HeadShape
from bole_tune.tree import TreeBatch

from ..common import (INDEX_DTYPES, INPUT_DTYPES, other_cuda_device, path_precision, require_tensor, use_triton,
                      validation_enabled)
from ..launcher import FastLauncher, misaligned
from ..reference import commit_closed_form
from .blocks import path_factors, path_product
from .checks import check_commit_inputs
from .pending import pending_path_rows
from .result import TreeVerifyResult, commit_epoch

DEFAULT_COMMIT_CONFIG_SOURCE = "bole_tune.lookup:tuned_commit"
COMMIT_PRODUCT = "split2"
"""The path update's product for 16-bit keys (`blocks.path_product`): the weighted values cut into a tf32 head and
its remainder, two tensor-core passes accumulated in fp32 into the state tile (about 2^-21 relative per product:
the committed state within 2.3e-7 of the closed form on the H200, fp32 FMAs 6.3e-8). Against fp32 FMAs it holds
far fewer registers, so more programs stream per SM: the all-layer commit 10-12% faster at B >= 16, 22% at B=1
("split3", exact pieces, measured the same within 1%; BENCHMARKS.md, "Eleventh session"). fp32 keys are not tf32
values: their commits use fp32 FMAs."""
SCAN_WIDTH = 32
"""Candidates one step of the commit's path scan looks at (`blocks.path_factors`: ``accepted // B_T + 1`` steps of a
``[16, B_T]`` compare, the same path at every width): the tree's node block (16-64, `config.node_block`), at most
this many. Measured on the H200 (`python3 lab/commit_scan.py --time --config database`, 9B bf16, 24 layers, the
database's launches with their first tile by pointers, three alternating turns; BENCHMARKS.md, "Thirty-fourth
session"), 32 against the node block's 64 at 64-node trees: B=1 1.49 against 1.51 us a layer, B=4 5.37 against
5.45, B=16 19.59 against 19.79, and at 256-node trees B=16 20.16 against 20.36; a 16-wide scan was between the two
(64-wide scans cost about 700 SASS instructions more than 16-wide ones); at 8-node trees a 32-wide scan was 0.5%
slower than the node block's 16 (19.11 against 19.02)."""
SCAN_BLOCK: int | None = None
"""The scan's width for every tree instead of `SCAN_WIDTH`'s rule (a power of two >= 16, wider or narrower than the
tree; None: the rule): for measuring (`python3 lab/commit_scan.py`) and the tests."""
TMA_FIRST_BY_POINTER = True
"""A ``tma=1`` launch's first state tile read by pointers at the program's start, as a pointer launch reads it (in
flight while the path's dependent loads resolve), the rest by TMA; off, a TMA load issued there would wait for its
tile on the spot, so the launch would start its stream only once the path is known. Exact either way (the CPU tests
run both). Measured on the H200 (`python3 lab/commit_scan.py --time`, 9B bf16, 24 layers, the tuned 128/16/128/2/3
TMA launch, three alternating turns; BENCHMARKS.md, "Thirty-fourth session"): B=16 19.15 against 19.52 us a layer at
8-node trees and 19.83 against 20.43 at 64-node ones (1.198x and 1.240x the copy floor, from 1.221x and 1.278x);
B=32 37.59 against 38.40 and 39.30 against 40.46: on."""
PATH_TABLE_MIN_BLOCK: int | None = 64
"""A launch of two or more layers whose node block has at least this many rows reads each request's path from a table
worked out once per launch for all layers (`pending.pending_path_rows`: one small launch before it) instead of
scanning the tree in every program: the path's factors then wait for one load, not for the accepted node and the
scan. None: never. Measured on the H200 (`python3 lab/commit_scan.py --time --config database`, 9B bf16, 24 layers,
the table's launch timed with it, first tiles by pointers; BENCHMARKS.md, "Thirty-fourth session") against the scan:
B=16 19.60 against 19.95 us a layer at 64-node trees, 19.77 against 20.37 at 128, 19.88 against 20.53 at 256; B=32
38.11 against 38.89 at 64 and 38.25 against 39.69 at 256. At 8-node trees (node block 16) the table lost 1.4% at B=16
(19.71 against 19.43, first tiles by TMA) and 5% at B=1 in the twelfth session (its launch): from node block 64."""
COMMIT_STATE_HINTS = ("evict_last", "")
"""The state tiles' cache hints: (the loads' eviction policy, the stores' cache modifier; "" for none). Each tile is
read once and written back to the same lines; kept in L2 on the load ("evict_last"), its write lands there. Measured
on the H200 (`lab/commit_hints.py`, 9B bf16 8-node trees, 24 layers a launch, two turns): 20.48-20.51 us per layer
at B=16 against 20.73-20.75 without hints (40.44-40.48 against 40.82-40.83 at B=32); "evict_first" loads or
streaming stores (".cs", ".cg") were 0-1.5% slower."""


# the per-layer strides of the factors read by gathered rows, the request count and the marks' layer stride
# are not specialised: one binary per config serves every batch size and layer count (the tuner compiles
# each config once per node block, not once per batch)
@triton.jit(do_not_specialize=["epoch", "num_requests", "stride_logp_layer", "stride_k_scale_layer",
                               "stride_committed_layer"])
def tree_commit_kernel(
    # state pool (and, for TMA loads, a descriptor over it as [rows, dk]) and request metadata
    state_desc, state_ptr, state_indices_ptr, accepted_ptr, offsets_ptr, dfs_enter_ptr, dfs_exit_ptr, node_depth_ptr,
    path_rows_ptr,  # the launch's path table ``[B, W_P]`` (`PATH_TABLE_MIN_BLOCK`), read where PATH_TABLE
    # factors from the verification
    u_ptr, logp_ptr, k_ptr, k_scale_ptr, committed_ptr, epoch,
    # strides (per layer: 0 for a single layer)
    stride_s_layer, stride_s_slot, stride_s_h, stride_s_v,
    stride_u_layer, stride_logp_layer, stride_k_layer, stride_k_scale_layer, stride_committed_layer, num_requests,
    # sizes and meta-parameters
    H_V: tl.constexpr, H_K: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr,
    B_T: tl.constexpr, B_K: tl.constexpr, B_V: tl.constexpr, V_SPAN: tl.constexpr, B_P: tl.constexpr,
    PRODUCT: tl.constexpr = "ieee", LOAD_HINT: tl.constexpr = "", STORE_HINT: tl.constexpr = "",
    TMA: tl.constexpr = False, STAGES: tl.constexpr = 3, TMA_FIRST_BY_POINTER: tl.constexpr = False,
    PATH_TABLE: tl.constexpr = False, W_P: tl.constexpr = 16,
):
    i_tile = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_l = tl.program_id(2).to(tl.int64) // num_requests
    i_r = tl.program_id(2).to(tl.int64) % num_requests
    state_ptr += i_l * stride_s_layer
    u_ptr += i_l * stride_u_layer
    logp_ptr += i_l * stride_logp_layer
    k_ptr += i_l * stride_k_layer
    k_scale_ptr += i_l * stride_k_scale_layer
    committed_ptr += i_l * stride_committed_layer
    i_hk = i_h // (H_V // H_K)
    i_span = i_tile // (D_K // B_K)
    i_k = i_tile % (D_K // B_K)
    accepted = tl.load(accepted_ptr + i_r).to(tl.int64)
    bos = tl.load(offsets_ptr + i_r).to(tl.int64)
    num_nodes = tl.load(offsets_ptr + i_r + 1).to(tl.int64) - bos
    # -1 keeps the slot; so does a node out of range, which value checks (off by default) would refuse, and a
    # path an earlier launch committed (marked neither 0 nor this launch's epoch): committing twice is a no-op
    mark = tl.load(committed_ptr + i_r)
    commit = (accepted >= 0) & (accepted < num_nodes) & ((mark == 0) | (mark == epoch))
    # the program's first state tile is requested before the path's dependent loads, so that it streams in while
    # they resolve (not where the slot is kept: its index need not name a slot then)
    slot = tl.load(state_indices_ptr + i_r).to(tl.int64)
    o_k = i_k * B_K + tl.arange(0, B_K)
    p_slab = state_ptr + slot * stride_s_slot + i_h * stride_s_h + i_span * V_SPAN * stride_s_v + o_k[None, :]
    if TMA and not TMA_FIRST_BY_POINTER:
        b_first = 0.0
    else:
        b_first = tl.load(p_slab + tl.arange(0, B_V)[:, None] * stride_s_v, mask=commit, other=0,
                          eviction_policy=LOAD_HINT)
    if commit:
        tl.store(committed_ptr + i_r, epoch)
        # the path holds one node per depth 0..depth(a): B_P of them at a time (one pass for the drafters'
        # trees of depth < B_P), each pass streaming this program's V_SPAN rows of the state; the first pass
        # decays S_pre, later ones (paths deeper than B_P) add to what it wrote
        if PATH_TABLE:
            rows, m_p, weight, logp_a = path_from_table(path_rows_ptr, i_r, 0, bos + accepted, i_h, i_hk, logp_ptr,
                                                        k_scale_ptr, H_V, H_K, W_P, B_P)
        else:
            rows, m_p, weight, logp_a = path_factors(accepted, bos, 0, i_h, i_hk, dfs_enter_ptr, dfs_exit_ptr,
                                                     node_depth_ptr, logp_ptr, k_scale_ptr, H_V, H_K, B_T, B_P)
        if TMA:
            # the pool as [rows, D_K] (host-checked: contiguous rows of D_K, fewer than 2^31 of them); the first
            # pass's tiles come in by TMA, STAGES in flight, and go out by pointer stores, so a later pass reads
            # them back by pointers after the barrier, as the pointer launch does
            row0 = ((i_l * stride_s_layer + slot * stride_s_slot + i_h * stride_s_h) // D_K
                    + i_span * V_SPAN).to(tl.int32)
            commit_span_tma(state_desc, p_slab, row0, (i_k * B_K).to(tl.int32), b_first, TMA_FIRST_BY_POINTER, rows,
                            m_p, weight, tl.exp(logp_a), o_k, i_h, i_hk, i_span, u_ptr, k_ptr, stride_s_v, H_V, H_K,
                            D_K, D_V, B_V, V_SPAN, PRODUCT, STORE_HINT, STAGES)
        else:
            commit_span(p_slab, b_first, True, rows, m_p, weight, tl.exp(logp_a), o_k, i_h, i_hk, i_span, u_ptr,
                        k_ptr, stride_s_v, H_V, H_K, D_K, D_V, B_V, V_SPAN, PRODUCT, LOAD_HINT, STORE_HINT)
        for i_p in range(1, tl.load(node_depth_ptr + bos + accepted) // B_P + 1):
            tl.debug_barrier()
            if PATH_TABLE:
                rows, m_p, weight, logp_a = path_from_table(path_rows_ptr, i_r, i_p, bos + accepted, i_h, i_hk,
                                                            logp_ptr, k_scale_ptr, H_V, H_K, W_P, B_P)
            else:
                rows, m_p, weight, logp_a = path_factors(accepted, bos, i_p, i_h, i_hk, dfs_enter_ptr, dfs_exit_ptr,
                                                         node_depth_ptr, logp_ptr, k_scale_ptr, H_V, H_K, B_T, B_P)
            commit_span(p_slab, b_first, False, rows, m_p, weight, 1.0, o_k, i_h, i_hk, i_span, u_ptr, k_ptr,
                        stride_s_v, H_V, H_K, D_K, D_V, B_V, V_SPAN, PRODUCT, LOAD_HINT, STORE_HINT)


@triton.jit
def path_from_table(path_rows_ptr, i_r, i_p, row_a, i_h, i_hk, logp_ptr, k_scale_ptr, H_V, H_K, W_P: tl.constexpr,
                    B_P: tl.constexpr):
    """`blocks.path_factors`' result read from the launch's path table instead of found in the tree: request
    ``i_r``'s packed rows at depths ``i_p * B_P ..`` (``[B, W_P]``, -1 past the accepted node, packed row
    ``row_a``), their mask, weights ``exp(logP_a - logP_j) * k_scale_j`` (0 off the path) and ``logP_a``. The rows
    depend on the request alone, so their factors' loads need not wait for the accepted node."""
    o_p = i_p * B_P + tl.arange(0, B_P)
    rows = tl.load(path_rows_ptr + i_r * W_P + o_p, mask=o_p < W_P, other=-1).to(tl.int64)
    m_p = rows >= 0
    rows = tl.where(m_p, rows, 0)
    logp_a = tl.load(logp_ptr + row_a * H_V + i_h)
    logp_p = tl.load(logp_ptr + rows * H_V + i_h, mask=m_p, other=0)
    scale_p = tl.load(k_scale_ptr + rows * H_K + i_hk, mask=m_p, other=0)
    return rows, m_p, tl.where(m_p, tl.exp(logp_a - logp_p) * scale_p, 0.0), logp_a


@triton.jit
def commit_span(p_slab, b_first, HAVE_FIRST: tl.constexpr, rows, m_p, weight, decay, o_k, i_h, i_hk, i_span, u_ptr,
                k_ptr, stride_s_v, H_V, H_K, D_K: tl.constexpr, D_V: tl.constexpr, B_V: tl.constexpr,
                V_SPAN: tl.constexpr, PRODUCT: tl.constexpr, LOAD_HINT: tl.constexpr, STORE_HINT: tl.constexpr):
    """One pass of a path's nodes (``rows``, ``weight``) over the program's ``V_SPAN`` state rows, in ``[B_V, b_k]``
    tiles: each read (the first one already requested where ``HAVE_FIRST``), decayed, updated and written back."""
    b_k = tl.load(k_ptr + rows[:, None] * (H_K * D_K) + i_hk * D_K + o_k[None, :], mask=m_p[:, None],
                  other=0).to(tl.float32)
    first = 0
    if HAVE_FIRST:
        commit_first_tile(p_slab, b_first, rows, m_p, weight, decay, b_k, i_h, i_span, u_ptr, stride_s_v, H_V, D_V,
                          B_V, V_SPAN, PRODUCT, STORE_HINT)
        first = 1
    for i_c in range(first, V_SPAN // B_V):
        o_c = i_c * B_V + tl.arange(0, B_V)
        b_s = tl.load(p_slab + o_c[:, None] * stride_s_v, eviction_policy=LOAD_HINT)
        tl.store(p_slab + o_c[:, None] * stride_s_v,
                 commit_tile(b_s, o_c, rows, m_p, weight, decay, b_k, i_h, i_span, u_ptr, H_V, D_V, V_SPAN,
                             PRODUCT), cache_modifier=STORE_HINT)


@triton.jit
def commit_first_tile(p_slab, b_first, rows, m_p, weight, decay, b_k, i_h, i_span, u_ptr, stride_s_v, H_V,
                      D_V: tl.constexpr, B_V: tl.constexpr, V_SPAN: tl.constexpr, PRODUCT: tl.constexpr,
                      STORE_HINT: tl.constexpr):
    """The span's first tile ``b_first`` (read at the program's start, by pointers) after the pass, written back."""
    o_c = tl.arange(0, B_V)
    tl.store(p_slab + o_c[:, None] * stride_s_v,
             commit_tile(b_first, o_c, rows, m_p, weight, decay, b_k, i_h, i_span, u_ptr, H_V, D_V, V_SPAN, PRODUCT),
             cache_modifier=STORE_HINT)


@triton.jit
def commit_span_tma(state_desc, p_slab, row0, col, b_first, HAVE_FIRST: tl.constexpr, rows, m_p, weight, decay, o_k,
                    i_h, i_hk, i_span, u_ptr, k_ptr, stride_s_v, H_V, H_K, D_K: tl.constexpr, D_V: tl.constexpr,
                    B_V: tl.constexpr, V_SPAN: tl.constexpr, PRODUCT: tl.constexpr, STORE_HINT: tl.constexpr,
                    STAGES: tl.constexpr):
    """`commit_span`'s first pass with the state tiles read by TMA (``state_desc`` over the pool's ``[rows, D_K]``
    from row ``row0``, column ``col``): a pipelined loop, ``STAGES`` tiles in flight in shared memory. With
    ``HAVE_FIRST`` the first tile is ``b_first``, read by pointers before the path was found (a TMA load issued
    there would wait for its tile on the spot), and the loop takes the rest."""
    b_k = tl.load(k_ptr + rows[:, None] * (H_K * D_K) + i_hk * D_K + o_k[None, :], mask=m_p[:, None],
                  other=0).to(tl.float32)
    first = 0
    if HAVE_FIRST:
        commit_first_tile(p_slab, b_first, rows, m_p, weight, decay, b_k, i_h, i_span, u_ptr, stride_s_v, H_V, D_V,
                          B_V, V_SPAN, PRODUCT, STORE_HINT)
        first = 1
    for i_c in tl.range(first, V_SPAN // B_V, num_stages=STAGES):
        o_c = i_c * B_V + tl.arange(0, B_V)
        b_s = state_desc.load([row0 + i_c * B_V, col])
        tl.store(p_slab + o_c[:, None] * stride_s_v,
                 commit_tile(b_s, o_c, rows, m_p, weight, decay, b_k, i_h, i_span, u_ptr, H_V, D_V, V_SPAN,
                             PRODUCT), cache_modifier=STORE_HINT)


@triton.jit
def commit_tile(b_s, o_c, rows, m_p, weight, decay, b_k, i_h, i_span, u_ptr, H_V, D_V: tl.constexpr,
                V_SPAN: tl.constexpr, PRODUCT: tl.constexpr):
    """State rows ``o_c`` of the program's span after the pass: ``decay * b_s`` plus the nodes' update."""
    b_u = tl.load(u_ptr + rows[:, None] * (H_V * D_V) + i_h * D_V + (i_span * V_SPAN + o_c)[None, :],
                  mask=m_p[:, None], other=0)
    return path_product(decay * b_s, tl.trans(b_u * weight[:, None]), b_k, PRODUCT)

COMMIT = FastLauncher(tree_commit_kernel)
_data_ptr = torch.Tensor.data_ptr

_config_source: Callable | None = None
def set_commit_config_source(source: Callable | None) -> Callable | None:
    """Use ``source`` for ``config=None`` commits: ``(hk, hv, dk, dv, dtype, max_tree_size, num_requests, layers,
    device) -> CommitConfig | None`` (None: the untuned fallback). ``None`` restores the default
    (`DEFAULT_COMMIT_CONFIG_SOURCE`, resolved on first use). Returns the source it replaces (None if the
    default was not resolved yet)."""
    global _config_source
    previous, _config_source = _config_source, source
    return previous


def commit_config(hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, max_tree_size: int, num_requests: int,
                  layers: int, device: torch.device) -> CommitConfig:
    """The launch ``config=None`` runs: the config source's on a GPU (the tuned one, cached there: one dictionary
    access after the first call), else the untuned fallback `default_commit_config`."""
    global _config_source
    if device.type == "cuda":
        if _config_source is None:
            module, name = DEFAULT_COMMIT_CONFIG_SOURCE.split(":")
            _config_source = getattr(importlib.import_module(module), name)
        config = _config_source(hk, hv, dk, dv, dtype, max_tree_size, num_requests, layers, device)
        if config is not None:
            return config
    return default_commit_config(layers * num_requests * hv, dk, dv)


def tree_commit(state, state_indices, res: TreeVerifyResult, accepted, validate: bool | None = None,
                config: CommitConfig | None = None) -> None:
    """Write in place, for each request, the state the recurrence reaches at its accepted node.

    Args:
        state: ``[num_slots, Hv, dv, dk]`` float32 pool (the one verified against).
        state_indices: ``[B]`` slot of each request.
        res: the `TreeVerifyResult` of `tree_verify` or `serial_verify`.
        accepted: ``[B]`` int, local index of each request's last accepted node; -1 leaves its slot as is.
        config: the launch (`CommitConfig`); None: the tuned one for this GPU, head shape, dtype, tree and batch
            bucket (one layer), else the untuned fallback (`commit_config`).
    """
    if isinstance(state, torch.Tensor) and state.is_cuda and (elsewhere := other_cuda_device(state)) is not None:
        with torch.cuda.device(elsewhere):  # Triton launches on the current device: make it the pool's
            return tree_commit(state, state_indices, res, accepted, validate, config)
    check_commit_inputs(state, state_indices, res, accepted, validate)
    if config is not None and type(config) is not CommitConfig:
        raise TypeError(f"config: expected a CommitConfig or None, got {type(config).__name__}")
    if not use_triton(state.device):
        commit_closed_form(state, state_indices, res, accepted, validate=False)
        return
    _launch(state, 1, (0, *state.stride()[:3]), state_indices, res.tree, accepted, res.u, res.log_decay, res.k,
            res.k_scale, res.committed, (0, 0, 0, 0, 0), config)


@dataclass
class LayerResults:
    """The verification factors of every GDN layer of a step, stacked so one launch commits them all.

    Each field is `TreeVerifyResult`'s with a leading layer dimension ``L``; ``layer(l)`` is layer l's
    `TreeVerifyResult` (views), to pass to `tree_verify` as ``out=``.
    """

    o: torch.Tensor
    u: torch.Tensor
    log_decay: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor
    committed: torch.Tensor

    @classmethod
    def empty(cls, num_layers: int, tree: TreeBatch, heads: HeadShape, dtype: torch.dtype, device) -> "LayerResults":
        """Buffers for ``num_layers`` layers verifying ``tree`` (its nodes and requests size them)."""
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
            raise ValueError(f"num_layers: expected a positive int, got {num_layers!r}")
        if not all(isinstance(getattr(tree, name, None), int) for name in ("num_nodes", "num_requests")):
            raise TypeError(f"tree: expected a TreeBatch (its num_nodes and num_requests size the buffers), got "
                            f"{type(tree).__name__}")
        if not isinstance(heads, HeadShape):
            raise TypeError(f"heads: expected a HeadShape, got {type(heads).__name__}")
        if dtype not in INPUT_DTYPES:
            raise TypeError(f"dtype: {dtype} is not an input dtype of the verify (bfloat16, float16 or float32)")
        n, h, b = tree.num_nodes, heads, tree.num_requests
        # each layer's marks start on a 16-byte boundary (rows padded to 4): a layer's result is then aligned
        # wherever the model's head counts are multiples of 4, and its launches take the aligned key's short path
        committed = torch.zeros(num_layers, -(-b // 4) * 4, dtype=torch.int32, device=device)[:, :b]
        return cls(o=torch.empty(num_layers, n, h.hv, h.dv, dtype=dtype, device=device),
                   u=torch.empty(num_layers, n, h.hv, h.dv, dtype=torch.float32, device=device),
                   log_decay=torch.empty(num_layers, n, h.hv, dtype=torch.float32, device=device),
                   k=torch.empty(num_layers, n, h.hk, h.dk, dtype=dtype, device=device),
                   k_scale=torch.empty(num_layers, n, h.hk, dtype=torch.float32, device=device),
                   committed=committed)

    @property
    def num_layers(self) -> int:
        return self.u.shape[0]

    def layer(self, index: int, tree: TreeBatch | None = None) -> TreeVerifyResult:
        """Layer ``index``'s `TreeVerifyResult` (views into the stacked buffers), its ``tree`` set to ``tree``.

        One object per layer, kept while the six stacked tensors are the same objects over the same memory: each call
        returns it again, so ``tree_verify(out=results.layer(l))`` checks it by the record of its last check
        (`result.stamp_result`) and no views are made again (making them and checking the result in full took half
        of an eager verify's Python: 21.2 against 11.6 us a call on a CPU, the launch left out;
        ``lab/host_python.py``). A result taken earlier for the same layer is that object: like its memory, which
        the layer's next verify writes, it shows the last call's tree."""
        if type(index) is not int:
            try:
                index = operator.index(index)
            except TypeError:
                raise TypeError(f"index: expected an int (a layer), got {type(index).__name__}") from None
        o, u, log_decay, k, k_scale, committed = self.o, self.u, self.log_decay, self.k, self.k_scale, self.committed
        layers = u.shape[0]
        if not 0 <= index < layers:
            raise IndexError(f"index: expected a layer in [0, {layers}), got {index}")
        kept = self.__dict__.get("_kept_layers")
        if not (kept is not None and kept[0] is o and kept[1] is u and kept[2] is log_decay and kept[3] is k
                and kept[4] is k_scale and kept[5] is committed and kept[6] == layers
                and kept[7] == (o.data_ptr(), u.data_ptr(), log_decay.data_ptr(), k.data_ptr(), k_scale.data_ptr(),
                                committed.data_ptr())):
            # new tensors, or one of them moved to other memory (``set_``, ``.data =``): the views made afresh
            kept = self.__dict__["_kept_layers"] = (
                o, u, log_decay, k, k_scale, committed, layers,
                (o.data_ptr(), u.data_ptr(), log_decay.data_ptr(), k.data_ptr(), k_scale.data_ptr(),
                 committed.data_ptr()), [None] * layers)
        entry = kept[8][index]  # (the result, its six views)
        if entry is not None:
            res, views = entry
            if (res.o is views[0] and res.u is views[1] and res.log_decay is views[2] and res.k is views[3]
                    and res.k_scale is views[4] and res.committed is views[5]):
                res.tree = tree
                return res
            # a field of the kept result was replaced by its holder: a new result over the same views
            res = TreeVerifyResult(*views, tree=tree)
        else:
            res = TreeVerifyResult(o=o[index], u=u[index], log_decay=log_decay[index], k=k[index],
                                   k_scale=k_scale[index], committed=committed[index], tree=tree)
        kept[8][index] = (res, (res.o, res.u, res.log_decay, res.k, res.k_scale, res.committed))
        return res


def tree_commit_layers(states, state_indices, results: LayerResults, tree: TreeBatch, accepted,
                       validate: bool | None = None, config: CommitConfig | None = None) -> None:
    """`tree_commit` of every layer of a step in one launch.

    Args:
        states: ``[L, num_slots, Hv, dv, dk]`` float32, the layers' pools (one tensor, as engines allocate
            them); state_indices, accepted: as for `tree_commit`, shared by all layers.
        results: the layers' factors (`LayerResults`, each layer verified with ``out=results.layer(l)``).
        tree: the trees every layer verified.
        config: the launch (`CommitConfig`); None: the one tuned for a launch of this many layers (else the
            nearest tuned, else the untuned fallback: `commit_config`).
    """
    if isinstance(states, torch.Tensor) and states.is_cuda and (elsewhere := other_cuda_device(states)) is not None:
        with torch.cuda.device(elsewhere):  # Triton launches on the current device: make it the pools'
            return tree_commit_layers(states, state_indices, results, tree, accepted, validate, config)
    if validation_enabled(validate) or not _layers_hold(states, state_indices, results, tree, accepted):
        require_tensor("states", states)
        if not isinstance(results, LayerResults):
            raise TypeError(f"results: expected LayerResults (LayerResults.empty, then out=results.layer(l)), "
                            f"got {type(results).__name__}")
        if states.dim() != 5 or states.shape[0] != results.num_layers:
            raise ValueError(f"states: expected shape [L={results.num_layers}, num_slots, Hv, dv, dk], "
                             f"got {tuple(states.shape)}")
        for name in ("u", "log_decay", "k", "k_scale", "committed"):
            if not getattr(results, name)[0].is_contiguous():
                raise ValueError(f"results.{name}: each layer must be contiguous")
        if isinstance(tree, TreeBatch) and results.u.dim() == 4 and results.u.shape[1] != tree.num_nodes:
            raise ValueError(f"tree: has {tree.num_nodes} nodes but results hold {results.u.shape[1]} rows a layer "
                             "(pass the tree the layers verified)")
        # the layers share one tensor each: layer 0's checks (shapes, dtypes, devices, values) hold for all
        check_commit_inputs(states[0], state_indices, results.layer(0, tree), accepted, validate)
    if config is not None and type(config) is not CommitConfig:
        raise TypeError(f"config: expected a CommitConfig or None, got {type(config).__name__}")
    if not use_triton(states.device):
        for layer in range(results.num_layers):
            commit_closed_form(states[layer], state_indices, results.layer(layer, tree), accepted, validate=False)
        return
    layers = results.num_layers
    _launch(states, layers, (states.stride(0) if layers > 1 else 0, *states.stride()[1:4]), state_indices, tree,
            accepted, results.u, results.log_decay, results.k, results.k_scale, results.committed,
            tuple(x.stride(0) for x in (results.u, results.log_decay, results.k, results.k_scale, results.committed)),
            config)


def _layers_hold(states, state_indices, results: LayerResults, tree: TreeBatch, accepted) -> bool:
    """Whether every host-side condition of `tree_commit_layers`' checks holds (layer 0's `check_commit_inputs`
    included), taken on the stacked tensors as plain comparisons: no layer's views are made (ten views, half of the
    call's Python). Stricter than the checks (each layer's factors laid out row-major by their strides, with any layer
    stride: `LayerResults.empty`'s, or the layers and rows of larger buffers an engine slices): where it fails, the
    checks run and name what is wrong, if anything."""
    tensor = torch.Tensor
    if not (type(results) is LayerResults and type(tree) is TreeBatch and isinstance(states, tensor)
            and isinstance(state_indices, tensor) and isinstance(accepted, tensor)):
        return False
    u, log_decay, k, k_scale, committed = results.u, results.log_decay, results.k, results.k_scale, results.committed
    if not (isinstance(u, tensor) and isinstance(log_decay, tensor) and isinstance(k, tensor)
            and isinstance(k_scale, tensor) and isinstance(committed, tensor)):
        return False
    ss, us, ks = states.shape, u.shape, k.shape
    b, device = len(tree.sizes), u.device
    return (len(ss) == 5 and len(us) == 4 and len(ks) == 4 and ss[0] == us[0] and ss[2] == us[2] and ss[3] == us[3]
            and ss[4] == ks[3] and us[1] == tree.num_nodes and ks[0] == us[0] and ks[1] == us[1]
            and us[2] > 0 and us[3] > 0 and ks[3] > 0 and ks[2] > 0 and us[2] % ks[2] == 0
            and states.dtype == torch.float32 and states.stride(4) == 1 and u.dtype == torch.float32
            and log_decay.dtype == torch.float32 and k_scale.dtype == torch.float32 and committed.dtype == torch.int32
            and k.dtype in INPUT_DTYPES
            and u.stride()[1:] == (us[2] * us[3], us[3], 1) and k.stride()[1:] == (ks[2] * ks[3], ks[3], 1)
            and log_decay.shape == us[:3] and log_decay.stride()[1:] == (us[2], 1)
            and k_scale.shape == ks[:3] and k_scale.stride()[1:] == (ks[2], 1)
            and state_indices.shape == (b,) and accepted.shape == (b,) and committed.shape == (us[0], b)
            and committed.stride(1) == 1
            and state_indices.dtype in INDEX_DTYPES and accepted.dtype in INDEX_DTYPES
            and state_indices.stride(0) == 1 and accepted.stride(0) == 1
            and state_indices.device == device and accepted.device == device and states.device == device
            and k.device == device and log_decay.device == device and k_scale.device == device
            and committed.device == device and tree.offsets.device == device)


def _launch(states, layers: int, state_strides: tuple, state_indices, tree, accepted, u, log_decay, k, k_scale,
            committed, layer_strides: tuple, config: CommitConfig | None) -> None:
    """One commit launch over ``layers`` layers: ``states`` the first layer's pool (``state_strides``: layer, slot,
    head and value row), the factors the first layer's (``layer_strides``: u, log_decay, k, k_scale and committed
    to the next layer; all 0 for one layer). Keyed (`FastLauncher.launch_keyed`) on the config, the sizes, the
    dtypes, the strides and which tensors are not 16-byte aligned (`launcher.misaligned`)."""
    hv, dv = u.shape[-2], u.shape[-1]
    hk, dk = k.shape[-2], k.shape[-1]
    if config is None:
        config = commit_config(hk, hv, dk, dv, k.dtype, tree.max_tree_size, tree.num_requests, layers, states.device)
    if not config.fits(dk, dv):
        raise ValueError(f"config: tiles b_k={config.b_k}, v_span={config.v_span} must divide dk={dk}, dv={dv}")
    b_k, v_span, num_requests = config.b_k, config.v_span, len(tree.sizes)
    grid = ((dv // v_span) * (dk // b_k), hv, layers * num_requests)
    offsets, enter, leave, depth = tree.offsets, tree.dfs_enter, tree.dfs_exit, tree.node_depth
    table = None
    if layers > 1 and PATH_TABLE_MIN_BLOCK is not None and node_block(tree.max_tree_size) >= PATH_TABLE_MIN_BLOCK:
        table = pending_path_rows(tree, accepted, _identity(tree))  # one small launch, shared by every layer
    tensors = (states, state_indices, accepted, offsets, enter, leave, depth, depth if table is None else table, u,
               log_decay, k, k_scale, committed)
    scalars = (commit_epoch(), *state_strides, *layer_strides, num_requests)
    pointers = tuple(map(_data_ptr, tensors))
    tma = bool(config.tma) and tma_state_loads(states, config)
    # built per launch and encoded by Triton's launcher each time (with the encoding, 18 us more host time a call than
    # a pointer launch on the H200's host: BENCHMARKS.md, "Fifteenth session"); kept, it would keep the pool alive
    desc = TensorDescriptor(states, [states.numel() // dk, dk], [dk, 1], [config.b_v, b_k]) if tma else None
    block = min(node_block(tree.max_tree_size), SCAN_WIDTH)
    if SCAN_BLOCK is not None:
        if type(SCAN_BLOCK) is not int or SCAN_BLOCK < 16 or SCAN_BLOCK & (SCAN_BLOCK - 1):
            raise ValueError(f"tree_commit.SCAN_BLOCK: expected None or a power of two >= 16, got {SCAN_BLOCK!r}")
        block = SCAN_BLOCK
    product = path_precision(COMMIT_PRODUCT, k.dtype, "ieee")
    key = (config, tma, hv, hk, dk, dv, block, state_indices.dtype, accepted.dtype, u.dtype, log_decay.dtype, k.dtype,
           k_scale.dtype, committed.dtype, product, COMMIT_STATE_HINTS, tma and TMA_FIRST_BY_POINTER,
           None if table is None else table.shape[1], misaligned(pointers, reduce(or_, pointers)), *state_strides,
           *layer_strides)
    COMMIT.launch_keyed(key, grid, (desc, *pointers, *scalars), lambda: (desc, *tensors, *scalars), lambda: dict(
        H_V=hv, H_K=hk, D_K=dk, D_V=dv, B_T=block, B_K=b_k, B_V=config.b_v, V_SPAN=v_span, B_P=16,
        PRODUCT=product, LOAD_HINT=COMMIT_STATE_HINTS[0], STORE_HINT=COMMIT_STATE_HINTS[1], TMA=tma,
        TMA_FIRST_BY_POINTER=tma and TMA_FIRST_BY_POINTER, PATH_TABLE=table is not None,
        W_P=16 if table is None else table.shape[1], STAGES=config.num_stages, num_warps=config.num_warps,
        num_stages=config.num_stages))


def _identity(tree: TreeBatch) -> torch.Tensor:
    """``[0, 1, .., B-1]`` int32 on the tree's device (each request its own): `pending_path_rows`' request map for a
    commit's own requests, kept with the tree."""
    kept = tree._cache.get("identity")
    if kept is None:
        kept = tree._cache["identity"] = torch.arange(tree.num_requests, dtype=torch.int32, device=tree.device)
    return kept


TMA_MAX_BOX = 256  # a TMA copy's box: at most 256 elements along each dimension


def tma_state_loads(states, config: CommitConfig) -> bool:
    """Whether a ``tma=1`` launch over ``states`` (one layer's pool, or the stacked layers' pools) reads its state
    tiles by TMA here: on an sm_90+ GPU (`tma_device`), with the pool contiguous (its rows of ``dk`` seen as one
    ``[rows, dk]`` matrix), 16-byte aligned, fewer than 2^31 rows (the kernel's row offsets are int32) and the
    tile within a TMA box. Elsewhere the launch reads by pointers: the same result, the pointer path's speed."""
    dk = states.shape[-1]
    return (tma_device(states.device) and states.is_contiguous() and states.data_ptr() % 16 == 0
            and (dk * states.element_size()) % 16 == 0 and states.numel() // dk < 2 ** 31
            and config.b_v <= TMA_MAX_BOX and config.b_k <= TMA_MAX_BOX)


_tma_devices: dict = {}
TMA_OFF_GPU = False
"""Let ``tma=1`` launches off a GPU read by TMA too (Triton's interpreter runs tensor descriptors): the CPU tests
set it to prove the TMA path's arithmetic where CI has no GPU."""


def tma_device(device: torch.device) -> bool:
    """Whether ``device`` can read by TMA: a CUDA GPU of compute capability 9.0 or later (cached per device), or,
    with `TMA_OFF_GPU` set, any device Triton's interpreter runs on."""
    if device.type != "cuda":
        return TMA_OFF_GPU
    index = device.index if device.index is not None else torch.cuda.current_device()
    capable = _tma_devices.get(index)
    if capable is None:
        capable = _tma_devices[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return capable
