"""The tuner replayed on an exhaustive recording: how close to the best config, with how many trials?

An exhaustive recording (`bole-tune tune --exhaustive --record FILE`) holds every config of the search
space measured on some buckets. Replaying the tuner on it with several sampler seeds (default config
first, TPE, then the polish phase, as in a real run; no warm start from neighbours; each run in its own
in-memory Optuna storage) says how often a study of ``trials`` trials lands within a few percent of
the exhaustive best. `benchmarks/tuner_vs_exhaustive.py` prints it; `tests/test_shipped_data.py`
checks the README's claim on the H200 recording in the repository.
"""

from __future__ import annotations

import statistics
import warnings
from dataclasses import dataclass, field

import optuna

from bole_tune.database import ShapeKey
from bole_tune.runners import UNTUNED_PREFIX, ReplayRunner
from bole_tune.search_space import SearchSpace
from bole_tune.tuner import tune_bucket


@dataclass(frozen=True)
class ReplayRun:
    """One seeded study of one bucket."""

    seed: int
    best_us: float  # the p50 of the best config the study found
    best_config: str
    configs_measured: int  # runner calls (a config measured twice by one study counts once)
    gap: float  # best_us / the exhaustive best - 1


@dataclass
class BucketReplay:
    """Every seeded study of one bucket, beside the bucket's exhaustive best."""

    key: ShapeKey
    exhaustive_best_us: float
    exhaustive_best_config: str
    working_configs: int  # configs of the recording with status ok
    runs: list[ReplayRun] = field(default_factory=list)

    def within(self, tolerance: float) -> int:
        """How many runs land within ``tolerance`` (0.03: 3%) of the exhaustive best."""
        return sum(r.gap <= tolerance for r in self.runs)

    def summary(self) -> str:
        gaps = [r.gap for r in self.runs]
        measured = [r.configs_measured for r in self.runs]
        return (f"{self.key.text}: exhaustive best {self.exhaustive_best_us:.1f} us ({self.exhaustive_best_config}) "
                f"over {self.working_configs} working configs; tuner gap median {statistics.median(gaps):+.1%}, "
                f"worst {max(gaps):+.1%}; within 3% in {self.within(0.03)}/{len(gaps)} seeds; "
                f"configs measured median {statistics.median(measured)}")


def key_from_text(text: str) -> ShapeKey:
    """The `ShapeKey` whose ``.text`` is ``text`` (``Hv32-Hk16-dk128-dv128-bf16-T64-B16[-TP2][-fold|-ring]``)."""
    parts = text.split("-")
    fold, ring = parts[-1] == "fold", parts[-1] == "ring"
    if fold or ring:
        parts = parts[:-1]
    try:
        data = {"hv": int(parts[0].removeprefix("Hv")), "hk": int(parts[1].removeprefix("Hk")),
                "dk": int(parts[2].removeprefix("dk")), "dv": int(parts[3].removeprefix("dv")),
                "dtype": parts[4], "tree_bucket": int(parts[5].removeprefix("T")),
                "batch_bucket": int(parts[6].removeprefix("B")), "fold": fold, "ring": ring}
        if len(parts) == 8:
            data["tp"] = int(parts[7].removeprefix("TP"))
        elif len(parts) != 7:
            raise ValueError
    except (IndexError, ValueError):
        raise ValueError(f"{text!r}: not a bucket key (expected Hv32-Hk16-dk128-dv128-bf16-T64-B16)") from None
    key = ShapeKey.from_dict(data, where=text)
    if key.text != text:
        raise ValueError(f"{text!r}: not a bucket key (reads back as {key.text!r})")
    return key


def sampler_for(seed: int) -> optuna.samplers.BaseSampler:
    """The sampler a real study uses (`tune_bucket`'s default), with ``seed``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=6, multivariate=True)


def replay_against_exhaustive(recording, trials: int = 32, seeds=range(30), space: SearchSpace | None = None,
                              keys=None) -> list[BucketReplay]:
    """Replay the tuner on every bucket of ``recording`` (or those whose text is in ``keys``), one
    study of ``trials`` trials per seed, and compare each study's best with the recording's best.

    ``recording`` is a path or a `ReplayRunner`. A config the search space asks for that the
    recording lacks raises `bole_tune.runners.RecordingIncomplete`.
    """
    runner = recording if isinstance(recording, ReplayRunner) else ReplayRunner(recording)
    space = space or SearchSpace.load()
    results = []
    for text in runner.keys():
        if keys is not None and text not in keys:
            continue
        key = key_from_text(text)
        ok = {c: m for c, m in runner.measurements[text].items() if m.status == "ok" and not c.startswith(UNTUNED_PREFIX)}
        if not ok:
            raise ValueError(f"{runner.path}: {text}: no working config in the recording")
        best_config = min(ok, key=lambda c: ok[c].p50_us)
        bucket = BucketReplay(key, ok[best_config].p50_us, best_config, len(ok))
        for seed in seeds:
            before = runner.calls
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                result = tune_bucket(runner, key, space, optuna.storages.InMemoryStorage(), trials, "replay",
                                     sampler=sampler_for(seed))
            found = result.best_measurement.p50_us
            bucket.runs.append(ReplayRun(seed, found, result.best.text, runner.calls - before,
                                         found / bucket.exhaustive_best_us - 1))
        results.append(bucket)
    return results
