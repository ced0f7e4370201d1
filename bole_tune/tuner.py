"""Optuna search over tile configs, one study per shape bucket, stored in any Optuna storage.

A study is named ``bole-tune:<gpu-slug>:<bucket key>`` and lives in the storage given (an SQLite
file by default), so an interrupted run picks up where it stopped: finished trials are kept and
only the missing ones run. Each study starts from the default config, the bucket's own entry in the
database (a re-tune measures it again) and the best configs of neighbouring buckets already tuned (warm
start), then lets TPE explore. A config the sampler
proposes twice is answered from the first measurement (no device time). Pruned (does not fit),
infeasible (does not compile or run) and wrong (fails the reference check) candidates are recorded
with their reason as pruned trials, which the sampler ranks below every working config.

The same loop tunes the commit (`tree_commit`, `tree_commit_layers`): a study whose key is a `CommitKey`
(bucket and layers per launch) over the ``commit`` search space (`CommitConfig`), named
``bole-tune:<gpu-slug>:commit:<key text>``, starting from the untuned fallback `default_commit_config`.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import optuna
import sqlalchemy
from filelock import FileLock

from bole_tune.config import CommitConfig, KernelConfig, default_commit_config, default_config
from bole_tune.database import CommitKey, ShapeKey
from bole_tune.kernels import PLANNER
from bole_tune.runners import DeviceLost, Measurement
from bole_tune.search_space import SearchSpace, feasible, for_key, gluon_bucket_refusal

optuna.logging.set_verbosity(optuna.logging.WARNING)


def default_storage() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "bole-tune" / "optuna-studies.sqlite3"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def _sqlite_file(url: str) -> Path | None:
    """The file of an ``sqlite:///`` URL (None for an in-memory database or another dialect)."""
    try:
        parsed = sqlalchemy.engine.make_url(url)
    except sqlalchemy.exc.ArgumentError:
        return None
    database = parsed.database if parsed.get_backend_name() == "sqlite" else None
    return Path(database) if database and database != ":memory:" else None


def open_storage(url: str | None):
    """An Optuna storage for ``url`` (default: the user's SQLite file); a bad URL is a ValueError.

    Several processes may open the same storage for the first time at once (workers, concurrent runs):
    Optuna creates the tables and stamps their version on first use, so two first openers of one SQLite
    file both try to insert ``alembic_version`` and one fails. An SQLite file is therefore opened under a
    file lock beside it (``<file>.lock``); a server database's first openers that lose that race retry.

    Trials send heartbeats every ``BOLE_TUNE_HEARTBEAT`` seconds (default 30): a trial whose process
    died (SIGKILL, a lost host) is failed after three missed beats and its config tried again.
    """
    url = url or default_storage()
    if "://" not in url:
        raise ValueError(f"--storage: {url!r} is not a storage URL (e.g. sqlite:///studies.db or "
                         "postgresql://user@host/db)")
    raw = os.environ.get("BOLE_TUNE_HEARTBEAT", "30")
    try:
        heartbeat = float(raw)
    except ValueError:
        raise ValueError(f"BOLE_TUNE_HEARTBEAT: expected seconds (a number), got {raw!r}") from None
    if not math.isfinite(heartbeat) or heartbeat <= 0:
        raise ValueError(f"BOLE_TUNE_HEARTBEAT: expected a positive number of seconds, got {raw!r}")
    sqlite_file = _sqlite_file(url)

    def create():
        with warnings.catch_warnings():  # heartbeats: experimental in optuna's API, stable in use since v2.9
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.RDBStorage(url, heartbeat_interval=max(1, int(heartbeat)),
                                              grace_period=max(2, int(3 * heartbeat)))

    try:
        if sqlite_file is not None:
            with FileLock(str(sqlite_file) + ".lock", timeout=300):
                return create()
        for attempt in range(3):
            try:
                return create()
            except sqlalchemy.exc.DBAPIError as error:
                lost_race = isinstance(error, sqlalchemy.exc.IntegrityError) or "already exists" in str(error)
                if not lost_race or attempt == 2:
                    raise
                time.sleep(0.5 * (attempt + 1))
    except Exception as error:  # unknown dialect, unreachable server, missing driver, unwritable lock
        raise ValueError(f"--storage: cannot open {url!r}: {str(error).splitlines()[0][:200]}") from None


