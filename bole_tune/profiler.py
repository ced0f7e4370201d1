"""`bole-tune profile` / `tune`: tune tile configs per bucket, measure latency curves, write the database.

For each model's GDN shape the job (1) tunes the chosen (tree bucket, batch bucket) grid with
Optuna, neighbours warm-starting each other, writing each bucket's winner to the database as soon as
it is known (an interrupted run loses nothing and resumes from the Optuna storage), then (2) measures
per-layer latency against tree size and batch for tree_verify with the tuned config and with the
default, serial_verify and tree_commit, stored as curves with provenance.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import optuna
import torch

from bole_tune import database
from bole_tune.bench import BenchCase, CaseBench, environment
from bole_tune.config import KernelConfig, default_config
from bole_tune.database import ShapeKey
from bole_tune.kernels import PLANNER, serial_verify, tree_verify
from bole_tune.lookup import decide
from bole_tune.precompile import precompile
from bole_tune.profiles import DEFAULT_MODELS, ModelProfile, resolve_model
from bole_tune.runners import GPURunner, Measurement, RecordingIncomplete, ReplayRunner
from bole_tune.search_space import SearchSpace, feasible
from bole_tune.shapes import BATCH_BUCKETS, TREE_BUCKETS, torch_dtype
from bole_tune.tuner import (FINISHED, TuneResult, default_storage, exhaustive_bucket, load_result, open_storage,
                             study_name, warm_starts)
from bole_tune.workers import EXIT_RECORDING_INCOMPLETE, Job, run_workers, visible_devices

QUICK_BATCHES = (1, 4, 16)
QUICK_TREE_SIZES = (16, 64, 128)
CPU_CURVE_BATCHES = (1, 2)  # the CPU fallback's curves, when none are asked for: seconds, not hours
CPU_CURVE_TREE_SIZES = (8, 16)
FLUSH_SECONDS = 30.0  # curve points are written at least this often: a killed run loses at most this much work
JOB_PREFIX = "bole-tune-job-"  # + the pid of the run, so that the next run can tell a killed run's folder


@dataclass
class ProfilePlan:
    """What `profile` and `tune` do: the models' heads per rank, the buckets tuned, the curve points.

    curve_batches, curve_tree_sizes: None measures the tuned grid on a GPU and `CPU_CURVE_BATCHES` x
    `CPU_CURVE_TREE_SIZES` on the CPU fallback.
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

    def curve_grid(self, on_gpu: bool) -> tuple[tuple, tuple]:
        """(batches, tree sizes) of the latency curves."""
        if not on_gpu and self.curve_batches is None and self.curve_tree_sizes is None:
            return CPU_CURVE_BATCHES, CPU_CURVE_TREE_SIZES
        return self.curve_batches or self.tune_batches, self.curve_tree_sizes or self.tune_tree_sizes


def make_plan(models=None, dtype: str = "bf16", tp: int = 1, quick: bool = False, batches=None, tree_sizes=None,
              trials: int | None = None, repeats: int = 30, curve_batches=None, curve_tree_sizes=None,
              serial: bool = True) -> ProfilePlan:
    """A checked plan from a user's choices (`DEFAULT_MODELS` when ``models`` is None; ``quick``: the small
    grid and 16 trials). A bad choice raises ValueError (or `ProfileError` for a model) naming it."""
    profiles = [resolve_model(m) if isinstance(m, str) else m for m in (models or DEFAULT_MODELS)]
    for model in profiles:
        model.heads(tp)
    trials = trials if trials is not None else (16 if quick else 32)
    if trials < 1:
        raise ValueError("--trials: must be at least 1")
    if repeats < 3:
        raise ValueError("--repeats: must be at least 3")
    return ProfilePlan(models=profiles, dtype=dtype, tp=tp,
                       tune_batches=tuple(batches or (QUICK_BATCHES if quick else BATCH_BUCKETS)),
                       tune_tree_sizes=tuple(tree_sizes or (QUICK_TREE_SIZES if quick else TREE_BUCKETS)),
                       curve_batches=tuple(curve_batches or batches or ()) or None,
                       curve_tree_sizes=tuple(curve_tree_sizes or tree_sizes or ()) or None,
                       n_trials=trials, repeats=repeats, serial=serial)


@dataclass(frozen=True)
class Progress:
    """A progress report: ``done`` of ``total`` (None: not known yet) in ``stage``, on ``label``."""

    stage: str  # "compiling", "tuning", "exhaustive", "curves"
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
    curve_rows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@functools.lru_cache(maxsize=None)
def code_version() -> str:
    """bole-tune's version and a digest of the sources that run and time the kernels (the kernels package,
    the bench, timing, workload, tree, config and shape modules): what says two measurements ran the same
    code. An edit elsewhere (the command line, the database) does not make finished points stale."""
    from bole_tune import __version__, bench, config, kernels, shapes, timing, tree, workloads

    sources = sorted(Path(kernels.__file__).parent.rglob("*.py"))
    sources += [Path(module.__file__) for module in (bench, config, shapes, timing, tree, workloads)]
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
    best, m = result.best, result.best_measurement
    k = result.key
    entry = {"key": k.as_dict(), "config": best.as_dict(), "latency_us": _latency(m),
             "kernel": PLANNER.policy.variant(k.batch_bucket, k.heads.hv, k.tree_bucket),
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
               if any(feasible(c, k.heads.dk, k.heads.dv, k.tree_bucket, k.dtype, limit)[0] for k in keys)]
    done = [0]

    def compiled(total):
        done[0] += 1
        if progress:
            progress(Progress("compiling", done[0], total, "candidates in parallel"))

    return precompile(keys, configs, progress=compiled)


