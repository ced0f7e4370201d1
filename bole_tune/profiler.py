"""`bole-tune profile` / `tune`: tune tile configs per bucket, measure latency curves, write the database.

For each model's GDN shape the job (1) tunes the chosen (tree bucket, batch bucket) grid with
Optuna, neighbours warm-starting each other, writing each bucket's winner to the database as soon as
it is known (an interrupted run loses nothing and resumes from the Optuna storage), then (2) measures
per-layer latency against tree size and batch for tree_verify with the tuned config and with the
default, serial_verify and tree_commit, stored as curves with provenance.

Without a GPU nothing can be tuned (tile configs do not exist on the CPU path); the job measures
the PyTorch fallback's curves instead, says so, and still writes a valid database.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from bole_tune import database
from bole_tune.bench import DTYPES, BenchCase, CaseBench, environment
from bole_tune.config import KernelConfig, default_config
from bole_tune.database import ShapeKey, batch_bucket, tree_bucket
from bole_tune.lookup import decide
from bole_tune.profiles import ModelProfile
from bole_tune.runners import Measurement
from bole_tune.search_space import SearchSpace
from bole_tune.tuner import TuneResult, warm_starts

FULL_BATCHES = (1, 2, 4, 8, 16, 32)
FULL_TREE_SIZES = (8, 16, 32, 64, 128, 256)
QUICK_BATCHES = (1, 4, 16)
QUICK_TREE_SIZES = (16, 64, 128)


@dataclass
class ProfilePlan:
    models: list[ModelProfile]
    dtype: str = "bf16"
    tp: int = 1
    tune_batches: tuple = FULL_BATCHES
    tune_tree_sizes: tuple = FULL_TREE_SIZES
    curve_batches: tuple = FULL_BATCHES
    curve_tree_sizes: tuple = FULL_TREE_SIZES
    n_trials: int = 32
    repeats: int = 30
    curves: bool = True
    serial: bool = True
    seed: int = 0


@dataclass
class ProfileReport:
    slug: str
    path: str
    measured_on: str
    tuned: list[TuneResult] = field(default_factory=list)
    curve_rows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def provenance(fp, method: str, extra: dict | None = None) -> dict:
    env = environment()
    facts = fp.facts
    data = {"device": fp.name, "slug": fp.slug, "uuid": facts.get("uuid", ""),
            "driver": facts.get("driver_version", ""), "cuda": facts.get("cuda_driver_version", env.get("cuda", "")),
            "cuda_runtime": env.get("cuda", ""), "torch": env["torch"], "triton": env["triton"],
            "bole_tune": env["bole_tune"], "python": env["python"], "date": env["date"], "timing_method": method}
    data.update(extra or {})
    return data


def _latency(m: Measurement) -> dict:
    return {"p20": round(m.p20_us, 3), "p50": round(m.p50_us, 3), "p80": round(m.p80_us, 3)}


def config_entry(result: TuneResult, fp) -> dict:
    best, m = result.best, result.best_measurement
    from bole_tune.kernels.tree_verify import pick_variant

    k = result.key
    entry = {"key": k.as_dict(), "config": best.as_dict(), "latency_us": _latency(m),
             "kernel": pick_variant(k.batch_bucket, k.hv, k.tree_bucket),
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
    from bole_tune.tuner import load_result, open_storage
    from bole_tune.workers import Job, run_workers

    keys = plan_keys(plan)
    existing = _existing_configs(db_path)
    warm = {key.text: [c.as_dict() for c in warm_starts(key, existing)] for key in keys}
    job = Job(keys=[k.as_dict() for k in keys], storage=storage_url, slug=fp.slug, n_trials=plan.n_trials,
              runner=runner_spec, space=space.source, sampler=sampler, seed=plan.seed,
              shared_memory_limit=fp.facts.get("max_shared_memory_per_block_bytes"), warm_start=warm)
    own_dir = job_dir is None
    job_dir = Path(job_dir or tempfile.mkdtemp(prefix="bole-tune-job-"))
    storage = open_storage(storage_url)

    def report_progress():
        if progress:
            progress(sum(_finished(storage, fp.slug, key) for key in keys), len(keys) * plan.n_trials)

    reports = run_workers(job, workers, job_dir / "job.json", progress=report_progress)
    failed = [r for r in reports if r.exit_code != 0]
    if failed:
        tails = "; ".join(f"worker {r.index} (exit {r.exit_code}, log {r.log}): "
                          f"{Path(r.log).read_text().strip().splitlines()[-1:] if Path(r.log).exists() else ''}"
                          for r in failed)
        raise WorkerFailure(f"{len(failed)} of {len(reports)} tuning workers failed: {tails}. Finished trials are "
                            "kept in the storage; run the same command again to resume.")
    if own_dir:  # worker logs are kept only when something failed
        shutil.rmtree(job_dir, ignore_errors=True)
    results = [load_result(storage, fp.slug, key) for key in keys]
    entries = {r.key.text: config_entry(r, fp) for r in results if r.best is not None}
    if entries:
        database.update(db_path, device=fp.as_dict(), configs=entries)
    return results


def _existing_configs(db_path) -> dict:
    try:
        data = database.load(db_path)
    except database.DatabaseError:
        return {}
    return {name: (ShapeKey.from_dict(e["key"]), KernelConfig(**e["config"])) for name, e in data["configs"].items()}


def plan_keys(plan: ProfilePlan) -> list[ShapeKey]:
    keys = []
    for model in plan.models:
        shape = model.gdn(plan.tp)
        for size in plan.tune_tree_sizes:
            for batch in plan.tune_batches:
                key = ShapeKey(shape.hv, shape.hk, shape.dk, shape.dv, plan.dtype, tree_bucket(size),
                               batch_bucket(batch), plan.tp)
                if key not in keys:
                    keys.append(key)
    return keys


def _finished(storage, slug: str, key: ShapeKey) -> int:
    import optuna

    from bole_tune.tuner import FINISHED, study_name
    try:
        study = optuna.load_study(study_name=study_name(slug, key), storage=storage)
    except KeyError:
        return 0
    return len(study.get_trials(deepcopy=False, states=FINISHED))


def measure_curves(model: ModelProfile, plan: ProfilePlan, device, db_path, fp,
                   progress: Callable | None = None) -> list[dict]:
    """Latency of every kernel at every (batch, tree size) of the plan, written as curves."""
    import torch

    from bole_tune.kernels import serial_verify, tree_verify

    shape = model.gdn(plan.tp)
    dtype = DTYPES[plan.dtype]
    on_gpu = torch.device(device).type == "cuda"
    entries = database.load(db_path)["configs"] if db_path.exists() else {}
    kernels = ["tree_verify_tuned", "tree_verify_default", "serial_verify", "tree_commit"] if on_gpu \
        else ["tree_verify_cpu_fallback", "tree_commit_cpu_fallback"]
    if not plan.serial and on_gpu:
        kernels.remove("serial_verify")
    points = {k: [] for k in kernels}
    rows = []
    method = ""
    for batch in plan.curve_batches:
        for size in plan.curve_tree_sizes:
            case = BenchCase(shape, batch, size, dtype, label=model.name)
            bench = CaseBench(case, device)
            key = ShapeKey(shape.hv, shape.hk, shape.dk, shape.dv, plan.dtype, tree_bucket(size), batch_bucket(batch),
                           plan.tp)
            measured = {}
            if on_gpu:
                decision = decide(key, fp.slug, "nearest", entries=entries)
                fallback = default_config(shape.dk, shape.dv)
                # the tuned point runs the kernel its config was tuned on, as tree_verify(config=None) does
                tuned_on = decision.kernel if decision.kernel == "fused" or size <= 64 else None
                for name, verify, config, variant in (("tree_verify_tuned", tree_verify, decision.config, tuned_on),
                                                      ("tree_verify_default", tree_verify, fallback, None),
                                                      ("serial_verify", serial_verify, None, None)):
                    if name not in kernels:
                        continue
                    error = bench.check(verify, config, variant)
                    timing, _ = bench.time_verify(verify, config, plan.repeats,
                                                  most_sets=2 if verify is serial_verify else 64, variant=variant)
                    measured[name] = (timing, error, config)
                measured["tree_commit"] = (bench.time_commit(plan.repeats), None, None)
            else:
                error = bench.check(tree_verify)
                timing, _ = bench.time_verify(tree_verify, None, max(3, plan.repeats // 10), most_sets=2)
                measured["tree_verify_cpu_fallback"] = (timing, error, None)
                measured["tree_commit_cpu_fallback"] = (bench.time_commit(3), None, None)
            for name, (timing, error, config) in measured.items():
                point = {"batch": batch, "tree_size": size, "p20": round(timing.p20_us, 3),
                         "p50": round(timing.p50_us, 3), "p80": round(timing.p80_us, 3)}
                if config is not None:
                    point["config"] = config.as_dict()
                if error is not None:
                    point["rel_error"] = error
                points[name].append(point)
                method = timing.method.split(",")[0]
                rows.append({"model": model.name, "kernel": name, **point})
            if progress:
                progress(model, batch, size, measured)
    curves = {}
    tp = f"/TP{plan.tp}" if plan.tp != 1 else ""
    for name, pts in points.items():
        curves[f"{model.name}/{name}/{plan.dtype}{tp}"] = {
            "model": model.name, "kernel": name, "dtype": plan.dtype, "tp": plan.tp,
            "shape": {"hv": shape.hv, "hk": shape.hk, "dk": shape.dk, "dv": shape.dv},
            "points": pts, "provenance": provenance(fp, method, {"repeats": plan.repeats}),
        }
    database.update(db_path, device=fp.as_dict(), curves=curves)
    return rows


def geometric_mean(values) -> float:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")
