"""What measures a tile config for the tuner: the GPU, or a replay of recorded measurements.

`GPURunner` checks each candidate against the float64 reference on the bucket's shape (a wrong
config is reported as ``wrong`` and never timed), then times it: a `KernelConfig` of `tree_verify` on a
`ShapeKey`, or a `CommitConfig` of `tree_commit` / `tree_commit_layers` on a `CommitKey` (checked against
`commit_closed_form`, `bole_tune.commit_bench`). Compile failures, out-of-resources
and out-of-memory are ``infeasible``; the search goes on. `ReplayRunner` answers from a file of
recorded measurements, so the whole tuning loop runs and is tested on a CPU; `RecordingRunner`
writes such a file while it measures.
"""

from __future__ import annotations

import dataclasses
import json
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bole_tune.atomic import write_text_atomic
from bole_tune.bench import BenchCase, CaseBench
from bole_tune.config import RING_ROUNDS, CommitConfig, KernelConfig
from bole_tune.database import CommitKey, ShapeKey
from bole_tune.fingerprint import Fingerprint, check_slug, fingerprint
from bole_tune.kernels import PLANNER, PendingRing, tree_verify
from bole_tune.kernels.verify.gluon import MAX_RING_WIDTH, gluon_ring_rounds
from bole_tune.kernels.verify.gluon import UNTUNED_CONFIG as GLUON_UNTUNED_CONFIG
from bole_tune.kernels.verify.planner import gluon_device_refusal
from bole_tune.search_space import gluon_bucket_refusal
from bole_tune.kernels.verify.self_check import accepted_error
from bole_tune.shapes import torch_dtype

STATUSES = ("ok", "wrong", "infeasible")


@dataclass(frozen=True)
class Measurement:
    status: str  # ok, wrong, infeasible
    p20_us: float = 0.0
    p50_us: float = 0.0
    p80_us: float = 0.0
    rel_error: float | None = None
    message: str = ""
    method: str = ""

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Measurement":
        if data.get("status") not in STATUSES:
            raise ValueError(f"status: expected one of {STATUSES}, got {data.get('status')!r}")
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


class DeviceLost(RuntimeError):
    """The GPU context is unusable (an illegal memory access, say); the run must restart to resume."""


def config_text(config: KernelConfig | CommitConfig) -> str:
    """How recordings name a config: its ``text`` (``"64/32/4/2"``; a commit's ``"128/16/128/2/3"``)."""
    return config.text


DEVICE_LOST_SIGNS = ("illegal memory access", "unspecified launch failure", "misaligned address",
                     "illegal instruction")


