"""Acceptance models (``profiles/acceptance/*.yaml``) and their calibration from logs of real rounds.

A model gives, for a draft node at depth d (1 = first draft position) whose rank among its siblings is
k (1 = the drafter's top choice), the probability that the target accepts it given that its parent was
accepted:

    k = 1:  depth_acceptance[d]
    k >= 2: (1 - depth_acceptance[d]) * alternative_share[k - 2]

``alternative_share[j]`` is the share of the rank-1 rejections in which the target's token is the
drafter's rank-(j + 2) token: the form in which sibling data is published (e.g. "at the first mismatch
the target's token is the rank-1 alternative 37% of the time"), and why the shares are not a constant
ratio to rank 1 (that ratio, ``(1 - a_d) * share / a_d``, grows fourfold from a 0.9 to a 0.7 depth).
The target picks one token, so the ranks of one parent exclude each other: ``sum(alternative_share) <=
1``. Below an accepted alternative (a node of rank >= 2 on the path) every probability is multiplied by
``branch_continuation``: the drafter's continuation of a token it did not rank first is right less
often than its main line.

A profile gives ``depth_acceptance`` (conditional) or ``depth_acceptance_unconditional`` (the
per-position rates engines report, P(the first d draft tokens are all accepted)), which must be
non-increasing and is converted here (``conditional[d] = unconditional[d] / unconditional[d - 1]``).
Conditional rates may rise with depth (published MTP data does: easy stretches survive); the path
probabilities they multiply into never do. A profile may hold variants per model (``models:``, each a
``depth_acceptance`` or ``depth_acceptance_unconditional``), chosen by ``load_acceptance(name, model=)``.

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
from bole_tune.profiles import PROFILES_DIR, Fields, ProfileError, read_text, read_yaml

DEFAULT_WORKLOAD = "qwen3.5-mtp-mbpp"
"""The workload `get_budget` and ``bole-tune budget`` use when none is named: code (MBPP), the Bole paper's
main evaluation (MAT 6.4-6.9 for Qwen3.5 4B-122B), between its math (7.08) and summarisation (4.98)."""


def _probability(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ProfileError(f"{where}: expected a probability in [0, 1], got {value!r}")
    return float(value)


def conditional_from_unconditional(values, where: str = "depth_acceptance_unconditional") -> tuple[float, ...]:
    """Per-depth conditional acceptance from P(first d draft tokens all accepted), which must not increase."""
    values = [_probability(v, f"{where}[{i}]") for i, v in enumerate(values)]
    if not values:
        raise ProfileError(f"{where}: must not be empty")
    for i in range(1, len(values)):
        if values[i] > values[i - 1]:
            raise ProfileError(f"{where}[{i}]: {values[i]} > {values[i - 1]} at the depth before: the chance that "
                               "all of the first d draft tokens are accepted cannot grow with d")
    return tuple(v / prev if prev > 0 else 0.0 for v, prev in zip(values, [1.0] + values[:-1]))


@dataclass(frozen=True)
class AcceptanceModel:
    name: str
    depth_acceptance: tuple[float, ...]
    alternative_share: tuple[float, ...] = ()
    branch_continuation: float = 1.0
    variant: str = ""  # the model a per-model variant of the profile is for ("" the profile's default)
    sources: tuple[str, ...] = ()  # citations of the published data (stored with every budget)
    where: str = ""  # the file read, for messages (never stored)

    def __post_init__(self):
        where = self.where or self.name
        if not self.depth_acceptance:
            raise ProfileError(f"{where}: depth_acceptance: must not be empty")
        for field_name in ("depth_acceptance", "alternative_share"):
            for i, p in enumerate(getattr(self, field_name)):
                _probability(p, f"{where}: {field_name}[{i}]")
        _probability(self.branch_continuation, f"{where}: branch_continuation")
        shares = self.alternative_share
        for i in range(1, len(shares)):
            if shares[i] > shares[i - 1]:
                raise ProfileError(f"{where}: alternative_share[{i}]: {shares[i]} > {shares[i - 1]} (a lower-ranked "
                                   "alternative cannot be the target's token more often than a higher-ranked one)")
        if sum(shares) > 1.0 + 1e-9:
            raise ProfileError(f"{where}: alternative_share: sums to {sum(shares):.3f} > 1 (the ranks of one parent "
                               "exclude each other: the target picks one token)")
        for d, a in enumerate(self.depth_acceptance):
            if shares and (1.0 - a) * shares[0] > a + 1e-12:
                raise ProfileError(f"{where}: depth_acceptance[{d}]: {a} makes the rank-2 token likelier than the "
                                   f"rank-1 token ({(1 - a) * shares[0]:.3f} > {a})")

    @property
    def max_rank(self) -> int:
        return 1 + len(self.alternative_share)

    def child_probability(self, depth: int, rank: int, off_main_line: bool = False) -> float:
        """P(accepted | parent accepted) of a node at ``depth`` (1-based) of sibling ``rank`` (1-based);
        ``off_main_line``: an alternative (rank >= 2) lies on its path."""
        a = self.depth_acceptance[min(depth, len(self.depth_acceptance)) - 1]
        if rank == 1:
            p = a
        elif rank <= self.max_rank:
            p = (1.0 - a) * self.alternative_share[rank - 2]
        else:
            return 0.0
        return p * self.branch_continuation if off_main_line else p

    def chain_accepted(self, length: int) -> float:
        """Expected accepted draft tokens of a chain of ``length`` top-ranked drafts."""
        total, path = 0.0, 1.0
        for d in range(1, length + 1):
            path *= self.child_probability(d, 1)
            total += path
        return total

    def with_depth_acceptance(self, depth_acceptance, variant: str = "") -> "AcceptanceModel":
        return AcceptanceModel(self.name, tuple(depth_acceptance), self.alternative_share, self.branch_continuation,
                               variant, self.sources, self.where)

    def as_dict(self) -> dict:
        d = {"name": self.name, "depth_acceptance": [round(a, 4) for a in self.depth_acceptance],
             "alternative_share": [round(s, 4) for s in self.alternative_share],
             "branch_continuation": round(self.branch_continuation, 4)}
        if self.variant:
            d["variant"] = self.variant
        return d

    @classmethod
    def from_dict(cls, data: dict, where: str = "acceptance") -> "AcceptanceModel":
        """The model stored in a budget entry (`as_dict`)."""
        return cls(data["name"], tuple(data["depth_acceptance"]), tuple(data.get("alternative_share", ())),
                   data.get("branch_continuation", 1.0), data.get("variant", ""), where=where)


def scale_rejection(depth_acceptance, factor: float) -> tuple[float, ...]:
    """The same per-depth shape with every rejection rate ``1 - a`` multiplied by ``factor`` (clipped to [0, 1])."""
    return tuple(min(1.0, max(0.0, 1.0 - factor * (1.0 - a))) for a in depth_acceptance)


def fit_rejection_scale(model: AcceptanceModel, target: float, expected_accepted, low: float = 0.0,
                        high: float = 4.0) -> tuple[float, AcceptanceModel]:
    """The factor on ``model``'s rejection rates (`scale_rejection`) under which ``expected_accepted(model)``
    equals ``target``, by bisection (the expectation falls as the factor grows). Returns (factor, model)."""
    def at(factor):
        return expected_accepted(model.with_depth_acceptance(scale_rejection(model.depth_acceptance, factor)))

    if not at(high) <= target <= at(low):
        raise ValueError(f"target {target}: outside what scaling the rejection rates reaches "
                         f"({at(high):.3f} .. {at(low):.3f})")
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if at(mid) > target else (low, mid)
    factor = (low + high) / 2
    return factor, model.with_depth_acceptance(scale_rejection(model.depth_acceptance, factor))


def acceptance_dir() -> Path:
    return PROFILES_DIR / "acceptance"


def list_acceptance_models() -> list[str]:
    return sorted(p.stem for p in acceptance_dir().glob("*.yaml"))


def _depths_of(f: Fields, path) -> tuple[float, ...]:
    if ("depth_acceptance" in f.data) == ("depth_acceptance_unconditional" in f.data):
        raise ProfileError(f"{path}: {f.prefix}depth_acceptance: give it or depth_acceptance_unconditional (one)")
    if "depth_acceptance" in f.data:
        return tuple(f.get("depth_acceptance", list))
    return conditional_from_unconditional(f.get("depth_acceptance_unconditional", list),
                                          f"{path}: {f.prefix}depth_acceptance_unconditional")


def load_acceptance(name_or_path: str, model: str | None = None) -> AcceptanceModel:
    """An acceptance profile by name (``profiles/acceptance/<name>.yaml``) or file; ``model``: its variant
    for that model (a display name such as ``Qwen3.5-27B``), the profile's default when it has none."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml") and "/" not in name_or_path:
        path = acceptance_dir() / f"{name_or_path}.yaml"
        if not path.exists():
            raise ProfileError(f"acceptance model {name_or_path!r}: unknown "
                               f"(known: {', '.join(list_acceptance_models())})")
    f = Fields(read_yaml(path), path)
    f.reject_unknown({"name", "depth_acceptance", "depth_acceptance_unconditional", "alternative_share",
                      "branch_continuation", "sources", "models"})
    sources = f.get("sources", list, [])
    if not all(isinstance(s, str) for s in sources):
        raise ProfileError(f"{path}: sources: expected a list of strings")
    name = f.get("name", str)
    base = AcceptanceModel(name, _depths_of(f, path), tuple(f.get("alternative_share", list, [])),
                           f.get("branch_continuation", float, 1.0), "", tuple(sources), str(path))
    variants = {}
    if "models" in f.data:
        models = f.sub("models")
        for key in models.data:
            sub = models.sub(key)
            sub.reject_unknown({"depth_acceptance", "depth_acceptance_unconditional"})
            variants[key.lower()] = AcceptanceModel(name, _depths_of(sub, path), base.alternative_share,
                                                    base.branch_continuation, key, base.sources,
                                                    f"{path}: models.{key}")
    return variants.get((model or "").lower(), base)


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


