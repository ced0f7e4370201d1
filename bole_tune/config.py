"""Tile configurations of the Bole verifier and its commit, and the rules that make one valid for a shape.

`KernelConfig`'s fields are the tuning knobs of `tree_verify`, `CommitConfig`'s those of `tree_commit` and
`tree_commit_layers`. The tuner, the search space, the worker job files, the database and the recordings all
take the knobs from ``knobs()``, so adding one touches the class, ``profiles/search_space.yaml`` and the
kernel only.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import asdict, dataclass, fields

from bole_tune.shapes import SUPPORTED_HEAD_DIMS

__all__ = ["COMMIT_FALLBACK_PROGRAMS", "CommitConfig", "KernelConfig", "SUPPORTED_HEAD_DIMS", "default_commit_config",
           "default_config", "node_block"]


def _tile(owner: str, name: str, value, least: int = 16) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least or value & (value - 1):
        raise ValueError(f"{owner}.{name}: expected a power of two >= {least}, got {value!r}")


def _launch_knobs(owner: str, num_warps, num_stages) -> None:
    if num_warps not in (1, 2, 4, 8, 16) or isinstance(num_warps, bool):
        raise ValueError(f"{owner}.num_warps: expected one of 1, 2, 4, 8, 16, got {num_warps!r}")
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or not 1 <= num_stages <= 8:
        raise ValueError(f"{owner}.num_stages: expected an int in 1..8, got {num_stages!r}")


class _Knobs:
    """What every tile config shares: its knobs by name, read from a mapping or a ``"a/b/c"`` text."""

    REQUIRED: tuple[str, ...] = ()  # knobs without a default: from_dict needs them
    SWITCHES: tuple[str, ...] = ()  # on (1) / off (0) knobs, last, added after the tiles: off where a text or a
    # search space written before them leaves them out

    @classmethod
    def knobs(cls) -> tuple[str, ...]:
        """The tuning knobs, in declaration order (the order of `text` and of the search space)."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_dict(cls, data: dict):
        """From ``{knob: value}``; an unknown or missing knob is a ValueError naming it."""
        if not isinstance(data, dict):
            raise ValueError(f"expected a mapping of {', '.join(cls.knobs())}, got {data!r}")
        unknown = sorted(set(data) - set(cls.knobs()))
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown knob (known: {', '.join(cls.knobs())})")
        missing = [k for k in cls.REQUIRED if k not in data]
        if missing:
            raise ValueError(f"{missing[0]}: missing")
        return cls(**data)

    @classmethod
    def from_text(cls, text: str):
        """The inverse of `text` (``"64/32/4/2"``); the trailing ``SWITCHES`` may be left out (a text written
        before they existed)."""
        parts, most = text.split("/"), len(cls.knobs())
        least = most - len(cls.SWITCHES)
        if not least <= len(parts) <= most:
            extra = f" ({most} with {', '.join(cls.SWITCHES)})" if cls.SWITCHES else ""
            raise ValueError(f"config {text!r}: expected {least} values{extra} separated by '/'")
        try:
            return cls(*(int(p) for p in parts))
        except ValueError as error:
            raise ValueError(f"config {text!r}: {error}") from None

    @property
    def text(self) -> str:
        """The knob values joined by '/', in `knobs` order: how recordings and studies name a config."""
        return "/".join(str(getattr(self, k)) for k in self.knobs())

    def knob_values(self) -> dict:
        """Every knob's value, switches included (what a study's trial holds)."""
        return asdict(self)

    def as_dict(self) -> dict:
        """The config as files write it (`knob_values`; a subclass may leave a switch out where it is off)."""
        return asdict(self)


