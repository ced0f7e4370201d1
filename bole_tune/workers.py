"""Tuning workers: one process per GPU (or several per GPU), sharing studies through Optuna storage.

The coordinator (`bole-tune tune` / `profile`) writes a job file, starts ``workers`` processes of
``python -m bole_tune.workers JOB INDEX``, each pinned to one visible GPU by CUDA_VISIBLE_DEVICES, and
supervises them: a worker that loses its GPU context to a crashing candidate exits with status 3
after recording that candidate as infeasible, and is restarted, resuming from the storage. When all
workers are done the coordinator reads the studies and writes the database once.

On other hosts, the same ``bole-tune tune --storage postgresql://...`` joins the same studies: every
worker stops when a study holds its target number of finished trials, wherever they ran.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import optuna
import torch

from bole_tune.atomic import write_text_atomic
from bole_tune.config import KernelConfig
from bole_tune.database import ShapeKey
from bole_tune.runners import DeviceLost, GPURunner, RecordingIncomplete, ReplayRunner
from bole_tune.search_space import SearchSpace
from bole_tune.tuner import best_config_of, neighbours, open_storage, tune_bucket

EXIT_DEVICE_LOST = 3
EXIT_RECORDING_INCOMPLETE = 4  # a replay met a config its recording lacks: restarting cannot help
SAMPLERS = ("tpe", "grid", "random")


@dataclass
class Job:
    keys: list[dict]
    storage: str
    slug: str
    n_trials: int
    runner: dict  # {"kind": "gpu", "repeats": 30} or {"kind": "replay", "path": ..., "delay": 0.0}
    space: str = ""
    sampler: str = "tpe"
    seed: int = 0
    shared_memory_limit: int | None = None
    warm_start: dict = field(default_factory=dict)  # key text -> [config dicts] known before the run

    def save(self, path: Path) -> None:
        write_text_atomic(path, json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path) -> "Job":
        return cls(**json.loads(Path(path).read_text()))


def make_runner(spec: dict):
    if spec["kind"] == "replay":
        return ReplayRunner(spec["path"], delay=spec.get("delay", 0.0))
    return GPURunner("cuda", repeats=spec.get("repeats", 30))


def make_sampler(name: str, seed: int, space):
    if name == "grid":
        return optuna.samplers.GridSampler({name: list(values) for name, values in space.values.items()}, seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=6, multivariate=True)


def _exit_with_parent() -> None:
    """A worker whose coordinator died (even by SIGKILL) stops instead of tuning on alone."""
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def run_worker(job: Job, index: int) -> int:
    """Tune every key of the job, in order, as worker ``index``; returns the process exit status."""
    space = SearchSpace.load(job.space or None)
    storage = open_storage(job.storage)
    runner = make_runner(job.runner)
    worker = f"{socket.gethostname()}:{os.getpid()}"
    tuned = {}
    for data in job.keys:
        key = ShapeKey.from_dict(data)
        warm = [KernelConfig.from_dict(c) for c in job.warm_start.get(key.text, [])]
        warm += [c for c in neighbours(key, tuned) if c not in warm]
        # a grid sampler's grid ids index a list shuffled by its seed: every worker must share one seed
        sampler = make_sampler(job.sampler, job.seed + (0 if job.sampler == "grid" else index), space)
        try:
            tune_bucket(runner, key, space, storage, job.n_trials, job.slug, warm_start=warm,
                        shared_memory_limit=job.shared_memory_limit, sampler=sampler, worker=worker)
        except DeviceLost as error:
            print(f"worker {index}: {error}", file=sys.stderr, flush=True)
            return EXIT_DEVICE_LOST
        except RecordingIncomplete as error:
            print(error, file=sys.stderr, flush=True)
            return EXIT_RECORDING_INCOMPLETE
        best = best_config_of(storage, job.slug, key)
        if best is not None:
            tuned[key.text] = (key, best)
    return 0


def visible_devices() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (indices, UUIDs or MIG ids)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


WORKER_MEMORY = {"gpu": 2 << 30, "replay": 512 << 20}
"""Host memory one worker process needs, by runner kind: torch, triton and optuna imported hold about 300 MiB
(290 MiB max RSS measured on the CPU); a CUDA context, compiled kernels and the input sets add over 1 GiB."""

WORKERS_PER_CORE = 4  # replay workers mostly wait (on the storage, on a replay delay); beyond this they only queue
WORKERS_PER_GPU = 4  # several workers can share a GPU while others compile; more only queue for it


def available_memory() -> int:
    """Bytes of host memory available to new processes (MemAvailable on Linux, free pages elsewhere)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def worker_limit(kind: str, trials: int) -> tuple[int, str]:
    """The most worker processes worth starting on this host for a job of ``trials`` trials in all, and
    which bound sets it: CPU cores, available memory, GPUs (``kind`` "gpu") and the trials themselves."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    bounds = {f"{cores} CPU cores x {WORKERS_PER_CORE}": WORKERS_PER_CORE * cores,
              f"{available_memory() >> 20} MiB of available memory at {WORKER_MEMORY[kind] >> 20} MiB per worker":
                  max(1, available_memory() // WORKER_MEMORY[kind]),
              f"{trials} trials in the job": max(1, trials)}
    if kind == "gpu":
        gpus = max(1, len(visible_devices()))
        bounds[f"{gpus} GPU{'s' if gpus > 1 else ''} x {WORKERS_PER_GPU}"] = WORKERS_PER_GPU * gpus
    reason = min(bounds, key=bounds.get)
    return bounds[reason], reason


def check_workers(workers: int, kind: str, trials: int) -> int:
    """``workers`` if it is at least 1 and within `worker_limit`; else a ValueError naming ``--workers``."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"--workers: must be a positive int, got {workers!r}")
    limit, reason = worker_limit(kind, trials)
    if workers > limit:
        raise ValueError(f"--workers: {workers} is more than this host and job can use (at most {limit}: {reason})")
    return workers