def tune(plan: ProfilePlan, runner, space: SearchSpace, db_path, storage: str | None = None,
         workers: int | None = None, sampler: str = "tpe", replace_corrupt: bool = False,
         progress: Callable | None = None) -> ProfileResult:
    """Tune every bucket of ``plan`` with ``runner`` (a `GPURunner` or a `ReplayRunner`) in worker processes
    sharing ``storage``, and write the winners to ``db_path`` (a corrupt file there raises `DatabaseError`
    first, unless ``replace_corrupt``). ``workers``: default one per visible GPU (one for a replay).
    ``progress`` receives `Progress` reports."""
    if workers is not None and workers < 1:
        raise ValueError("--workers: must be at least 1")
    storage = open_storage_url(storage)
    fp = runner.fingerprint()
    result = ProfileResult(fp.slug, fp.name, Path(db_path), on_gpu=fp.kind == "gpu")
    note = database.prepare(db_path, replace_corrupt)
    if note:
        result.notes.append(note)
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


def exhaustive(plan: ProfilePlan, runner, space: SearchSpace, progress: Callable | None = None) -> dict:
    """Measure every config of ``space`` on every bucket of ``plan`` (the tuner's yardstick): key text ->
    config text -> `Measurement`. Nothing is written to the database."""
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
            progress: Callable | None = None, remeasure: bool = False) -> ProfileResult:
    """The main job: tune every bucket of ``plan`` on this machine's GPU and measure the latency curves,
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


def _existing_configs(db_path) -> dict:
    try:
        data = database.load(db_path)
    except database.DatabaseError:
        return {}
    return {name: (ShapeKey.from_dict(e["key"]), KernelConfig.from_dict(e["config"]))
            for name, e in data["configs"].items()}


def plan_keys(plan: ProfilePlan) -> list[ShapeKey]:
    keys = []
    for model in plan.models:
        heads = model.heads(plan.tp)
        for size in plan.tune_tree_sizes:
            for batch in plan.tune_batches:
                key = ShapeKey.bucketed(heads, plan.dtype, size, batch, plan.tp)
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


def measure_curves(model: ModelProfile, plan: ProfilePlan, device, db_path, fp,
                   progress: Callable | None = None, remeasure: bool = False) -> list[dict]:
    """Latency of every kernel at every (batch, tree size) of the plan, written as curves as it is measured
    (at least every `FLUSH_SECONDS` and at the end). A (batch, tree size) whose every kernel's point the
    database already holds, measured alike (`measured_points`; the tuned one with the config now tuned), is
    not measured again unless ``remeasure``; its rows come back with ``resumed: True``."""
    shape = model.heads(plan.tp)
    shape_dict = {"hv": shape.hv, "hk": shape.hk, "dk": shape.dk, "dv": shape.dv}
    dtype = torch_dtype(plan.dtype)
    on_gpu = torch.device(device).type == "cuda"
    kernels = ["tree_verify_tuned", "tree_verify_default", "serial_verify", "tree_commit"] if on_gpu \
        else ["tree_verify_cpu_fallback", "tree_commit_cpu_fallback"]
    if not plan.serial and on_gpu:
        kernels.remove("serial_verify")
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

    rows = []
    batches, sizes = plan.curve_grid(on_gpu)
    for batch in batches:
        for size in sizes:
            key = ShapeKey.bucketed(shape, plan.dtype, size, batch, plan.tp)
            # the configs of the database being written, just tuned
            decision = decide(key, fp.slug, "nearest", directory=Path(db_path).parent) if on_gpu else None
            held = [done.get((k, batch, size)) for k in kernels]
            if all(held) and (decision is None or held[0].get("config") == decision.config.as_dict()):
                rows += [{"model": model.name, "kernel": k, **point, "resumed": True} for k, point in zip(kernels, held)]
                if progress:
                    progress(model, batch, size, {})
                continue
            case = BenchCase(shape, batch, size, dtype, label=model.name)
            bench = CaseBench(case, device)
            measured = {}
            if on_gpu:
                # the tuned point runs the kernel its config was tuned on, as tree_verify(config=None) does
                for name, verify, launch in (
                        ("tree_verify_tuned", tree_verify, bench.launch(decision.config, tuned_on=decision.kernel)),
                        ("tree_verify_default", tree_verify, bench.launch(default_config(shape.dk, shape.dv))),
                        ("serial_verify", serial_verify, None)):
                    if name not in kernels:
                        continue
                    error = bench.check(verify, launch)
                    timing, _ = bench.time_verify(verify, launch, plan.repeats,
                                                  most_sets=2 if verify is serial_verify else 64)
                    measured[name] = (timing, error, launch and launch.config)
                measured["tree_commit"] = (bench.time_commit(plan.repeats), None, None)
            else:
                error = bench.check(tree_verify)
                timing, _ = bench.time_verify(tree_verify, repeats=max(3, plan.repeats // 10), most_sets=2)
                measured["tree_verify_cpu_fallback"] = (timing, error, None)
                measured["tree_commit_cpu_fallback"] = (bench.time_commit(3), None, None)
            for name, (timing, error, config) in measured.items():
                point = {"batch": batch, "tree_size": size, "p20": round(timing.p20_us, 3),
                         "p50": round(timing.p50_us, 3), "p80": round(timing.p80_us, 3), "measured": run["date"]}
                if config is not None:
                    point["config"] = config.as_dict()
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
