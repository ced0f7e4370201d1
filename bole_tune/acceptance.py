"""Acceptance models (``profiles/acceptance/*.yaml``) and their calibration from logs of real rounds.

A model gives, for a draft node at depth d (1 = first draft position) whose rank among its siblings
is k (1 = the drafter's top choice), the probability that the target accepts it given that its
parent was accepted: ``depth_acceptance[d] * rank_share[k]``. The ranks of one parent exclude each
other (the target picks one token), so ``depth_acceptance[d] * sum(rank_share) <= 1``.

Log format for `calibrate` (JSON Lines, one object per request and round)::

    {"parents": [-1, 0, 0, 1], "ranks": [1, 1, 2, 1], "accepted": [0, 1, 3]}

``parents``: local parent of each draft node (-1: it hangs off the committed token), parent before
child. ``ranks``: the node's rank among its siblings (1 = top). ``accepted``: the accepted draft nodes
(a path from a root, possibly empty). Extra keys are ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from bole_tune.atomic import write_text_atomic
from bole_tune.profiles import PROFILES_DIR, Fields, ProfileError, read_yaml


@dataclass(frozen=True)
class AcceptanceModel:
    name: str
    depth_acceptance: tuple[float, ...]
    rank_share: tuple[float, ...]
    source: str = ""

    def __post_init__(self):
        where = self.source or self.name
        if not self.depth_acceptance or not self.rank_share:
            raise ProfileError(f"{where}: depth_acceptance and rank_share must not be empty")
        for field_name, values in (("depth_acceptance", self.depth_acceptance), ("rank_share", self.rank_share)):
            for i, p in enumerate(values):
                if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
                    raise ProfileError(f"{where}: {field_name}[{i}]: expected a probability in [0, 1], got {p!r}")
        if self.rank_share[0] != 1.0:
            raise ProfileError(f"{where}: rank_share[0]: must be 1.0 (shares are relative to the top rank)")
        total = sum(self.rank_share)
        for d, a in enumerate(self.depth_acceptance):
            if a * total > 1.0 + 1e-6:
                raise ProfileError(f"{where}: depth_acceptance[{d}] * sum(rank_share) = {a * total:.3f} > 1 "
                                   "(the ranks of one parent exclude each other)")

    @property
    def max_rank(self) -> int:
        return len(self.rank_share)

    def child_probability(self, depth: int, rank: int) -> float:
        """P(accepted | parent accepted) for a node at ``depth`` (1-based) of sibling ``rank`` (1-based)."""
        a = self.depth_acceptance[min(depth, len(self.depth_acceptance)) - 1]
        return a * self.rank_share[rank - 1] if rank <= self.max_rank else 0.0

    def as_dict(self) -> dict:
        return {"name": self.name, "depth_acceptance": [round(a, 4) for a in self.depth_acceptance],
                "rank_share": [round(s, 4) for s in self.rank_share]}


def acceptance_dir() -> Path:
    return PROFILES_DIR / "acceptance"


def list_acceptance_models() -> list[str]:
    return sorted(p.stem for p in acceptance_dir().glob("*.yaml"))


def load_acceptance(name_or_path: str) -> AcceptanceModel:
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml") and "/" not in name_or_path:
        path = acceptance_dir() / f"{name_or_path}.yaml"
        if not path.exists():
            raise ProfileError(f"acceptance model {name_or_path!r}: unknown "
                               f"(known: {', '.join(list_acceptance_models())})")
    f = Fields(read_yaml(path), path)
    f.reject_unknown({"name", "depth_acceptance", "rank_share"})
    return AcceptanceModel(f.get("name", str), tuple(f.get("depth_acceptance", list)),
                           tuple(f.get("rank_share", list)), source=str(path))


def save_acceptance(model: AcceptanceModel, path, comment: str = "") -> None:
    header = "".join(f"# {line}\n" for line in comment.splitlines())
    write_text_atomic(path, header + yaml.safe_dump(model.as_dict(), sort_keys=False, default_flow_style=None))


def _depths(parents: list[int]) -> list[int]:
    depths = []
    for n, p in enumerate(parents):
        if not -1 <= p < n:
            raise ValueError(f"parents[{n}]={p}: a parent must precede its child (-1 for a root)")
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def calibrate(path, name: str | None = None, max_depth: int = 8, max_rank: int = 4, iterations: int = 50
              ) -> tuple[AcceptanceModel, dict]:
    """Fit an acceptance model to a JSONL log of rounds; returns the model and fit statistics.

    Every drafted node whose parent was accepted (or that hangs off the committed token) is one trial
    at (depth, rank), a success when it was accepted. ``p(d, k) = a_d * s_k`` is fitted by alternating
    maximum-likelihood updates of a and s (Poisson approximation), with s_1 = 1.
    """
    path = Path(path)
    trials = [[0] * max_rank for _ in range(max_depth)]
    successes = [[0] * max_rank for _ in range(max_depth)]
    rounds = 0
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise ValueError(f"{path}: cannot be read ({error})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
            parents, ranks, accepted = record["parents"], record["ranks"], set(record["accepted"])
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{where}: expected an object with parents, ranks and accepted ({error})") from None
        if len(ranks) != len(parents):
            raise ValueError(f"{where}: ranks has {len(ranks)} entries for {len(parents)} nodes")
        try:
            depths = _depths(parents)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        for n in accepted:
            if not 0 <= n < len(parents) or (parents[n] >= 0 and parents[n] not in accepted):
                raise ValueError(f"{where}: accepted node {n} is not on a path from a root")
        rounds += 1
        for n, (p, rank) in enumerate(zip(parents, ranks)):
            if p >= 0 and p not in accepted:
                continue
            d, k = min(depths[n], max_depth) - 1, rank - 1
            if not 0 <= k:
                raise ValueError(f"{where}: ranks[{n}]={rank} (ranks start at 1)")
            if k >= max_rank:
                continue
            trials[d][k] += 1
            successes[d][k] += n in accepted
    if rounds == 0:
        raise ValueError(f"{path}: no rounds in the log")
    observed_depths = [d for d in range(max_depth) if trials[d][0] > 0]
    if not observed_depths:
        raise ValueError(f"{path}: no top-ranked node was ever drafted after an accepted parent")
    a = [successes[d][0] / trials[d][0] if trials[d][0] else 0.0 for d in range(max_depth)]
    s = [1.0] * max_rank
    for _ in range(iterations):
        for k in range(1, max_rank):
            exposure = sum(a[d] * trials[d][k] for d in range(max_depth))
            s[k] = sum(successes[d][k] for d in range(max_depth)) / exposure if exposure else 0.0
        for d in range(max_depth):
            exposure = sum(s[k] * trials[d][k] for k in range(max_rank))
            a[d] = sum(successes[d]) / exposure if exposure else 0.0
    depth_count = max(observed_depths) + 1
    a = [min(1.0, x) for x in a[:depth_count]]
    total = sum(s)
    a = [min(x, 0.999 / total) for x in a]  # keep the ranks of one parent exclusive, after rounding too
    model = AcceptanceModel(name or path.stem, tuple(a), tuple(min(1.0, x) for x in s), source=str(path))
    stats = {"rounds": rounds, "trials": trials, "successes": successes}
    return model, stats
