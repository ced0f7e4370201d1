"""`bole-tune profile` / `tune`: tune tile configs per bucket, measure latency curves, write the database.

For each model's GDN shape the job (1) tunes the chosen (tree bucket, batch bucket) grid with
Optuna, neighbours warm-starting each other, writing each bucket's winner to the database as soon as
it is known (an interrupted run loses nothing and resumes from the Optuna storage); (2) tunes the commit
(`tune_commits`) on the same grid, twice per bucket: the one-layer launch (`tree_commit`) and the launch
that commits all of the model's GDN layers at once (`tree_commit_layers`), in this process, each candidate
checked against `commit_closed_form` first; then (3) measures per-layer latency against tree size and
batch for tree_verify with the tuned config and with the default, serial_verify, tree_commit, and a
layer's round (`round_verify_commit`: the tuned tree_verify then the tuned tree_commit, timed together;
`round_serial`: serial_verify then a copy of one state per request, a snapshot engine's commit), stored as
curves with provenance. What the budget reads is `bole-tune step`'s step curve, whose GDN part is already a
whole round (conv, gates, verify and the commit with ``config=None``, the tuned one).

**Resume.** Curve points are written as they are measured (at least every `FLUSH_SECONDS`, and at the end
of each model), and a point the database already holds, measured by the same code (`code_version`,
torch, Triton), with the same repeats and, for the tuned curve, the config now tuned, is not measured
again (``remeasure`` forces it), so a run killed even with SIGKILL resumes where it stopped. Tuning
resumes from the Optuna storage, whose heartbeats fail a killed worker's RUNNING trial. The job folder a
run makes in the temporary directory is removed when it ends, however it ends, except when a worker
failed (its logs are then kept, under a ``bole-tune-failed-`` name the error names); one left by a killed
run is removed by the next.

Without a GPU nothing can be tuned (tile configs do not exist on the CPU path); the job measures
the PyTorch fallback's curves instead, says so, and still writes a valid database.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import optuna
import torch

from bole_tune import database
from bole_tune.bench import BenchCase, CaseBench, environment
from bole_tune.config import CommitConfig, KernelConfig, default_config
from bole_tune.database import CommitKey, ShapeKey
from bole_tune.kernels import PLANNER, serial_verify, tree_commit, tree_verify
from bole_tune.lookup import decide, decide_commit
from bole_tune.precompile import precompile
from bole_tune.profiles import DEFAULT_MODELS, ModelProfile, resolve_model
from bole_tune.runners import GPURunner, Measurement, RecordingIncomplete, ReplayRunner
from bole_tune.search_space import SearchSpace, feasible, for_device
from bole_tune.shapes import BATCH_BUCKETS, TREE_BUCKETS, torch_dtype
from bole_tune.timing import Timing, time_launches
from bole_tune.tuner import (FINISHED, TuneResult, default_storage, exhaustive_bucket, load_result, open_storage,
                             study_name, tune_bucket_buffered, warm_starts)
from bole_tune.workers import EXIT_RECORDING_INCOMPLETE, Job, make_sampler, run_workers, visible_devices

QUICK_BATCHES = (1, 4, 16)
QUICK_TREE_SIZES = (16, 64, 128)
QUICK_COMMIT_BATCHES = BATCH_BUCKETS  # `tune --commit --quick` covers every batch bucket (1..32) ...
QUICK_COMMIT_TREE_SIZES = (8, 16, 32, 64)  # ... and the tree buckets engines draft (up to 64 nodes)
QUICK_COMMIT_TRIALS = 12
COMMIT_TRIALS = 24
CPU_CURVE_BATCHES = (1, 2)  # the CPU fallback's curves, when none are asked for: seconds, not hours
CPU_CURVE_TREE_SIZES = (8, 16)
FLUSH_SECONDS = 30.0  # curve points are written at least this often: a killed run loses at most this much work
JOB_PREFIX = "bole-tune-job-"  # + the pid of the run, so that the next run can tell a killed run's folder


@dataclass
class ProfilePlan:
    """What `profile` and `tune` do: the models' heads per rank, the buckets tuned, the curve points.

    curve_batches, curve_tree_sizes: None measures the tuned grid on a GPU and `CPU_CURVE_BATCHES` x
    `CPU_CURVE_TREE_SIZES` on the CPU fallback.
    commit_batches, commit_tree_sizes, commit_trials: the commit's tuning grid (None: the tuned grid) and
    trials per commit study; each bucket is tuned for the one-layer launch and the all-layer launch.
    """

    models: list[ModelProfile]
    dtype: str = "bf16"
    tp: int = 1
    tune_batches: tuple = BATCH_BUCKETS
    tune_tree_sizes: tuple = TREE_BUCKETS
    curve_batches: tuple | None = None
    curve_tree_sizes: tuple | None = None
    n_trials: int = 32
    repeats: int = 30
    serial: bool = True
    seed: int = 0
    commit_batches: tuple | None = None
    commit_tree_sizes: tuple | None = None
    commit_trials: int = COMMIT_TRIALS
    fold: bool = False  # tune the folded verify (tree_verify with pending=) instead of the verify
    ring: bool = False  # tune a PendingRing's write round instead of the verify

    def commit_grid(self) -> tuple[tuple, tuple]:
        """(batches, tree sizes) the commit is tuned at."""
        return self.commit_batches or self.tune_batches, self.commit_tree_sizes or self.tune_tree_sizes

    def curve_grid(self, on_gpu: bool) -> tuple[tuple, tuple]:
        """(batches, tree sizes) of the latency curves."""
        if not on_gpu and self.curve_batches is None and self.curve_tree_sizes is None:
            return CPU_CURVE_BATCHES, CPU_CURVE_TREE_SIZES
        return self.curve_batches or self.tune_batches, self.curve_tree_sizes or self.tune_tree_sizes


def make_plan(models=None, dtype: str = "bf16", tp: int = 1, quick: bool = False, batches=None, tree_sizes=None,
              trials: int | None = None, repeats: int = 30, curve_batches=None, curve_tree_sizes=None,
              serial: bool = True, commit: bool = False, fold: bool = False, ring: bool = False) -> ProfilePlan:
    """A checked plan from a user's choices (`DEFAULT_MODELS` when ``models`` is None; ``quick``: the small
    grid, 16 trials, and 12 per commit study). ``commit``: the plan of a commit-only tuning (``tune --commit``:
    ``--trials`` counts commit trials, and ``quick`` tunes the commit at every batch bucket and trees up to 64
    nodes, `QUICK_COMMIT_BATCHES` x `QUICK_COMMIT_TREE_SIZES`). A bad choice raises ValueError (or
    `ProfileError` for a model) naming it."""
    profiles = [resolve_model(m) if isinstance(m, str) else m for m in (models or DEFAULT_MODELS)]
    for model in profiles:
        model.heads(tp)
    if trials is not None and trials < 1:
        raise ValueError("--trials: must be at least 1")
    commit_trials = (trials if commit and trials is not None
                     else QUICK_COMMIT_TRIALS if quick else COMMIT_TRIALS)
    trials = trials if trials is not None else (16 if quick else 32)
    if repeats < 3:
        raise ValueError("--repeats: must be at least 3")
    return ProfilePlan(models=profiles, dtype=dtype, tp=tp,
                       commit_batches=tuple(batches or (QUICK_COMMIT_BATCHES if quick and commit else ())) or None,
                       commit_tree_sizes=tuple(tree_sizes or (QUICK_COMMIT_TREE_SIZES if quick and commit else ()))
                       or None,
                       commit_trials=commit_trials,
                       tune_batches=tuple(batches or (QUICK_BATCHES if quick else BATCH_BUCKETS)),
                       tune_tree_sizes=tuple(tree_sizes or (QUICK_TREE_SIZES if quick else TREE_BUCKETS)),
                       curve_batches=tuple(curve_batches or batches or ()) or None,
                       curve_tree_sizes=tuple(curve_tree_sizes or tree_sizes or ()) or None,
                       n_trials=trials, repeats=repeats, serial=serial, fold=fold, ring=ring)


@dataclass(frozen=True)
class Progress:
    """A progress report: ``done`` of ``total`` (None: not known yet) in ``stage``, on ``label``."""

    stage: str  # "compiling", "tuning", "tuning commits", "exhaustive", "curves"
    done: int
    total: int | None
    label: str = ""


@dataclass
class ProfileResult:
    """What `profile` (or `tune`) did: where it wrote, what it tuned and measured, and what to tell the user."""

    slug: str
    device_name: str
    path: Path
    on_gpu: bool
    tuned: list[TuneResult] = field(default_factory=list)
    commit_tuned: list[TuneResult] = field(default_factory=list)
    curve_rows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@functools.lru_cache(maxsize=None)
def code_version() -> str:
    """bole-tune's version and a digest of the sources that run and time the kernels (the kernels package,
    the bench, timing, workload, tree, config and shape modules): what says two measurements ran the same
    code. An edit elsewhere (the command line, the database) does not make finished points stale."""
    from bole_tune import __version__, bench, commit_bench, config, kernels, shapes, timing, tree, workloads

    sources = sorted(Path(kernels.__file__).parent.rglob("*.py"))
    sources += [Path(module.__file__) for module in (bench, commit_bench, config, shapes, timing, tree, workloads)]
    digest = hashlib.sha256()
    for source in sources:
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return f"{__version__}+{digest.hexdigest()[:12]}"


def provenance(fp, method: str, extra: dict | None = None) -> dict:
    """Who measured, with what code and how: names and versions only, never a path of this machine."""
    env = environment()
    facts = fp.facts
    data = {"device": fp.name, "slug": fp.slug, "uuid": facts.get("uuid", ""), "code": code_version(),
            "driver": facts.get("driver_version", ""), "cuda": facts.get("cuda_driver_version", env.get("cuda", "")),
            "cuda_runtime": env.get("cuda", ""), "torch": env["torch"], "triton": env["triton"],
            "bole_tune": env["bole_tune"], "python": env["python"], "date": env["date"], "timing_method": method}
    data.update(extra or {})
    return data


def _latency(m: Measurement) -> dict:
    return {"p20": round(m.p20_us, 3), "p50": round(m.p50_us, 3), "p80": round(m.p80_us, 3)}


def config_entry(result: TuneResult, fp) -> dict:
    """The database entry (``configs``) of a verifier study's winner, with the kernel it was tuned on."""
    k = result.key
    return commit_entry(result, fp, kernel=PLANNER.policy.variant(k.batch_bucket, k.heads.hv, k.tree_bucket))