class GPURunner:
    """Measures configs on a CUDA device (or, without one, the CPU fallback, which ignores configs)."""

    def __init__(self, device="cuda", repeats: int = 30):
        self.device = torch.device(device)
        self.repeats = repeats
        self._bench_key = None
        self._bench = None
        self._commit_bench = None
        self.name = f"{'GPU' if self.device.type == 'cuda' else 'CPU'} runner ({self.device})"

    def fingerprint(self) -> Fingerprint:
        return fingerprint(self.device)

    def bench(self, key: ShapeKey, max_depth: int = 8):
        """The `CaseBench` of ``key`` (one kept at a time: buckets are tuned one after another)."""
        if self._bench_key != key:
            case = BenchCase(key.heads, key.batch_bucket, key.tree_bucket, torch_dtype(key.dtype), max_depth)
            self._bench, self._bench_key = CaseBench(case, self.device), key
        return self._bench

    def commit_bench(self, key: CommitKey):
        """The `CommitBench` of ``key`` (one kept at a time)."""
        from bole_tune.commit_bench import CommitBench

        if self._commit_bench is None or self._commit_bench.key != key:
            self._commit_bench = None  # free the previous bucket's sets first
            self._commit_bench = CommitBench(key, self.device)
        return self._commit_bench

    def measure(self, key: ShapeKey | CommitKey, config: KernelConfig | CommitConfig) -> Measurement:
        if isinstance(key, CommitKey) != isinstance(config, CommitConfig):
            raise TypeError(f"config: a {type(key).__name__} is measured with a "
                            f"{'CommitConfig' if isinstance(key, CommitKey) else 'KernelConfig'}, got "
                            f"{type(config).__name__}")
        if isinstance(key, CommitKey):
            bench = self.commit_bench(key)
            bench.reference(), bench.sets()  # the harness itself must not fail inside the guarded region
            return self._guarded(key, config, self._measure_commit)
        bench = self.bench(key)
        bench.reference()  # the harness itself must not fail inside the guarded region below
        return self._guarded(key, config, self._measure_verify)

    def untuned_config(self, key: ShapeKey, default: KernelConfig) -> KernelConfig:
        """The config a bucket without a tuned entry runs here: the Gluon verify's `UNTUNED_CONFIG` where the planner
        gives the bucket's launches to it (this device an sm_90 GPU, the bucket one of its, as the tuner sees it:
        `gluon_bucket_refusal`), else ``default``."""
        if not gluon_device_refusal(self.device) and not gluon_bucket_refusal(GLUON_UNTUNED_CONFIG, key):
            return GLUON_UNTUNED_CONFIG
        return default

    def ring_rounds(self, key: ShapeKey, max_path: int) -> int:
        """The rounds of the ring a ring write's trials are timed on (paths of up to ``max_path`` nodes):
        `RING_ROUNDS`, or where the bucket's launches run on the Gluon verify (`untuned_config`), the most rounds up
        to it whose tables the Gluon verify takes (`gluon.gluon_ring_rounds`: three for the 9-node paths of trees
        of depth 8, where four would be 64 wide), so that its Gluon and Triton configs are timed on the ring an
        engine keeps there."""
        if key.ring and self.untuned_config(key, None) is GLUON_UNTUNED_CONFIG:
            return gluon_ring_rounds(max_path, RING_ROUNDS) or RING_ROUNDS
        return RING_ROUNDS

    def measure_untuned(self, key: ShapeKey, config: KernelConfig) -> Measurement:
        """``config`` (the bucket's default, or `untuned_config`) on the kernel a bucket without a tuned config runs
        (`LaunchPolicy.untuned_variant`): what a study's "speedup over the default" compares with."""
        bench = self.bench(key)
        bench.reference()
        variant = PLANNER.policy.untuned_variant(key.batch_bucket, key.heads.hv, key.tree_bucket)
        return self._guarded(key, config, lambda k, c: self._measure_verify(k, c, variant))

    def _measure_verify(self, key: ShapeKey, config: KernelConfig, variant: str | None = None) -> Measurement:
        """A verify config, or with ``key.fold`` the folded verify's (its outputs against the float64 reference
        on the committed pool, its committed slots against `commit_closed_form`; then the folded round timed), or with
        ``key.ring`` a `PendingRing` write round's (the ring's outputs over R + 1 rounds and its flushed slots against
        the float64 recurrence; then the write round timed with the tables full, `CaseBench.time_ring_write`);
        ``variant``: on that kernel, not the planner's for the bucket."""
        from bole_tune.commit_bench import COMMIT_TOLERANCE

        bench = self.bench(key)
        rounds = self.ring_rounds(key, bench.tree().depth + 1) if key.ring else RING_ROUNDS
        if key.ring and config.gluon:  # the ring timed here must be one the Gluon verify takes, or Triton's is timed
            width = PendingRing.table_width(rounds, bench.tree().depth + 1)
            if width > MAX_RING_WIDTH:
                return Measurement("infeasible", message=f"the tuner's ring ({rounds} rounds of "
                                   f"{bench.tree().depth + 1}-node paths) has tables {width} wide; the Gluon verify "
                                   f"takes at most {MAX_RING_WIDTH}")
        with warnings.catch_warnings():  # a failed self-check is reported as "wrong" below, not warned
            warnings.simplefilter("ignore", UserWarning)
            # a Gluon config (gluon=1) on the Gluon verify, refused (ValueError: infeasible) where it cannot run;
            # any other config on the Triton kernels
            launch = bench.launch(config, variant=variant, fold=key.fold, ring=key.ring, gluon=bool(config.gluon))
        if launch.fallback_error is not None:  # tree_verify would run this config on the fused kernel
            return Measurement("wrong", rel_error=launch.fallback_error, message=launch.fallback)
        if config.gluon and not launch.gluon:  # the Gluon verify failed its self-check: it would not run
            return Measurement("wrong", message=launch.fallback)
        if key.ring:  # over R + 1 rounds (a write round among them), then the slots flushed, against float64
            error, state_error = bench.ring_errors(write=launch, rounds=rounds)
            if not state_error <= accepted_error(torch_dtype(key.dtype)):
                return Measurement("wrong", rel_error=state_error, message=f"the ring's slots: relative error "
                                                                           f"{state_error:.2e} against float64")
        elif key.fold:
            error, state_error = bench.fold_errors(launch)
            if not state_error <= COMMIT_TOLERANCE:
                return Measurement("wrong", rel_error=state_error,
                                   message=f"folded state: relative error {state_error:.2e} against commit_closed_form")
        else:
            error = bench.error(tree_verify, launch)
        if not error <= accepted_error(torch_dtype(key.dtype)):
            return Measurement("wrong", rel_error=error,
                               message=f"relative error {error:.2e} against the float64 reference")
        if key.ring:
            timing = bench.time_ring_write(launch, rounds=rounds, repeats=self.repeats)
            timing = dataclasses.replace(timing, method=f"{timing.method}; a write round of a ring of {rounds} rounds")
        elif key.fold:
            timing = bench.time_folded(launch, repeats=self.repeats)
        else:
            timing, _ = bench.time_verify(tree_verify, launch, repeats=self.repeats)
        return Measurement("ok", timing.p20_us, timing.p50_us, timing.p80_us, error, method=timing.method)

    def _measure_commit(self, key: CommitKey, config: CommitConfig) -> Measurement:
        """Check ``config`` against `commit_closed_form` (never time or record a wrong one), then time it."""
        from bole_tune.commit_bench import COMMIT_TOLERANCE

        bench = self.commit_bench(key)
        error = bench.error(config)
        if not error <= COMMIT_TOLERANCE:
            if error == float("inf"):
                return Measurement("wrong", message="wrote a slot it must leave as it is, or NaN (against "
                                                    "commit_closed_form)")
            return Measurement("wrong", rel_error=error,
                               message=f"relative error {error:.2e} against commit_closed_form")
        timing = bench.time(config, repeats=self.repeats)
        return Measurement("ok", timing.p20_us, timing.p50_us, timing.p80_us, error, method=timing.method)

    def _guarded(self, key, config, body) -> Measurement:
        """``body(key, config)``; what fails for this config alone (compile failures, out of resources or memory,
        launch errors) is ``infeasible``, a crashed GPU context `DeviceLost`."""
        try:
            return body(key, config)
        except torch.cuda.OutOfMemoryError as error:
            torch.cuda.empty_cache()
            return Measurement("infeasible", message=f"out of memory: {str(error)[:200]}")
        except Exception as error:  # compile failures, out of resources, launch errors: this config only
            text = f"{type(error).__name__}: {str(error)[:300]}"
            if any(s in text for s in DEVICE_LOST_SIGNS):
                raise DeviceLost(f"{config} crashed the GPU context on {key.text}: {text}") from error
            return Measurement("infeasible", message=text)


