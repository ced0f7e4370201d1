"""Gate preparation from raw projections in one launch: ``g = -exp(A_log) * softplus(a + dt_bias)``,
``beta = sigmoid(b)`` (transformers' Qwen3.5 GatedDeltaNet), both written as float32.

Six separate PyTorch element-wise kernels become one read of a and b and one write of g and beta.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INPUT_DTYPES, other_cuda_device, use_triton, validation_enabled
from .launcher import FastLauncher, addresses


@triton.jit
def gdn_gates_kernel(
    # pointers
    a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr,
    # sizes and strides
    num_rows, heads, stride_a_n, stride_b_n,
    # meta-parameters
    BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
):
    i_n = tl.program_id(0).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_h = tl.arange(0, BLOCK_H)
    m = (o_n < num_rows)[:, None] & (o_h < heads)[None, :]
    b_a = tl.load(a_ptr + o_n[:, None] * stride_a_n + o_h[None, :], mask=m, other=0).to(tl.float32)
    b_b = tl.load(b_ptr + o_n[:, None] * stride_b_n + o_h[None, :], mask=m, other=0).to(tl.float32)
    a_log = tl.load(a_log_ptr + o_h, mask=o_h < heads, other=0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + o_h, mask=o_h < heads, other=0).to(tl.float32)
    z = b_a + dt_bias[None, :]
    # softplus with PyTorch's threshold: linear above 20, where log(1 + e^z) equals z in float32
    softplus = tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))
    tl.store(g_ptr + o_n[:, None] * heads + o_h[None, :], -tl.exp(a_log)[None, :] * softplus, mask=m)
    tl.store(beta_ptr + o_n[:, None] * heads + o_h[None, :], tl.sigmoid(b_b), mask=m)


GATES = FastLauncher(gdn_gates_kernel)
"""The gates kernel's launches: an eager call skips Triton's binder, which costs more host time than the rest of
the call (BENCHMARKS.md, "The host path")."""


def gdn_gates(a, b, a_log, dt_bias, validate: bool | None = None,
              out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``g`` and ``beta`` ``[N, Hv]`` float32 from the raw projections ``a``, ``b`` ``[N, Hv]`` and the
    per-head ``A_log``, ``dt_bias`` ``[Hv]``. ``out``: a ``(g, beta)`` pair of contiguous float32 ``[N, Hv]`` tensors
    on a's device to write into (reused across layers: no allocation per call), else new ones."""
    if isinstance(a, torch.Tensor) and a.is_cuda and (elsewhere := other_cuda_device(a)) is not None:
        with torch.cuda.device(elsewhere):  # Triton launches on the current device: make it the inputs'
            return gdn_gates(a, b, a_log, dt_bias, validate, out)
    if not _gates_fit(a, b, a_log, dt_bias):  # the common case in plain comparisons; else name what is wrong
        _explain_gates(a, b, a_log, dt_bias)
    if out is not None:
        _check_gates_out(out, a)
    if validation_enabled(validate):
        flags = torch.stack([~torch.isfinite(t).all() for t in (a, b, a_log, dt_bias)]).tolist()
        for flag, name in zip(flags, ("a", "b", "a_log", "dt_bias")):
            if flag:
                raise ValueError(f"{name}: contains NaN or inf (the gates would be NaN)")
    if not use_triton(a.device):
        g = -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())
        beta = torch.sigmoid(b.float())
        if out is None:
            return g, beta
        out[0].copy_(g)
        out[1].copy_(beta)
        return out
    if a.stride(1) != 1:
        a = a.contiguous()
    if b.stride(1) != 1:
        b = b.contiguous()
    a_log, dt_bias = a_log.contiguous(), dt_bias.contiguous()
    n, heads = a.shape
    if out is None:
        g = torch.empty(n, heads, dtype=torch.float32, device=a.device)
        beta = torch.empty_like(g)
    else:
        g, beta = out
    block_h, block_n = _blocks(heads)
    tensors = (a, b, a_log, dt_bias, g, beta)
    pointers, alignment = addresses(tensors)
    sizes = (n, heads, a.stride(0), b.stride(0))
    # keyed on what decides the binary (`FastLauncher.launch_keyed`): the dtypes, which tensors are misaligned,
    # every integer argument (Triton specialises on them) and the blocks they set
    key = (a.dtype, b.dtype, a_log.dtype, dt_bias.dtype, alignment, *sizes)
    GATES.launch_keyed(key, (-(-n // block_n),), (*pointers, *sizes), lambda: (*tensors, *sizes),
                       lambda: dict(BLOCK_N=block_n, BLOCK_H=block_h))
    return g, beta


def _check_gates_out(out, a) -> None:
    """``out`` must be two distinct contiguous float32 tensors of a's shape on a's device."""
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"out: expected a (g, beta) pair of tensors, got {type(out).__name__}")
    for name, x in zip(("out[0] (g)", "out[1] (beta)"), out):
        if not (isinstance(x, torch.Tensor) and x.shape == a.shape and x.dtype == torch.float32
                and x.device == a.device and x.is_contiguous()):
            raise ValueError(f"{name}: expected a contiguous float32 tensor of shape {tuple(a.shape)} on {a.device}, "
                             f"got {getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))} on "
                             f"{getattr(x, 'device', '-')}")
    if out[0].data_ptr() == out[1].data_ptr():
        raise ValueError("out: g and beta must be two tensors, not one")


def _gates_fit(a, b, a_log, dt_bias) -> bool:
    """Whether `_explain_gates` would pass, as plain comparisons (no error)."""
    tensor = torch.Tensor
    if not (isinstance(a, tensor) and isinstance(b, tensor) and isinstance(a_log, tensor)
            and isinstance(dt_bias, tensor)):
        return False
    shape, device = a.shape, a.device
    return (len(shape) == 2 and b.shape == shape and a_log.shape == shape[1:] and dt_bias.shape == shape[1:]
            and a.dtype in INPUT_DTYPES and b.dtype in INPUT_DTYPES and a_log.dtype in INPUT_DTYPES
            and dt_bias.dtype in INPUT_DTYPES and b.device == device and a_log.device == device
            and dt_bias.device == device)


def _explain_gates(a, b, a_log, dt_bias) -> None:
    """`gdn_gates`' argument checks one by one, raising with the argument's name."""
    for name, x in (("a", a), ("b", b), ("a_log", a_log), ("dt_bias", dt_bias)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in INPUT_DTYPES:
            raise TypeError(f"{name}: dtype {x.dtype}; expected bfloat16, float16 or float32")
        if x.device != a.device:
            raise ValueError(f"{name}: on device {x.device} but a is on {a.device}")
    if a.dim() != 2:
        raise ValueError(f"a: expected shape [N, Hv], got {tuple(a.shape)}")
    if tuple(b.shape) != tuple(a.shape):
        raise ValueError(f"b: expected shape {tuple(a.shape)} like a, got {tuple(b.shape)}")
    heads = a.shape[1]
    for name, x in (("a_log", a_log), ("dt_bias", dt_bias)):
        if tuple(x.shape) != (heads,):
            raise ValueError(f"{name}: expected shape [Hv={heads}], got {tuple(x.shape)}")


_BLOCKS: dict = {}


def _blocks(heads: int) -> tuple[int, int]:
    """``(BLOCK_H, BLOCK_N)``: the heads rounded up to a power of two, and rows a program so that a program holds
    about 4096 gates (at most 64 rows)."""
    blocks = _BLOCKS.get(heads)
    if blocks is None:
        block_h = triton.next_power_of_2(heads)
        blocks = _BLOCKS[heads] = (block_h, max(1, min(64, 4096 // block_h)))
    return blocks
