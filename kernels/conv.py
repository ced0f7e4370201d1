"""Tree-parallel causal depthwise convolution (with SiLU), and its commit along the accepted path.

Qwen3.5 runs a width-K (4) causal depthwise convolution over the concatenated q/k/v projections
before the recurrence. On a tree, node i's window is (great-grandparent, grandparent, parent, i);
past a root it continues into the request's committed conv state, the last K - 1 inputs
(``conv_state[slot, c, K - 2]`` the most recent). The ancestor table of `TreeBatch` holds, per node,
the packed row of each ancestor or the committed column to read, so every node is computed
independently: one program per (node block, channel block).

The commit writes, per request, the last K - 1 inputs of the accepted path (reaching into the old
state when the path is shorter) into the slot, reading before writing inside each program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bole_tune.tree import TreeBatch

from .common import (INDEX_DTYPES, INPUT_DTYPES, other_cuda_device, raise_first, slot_checks, use_triton,
                     validation_enabled)
from .reference import tree_conv_commit_reference, tree_conv_reference


@triton.jit
def tree_conv_kernel(
    # pointers
    x_ptr, weight_ptr, conv_state_ptr, state_indices_ptr, ancestors_ptr, request_ptr, y_ptr,
    # sizes and strides
    num_nodes, channels, stride_x_n, stride_s_slot, stride_s_c, stride_w_c, stride_y_n,
    # meta-parameters
    WIDTH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, APPLY_SILU: tl.constexpr,
):
    i_n = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_n = o_n < num_nodes
    m_c = o_c < channels
    m = m_n[:, None] & m_c[None, :]
    slot = tl.load(state_indices_ptr + tl.load(request_ptr + o_n, mask=m_n, other=0), mask=m_n, other=0).to(tl.int64)
    b_x = tl.load(x_ptr + o_n[:, None] * stride_x_n + o_c[None, :], mask=m, other=0).to(tl.float32)
    w_last = tl.load(weight_ptr + o_c * stride_w_c + (WIDTH - 1), mask=m_c, other=0).to(tl.float32)
    acc = b_x * w_last[None, :]
    for m_back in tl.static_range(1, WIDTH):
        src = tl.load(ancestors_ptr + o_n * (WIDTH - 1) + (m_back - 1), mask=m_n, other=0).to(tl.int64)
        in_tree = src >= 0
        from_tree = tl.load(x_ptr + src[:, None] * stride_x_n + o_c[None, :], mask=m & in_tree[:, None], other=0)
        column = (WIDTH - 1) + src  # src = -j: the j-th most recent committed input
        from_state = tl.load(conv_state_ptr + slot[:, None] * stride_s_slot + o_c[None, :] * stride_s_c
                             + column[:, None], mask=m & (~in_tree)[:, None], other=0)
        window = tl.where(in_tree[:, None], from_tree.to(tl.float32), from_state.to(tl.float32))
        w = tl.load(weight_ptr + o_c * stride_w_c + (WIDTH - 1 - m_back), mask=m_c, other=0).to(tl.float32)
        acc += window * w[None, :]
    if APPLY_SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + o_n[:, None] * stride_y_n + o_c[None, :], acc.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def tree_conv_commit_kernel(
    # pointers
    x_ptr, conv_state_ptr, state_indices_ptr, accepted_ptr, offsets_ptr, ancestors_ptr,
    # sizes and strides
    channels, stride_x_n, stride_s_slot, stride_s_c,
    # meta-parameters
    WIDTH: tl.constexpr, W_PAD: tl.constexpr, BLOCK_C: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1).to(tl.int64)
    accepted = tl.load(accepted_ptr + i_r).to(tl.int64)
    bos = tl.load(offsets_ptr + i_r).to(tl.int64)
    # -1 keeps the slot; so does a node out of range, which value checks (off by default) would refuse
    if (accepted >= 0) & (accepted < tl.load(offsets_ptr + i_r + 1).to(tl.int64) - bos):
        o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
        m_c = o_c < channels
        row = bos + accepted
        slot = tl.load(state_indices_ptr + i_r).to(tl.int64)
        p_state = conv_state_ptr + slot * stride_s_slot + o_c * stride_s_c
        # column WIDTH-2 becomes the accepted node's input, column t the input (WIDTH-2-t) steps before it
        o_t = tl.arange(0, W_PAD)
        m_t = o_t < WIDTH - 1
        back = (WIDTH - 2) - o_t  # distance from the accepted node, 0 for the newest column
        src = tl.load(ancestors_ptr + row * (WIDTH - 1) + tl.maximum(back - 1, 0), mask=m_t & (back > 0), other=0)
        src = tl.where(back == 0, row, src.to(tl.int64))
        in_tree = src >= 0
        from_tree = tl.load(x_ptr + src[:, None] * stride_x_n + o_c[None, :],
                            mask=(m_t & in_tree)[:, None] & m_c[None, :], other=0)
        from_state = tl.load(p_state[None, :] + ((WIDTH - 1) + src)[:, None],
                             mask=(m_t & ~in_tree)[:, None] & m_c[None, :], other=0)
        b_new = tl.where(in_tree[:, None], from_tree.to(tl.float32), from_state.to(tl.float32))
        tl.debug_barrier()  # every old column is read before any is overwritten
        tl.store(p_state[None, :] + o_t[:, None], b_new.to(conv_state_ptr.dtype.element_ty),
                 mask=m_t[:, None] & m_c[None, :])


def _check_pool(x, conv_state, state_indices, tree, validate, name, finite_x=False) -> tuple[int, int]:
    """Shared checks of the inputs, the conv-state pool and the slots; returns (channels, width).

    Value checks (slots, and with ``finite_x`` NaN or inf in x) cost one device-to-host copy together.
    """
    if not isinstance(tree, TreeBatch):
        raise TypeError(f"tree: expected a TreeBatch, got {type(tree).__name__}")
    for arg, t in ((name, x), ("conv_state", conv_state), ("state_indices", state_indices)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{arg}: expected a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 2 or x.shape[0] != tree.num_nodes:
        raise ValueError(f"{name}: expected shape [N={tree.num_nodes}, channels], got {tuple(x.shape)}")
    channels = x.shape[1]
    if conv_state.dim() != 3 or conv_state.shape[1] != channels or conv_state.shape[2] < 1:
        raise ValueError(f"conv_state: expected shape [num_slots, channels={channels}, width - 1], "
                         f"got {tuple(conv_state.shape)}")
    if tuple(state_indices.shape) != (tree.num_requests,):
        raise ValueError(f"state_indices: expected shape [B={tree.num_requests}], got {tuple(state_indices.shape)}")
    for arg, t in ((name, x), ("conv_state", conv_state)):
        if t.dtype not in INPUT_DTYPES:
            raise TypeError(f"{arg}: dtype {t.dtype}; expected bfloat16, float16 or float32")
    if state_indices.dtype not in INDEX_DTYPES:
        raise TypeError(f"state_indices: dtype {state_indices.dtype}; expected int32 or int64")
    for arg, t in (("conv_state", conv_state), ("state_indices", state_indices)):
        if t.device != x.device:
            raise ValueError(f"{arg}: on device {t.device} but {name} is on {x.device}")
    if tree.device.type != x.device.type:
        raise ValueError(f"tree: built for device {tree.device} but {name} is on {x.device}")
    if conv_state.stride(-1) != 1:
        raise ValueError("conv_state: the last (width) dimension must be contiguous; it is updated in place")
    if validation_enabled(validate):
        nan_check = [(~torch.isfinite(x).all(), f"{name}: contains NaN or inf")] if finite_x else []
        raise_first(nan_check + slot_checks(state_indices, conv_state.shape[0]))
    return channels, conv_state.shape[2] + 1


def tree_conv(x, conv_state, weight, state_indices, tree: TreeBatch, activation: str | None = "silu",
              validate: bool | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal depthwise convolution of every tree node over its ancestors (then the committed inputs).

    Args:
        x: ``[N, channels]`` the pre-convolution projections (q, k, v concatenated), any float dtype.
        conv_state: ``[num_slots, channels, width - 1]`` committed inputs, oldest first; never written here.
        weight: ``[channels, width]`` (transformers' ``conv1d.weight.squeeze(1)``).
        activation: "silu" (Qwen3.5) or None.
        out: optional ``[N, channels]`` contiguous buffer in x's dtype to write into.

    Returns:
        ``[N, channels]`` in x's dtype.
    """
    if isinstance(x, torch.Tensor) and x.is_cuda and (elsewhere := other_cuda_device(x)) is not None:
        with torch.cuda.device(elsewhere):  # Triton launches on the current device: make it the inputs'
            return tree_conv(x, conv_state, weight, state_indices, tree, activation, validate, out)
    if activation not in ("silu", None):
        raise ValueError(f"activation: expected 'silu' or None, got {activation!r}")
    channels, width = _check_pool(x, conv_state, state_indices, tree, validate, "x", finite_x=True)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight: expected a torch.Tensor, got {type(weight).__name__}")
    if tuple(weight.shape) != (channels, width):
        raise ValueError(f"weight: expected shape [channels={channels}, width={width}] (width = conv_state's "
                         f"last dimension + 1), got {tuple(weight.shape)}")
    if weight.dtype not in INPUT_DTYPES or weight.device != x.device:
        raise TypeError(f"weight: expected a bf16, fp16 or fp32 tensor on {x.device}, got {weight.dtype} on {weight.device}")
    if out is not None and (not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != x.dtype
                            or out.device != x.device or not out.is_contiguous()):
        raise ValueError(f"out: expected a contiguous {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}")
    if not use_triton(x.device):
        y = tree_conv_reference(x, conv_state, weight, state_indices, tree, activation)
        return out.copy_(y) if out is not None else y
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    state_indices = state_indices.contiguous()  # read by index (stride 1): a strided view is copied on the device
    y = out if out is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_n, block_c = 16, 128
    grid = (triton.cdiv(tree.num_nodes, block_n), triton.cdiv(channels, block_c))
    tree_conv_kernel[grid](
        x, weight, conv_state, state_indices, tree.ancestor_table(width - 1), tree.request_of_node(), y,
        tree.num_nodes, channels, x.stride(0), conv_state.stride(0), conv_state.stride(1), weight.stride(0), y.stride(0),
        WIDTH=width, BLOCK_N=block_n, BLOCK_C=block_c, APPLY_SILU=activation == "silu",
    )
    return y