def commit_entry(result: TuneResult, fp, **extra) -> dict:
    """The database entry (``commit_configs``) of a commit study's winner; ``extra`` fields follow its latency."""
    best, m = result.best, result.best_measurement
    entry = {"key": result.key.as_dict(), "config": best.as_dict(), "latency_us": _latency(m), **extra,
             "rel_error": m.rel_error, "trials": result.counts, "study": result.study_name}
    if result.default_measurement and result.default_measurement.status == "ok":
        entry["default_config"] = result.default.as_dict()
        entry["default_latency_us"] = _latency(result.default_measurement)
        entry["speedup_vs_default"] = round(result.speedup, 3)
    entry["provenance"] = provenance(fp, m.method, {"workers": result.workers} if result.workers else None)
    return entry


class WorkerFailure(RuntimeError):
    """A tuning worker failed for a reason other than a crashing candidate."""


def tune_all(plan: ProfilePlan, runner_spec: dict, fp, storage_url: str, db_path, space: SearchSpace,
             workers: int = 1, sampler: str = "tpe", progress: Callable | None = None,
             job_dir: Path | None = None) -> list[TuneResult]:
    """Tune every bucket of the plan with ``workers`` worker processes; write the database once."""
    keys = plan_keys(plan)
    existing = _existing_configs(db_path)
    warm = {key.text: [c.as_dict() for c in warm_starts(key, existing)] for key in keys}
    job = Job(keys=[k.as_dict() for k in keys], storage=storage_url, slug=fp.slug, n_trials=plan.n_trials,
              runner=runner_spec, space=space.source, sampler=sampler, seed=plan.seed,
              shared_memory_limit=fp.facts.get("max_shared_memory_per_block_bytes"), warm_start=warm)
    storage = open_storage(storage_url)

    def report_progress():
        if progress:
            progress(sum(_finished(storage, fp.slug, key) for key in keys), len(keys) * plan.n_trials)

    with job_folder(job_dir) as folder:
        reports = run_workers(job, workers, folder.path / "job.json", progress=report_progress)
        failed = [r for r in reports if r.exit_code != 0]
        incomplete = [r for r in failed if r.exit_code == EXIT_RECORDING_INCOMPLETE and Path(r.log).exists()]
        if incomplete:  # the recording and the search space disagree: resuming cannot help
            raise RecordingIncomplete(Path(incomplete[0].log).read_text().strip().splitlines()[-1])
        if failed:
            kept = folder.keep()  # worker logs are kept only when a worker failed
            logs = {r.index: kept / Path(r.log).name for r in failed}
            tails = "; ".join(f"worker {r.index} (exit {r.exit_code}, log {logs[r.index]}): "
                              f"{logs[r.index].read_text().strip().splitlines()[-1:] if logs[r.index].exists() else ''}"
                              for r in failed)
            raise WorkerFailure(f"{len(failed)} of {len(reports)} tuning workers failed: {tails}. Finished trials are "
                                "kept in the storage; run the same command again to resume.")
    results = [load_result(storage, fp.slug, key) for key in keys]
    entries = {r.key.text: config_entry(r, fp) for r in results if r.best is not None}
    if entries:
        database.update(db_path, device=fp.as_dict(), configs=entries)
    return results