@dataclass
class TuneResult:
    key: ShapeKey | CommitKey
    study_name: str
    best: KernelConfig | CommitConfig | None
    best_measurement: Measurement | None
    default: KernelConfig | CommitConfig
    default_measurement: Measurement | None
    counts: dict = field(default_factory=dict)
    workers: list = field(default_factory=list)  # host:pid of every process that measured a trial

    @property
    def speedup(self) -> float | None:
        if self.best_measurement and self.default_measurement and self.default_measurement.status == "ok":
            return self.default_measurement.p50_us / self.best_measurement.p50_us
        return None


def study_name(slug: str, key: ShapeKey | CommitKey) -> str:
    if isinstance(key, CommitKey):
        return f"bole-tune:{slug}:commit:{key.text}"
    return f"bole-tune:{slug}:{key.text}"


def default_for(key: ShapeKey | CommitKey):
    """The config a study of ``key`` starts from and compares its best with: the verifier's safe default, or
    the commit's untuned fallback for this launch's programs."""
    if isinstance(key, CommitKey):
        return default_commit_config(key.programs_per_tile, key.heads.dk, key.heads.dv)
    return default_config(key.heads.dk, key.heads.dv)


def _check_kind(key, space: SearchSpace) -> type:
    """The config type of ``space``, which must be the one ``key`` tunes (a `CommitKey`: the commit space)."""
    wanted = "commit" if isinstance(key, CommitKey) else "verify"
    if space.kind != wanted:
        raise ValueError(f"space: a {'commit' if wanted == 'commit' else 'tree_verify'} bucket ({key.text}) needs "
                         f"the {wanted} search space, got the {space.kind} one ({space.source})")
    return space.config_type


def _measurement_of(trial) -> Measurement | None:
    data = trial.user_attrs.get("measurement")
    return Measurement.from_dict(data) if data else None


FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)