class RecordingIncomplete(ValueError):
    """A replay asked for a config its recording does not hold (the recording and the search space
    disagree); the message names the recording, the bucket and the config."""


class ReplayRunner:
    """Answers from recorded measurements: ``{"device": {...}, "measurements": {key: {config: m}}}``.

    A recording may also list ``"crashes": {key: [config, ...]}``: configs that took the GPU context
    down; replaying one raises `DeviceLost`, as the GPU runner does. A config (or bucket) the recording
    does not hold raises `RecordingIncomplete`: a replay answers only what was measured, and a missing
    config is a recording that does not match the search space, never an "infeasible" config.
    ``delay`` seconds per measurement make a replay take time like a real run (for watching, or
    testing, workers).
    """

    def __init__(self, path, delay: float = 0.0):
        self.path = Path(path)
        self.delay = delay
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"{self.path}: not a readable recording ({error})") from None
        if not isinstance(data, dict) or not isinstance(data.get("measurements"), dict):
            raise ValueError(f"{self.path}: measurements: missing (not a bole-tune recording?)")
        self.device = data.get("device", {})
        check_slug(self.device.get("slug", "replay"), f"{self.path}: device.slug")
        self.measurements = {}
        for key, by_config in data["measurements"].items():
            try:
                self.measurements[key] = {c: Measurement.from_dict(m) for c, m in by_config.items()}
            except (TypeError, ValueError) as error:
                raise ValueError(f"{self.path}: measurements.{key}: {error}") from None
        self.crashes = {key: set(configs) for key, configs in data.get("crashes", {}).items()}
        self.calls = 0
        self.name = f"replay of {self.path.name}"

    def fingerprint(self) -> Fingerprint:
        d = self.device
        return Fingerprint(slug=d.get("slug", "replay"), kind=d.get("kind", "gpu"), name=d.get("name", "replay"),
                           facts=d.get("facts", {}), source=f"recorded in {self.path.name}")

    def keys(self) -> list[str]:
        return list(self.measurements)

    def measure(self, key: ShapeKey | CommitKey, config: KernelConfig | CommitConfig) -> Measurement:
        self.calls += 1
        if self.delay:
            time.sleep(self.delay)
        if config_text(config) in self.crashes.get(key.text, ()):
            raise DeviceLost(f"{config} crashed the GPU context on {key.text} (recorded crash)")
        by_config = self.measurements.get(key.text)
        if by_config is None:
            raise RecordingIncomplete(f"{self.path}: the recording has no bucket {key.text} (it holds "
                                      f"{', '.join(self.measurements) or 'none'})")
        recorded = by_config.get(config_text(config))
        if recorded is None:
            raise RecordingIncomplete(f"{self.path}: {key.text}: config {config_text(config)} "
                                      f"({'/'.join(type(config).knobs())}) is not in the recording; record it, or "
                                      f"replay with the search space it was recorded on")
        return recorded

    def untuned_config(self, key: ShapeKey, default: KernelConfig) -> KernelConfig:
        """The recorded `GPURunner.untuned_config`: the one config the bucket holds an untuned measurement of where it
        is not ``default``, else ``default``."""
        others = [text[len(UNTUNED_PREFIX):] for text in self.measurements.get(key.text, {})
                  if text.startswith(UNTUNED_PREFIX) and text != UNTUNED_PREFIX + config_text(default)]
        return KernelConfig.from_text(others[0]) if len(others) == 1 else default

    def measure_untuned(self, key: ShapeKey, config: KernelConfig) -> Measurement | None:
        """The recorded `GPURunner.measure_untuned` (``"untuned " + config`` in the bucket), or None."""
        return self.measurements.get(key.text, {}).get(UNTUNED_PREFIX + config_text(config))


