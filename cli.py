"""The ``bole-tune`` command line: parse, call the library, render with rich.

Installed as ``bole_tune.cli`` (console script ``bole-tune``). Every command is a thin wrapper over
a library call a user can make from Python; usage errors print one line, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

console = Console()
err_console = Console(stderr=True)


class UsageError(Exception):
    """A mistake in the command line or its files: reported in one line, exit status 2."""


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def _add_bench(sub) -> None:
    p = sub.add_parser(
        "bench", help="time tree_verify against serial_verify (and tree_commit) on one GDN layer",
        description="Time one GDN layer's tree verification: the Bole verifier (tree_verify) against the "
                    "serial per-node-snapshot verifier engines use (serial_verify), and the commit. "
                    "Without a GPU it times small CPU cases and says so.")
    p.add_argument("--model", action="append", help="model profile (repeatable; default qwen3.5-9b)")
    p.add_argument("--batch", type=_positive_ints, default=None, help="batch sizes, e.g. 1,4,16")
    p.add_argument("--tree-size", type=_positive_ints, default=None, help="nodes per request, e.g. 16,64,256")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--max-depth", type=int, default=8, help="tree depth bound (edges), default 8")
    p.add_argument("--no-serial", action="store_true", help="skip the serial baseline")
    p.add_argument("--no-commit", action="store_true", help="skip tree_commit")
    p.add_argument("--repeats", type=int, default=50, help="timed graph replays per case")
    p.add_argument("--json", type=Path, help="also write the rows as JSON to this file")
    p.add_argument("--lookup", action="store_true", help="only time the runtime config lookup (cached path)")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    import torch

    from bole_tune.bench import BenchCase, CaseBench, DTYPES, bench_commit, bench_verify, environment
    from bole_tune.profiles import ProfileError, resolve_model

    has_gpu = torch.cuda.is_available()
    device = "cuda" if has_gpu else "cpu"
    if args.lookup:
        from bole_tune.lookup import lookup_cost_ns
        cost = lookup_cost_ns(device)
        console.print(f"tree_verify(config=None) lookup after the first call: {cost:.0f} ns per call on {device}")
        return 0
    try:
        models = [resolve_model(m) for m in (args.model or ["qwen3.5-9b"])]
    except ProfileError as error:
        raise UsageError(str(error)) from None
    env = environment()
    if has_gpu:
        batches, sizes = args.batch or [1, 4, 16], args.tree_size or [16, 32, 64, 128, 256]
        console.print(f"[bold]bole-tune bench[/] on {env['gpu']} (torch {env['torch']}, triton {env['triton']})")
    else:
        batches, sizes = args.batch or [1], args.tree_size or [16]
        mode = ("the Triton kernels under TRITON_INTERPRET=1" if os.environ.get("TRITON_INTERPRET") == "1"
                else "the PyTorch closed-form fallback")
        console.print(f"[yellow]No CUDA GPU here: timing {mode} on the CPU, with the wall clock. These numbers "
                      "check that the code runs; they say nothing about GPU speed.[/]")
    rows = []
    dtype = DTYPES[args.dtype]
    for model in models:
        shape = model.gdn()
        if not has_gpu:  # keep the CPU run to seconds: one key head group, small heads
            from bole_tune.profiles import GDNShape
            shape = GDNShape(1, shape.hv // shape.hk, 32, 32)
        for batch in batches:
            for size in sizes:
                case = BenchCase(shape, batch, size, dtype, args.max_depth, label=model.name)
                bench = CaseBench(case, device)
                case_rows = [bench_verify("bole", case, device, repeats=args.repeats, bench=bench, eager=has_gpu)]
                if not args.no_serial:
                    case_rows.append(bench_verify("serial", case, device, repeats=args.repeats, bench=bench))
                if not args.no_commit:
                    case_rows.append(bench_commit(case, device, repeats=args.repeats, bench=bench))
                rows.extend(case_rows)
                _print_progress(case_rows)
    console.print(_bench_table(rows))
    if args.json:
        _write_json(args.json, {"environment": env, "rows": rows})
        console.print(f"rows written to {args.json}")
    return 0


def _print_progress(rows) -> None:
    parts = [f"{r['kernel']} {r['p50_us']:.1f} us" for r in rows]
    r = rows[0]
    console.print(f"  {r['label']} B={r['batch']} T={r['tree_size']}: " + ", ".join(parts))


def _bench_table(rows) -> Table:
    table = Table(title="one GDN layer, per call (median of CUDA-graph replays; p20-p80)")
    for column in ("model", "Hv", "B", "T", "kernel", "p50 us", "p20-p80", "floor us", "of floor", "vs serial"):
        table.add_column(column, justify="right" if column not in ("model", "kernel") else "left")
    serial = {(r["label"], r["hv"], r["batch"], r["tree_size"]): r["p50_us"] for r in rows if r["kernel"] == "serial_verify"}
    for r in rows:
        key = (r["label"], r["hv"], r["batch"], r["tree_size"])
        speedup = f"{serial[key] / r['p50_us']:.1f}x" if r["kernel"] == "tree_verify" and key in serial else ""
        kernel = f"{r['kernel']} ({r['variant']})" if "variant" in r else r["kernel"]
        table.add_row(r["label"], str(r["hv"]), str(r["batch"]), str(r["tree_size"]), kernel,
                      f"{r['p50_us']:.1f}", f"{r['p20_us']:.1f}-{r['p80_us']:.1f}", f"{r['floor_us']:.1f}",
                      f"{r['floor_fraction']:.0%}", speedup)
    return table


def _write_json(path: Path, data) -> None:
    from bole_tune.atomic import write_text_atomic
    write_text_atomic(path, json.dumps(data, indent=1, default=str) + "\n")


def _add_common_db(p) -> None:
    p.add_argument("--db-dir", type=Path, help="tuning database folder (default: $BOLE_TUNE_DB, else "
                                                  "~/.local/share/bole-tune/tuning_db)")


def _add_env(sub) -> None:
    p = sub.add_parser("env", help="fingerprint this machine's GPU (NVML matched by UUID / PCI bus id)",
                       description="Print what bole-tune records about this GPU (or the CPU without one): name, "
                                   "UUID, PCI bus id, compute capability, SMs, memory, caches, driver and CUDA "
                                   "versions, clocks and power limit, and the database file it maps to.")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--device", default=None, help="torch device, e.g. cuda:1 (default: the current one)")
    p.set_defaults(func=cmd_env)


def cmd_env(args) -> int:
    from bole_tune.database import database_path, default_directory
    from bole_tune.fingerprint import fingerprint

    try:
        fp = fingerprint(args.device)
    except (RuntimeError, AssertionError, ValueError) as error:
        raise UsageError(f"--device {args.device}: {error}") from None
    if args.json:
        print(json.dumps({**fp.as_dict(), "database": str(database_path(fp.slug, default_directory()))}, indent=1))
        return 0
    table = Table(title=f"{fp.name} ({fp.source})", show_header=False)
    table.add_column("fact", style="bold")
    table.add_column("value")
    table.add_row("slug", fp.slug)
    for key, value in fp.facts.items():
        table.add_row(key, str(value))
    table.add_row("database file", str(database_path(fp.slug, default_directory())))
    console.print(table)
    if fp.kind == "cpu":
        console.print("[yellow]No CUDA GPU: tile configs cannot be tuned here; profile measures the CPU fallback.[/]")
    return 0


def _add_tuning_args(p, curves: bool) -> None:
    p.add_argument("--model", action="append", help="model profile, repeatable (default: qwen3.5-9b, qwen3.5-27b, "
                                                     "qwen3.5-122b-a10b)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="input dtype (default bf16)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: heads per rank = heads / tp")
    p.add_argument("--quick", action="store_true", help="small grid (batch 1,4,16; tree 16,64,128) and 16 trials")
    p.add_argument("--batch", type=_positive_ints, help="batch sizes to tune" + (" and measure" if curves else ""))
    p.add_argument("--tree-size", type=_positive_ints, help="tree sizes (nodes per request)")
    p.add_argument("--trials", type=int, help="Optuna trials per bucket (default 32, 16 with --quick)")
    p.add_argument("--storage", help="Optuna storage URL (default: an SQLite file in ~/.cache/bole-tune); "
                                     "an interrupted run resumes from it")
    p.add_argument("--repeats", type=int, default=30, help="timed CUDA-graph replays per measurement")
    p.add_argument("--workers", type=int, help="worker processes on this host (default: one per visible GPU); "
                                               "more hosts join with the same command and --storage")
    p.add_argument("--sampler", choices=["tpe", "grid", "random"], default="tpe",
                   help="Optuna sampler (grid: every config, split among the workers)")
    p.add_argument("--replace-corrupt", action="store_true",
                   help="if the database file is corrupt, keep a backup of it and start a new one")
    _add_common_db(p)


def _add_profile(sub) -> None:
    p = sub.add_parser("profile", help="tune every bucket and measure latency curves; write the tuning database",
                       description="The main job. For each model's GDN shape: tune tree_verify's tile configs per "
                                   "(tree size, batch) bucket with Optuna (every candidate checked against the float64 "
                                   "reference first), then measure per-layer latency of tree_verify (tuned and "
                                   "default), serial_verify and tree_commit against tree size and batch, and write "
                                   "everything with provenance to <db-dir>/<gpu>.yaml. Without a GPU it measures "
                                   "the CPU fallback and says so.")
    _add_tuning_args(p, curves=True)
    p.add_argument("--no-serial", action="store_true", help="skip the serial baseline curve")
    p.add_argument("--curve-batch", type=_positive_ints, help="batch sizes of the latency curves (default: as tuned)")
    p.add_argument("--curve-tree-size", type=_positive_ints, help="tree sizes of the latency curves (default: as tuned)")
    p.set_defaults(func=cmd_profile)


def _add_tune(sub) -> None:
    p = sub.add_parser("tune", help="tune tile configs per bucket (no curves)",
                       description="Run the Optuna studies only. --exhaustive measures every config instead (the "
                                   "yardstick); --record FILE saves every measurement; --replay FILE runs the tuner "
                                   "on recorded measurements (no GPU needed).")
    _add_tuning_args(p, curves=False)
    p.add_argument("--exhaustive", action="store_true", help="measure every config of the search space")
    p.add_argument("--record", type=Path, help="write every measurement to this JSON file")
    p.add_argument("--replay", type=Path, help="answer from a recording instead of the GPU")
    p.add_argument("--replay-delay", type=float, default=0.0,
                   help="seconds each replayed measurement takes (to watch or test the workers)")
    p.set_defaults(func=cmd_tune)


def _plan(args, curves: bool):
    from bole_tune.profiler import (FULL_BATCHES, FULL_TREE_SIZES, QUICK_BATCHES, QUICK_TREE_SIZES, ProfilePlan)
    from bole_tune.profiles import ProfileError, resolve_model

    names = args.model or ["qwen3.5-9b", "qwen3.5-27b", "qwen3.5-122b-a10b"]
    try:
        models = [resolve_model(m) for m in names]
        for model in models:
            model.gdn(args.tp)
    except (ProfileError, ValueError) as error:
        raise UsageError(str(error)) from None
    batches = tuple(args.batch or (QUICK_BATCHES if args.quick else FULL_BATCHES))
    sizes = tuple(args.tree_size or (QUICK_TREE_SIZES if args.quick else FULL_TREE_SIZES))
    trials = args.trials if args.trials is not None else (16 if args.quick else 32)
    if trials < 1:
        raise UsageError("--trials: must be at least 1")
    if args.repeats < 3:
        raise UsageError("--repeats: must be at least 3")
    return ProfilePlan(models=models, dtype=args.dtype, tp=args.tp, tune_batches=batches, tune_tree_sizes=sizes,
                       curve_batches=tuple(getattr(args, "curve_batch", None) or batches),
                       curve_tree_sizes=tuple(getattr(args, "curve_tree_size", None) or sizes),
                       n_trials=trials, repeats=args.repeats, serial=not getattr(args, "no_serial", False))


def _db_path(args, slug: str) -> Path:
    from bole_tune.database import database_path
    return database_path(slug, args.db_dir)


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("eta"), TimeRemainingColumn(), console=console)


def _precompile(runner, keys, space) -> None:
    """Compile every feasible config in parallel worker processes first (GPU runs only)."""
    from bole_tune.precompile import precompile
    from bole_tune.runners import GPURunner
    from bole_tune.search_space import feasible

    if not isinstance(getattr(runner, "inner", runner), GPURunner) or runner.fingerprint().kind != "gpu":
        return
    limit = runner.fingerprint().facts.get("max_shared_memory_per_block_bytes")
    configs = [c for c in space.configs() if any(feasible(c, k.dk, k.dv, k.tree_bucket, k.dtype, limit)[0]
                                                 for k in keys)]
    with _progress() as bar:
        task = bar.add_task("compiling candidates in parallel", total=None)
        count = precompile(keys, configs, progress=lambda total: bar.update(task, total=total, advance=1))
    console.print(f"compiled {count} kernel variants ahead of the search")


def _run_tuning(args, plan, runner, db_path, space) -> list:
    from bole_tune.profiler import plan_keys, tune_all
    from bole_tune.runners import ReplayRunner
    from bole_tune.workers import visible_devices

    storage_url = _storage_url(args)
    if isinstance(runner, ReplayRunner):
        spec = {"kind": "replay", "path": str(Path(runner.path).resolve()), "delay": runner.delay}
        workers = args.workers or 1
    else:
        _precompile(runner, plan_keys(plan), space)
        spec = {"kind": "gpu", "repeats": plan.repeats}
        workers = args.workers or max(1, len(visible_devices()))
    console.print(f"tuning with {workers} worker process{'es' if workers > 1 else ''} on {storage_url}")
    with _progress() as bar:
        task = bar.add_task("tuning", total=None)
        results = tune_all(plan, spec, runner.fingerprint(), storage_url, db_path, space, workers=workers,
                           sampler=args.sampler,
                           progress=lambda done, total: bar.update(task, completed=done, total=total))
    return results


def _storage_url(args) -> str:
    from bole_tune.tuner import default_storage, open_storage

    url = args.storage or default_storage()
    try:
        open_storage(url)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return url


def _tuning_table(results) -> Table:
    from bole_tune.profiler import geometric_mean

    table = Table(title="tuned tile configs (tree_verify, one GDN layer)")
    for column in ("bucket", "best config", "p50 us", "default us", "speedup", "measured", "wrong", "infeasible"):
        table.add_column(column, justify="left" if column in ("bucket", "best config") else "right")
    for r in results:
        if r.best is None:
            table.add_row(r.key.text, "[red]none worked[/]", "", "", "", str(r.counts.get("measured", 0)),
                          str(r.counts.get("wrong", 0)), str(r.counts.get("infeasible", 0)))
            continue
        d = r.default_measurement
        table.add_row(r.key.text, str(r.best), f"{r.best_measurement.p50_us:.1f}",
                      f"{d.p50_us:.1f}" if d and d.status == "ok" else "-",
                      f"{r.speedup:.2f}x" if r.speedup else "-", str(r.counts.get("measured", 0)),
                      str(r.counts.get("wrong", 0)), str(r.counts.get("infeasible", 0)))
    speedups = [r.speedup for r in results if r.speedup]
    if speedups:
        table.caption = f"geometric-mean speedup over the default config: {geometric_mean(speedups):.2f}x"
    return table


def _search_space():
    from bole_tune.profiles import ProfileError
    from bole_tune.search_space import SearchSpace
    try:
        return SearchSpace.load()
    except ProfileError as error:
        raise UsageError(str(error)) from None


def cmd_profile(args) -> int:
    import torch

    from bole_tune.database import DatabaseError
    from bole_tune.profiler import measure_curves
    from bole_tune.runners import GPURunner

    plan = _plan(args, curves=True)
    space = _search_space()
    runner = GPURunner("cuda" if torch.cuda.is_available() else "cpu", repeats=plan.repeats)
    fp = runner.fingerprint()
    db_path = _db_path(args, fp.slug)
    _prepare_database(db_path, args.replace_corrupt)
    console.print(f"[bold]bole-tune profile[/] on {fp.name} -> {db_path}")
    results = []
    try:
        if fp.kind == "gpu":
            results = _run_tuning(args, plan, runner, db_path, space)
            console.print(_tuning_table(results))
        else:
            console.print("[yellow]No CUDA GPU: tile configs exist only for the Triton kernels on a GPU, so nothing "
                          "is tuned. Measuring the PyTorch closed-form fallback (and its commit) on the CPU with the "
                          "wall clock instead; the database records these as CPU fallback curves.[/]")
            if not (args.batch or args.tree_size or args.curve_batch or args.curve_tree_size):
                plan.curve_batches, plan.curve_tree_sizes = (1, 2), (8, 16)
        total = len(plan.models) * len(plan.curve_batches) * len(plan.curve_tree_sizes)
        rows = []
        with _progress() as bar:
            task = bar.add_task("latency curves", total=total)
            for model in plan.models:
                rows += measure_curves(model, plan, runner.device, db_path, fp,
                                       progress=lambda m, b, t, _: bar.update(task, advance=1,
                                                                              description=f"{m.name} B={b} T={t}"))
    except DatabaseError as error:
        raise UsageError(str(error)) from None
    console.print(_curve_table(rows))
    console.print(f"database written: {db_path}")
    return 0


def _prepare_database(db_path, replace_corrupt: bool) -> None:
    from bole_tune import database

    if not db_path.exists():
        return
    try:
        database.load(db_path)
    except database.DatabaseError as error:
        backup = database.backup_corrupt(db_path)
        if not replace_corrupt:
            raise UsageError(f"{error}. A copy is kept at {backup}; fix or remove the file, or pass "
                             "--replace-corrupt to start a new one.") from None
        db_path.unlink()
        err_console.print(f"[yellow]{error}; a copy is kept at {backup} and a new database is started.[/]")


def _curve_table(rows) -> Table:
    table = Table(title="per-layer latency, p50 us (median of timed replays)")
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    table.add_column("model")
    table.add_column("B", justify="right")
    table.add_column("T", justify="right")
    for k in kernels:
        table.add_column(k, justify="right")
    grouped = {}
    for r in rows:
        grouped.setdefault((r["model"], r["batch"], r["tree_size"]), {})[r["kernel"]] = r["p50"]
    for (model, batch, size), values in grouped.items():
        table.add_row(model, str(batch), str(size), *[f"{values[k]:.1f}" if k in values else "" for k in kernels])
    return table


def cmd_tune(args) -> int:
    import torch

    from bole_tune.database import DatabaseError
    from bole_tune.runners import GPURunner, RecordingRunner, ReplayRunner
    from bole_tune.tuner import exhaustive_bucket

    plan = _plan(args, curves=False)
    space = _search_space()
    if args.record and not args.exhaustive:
        raise UsageError("--record: only with --exhaustive (tuning workers record into the Optuna storage)")
    if args.workers is not None and args.workers < 1:
        raise UsageError("--workers: must be at least 1")
    if args.replay:
        try:
            runner = ReplayRunner(args.replay, delay=args.replay_delay)
        except ValueError as error:
            raise UsageError(str(error)) from None
    else:
        if not torch.cuda.is_available():
            raise UsageError("no CUDA GPU: tile configs can only be tuned on a GPU (or use --replay FILE)")
        runner = GPURunner("cuda", repeats=plan.repeats)
    if args.record:
        runner = RecordingRunner(runner, args.record)
    fp = runner.fingerprint()
    db_path = _db_path(args, fp.slug)
    _prepare_database(db_path, args.replace_corrupt)
    console.print(f"[bold]bole-tune tune[/] with {runner.name} -> {db_path}")
    if args.exhaustive:
        from bole_tune.profiler import plan_keys

        keys = plan_keys(plan)
        _precompile(runner, keys, space)
        with _progress() as bar:
            task = bar.add_task("exhaustive", total=len(keys) * len(space.configs()))
            for key in keys:
                bar.update(task, description=f"exhaustive {key.text}")
                found = exhaustive_bucket(runner, key, space, on_trial=lambda c, m: bar.advance(task))
                ok = {c: m for c, m in found.items() if m.status == "ok"}
                if ok:
                    best = min(ok, key=lambda c: ok[c].p50_us)
                    console.print(f"  {key.text}: best {best} {ok[best].p50_us:.1f} us of {len(ok)} working")
        return 0
    try:
        results = _run_tuning(args, plan, runner, db_path, space)
    except DatabaseError as error:
        raise UsageError(str(error)) from None
    console.print(_tuning_table(results))
    console.print(f"database written: {db_path}")
    return 0


def _add_show(sub) -> None:
    p = sub.add_parser("show", help="render a tuning database (rich tables, or --json)",
                       description="Show the tuned configs, curves and budgets of one GPU's database.")
    p.add_argument("--gpu", help="GPU slug, e.g. nvidia-h200 (default: this machine's)")
    p.add_argument("--file", type=Path, help="a database file to show instead")
    p.add_argument("--json", action="store_true", help="print the database as JSON")
    _add_common_db(p)
    p.set_defaults(func=cmd_show)


def _resolve_db_file(args) -> Path:
    from bole_tune.database import database_path, search_directories
    from bole_tune.fingerprint import fingerprint

    if args.file:
        return args.file
    slug = args.gpu or fingerprint().slug
    folders = [args.db_dir] if args.db_dir else search_directories()
    for folder in folders:
        path = database_path(slug, folder)
        if path.exists():
            return path
    raise UsageError(f"no tuning database for {slug} in {', '.join(map(str, folders))} (run bole-tune profile)")


def cmd_show(args) -> int:
    from bole_tune import database

    path = _resolve_db_file(args)
    try:
        data = database.load(path)
    except database.DatabaseError as error:
        raise UsageError(str(error)) from None
    if args.json:
        print(json.dumps(data, indent=1, default=str))
        return 0
    device = data.get("device", {})
    console.print(f"[bold]{path}[/] — {device.get('name', '?')} (schema {data['schema_version']})")
    table = Table(title="tuned configs (T: tree-size bucket, B: batch bucket; config: b_k/b_v/warps/stages)")
    for column, width in (("shape", 19), ("T", 3), ("B", 2), ("config", 11), ("kernel", 8), ("p50 us", 6),
                          ("p20-p80", 11), ("default us", 6), ("speedup", 5), ("measured", 3)):
        table.add_column(column, min_width=width, no_wrap=True,
                         justify="left" if column in ("shape", "config", "kernel", "p20-p80") else "right")
    versions, dates = set(), set()
    for _, e in sorted(data["configs"].items(), key=lambda kv: database.ShapeKey.from_dict(kv[1]["key"])):
        c, lat, k = e["config"], e["latency_us"], e["key"]
        prov = e["provenance"]
        versions.add(str(prov.get("triton", "?")))
        dates.add(str(prov.get("date", "?"))[:10])
        shape = f"Hv{k['hv']} Hk{k['hk']} {k['dk']}/{k['dv']} {k['dtype']}" + (f" TP{k['tp']}" if k.get("tp", 1) != 1 else "")
        table.add_row(shape, str(k["tree_bucket"]), str(k["batch_bucket"]),
                      f"{c['b_k']}/{c['b_v']}/{c['num_warps']}/{c['num_stages']}", e.get("kernel", "fused"),
                      f"{lat['p50']:.1f}",
                      f"{lat['p20']:.1f}-{lat['p80']:.1f}",
                      f"{e['default_latency_us']['p50']:.1f}" if "default_latency_us" in e else "-",
                      f"{e['speedup_vs_default']:.2f}x" if "speedup_vs_default" in e else "-",
                      str(e.get("trials", {}).get("measured", "")))
    console.print(table)
    if data["configs"]:
        console.print(f"triton {', '.join(sorted(versions))}; measured {', '.join(sorted(dates))} "
                      "(full provenance: --json)")
    for name, curve in data["curves"].items():
        points = curve["points"]
        summary = ", ".join(f"B{p['batch']}/T{p['tree_size']}: {p['p50']:.1f}" for p in points[:8])
        more = f" (+{len(points) - 8} more)" if len(points) > 8 else ""
        console.print(f"[bold]curve[/] {name}: {summary}{more} us")
    for section in ("budgets", "step_curves"):
        if data.get(section):
            console.print(f"[bold]{section}[/]: {', '.join(data[section])}")
    return 0


def _add_lookup(sub) -> None:
    p = sub.add_parser("lookup", help="print the config the runtime would pick for a shape, and why",
                       description="Resolve a tile config the way tree_verify(config=None) does: the exact bucket, "
                                   "else the nearest tuned bucket, else the default (policy from BOLE_TUNE_LOOKUP).")
    p.add_argument("--gpu", help="GPU slug (default: this machine's)")
    for name in ("hv", "hk", "dk", "dv"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--tree-size", type=int, required=True, help="nodes of the largest tree in the batch")
    p.add_argument("--batch", type=int, required=True, help="requests in the batch")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--policy", choices=["nearest", "strict", "default"], help="override BOLE_TUNE_LOOKUP")
    p.add_argument("--json", action="store_true")
    _add_common_db(p)
    p.set_defaults(func=cmd_lookup)


def cmd_lookup(args) -> int:
    from bole_tune import database
    from bole_tune.config import SUPPORTED_HEAD_DIMS
    from bole_tune.fingerprint import fingerprint
    from bole_tune.lookup import decide, policy

    for name in ("hv", "hk", "tree_size", "batch", "tp"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}: must be a positive integer")
    for name in ("dk", "dv"):
        if getattr(args, name) not in SUPPORTED_HEAD_DIMS:
            raise UsageError(f"--{name}: {getattr(args, name)} is not a supported head size {SUPPORTED_HEAD_DIMS}")
    if args.hv % args.hk:
        raise UsageError(f"--hv {args.hv} must be a multiple of --hk {args.hk}")
    slug = args.gpu or fingerprint().slug
    key = database.ShapeKey(args.hv, args.hk, args.dk, args.dv, args.dtype, database.tree_bucket(args.tree_size),
                            database.batch_bucket(args.batch), args.tp)
    entries = None
    if args.db_dir:
        path = database.database_path(slug, args.db_dir)
        try:
            entries = database.load(path)["configs"] if path.exists() else {}
        except database.DatabaseError as error:
            raise UsageError(str(error)) from None
    try:
        mode = args.policy or policy()
        decision = decide(key, slug, mode, entries=entries)
    except (LookupError, ValueError) as error:
        raise UsageError(str(error)) from None
    result = {"gpu": slug, "key": key.text, "policy": mode, "how": decision.how, "reason": decision.reason,
              "config": decision.config.as_dict(), "kernel": decision.kernel, "tuned_p50_us": decision.latency_us}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    kernel = f" on the {decision.kernel} kernel" if decision.kernel else ""
    console.print(f"{key.text} on {slug}: [bold]{decision.config}[/]{kernel} ({decision.how}: {decision.reason})")
    return 0


def _add_step(sub) -> None:
    p = sub.add_parser("step", help="measure the whole verification step of each model (needs a GPU)",
                       description="Time one GDN layer (with tree_verify, and with serial_verify), one attention "
                                   "layer (tree mask over a KV context) and the LM head at the model's real shapes "
                                   "with random weights, as CUDA graphs, for each batch and tree size; the step is "
                                   "their sum over the model's layers. Writes step curves to the database.")
    p.add_argument("--model", action="append", help="model profile, repeatable (default: all four)")
    p.add_argument("--batch", type=_positive_ints, default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--tree-size", type=_positive_ints, default=[1, 4, 8, 16, 32, 64, 128],
                   help="verified tokens per request (1 = no speculation)")
    p.add_argument("--context", type=int, default=4096, help="KV context length of the attention layers")
    p.add_argument("--no-serial", action="store_true", help="skip the serial_verify variant")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--replace-corrupt", action="store_true")
    _add_common_db(p)
    p.set_defaults(func=cmd_step)


ALL_MODELS = ["qwen3.5-9b", "qwen3.5-27b", "qwen3.5-122b-a10b", "qwen3-next-80b-a3b"]


def _models(names):
    from bole_tune.profiles import ProfileError, resolve_model
    try:
        return [resolve_model(m) for m in names]
    except ProfileError as error:
        raise UsageError(str(error)) from None


def cmd_step(args) -> int:
    import torch

    from bole_tune import database
    from bole_tune.fingerprint import fingerprint
    from bole_tune.profiler import provenance
    from bole_tune.step_latency import METHOD, measure_step_curve

    models = _models(args.model or ALL_MODELS)
    if args.context < 1:
        raise UsageError("--context: must be positive")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fp = fingerprint(device)
    if device == "cpu":
        console.print("[yellow]No CUDA GPU: timing the layers on the CPU with the wall clock; these numbers say "
                      "nothing about a GPU's step.[/]")
    db_path = _db_path(args, fp.slug)
    _prepare_database(db_path, args.replace_corrupt)
    table = Table(title=f"verification step on {fp.name}, us (p50)")
    for column in ("model", "B", "T", "tokens", "GDN layer", "GDN serial", "attention", "LM head", "step",
                   "step serial"):
        table.add_column(column, justify="left" if column == "model" else "right")
    with _progress() as bar:
        task = bar.add_task("step latency", total=len(models) * len(args.batch) * len(args.tree_size))
        for model in models:
            def progress(m, b, t, point):
                bar.update(task, advance=1, description=f"{m.name} B={b} T={t}")
                d = point.as_dict()
                table.add_row(m.name, str(b), str(t), str(point.tokens), f"{d['gdn_us']:.0f}",
                              f"{d.get('gdn_serial_us', 0):.0f}" if "gdn_serial_us" in d else "-",
                              f"{d['attention_us']:.0f}", f"{d['lm_head_us']:.0f}", f"{d['step_us']:.0f}",
                              f"{d.get('step_serial_us', 0):.0f}" if "step_serial_us" in d else "-")
            points = measure_step_curve(model, args.batch, args.tree_size, args.context, device, args.repeats,
                                        serial=not args.no_serial, progress=progress)
            entry = {"model": model.name, "dtype": "bf16", "context": args.context,
                     "layers": {"gdn": model.num_gdn_layers, "attention": model.num_attention_layers},
                     "measured_by": "layer groups, summed", "points": [p.as_dict() for p in points],
                     "provenance": provenance(fp, METHOD)}
            database.update(db_path, device=fp.as_dict(), step_curves={f"{model.name}/bf16": entry})
    console.print(table)
    console.print(f"step curves written: {db_path}")
    return 0


def _add_budget(sub) -> None:
    p = sub.add_parser("budget", help="choose the tree-token budget per batch size; export engine settings",
                       description="From the measured step curves and an acceptance model, choose per batch size "
                                   "the tree (tokens, nodes per request, depth, width) that maximises expected "
                                   "tokens per second; write it to the database and export SGLang/vLLM settings.")
    p.add_argument("--model", action="append", help="model profile, repeatable (default: every model with a step curve)")
    p.add_argument("--acceptance", default="qwen3-next-mtp-gsm8k", help="acceptance model name or YAML file")
    p.add_argument("--gpu", help="GPU slug (default: this machine's)")
    p.add_argument("--export", type=Path, help="folder for engine settings files (sglang-*.json, vllm-*.json)")
    _add_common_db(p)
    p.set_defaults(func=cmd_budget)


def cmd_budget(args) -> int:
    from bole_tune import database
    from bole_tune.acceptance import load_acceptance
    from bole_tune.budget import StepCurve, budget_name, build_budgets, engine_settings
    from bole_tune.fingerprint import fingerprint
    from bole_tune.profiles import ProfileError

    try:
        acceptance = load_acceptance(args.acceptance)
    except ProfileError as error:
        raise UsageError(str(error)) from None
    slug = args.gpu or fingerprint().slug
    db_path = _resolve_db_file(argparse.Namespace(file=None, gpu=slug, db_dir=args.db_dir))
    try:
        data = database.load(db_path)
    except database.DatabaseError as error:
        raise UsageError(str(error)) from None
    curves = data.get("step_curves", {})
    names = [m.name for m in _models(args.model)] if args.model else [c["model"] for c in curves.values()]
    table = Table(title=f"tree-token budgets on {slug} (acceptance model {acceptance.name})")
    for column in ("model", "B", "N", "per req", "shape", "depth", "width", "MAT", "tok/s", "x plain", "x fixed"):
        table.add_column(column, justify="left" if column in ("model", "shape") else "right",
                         no_wrap=column == "model")
    budgets = {}
    for name in names:
        curve = curves.get(f"{name}/bf16")
        if curve is None:
            raise UsageError(f"no step curve for {name} in {db_path} (run bole-tune step --model ... first)")
        entry = build_budgets(acceptance, StepCurve(curve["points"]))
        entry["step_curve"] = f"{name}/bf16"
        entry["provenance"] = {"date": database.now(), "step_curve_date": curve["provenance"].get("date", ""),
                               "acceptance_source": acceptance.source, "method": "best-first trees and chains; "
                               "tokens/s = B * E[accepted + 1] / (step + draft)"}
        budgets[budget_name(name)] = entry
        for batch, b in entry["batches"].items():
            table.add_row(name, str(batch), str(b["tokens"]), str(b["nodes_per_request"]), b["shape"], str(b["depth"]),
                          str(b["width"]), f"{b['expected_mean_accepted']:.2f}", f"{b['tokens_per_second']:.0f}",
                          f"{b['speedup_vs_no_speculation']:.2f}x", f"{b['speedup_vs_fixed_budget']:.2f}x")
        if args.export:
            from bole_tune.atomic import write_text_atomic
            settings = engine_settings(entry)
            stem = name.lower()
            write_text_atomic(args.export / f"sglang-{stem}.json", json.dumps(settings["sglang"], indent=1) + "\n")
            write_text_atomic(args.export / f"vllm-{stem}.json", json.dumps(settings["vllm"], indent=1) + "\n")
    try:
        database.update(db_path, budgets=budgets)
    except database.DatabaseError as error:
        raise UsageError(str(error)) from None
    console.print(table)
    console.print(f"budgets written: {db_path}" + (f"; engine settings in {args.export}" if args.export else ""))
    return 0


def _add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="fit an acceptance model to a JSONL log of real rounds",
                       description="Fit per-depth acceptance and rank shares from a log (one JSON object per request "
                                   "and round: parents, ranks, accepted; see bole_tune.acceptance).")
    p.add_argument("log", type=Path)
    p.add_argument("--name", help="name of the fitted model (default: the log's file name)")
    p.add_argument("--out", type=Path, help="write the model as YAML here (default: print it)")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args) -> int:
    from bole_tune.acceptance import calibrate, save_acceptance
    from bole_tune.profiles import ProfileError

    try:
        model, stats = calibrate(args.log, args.name)
    except (ValueError, ProfileError) as error:
        raise UsageError(str(error)) from None
    console.print(f"fitted on {stats['rounds']} rounds: depth acceptance "
                  f"{', '.join(f'{a:.3f}' for a in model.depth_acceptance)}; rank shares "
                  f"{', '.join(f'{s:.3f}' for s in model.rank_share)}")
    if args.out:
        save_acceptance(model, args.out, f"fitted by bole-tune calibrate from {args.log} ({stats['rounds']} rounds)")
        console.print(f"written: {args.out}")
    return 0


def _add_report(sub) -> None:
    p = sub.add_parser("report", help="plots (PNG and SVG) of step latency, budgets and tree vs serial verification")
    p.add_argument("--gpu", help="GPU slug (default: this machine's)")
    p.add_argument("--out", type=Path, default=Path("bole-tune-report"), help="output folder")
    _add_common_db(p)
    p.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    from bole_tune import database
    from bole_tune.report import write_report

    path = _resolve_db_file(argparse.Namespace(file=None, gpu=args.gpu, db_dir=args.db_dir))
    try:
        data = database.load(path)
        files = write_report(data, args.out)
    except (database.DatabaseError, ValueError) as error:
        raise UsageError(str(error)) from None
    console.print(_report_table(data))
    for f in files:
        console.print(f"written: {f}")
    return 0


def _report_table(data) -> Table:
    """Per model and batch: plain decoding, the chosen budget and what it gains."""
    table = Table(title=f"summary: {data.get('device', {}).get('name', '')}")
    for column in ("model", "B", "plain step ms", "chosen", "step ms", "E[MAT]", "tokens/s", "x plain",
                   "GDN via serial: step ms"):
        table.add_column(column, justify="left" if column in ("model", "chosen") else "right", no_wrap=True)
    curves = data.get("step_curves", {})
    for name, budget in data.get("budgets", {}).items():
        points = {(p["batch"], p["tree_size"]): p for p in curves.get(budget.get("step_curve", ""), {}).get("points", [])}
        for batch, b in sorted(budget["batches"].items(), key=lambda kv: int(kv[0])):
            plain = points.get((int(batch), 1), {}).get("step_us")
            near = min((p for (pb, _), p in points.items() if pb == int(batch) and "step_serial_us" in p),
                       key=lambda p: abs(p["tree_size"] - b["nodes_per_request"]), default=None)
            table.add_row(name.split("/")[0], str(batch), f"{plain / 1000:.2f}" if plain else "-",
                          f"{b['nodes_per_request']} ({b['shape']})", f"{b['step_us'] / 1000:.2f}",
                          f"{b['expected_mean_accepted']:.2f}", f"{b['tokens_per_second']:.0f}",
                          f"{b['speedup_vs_no_speculation']:.2f}x",
                          f"{near['step_serial_us'] / 1000:.2f} (T={near['tree_size']})" if near else "-")
    return table


def _add_validate(sub) -> None:
    p = sub.add_parser("validate", help="prove the tree step exact against transformers' Qwen3.5 and lossless end to end",
                       description="Build transformers' own Qwen3.5 text model (random weights) and check (1) every "
                                   "tree node's GDN-layer output and the committed states against transformers running "
                                   "each root-to-node path token by token, and (2) that speculative decoding with our "
                                   "tree steps generates exactly transformers' greedy tokens. Needs transformers "
                                   "(pip install -e '.[validate]').")
    p.add_argument("--production", action="store_true",
                   help="Qwen3.5-9B GDN head sizes (Hk 16, Hv 32, dk = dv = 128); best on a GPU")
    p.add_argument("--trees", type=int, default=3, help="random trees in the layer check")
    p.add_argument("--prompts", type=int, default=3, help="prompts in the generation check")
    p.add_argument("--tokens", type=int, default=200, help="tokens generated per prompt")
    p.add_argument("--skip-generation", action="store_true", help="only the layer check")
    p.set_defaults(func=cmd_validate)


def cmd_validate(args) -> int:
    import torch

    from bole_tune import validate

    if min(args.trees, args.prompts, args.tokens) < 1:
        raise UsageError("--trees, --prompts and --tokens must be positive")
    from bole_tune.kernels.common import use_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = validate.PRODUCTION if args.production else validate.ModelSize()
    path = "the Triton kernels" if use_triton(torch.device(device)) else "the PyTorch fallback (no GPU, no TRITON_INTERPRET=1)"
    try:
        console.print(f"[bold]bole-tune validate[/] on {device}, running {path}: transformers' Qwen3.5 with GDN heads "
                      f"Hk {size.hk}, Hv {size.hv}, dk {size.dk}, dv {size.dv}")
        layers = validate.validate_layers(size, device, trees=args.trees)
    except RuntimeError as error:
        if "transformers" in str(error):
            raise UsageError(str(error)) from None
        raise
    verdict = "[green]PASS[/]" if layers.passed else "[red]FAIL[/]"
    console.print(f"{verdict} layer step vs transformers token by token: {layers.trees} trees, {layers.nodes} nodes; "
                  f"worst relative error: outputs {layers.worst_output_error:.1e}, recurrent state "
                  f"{layers.worst_state_error:.1e}, conv state {layers.worst_conv_error:.1e} "
                  f"(bound {validate.TOLERANCE:.0e})")
    for failure in layers.failures:
        console.print(f"  {failure}")
    passed = layers.passed
    if not args.skip_generation:
        gen = validate.validate_generation(size, device, prompts=args.prompts, new_tokens=args.tokens)
        verdict = "[green]PASS[/]" if gen.passed else "[red]FAIL[/]"
        console.print(f"{verdict} speculative decoding vs transformers' greedy generate: {gen.prompts} prompts x "
                      f"{args.tokens} tokens, identical: {not gen.mismatches}; {gen.rounds} rounds, mean accepted "
                      f"draft tokens per round {gen.mean_accepted:.2f}")
        for mismatch in gen.mismatches:
            console.print(f"  {mismatch}")
        passed = passed and gen.passed
    console.print("[bold green]verdict: exact[/]" if passed else "[bold red]verdict: NOT exact[/]")
    return 0 if passed else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bole-tune",
        description="Exact, fast tree speculative decoding for hybrid-attention LLMs (Qwen3.5 / Qwen3-Next): "
                    "benchmark, tune and look up the Bole verifier on your GPU.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_profile(sub)
    _add_tune(sub)
    _add_show(sub)
    _add_lookup(sub)
    _add_env(sub)
    _add_bench(sub)
    _add_step(sub)
    _add_budget(sub)
    _add_calibrate(sub)
    _add_report(sub)
    _add_validate(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from bole_tune import __version__
        console.print(f"bole-tune {__version__}")
        return 0
    if not args.command:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except UsageError as error:
        err_console.print(f"[red]bole-tune {args.command}: {error}[/]")
        return 2
    except Exception as error:
        from bole_tune.runners import DeviceLost
        if not isinstance(error, DeviceLost):
            raise
        err_console.print(f"[red]bole-tune {args.command}: {error}[/]")
        return 3
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]")
        return 130


if __name__ == "__main__":
    sys.exit(main())
