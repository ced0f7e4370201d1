"""The tuning database: one YAML file per GPU model, ``<folder>/<gpu-slug>.yaml``, and its one access layer.

Layout (schema version 1)::

    # bole-tune sha256 <digest of the lines below>: 108 configs, 40 curves, 48 budgets, 4 step_curves (...)
    schema_version: 1
    device: {slug, name, kind, source, facts: {...}}        # fingerprint of the last writer
    configs:                                               # best tile config per shape bucket
      Hv32-Hk16-dk128-dv128-bf16-T64-B16:
        key: {hv, hk, dk, dv, dtype, tree_bucket, batch_bucket, tp}
        config: {b_k, b_v, num_warps, num_stages}          # the knobs of KernelConfig
        kernel: fused                                      # the tree_verify variant it was tuned on
        latency_us: {p20, p50, p80}
        default_config: {...}
        default_latency_us: {p20, p50, p80}
        rel_error: 0.0018
        trials: {total, measured, wrong, infeasible, pruned}
        provenance: {device, driver, cuda, torch, triton, bole_tune, python, date, timing_method}
    curves:                                                # latency against tree size and batch
      Qwen3.5-9B/tree_verify_tuned/bf16: {model, kernel, dtype, shape, points: [...], provenance}
    budgets:                                               # tree-token budgets (see bole_tune.budget)
      Qwen3.5-9B/bf16/qwen3.5-mtp-mbpp/sglang: {model, dtype, tp, workload, engine, acceptance, step_curve,
          fixed_chain, batches: {B: {batch, serves, shape, nodes_per_request, parents, ranks, sglang, ...}},
          provenance}
    step_curves:                                           # whole verification step latency
      Qwen3.5-9B/bf16: {model, dtype, context, layers, points: [{batch, tree_size, step_us, ...}], provenance}
    commit_configs:                                        # best tree_commit launch per bucket and layer count
      Hv32-Hk16-dk128-dv128-bf16-T64-B16-L24:              # ShapeKey text + -L<layers one launch commits>
        key: {hv, hk, dk, dv, dtype, tree_bucket, batch_bucket, tp, layers}
        config: {b_k, b_v, v_span, num_warps, num_stages}  # the knobs of CommitConfig
        latency_us: {p20, p50, p80}                        # per launch (all its layers)
        default_config: {...}                              # the untuned fallback for this bucket
        default_latency_us: {p20, p50, p80}
        rel_error, trials, study, provenance               # as for configs

The commit's entries are keyed by the verification bucket they commit and by ``layers``, the GDN layers one
launch commits: 1 for `tree_commit` (one layer), L for `tree_commit_layers` over L stacked layers, which has
L times the programs of the one-layer launch and is tuned as a launch of its own (`bole_tune.lookup`
takes the nearest tuned launch by programs where the exact one is missing).

**Where the database is read from** (`search_directories`, one rule for the runtime lookup, `get_budget`
and every command): the folder given (``--db-dir``) or ``$BOLE_TUNE_DB`` alone, if set; else the user's
folder (``$XDG_DATA_HOME/bole-tune/tuning_db``), then the database shipped with bole-tune. `search`
merges the entries of every ``<slug>.yaml`` found, by name within each section: an entry in an earlier
folder wins over one of the same name in a later folder, all others are kept, and each entry remembers
the file it came from. Writes go to one file, in `default_directory` (or the folder given), never to the
shipped database unless its folder is given (``--db-dir``, ``$BOLE_TUNE_DB``). A GPU slug is a file name:
one with a path separator or a leading dot (``../../x``) is refused (`database_path`).

**Corrupt files**: every read validates the whole file; a file that is unreadable, not YAML, of an
unknown schema or with a bad field raises `DatabaseError` naming the file and the field. A key given twice
in one mapping (``configs:`` twice, two files concatenated) is refused with both lines, never read as "last
key wins" (`UniqueKeyLoader`). Every write puts a digest of the file's text on its first line, with what it
holds; a file whose text does not match (cut short at a line boundary, changed since) is refused. The
digest is optional: a file without one (hand-written, or older) is read as it is, and after editing a
written file by hand one deletes that line. The runtime's
config lookup in its ``nearest`` mode warns once and uses the safe default instead (``strict`` raises);
`get_budget` and the command line report the error. A write never replaces a corrupt file: it keeps a
copy (``<file>.corrupt-<time>``) and refuses, unless asked to replace it (``--replace-corrupt``).

**Concurrency**: every write takes a file lock, re-reads the file, merges (one rule, `update`: entries with
the same name are replaced, except curves and step curves, merged point by point; all others kept) and
replaces the file atomically (`bole_tune.atomic`: its mode kept, a symlink's target updated), so
concurrent writers lose nothing and a reader never sees half a file. Each file is parsed once per version (cached by path, modification time,
size and inode; `clear_cache` forgets).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from filelock import FileLock

from bole_tune.atomic import write_target, write_text_atomic
from bole_tune.config import CommitConfig, KernelConfig
from bole_tune.fingerprint import check_slug
from bole_tune.shapes import BATCH_BUCKETS, DTYPES, TREE_BUCKETS, HeadShape, batch_bucket, dtype_name, tree_bucket

SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = (1,)
SECTIONS = ("configs", "curves", "budgets", "step_curves", "commit_configs")
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "tuning_db"
if not SHIPPED_DIR.is_dir():  # installed layout: tuning_db/ is the package bole_tune.tuning_db
    SHIPPED_DIR = Path(__file__).resolve().parent / "tuning_db"


class DatabaseError(ValueError):
    """A tuning database file is unreadable, corrupt, of an unknown schema or has a bad field."""


def _positive_int(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise DatabaseError(f"{where}: expected a positive int, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True, order=True)
class ShapeKey:
    """What a tuned config is keyed by: one rank's heads (``tp``: the tensor-parallel degree they were
    tuned under), the dtype name and the tree and batch buckets."""

    heads: HeadShape
    dtype: str
    tree_bucket: int
    batch_bucket: int
    tp: int = 1
    fold: bool = False  # the folded verify (`tree_verify(..., pending=...)`): its own tuned entries
    ring: bool = False  # a `PendingRing`'s write round (its R rounds of pending tokens folded in): its own entries

    def __post_init__(self):
        if not isinstance(self.fold, bool):
            raise ValueError(f"ShapeKey.fold: expected True or False, got {self.fold!r}")
        if not isinstance(self.ring, bool):
            raise ValueError(f"ShapeKey.ring: expected True or False, got {self.ring!r}")
        if self.fold and self.ring:
            raise ValueError("ShapeKey.ring: a ring's write round or the folded verify (fold), not both")
        if not isinstance(self.heads, HeadShape):
            raise ValueError(f"ShapeKey.heads: expected a HeadShape, got {self.heads!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"ShapeKey.dtype: expected one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.tree_bucket not in TREE_BUCKETS:
            raise ValueError(f"ShapeKey.tree_bucket: expected one of {TREE_BUCKETS}, got {self.tree_bucket!r}")
        if self.batch_bucket not in BATCH_BUCKETS:
            raise ValueError(f"ShapeKey.batch_bucket: expected one of {BATCH_BUCKETS}, got {self.batch_bucket!r}")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp <= 0:
            raise ValueError(f"ShapeKey.tp: expected a positive int, got {self.tp!r}")

    @classmethod
    def bucketed(cls, heads: HeadShape, dtype, tree_size: int, batch: int, tp: int = 1,
                 fold: bool = False, ring: bool = False) -> "ShapeKey":
        """The key of a launch: ``dtype`` a name or a torch dtype, sizes put in their buckets."""
        name = dtype if isinstance(dtype, str) else dtype_name(dtype)
        return cls(heads=heads, dtype=name, tree_bucket=tree_bucket(tree_size), batch_bucket=batch_bucket(batch), tp=tp,
                   fold=fold, ring=ring)

    @property
    def text(self) -> str:
        h = self.heads
        tp = f"-TP{self.tp}" if self.tp != 1 else ""
        kind = "-fold" if self.fold else "-ring" if self.ring else ""
        return f"Hv{h.hv}-Hk{h.hk}-dk{h.dk}-dv{h.dv}-{self.dtype}-T{self.tree_bucket}-B{self.batch_bucket}{tp}{kind}"

    def as_dict(self) -> dict:
        h = self.heads
        data = {"hv": h.hv, "hk": h.hk, "dk": h.dk, "dv": h.dv, "dtype": self.dtype,
                "tree_bucket": self.tree_bucket, "batch_bucket": self.batch_bucket, "tp": self.tp}
        return {**data, "fold": True} if self.fold else {**data, "ring": True} if self.ring else data

    @property
    def verify_key(self) -> "ShapeKey":
        """The same bucket's key for the verify alone (itself when neither folded nor a ring's write round)."""
        return dataclasses.replace(self, fold=False, ring=False) if self.fold or self.ring else self

    @property
    def fold_key(self) -> "ShapeKey":
        """The same bucket's key for the folded verify (a ring's write round folds too: what it falls back to)."""
        return dataclasses.replace(self, fold=True, ring=False)

    @classmethod
    def from_dict(cls, data: dict, where: str = "key") -> "ShapeKey":
        if not isinstance(data, dict):
            raise DatabaseError(f"{where}: expected a mapping, got {data!r}")
        values = {name: _positive_int(data.get(name), f"{where}.{name}")
                  for name in ("hv", "hk", "dk", "dv", "tree_bucket", "batch_bucket")}
        values["tp"] = _positive_int(data.get("tp", 1), f"{where}.tp")
        for flag in ("fold", "ring"):
            values[flag] = data.get(flag, False)
            if not isinstance(values[flag], bool):
                raise DatabaseError(f"{where}.{flag}: expected true or false, got {values[flag]!r}")
        try:
            heads = HeadShape(hk=values.pop("hk"), hv=values.pop("hv"), dk=values.pop("dk"), dv=values.pop("dv"))
            return cls(heads=heads, dtype=data.get("dtype"), **values)
        except ValueError as error:
            field_error = str(error).split(".", 1)[1]  # "ShapeKey.dtype: ..." -> "dtype: ..."
            raise DatabaseError(f"{where}.{field_error}") from None


@dataclass(frozen=True, kw_only=True, order=True)
class CommitKey:
    """What a tuned commit config is keyed by: the bucket of the verification it commits (`ShapeKey`) and
    ``layers``, the GDN layers one launch commits (1: `tree_commit`; L: `tree_commit_layers` over L layers,
    a launch of L times the programs). Text: the shape's, then ``-L<layers>``."""

    shape: ShapeKey
    layers: int = 1

    def __post_init__(self):
        if not isinstance(self.shape, ShapeKey):
            raise ValueError(f"CommitKey.shape: expected a ShapeKey, got {self.shape!r}")
        if isinstance(self.layers, bool) or not isinstance(self.layers, int) or self.layers <= 0:
            raise ValueError(f"CommitKey.layers: expected a positive int, got {self.layers!r}")

    @classmethod
    def bucketed(cls, heads: HeadShape, dtype, tree_size: int, batch: int, layers: int = 1,
                 tp: int = 1) -> "CommitKey":
        """The key of a commit launch: sizes put in their buckets, ``layers`` as it is."""
        return cls(shape=ShapeKey.bucketed(heads, dtype, tree_size, batch, tp), layers=layers)

    # the shape's fields, so the tuner and the search space read a commit key as they read a shape key
    heads = property(lambda self: self.shape.heads)
    dtype = property(lambda self: self.shape.dtype)
    tree_bucket = property(lambda self: self.shape.tree_bucket)
    batch_bucket = property(lambda self: self.shape.batch_bucket)
    tp = property(lambda self: self.shape.tp)

    @property
    def programs_per_tile(self) -> int:
        """Layers x requests (the bucket) x value heads: what one launch's program count scales with."""
        return self.layers * self.shape.batch_bucket * self.shape.heads.hv

    @property
    def text(self) -> str:
        return f"{self.shape.text}-L{self.layers}"

    def as_dict(self) -> dict:
        return {**self.shape.as_dict(), "layers": self.layers}

    @classmethod
    def from_dict(cls, data: dict, where: str = "key") -> "CommitKey":
        if not isinstance(data, dict):
            raise DatabaseError(f"{where}: expected a mapping, got {data!r}")
        layers = _positive_int(data.get("layers"), f"{where}.layers")
        return cls(shape=ShapeKey.from_dict({k: v for k, v in data.items() if k != "layers"}, where), layers=layers)


