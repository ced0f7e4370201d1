"""Each next-round request's pending path (`PendingPaths.path_rows`), worked out once per round for all layers.

A round's accepted paths are the same for every GDN layer; a verify that folds them in (docs/math.md §4) reads,
per request, the packed rows of its slot's path by depth instead of searching the previous tree in every
program. ``path_rows[r, d]`` is the row (in the previous round's packing) of the node at depth ``d`` on the path
from the root to the accepted node of the previous request of request ``r``'s slot, -1 past the accepted node's
depth and for a request with nothing pending. A node lies on that path when the accepted node's pre-order number
lies in its depth-first interval; ancestors precede their descendants in the packing, so only the nodes up to
the accepted one are looked at.

On a GPU, and on the CPU under ``TRITON_INTERPRET=1``, one launch (`pending_path_rows_kernel`, one program per
request); elsewhere a few batched torch operations (`pending_path_rows_torch`). Neither reads device data on
the host, so either can run inside a CUDA graph capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bole_tune.tree import TreeBatch

from ..common import on_device_of, use_triton
from ..launcher import FastLauncher
from .blocks import path_hits

SEARCH_BLOCK = 64
"""Nodes of the previous tree one step of the kernel's search looks at."""


def path_width(tree: TreeBatch) -> int:
    """Columns of `PendingPaths.path_rows`: a power of two >= 16 that holds the deepest path (depth + 1 nodes)."""
    return max(16, 1 << tree.depth.bit_length())


@triton.jit(do_not_specialize=["num_prev"])
def pending_path_rows_kernel(map_ptr, accepted_ptr, offsets_ptr, enter_ptr, exit_ptr, depth_ptr, rows_ptr, num_prev,
                             B_T: tl.constexpr, WIDTH: tl.constexpr):
    i_r = tl.program_id(0).to(tl.int64)
    prev = tl.load(map_ptr + i_r).to(tl.int64)
    ok = (prev >= 0) & (prev < num_prev)
    prev = tl.where(ok, prev, 0)
    accepted = tl.load(accepted_ptr + prev).to(tl.int64)
    bos = tl.load(offsets_ptr + prev).to(tl.int64)
    size = tl.load(offsets_ptr + prev + 1).to(tl.int64) - bos
    ok = ok & (accepted >= 0) & (accepted < size)
    accepted = tl.where(ok, accepted, -1)  # no search steps below
    enter_a = tl.load(enter_ptr + bos + tl.maximum(accepted, 0))
    o_w = tl.arange(0, WIDTH)
    rows = tl.full([WIDTH], -1, dtype=tl.int64)
    for j_b in range(0, (accepted + B_T) // B_T):
        o_j = j_b * B_T + tl.arange(0, B_T)
        hit = path_hits(enter_ptr, exit_ptr, depth_ptr, bos, o_j, o_j <= accepted, enter_a, o_w)
        rows = tl.maximum(rows, tl.max(tl.where(hit, bos + o_j[None, :], -1), axis=1))
    tl.store(rows_ptr + i_r * WIDTH + o_w, rows.to(tl.int32))


PENDING_ROWS = FastLauncher(pending_path_rows_kernel)


def pending_path_rows(tree: TreeBatch, accepted: torch.Tensor, request_map: torch.Tensor) -> torch.Tensor:
    """`PendingPaths.path_rows` ``[len(request_map), path_width(tree)]`` int32 on the tree's device. An accepted
    node out of range, or a request_map entry out of range, gives an empty path (nothing is committed)."""
    device = tree.device
    # the kernel reads both by index (stride 1): a strided view is copied (on the device, no host read)
    accepted, request_map = accepted.to(device).contiguous(), request_map.to(device).contiguous()
    if not use_triton(device):
        return pending_path_rows_torch(tree, accepted, request_map)
    width = path_width(tree)
    rows = torch.empty((len(request_map), width), dtype=torch.int32, device=device)
    if len(request_map):
        with on_device_of(rows):  # Triton launches on the current device: make it the tree's
            PENDING_ROWS(
                (len(request_map),), request_map, accepted, tree.offsets, tree.dfs_enter, tree.dfs_exit,
                tree.node_depth, rows, tree.num_requests,
                B_T=min(SEARCH_BLOCK, triton.next_power_of_2(max(tree.max_tree_size, 16))), WIDTH=width)
    return rows


def pending_path_rows_torch(tree: TreeBatch, accepted: torch.Tensor, request_map: torch.Tensor) -> torch.Tensor:
    """The same table from batched torch operations over all of the previous round's nodes."""
    device, width = tree.device, path_width(tree)
    b, n = tree.num_requests, tree.num_nodes
    offsets = tree.offsets.long()
    sizes = offsets[1:] - offsets[:-1]
    acc = accepted.long()
    valid = (acc >= 0) & (acc < sizes)
    request = torch.repeat_interleave(torch.arange(b, device=device), sizes, output_size=n)
    enter, leave = tree.dfs_enter.long(), tree.dfs_exit.long()
    enter_a = enter[offsets[:-1] + torch.where(valid, acc, 0)][request]
    on_path = valid[request] & (enter <= enter_a) & (enter_a <= leave)
    column = torch.where(on_path, request * width + tree.node_depth.long(), b * width)
    table = torch.full((b * width + 1,), -1, dtype=torch.int32, device=device)
    table.scatter_(0, column, torch.arange(n, dtype=torch.int32, device=device))  # off-path nodes land on the spare
    table = table[:-1].view(b, width)
    prev = request_map.long()
    joined = (prev < 0) | (prev >= b)
    return torch.where(joined[:, None], -1, table[torch.where(joined, 0, prev)]).to(torch.int32)