class JobFolder:
    """The folder of a run's job file and worker logs: ``given`` (the caller's, left as it is), else a new one
    in the temporary directory named after this host and process."""

    def __init__(self, given=None):
        self.own = given is None
        if self.own:
            remove_killed_job_folders()
            self.path = Path(tempfile.mkdtemp(prefix=f"{_job_prefix(os.getpid())}"))
        else:
            self.path = Path(given)
        self.kept = False

    def keep(self) -> Path:
        """Keep the folder (a worker failed: its log says why), renamed so that no later run removes it."""
        if self.own:
            kept = self.path.with_name("bole-tune-failed-" + self.path.name[len(JOB_PREFIX):])
            os.rename(self.path, kept)
            self.path = kept
        self.kept = True
        return self.path


def _job_prefix(pid: int) -> str:
    return f"{JOB_PREFIX}{pid}@{os.uname().nodename}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_killed_job_folders() -> list[Path]:
    """Remove the job folders in the temporary directory that runs on this host left when killed (SIGKILL,
    SIGTERM: no clean-up ran); return them."""
    removed = []
    for folder in Path(tempfile.gettempdir()).glob(f"{JOB_PREFIX}*@*"):
        pid = folder.name[len(JOB_PREFIX):].split("@", 1)[0]
        if pid.isdigit() and folder.name.startswith(_job_prefix(int(pid))) and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