def default_directory() -> Path:
    """Where commands write: ``$BOLE_TUNE_DB``, else the user's data folder."""
    env = os.environ.get("BOLE_TUNE_DB")
    if env:
        return Path(env)
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "bole-tune" / "tuning_db"


def search_directories(directory=None) -> list[Path]:
    """The folders read, in order (earlier ones win): ``directory`` alone if given, else ``$BOLE_TUNE_DB``
    alone if set, else the user's folder and then the database shipped with bole-tune."""
    if directory:
        return [Path(directory)]
    if os.environ.get("BOLE_TUNE_DB"):
        return [default_directory()]
    return [default_directory(), SHIPPED_DIR]


def database_path(slug: str, directory=None) -> Path:
    """The file of ``slug`` in ``directory``, else in `default_directory` (where commands write).

    A slug that is not a plain file name (a path separator, a leading dot: ``../../x``) raises ValueError
    naming it, so no name leads out of the folder. The shipped database is never the default: if the
    user's folder resolves to it, ValueError (it is written only when passed as ``directory`` or
    ``$BOLE_TUNE_DB``)."""
    check_slug(slug)
    if directory:
        return Path(directory) / f"{slug}.yaml"
    folder = default_directory()
    if not os.environ.get("BOLE_TUNE_DB") and write_target(folder) == write_target(SHIPPED_DIR):
        raise ValueError(f"{folder}: is the database shipped with bole-tune, which is written only when passed "
                         "as --db-dir or $BOLE_TUNE_DB")
    return folder / f"{slug}.yaml"


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
    """A number; ``positive``: > 0, else >= 0."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not -float("inf") < value < float("inf")
            or (positive and not value > 0) or (not positive and not value >= 0)):
        raise DatabaseError(f"{where}: expected a finite {'positive' if positive else 'non-negative'} number, "
                            f"got {value!r}")
    return float(value)


def _count(value, where: str, positive: bool = True) -> int:
    """An int; ``positive``: > 0, else >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < (1 if positive else 0):
        raise DatabaseError(f"{where}: expected a {'positive' if positive else 'non-negative'} int, got {value!r}")
    return value