@dataclass(frozen=True)
class KernelConfig(_Knobs):
    """One launch configuration of `tree_verify`.

    b_k: width of the key-dimension chunks the state products walk (divides dk).
    b_v: value columns per program (divides dv); a request's head runs ``dv / b_v`` programs.
    num_warps, num_stages: Triton launch parameters.
    gluon: 1 to run the Gluon verify (`kernels/verify/gluon.py`: sm_90, bf16 resident launches of 33-64-node
    trees) with these tiles, where the launch can (`kernels.verify.gluon.tile_refusal` names the tiles it takes:
    b_k and b_v of 32 or 64, 4 warps, ``num_stages`` 1 or 2 state tiles in flight); elsewhere the Triton kernels
    run the same tiles. 0: the Triton kernels.
    """

    b_k: int
    b_v: int
    num_warps: int = 4
    num_stages: int = 2
    gluon: int = 0

    REQUIRED = ("b_k", "b_v")
    SWITCHES = ("gluon",)

    def __post_init__(self):
        for name in ("b_k", "b_v"):
            _tile("KernelConfig", name, getattr(self, name))
        _launch_knobs("KernelConfig", self.num_warps, self.num_stages)
        if self.gluon not in (0, 1) or isinstance(self.gluon, bool):
            raise ValueError(f"KernelConfig.gluon: expected 0 (the Triton kernels) or 1 (the Gluon verify), "
                             f"got {self.gluon!r}")

    @property
    def text(self) -> str:
        """``"b_k/b_v/warps/stages"``, with ``"/1"`` after it for a Gluon config (a Triton config keeps the
        four-value text it had before the ``gluon`` knob, so recordings and studies that name one still match)."""
        text = f"{self.b_k}/{self.b_v}/{self.num_warps}/{self.num_stages}"
        return f"{text}/1" if self.gluon else text

    def as_dict(self) -> dict:
        """``{b_k, b_v, num_warps, num_stages}``, with ``gluon: 1`` for a Gluon config: a Triton config is written as
        it was before the knob, so entries and curve points that hold one still match."""
        data = asdict(self)
        if not self.gluon:
            del data["gluon"]
        return data

    def replace(self, **changes) -> "KernelConfig":
        """A copy with some knobs changed."""
        return dataclasses.replace(self, **changes)

    def fits(self, dk: int, dv: int) -> bool:
        """Whether the tiles divide the head dimensions."""
        return self.b_k <= dk and dk % self.b_k == 0 and self.b_v <= dv and dv % self.b_v == 0

    def __str__(self) -> str:
        return (f"b_k={self.b_k} b_v={self.b_v} warps={self.num_warps} stages={self.num_stages}"
                f"{' gluon' if self.gluon else ''}")