@contextlib.contextmanager
def job_folder(given=None):
    """A `JobFolder`, removed when the block ends however it ends (an exception, Ctrl-C) unless kept."""
    folder = JobFolder(given)
    try:
        yield folder
    finally:
        if folder.own and not folder.kept:
            shutil.rmtree(folder.path, ignore_errors=True)


def open_storage_url(url: str | None) -> str:
    """The Optuna storage URL a run uses (default: the user's SQLite file), checked by opening it."""
    url = url or default_storage()
    open_storage(url)
    return url


def precompile_candidates(runner, keys: list[ShapeKey], space: SearchSpace, progress: Callable | None = None) -> int:
    """Compile every feasible config for ``keys`` in parallel worker processes first (GPU runs only);
    returns how many kernel variants compiled."""
    if not isinstance(getattr(runner, "inner", runner), GPURunner) or runner.fingerprint().kind != "gpu":
        return 0
    limit = runner.fingerprint().facts.get("max_shared_memory_per_block_bytes")
    configs = [c for c in space.configs()
               if any(feasible(c, k.heads.dk, k.heads.dv, k.tree_bucket, k.dtype, limit, bucket=k)[0] for k in keys)]
    done = [0]

    def compiled(total):
        done[0] += 1
        if progress:
            progress(Progress("compiling", done[0], total, "candidates in parallel"))

    return precompile(keys, configs, progress=compiled)


def _start(runner, db_path, storage: str | None, replace_corrupt: bool):
    """(storage URL, the runner's fingerprint, an empty `ProfileResult` with the database file's note): how a
    tuning run begins, before anything is measured (a corrupt file raises `DatabaseError` unless
    ``replace_corrupt``)."""
    storage = open_storage_url(storage)
    fp = runner.fingerprint()
    result = ProfileResult(fp.slug, fp.name, Path(db_path), on_gpu=fp.kind == "gpu")
    note = database.prepare(db_path, replace_corrupt)
    if note:
        result.notes.append(note)
    return storage, fp, result


def tune(plan: ProfilePlan, runner, space: SearchSpace, db_path, storage: str | None = None,
         workers: int | None = None, sampler: str = "tpe", replace_corrupt: bool = False,
         progress: Callable | None = None) -> ProfileResult:
    """Tune every bucket of ``plan`` with ``runner`` (a `GPURunner` or a `ReplayRunner`) in worker processes
    sharing ``storage``, and write the winners to ``db_path`` (a corrupt file there raises `DatabaseError`
    first, unless ``replace_corrupt``). ``workers``: default one per visible GPU (one for a replay).
    ``progress`` receives `Progress` reports."""
    if workers is not None and workers < 1:
        raise ValueError("--workers: must be at least 1")
    storage, fp, result = _start(runner, db_path, storage, replace_corrupt)
    if isinstance(runner, ReplayRunner):
        spec = {"kind": "replay", "path": str(Path(runner.path).resolve()), "delay": runner.delay}
        workers = workers or 1
    else:
        count = precompile_candidates(runner, plan_keys(plan), space, progress)
        if count:
            result.notes.append(f"compiled {count} kernel variants ahead of the search")
        spec = {"kind": "gpu", "repeats": plan.repeats}
        workers = workers or max(1, len(visible_devices()))
    result.notes.append(f"tuned with {workers} worker process{'es' if workers > 1 else ''} on {storage}")
    result.tuned = tune_all(plan, spec, fp, storage, db_path, space, workers=workers, sampler=sampler,
                            progress=lambda done, total: progress and progress(Progress("tuning", done, total)))
    return result