def _string(value, where: str) -> str:
    if not isinstance(value, str):
        raise DatabaseError(f"{where}: expected a string, got {value!r}")
    return value


def _latency(value, where: str) -> None:
    value = _mapping(value, where)
    for q in ("p20", "p50", "p80"):
        _number(value.get(q), f"{where}.{q}")


def _config(value, where: str) -> KernelConfig:
    try:
        return KernelConfig.from_dict(_mapping(value, where))
    except (TypeError, ValueError) as error:
        raise DatabaseError(f"{where}.{error}") from None


def _commit_config(value, where: str) -> CommitConfig:
    try:
        return CommitConfig.from_dict(_mapping(value, where))
    except (TypeError, ValueError) as error:
        raise DatabaseError(f"{where}.{error}") from None


def _batch_key(value, where: str) -> int:
    """A batch size used as a mapping key: an int, or the int's text (JSON round trips make keys strings)."""
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return _count(value, where)


def _config_entry(name: str, entry, w: str) -> None:
    entry = _mapping(entry, w)
    key = ShapeKey.from_dict(entry.get("key"), f"{w}.key")
    if key.text != name:
        raise DatabaseError(f"{w}.key: describes {key.text}, not {name}")
    _config(entry.get("config"), f"{w}.config")
    _latency(entry.get("latency_us"), f"{w}.latency_us")
    if "kernel" in entry:
        from bole_tune.kernels.verify.planner import VARIANTS  # the kernels the runtime can launch

        if _string(entry["kernel"], f"{w}.kernel") not in VARIANTS:
            raise DatabaseError(f"{w}.kernel: expected one of {', '.join(VARIANTS)}, got {entry['kernel']!r}")
    if "default_config" in entry:
        _config(entry["default_config"], f"{w}.default_config")
        _latency(entry.get("default_latency_us"), f"{w}.default_latency_us")
    _mapping(entry.get("provenance"), f"{w}.provenance")
    _mapping(entry.get("trials", {}), f"{w}.trials")