def tune_bucket(runner, key: ShapeKey | CommitKey, space: SearchSpace, storage, n_trials: int, slug: str,
                warm_start=(), shared_memory_limit: int | None = None, sampler=None, on_trial=None,
                worker: str | None = None) -> TuneResult:
    """Run (or resume, or join) the study of one bucket until it holds ``n_trials`` finished trials
    (with a grid sampler: until every grid point is covered).

    Several workers (processes, hosts) may run this on the same study at once: the first seeds it
    with the default and warm-start configs, a config any worker already measured is answered from
    the storage, and everyone stops when the study as a whole has ``n_trials`` finished trials.
    """
    config_type = _check_kind(key, space)
    space = for_key(space, key)  # the gluon knob held at 0 where no Gluon config runs
    name = study_name(slug, key)
    n_trials = min(n_trials, space.size)  # distinct configs, each measured once: more trials would only repeat
    study = optuna.create_study(study_name=name, storage=storage, direction="minimize", load_if_exists=True,
                                sampler=sampler or optuna.samplers.TPESampler(seed=0, n_startup_trials=6,
                                                                              multivariate=True))
    with warnings.catch_warnings():  # experimental in optuna, stable in use since v2.9
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    default = default_for(key)
    if not study.trials:
        study.set_user_attr("key", key.as_dict())
        warm = list(warm_start)
        # the default and the first warm start (the bucket's own entry, where it has one) with each switch of the
        # space turned the other way (the commit's tma): a switch changes the kernel, so a re-tune measures both
        # and first of all what the bucket runs untuned where that is not the default (the Gluon verify's tiles on
        # an sm_90 GPU): a study that never measured it could record a config slower than running untuned
        untuned = (runner.untuned_config(key, default) if isinstance(key, ShapeKey) and hasattr(runner, "untuned_config")
                   else default)
        starts = ([untuned, default] + warm[:1] + [t for c in [default] + warm[:1] for t in switch_twins(c, space)]
                  + warm[1:] + kernel_starts(key))
        for config in dict.fromkeys(starts):  # in order, once each
            if space.contains(config):
                study.enqueue_trial(config.knob_values(), skip_if_exists=True)
    measured: dict = {}

    def known(text: str) -> Measurement | None:
        """The measurement of ``text`` by this or any other worker, if there is one."""
        if text not in measured:
            for t in study.get_trials(deepcopy=False, states=FINISHED):
                m = _measurement_of(t)
                if m is not None and config_type.from_dict(t.params).text == text:
                    measured[text] = m
                    break
        return measured.get(text)

    def objective(trial: optuna.Trial) -> float:
        params = {name: trial.suggest_categorical(name, list(values)) for name, values in space.values.items()}
        try:
            config = config_type.from_dict(params)
        except ValueError as error:  # a commit's b_v above its v_span: no such launch
            trial.set_user_attr("status", "pruned")
            trial.set_user_attr("reason", str(error))
            raise optuna.TrialPruned(str(error)) from None
        if worker:
            trial.set_user_attr("worker", worker)
        text = config.text
        m = known(text)
        if m is not None:
            trial.set_user_attr("repeat_of_earlier_trial", True)
        else:
            ok, reason = feasible(config, key.heads.dk, key.heads.dv, key.tree_bucket, key.dtype, shared_memory_limit,
                                  bucket=key)
            if not ok:
                trial.set_user_attr("status", "pruned")
                trial.set_user_attr("reason", reason)
                raise optuna.TrialPruned(reason)
            try:
                m = runner.measure(key, config)
            except DeviceLost as error:
                # record the crash as this config's result (nobody retries it), then stop this process
                lost.append(error)
                m = Measurement("infeasible", message=f"crashed the GPU context: {error}")
                trial.study.stop()
            measured[text] = m
        trial.set_user_attr("measurement", m.as_dict())
        trial.set_user_attr("status", m.status)
        if on_trial:
            on_trial(config, m)
        if m.status != "ok":
            trial.set_user_attr("reason", m.message)
            raise optuna.TrialPruned(m.message)
        return m.p50_us

    lost: list = []
    finished = study.get_trials(deepcopy=False, states=FINISHED)
    if isinstance(study.sampler, optuna.samplers.GridSampler):
        # a grid is done when every point is covered, whoever covered it; the sampler stops the study
        grid = space.grid_size  # a commit's b_v > v_span points are visited too, and pruned at once
        if len({tuple(sorted(t.params.items())) for t in finished}) < grid:
            study.optimize(objective, n_trials=grid, catch=())
    elif len(finished) < n_trials:
        def run_until(target: int) -> None:
            done = len(study.get_trials(deepcopy=False, states=FINISHED))
            if done < target and not lost:
                study.optimize(objective, n_trials=target - done, catch=(),
                               callbacks=[optuna.study.MaxTrialsCallback(target, states=FINISHED)])

        # explore with the sampler, then polish: measure the untried one-step neighbours of the best
        # config so far (TPE alone can stop one step short of the optimum in these small discrete spaces)
        run_until(n_trials - polish_trials(n_trials))
        while not lost:
            done = len(study.get_trials(deepcopy=False, states=FINISHED))
            if done >= n_trials:
                break
            tried = {_trial_text(config_type, t.params) for t in study.get_trials(deepcopy=False)
                     if set(t.params) == set(config_type.knobs())}
            steps = []
            # the best first; the runners-up once its neighbours are done
            for center in _ranked_configs(study, config_type):
                steps = [c for c in step_neighbours(center, space) if c.text not in tried and
                         feasible(c, key.heads.dk, key.heads.dv, key.tree_bucket, key.dtype, shared_memory_limit,
                                  bucket=key)[0]]
                if steps:
                    break
            if not steps:
                break
            steps = steps[:n_trials - done]
            for config in steps:
                study.enqueue_trial(config.knob_values(), skip_if_exists=True)
            run_until(done + len(steps))
        run_until(n_trials)
    if lost:
        raise DeviceLost(f"{lost[0]} (recorded in study {name}; run the same command again to resume)")
    record_untuned_default(runner, study, key, default)
    return _result(study, key, name, default)