def tune_commits(plan: ProfilePlan, runner, space: SearchSpace, db_path, storage: str | None = None,
                 fp=None, progress: Callable | None = None, compile_ahead: bool = True,
                 sampler: str = "tpe") -> list[TuneResult]:
    """Tune the commit launch of every bucket of ``plan``'s commit grid (`ProfilePlan.commit_grid`), for one
    layer and for all of each model's GDN layers at once (`plan_commit_keys`), in this process: one Optuna
    study per key in ``storage`` (resumed if it holds trials), each candidate checked against
    `commit_closed_form` by ``runner`` before it is timed (a wrong one is recorded as such and never chosen).
    Each study runs in memory and is written to the storage when done (`tune_bucket_buffered`: SQLite's round
    trips would cost more than the measurements); a finished study is never run again. Winners are written to
    ``db_path``'s ``commit_configs`` at least every `FLUSH_SECONDS` and at the end.

    Commit studies take seconds each (one small kernel, no worker processes needed); on a GPU the
    candidates are compiled first in parallel processes (`bole_tune.commit_bench.precompile_commits`).
    """
    from bole_tune.commit_bench import precompile_commits

    if space.kind != "commit":
        raise ValueError(f"space: the commit is tuned over the commit search space, got the {space.kind} one")
    fp = fp or runner.fingerprint()
    space = for_device(space, fp.facts, fp.kind)
    keys = plan_commit_keys(plan)
    storage_url = open_storage_url(storage)
    store = open_storage(storage_url)
    limit = fp.facts.get("max_shared_memory_per_block_bytes")
    if compile_ahead and isinstance(getattr(runner, "inner", runner), GPURunner) and fp.kind == "gpu":
        done = [0]

        def compiled(total):
            done[0] += 1
            if progress:
                progress(Progress("compiling", done[0], total, "commit candidates in parallel"))

        configs = [c for c in space.configs() if any(feasible(c, k.heads.dk, k.heads.dv, k.tree_bucket, k.dtype,
                                                              limit)[0] for k in keys)]
        precompile_commits(keys, configs, progress=compiled)
    existing = _existing_configs(db_path, "commit_configs", CommitKey, CommitConfig)
    tuned: dict = {}
    results, pending = [], {}
    last_write = time.monotonic()
    total = len(keys) * plan.commit_trials

    def write():
        if pending:
            database.update(db_path, device=fp.as_dict(), commit_configs=dict(pending))
            pending.clear()

    try:
        for index, key in enumerate(keys):
            if progress:
                progress(Progress("tuning commits", index * plan.commit_trials, total, key.text))
            known = {**existing, **tuned}
            result = tune_bucket_buffered(runner, key, space, store, plan.commit_trials, fp.slug,
                                          warm_start=warm_starts(key, known), shared_memory_limit=limit,
                                          sampler=make_sampler(sampler, plan.seed, space))
            results.append(result)
            if result.best is not None:
                tuned[key.text] = (key, result.best)
                pending[key.text] = commit_entry(result, fp)
            if time.monotonic() - last_write >= FLUSH_SECONDS:
                write()
                last_write = time.monotonic()
    finally:  # what finished is written even when a candidate took the GPU down (DeviceLost) or on Ctrl-C
        write()
    if progress:
        progress(Progress("tuning commits", total, total))
    return results


def tune_commit(plan: ProfilePlan, runner, db_path, storage: str | None = None, replace_corrupt: bool = False,
                space: SearchSpace | None = None, sampler: str = "tpe",
                progress: Callable | None = None) -> ProfileResult:
    """`bole-tune tune --commit`: `tune_commits` alone, with ``runner`` (a `GPURunner`, or a `ReplayRunner` of a
    commit recording), written to ``db_path`` (a corrupt file there raises `DatabaseError` first, unless
    ``replace_corrupt``)."""
    space = space or SearchSpace.load(kind="commit")
    storage, fp, result = _start(runner, db_path, storage, replace_corrupt)
    result.notes.append(f"commit tuned in this process on {storage}")
    result.commit_tuned = tune_commits(plan, runner, space, db_path, storage, fp, progress, sampler=sampler)
    return result


def exhaustive(plan: ProfilePlan, runner, space: SearchSpace, progress: Callable | None = None) -> dict:
    """Measure every config of ``space`` on every bucket of ``plan`` (the tuner's yardstick): key text ->
    config text -> `Measurement`. Nothing is written to the database. A commit space measures the commit
    keys (`plan_commit_keys`)."""
    if space.kind == "commit":
        from bole_tune.commit_bench import precompile_commits

        keys = plan_commit_keys(plan)
        fp = runner.fingerprint()
        space = for_device(space, fp.facts, fp.kind)
        if isinstance(getattr(runner, "inner", runner), GPURunner) and fp.kind == "gpu":
            precompile_commits(keys, space.configs())
        total, done, found = len(keys) * len(space.configs()), [0], {}
        for key in keys:
            def measured_commit(config, m, key=key):
                done[0] += 1
                if progress:
                    progress(Progress("exhaustive", done[0], total, key.text))

            found[key.text] = exhaustive_bucket(runner, key, space, on_trial=measured_commit)
        return found
    keys = plan_keys(plan)
    precompile_candidates(runner, keys, space, progress)
    total, done, found = len(keys) * len(space.configs()), [0], {}

    def measured(config, m):
        done[0] += 1
        if progress:
            progress(Progress("exhaustive", done[0], total, key.text))

    for key in keys:
        found[key.text] = exhaustive_bucket(runner, key, space, on_trial=measured)
    return found