def _commit_entry(name: str, entry, w: str) -> None:
    """What `bole_tune.lookup.decide_commit` reads of a commit entry (and what the tuner writes)."""
    entry = _mapping(entry, w)
    key = CommitKey.from_dict(entry.get("key"), f"{w}.key")
    if key.text != name:
        raise DatabaseError(f"{w}.key: describes {key.text}, not {name}")
    config = _commit_config(entry.get("config"), f"{w}.config")
    if not config.fits(key.heads.dk, key.heads.dv):
        raise DatabaseError(f"{w}.config: tiles b_k={config.b_k}, v_span={config.v_span} do not divide "
                            f"dk={key.heads.dk}, dv={key.heads.dv}")
    _latency(entry.get("latency_us"), f"{w}.latency_us")
    if "default_config" in entry:
        _commit_config(entry["default_config"], f"{w}.default_config")
        _latency(entry.get("default_latency_us"), f"{w}.default_latency_us")
    if "rel_error" in entry and entry["rel_error"] is not None:
        _number(entry["rel_error"], f"{w}.rel_error", positive=False)
    _mapping(entry.get("provenance"), f"{w}.provenance")
    _mapping(entry.get("trials", {}), f"{w}.trials")


def _curve(curve, w: str) -> None:
    curve = _mapping(curve, w)
    for field_name in ("model", "kernel", "dtype"):
        _string(curve.get(field_name), f"{w}.{field_name}")
    points = curve.get("points")
    if not isinstance(points, list) or not points:
        raise DatabaseError(f"{w}.points: expected a non-empty list")
    for i, point in enumerate(points):
        point = _mapping(point, f"{w}.points[{i}]")
        for field_name in ("batch", "tree_size"):
            _count(point.get(field_name), f"{w}.points[{i}].{field_name}")
        _latency(point, f"{w}.points[{i}]")
    _mapping(curve.get("provenance"), f"{w}.provenance")


STEP_POINT_TIMES = ("step_us", "gdn_us", "attention_us", "lm_head_us")
STEP_POINT_OPTIONAL_TIMES = ("gdn_serial_us", "step_serial_us")


def _step_curve(curve, w: str) -> None:
    """What `bole_tune.budget.StepCurve`, ``budget`` and ``report`` read of a step curve."""
    curve = _mapping(curve, w)
    _string(curve.get("model"), f"{w}.model")
    if curve.get("dtype") not in DTYPES:
        raise DatabaseError(f"{w}.dtype: expected one of {', '.join(DTYPES)}, got {curve.get('dtype')!r}")
    if "context" in curve:
        _count(curve["context"], f"{w}.context")
    if "layers" in curve:
        layers = _mapping(curve["layers"], f"{w}.layers")
        for name in ("gdn", "attention"):
            _count(layers.get(name), f"{w}.layers.{name}", positive=False)
    points = curve.get("points")
    if not isinstance(points, list) or not points:
        raise DatabaseError(f"{w}.points: expected a non-empty list")
    seen = set()
    for i, point in enumerate(points):
        p = f"{w}.points[{i}]"
        point = _mapping(point, p)
        batch, size = _count(point.get("batch"), f"{p}.batch"), _count(point.get("tree_size"), f"{p}.tree_size")
        if (batch, size) in seen:
            raise DatabaseError(f"{p}: a second point at batch {batch}, tree size {size}")
        seen.add((batch, size))
        if _count(point.get("tokens"), f"{p}.tokens") != batch * size:
            raise DatabaseError(f"{p}.tokens: expected batch x tree_size = {batch * size}, got {point['tokens']}")
        for name in STEP_POINT_TIMES:
            _number(point.get(name), f"{p}.{name}", positive=name == "step_us")
        for name in STEP_POINT_OPTIONAL_TIMES:
            if name in point:
                _number(point[name], f"{p}.{name}")
        if "attention_kernel" in point:
            _string(point["attention_kernel"], f"{p}.attention_kernel")
        if "gdn_round" in point:
            _string(point["gdn_round"], f"{p}.gdn_round")
        if "gdn_rounds_us" in point:
            for name, value in _mapping(point["gdn_rounds_us"], f"{p}.gdn_rounds_us").items():
                _number(value, f"{p}.gdn_rounds_us.{name}")
        if "attention_variants_us" in point:
            for name, value in _mapping(point["attention_variants_us"], f"{p}.attention_variants_us").items():
                _number(value, f"{p}.attention_variants_us.{name}", positive=False)
    _mapping(curve.get("provenance"), f"{w}.provenance")