def _int_list(record: dict, name: str, where: str) -> list[int]:
    """``record[name]``, a list of ints; otherwise a ValueError naming the line and the field."""
    if name not in record:
        raise ValueError(f"{where}: {name}: missing (each line needs parents, ranks and accepted)")
    values = record[name]
    if not isinstance(values, list):
        raise ValueError(f"{where}: {name}: expected a list of ints, got {values!r}")
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: {name}[{i}]: expected an int, got {value!r}")
    return values


def calibrate(path, name: str | None = None, max_depth: int = 8, max_rank: int = 4) -> tuple[AcceptanceModel, dict]:
    """Fit an acceptance model to a JSONL log of rounds; returns the model and fit statistics.

    Every drafted node whose parent was accepted (or that hangs off the committed token) is one trial at
    (depth, rank), a success when it was accepted. On the main line (no alternative above it):
    ``depth_acceptance[d]`` is the success rate of rank 1 at depth d, ``alternative_share[k]`` the
    successes of rank k + 2 over the rejections of rank 1 its trials expect (maximum likelihood under a
    Poisson approximation). ``branch_continuation`` is the successes below an accepted alternative over
    what the main-line rates expect there. Shares are then made non-increasing and exclusive.
    """
    path = Path(path)
    trials = [[0] * max_rank for _ in range(max_depth)]  # main line
    successes = [[0] * max_rank for _ in range(max_depth)]
    off_trials = [[0] * max_rank for _ in range(max_depth)]  # below an accepted alternative
    off_successes = 0
    rounds = 0
    lines = read_text(path).splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except ValueError as error:
            raise ValueError(f"{where}: expected an object with parents, ranks and accepted; not JSON ({error})") \
                from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected an object with parents, ranks and accepted, got "
                             f"{type(record).__name__}")
        parents, ranks, accepted = (_int_list(record, name, where) for name in ("parents", "ranks", "accepted"))
        accepted = set(accepted)
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
        off = []  # an alternative lies strictly above the node
        for n, (p, rank) in enumerate(zip(parents, ranks)):
            if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
                raise ValueError(f"{where}: ranks[{n}]={rank!r} (ranks start at 1)")
            off.append(p >= 0 and (off[p] or ranks[p] > 1))
            if (p >= 0 and p not in accepted) or rank > max_rank:
                continue
            d, k = min(depths[n], max_depth) - 1, rank - 1
            if off[n]:
                off_trials[d][k] += 1
                off_successes += n in accepted
            else:
                trials[d][k] += 1
                successes[d][k] += n in accepted
    if rounds == 0:
        raise ValueError(f"{path}: no rounds in the log")
    observed = [d for d in range(max_depth) if trials[d][0] > 0]
    if not observed:
        raise ValueError(f"{path}: no top-ranked node was ever drafted after an accepted parent")
    a = [successes[d][0] / trials[d][0] if trials[d][0] else 0.0 for d in range(max(observed) + 1)]
    for d in range(1, len(a)):  # depths never tried take the depth before
        if not trials[d][0]:
            a[d] = a[d - 1]
    shares = []
    for k in range(1, max_rank):
        exposure = sum(trials[d][k] * (1 - a[min(d, len(a) - 1)]) for d in range(max_depth))
        if exposure:
            shares.append(sum(successes[d][k] for d in range(max_depth)) / exposure)
    cap = min((x / (1 - x) for x in a if x < 1), default=1.0)  # rank 2 never likelier than rank 1
    for k in range(len(shares)):
        shares[k] = min(shares[k], shares[k - 1] if k else cap, 1.0)
    if sum(shares) > 1:
        shares = [x / sum(shares) for x in shares]
    model = AcceptanceModel(name or path.stem, tuple(a), tuple(shares))
    expected_off = sum(off_trials[d][k] * model.child_probability(d + 1, k + 1)
                       for d in range(max_depth) for k in range(max_rank))
    continuation = min(1.0, off_successes / expected_off) if expected_off else 1.0
    model = AcceptanceModel(model.name, model.depth_acceptance, model.alternative_share, continuation, where=str(path))
    stats = {"rounds": rounds, "trials": trials, "successes": successes,
             "below_alternatives": {"trials": sum(map(sum, off_trials)), "successes": off_successes}}
    return model, stats
