"""The tuner's search space (``profiles/search_space.yaml``) and the pruning done before compiling."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from bole_tune.config import KernelConfig, node_block
from bole_tune.profiles import PROFILES_DIR, Fields, ProfileError, read_yaml

DEFAULT_SHARED_MEMORY = 227 * 1024  # bytes per block on sm_90 when the device does not say
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class SearchSpace:
    b_k: tuple[int, ...]
    b_v: tuple[int, ...]
    num_warps: tuple[int, ...]
    num_stages: tuple[int, ...]
    source: str = ""

    @classmethod
    def load(cls, path=None) -> "SearchSpace":
        path = Path(path) if path else PROFILES_DIR / "search_space.yaml"
        f = Fields(read_yaml(path), path)
        f.reject_unknown({"b_k", "b_v", "num_warps", "num_stages"})
        values = {}
        for name in ("b_k", "b_v", "num_warps", "num_stages"):
            items = f.get(name, list)
            if not items:
                raise ProfileError(f"{path}: {name}: the list is empty")
            for item in items:
                if isinstance(item, bool) or not isinstance(item, int) or item <= 0:
                    raise ProfileError(f"{path}: {name}: expected positive ints, got {item!r}")
            values[name] = tuple(sorted(set(items)))
        try:
            for combo in itertools.product(*values.values()):
                KernelConfig(*combo)
        except ValueError as error:
            raise ProfileError(f"{path}: {error}") from None
        return cls(**values, source=str(path))

    def configs(self) -> list[KernelConfig]:
        return [KernelConfig(*c) for c in itertools.product(self.b_k, self.b_v, self.num_warps, self.num_stages)]

    def params(self, config: KernelConfig) -> dict:
        return config.as_dict()


def shared_memory_estimate(config: KernelConfig, tree_size: int, dtype: str) -> int:
    """Bytes of shared memory a tree_verify program needs, by the operands Triton stages there.

    The dk loop's q, k and state chunks are buffered ``num_stages`` deep; the dot products stage one
    ``[B_T, max(B_T, b_v)]`` fp32 operand pair for layout changes.
    """
    b_t = node_block(tree_size)
    per_stage = 2 * b_t * config.b_k * DTYPE_BYTES[dtype] + config.b_v * config.b_k * 4
    staging = 2 * b_t * max(b_t, config.b_v) * 4
    return config.num_stages * per_stage + staging


def feasible(config: KernelConfig, dk: int, dv: int, tree_size: int, dtype: str,
             shared_memory_limit: int | None = None) -> tuple[bool, str]:
    """Whether ``config`` can run on this shape and device; the reason when it cannot."""
    if not config.fits(dk, dv):
        return False, f"tiles b_k={config.b_k}, b_v={config.b_v} do not divide dk={dk}, dv={dv}"
    need = shared_memory_estimate(config, tree_size, dtype)
    limit = shared_memory_limit or DEFAULT_SHARED_MEMORY
    if need > limit:
        return False, f"needs about {need // 1024} KiB of shared memory, the device has {limit // 1024} KiB"
    return True, ""