BUDGET_ENGINES = ("sglang", "vllm", "bole")
BUDGET_COUNTS = ("batch", "tokens", "nodes_per_request")
BUDGET_SIZES = ("draft_tokens", "depth", "width")
BUDGET_NUMBERS = ("expected_accepted", "step_us", "draft_us")
BUDGET_POSITIVE_NUMBERS = ("expected_tokens_per_round", "tokens_per_second", "speedup_vs_no_speculation",
                           "speedup_vs_fixed_chain")
SGLANG_FLAGS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")


def _probabilities(values, where: str, empty: bool = False) -> None:
    if not isinstance(values, list) or (not values and not empty):
        raise DatabaseError(f"{where}: expected a {'' if empty else 'non-empty '}list of probabilities, got {values!r}")
    for i, value in enumerate(values):
        if _number(value, f"{where}[{i}]", positive=False) > 1:
            raise DatabaseError(f"{where}[{i}]: expected a probability in [0, 1], got {value!r}")


def _budget_engine_settings(entry: dict, p: str, engine: str) -> None:
    """The engine's own settings of a batch entry, consistent with the tree it describes."""
    n = entry["nodes_per_request"]
    for other in ("sglang", "vllm"):
        if other != engine and other in entry:
            raise DatabaseError(f"{p}.{other}: a {engine} budget carries no {other} settings")
    if engine == "vllm":
        k = _count(_mapping(entry.get("vllm"), f"{p}.vllm").get("num_speculative_tokens"),
                   f"{p}.vllm.num_speculative_tokens")
        if k != n - 1 or entry["shape"] != "chain":
            raise DatabaseError(f"{p}.vllm.num_speculative_tokens: {k} does not describe a chain of "
                                f"nodes_per_request - 1 = {n - 1} tokens")
    elif engine == "sglang":
        flags = _mapping(entry.get("sglang"), f"{p}.sglang")
        steps, topk, draft = (_count(flags.get(f), f"{p}.sglang.{f}") for f in SGLANG_FLAGS)
        if draft != n:
            raise DatabaseError(f"{p}.sglang.speculative_num_draft_tokens: {draft} != nodes_per_request {n}")
        if topk == 1 and draft != steps + 1:
            raise DatabaseError(f"{p}.sglang.speculative_num_draft_tokens: with topk 1 SGLang uses num_steps + 1 "
                                f"= {steps + 1}, not {draft}")
        if draft - 1 > topk + (steps - 1) * topk * topk or entry["depth"] > steps:
            raise DatabaseError(f"{p}.sglang: {steps} steps of top-{topk} beam search cannot propose this tree")