def _trial_text(config_type: type, params: dict) -> str:
    """A trial's config as `text` names it; a combination that makes no config (pruned) by its values joined."""
    try:
        return config_type.from_dict(params).text
    except ValueError:
        return "/".join(str(params[k]) for k in config_type.knobs())


UNTUNED_ATTR = "untuned_default"
"""The study attribute holding the default config's measurement on the kernel an untuned bucket runs, where that
is not the kernel the study searched (`record_untuned_default`)."""


UNTUNED_CONFIG_ATTR = "untuned_config"
"""The study attribute naming the config an untuned bucket runs where it is not the default (`record_untuned_default`:
on an sm_90 GPU a Gluon bucket runs the Gluon verify's untuned tiles)."""


def record_untuned_default(runner, study, key: ShapeKey | CommitKey, default) -> None:
    """Where a bucket runs untuned what its study does not measure as its default (a "stream" bucket runs the
    resident kernel until tuned; on an sm_90 GPU a Gluon bucket runs the Gluon verify with `UNTUNED_CONFIG`, the
    runner's ``untuned_config``), measure that once and keep it in the study: the default a user would really run,
    so a study's speedup over it is what tuning gains (the default's own trial stays a trial)."""
    if isinstance(key, CommitKey) or UNTUNED_ATTR in study.user_attrs or not hasattr(runner, "measure_untuned"):
        return
    untuned = runner.untuned_config(key, default) if hasattr(runner, "untuned_config") else default
    policy = PLANNER.policy
    if untuned == default and policy.variant(key.batch_bucket, key.heads.hv, key.tree_bucket) == \
            policy.untuned_variant(key.batch_bucket, key.heads.hv, key.tree_bucket):
        return
    m = runner.measure_untuned(key, untuned)
    if m is not None:
        study.set_user_attr(UNTUNED_ATTR, m.as_dict())
        if untuned != default:
            study.set_user_attr(UNTUNED_CONFIG_ATTR, untuned.text)


def tune_bucket_buffered(runner, key: ShapeKey | CommitKey, space: SearchSpace, storage, n_trials: int, slug: str,
                         **options) -> TuneResult:
    """`tune_bucket` in an in-memory study, written to ``storage`` when it is done: for studies of seconds run by
    one process (the commit's), where the storage's round trips per trial (about 70 ms with SQLite and TPE)
    would cost more than the measurements. A study the storage already holds with ``n_trials`` finished
    trials is read back and nothing is measured; one it holds with fewer (an interrupted `tune_bucket`) is
    continued from its finished trials, then replaced. An interrupted buffered study is redone from its start
    (or from what the storage held). ``options``: `tune_bucket`'s."""
    name = study_name(slug, key)
    grid = isinstance(options.get("sampler"), optuna.samplers.GridSampler)
    target = space.grid_size if grid else min(n_trials, space.size)
    try:
        stored = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        stored = None
    finished = stored.get_trials(deepcopy=False, states=FINISHED) if stored is not None else []
    if stored is not None and len(finished) >= target:
        return _result(stored, key, name, default_for(key))
    memory = optuna.storages.InMemoryStorage()
    if finished:
        study = optuna.create_study(study_name=name, storage=memory, direction="minimize")
        for attr, value in stored.user_attrs.items():
            study.set_user_attr(attr, value)
        study.add_trials(finished)

    def persist():
        if stored is not None:
            optuna.delete_study(study_name=name, storage=storage)
        optuna.copy_study(from_study_name=name, from_storage=memory, to_storage=storage)

    try:
        result = tune_bucket(runner, key, space, memory, n_trials, slug, **options)
    except DeviceLost:  # the crashing config is recorded: the next run continues without it
        persist()
        raise
    persist()
    return result


POLISH_FRACTION = 0.25


def polish_trials(n_trials: int) -> int:
    """Trials kept for the local search around the sampler's best configs."""
    return int(n_trials * POLISH_FRACTION) if n_trials >= 8 else 0


