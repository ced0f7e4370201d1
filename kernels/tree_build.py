"""A parent table ``[B, T]`` (every request the same size, node 0 its one root) into the tensors of a
`TreeBatch`, on the device in one launch: what an engine that keeps its draft tree on the GPU (SGLang's
``retrieve_parent_token``) needs once per speculative round, CUDA-graph safe.

Convention of the table: node 0 of each request is the root and its entry is never read; node ``i >= 1``
hangs off ``table[r, i]``, taken into ``[0, i - 1]`` (a negative entry reads as 0, one ``>= i`` as
``i - 1``), so whatever the table holds the result is a tree whose parents precede their children.

The kernel (one program per request, the request's nodes padded to ``TB``, a power of two >= 16):

1. ``A = I + P`` as a ``[TB, TB]`` register tile, ``P[i, j] = 1`` when j is i's parent. Squaring it and
   clamping to 1 turns "ancestor at distance <= s" into "ancestor at distance <= 2s"; after
   ``ceil(log2 T)`` squarings ``A[i, j] = 1`` exactly when j is i or one of its ancestors. The products run
   on fp16 operands with fp32 accumulation: the entries are 0 or 1 and a sum is at most ``TB``, so every
   product is exact (tensor cores on a GPU, numpy under the interpreter).
2. Row sums of ``A`` count the ancestors: ``depth_i = sum_j A[i, j] - 1``. Column sums are subtree sizes:
   ``size_j = sum_i A[i, j]``.
3. Pre-order numbers, children in increasing index order. Node i is preceded by its strict ancestors and,
   for every ancestor-or-self a of i, by the whole subtrees of a's earlier siblings. With
   ``off_a = sum over s of size_s``, s running over a's siblings with smaller index,
   ``enter_i = depth_i + sum_a A[i, a] off_a`` and ``exit_i = enter_i + size_i - 1``.
4. Block depths (`TreeBatch.block_depths`, the substitution sweeps of a block of ``bs`` consecutive nodes):
   a node's ancestors have smaller indices, so the ones in its own block form an unbroken stretch of its
   path just above it, and the node's depth inside the forest its block induces is
   ``sum_j A[i, j] [j // bs == i // bs] - 1``. The table holds the maximum of that over each block, for
   ``bs`` in 16, 32 and 64 (the node blocks `config.node_block` chooses).

Everything is written by the kernel, offsets included; the host only knows B and T, so the call can be
captured in a CUDA graph (no host reads of device data, no shape that depends on the tree).

Trees of more than `MAX_KERNEL_TREE` (128) nodes, and CPU tensors without ``TRITON_INTERPRET=1``, take
`tree_tables_torch`: the same algorithm as batched ``[B, T, T]`` torch ops (about 30 launches). A
``[256, 256]`` tile would not fit in one program's registers; no engine drafts trees that large today.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import INDEX_DTYPES, on_device_of, use_triton
from .launcher import FastLauncher, addresses

BLOCK_SIZES = (16, 32, 64)
"""The node-block sizes whose depth tables are built (every value `config.node_block` returns)."""
MAX_KERNEL_TREE = 128
"""Largest tree size (T) the kernel takes; larger ones run `tree_tables_torch`."""


class TreeTables(NamedTuple):
    """The device tensors of a `TreeBatch` of B requests of T nodes each (all int32)."""

    offsets: torch.Tensor  # [B + 1]
    parents: torch.Tensor  # [B * T], -1 for node 0
    node_depth: torch.Tensor  # [B * T]
    dfs_enter: torch.Tensor  # [B * T]
    dfs_exit: torch.Tensor  # [B * T]
    block_depths: dict  # block size -> ([B, ceil(T / block)] int32, ceil(T / block)), as TreeBatch caches it


@triton.jit
def _block_table(b_anc, o_i, m_i, table_ptr, i_r, num_blocks,
                 BS: tl.constexpr, NUM_B: tl.constexpr):
    """Per block of ``BS`` nodes, the depth of the forest it induces; one row of the table."""
    blk = o_i // BS
    local = tl.sum(tl.where(blk[:, None] == blk[None, :], b_anc, 0.0), axis=1) - 1.0
    local = tl.where(m_i, local, 0.0)
    o_b = tl.arange(0, NUM_B)
    row = tl.max(tl.where(o_b[:, None] == blk[None, :], local[None, :], 0.0), axis=1)
    tl.store(table_ptr + i_r * num_blocks + o_b, row.to(tl.int32), mask=o_b < num_blocks)


@triton.jit
def tree_build_kernel(
    # pointers
    table_ptr, parents_ptr, depth_ptr, enter_ptr, exit_ptr, offsets_ptr, blk16_ptr, blk32_ptr, blk64_ptr,
    # sizes and strides
    T, stride_r, stride_n, nb16, nb32, nb64,
    # meta-parameters
    NUM_SQUARINGS: tl.constexpr, TB: tl.constexpr, NB16: tl.constexpr, NB32: tl.constexpr, NB64: tl.constexpr,
):
    """One program per request: its ``T`` nodes in a ``[TB, TB]`` ancestor tile (module docstring)."""
    i_r = tl.program_id(0)
    o_i = tl.arange(0, TB)
    m_i = o_i < T
    # parents, taken into [0, i - 1]; node 0's entry is not read
    par = tl.load(table_ptr + i_r * stride_r + o_i * stride_n, mask=m_i & (o_i > 0), other=0)
    par = tl.minimum(tl.maximum(par, 0), tl.maximum(o_i - 1, 0)).to(tl.int32)
    has_parent = m_i & (o_i > 0)

    # 1. A = I + P, then its transitive closure by squaring
    edge = has_parent[:, None] & (par[:, None] == o_i[None, :])
    diag = m_i[:, None] & (o_i[:, None] == o_i[None, :])
    b_anc = tl.where(edge | diag, 1.0, 0.0)
    for _ in tl.static_range(NUM_SQUARINGS):
        b_h = b_anc.to(tl.float16)
        b_anc = tl.minimum(tl.dot(b_h, b_h, out_dtype=tl.float32), 1.0)

    # 2. depths (row sums) and subtree sizes (column sums)
    depth = tl.sum(b_anc, axis=1) - 1.0
    size = tl.sum(b_anc, axis=0)

    # 3. pre-order: earlier siblings' subtrees, summed over every ancestor-or-self
    sibling = (has_parent[:, None] & has_parent[None, :] & (par[:, None] == par[None, :])
               & (o_i[None, :] < o_i[:, None]))
    off = tl.sum(tl.where(sibling, size[None, :], 0.0), axis=1)
    enter = depth + tl.sum(b_anc * off[None, :], axis=1)
    exit_ = enter + size - 1.0

    rows = i_r * T + o_i
    tl.store(parents_ptr + rows, tl.where(o_i == 0, -1, par), mask=m_i)
    tl.store(depth_ptr + rows, depth.to(tl.int32), mask=m_i)
    tl.store(enter_ptr + rows, enter.to(tl.int32), mask=m_i)
    tl.store(exit_ptr + rows, exit_.to(tl.int32), mask=m_i)
    tl.store(offsets_ptr + i_r + 1, (i_r + 1) * T)
    if i_r == 0:
        tl.store(offsets_ptr, 0)

    # 4. block depths
    _block_table(b_anc, o_i, m_i, blk16_ptr, i_r, nb16, 16, NB16)
    _block_table(b_anc, o_i, m_i, blk32_ptr, i_r, nb32, 32, NB32)
    _block_table(b_anc, o_i, m_i, blk64_ptr, i_r, nb64, 64, NB64)


TREE_BUILD = FastLauncher(tree_build_kernel)
"""The tree-build kernel's launches (once per round), without Triton's binder."""


def _num_warps(tile: int) -> int:
    return {16: 1, 32: 2, 64: 4}.get(tile, 8)


def build_tree_tables(parent_table: torch.Tensor, num_warps: int | None = None) -> TreeTables:
    """The `TreeBatch` tensors of ``parent_table`` ``[B, T]`` (node 0 the root, its entry not read; node i's
    parent taken into ``[0, i - 1]``): one kernel launch, no host sync, graph-safe.

    ``num_warps`` overrides the launch's warps (for timing; default by tile size). Trees of more than
    `MAX_KERNEL_TREE` nodes and CPU tensors without the interpreter run `tree_tables_torch` (same results).
    """
    if not isinstance(parent_table, torch.Tensor):
        raise TypeError(f"parent_table: expected a torch.Tensor, got {type(parent_table).__name__}")
    if parent_table.dim() != 2:
        raise ValueError(f"parent_table: expected [B, T], got {tuple(parent_table.shape)}")
    b, t = parent_table.shape
    if t == 0:
        raise ValueError("parent_table: T = 0 (every request needs its root, node 0)")
    device = parent_table.device
    if b == 0 or t > MAX_KERNEL_TREE or not use_triton(device):
        return tree_tables_torch(parent_table)
    if parent_table.dtype not in INDEX_DTYPES:
        parent_table = parent_table.long()
    tile = max(16, 1 << (t - 1).bit_length())  # the next power of two (triton's costs a constexpr call)
    i32 = torch.int32
    nodes = [torch.empty(b * t, dtype=i32, device=device) for _ in range(4)]
    offsets = torch.empty(b + 1, dtype=i32, device=device)
    blocks = {bs: -(-t // bs) for bs in BLOCK_SIZES}
    tables = {bs: torch.empty(b, blocks[bs], dtype=i32, device=device) for bs in BLOCK_SIZES}
    tensors = (parent_table, *nodes, offsets, tables[16], tables[32], tables[64])
    sizes = (t, parent_table.stride(0), parent_table.stride(1), blocks[16], blocks[32], blocks[64])
    pointers, alignment = addresses(tensors)
    warps = num_warps or _num_warps(tile)
    # keyed on what decides the binary (`FastLauncher.launch_keyed`): the table's dtype, which tensors are
    # misaligned, every integer argument (Triton specialises on them; the constants follow from T) and the warps
    key = (parent_table.dtype, alignment, warps, *sizes)
    with on_device_of(parent_table):  # Triton launches on the current device: make it the table's
        TREE_BUILD.launch_keyed(key, (b,), (*pointers, *sizes), lambda: (*tensors, *sizes), lambda: dict(
            NUM_SQUARINGS=math.ceil(math.log2(t)), TB=tile, NB16=max(2, tile // 16), NB32=max(2, tile // 32),
            NB64=max(2, tile // 64), num_warps=warps))
    return TreeTables(offsets, *nodes, {bs: (tables[bs], blocks[bs]) for bs in BLOCK_SIZES})



def tree_tables_torch(parent_table: torch.Tensor) -> TreeTables:
    """`build_tree_tables` as batched torch ops (the fallback: any T, any device; about 30 launches).

    The same ancestor matrix, squared ``ceil(log2 T)`` times over ``[B, T, T]``.
    """
    b, t = parent_table.shape
    device = parent_table.device
    idx = torch.arange(t, device=device)
    par = parent_table.long().clamp(min=0)
    par = torch.minimum(par, (idx - 1).clamp(min=0))  # defensive: a parent precedes its child
    onehot = torch.zeros(b, t, t, device=device, dtype=torch.float32)
    if t > 1:
        onehot[:, 1:].scatter_(2, par[:, 1:, None], 1.0)
    anc = onehot + torch.eye(t, device=device)
    for _ in range(max(0, math.ceil(math.log2(t)))):
        anc = (anc @ anc).clamp(max=1.0)
    depth = anc.sum(2) - 1  # [B, T]
    size = anc.sum(1)  # [B, T] subtree sizes
    parent_full = torch.where(idx[None] == 0, torch.full_like(par, -1), par)  # [B, T]
    same = (parent_full[:, :, None] == parent_full[:, None, :]) & (idx[None, None, :] < idx[None, :, None])
    off = (same.float() * size[:, None, :]).sum(2)  # earlier siblings' subtree sizes
    enter = depth + (anc * off[:, None, :]).sum(2)
    exit_ = enter + size - 1
    block_tables = {}
    for block in BLOCK_SIZES:
        blocks = -(-t // block)
        blk = idx // block
        local = (anc * (blk[None, None, :] == blk[None, :, None])).sum(2) - 1
        table = torch.zeros(b, blocks, device=device, dtype=torch.float32)
        table.scatter_reduce_(1, blk[None].expand(b, t), local, reduce="amax", include_self=True)
        block_tables[block] = (table.to(torch.int32), blocks)
    i32 = torch.int32
    return TreeTables(
        offsets=torch.arange(0, (b + 1) * t, t, device=device, dtype=i32),
        parents=parent_full.reshape(-1).to(i32), node_depth=depth.reshape(-1).to(i32),
        dfs_enter=enter.reshape(-1).to(i32), dfs_exit=exit_.reshape(-1).to(i32),
        block_depths=block_tables)
