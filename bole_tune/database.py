"""The tuning database: one YAML file per GPU model, ``<db dir>/<gpu-slug>.yaml``.

Layout (schema version 1)::

    schema_version: 1
    device: {slug, name, kind, source, facts: {...}}        # fingerprint of the last writer
    configs:                                               # best tile config per shape bucket
      Hv32-Hk16-dk128-dv128-bf16-T64-B16:
        key: {hv, hk, dk, dv, dtype, tree_bucket, batch_bucket, tp}
        config: {b_k, b_v, num_warps, num_stages}
        latency_us: {p20, p50, p80}
        default_config: {...}
        default_latency_us: {p20, p50, p80}
        rel_error: 0.0018
        trials: {total, measured, wrong, infeasible, pruned}
        provenance: {device, driver, cuda, torch, triton, bole_tune, python, date, timing_method}
    curves:                                                # latency against tree size and batch
      Qwen3.5-9B/tree_verify_tuned/bf16: {model, kernel, dtype, shape, points: [...], provenance}
    budgets: {...}                                         # tree-token budgets (see bole_tune.budget)
    step_curves: {...}                                     # whole verification step latency

Every write takes a file lock, re-reads the file, merges (entries with the same key are replaced,
all others kept) and replaces the file atomically, so concurrent writers lose nothing and a reader
never sees half a file. Every load validates; errors name the file and the field.
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml
from filelock import FileLock

from bole_tune.atomic import write_text_atomic

SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = (1,)
TREE_BUCKETS = (8, 16, 32, 64, 128, 256)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
SECTIONS = ("configs", "curves", "budgets", "step_curves")
DTYPE_NAMES = ("bf16", "fp16", "fp32")
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "tuning_db"
if not SHIPPED_DIR.is_dir():  # installed layout: tuning_db/ is the package bole_tune.tuning_db
    SHIPPED_DIR = Path(__file__).resolve().parent / "tuning_db"


class DatabaseError(ValueError):
    """A tuning database file is unreadable, corrupt, of an unknown schema or has a bad field."""


def bucket(value: int, buckets) -> int:
    """The smallest bucket that holds ``value`` (the largest bucket for anything bigger)."""
    for b in buckets:
        if value <= b:
            return b
    return buckets[-1]


def tree_bucket(tree_size: int) -> int:
    return bucket(tree_size, TREE_BUCKETS)


def batch_bucket(batch: int) -> int:
    return bucket(batch, BATCH_BUCKETS)


@dataclass(frozen=True, order=True)
class ShapeKey:
    """What a tuned config is keyed by (per tensor-parallel rank: hv and hk are that rank's heads)."""

    hv: int
    hk: int
    dk: int
    dv: int
    dtype: str
    tree_bucket: int
    batch_bucket: int
    tp: int = 1

    @property
    def text(self) -> str:
        tp = f"-TP{self.tp}" if self.tp != 1 else ""
        return (f"Hv{self.hv}-Hk{self.hk}-dk{self.dk}-dv{self.dv}-{self.dtype}"
                f"-T{self.tree_bucket}-B{self.batch_bucket}{tp}")

    @property
    def head_key(self) -> tuple:
        return (self.hv, self.hk, self.dk, self.dv, self.dtype, self.tp)

    def as_dict(self) -> dict:
        return {"hv": self.hv, "hk": self.hk, "dk": self.dk, "dv": self.dv, "dtype": self.dtype,
                "tree_bucket": self.tree_bucket, "batch_bucket": self.batch_bucket, "tp": self.tp}

    @classmethod
    def from_dict(cls, data: dict, where: str = "key") -> "ShapeKey":
        if not isinstance(data, dict):
            raise DatabaseError(f"{where}: expected a mapping, got {data!r}")
        values = {}
        for name in ("hv", "hk", "dk", "dv", "tree_bucket", "batch_bucket"):
            value = data.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise DatabaseError(f"{where}.{name}: expected a positive int, got {value!r}")
            values[name] = value
        tp = data.get("tp", 1)
        if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
            raise DatabaseError(f"{where}.tp: expected a positive int, got {tp!r}")
        if data.get("dtype") not in DTYPE_NAMES:
            raise DatabaseError(f"{where}.dtype: expected one of {DTYPE_NAMES}, got {data.get('dtype')!r}")
        if values["tree_bucket"] not in TREE_BUCKETS:
            raise DatabaseError(f"{where}.tree_bucket: expected one of {TREE_BUCKETS}, got {values['tree_bucket']}")
        if values["batch_bucket"] not in BATCH_BUCKETS:
            raise DatabaseError(f"{where}.batch_bucket: expected one of {BATCH_BUCKETS}, got {values['batch_bucket']}")
        return cls(dtype=data["dtype"], tp=tp, **values)


def default_directory() -> Path:
    """Where `bole-tune profile` writes: ``$BOLE_TUNE_DB``, else the user's data folder."""
    env = os.environ.get("BOLE_TUNE_DB")
    if env:
        return Path(env)
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "bole-tune" / "tuning_db"


def search_directories() -> list[Path]:
    """Where the runtime looks, in order: ``$BOLE_TUNE_DB`` alone if set, else the user's folder
    and then the database shipped with bole-tune."""
    env = os.environ.get("BOLE_TUNE_DB")
    if env:
        return [Path(env)]
    return [default_directory(), SHIPPED_DIR]


def database_path(slug: str, directory=None) -> Path:
    return Path(directory or default_directory()) / f"{slug}.yaml"


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def empty(device: dict | None = None) -> dict:
    return {"schema_version": SCHEMA_VERSION, "device": device or {}, **{s: {} for s in SECTIONS}}


# ---- validation -------------------------------------------------------------------------------

def _mapping(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise DatabaseError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _number(value, where: str, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and not value > 0):
        raise DatabaseError(f"{where}: expected a {'positive ' if positive else ''}number, got {value!r}")
    return float(value)


def _latency(value, where: str) -> None:
    value = _mapping(value, where)
    for q in ("p20", "p50", "p80"):
        _number(value.get(q), f"{where}.{q}")


def _config(value, where: str):
    from bole_tune.config import KernelConfig

    value = _mapping(value, where)
    unknown = set(value) - {"b_k", "b_v", "num_warps", "num_stages"}
    if unknown:
        raise DatabaseError(f"{where}.{sorted(unknown)[0]}: unknown field")
    try:
        return KernelConfig(**value)
    except (TypeError, ValueError) as error:
        raise DatabaseError(f"{where}: {error}") from None


def validate(data, path) -> dict:
    """Check a loaded database; return it. Raises `DatabaseError` naming ``path`` and the field."""
    where = str(path)
    data = _mapping(data, where)
    version = data.get("schema_version")
    if version not in SUPPORTED_SCHEMA_VERSIONS:
        raise DatabaseError(f"{where}: schema_version {version!r} is not understood "
                            f"(this bole-tune reads versions {list(SUPPORTED_SCHEMA_VERSIONS)})")
    unknown = set(data) - {"schema_version", "device", *SECTIONS}
    if unknown:
        raise DatabaseError(f"{where}: {sorted(unknown)[0]}: unknown top-level field")
    _mapping(data.get("device", {}), f"{where}: device")
    for section in SECTIONS:
        _mapping(data.get(section, {}), f"{where}: {section}")
    for name, entry in data.get("configs", {}).items():
        w = f"{where}: configs.{name}"
        entry = _mapping(entry, w)
        key = ShapeKey.from_dict(entry.get("key"), f"{w}.key")
        if key.text != name:
            raise DatabaseError(f"{w}.key: describes {key.text}, not {name}")
        _config(entry.get("config"), f"{w}.config")
        _latency(entry.get("latency_us"), f"{w}.latency_us")
        if "default_config" in entry:
            _config(entry["default_config"], f"{w}.default_config")
            _latency(entry.get("default_latency_us"), f"{w}.default_latency_us")
        _mapping(entry.get("provenance"), f"{w}.provenance")
        _mapping(entry.get("trials", {}), f"{w}.trials")
    for name, curve in data.get("curves", {}).items():
        w = f"{where}: curves.{name}"
        curve = _mapping(curve, w)
        for field_name in ("model", "kernel", "dtype"):
            if not isinstance(curve.get(field_name), str):
                raise DatabaseError(f"{w}.{field_name}: expected a string, got {curve.get(field_name)!r}")
        points = curve.get("points")
        if not isinstance(points, list) or not points:
            raise DatabaseError(f"{w}.points: expected a non-empty list")
        for i, point in enumerate(points):
            point = _mapping(point, f"{w}.points[{i}]")
            for field_name in ("batch", "tree_size"):
                _number(point.get(field_name), f"{w}.points[{i}].{field_name}")
            _latency(point, f"{w}.points[{i}]")
        _mapping(curve.get("provenance"), f"{w}.provenance")
    for section in ("budgets", "step_curves"):
        for name, entry in data.get(section, {}).items():
            entry = _mapping(entry, f"{where}: {section}.{name}")
            _mapping(entry.get("provenance"), f"{where}: {section}.{name}.provenance")
    return data


# ---- reading and writing ----------------------------------------------------------------------

def load(path) -> dict:
    """Read and validate one database file."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise DatabaseError(f"{path}: no such tuning database") from None
    except OSError as error:
        raise DatabaseError(f"{path}: cannot be read ({error})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise DatabaseError(f"{path}: is corrupt (not valid YAML: {str(error).splitlines()[0]})") from None
    if data is None:
        raise DatabaseError(f"{path}: is empty or truncated")
    return validate(data, path)


def _lock(path: Path) -> FileLock:
    return FileLock(str(path) + ".lock", timeout=300)


def backup_corrupt(path: Path) -> Path:
    """Copy an unreadable database aside (never overwritten) and return the copy's path."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    backup = path.with_name(f"{path.name}.corrupt-{stamp}")
    shutil.copy2(path, backup)
    return backup


def merge_curve(old: dict | None, new: dict) -> dict:
    """A curve measured again, perhaps at fewer points: the new points, plus the old curve's points at the
    (batch, tree size) pairs the new run did not measure, so a partial re-profile never drops a measurement.

    When points are kept, every point names the date of the run that measured it (``measured``) and the
    curve's provenance (the new run's) lists the earlier runs' under ``earlier_runs``.
    """
    if not old or old.get("shape") != new.get("shape") or old.get("kernel") != new.get("kernel"):
        return new
    fresh = {(p["batch"], p["tree_size"]) for p in new["points"]}
    old_provenance = old.get("provenance") or {}
    kept = [{**p, "measured": p.get("measured", old_provenance.get("date", ""))} for p in old["points"]
            if (p["batch"], p["tree_size"]) not in fresh]
    if not kept:
        return new
    provenance = dict(new.get("provenance") or {})
    earlier = list(old_provenance.get("earlier_runs", []))
    earlier.append({k: v for k, v in old_provenance.items() if k != "earlier_runs"})
    provenance["earlier_runs"] = earlier
    points = [{**p, "measured": p.get("measured", provenance.get("date", ""))} for p in new["points"]] + kept
    return {**new, "points": sorted(points, key=lambda p: (p["batch"], p["tree_size"])), "provenance": provenance}


def update(path, device: dict | None = None, replace_corrupt: bool = False, **sections) -> dict:
    """Merge entries into the database at ``path`` (created if missing); returns the merged data.

    ``sections``: any of configs, curves, budgets, step_curves, each a mapping name -> entry.
    Entries replace those with the same name, except curves, whose points are merged (`merge_curve`);
    nothing else is dropped. A corrupt file is copied to a backup and the update refused, unless
    ``replace_corrupt`` (then the backup is kept and a new file started).
    """
    path = Path(path)
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"update: unknown section {sorted(unknown)[0]!r} (known: {SECTIONS})")
    path.parent.mkdir(parents=True, exist_ok=True)
    with _lock(path):
        if path.exists():
            try:
                data = load(path)
            except DatabaseError as error:
                backup = backup_corrupt(path)
                if not replace_corrupt:
                    raise DatabaseError(f"{error}. Nothing was written; a copy is kept at {backup}. "
                                        "Fix or remove the file, or pass --replace-corrupt to start a new one.") from None
                data = empty()
        else:
            data = empty()
        if device:
            data["device"] = device
        for section, entries in sections.items():
            if entries:
                held = data.setdefault(section, {})
                if section == "curves":
                    entries = {name: merge_curve(held.get(name), entry) for name, entry in entries.items()}
                held.update(entries)
        validate(data, path)
        write_text_atomic(path, yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=110))
    return data


def find(slug: str) -> tuple[Path, dict] | None:
    """The first database for ``slug`` in the runtime's search folders, loaded."""
    for directory in search_directories():
        path = database_path(slug, directory)
        if path.exists():
            return path, load(path)
    return None