def profile(plan: ProfilePlan, db_dir=None, storage: str | None = None, workers: int | None = None,
            sampler: str = "tpe", replace_corrupt: bool = False, space: SearchSpace | None = None,
            progress: Callable | None = None, remeasure: bool = False,
            commit_space: SearchSpace | None = None) -> ProfileResult:
    """The main job: tune every bucket of ``plan`` on this machine's GPU (tree_verify's tiles with worker
    processes, then the commit's, `tune_commits`) and measure the latency curves,
    written to ``<db_dir>/<gpu>.yaml`` (`bole_tune.database.database_path`) as they are measured. Curve
    points the database holds, measured alike, are kept, not measured again (`measure_curves`), unless
    ``remeasure``.

    Without a CUDA GPU nothing is tuned (tile configs exist only for the Triton kernels on a GPU): the
    PyTorch fallback's curves are measured on the CPU instead, at `ProfilePlan.curve_grid`, and recorded
    as such. A corrupt database raises `DatabaseError` before anything runs, unless ``replace_corrupt``.
    """
    space = space or SearchSpace.load()
    runner = GPURunner("cuda" if torch.cuda.is_available() else "cpu", repeats=plan.repeats)
    fp = runner.fingerprint()
    db_path = database.database_path(fp.slug, db_dir)
    if fp.kind == "gpu":
        result = tune(plan, runner, space, db_path, storage, workers, sampler, replace_corrupt, progress)
        result.commit_tuned = tune_commits(plan, runner, commit_space or SearchSpace.load(kind="commit"), db_path,
                                           storage, fp, progress, sampler=sampler)
    else:
        result = ProfileResult(fp.slug, fp.name, db_path, on_gpu=False)
        note = database.prepare(db_path, replace_corrupt)
        result.notes += [note] if note else []
        result.notes.append("No CUDA GPU: tile configs exist only for the Triton kernels on a GPU, so nothing is "
                            "tuned. Measured the PyTorch closed-form fallback (and its commit) on the CPU with the "
                            "wall clock instead; the database records these as CPU fallback curves.")
    batches, sizes = plan.curve_grid(result.on_gpu)
    total, done = len(plan.models) * len(batches) * len(sizes), [0]

    def measured(model, batch, size, _):
        done[0] += 1
        if progress:
            progress(Progress("curves", done[0], total, f"{model.name} B={batch} T={size}"))

    for model in plan.models:
        result.curve_rows += measure_curves(model, plan, runner.device, db_path, fp, progress=measured,
                                            remeasure=remeasure)
    resumed = sum(1 for row in result.curve_rows if row.get("resumed"))
    if resumed:
        result.notes.append(f"resumed: {resumed} of {len(result.curve_rows)} curve points were already in the database, "
                            "measured by this code with these settings, and were kept (--remeasure measures them "
                            "again)")
    return result


def _existing_configs(db_path, section: str = "configs", key_type=ShapeKey, config_type=KernelConfig) -> dict:
    """``{name: (key, config)}`` of one section of the database at ``db_path`` (empty if it cannot be read)."""
    try:
        data = database.load(db_path)
    except database.DatabaseError:
        return {}
    return {name: (key_type.from_dict(e["key"]), config_type.from_dict(e["config"]))
            for name, e in data[section].items()}


def plan_commit_keys(plan: ProfilePlan) -> list[CommitKey]:
    """The commit launches tuned: every bucket of `ProfilePlan.commit_grid`, for one layer (`tree_commit`) and
    for all of the model's GDN layers in one launch (`tree_commit_layers`), models in order."""
    keys = []
    batches, sizes = plan.commit_grid()
    for model in plan.models:
        heads = model.heads(plan.tp)
        for layers in dict.fromkeys((1, model.num_gdn_layers)):
            for size in sizes:
                for batch in batches:
                    key = CommitKey.bucketed(heads, plan.dtype, size, batch, layers, plan.tp)
                    if key not in keys:
                        keys.append(key)
    return keys


def plan_keys(plan: ProfilePlan) -> list[ShapeKey]:
    keys = []
    for model in plan.models:
        heads = model.heads(plan.tp)
        for size in plan.tune_tree_sizes:
            for batch in plan.tune_batches:
                key = ShapeKey.bucketed(heads, plan.dtype, size, batch, plan.tp, fold=plan.fold, ring=plan.ring)
                if key not in keys:
                    keys.append(key)
    return keys


def _finished(storage, slug: str, key: ShapeKey) -> int:
    try:
        study = optuna.load_study(study_name=study_name(slug, key), storage=storage)
    except KeyError:
        return 0
    return len(study.get_trials(deepcopy=False, states=FINISHED))


def curve_name(model: ModelProfile, kernel: str, dtype: str, tp: int) -> str:
    """A curve's name in the database: ``<model>/<kernel>/<dtype>[/TP<n>]``."""
    return f"{model.name}/{kernel}/{dtype}" + (f"/TP{tp}" if tp != 1 else "")


SAME_RUN_FIELDS = ("code", "torch", "triton", "repeats")  # of a provenance: points measured alike


def measured_points(db_path, names: dict, shape: dict, run: dict) -> dict:
    """The points of the curves ``names`` (kernel -> curve name) that the database at ``db_path`` holds,
    measured for ``shape`` as this ``run`` would measure them (`SAME_RUN_FIELDS`): (kernel, batch, tree
    size) -> point. A point's run is the provenance of its date (``measured``, else the curve's)."""
    try:
        curves = database.load(db_path)["curves"]
    except database.DatabaseError:
        return {}
    found = {}
    for kernel, name in names.items():
        curve = curves.get(name)
        if not curve or curve.get("shape") != shape or curve.get("kernel") != kernel:
            continue
        provenance = curve.get("provenance") or {}
        runs = {r.get("date"): r for r in [*provenance.get("earlier_runs", []), provenance]}
        for point in curve["points"]:
            by = runs.get(point.get("measured", provenance.get("date")))
            if by is not None and all(by.get(f) == run.get(f) for f in SAME_RUN_FIELDS):
                found[(kernel, point["batch"], point["tree_size"])] = point
    return found


