"""What the verifiers share: the result type, input validation and backend dispatch.

Validation has two levels. Shapes, dtypes and devices are checked on every call (host-side, no
device work). Values (NaN or inf gates, slot indices out of range or repeated, accepted nodes out of
range) need one device-to-host copy, so they are checked unless ``validate=False`` is passed, the
environment sets ``BOLE_TUNE_VALIDATE=0``, or a CUDA graph is being captured (where a copy to the
host is impossible). Engines that validated their integration turn them off on the hot path.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from bole_tune.config import SUPPORTED_HEAD_DIMS
from bole_tune.tree import TreeBatch

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass
class TreeVerifyResult:
    """Outputs of one verification call and the factors `tree_commit` needs.

    o: ``[N, Hv, dv]`` in v's dtype, every node's output.
    u: ``[N, Hv, dv]`` float32, the factorized updates ``U = (I + G)^-1 R``.
    log_decay: ``[N, Hv]`` float32, ``logP`` (path cumulative sum of g).
    k: ``[N, Hk, dk]`` in k's dtype, a copy of the raw keys (inputs may be reused before commit).
    k_scale: ``[N, Hk]`` float32, the factor that normalises each key (1 without L2 norm).
    tree: the trees verified.
    """

    o: torch.Tensor
    u: torch.Tensor
    log_decay: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor
    tree: TreeBatch

    def nbytes_per_node_head(self) -> float:
        """Bytes kept per node and value head until the commit (u, logP and the shared keys)."""
        n, hv, dv = self.u.shape
        hk, dk = self.k.shape[1:]
        keys = (dk * self.k.element_size() + 4) * hk / hv
        return dv * 4 + 4 + keys


@dataclass(frozen=True)
class VerifyShape:
    num_nodes: int
    num_requests: int
    num_slots: int
    hk: int
    hv: int
    dk: int
    dv: int
    scale: float


def validation_enabled(validate: bool | None) -> bool:
    """Resolve the ``validate`` argument against the environment and graph capture."""
    if validate is None:
        raw = os.environ.get("BOLE_TUNE_VALIDATE", "1").strip().lower()
        if raw in ("1", "true", "yes", "on", ""):
            validate = True
        elif raw in ("0", "false", "no", "off"):
            validate = False
        else:
            raise ValueError(f"BOLE_TUNE_VALIDATE: expected 1 or 0, got {raw!r}")
    if validate and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    return bool(validate)


def _require_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")


def _require_shape(name: str, x: torch.Tensor, expected: tuple, meaning: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {meaning} = {tuple(expected)}, got {tuple(x.shape)}")


def _require_dim(name: str, x: torch.Tensor, dim: int, meaning: str) -> None:
    if x.dim() != dim:
        raise ValueError(f"{name}: expected a {dim}-D tensor {meaning}, got shape {tuple(x.shape)}")


def check_verify_inputs(q, k, v, g, beta, state, state_indices, tree, scale, validate) -> VerifyShape:
    """Check the arguments of `tree_verify` / `serial_verify`; raise naming the bad one."""
    if not isinstance(tree, TreeBatch):
        raise TypeError(f"tree: expected a TreeBatch (TreeBatch.from_parents), got {type(tree).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state),
                    ("state_indices", state_indices)):
        _require_tensor(name, x)
    _require_dim("q", q, 3, "[N, Hk, dk]")
    _require_dim("k", k, 3, "[N, Hk, dk]")
    _require_dim("v", v, 3, "[N, Hv, dv]")
    _require_dim("state", state, 4, "[num_slots, Hv, dv, dk]")
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if n != tree.num_nodes:
        raise ValueError(f"q: has {n} rows but the tree has {tree.num_nodes} nodes (q: [N, Hk, dk])")
    _require_shape("k", k, (n, hk, dk), "[N, Hk, dk] like q")
    if v.shape[0] != n:
        raise ValueError(f"v: has {v.shape[0]} rows but the tree has {n} nodes (v: [N, Hv, dv])")
    if hk == 0 or hv % hk != 0:
        raise ValueError(f"v: value heads Hv={hv} must be a positive multiple of key heads Hk={hk}")
    _require_shape("g", g, (n, hv), "[N, Hv]")
    _require_shape("beta", beta, (n, hv), "[N, Hv]")
    _require_shape("state", state, (state.shape[0], hv, dv, dk), "[num_slots, Hv, dv, dk]")
    _require_shape("state_indices", state_indices, (tree.num_requests,), "[B] (one slot per request)")
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
    if validation_enabled(validate):
        _check_values(g, beta, state_indices, state.shape[0])
    return VerifyShape(n, tree.num_requests, state.shape[0], hk, hv, dk, dv, float(scale))


def slot_checks(state_indices, num_slots) -> list:
    sorted_slots = torch.sort(state_indices.long()).values
    return [
        (sorted_slots[0] < 0, "state_indices: has a negative slot index"),
        (sorted_slots[-1] >= num_slots, f"state_indices: has a slot index >= num_slots={num_slots}"),
        ((sorted_slots[1:] == sorted_slots[:-1]).any(),
         "state_indices: names a slot twice (each request needs its own slot)"),
    ]


def raise_first(checks) -> None:
    """Evaluate device-side checks with one copy to the host; raise the first that failed."""
    flags = torch.stack([flag for flag, _ in checks]).tolist()
    for flag, (_, message) in zip(flags, checks):
        if flag:
            raise ValueError(message() if callable(message) else message)


def _check_values(g, beta, state_indices, num_slots) -> None:
    raise_first([
        (~torch.isfinite(g).all(), "g: contains NaN or inf (the log-decay must be finite)"),
        ((g > 0).any(), "g: has positive entries (g is a log-decay and must be <= 0)"),
        (~torch.isfinite(beta).all(), "beta: contains NaN or inf"),
        (((beta < 0) | (beta > 1)).any(), "beta: has entries outside [0, 1]"),
        *slot_checks(state_indices, num_slots),
    ])


def check_commit_inputs(state, state_indices, result, accepted, validate) -> None:
    """Check the arguments of `tree_commit`; raise naming the bad one."""
    if not isinstance(result, TreeVerifyResult):
        raise TypeError(f"res: expected the TreeVerifyResult of tree_verify/serial_verify, got {type(result).__name__}")
    for name, x in (("state", state), ("state_indices", state_indices), ("accepted", accepted)):
        _require_tensor(name, x)
    tree = result.tree
    n, hv, dv = result.u.shape
    dk = result.k.shape[2]
    _require_dim("state", state, 4, "[num_slots, Hv, dv, dk]")
    _require_shape("state", state, (state.shape[0], hv, dv, dk), "[num_slots, Hv, dv, dk] as verified")
    if state.dtype != torch.float32:
        raise TypeError(f"state: dtype {state.dtype}; the state pool must be float32")
    if state.stride(-1) != 1:
        raise ValueError("state: the last (dk) dimension must be contiguous (stride 1); the pool is updated in place")
    _require_shape("state_indices", state_indices, (tree.num_requests,), "[B] (one slot per request)")
    _require_shape("accepted", accepted, (tree.num_requests,), "[B] (one node per request)")
    for name, x in (("state_indices", state_indices), ("accepted", accepted)):
        if x.dtype not in INDEX_DTYPES:
            raise TypeError(f"{name}: dtype {x.dtype}; expected int32 or int64")
        if x.device != result.u.device:
            raise ValueError(f"{name}: on device {x.device} but the verification result is on {result.u.device}")
    if state.device != result.u.device:
        raise ValueError(f"state: on device {state.device} but the verification result is on {result.u.device}")
    if validation_enabled(validate):
        sizes = (tree.offsets[1:] - tree.offsets[:-1]).to(accepted.dtype)
        out_of_range = (accepted < -1) | (accepted >= sizes)
        raise_first([
            *slot_checks(state_indices, state.shape[0]),
            (out_of_range.any(), lambda: _accepted_message(accepted, out_of_range, tree)),
        ])


def _accepted_message(accepted, out_of_range, tree) -> str:
    r = int(out_of_range.nonzero()[0, 0])
    return (f"accepted[{r}]={int(accepted[r])} is out of range for request {r} with {tree.sizes[r]} nodes "
            "(expected -1 or a local node index)")


def result_buffers(shape: VerifyShape, dtype: torch.dtype, device, tree: TreeBatch,
                   out: TreeVerifyResult | None) -> TreeVerifyResult:
    """Fresh output buffers, or ``out`` (for example reused across layers) after checking it fits."""
    expected = {
        "o": ((shape.num_nodes, shape.hv, shape.dv), dtype),
        "u": ((shape.num_nodes, shape.hv, shape.dv), torch.float32),
        "log_decay": ((shape.num_nodes, shape.hv), torch.float32),
        "k": ((shape.num_nodes, shape.hk, shape.dk), dtype),
        "k_scale": ((shape.num_nodes, shape.hk), torch.float32),
    }
    if out is None:
        buffers = {name: torch.empty(size, dtype=dt, device=device) for name, (size, dt) in expected.items()}
        return TreeVerifyResult(tree=tree, **buffers)
    if not isinstance(out, TreeVerifyResult):
        raise TypeError(f"out: expected a TreeVerifyResult to write into, got {type(out).__name__}")
    for name, (size, dt) in expected.items():
        x = getattr(out, name)
        if tuple(x.shape) != size or x.dtype != dt or x.device != torch.device(device) or not x.is_contiguous():
            raise ValueError(f"out.{name}: expected a contiguous {dt} tensor of shape {size} on {device}, "
                             f"got {x.dtype} {tuple(x.shape)} on {x.device}")
    out.tree = tree
    return out


def use_triton(device: torch.device) -> bool:
    """Triton runs on CUDA devices, and on the CPU under ``TRITON_INTERPRET=1``."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    """tf32 tensor cores for 16-bit inputs; three tf32 passes (about fp32 accuracy) for fp32 inputs."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def state_split(dtype: torch.dtype, node_block: int) -> bool:
    """Whether the resident kernel's state products take S_pre as two bf16 parts (``hi + lo``).

    For bf16 inputs on trees of more than 32 nodes (``node_block`` 64): 16 significant bits of S_pre
    (tf32 keeps 11) times the bf16 q/k tiles as they are. On the H200 (`scripts/kernel_lab.py --split`
    and re-tunes, BENCHMARKS.md) that made T=64 3-10% faster (9B B=16: 61.8 against 64.0 us; 122B B=16:
    117.8 against 129.0) and the outputs, where the state predicts v, 2.5x more accurate (5.7e-4 against
    1.4e-3); on smaller trees it was mixed (27B T32-B16 best 47.9 against 43.1 us, 9B T16-B16 20.5
    against 19.5), so they keep one tf32 product, as does the fused kernel (up to 47% slower with the
    split, and Triton 3.6 miscompiled its 32/32/8/3 config: 1.3e-2). fp16 inputs keep tf32 (an fp16
    part would overflow past 65504), fp32 inputs tf32x3.
    """
    return dtype == torch.bfloat16 and node_block >= 64