def tree_conv_commit(conv_state, state_indices, x, tree: TreeBatch, accepted, validate: bool | None = None) -> None:
    """Write, per request, the last width - 1 inputs of the path to its accepted node (-1: untouched).

    ``x`` is the same pre-convolution input `tree_conv` read (``[N, channels]``).
    """
    if isinstance(x, torch.Tensor) and x.is_cuda and (elsewhere := other_cuda_device(x)) is not None:
        with torch.cuda.device(elsewhere):  # Triton launches on the current device: make it the inputs'
            return tree_conv_commit(conv_state, state_indices, x, tree, accepted, validate)
    channels, width = _check_pool(x, conv_state, state_indices, tree, validate, "x")
    if not isinstance(accepted, torch.Tensor):
        raise TypeError(f"accepted: expected a torch.Tensor, got {type(accepted).__name__}")
    if tuple(accepted.shape) != (tree.num_requests,) or accepted.dtype not in INDEX_DTYPES:
        raise ValueError(f"accepted: expected an int tensor of shape [B={tree.num_requests}], "
                         f"got {accepted.dtype} {tuple(accepted.shape)}")
    if validation_enabled(validate):
        sizes = (tree.offsets[1:] - tree.offsets[:-1]).to(accepted.dtype)
        if bool(((accepted < -1) | (accepted >= sizes)).any()):
            raise ValueError("accepted: has an entry out of range (expected -1 or a local node index)")
    if not use_triton(x.device):
        tree_conv_commit_reference(conv_state, state_indices, x, tree, accepted)
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    # read by index (stride 1): a strided view is copied on the device
    state_indices, accepted = state_indices.contiguous(), accepted.contiguous()
    block_c = 128
    grid = (tree.num_requests, triton.cdiv(channels, block_c))
    tree_conv_commit_kernel[grid](
        x, conv_state, state_indices, accepted, tree.offsets, tree.ancestor_table(width - 1),
        channels, x.stride(0), conv_state.stride(0), conv_state.stride(1),
        WIDTH=width, W_PAD=triton.next_power_of_2(width), BLOCK_C=block_c,
    )
