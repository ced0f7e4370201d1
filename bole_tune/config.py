"""Tile configurations of the Bole verifier and the rules that make one valid for a shape.

`KernelConfig`'s fields are the tuning knobs. The tuner, the search space, the worker job files,
the database and the recordings all take the knobs from `KernelConfig.knobs()`, so adding one
touches this class, ``profiles/search_space.yaml`` and the kernel only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from bole_tune.shapes import SUPPORTED_HEAD_DIMS

__all__ = ["KernelConfig", "SUPPORTED_HEAD_DIMS", "default_config", "node_block"]


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration of `tree_verify`.

    b_k: width of the key-dimension chunks the state products walk (divides dk).
    b_v: value columns per program (divides dv); a request's head runs ``dv / b_v`` programs.
    num_warps, num_stages: Triton launch parameters.
    """

    b_k: int
    b_v: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("b_k", "b_v"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name}: expected a power of two >= 16, got {value!r}")
        if self.num_warps not in (1, 2, 4, 8, 16) or isinstance(self.num_warps, bool):
            raise ValueError(f"KernelConfig.num_warps: expected one of 1, 2, 4, 8, 16, got {self.num_warps!r}")
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"KernelConfig.num_stages: expected an int in 1..8, got {self.num_stages!r}")

    @classmethod
    def knobs(cls) -> tuple[str, ...]:
        """The tuning knobs, in declaration order (the order of `text` and of the search space)."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_dict(cls, data: dict) -> "KernelConfig":
        """From ``{knob: value}``; an unknown or missing knob is a ValueError naming it."""
        if not isinstance(data, dict):
            raise ValueError(f"expected a mapping of {', '.join(cls.knobs())}, got {data!r}")
        unknown = sorted(set(data) - set(cls.knobs()))
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown knob (known: {', '.join(cls.knobs())})")
        missing = [k for k in ("b_k", "b_v") if k not in data]
        if missing:
            raise ValueError(f"{missing[0]}: missing")
        return cls(**data)

    @classmethod
    def from_text(cls, text: str) -> "KernelConfig":
        """The inverse of `text` (``"64/32/4/2"``)."""
        parts = text.split("/")
        if len(parts) != len(cls.knobs()):
            raise ValueError(f"config {text!r}: expected {len(cls.knobs())} values separated by '/'")
        try:
            return cls(*(int(p) for p in parts))
        except ValueError as error:
            raise ValueError(f"config {text!r}: {error}") from None

    @property
    def text(self) -> str:
        """The knob values joined by '/', in `knobs` order: how recordings and studies name a config."""
        return "/".join(str(getattr(self, k)) for k in self.knobs())

    def fits(self, dk: int, dv: int) -> bool:
        """Whether the tiles divide the head dimensions."""
        return self.b_k <= dk and dk % self.b_k == 0 and self.b_v <= dv and dv % self.b_v == 0

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"b_k={self.b_k} b_v={self.b_v} warps={self.num_warps} stages={self.num_stages}"


def default_config(dk: int, dv: int) -> KernelConfig:
    """A sound configuration for any supported shape, used when nothing better is known."""
    return KernelConfig(b_k=min(64, dk), b_v=min(32, dv), num_warps=4, num_stages=2)


def node_block(max_tree_size: int) -> int:
    """Rows of the tree the verifier solves together: the padded tree size, between 16 and 64.

    Trees up to 64 nodes are solved in one block (no sequential dependence between blocks); larger
    trees walk 64-row blocks in order, each reusing the already solved rows of earlier blocks.
    """
    block = 16
    while block < max_tree_size and block < 64:
        block *= 2
    return block