# deepest tree whose fp16 level sweeps stay in range: partial sums up to 2^(depth - 1) = 2048
SWEEP_F16_MAX_DEPTH = 12


def sweep_f16(dtype: torch.dtype, use_qk_l2norm: bool, depth: int, scale: float) -> bool:
    """Whether the resident kernel's level sweeps ``X <- I - G X`` and ``M = C X`` take fp16 operands.

    fp16 keeps tf32's 11 significant bits at twice its tensor-core rate; what it lacks is range. With
    L2-normalised keys (and beta in [0, 1], which validation checks) ``|G_ij| = beta_i * decay *
    |cos(k_i, k_j)| <= 1`` and ``|C_ij| <= scale``. The exact entries of ``X = (I + G)^-1`` are at most
    1 (for j on the path to i, ``X_ij = -beta_i * decay * k_i^T H ... H k_j`` over the nodes between them,
    each ``H = I - beta k k^T`` a contraction), but after ``s`` sweeps a row deeper than ``s`` holds a
    partial Neumann sum: a sum over chains of ancestors, at most ``2^(d - 1)`` in magnitude for a tree
    of depth ``d`` (binomially many chains, as for a chain of nearly equal keys). So fp16 is taken for
    trees of depth at most `SWEEP_F16_MAX_DEPTH` (12: 2048, the drafters' trees are 8 deep) and
    ``scale <= 256``; deeper trees, raw keys and fp32 inputs keep tf32 (tf32x3 for fp32). A guard in the
    kernel instead (clamping those rows) cost more than fp16 saves. On the H200 (9B, `scripts/kernel_lab.py
    --resident-cand`, BENCHMARKS.md): 5-8% faster at 64-node trees (B=16: 57.0 against 60.5 us; B=32:
    109.4 against 119.0; 27B B=16: 82.4 against 88.4), the same at 16 nodes, errors unchanged.
    """
    return (dtype in (torch.bfloat16, torch.float16) and bool(use_qk_l2norm) and depth <= SWEEP_F16_MAX_DEPTH
            and scale <= 256.0)


def gram_dtype(x: torch.Tensor):
    """Operand type of the q/k Gram products: the inputs' own on a GPU (bf16/fp16 tensor cores).

    Triton 3.6's CPU interpreter multiplies bf16 blocks as raw 16-bit integers, so there bf16 is
    widened to fp32 first (exact: every bf16 value is an fp32 value, and so is each product).
    """
    import triton.language as tl

    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[x.dtype]


def token_head_strides(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Make the last dimension contiguous (a copy only if it is not) and return the other strides."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x, x.stride(0), x.stride(1)