UNTUNED_PREFIX = "untuned "
"""How a recording names the default config's measurement on the untuned kernel (`GPURunner.measure_untuned`)."""


class RecordingRunner:
    """Wraps a runner and writes every measurement to ``path`` (atomically, after each one)."""

    def __init__(self, inner, path):
        self.inner, self.path = inner, Path(path)
        self.name = f"{inner.name}, recording to {self.path.name}"
        self.data = {"device": inner.fingerprint().as_dict(), "measurements": {}}
        if self.path.exists():
            existing = ReplayRunner(self.path)
            self.data["measurements"] = {k: {c: m.as_dict() for c, m in v.items()}
                                         for k, v in existing.measurements.items()}

    def fingerprint(self) -> Fingerprint:
        return self.inner.fingerprint()

    def measure(self, key: ShapeKey | CommitKey, config: KernelConfig | CommitConfig) -> Measurement:
        m = self.inner.measure(key, config)
        self._record(key, config.text, m)
        return m

    def untuned_config(self, key: ShapeKey, default: KernelConfig) -> KernelConfig:
        return self.inner.untuned_config(key, default) if hasattr(self.inner, "untuned_config") else default

    def measure_untuned(self, key: ShapeKey, config: KernelConfig) -> Measurement | None:
        m = self.inner.measure_untuned(key, config) if hasattr(self.inner, "measure_untuned") else None
        if m is not None:
            self._record(key, UNTUNED_PREFIX + config.text, m)
        return m

    def _record(self, key, text: str, m: Measurement) -> None:
        self.data["measurements"].setdefault(key.text, {})[text] = m.as_dict()
        write_text_atomic(self.path, json.dumps(self.data, indent=1) + "\n")
