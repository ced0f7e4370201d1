"""Runtime choice of the verifier's tile configuration from the tuning database.

The kernels' launch planner asks `tuned_launch` for ``tree_verify(config=None)``. The policy comes from
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
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass

import torch
import triton

from bole_tune import database
from bole_tune.config import KernelConfig, default_config
from bole_tune.database import DatabaseError, ShapeKey
from bole_tune.fingerprint import fingerprint
from bole_tune.shapes import HeadShape, batch_bucket, dtype_name, tree_bucket

POLICIES = ("nearest", "strict", "default")


@dataclass(frozen=True)
class Decision:
    """What the runtime picked and why."""

    config: KernelConfig
    how: str  # "exact", "nearest", "default"
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
            if (other.heads, other.dtype, other.tree_bucket, other.batch_bucket)
            == (key.heads, key.dtype, key.tree_bucket, key.batch_bucket)]
    if same:
        other, name, entry = next((s for s in same if s[0].tp == key.tp), same[0])
        return _from_entry(entry, found.source("configs", name), key, "exact", f"tuned for this bucket ({found.where})")
    if mode == "strict":
        raise LookupError(f"BOLE_TUNE_LOOKUP=strict: no tuned config for {key.text} on {slug} ({found.where})")
    candidates = []
    for other, name, entry in tuned:
        if (other.heads, other.dtype) != (key.heads, key.dtype):  # same heads, head sizes and dtype; any tp
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
    _warned.clear()
    _slugs.clear()
    database.clear_cache()


def _device_slug(device: torch.device) -> str:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _slugs:
        _slugs[index] = fingerprint(torch.device("cuda", index)).slug
    return _slugs[index]


def tuned_launch(heads: HeadShape, dtype: torch.dtype, max_tree_size: int, num_requests: int,
                 device: torch.device) -> tuple[KernelConfig, str | None]:
    """(config, the kernel variant it was tuned on or None) for ``tree_verify(config=None)``.

    Cached per device and bucket; off a CUDA device (no tuned binaries) the safe default.
    """
    cache_key = (device.index, heads.hk, heads.hv, heads.dk, heads.dv, dtype, max_tree_size, num_requests)
    launch = _cache.get(cache_key)
    if launch is not None:
        return launch
    mode = policy()
    kernel = None
    if device.type != "cuda":
        config = default_config(heads.dk, heads.dv)
    else:
        key = ShapeKey(heads=heads, dtype=dtype_name(dtype), tree_bucket=tree_bucket(max_tree_size),
                       batch_bucket=batch_bucket(num_requests))
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
    if decision.how != "exact" and not decision.reason.startswith("BOLE_TUNE_LOOKUP") and token not in _warned:
        _warned.add(token)
        warnings.warn(f"bole-tune: no tuned config for {decision.key.text} on {slug}; using the "
                      f"{decision.how} one ({decision.config}): {decision.reason}", stacklevel=4)
    _check_triton_version(decision)


def _check_triton_version(decision: Decision) -> None:
    if not decision.source:
        return
    token = ("triton", decision.source)
    if token in _warned:
        return
    _warned.add(token)
    try:
        entries = database.load(decision.source)["configs"]
    except DatabaseError:
        return
    entry = entries.get(decision.key.text) or next(iter(entries.values()), {})
    made_with = entry.get("provenance", {}).get("triton")
    if made_with and made_with != triton.__version__:
        warnings.warn(f"bole-tune: {decision.source} was tuned with triton {made_with}, this is triton "
                      f"{triton.__version__}; its configs are used but may no longer be the fastest", stacklevel=5)


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