def job_trials(job: "Job") -> int:
    """Trials the job asks for in all: buckets x trials per bucket (a grid: x the space's configs)."""
    per_bucket = SearchSpace.load(job.space or None).size if job.sampler == "grid" else job.n_trials
    return len(job.keys) * per_bucket


@dataclass
class WorkerReport:
    index: int
    device: str
    restarts: int = 0
    exit_code: int | None = None
    log: str = ""


def run_workers(job: Job, workers: int, job_path: Path, progress=None, max_restarts: int = 3,
                poll: float = 1.0) -> list[WorkerReport]:
    """Start and supervise ``workers`` worker processes until all are done (at most `worker_limit`)."""
    check_workers(workers, job.runner["kind"], job_trials(job))
    devices = visible_devices() if job.runner["kind"] == "gpu" else []
    job.save(job_path)
    reports, processes = [], {}

    def start(report: WorkerReport):
        env = dict(os.environ)
        if report.device:
            env["CUDA_VISIBLE_DEVICES"] = report.device
        log = open(report.log, "a")
        processes[report.index] = (subprocess.Popen([sys.executable, "-m", "bole_tune.workers", str(job_path),
                                                     str(report.index)], env=env, stdout=log, stderr=log), log)

    for i in range(workers):
        report = WorkerReport(i, devices[i % len(devices)] if devices else "", log=str(job_path) + f".worker{i}.log")
        reports.append(report)
        start(report)
    try:
        while processes:
            time.sleep(poll)
            if progress:
                progress()
            for index, (process, log) in list(processes.items()):
                code = process.poll()
                if code is None:
                    continue
                log.close()
                del processes[index]
                report = reports[index]
                report.exit_code = code
                if code == EXIT_DEVICE_LOST and report.restarts < max_restarts:
                    report.restarts += 1
                    start(report)
    finally:
        for process, log in processes.values():
            process.kill()
            log.close()
    if progress:
        progress()
    return reports


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m bole_tune.workers JOB_FILE WORKER_INDEX", file=sys.stderr)
        return 2
    _exit_with_parent()
    return run_worker(Job.load(argv[0]), int(argv[1]))


if __name__ == "__main__":
    sys.exit(main())