ROUND_KERNELS = ("round_verify_commit", "round_folded", "round_ring", "round_serial", "round_verify_commit_cpu_fallback")
"""The round curves: a layer's verify plus commit, timed together (the tuned launches), the folded verify (the
previous round's commit inside the verify, its tuned launch), a ring of pending rounds (`CaseBench.time_ring`: the
verify's tuned launch reading through the pending tokens, the folded verify's writing them every R-th round), the
serial engine's verify and its snapshot copy; on a CPU the fallback's verify plus commit."""


def time_commit(bench: CaseBench, config: CommitConfig | None, repeats: int, most_sets: int = 64) -> Timing:
    """`tree_commit` of each request's deepest node with ``config`` (as `CaseBench.time_commit`, which takes the
    runtime's lookup): every timed launch commits a fresh result."""
    tree, pool, inputs, slots = bench.sets(most_sets)
    results = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, validate=False)
               for i, x in enumerate(inputs)]
    accepted = bench.deepest(tree)

    def launch(i):
        results[i].committed.zero_()
        tree_commit(pool, slots[i], results[i], accepted, validate=False, config=config)

    return time_launches(launch, len(inputs), bench.device, repeats=repeats)


def time_round(bench: CaseBench, launch, config: CommitConfig | None, repeats: int, most_sets: int = 64) -> Timing:
    """One layer's round: `tree_verify` with ``launch`` then `tree_commit` of each request's deepest node with
    ``config``, timed together in one launch function (as `bole-tune bench`'s ``round_verify_commit`` row; the
    verify marks its result uncommitted, so every replay commits)."""
    launch = launch or bench.launch()
    tree, pool, inputs, slots = bench.sets(most_sets)
    accepted = bench.deepest(tree)
    outs = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, validate=False, launch=launch)
            for i, x in enumerate(inputs)]

    def round_(i):
        x = inputs[i]
        res = tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, validate=False, launch=launch, out=outs[i])
        tree_commit(pool, slots[i], res, accepted, validate=False, config=config)

    return time_launches(round_, len(inputs), bench.device, repeats=repeats)


def curve_kernels(on_gpu: bool, serial: bool = True) -> list[str]:
    """The curves `measure_curves` writes, in order."""
    if not on_gpu:
        return ["tree_verify_cpu_fallback", "tree_commit_cpu_fallback", "round_verify_commit_cpu_fallback"]
    kernels = ["tree_verify_tuned", "tree_verify_default", "serial_verify", "tree_commit", "round_verify_commit",
               "round_folded", "round_ring", "round_serial"]
    return kernels if serial else [k for k in kernels if k not in ("serial_verify", "round_serial")]


