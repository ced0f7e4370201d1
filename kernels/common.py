"""What every kernel of the package shares: dtypes it takes, argument checks, and backend dispatch.

Validation has two levels. Shapes, dtypes, devices and the tree are checked on every call, on the host,
with no device work. Values (NaN or inf gates, slot indices out of range or repeated, accepted nodes out
of range) live on the device: checking them costs one device-to-host copy, which synchronises the
stream and cost 250-900 us of host time per call on the H200 (BENCHMARKS.md, "tree_commit" and "Cost of
the choice at runtime"), several times the kernels themselves at small batches. So they are checked only
when asked: ``validate=True``, or ``BOLE_TUNE_VALIDATE=1`` in the environment for every call of a process
(for example while an engine's integration is being brought up). Never inside a CUDA graph capture, where
a copy to the host is impossible. Without them an accepted node out of range leaves its slot as it is, and a
pending path's request or slot out of range (`PendingPaths`, `PendingPaths.between_rounds`) has nothing pending;
a slot index out of range is not caught (the kernels address the pool with it): the value checks are there for
that while an integration is brought up.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton.language as tl

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
L2_EPS = 1e-6
"""Added to the sum of squares before the square root of the q/k L2 norm (as the engines do)."""
LOG_DECAY_FLOOR = -30.0
"""Every log-decay below this is taken as this (-inf and -3e38 included): exp(-30) = 9.4e-14, a decay that
is zero to fp32 precision. The floor keeps path sums of g small, so their differences keep the small g
that follow a huge one (a root of g = -1e6 then g = -0.01: without it, -1e6 - 0.01 rounds to -1e6 in fp32
and the child's decay came out 1 instead of 0.99) and never overflow to -inf (g = -3e38 twice). Accepted
range of g: every value <= 0; exact to the verifier's tolerance against the float64 recurrence."""


_ENVIRON = getattr(os.environ, "_data", None)  # CPython's dict behind os.environ, kept in step with it
_VALIDATE_KEY = os.environ.encodekey("BOLE_TUNE_VALIDATE") if _ENVIRON is not None and hasattr(
    os.environ, "encodekey") else None


_cuda_get_device = getattr(torch._C, "_cuda_getDevice", None)


def other_cuda_device(x: torch.Tensor) -> torch.device | None:
    """``x``'s device where it is a CUDA device other than the current one, else None (``x`` a tensor).

    Triton launches a kernel on the current device, and the kept-binary launches (`launcher.FastLauncher`) pass
    bare addresses: a kernel launched on ``cuda:0`` with ``cuda:1``'s memory faults, or reads over the link where
    peer access is on. So each public call whose inputs live elsewhere runs itself again under
    ``torch.cuda.device`` of its inputs: an engine that keeps its tensors on ``cuda:1`` without
    ``torch.cuda.set_device(1)`` gets its answers, on that device's current stream."""
    if not x.is_cuda:
        return None
    current = _cuda_get_device() if _cuda_get_device is not None else torch.cuda.current_device()
    return x.device if x.get_device() != current else None


def on_device_of(x: torch.Tensor):
    """A context in which ``x``'s device is the current one (`other_cuda_device`): ``torch.cuda.device`` where it
    is another CUDA device, else one that does nothing. For the calls made once a round; a layer's calls test
    `other_cuda_device` themselves (no context object on their path)."""
    elsewhere = other_cuda_device(x)
    return torch.cuda.device(elsewhere) if elsewhere is not None else contextlib.nullcontext()


def validation_enabled(validate: bool | None) -> bool:
    """Resolve the ``validate`` argument against the environment and graph capture."""
    if validate is None:
        if _VALIDATE_KEY is not None and _ENVIRON.get(_VALIDATE_KEY) is None:
            return False  # unset, found without os.environ's own lookup (0.7 us: a call's host time counts)
        raw = os.environ.get("BOLE_TUNE_VALIDATE", "0")
        if raw == "0":  # the default, decided without parsing
            return False
        raw = raw.strip().lower()
        if raw in ("1", "true", "yes", "on"):
            validate = True
        elif raw in ("0", "false", "no", "off", ""):
            validate = False
        else:
            raise ValueError(f"BOLE_TUNE_VALIDATE: expected 1 or 0, got {raw!r}")
    if validate and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    return bool(validate)


def require_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")


def require_shape(name: str, x: torch.Tensor, expected: tuple, meaning: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {meaning} = {tuple(expected)}, got {tuple(x.shape)}")


def require_dim(name: str, x: torch.Tensor, dim: int, meaning: str) -> None:
    if x.dim() != dim:
        raise ValueError(f"{name}: expected a {dim}-D tensor {meaning}, got shape {tuple(x.shape)}")


def slot_checks(state_indices, num_slots, name: str = "state_indices") -> list:
    """Device-side checks that every request names its own slot of a pool of ``num_slots`` (``name``: the
    argument's, for the messages)."""
    if state_indices.numel() == 0:
        return []
    sorted_slots = torch.sort(state_indices.long()).values
    return [
        (sorted_slots[0] < 0, f"{name}: has a negative slot index"),
        (sorted_slots[-1] >= num_slots, f"{name}: has a slot index >= num_slots={num_slots}"),
        ((sorted_slots[1:] == sorted_slots[:-1]).any(),
         f"{name}: names a slot twice (each request needs its own slot)"),
    ]


def require_index_vector(name: str, x, device, length: int | None = None) -> None:
    """``x`` must be a 1-D int32 or int64 tensor on ``device`` (of ``length`` entries where given); raise naming
    it."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected an int32 or int64 tensor, got {type(x).__name__}")
    if x.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name}: dtype {x.dtype}; expected int32 or int64")
    if x.dim() != 1 or (length is not None and x.shape[0] != length):
        expected = f"[{length}]" if length is not None else "1-D"
        raise ValueError(f"{name}: expected shape {expected}, got {tuple(x.shape)}")
    if x.device != torch.device(device):
        raise ValueError(f"{name}: on device {x.device} but expected {device}")


def raise_first(checks) -> None:
    """Evaluate device-side checks with one copy to the host; raise the first that failed."""
    if not checks:
        return
    flags = torch.stack([flag for flag, _ in checks]).tolist()
    for flag, (_, message) in zip(flags, checks):
        if flag:
            raise ValueError(message() if callable(message) else message)


def use_triton(device: torch.device) -> bool:
    """Triton runs on CUDA devices, and on the CPU under ``TRITON_INTERPRET=1``."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"


def path_precision(choice: str, k_dtype: torch.dtype, otherwise: str) -> str:
    """The precision a path update's product runs in (`verify.blocks.path_product`): ``choice``, except that the
    "split" products (the values cut into exact tf32 pieces) need 16-bit keys (each an exact tf32 value), so fp32
    keys get ``otherwise``."""
    if choice.startswith("split") and k_dtype == torch.float32:
        return otherwise
    return choice


def dot_precision(dtype: torch.dtype) -> str:
    """tf32 tensor cores for 16-bit inputs; three tf32 passes (about fp32 accuracy) for fp32 inputs."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def gram_dtype(x: torch.Tensor):
    """Operand type of the q/k Gram products: the inputs' own on a GPU (bf16/fp16 tensor cores).

    Triton 3.6's CPU interpreter multiplies bf16 blocks as raw 16-bit integers, so there bf16 is
    widened to fp32 first (exact: every bf16 value is an fp32 value, and so is each product).
    """
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[x.dtype]


def token_head_strides(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Make the last dimension contiguous (a copy only if it is not) and return the other strides."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x, x.stride(0), x.stride(1)
