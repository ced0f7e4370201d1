"""Runtime choice of the verifier's tile configuration from the tuning database.

``tree_verify(config=None)`` asks `config_for`. The policy comes from ``BOLE_TUNE_LOOKUP``:

- ``nearest`` (default): the exact shape bucket; else the nearest bucket of the same head shape
  whose config fits; else the safe default. One warning per missing bucket, not per call.
- ``strict``: the exact bucket or a `LookupError` (engines that must run tuned configs).
- ``default``: always the safe default; the database is not read.

The database folder is ``BOLE_TUNE_DB`` if set, else the user's folder and the shipped
``tuning_db/`` (user entries win). A database written under another Triton version is used, with
one warning. Decisions are cached per (device, shape bucket): after the first call a lookup is one
dictionary access.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass

import torch

from bole_tune.config import KernelConfig, default_config
from bole_tune.database import (DatabaseError, ShapeKey, batch_bucket, database_path, load, search_directories,
                                tree_bucket)

POLICIES = ("nearest", "strict", "default")
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Decision:
    """What the runtime picked and why."""

    config: KernelConfig
    how: str  # "exact", "nearest", "default"
    reason: str
    key: ShapeKey
    source: str = ""  # the database entry used
    latency_us: float | None = None
    kernel: str | None = None  # the tree_verify variant the config was tuned on (None: not tuned)


def policy() -> str:
    value = os.environ.get("BOLE_TUNE_LOOKUP", "nearest").strip().lower() or "nearest"
    if value not in POLICIES:
        raise ValueError(f"BOLE_TUNE_LOOKUP: unknown policy {value!r} (expected one of {', '.join(POLICIES)})")
    return value


def _entries_for(slug: str) -> tuple[dict, list[str]]:
    """Config entries for ``slug`` from every search folder (later folders first, so earlier ones win)."""
    merged, sources = {}, []
    for directory in reversed(search_directories()):
        path = database_path(slug, directory)
        if not path.exists():
            continue
        data = load(path)
        for name, entry in data.get("configs", {}).items():
            merged[name] = dict(entry, _source=str(path))
        sources.append(str(path))
    return merged, sources


def decide(key: ShapeKey, slug: str, mode: str | None = None, entries: dict | None = None) -> Decision:
    """Pick a config for ``key`` on the GPU model ``slug`` (no caching; see `config_for`)."""
    mode = mode or policy()
    fallback = default_config(key.dk, key.dv)
    if mode == "default":
        return Decision(fallback, "default", "BOLE_TUNE_LOOKUP=default", key)
    if entries is None:
        entries, sources = _entries_for(slug)
        where = ", ".join(sources) or f"no {slug}.yaml in {', '.join(map(str, search_directories()))}"
    else:
        where = "given entries"
    # heads per rank fix the kernel's shape: an entry tuned under any tensor-parallel degree serves it,
    # one tuned under the same degree first
    same = [e for e in entries.values() if _bucket_of(e) == _bucket_of({"key": key.as_dict()})]
    if same:
        exact = next((e for e in same if e["key"].get("tp", 1) == key.tp), same[0])
        return _from_entry(exact, key, "exact", f"tuned for this bucket ({where})")
    if mode == "strict":
        raise LookupError(f"BOLE_TUNE_LOOKUP=strict: no tuned config for {key.text} on {slug} ({where})")
    candidates = []
    for entry in entries.values():
        other = ShapeKey.from_dict(entry["key"])
        if other.head_key[:5] != key.head_key[:5]:  # same heads, head sizes and dtype; any tp
            continue
        config = KernelConfig(**entry["config"])
        if not config.fits(key.dk, key.dv):
            continue
        distance = (abs(math.log2(other.tree_bucket / key.tree_bucket))
                    + abs(math.log2(other.batch_bucket / key.batch_bucket)))
        # ties go to the larger tree bucket: its config was sized for at least this many rows
        candidates.append((distance, -other.tree_bucket, -other.batch_bucket, entry))
    if candidates:
        candidates.sort(key=lambda c: c[:3])
        entry = candidates[0][3]
        return _from_entry(entry, key, "nearest", f"nearest tuned bucket {entry['key']['tree_bucket']} nodes, "
                                                  f"batch {entry['key']['batch_bucket']} ({where})")
    return Decision(fallback, "default", f"nothing tuned for this head shape on {slug} ({where})", key)


def _bucket_of(entry: dict) -> tuple:
    k = entry["key"]
    return (k["hv"], k["hk"], k["dk"], k["dv"], k["dtype"], k["tree_bucket"], k["batch_bucket"])


def _from_entry(entry: dict, key: ShapeKey, how: str, reason: str) -> Decision:
    # entries written before the resident kernel existed were all tuned on the fused one
    return Decision(KernelConfig(**entry["config"]), how, reason, key, source=entry.get("_source", ""),
                    latency_us=entry["latency_us"]["p50"], kernel=entry.get("kernel", "fused"))


_cache: dict = {}
_warned: set = set()


def clear_cache() -> None:
    """Forget cached decisions (after the database or the environment changed)."""
    _cache.clear()
    _warned.clear()
    _slugs.clear()


_slugs: dict = {}


def _device_slug(device: torch.device) -> str:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _slugs:
        from bole_tune.fingerprint import fingerprint
        _slugs[index] = fingerprint(torch.device("cuda", index)).slug
    return _slugs[index]


def config_for(shape, dtype: torch.dtype, tree, device: torch.device, tp: int = 1) -> KernelConfig:
    """The configuration `tree_verify(config=None)` launches with (cached per device and bucket)."""
    return launch_for(shape, dtype, tree, device, tp)[0]


def launch_for(shape, dtype: torch.dtype, tree, device: torch.device, tp: int = 1) -> tuple[KernelConfig, str | None]:
    """(config, kernel variant it was tuned on, or None without a tuned entry), cached per bucket."""
    cache_key = (device.index, shape.hv, shape.hk, shape.dk, shape.dv, dtype, tree.max_tree_size,
                 tree.num_requests, tp)
    launch = _cache.get(cache_key)
    if launch is not None:
        return launch
    mode = policy()
    kernel = None
    if device.type != "cuda":
        config = default_config(shape.dk, shape.dv)
    else:
        key = ShapeKey(shape.hv, shape.hk, shape.dk, shape.dv, DTYPE_NAMES[dtype], tree_bucket(tree.max_tree_size),
                       batch_bucket(tree.num_requests), tp)
        slug = _device_slug(device)
        try:
            decision = decide(key, slug, mode)
        except DatabaseError as error:
            if mode == "strict":
                raise
            decision = Decision(default_config(shape.dk, shape.dv), "default", f"unreadable database: {error}", key)
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
    import triton

    try:
        entries = load(decision.source).get("configs", {})
    except DatabaseError:
        return
    entry = entries.get(decision.key.text) or next(iter(entries.values()), {})
    made_with = entry.get("provenance", {}).get("triton")
    if made_with and made_with != triton.__version__:
        warnings.warn(f"bole-tune: {decision.source} was tuned with triton {made_with}, this is triton "
                      f"{triton.__version__}; its configs are used but may no longer be the fastest", stacklevel=5)


def lookup_cost_ns(device=None, repeats: int = 200_000) -> float:
    """Nanoseconds per `config_for` call once cached (the cost tree_verify(config=None) adds per call)."""
    import time

    from bole_tune.kernels.common import VerifyShape
    from bole_tune.workloads import make_tree

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    tree = make_tree([64] * 16, device=device)
    shape = VerifyShape(tree.num_nodes, 16, 16, 16, 32, 128, 128, 128 ** -0.5)
    config_for(shape, torch.bfloat16, tree, device)
    start = time.perf_counter_ns()
    for _ in range(repeats):
        config_for(shape, torch.bfloat16, tree, device)
    return (time.perf_counter_ns() - start) / repeats