@dataclass(frozen=True)
class CommitConfig(_Knobs):
    """One launch configuration of `tree_commit` and `tree_commit_layers` (docs/math.md §4).

    Each program owns ``v_span`` rows and ``b_k`` columns of one head's state in one slot (and one layer)
    and streams them in ``[b_v, b_k]`` tiles, each read once and written once, ``num_stages`` tiles in
    flight; a launch has ``layers x requests x Hv x (dv / v_span) x (dk / b_k)`` programs.

    b_k: state columns per program (divides dk). b_v: rows per streamed tile (divides v_span).
    v_span: rows per program (divides dv). num_warps, num_stages: Triton launch parameters.
    tma: 1 to read the state tiles by TMA (a tensor descriptor over the pool: bulk copies into shared memory,
    ``num_stages`` of them in flight, the tiles' updates written back by pointers), 0 by per-thread pointer loads.
    A TMA launch needs an sm_90+ GPU and a contiguous, 16-byte aligned pool; elsewhere it reads by pointers
    (`tree_commit.tma_state_loads`), with the same result.
    """

    b_k: int
    b_v: int
    v_span: int
    num_warps: int = 2
    num_stages: int = 3
    tma: int = 0

    REQUIRED = ("b_k", "b_v", "v_span")
    SWITCHES = ("tma",)

    def __post_init__(self):
        for name in ("b_k", "b_v", "v_span"):
            _tile("CommitConfig", name, getattr(self, name))
        if self.b_v > self.v_span:
            raise ValueError(f"CommitConfig.b_v: expected at most v_span ({self.v_span}): a program streams its "
                             f"v_span rows in tiles of b_v, got {self.b_v!r}")
        _launch_knobs("CommitConfig", self.num_warps, self.num_stages)
        if self.tma not in (0, 1) or isinstance(self.tma, bool):
            raise ValueError(f"CommitConfig.tma: expected 0 (pointer loads) or 1 (TMA loads), got {self.tma!r}")

    @property
    def text(self) -> str:
        """``"b_k/b_v/v_span/warps/stages"``, with ``"/1"`` after it for a TMA launch (a pointer launch keeps the
        five-value text it had before the ``tma`` knob, so recordings and studies that name one still match)."""
        text = f"{self.b_k}/{self.b_v}/{self.v_span}/{self.num_warps}/{self.num_stages}"
        return f"{text}/1" if self.tma else text

    def fits(self, dk: int, dv: int) -> bool:
        """Whether the tiles divide the head dimensions (b_k divides dk, v_span divides dv)."""
        return self.b_k <= dk and dk % self.b_k == 0 and self.v_span <= dv and dv % self.v_span == 0

    def programs(self, dk: int, dv: int) -> int:
        """Programs per (layer, request, value head): the tiles of one head's ``[dv, dk]`` state."""
        return (dk // self.b_k) * (dv // self.v_span)

    def __str__(self) -> str:
        return (f"b_k={self.b_k} b_v={self.b_v} v_span={self.v_span} warps={self.num_warps} "
                f"stages={self.num_stages}{' tma' if self.tma else ''}")


def default_config(dk: int, dv: int) -> KernelConfig:
    """A sound configuration for any supported shape, used when nothing better is known."""
    return KernelConfig(b_k=min(64, dk), b_v=min(32, dv), num_warps=4, num_stages=2)


COMMIT_FALLBACK_PROGRAMS = 264
"""The untuned commit fallback's target: programs per launch below which it narrows the tiles (264 is two
per SM of an H200, where fewer left the copy latency-bound: BENCHMARKS.md, "tree_commit")."""


@functools.lru_cache(maxsize=4096)
def default_commit_config(programs_per_tile: int, dk: int, dv: int) -> CommitConfig:
    """The *untuned fallback* of the commit: what `tree_commit` / `tree_commit_layers` launch where the tuning
    database has no entry for the shape (and off a GPU). Not a tuned value: a rule measured once on the H200.

    ``programs_per_tile``: layers x requests x value heads of the launch. The widest tiles (columns ``b_k``
    up to 128, rows per program ``v_span`` up to 128) that still give at least `COMMIT_FALLBACK_PROGRAMS`
    programs, halving the span first (down to 16 rows), then the columns (down to 32); ``b_v`` 16, 2 warps,
    3 stages.
    """
    b_k, v_span = min(128, dk), min(128, dv)
    while programs_per_tile * (dk // b_k) * (dv // v_span) < COMMIT_FALLBACK_PROGRAMS:
        if v_span > 16:
            v_span //= 2
        elif b_k > 32:
            b_k //= 2
        else:
            break
    return CommitConfig(b_k=b_k, b_v=min(16, v_span), v_span=v_span, num_warps=2, num_stages=3)


def node_block(max_tree_size: int) -> int:
    """Rows of the tree the verifier solves together: the padded tree size, between 16 and 64.

    Trees up to 64 nodes are solved in one block (no sequential dependence between blocks); larger
    trees walk 64-row blocks in order, each reusing the already solved rows of earlier blocks.
    """
    block = 16
    while block < max_tree_size and block < 64:
        block *= 2
    return block


RING_ROUNDS = 4
"""The rounds a `PendingRing` keeps pending in `bole-tune bench`'s ring rows: the best of 4 and 8 for B=16 4-node
chains in `lab/ring_after.py` (a read round's corrections grow with the tokens held; BENCHMARKS.md)."""

SHORT_RING_ROUNDS = 2
"""A shorter ring `bole-tune step` also times (its ``"ring of 2"`` round): its tables are half as wide, so its read
rounds are cheaper and its write rounds twice as frequent; on the H200 it wins where the paths are long and the batch
large (9B B=32 8-node chains: 52.2 against 54.2 us per layer and round; B=32 4-node chains: 50.7 against 43.8)."""