def measure_curves(model: ModelProfile, plan: ProfilePlan, device, db_path, fp,
                   progress: Callable | None = None, remeasure: bool = False) -> list[dict]:
    """Latency of every kernel at every (batch, tree size) of the plan, written as curves as it is measured
    (at least every `FLUSH_SECONDS` and at the end). A (batch, tree size) whose every kernel's point the
    database already holds, measured alike (`measured_points`; the tuned ones with the configs now tuned:
    tree_verify's ``config``, the commit's ``commit_config``), is not measured again unless ``remeasure``; its
    rows come back with ``resumed: True``.

    The round curves (`ROUND_KERNELS`) are what a GDN layer costs per speculation round: ``round_verify_commit``
    the tuned tree_verify then the tuned one-layer tree_commit, ``round_folded`` the folded verify with its tuned
    config (`CaseBench.time_folded`, with its reset of the previous round's commit marks), ``round_ring`` a ring of
    `RING_ROUNDS` pending rounds over a cycle (`CaseBench.time_ring`: reads on the verify's tuned config, writes on the
    ring write's, whose config the point records), ``round_serial`` serial_verify then its
    snapshot copy."""
    shape = model.heads(plan.tp)
    shape_dict = {"hv": shape.hv, "hk": shape.hk, "dk": shape.dk, "dv": shape.dv}
    dtype = torch_dtype(plan.dtype)
    on_gpu = torch.device(device).type == "cuda"
    kernels = curve_kernels(on_gpu, plan.serial)
    names = {k: curve_name(model, k, plan.dtype, plan.tp) for k in kernels}
    run = provenance(fp, "", {"repeats": plan.repeats})  # one per run: its date names the points it measures
    done = {} if remeasure else measured_points(db_path, names, shape_dict, run)
    pending = {k: [] for k in kernels}
    last_write = [time.monotonic()]

    def write():
        if any(pending.values()):
            database.update(db_path, device=fp.as_dict(), curves={
                names[k]: {"model": model.name, "kernel": k, "dtype": plan.dtype, "tp": plan.tp,
                           "shape": dict(shape_dict), "points": list(pts), "provenance": dict(run)}
                for k, pts in pending.items() if pts})
            for pts in pending.values():
                pts.clear()
        last_write[0] = time.monotonic()

    def current(held: dict, decision, commit, fold, ring_write) -> bool:
        """Whether the held points ran the configs now tuned."""
        if decision is not None and held["tree_verify_tuned"].get("config") != decision.config.as_dict():
            return False
        if fold is not None and held["round_folded"].get("config") != fold.config.as_dict():
            return False
        if ring_write is not None and held["round_ring"].get("config") != ring_write.config.as_dict():
            return False
        return commit is None or all(held[k].get("commit_config") == commit.config.as_dict()
                                     for k in ("tree_commit", "round_verify_commit"))

    rows = []
    batches, sizes = plan.curve_grid(on_gpu)
    for batch in batches:
        for size in sizes:
            key = ShapeKey.bucketed(shape, plan.dtype, size, batch, plan.tp)
            # the configs of the database being written, just tuned
            directory = Path(db_path).parent
            decision = decide(key, fp.slug, "nearest", directory=directory) if on_gpu else None
            commit = (decide_commit(CommitKey(shape=key, layers=1), fp.slug, "nearest", directory=directory,
                                    num_requests=batch) if on_gpu else None)
            fold = (decide(replace(key, fold=True), fp.slug, "nearest", directory=directory)
                    if on_gpu else None)
            ring_write = (decide(replace(key, ring=True), fp.slug, "nearest", directory=directory)
                          if on_gpu else None)
            held = {k: done.get((k, batch, size)) for k in kernels}
            if all(held.values()) and current(held, decision, commit, fold, ring_write):
                rows += [{"model": model.name, "kernel": k, **point, "resumed": True} for k, point in held.items()]
                if progress:
                    progress(model, batch, size, {})
                continue
            case = BenchCase(shape, batch, size, dtype, label=model.name)
            bench = CaseBench(case, device)
            measured = {}
            if on_gpu:
                # the tuned point runs the kernel its config was tuned on, as tree_verify(config=None) does
                tuned = bench.launch(decision.config, tuned_on=decision.kernel)
                for name, verify, launch in (
                        ("tree_verify_tuned", tree_verify, tuned),
                        ("tree_verify_default", tree_verify, bench.launch(default_config(shape.dk, shape.dv))),
                        ("serial_verify", serial_verify, None)):
                    if name not in kernels:
                        continue
                    error = bench.check(verify, launch)
                    timing, _ = bench.time_verify(verify, launch, plan.repeats,
                                                  most_sets=2 if verify is serial_verify else 64)
                    measured[name] = (timing, error, launch and launch.config, None)
                if "round_serial" in kernels:
                    measured["round_serial"] = (bench.time_serial_round(plan.repeats), None, None, None)
                measured["tree_commit"] = (time_commit(bench, commit.config, plan.repeats), None, None, commit.config)
                measured["round_verify_commit"] = (time_round(bench, tuned, commit.config, plan.repeats), None,
                                                   tuned.config, commit.config)
                folded = bench.launch(fold.config, tuned_on=fold.kernel, fold=True)
                measured["round_folded"] = (bench.time_folded(folded, plan.repeats), None, folded.config, None)
                writes = bench.launch(ring_write.config, tuned_on=ring_write.kernel, ring=True)
                ring = bench.time_ring(layers=model.num_gdn_layers, repeats=plan.repeats, read_launch=tuned,
                                       write_launch=writes)
                measured["round_ring"] = (ring["round_ring"], None, writes.config, None)  # reads: the verify's
            else:
                error = bench.check(tree_verify)
                timing, _ = bench.time_verify(tree_verify, repeats=max(3, plan.repeats // 10), most_sets=2)
                measured["tree_verify_cpu_fallback"] = (timing, error, None, None)
                measured["tree_commit_cpu_fallback"] = (bench.time_commit(3), None, None, None)
                measured["round_verify_commit_cpu_fallback"] = (time_round(bench, None, None, 3, most_sets=2), None,
                                                                None, None)
            for name in kernels:  # in the curves' order
                timing, error, config, commit_config = measured[name]
                point = {"batch": batch, "tree_size": size, "p20": round(timing.p20_us, 3),
                         "p50": round(timing.p50_us, 3), "p80": round(timing.p80_us, 3), "measured": run["date"]}
                if config is not None:
                    point["config"] = config.as_dict()
                if commit_config is not None:
                    point["commit_config"] = commit_config.as_dict()
                if error is not None:
                    point["rel_error"] = error
                pending[name].append(point)
                run["timing_method"] = timing.method.split(",")[0]
                rows.append({"model": model.name, "kernel": name, **point})
            if progress:
                progress(model, batch, size, measured)
            if time.monotonic() - last_write[0] >= FLUSH_SECONDS:
                write()
    write()
    return rows
