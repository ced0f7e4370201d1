"""Runtime choice of the verifier's and the commit's tile configurations from the tuning database.

The kernels' launch planner asks `tuned_launch` for ``tree_verify(config=None)``; the commit asks
`tuned_commit` for ``tree_commit(config=None)`` and ``tree_commit_layers(config=None)`` (section
``commit_configs``, keyed by bucket and by the layers one launch commits). The policy comes from
``BOLE_TUNE_LOOKUP``:

- ``nearest`` (default): the exact shape bucket; else the nearest bucket of the same head shape
  whose config fits; else the safe default. One warning per missing bucket, not per call. An
  unreadable database counts as empty, with one warning.
- ``strict``: the exact bucket or a `LookupError` (engines that must run tuned configs); an
  unreadable database raises `DatabaseError`.
- ``default``: always the safe default; the database is not read.

The database is read as `bole_tune.database.search` reads it (``BOLE_TUNE_DB`` alone if set, else the
user's folder and then the shipped ``tuning_db/``; user entries win). A database written under another
Triton version is used, with one warning. Decisions are cached per (device, shape bucket): after the
first call a lookup is one dictionary access.

**The commit** follows the same policies, with one difference: where nothing is tuned for its bucket it takes
the nearest tuned launch of the same heads and dtype (by programs: layers x batch, and by tree bucket), else
the untuned fallback `bole_tune.config.default_commit_config` (the rule the commit shipped with before it
was tuned), *silently*: the fallback is a sound launch, not a degraded mode, and a database tuned before
commits were tuned (the shipped one until the H200 is profiled again) must not warn on every new shape.
``bole-tune lookup --commit`` says which it took and why.

**The folded verify** (``tree_verify(..., pending=...)``: the previous round's commit in the same launch) has
entries of its own (keys ending in ``-fold``, `ShapeKey.fold`; ``bole-tune tune --fold``): its best tiles need
not be the verify's. Where its bucket has none it runs the config of the same bucket's verify (as that lookup
decides it), silently: it is what the folded launch ran before it was tuned apart.

**A ring's write round** (a `PendingRing` round that folds its R rounds of pending tokens into the slots and writes
them) has entries of its own too (keys ending in ``-ring``, `ShapeKey.ring`; ``bole-tune tune --ring``): it folds
R rounds of tokens, not one, and its best tiles differ from the folded verify's (9B B=32 8-node chains on the H200:
the folded verify's tuned 32/128/2/3 wrote in 91.6 us a round, 32/64/2/3 in 70.6). Where its bucket has none it
runs the folded verify's config (as that lookup decides it), silently, or where the bucket's verify config is a
Gluon one (``gluon: 1``), that: the Gluon verify runs a ring's write rounds, not a folded verify's. A ring's read
rounds run the verify's.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings
from dataclasses import dataclass

import torch
import triton

from bole_tune import database
from bole_tune.config import CommitConfig, KernelConfig, default_commit_config, default_config
from bole_tune.database import CommitKey, DatabaseError, ShapeKey
from bole_tune.fingerprint import fingerprint
from bole_tune.shapes import HeadShape, batch_bucket, dtype_name, tree_bucket

POLICIES = ("nearest", "strict", "default")


@dataclass(frozen=True)
class Decision:
    """What the runtime picked and why."""

    config: KernelConfig
    how: str  # "exact", "nearest", "default"; "verify": a folded verify's (or ring write's) key served by its
    # bucket's verify entry; "fold": a ring write's key served by its bucket's folded verify entry
    reason: str
    key: ShapeKey
    source: str = ""  # the database file of the entry used
    latency_us: float | None = None
    kernel: str | None = None  # the tree_verify variant the config was tuned on (None: not tuned)


def policy() -> str:
    """``BOLE_TUNE_LOOKUP`` (default ``nearest``); any other value than `POLICIES` is a ValueError, never
    read as one of them."""
    value = os.environ.get("BOLE_TUNE_LOOKUP", "nearest").strip().lower() or "nearest"
    if value not in POLICIES:
        raise ValueError(f"BOLE_TUNE_LOOKUP: unknown policy {value!r} (expected one of {', '.join(POLICIES)})")
    return value


def decide(key: ShapeKey, slug: str, mode: str | None = None, directory=None) -> Decision:
    """Pick a config for ``key`` on the GPU model ``slug`` (no caching; see `tuned_launch`).

    ``mode``: one of `POLICIES` (default: `policy`). ``directory``: read that database folder alone instead
    of the search folders.
    """
    mode = mode or policy()
    if mode not in POLICIES:
        raise ValueError(f"mode: unknown lookup policy {mode!r} (expected one of {', '.join(POLICIES)})")
    fallback = default_config(key.heads.dk, key.heads.dv)
    if mode == "default":
        return Decision(fallback, "default", "BOLE_TUNE_LOOKUP=default", key)
    found = database.search(slug, directory)
    configs = found.entries("configs")
    tuned = [(ShapeKey.from_dict(entry["key"]), name, entry) for name, entry in configs.items()]
    # heads per rank fix the kernel's shape: an entry tuned under any tensor-parallel degree serves it,
    # one tuned under the same degree first
    same = [(other, name, entry) for other, name, entry in tuned
            if (other.heads, other.dtype, other.tree_bucket, other.batch_bucket, other.fold, other.ring)
            == (key.heads, key.dtype, key.tree_bucket, key.batch_bucket, key.fold, key.ring)]
    if same:
        other, name, entry = next((s for s in same if s[0].tp == key.tp), same[0])
        return _from_entry(entry, found.source("configs", name), key, "exact", f"tuned for this bucket ({found.where})")
    if key.ring:  # a ring's write round not tuned on its own runs what the folded verify of its bucket runs,
        # or where the bucket's verify config is a Gluon one, that: the Gluon verify runs a ring's write rounds but
        # not a PendingCommit fold, so the folded verify's config would take them to the Triton kernels
        try:
            verify = decide(key.verify_key, slug, mode, directory)
        except LookupError:  # strict, and the verify not tuned: the folded verify's entry may still be there
            verify = None
        if verify is not None and verify.config.gluon:
            return dataclasses.replace(verify, key=key, how="verify" if verify.how == "exact" else verify.how,
                                       reason=f"the ring's write round is not tuned for this bucket: the verify's "
                                              f"Gluon config (the Gluon verify runs a ring's rounds), {verify.reason}")
        decision = decide(key.fold_key, slug, mode, directory)
        return dataclasses.replace(decision, key=key, how="fold" if decision.how == "exact" else decision.how,
                                   reason=f"the ring's write round is not tuned for this bucket: the folded verify's "
                                          f"config, {decision.reason}")
    if key.fold:  # a folded verify not tuned on its own runs what the verify of its bucket runs
        decision = decide(key.verify_key, slug, mode, directory)
        return dataclasses.replace(decision, key=key, how="verify" if decision.how == "exact" else decision.how,
                                   reason=f"the folded verify is not tuned for this bucket: the verify's config, "
                                          f"{decision.reason}")
    if mode == "strict":
        raise LookupError(f"BOLE_TUNE_LOOKUP=strict: no tuned config for {key.text} on {slug} ({found.where})")
    candidates = []
    for other, name, entry in tuned:
        if (other.heads, other.dtype) != (key.heads, key.dtype) or other.fold or other.ring:  # any tp
            continue
        if not KernelConfig.from_dict(entry["config"]).fits(key.heads.dk, key.heads.dv):
            continue
        distance = (abs(math.log2(other.tree_bucket / key.tree_bucket))
                    + abs(math.log2(other.batch_bucket / key.batch_bucket)))
        # ties go to the larger tree bucket: its config was sized for at least this many rows
        candidates.append((distance, -other.tree_bucket, -other.batch_bucket, other, name, entry))
    if candidates:
        candidates.sort(key=lambda c: c[:3])
        other, name, entry = candidates[0][3:]
        reason = f"nearest tuned bucket {other.tree_bucket} nodes, batch {other.batch_bucket} ({found.where})"
        return _from_entry(entry, found.source("configs", name), key, "nearest", reason)
    return Decision(fallback, "default", f"nothing tuned for this head shape on {slug} ({found.where})", key)


def _from_entry(entry: dict, source, key: ShapeKey, how: str, reason: str) -> Decision:
    # entries written before the resident kernel existed were all tuned on the fused one
    return Decision(KernelConfig.from_dict(entry["config"]), how, reason, key, source=str(source),
                    latency_us=entry["latency_us"]["p50"], kernel=entry.get("kernel", "fused"))


_cache: dict = {}
_warned: set = set()
_slugs: dict = {}


def clear_cache() -> None:
    """Forget cached decisions and parsed database files (after the database or the environment changed)."""
    _cache.clear()
    _commit_cache.clear()
    _warned.clear()
    _slugs.clear()
    database.clear_cache()
    from bole_tune.kernels.verify.planner import forget_plans

    forget_plans()  # the planners' remembered launches were made from the decisions just forgotten


def _device_slug(device: torch.device) -> str:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _slugs:
        _slugs[index] = fingerprint(torch.device("cuda", index)).slug
    return _slugs[index]


def tuned_launch(heads: HeadShape, dtype: torch.dtype, max_tree_size: int, num_requests: int,
                 device: torch.device, fold: bool = False, ring: bool = False) -> tuple[KernelConfig, str | None]:
    """(config, the kernel variant it was tuned on or None) for ``tree_verify(config=None)`` (``fold``: with
    ``pending=``, whose entries are tuned apart and fall back to the verify's; ``ring``: a `PendingRing`'s write
    round, whose entries fall back to the folded verify's).

    Cached per device and bucket; off a CUDA device (no tuned binaries) the safe default.
    """
    cache_key = (device.index, heads.hk, heads.hv, heads.dk, heads.dv, dtype, max_tree_size, num_requests, fold, ring)
    launch = _cache.get(cache_key)
    if launch is not None:
        return launch
    mode = policy()
    kernel = None
    if device.type != "cuda":
        config = default_config(heads.dk, heads.dv)
    else:
        key = ShapeKey(heads=heads, dtype=dtype_name(dtype), tree_bucket=tree_bucket(max_tree_size),
                       batch_bucket=batch_bucket(num_requests), fold=bool(fold), ring=bool(ring))
        slug = _device_slug(device)
        try:
            decision = decide(key, slug, mode)
        except DatabaseError as error:
            if mode == "strict":
                raise
            decision = Decision(default_config(heads.dk, heads.dv), "default", f"unreadable database: {error}", key)
        _warn_once(decision, slug)
        config, kernel = decision.config, decision.kernel
    _cache[cache_key] = (config, kernel)
    return config, kernel


def _warn_once(decision: Decision, slug: str) -> None:
    """One warning per bucket that had no exact entry (not per call), and one per stale database."""
    token = (slug, decision.key.text)
    if decision.how not in ("exact", "verify", "fold") and not decision.reason.startswith("BOLE_TUNE_LOOKUP") \
            and token not in _warned:
        _warned.add(token)
        warnings.warn(f"bole-tune: no tuned config for {decision.key.text} on {slug}; using the "
                      f"{decision.how} one ({decision.config}): {decision.reason}", stacklevel=4)
    _check_triton_version(decision)


def _check_triton_version(decision, section: str = "configs") -> None:
    if not decision.source:
        return
    token = ("triton", decision.source)
    if token in _warned:
        return
    _warned.add(token)
    try:
        entries = database.load(decision.source)[section]
    except DatabaseError:
        return
    entry = entries.get(decision.key.text) or next(iter(entries.values()), {})
    made_with = entry.get("provenance", {}).get("triton")
    if made_with and made_with != triton.__version__:
        warnings.warn(f"bole-tune: {decision.source} was tuned with triton {made_with}, this is triton "
                      f"{triton.__version__}; its configs are used but may no longer be the fastest", stacklevel=5)


# ---- the commit ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class CommitDecision:
    """What the runtime picked for a commit launch and why (``how``: "exact", "nearest", "default")."""

    config: CommitConfig
    how: str
    reason: str
    key: CommitKey
    source: str = ""  # the database file of the entry used
    latency_us: float | None = None  # the entry's tuned p50 (per launch)


def decide_commit(key: CommitKey, slug: str, mode: str | None = None, directory=None,
                  num_requests: int | None = None) -> CommitDecision:
    """Pick a commit config for ``key`` on the GPU model ``slug`` (no caching; see `tuned_commit`).

    ``mode``: one of `POLICIES` (default: `policy`); ``strict`` raises `LookupError` without an exact entry.
    ``directory``: read that database folder alone. ``num_requests``: the launch's real request count, which
    sizes the untuned fallback (default: the bucket's).
    """
    mode = mode or policy()
    if mode not in POLICIES:
        raise ValueError(f"mode: unknown lookup policy {mode!r} (expected one of {', '.join(POLICIES)})")
    h = key.heads
    fallback = default_commit_config(key.layers * (num_requests or key.batch_bucket) * h.hv, h.dk, h.dv)
    if mode == "default":
        return CommitDecision(fallback, "default", "BOLE_TUNE_LOOKUP=default: the untuned fallback", key)
    found = database.search(slug, directory)
    tuned = [(CommitKey.from_dict(entry["key"]), name, entry)
             for name, entry in found.entries("commit_configs").items()]
    same = [t for t in tuned if (t[0].shape.heads, t[0].dtype, t[0].tree_bucket, t[0].batch_bucket, t[0].layers)
            == (h, key.dtype, key.tree_bucket, key.batch_bucket, key.layers)]
    if same:
        other, name, entry = next((s for s in same if s[0].tp == key.tp), same[0])
        return _commit_from_entry(entry, found.source("commit_configs", name), key, "exact",
                                  f"tuned for this bucket ({found.where})")
    if mode == "strict":
        raise LookupError(f"BOLE_TUNE_LOOKUP=strict: no tuned commit config for {key.text} on {slug} ({found.where})")
    candidates = []
    for other, name, entry in tuned:
        if (other.heads, other.dtype) != (h, key.dtype):
            continue
        if not CommitConfig.from_dict(entry["config"]).fits(h.dk, h.dv):
            continue
        # a launch's cost follows its programs (layers x requests x heads) and, a little, the tree it gathers from
        distance = (abs(math.log2(other.programs_per_tile / key.programs_per_tile))
                    + abs(math.log2(other.tree_bucket / key.tree_bucket)))
        candidates.append((distance, other.layers != key.layers, -other.tree_bucket, -other.programs_per_tile,
                           other, name, entry))
    if candidates:
        candidates.sort(key=lambda c: c[:4])
        other, name, entry = candidates[0][4:]
        reason = (f"nearest tuned launch: {other.layers} layer{'s' if other.layers > 1 else ''}, batch "
                  f"{other.batch_bucket}, {other.tree_bucket} nodes ({found.where})")
        return _commit_from_entry(entry, found.source("commit_configs", name), key, "nearest", reason)
    return CommitDecision(fallback, "default", f"the untuned fallback: no commit config tuned for these heads on "
                                               f"{slug} ({found.where})", key)


def _commit_from_entry(entry: dict, source, key: CommitKey, how: str, reason: str) -> CommitDecision:
    return CommitDecision(CommitConfig.from_dict(entry["config"]), how, reason, key, source=str(source),
                          latency_us=entry["latency_us"]["p50"])


_commit_cache: dict = {}


def tuned_commit(hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, max_tree_size: int, num_requests: int,
                 layers: int, device: torch.device) -> CommitConfig:
    """The config of ``tree_commit(config=None)`` (``layers`` 1) and ``tree_commit_layers(config=None)`` (the
    layers it commits): the commit config source of ``bole_tune.kernels`` (`DEFAULT_COMMIT_CONFIG_SOURCE`).

    Cached per device and launch (one dictionary access after the first call); off a CUDA device, the untuned
    fallback. An unreadable database gives the fallback (``strict``: raises), as `tuned_launch` does.
    """
    cache_key = (device.index, hk, hv, dk, dv, dtype, max_tree_size, num_requests, layers)
    config = _commit_cache.get(cache_key)
    if config is not None:
        return config
    if device.type != "cuda":
        config = default_commit_config(layers * num_requests * hv, dk, dv)
    else:
        heads = HeadShape(hk=hk, hv=hv, dk=dk, dv=dv)
        key = CommitKey.bucketed(heads, dtype_name(dtype), max_tree_size, num_requests, layers)
        mode = policy()
        slug = _device_slug(device)
        try:
            decision = decide_commit(key, slug, mode, num_requests=num_requests)
        except DatabaseError as error:
            if mode == "strict":
                raise
            decision = CommitDecision(default_commit_config(layers * num_requests * hv, dk, dv), "default",
                                      f"unreadable database: {error}", key)
        _check_triton_version(decision, "commit_configs")
        config = decision.config
    _commit_cache[cache_key] = config
    return config


def commit_lookup_cost_ns(device=None, repeats: int = 200_000) -> float:
    """Nanoseconds per `tuned_commit` call once cached (what ``tree_commit(config=None)`` adds per call)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    args = (16, 32, 128, 128, torch.bfloat16, 64, 16, 1, device)
    tuned_commit(*args)
    start = time.perf_counter_ns()
    for _ in range(repeats):
        tuned_commit(*args)
    return (time.perf_counter_ns() - start) / repeats


def lookup_cost_ns(device=None, repeats: int = 200_000) -> float:
    """Nanoseconds per `tuned_launch` call once cached (the cost tree_verify(config=None) adds per call)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    heads = HeadShape(hk=16, hv=32, dk=128, dv=128)
    tuned_launch(heads, torch.bfloat16, 64, 16, device)
    start = time.perf_counter_ns()
    for _ in range(repeats):
        tuned_launch(heads, torch.bfloat16, 64, 16, device)
    return (time.perf_counter_ns() - start) / repeats