def _ranked_configs(study, config_type: type = KernelConfig) -> list:
    """Configs measured correct in the study, fastest first."""
    ranked = {}
    for t in study.get_trials(deepcopy=False, states=FINISHED):
        m = _measurement_of(t)
        if m is not None and m.status == "ok":
            config = config_type.from_dict(t.params)
            ranked[config.text] = (m.p50_us, config)
    return [c for _, c in sorted(ranked.values(), key=lambda x: x[0])]


def switch_twins(config, space: SearchSpace) -> list:
    """``config`` with one of its on/off knobs (its class's ``SWITCHES``) turned the other way, for each such knob
    the space lets take both values."""
    values = config.knob_values()
    return [type(config)(**{**values, name: other}) for name in type(config).SWITCHES
            for other in space.values.get(name, ()) if other != values[name]]


def step_neighbours(config, space: SearchSpace) -> list:
    """Configs one step away in one parameter (the next smaller or larger value of the space); a step that
    makes no config of the space (a commit's b_v above its v_span, a Gluon config of tiles it does not take) is
    skipped."""
    found = []
    values = config.knob_values()
    for name, choices in space.values.items():
        choices = sorted(choices)
        if values[name] not in choices:
            continue
        i = choices.index(values[name])
        for j in (i - 1, i + 1):
            if 0 <= j < len(choices):
                try:
                    step = type(config)(**{**values, name: choices[j]})
                except ValueError:
                    continue
                if space.contains(step):  # a Gluon config with tiles the Gluon verify does not take is none
                    found.append(step)
    return found


def best_config_of(storage, slug: str, key: ShapeKey | CommitKey):
    return load_result(storage, slug, key).best


def load_result(storage, slug: str, key: ShapeKey | CommitKey) -> TuneResult:
    """The current result of a bucket's study, read from the storage (after the workers are done)."""
    name = study_name(slug, key)
    study = optuna.load_study(study_name=name, storage=storage)
    return _result(study, key, name, default_for(key))


def _result(study, key: ShapeKey | CommitKey, name: str, default) -> TuneResult:
    counts = {"total": 0, "measured": 0, "ok": 0, "wrong": 0, "infeasible": 0, "pruned": 0}
    best, best_m, default_m = None, None, None
    workers = set()
    for t in study.trials:
        if t.state not in FINISHED:
            continue
        counts["total"] += 1
        if "worker" in t.user_attrs:
            workers.add(t.user_attrs["worker"])
        status = t.user_attrs.get("status", "failed")
        m = _measurement_of(t)
        if status == "pruned":
            counts["pruned"] += 1
            continue
        if m is None:
            continue
        if not t.user_attrs.get("repeat_of_earlier_trial"):
            counts["measured"] += 1
            counts[m.status] = counts.get(m.status, 0) + 1
        config = type(default).from_dict(t.params)
        if config == default:
            default_m = m
        if m.status == "ok" and (best_m is None or m.p50_us < best_m.p50_us):
            best, best_m = config, m
    if UNTUNED_ATTR in study.user_attrs:  # the default as an untuned bucket runs it (`record_untuned_default`)
        default_m = Measurement.from_dict(study.user_attrs[UNTUNED_ATTR])
        if UNTUNED_CONFIG_ATTR in study.user_attrs:  # and the config it runs, where that is not the default
            default = type(default).from_text(study.user_attrs[UNTUNED_CONFIG_ATTR])
    return TuneResult(key, name, best, best_m, default, default_m, counts, sorted(workers))


# the resident kernel's best tiles in the H200 lab (scripts/kernel_lab.py --resident/--resident-cand,
# 9B/27B/122B at B=8-32, T=64): a 16-trial study seeded only with fused-kernel neighbours missed them; and
# whole key rows per step for small trees (lab/variant_sweep.py, 9B B=1-16, T=4-32)
RESIDENT_STARTS = (KernelConfig(32, 64, 4, 3), KernelConfig(64, 64, 4, 1), KernelConfig(32, 64, 4, 1),
                   KernelConfig(128, 32, 4, 2), KernelConfig(128, 64, 4, 2))
