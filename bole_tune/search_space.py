"""The tuner's search space (``profiles/search_space.yaml``) and the pruning done before compiling."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path

from bole_tune.config import KernelConfig, node_block
from bole_tune.profiles import PROFILES_DIR, Fields, ProfileError, read_yaml
from bole_tune.shapes import torch_dtype

DEFAULT_SHARED_MEMORY = 227 * 1024  # bytes per block on sm_90 when the device does not say


@dataclass(frozen=True)
class SearchSpace:
    """The candidate values of every knob of `KernelConfig` (``values``, in `KernelConfig.knobs` order)."""

    values: dict  # knob name -> tuple of candidate values, sorted
    source: str = ""

    @classmethod
    def load(cls, path=None) -> "SearchSpace":
        path = Path(path) if path else PROFILES_DIR / "search_space.yaml"
        f = Fields(read_yaml(path), path)
        knobs = KernelConfig.knobs()
        f.reject_unknown(set(knobs))
        values = {}
        for name in knobs:
            items = f.get(name, list)
            if not items:
                raise ProfileError(f"{path}: {name}: the list is empty")
            for item in items:
                if isinstance(item, bool) or not isinstance(item, int) or item <= 0:
                    raise ProfileError(f"{path}: {name}: expected positive ints, got {item!r}")
            values[name] = tuple(sorted(set(items)))
        space = cls(values, source=str(path))
        try:
            space.configs()
        except ValueError as error:
            raise ProfileError(f"{path}: {error}") from None
        return space

    def configs(self) -> list[KernelConfig]:
        """Every combination of the knobs' values."""
        names = list(self.values)
        return [KernelConfig(**dict(zip(names, combo))) for combo in itertools.product(*self.values.values())]

    @property
    def size(self) -> int:
        """How many configs the space holds (every combination of the knobs' values)."""
        return math.prod(len(values) for values in self.values.values())

    def check_trials(self, n_trials: int) -> int:
        """``n_trials`` if a study of this space can use that many: each config is measured once at most
        (a repeat is answered from the first measurement), so more trials than configs only spin."""
        if n_trials > self.size:
            raise ValueError(f"--trials: {n_trials} is more than the {self.size} configs of the search space "
                             f"({self.source or 'search_space.yaml'}); a bucket measures each config once at most")
        return n_trials

    def contains(self, config: KernelConfig) -> bool:
        return all(getattr(config, name) in values for name, values in self.values.items())


def shared_memory_estimate(config: KernelConfig, tree_size: int, dtype: str) -> int:
    """Bytes of shared memory a tree_verify program needs, by the operands Triton stages there.

    The dk loop's q, k and state chunks are buffered ``num_stages`` deep; the dot products stage one
    ``[B_T, max(B_T, b_v)]`` fp32 operand pair for layout changes.
    """
    b_t = node_block(tree_size)
    per_stage = 2 * b_t * config.b_k * torch_dtype(dtype).itemsize + config.b_v * config.b_k * 4
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