def _budget_batch(entry, p: str, batch: int, engine: str) -> tuple[int, object]:
    """Check one batch entry; return its ``serves`` range."""
    entry = _mapping(entry, p)
    for name in BUDGET_COUNTS:
        _count(entry.get(name), f"{p}.{name}")
    for name in BUDGET_SIZES:
        _count(entry.get(name), f"{p}.{name}", positive=False)
    for name in BUDGET_NUMBERS:
        _number(entry.get(name), f"{p}.{name}", positive=False)
    for name in BUDGET_POSITIVE_NUMBERS:
        _number(entry.get(name), f"{p}.{name}")
    if entry["batch"] != batch:
        raise DatabaseError(f"{p}.batch: {entry['batch']} under the key {batch}")
    if entry["tokens"] != batch * entry["nodes_per_request"]:
        raise DatabaseError(f"{p}.tokens: expected batch x nodes_per_request = {batch * entry['nodes_per_request']}, "
                            f"got {entry['tokens']}")
    if entry.get("shape") not in ("chain", "tree"):
        raise DatabaseError(f"{p}.shape: expected 'chain' or 'tree', got {entry.get('shape')!r}")
    drafts = entry["draft_tokens"]
    if drafts != entry["nodes_per_request"] - 1:
        raise DatabaseError(f"{p}.draft_tokens: expected nodes_per_request - 1, got {drafts}")
    if abs(entry["expected_tokens_per_round"] - 1 - entry["expected_accepted"]) > 1e-3:
        raise DatabaseError(f"{p}.expected_tokens_per_round: expected 1 + expected_accepted")
    for name in ("parents", "ranks"):
        values = entry.get(name)
        if not isinstance(values, list) or len(values) != drafts:
            raise DatabaseError(f"{p}.{name}: expected a list of {drafts} ints, got {values!r}")
    depths = []
    for i, (parent, rank) in enumerate(zip(entry["parents"], entry["ranks"])):
        if isinstance(parent, bool) or not isinstance(parent, int) or not -1 <= parent < i:
            raise DatabaseError(f"{p}.parents[{i}]: expected -1 or an earlier node, got {parent!r}")
        _count(rank, f"{p}.ranks[{i}]")
        depths.append(1 if parent < 0 else depths[parent] + 1)
    if entry["depth"] != max(depths, default=0):
        raise DatabaseError(f"{p}.depth: the tree's parents give depth {max(depths, default=0)}")
    if entry["width"] != max((depths.count(d) for d in set(depths)), default=0):
        raise DatabaseError(f"{p}.width: not the most nodes at one depth of the tree's parents")
    if (entry["shape"] == "chain") != (entry["width"] <= 1):
        raise DatabaseError(f"{p}.shape: {entry['shape']!r} but the tree's width is {entry['width']}")
    _budget_engine_settings(entry, p, engine)
    if "gdn_round" in entry:
        _string(entry["gdn_round"], f"{p}.gdn_round")
    served = entry.get("serves")
    if (not isinstance(served, list) or len(served) != 2 or
            (served[1] is not None and _count(served[1], f"{p}.serves[1]") != batch)):
        raise DatabaseError(f"{p}.serves: expected [low, {batch}] (or [low, null] for the largest batch), got {served!r}")
    return _count(served[0], f"{p}.serves[0]"), served[1]


def _budget(name: str, budget, w: str) -> None:
    """What `get_budget`, the engine exports and ``report`` read of a budget (see `bole_tune.budget`)."""
    budget = _mapping(budget, w)
    engine = budget.get("engine")
    if engine not in BUDGET_ENGINES:
        raise DatabaseError(f"{w}.engine: expected one of {', '.join(BUDGET_ENGINES)}, got {engine!r}")
    _string(budget.get("model"), f"{w}.model")
    _string(budget.get("workload"), f"{w}.workload")
    if budget.get("dtype") not in DTYPES:
        raise DatabaseError(f"{w}.dtype: expected one of {', '.join(DTYPES)}, got {budget.get('dtype')!r}")
    tp = _count(budget.get("tp"), f"{w}.tp")
    expected = (f"{budget['model']}/{budget['dtype']}" + (f"/TP{tp}" if tp != 1 else "")
                + f"/{budget['workload']}/{engine}")
    if name != expected:
        raise DatabaseError(f"{w}: the name of a budget is <model>/<dtype>[/TP<n>]/<workload>/<engine>; its fields "
                            f"say {expected}")
    acceptance = _mapping(budget.get("acceptance"), f"{w}.acceptance")
    _string(acceptance.get("name"), f"{w}.acceptance.name")
    _probabilities(acceptance.get("depth_acceptance"), f"{w}.acceptance.depth_acceptance")
    _probabilities(acceptance.get("alternative_share"), f"{w}.acceptance.alternative_share", empty=True)
    _probabilities([acceptance.get("branch_continuation")], f"{w}.acceptance.branch_continuation")
    _count(budget.get("fixed_chain"), f"{w}.fixed_chain", positive=False)
    _string(budget.get("step_curve"), f"{w}.step_curve")
    batches = _mapping(budget.get("batches"), f"{w}.batches")
    if not batches:
        raise DatabaseError(f"{w}.batches: expected at least one batch size")
    ranges = {}
    for key, entry in batches.items():
        batch = _batch_key(key, f"{w}.batches.{key}")
        ranges[batch] = (key, _budget_batch(entry, f"{w}.batches.{key}", batch, engine))
    previous = 0
    for i, batch in enumerate(sorted(ranges)):
        key, (low, high) = ranges[batch]
        last = i == len(ranges) - 1
        if low != previous + 1 or (high is None) != last:
            raise DatabaseError(f"{w}.batches.{key}.serves: expected [{previous + 1}, {'null' if last else batch}] "
                                "(each bucket serves the batch sizes above the previous one up to its own; the "
                                "largest every size above)")
        previous = batch
    _mapping(budget.get("provenance"), f"{w}.provenance")


_SECTION_CHECKS = {"curves": lambda name, entry, w: _curve(entry, w), "configs": _config_entry,
                   "commit_configs": _commit_entry, "budgets": _budget,
                   "step_curves": lambda name, entry, w: _step_curve(entry, w)}


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
        for name, entry in _mapping(data.get(section, {}), f"{where}: {section}").items():
            _SECTION_CHECKS[section](name, entry, f"{where}: {section}.{name}")
    return data