# the state-first order's best tiles (lab/state_first.py, 9B B=16-32, T=4-16): whole value rows per program
STREAM_STARTS = (KernelConfig(32, 128, 4, 3), KernelConfig(32, 128, 4, 2), KernelConfig(64, 128, 4, 3))
# the folded stream launch's best tiles with its state products as S Q^T (lab/rows_first.py, 9B B=16-32, T=4-16)
FOLD_STREAM_STARTS = (KernelConfig(32, 64, 2, 3), KernelConfig(32, 128, 2, 2))
# every Gluon config of the shipped space, where the bucket runs the Gluon verify (on sm_90: `for_device`): a handful,
# each its own kernel, and a sampler that draws the gluon knob at random seldom meets them with tiles it takes
GLUON_STARTS = tuple(KernelConfig(b_k, b_v, 4, stages, gluon=1) for b_k in (32, 64) for b_v in (64, 32)
                     for stages in (2, 1))


def kernel_starts(key: ShapeKey | CommitKey) -> list[KernelConfig]:
    """Configs a study starts with for the kernel this bucket runs on (beside default and neighbours)."""
    if isinstance(key, CommitKey):
        return []
    variant = PLANNER.policy.variant(key.batch_bucket, key.heads.hv, key.tree_bucket)
    starts = {"resident": RESIDENT_STARTS, "stream": STREAM_STARTS}.get(variant, ())
    if variant == "stream" and (key.fold or key.ring):  # a ring's write round folds too
        starts = FOLD_STREAM_STARTS + starts
    gluon = [c for c in GLUON_STARTS if not gluon_bucket_refusal(c, key)]
    return [c for c in starts if c.fits(key.heads.dk, key.heads.dv)] + gluon


def warm_starts(key: ShapeKey, tuned: dict) -> list[KernelConfig]:
    """What a study of ``key`` starts from (after the default): the bucket's own entry in the database,
    then `neighbours`. A re-tune (after a kernel, driver or Triton update) measures the config it is
    replacing again, so it never writes a worse entry for want of trying the old one (on the H200 a
    16-trial re-tune of 27B T32-B16 missed the previous 32/32/2/3 and recorded 49.2 us against 43.1)."""
    own = [config for other, config in tuned.values() if other == key]
    if getattr(key, "ring", False):  # a ring's write round starts from its bucket's folded verify config too
        own += [config for other, config in tuned.values() if other == key.fold_key and config not in own]
    if getattr(key, "fold", False) or getattr(key, "ring", False):  # and from its bucket's verify config
        own += [config for other, config in tuned.values() if other == key.verify_key and config not in own]
    return own + [c for c in neighbours(key, tuned) if c not in own]


def neighbours(key: ShapeKey | CommitKey, tuned: dict) -> list:
    """Best configs of already tuned buckets next to ``key`` (same heads, one bucket step away; a commit key:
    also the same layers per launch; a folded verify's key: folded ones; a ring write's key: ring writes)."""
    found = []
    for other_text, (other, config) in tuned.items():
        if (other.heads, other.dtype, other.tp) != (key.heads, key.dtype, key.tp) or other == key:
            continue
        if type(other) is not type(key) or getattr(other, "layers", 1) != getattr(key, "layers", 1):
            continue
        if (getattr(other, "fold", False), getattr(other, "ring", False)) != (getattr(key, "fold", False),
                                                                              getattr(key, "ring", False)):
            continue
        steps = abs(math.log2(other.tree_bucket / key.tree_bucket)) + abs(math.log2(other.batch_bucket / key.batch_bucket))
        if steps <= 1:
            found.append((steps, config))
    return [c for _, c in sorted(found, key=lambda x: x[0])]


def exhaustive_bucket(runner, key: ShapeKey | CommitKey, space: SearchSpace, shared_memory_limit=None,
                      on_trial=None) -> dict[str, Measurement]:
    """Measure every feasible config of the space on one bucket (the yardstick for the tuner)."""
    _check_kind(key, space)
    results = {}
    for config in for_key(space, key).configs():
        ok, reason = feasible(config, key.heads.dk, key.heads.dv, key.tree_bucket, key.dtype, shared_memory_limit,
                              bucket=key)
        m = runner.measure(key, config) if ok else Measurement("infeasible", message=reason)
        results[config.text] = m
        if on_trial:
            on_trial(config, m)
    return results