# ---- reading ----------------------------------------------------------------------------------

_parsed: dict = {}  # resolved path -> ((mtime_ns, size, inode), data)


def clear_cache() -> None:
    """Forget every parsed file (the next read parses again)."""
    _parsed.clear()


class DuplicateKey(yaml.YAMLError):
    """A mapping names the same key twice (`UniqueKeyLoader`)."""

    def __init__(self, key, first: int, line: int):
        super().__init__(f"line {line}: key {key!r} given a second time (first at line {first})")
        self.key, self.first, self.line = key, first, line


_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser where installed: 7x faster
_SafeDumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # (0.6 s against 4.6 s for the shipped file)


class UniqueKeyLoader(_SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping (``configs:`` twice, two hosts' files
    concatenated) raises `DuplicateKey` instead of the second silently replacing the first."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # << merges are YAML's own override rule
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    if key in seen:
                        raise DuplicateKey(key, seen[key], key_node.start_mark.line + 1)
                    seen[key] = key_node.start_mark.line + 1
                except TypeError:  # an unhashable key: the safe loader reports it
                    continue
        return super().construct_mapping(node, deep)


DIGEST_LINE = re.compile(r"# bole-tune sha256 ([0-9a-f]{64}): ([^(\n]*)")


def _digest(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()


def dump(data: dict) -> str:
    """The text of a database file: a first line with the sha256 of the rest and what it holds, then the YAML."""
    body = yaml.dump(data, Dumper=_SafeDumper, sort_keys=False, default_flow_style=None, width=110)
    counts = ", ".join(f"{len(data.get(s) or {})} {s}" for s in SECTIONS)
    return (f"# bole-tune sha256 {_digest(body)}: {counts} (of the lines below: a file cut short or changed is "
            "refused; after editing it by hand, delete this line)\n" + body)


def _check_digest(text: str, path: Path) -> None:
    """A file whose first line is a digest must match it (a file without one, hand-written, is not checked)."""
    if not text.startswith("# bole-tune sha256"):
        return
    first, _, body = text.partition("\n")
    match = DIGEST_LINE.match(first)
    if match is None:
        raise DatabaseError(f"{path}: line 1: not a bole-tune digest line; delete it if the file was edited by hand")
    if _digest(body) != match.group(1):
        raise DatabaseError(f"{path}: its text does not match the digest on line 1 (written holding "
                            f"{match.group(2).strip()}): cut short or changed since bole-tune wrote it. If you edited "
                            "it by hand, delete line 1")


def _parse(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DatabaseError(f"{path}: no such tuning database") from None
    except UnicodeDecodeError:
        raise DatabaseError(f"{path}: is corrupt (not UTF-8 text)") from None
    except OSError as error:
        raise DatabaseError(f"{path}: cannot be read ({error})") from None
    _check_digest(text, path)
    try:
        data = yaml.load(text, Loader=UniqueKeyLoader)
    except DuplicateKey as error:
        raise DatabaseError(f"{path}: {error}; read as 'last key wins' the first would be lost: merge the two by "
                            "hand") from None
    except yaml.YAMLError as error:
        raise DatabaseError(f"{path}: is corrupt (not valid YAML: {str(error).splitlines()[0]})") from None
    if data is None:
        raise DatabaseError(f"{path}: is empty or truncated")
    data = validate(data, path)
    for section in SECTIONS:
        data.setdefault(section, {})
    return data


def load(path) -> dict:
    """Read and validate one database file, parsed once per version of the file (the result is shared:
    do not modify it). Raises `DatabaseError` naming the file and the field."""
    path = Path(path)
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise DatabaseError(f"{path}: no such tuning database") from None
    except OSError as error:
        raise DatabaseError(f"{path}: cannot be read ({error})") from None
    version = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
    cache_key = str(path.resolve())
    hit = _parsed.get(cache_key)
    if hit is not None and hit[0] == version:
        return hit[1]
    data = _parse(path)
    _parsed[cache_key] = (version, data)
    return data


@dataclass(frozen=True)
class Found:
    """The database of one GPU model as read: every ``<slug>.yaml`` in the search folders, merged."""

    slug: str
    folders: tuple[Path, ...]  # searched, in order
    files: tuple[Path, ...]  # found, in search order
    device: dict = field(default_factory=dict)  # of the first file found
    sections: dict = field(default_factory=dict)  # section -> {name: entry}
    sources: dict = field(default_factory=dict)  # (section, name) -> the file the entry came from

    @property
    def where(self) -> str:
        """The files read, or where none was found (for messages)."""
        if self.files:
            return ", ".join(map(str, self.files))
        return f"no {self.slug}.yaml in {', '.join(map(str, self.folders))}"

    def entries(self, section: str) -> dict:
        return self.sections.get(section, {})

    def source(self, section: str, name: str) -> Path:
        return self.sources[(section, name)]

    def as_data(self) -> dict:
        """The merged entries in the layout of one database file."""
        return {"schema_version": SCHEMA_VERSION, "device": self.device, **{s: self.entries(s) for s in SECTIONS}}


def search(slug: str, directory=None) -> Found:
    """Every database of ``slug`` in `search_directories` (``directory``: that folder alone), merged by
    entry name, earlier folders winning. A corrupt file raises `DatabaseError` naming it."""
    folders = tuple(search_directories(directory))
    files = tuple(p for p in (database_path(slug, folder) for folder in folders) if p.exists())
    sections = {s: {} for s in SECTIONS}
    sources = {}
    device = {}
    for path in reversed(files):  # the later folders first, so that earlier ones overwrite them
        data = load(path)
        device = data.get("device") or device
        for section in SECTIONS:
            for name, entry in data[section].items():
                sections[section][name] = entry
                sources[(section, name)] = path
    return Found(slug, folders, files, device, sections, sources)


# ---- writing ----------------------------------------------------------------------------------

def _lock(path: Path) -> FileLock:
    """The lock of the file a write replaces (a symlinked database and its target share one)."""
    return FileLock(str(write_target(path)) + ".lock", timeout=300)


def backup_corrupt(path: Path) -> Path:
    """Copy an unreadable database aside (never overwritten) and return the copy's path."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    backup = path.with_name(f"{path.name}.corrupt-{stamp}")
    shutil.copy2(path, backup)
    return backup


def prepare(path, replace_corrupt: bool = False) -> str | None:
    """Check ``path`` before a long run that will write it, so a corrupt file is found first, not last.

    A corrupt file is copied aside and `DatabaseError` raised; with ``replace_corrupt`` the file is
    removed instead (the copy kept) and a note saying so returned for the user. None: nothing to say.
    """
    path = Path(path)
    if not path.exists():
        return None
    try:
        _parse(path)
    except DatabaseError as error:
        backup = backup_corrupt(path)
        if not replace_corrupt:
            raise DatabaseError(f"{error}. A copy is kept at {backup}; fix or remove the file, or pass "
                                "--replace-corrupt to start a new one.") from None
        path.unlink()
        return f"{error}; a copy is kept at {backup} and a new database is started."
    return None


# The fields of a curve that say what its points measure, per section merged point by point: curves that
# agree on those present in both are merged point by point; others measure something else and replace.
POINT_IDENTITY = {"curves": ("shape", "kernel"), "step_curves": ("context", "layers")}


def _point_key(point: dict) -> tuple:
    return point["batch"], point["tree_size"]


def merge_points(old: dict | None, new: dict, identity=POINT_IDENTITY["curves"]) -> dict:
    """A curve (or step curve) measured again, perhaps at other or fewer points: the new points, plus the old
    curve's points at the (batch, tree size) pairs the new run did not measure, so a partial or concurrent
    run never drops a measurement. ``identity``: the fields both must agree on (where both have them) to
    be merged; a curve that disagrees measures something else and replaces the old one.

    When points are kept, every point names the date of the run that measured it (``measured``) and the
    curve's provenance (the new run's) lists, under ``earlier_runs``, the provenance of each earlier run
    that still measured one of its points.
    """
    if not old or any(f in old and f in new and old[f] != new[f] for f in identity):
        return new
    fresh = {_point_key(p) for p in new["points"]}
    old_provenance = old.get("provenance") or {}
    kept = [{**p, "measured": p.get("measured", old_provenance.get("date", ""))} for p in old["points"]
            if _point_key(p) not in fresh]
    if not kept:
        return new
    provenance = {k: v for k, v in (new.get("provenance") or {}).items() if k != "earlier_runs"}
    owners = {p["measured"] for p in kept} - {provenance.get("date")}
    earlier = []
    for run in [*old_provenance.get("earlier_runs", []), {k: v for k, v in old_provenance.items()
                                                          if k != "earlier_runs"}]:
        if run.get("date") in owners and run not in earlier:
            earlier.append(run)
    if earlier:
        provenance["earlier_runs"] = earlier
    points = [{**p, "measured": p.get("measured", provenance.get("date", ""))} for p in new["points"]] + kept
    return {**new, "points": sorted(points, key=_point_key), "provenance": provenance}


def update(path, device: dict | None = None, replace_corrupt: bool = False, **sections) -> dict:
    """Merge entries into the database at ``path`` (created if missing); returns the merged data.

    ``sections``: any of configs, curves, budgets, step_curves, commit_configs, each a mapping name -> entry.
    One rule: an entry replaces the one of the same name (a config is one bucket's winner, a budget one
    choice), except in the sections of measured points (curves, step curves: `POINT_IDENTITY`), whose
    points are merged by (batch, tree size) (`merge_points`); nothing else is dropped. A corrupt file is copied to a backup and the update refused, unless
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
                data = _parse(path)  # under the lock, from the disk: never the shared parsed copy
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
                if section in POINT_IDENTITY:
                    entries = {name: merge_points(held.get(name), entry, POINT_IDENTITY[section])
                               for name, entry in entries.items()}
                held.update(entries)
        validate(data, path)
        write_text_atomic(path, dump(data))
    return data
