"""The ``bole-tune`` command line (``bole_tune.cli``): parse, call one library function per command (named
in its docstring), render with rich (`bole_tune.render`). A usage error or a bad file prints one line on
stderr, exit status 2, naming the flag, file or field; numbers are checked by their argparse types and output
paths by `bole_tune.arguments.check_output` before any work starts. Commands import optuna, the kernels or
matplotlib themselves, so ``--help`` starts fast.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from bole_tune import database, render
from bole_tune.arguments import (MAX_CONTEXT, MAX_REPEATS, MAX_TREE_DEPTH, MIN_REPEATS, check_outputs, integer,
                                 integers, seconds, write_or_rescue)
from bole_tune.config import RING_ROUNDS
from bole_tune.fingerprint import fingerprint
from bole_tune.profiles import DEFAULT_MODELS
from bole_tune.shapes import DTYPES, SUPPORTED_HEAD_DIMS
from bole_tune.workloads import MAX_BATCH, MAX_TREE_SIZE

console = Console()
err_console = Console(stderr=True)


class UsageError(Exception):
    """A mistake in the command line or its files: reported in one line, exit status 2."""


def _say(lines) -> None:
    console.print(*lines, sep="\n")


def _fail(message, code: int = 2) -> int:
    """Print ``message`` as one line on stderr (no markup, no wrapping); returns the exit status."""
    err_console.print(" ".join(str(message).split()), style="red", markup=False, highlight=False, soft_wrap=True)
    return code


def _call(function, *args, **kwargs):
    """``function(*args, **kwargs)``, a bad value or file (ValueError, LookupError) becoming a `UsageError`."""
    try:
        return function(*args, **kwargs)
    except (ValueError, LookupError) as error:
        raise UsageError(str(error)) from None


def cmd_bench(args) -> int:
    """`bole_tune.bench.run_cases` (`bole_tune.lookup.lookup_cost_ns` with --lookup)."""
    import torch

    from bole_tune.bench import round_verdict, run_cases
    from bole_tune.lookup import commit_lookup_cost_ns, lookup_cost_ns
    from bole_tune.profiles import resolve_model

    if args.lookup:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        console.print(f"tree_verify(config=None) lookup after the first call: {lookup_cost_ns(device):.0f} ns per "
                      f"call on {device}")
        console.print(f"tree_commit(config=None) lookup after the first call: {commit_lookup_cost_ns(device):.0f} ns "
                      f"per call on {device}")
        return 0
    _call(check_outputs, args, json=False)
    models = [_call(resolve_model, m) for m in (args.model or ["qwen3.5-9b"])]
    run = run_cases(models, args.batch, args.tree_size, DTYPES[args.dtype], args.max_depth, args.repeats,
                    serial=not args.no_serial, commit=not args.no_commit, chain=args.chain,
                    ring_rounds=args.ring_rounds, progress=lambda rows: console.print(render.bench_progress(rows)))
    env = run.environment
    console.print(f"[yellow]{run.cpu_note}[/]" if run.cpu_note else
                  f"[bold]bole-tune bench[/] on {env['gpu']} (torch {env['torch']}, triton {env['triton']})")
    console.print(render.bench(run.rows))
    if not args.no_commit and not args.no_serial:
        console.print(render.round_verdict(round_verdict(run.rows)))
    if args.json:
        _call(write_or_rescue, args.json, render.json_text({"environment": env, "rows": run.rows}) + "\n", "--json")
        console.print(f"rows written to {args.json}")
    return 0


def cmd_env(args) -> int:
    """`bole_tune.fingerprint.fingerprint`."""
    try:
        fp = fingerprint(args.device)
    except (RuntimeError, AssertionError, ValueError) as error:
        raise UsageError(f"--device {args.device}: {error}") from None
    path = database.database_path(fp.slug)
    if args.json:
        print(render.json_text({**fp.as_dict(), "database": str(path)}))
        return 0
    console.print(render.facts(f"{fp.name} ({fp.source})",
                               [("slug", fp.slug), *fp.facts.items(), ("database file", path)]))
    if fp.kind == "cpu":
        console.print("[yellow]No CUDA GPU: tile configs cannot be tuned here; profile measures the CPU fallback.[/]")
    return 0


def _plan(args, runner_kind: str, commit: bool = False, fold: bool = False, ring: bool = False):
    """`profile`'s or `tune`'s plan and search space (``commit``: the commit's only, for ``tune --commit``);
    output paths, --trials and --workers checked first."""
    from bole_tune.profiler import make_plan, plan_keys
    from bole_tune.search_space import SearchSpace
    from bole_tune.workers import check_workers

    _call(check_outputs, args, db_dir=True, record=False)
    plan = _call(make_plan, args.model, args.dtype, args.tp, args.quick, args.batch, args.tree_size, args.trials,
                 args.repeats, getattr(args, "curve_batch", None), getattr(args, "curve_tree_size", None),
                 serial=not getattr(args, "no_serial", False), commit=commit, fold=fold, ring=ring)
    if commit:
        if args.workers is not None:
            raise UsageError("--workers: the commit is tuned in this process (its studies take seconds); "
                             "drop --workers with --commit")
        space = _call(SearchSpace.load, kind="commit")
        if args.sampler != "grid":
            _call(space.check_trials, plan.commit_trials)
        return plan, space
    space = _call(SearchSpace.load)
    if args.sampler != "grid":  # a grid measures every config whatever --trials says
        _call(space.check_trials, plan.n_trials)
    if args.workers is not None:
        per_bucket = space.size if args.sampler == "grid" else plan.n_trials
        _call(check_workers, args.workers, runner_kind, len(plan_keys(plan)) * per_bucket)
    return plan, space


def _commit_table(results):
    """`render.tuning`'s table of commit studies (keys end in -L<layers per launch>)."""
    table = render.tuning(results)
    table.title = "tuned commit configs (tree_commit / tree_commit_layers; L: layers one launch commits)"
    return table


def cmd_profile(args) -> int:
    """`bole_tune.profiler.profile`."""
    from bole_tune.profiler import profile
    from bole_tune.search_space import SearchSpace

    plan, space = _plan(args, "gpu")
    commit_space = _call(SearchSpace.load, kind="commit")
    with render.progress_bar(console) as bar:
        result = _call(profile, plan, args.db_dir, args.storage, args.workers, args.sampler, args.replace_corrupt,
                       space=space, progress=render.stage_progress(bar), remeasure=args.remeasure,
                       commit_space=commit_space)
    _say([f"[bold]bole-tune profile[/] on {result.device_name} -> {result.path}", *result.notes,
          *([render.tuning(result.tuned)] if result.tuned else []),
          *([_commit_table(result.commit_tuned)] if result.commit_tuned else []), render.curves(result.curve_rows),
          f"database written: {result.path}"])
    return 0


def cmd_tune(args) -> int:
    """`bole_tune.profiler.tune` with a GPU or a replayed recording (`exhaustive` with --exhaustive;
    `tune_commit` with --commit)."""
    import torch

    from bole_tune.profiler import exhaustive, tune, tune_commit
    from bole_tune.runners import GPURunner, RecordingRunner, ReplayRunner

    if args.fold + args.commit + args.ring > 1:
        raise UsageError("--fold, --ring, --commit: each tunes another launch (the folded verify, a ring's write "
                         "round, the commit): give one of them")
    plan, space = _plan(args, "replay" if args.replay else "gpu", commit=args.commit, fold=args.fold, ring=args.ring)
    if args.record and not args.exhaustive:
        raise UsageError("--record: only with --exhaustive (tuning workers record into the Optuna storage)")
    if args.replay:
        runner = _call(ReplayRunner, args.replay, delay=args.replay_delay)
    elif not torch.cuda.is_available():
        raise UsageError("no CUDA GPU: tile configs can only be tuned on a GPU (or use --replay FILE)")
    else:
        runner = GPURunner("cuda", repeats=plan.repeats)
    if args.record:
        runner = RecordingRunner(runner, args.record)
    db_path = _call(database.database_path, runner.fingerprint().slug, args.db_dir)
    what = ("the commit (tree_commit, tree_commit_layers)" if args.commit
            else "the folded verify (tree_verify with pending=)" if args.fold
            else "a ring's write round (tree_verify with ring=, R rounds folded in)" if args.ring else "tree_verify")
    console.print(f"[bold]bole-tune tune[/] {what} with {runner.name} -> {db_path}")
    with render.progress_bar(console) as bar:
        if args.exhaustive:
            found = exhaustive(plan, runner, space, progress=render.stage_progress(bar))
        elif args.commit:
            result = _call(tune_commit, plan, runner, db_path, args.storage, args.replace_corrupt, space=space,
                           sampler=args.sampler, progress=render.stage_progress(bar))
        else:
            result = _call(tune, plan, runner, space, db_path, args.storage, args.workers, args.sampler,
                           args.replace_corrupt, progress=render.stage_progress(bar))
    if args.exhaustive:
        _say(render.exhaustive(found))
    elif args.commit:
        _say([*result.notes, _commit_table(result.commit_tuned), f"database written: {db_path}"])
    else:
        _say([*result.notes, render.tuning(result.tuned), f"database written: {db_path}"])
    return 0


def _found(args) -> database.Found:
    """The database the runtime reads for ``--gpu`` (default: this machine's), from ``--db-dir`` if given."""
    slug = args.gpu or fingerprint().slug
    found = _call(database.search, slug, args.db_dir)
    if not found.files:
        raise UsageError(f"no tuning database for {slug} in {', '.join(map(str, found.folders))} "
                         "(run bole-tune profile)")
    return found


def cmd_show(args) -> int:
    """`bole_tune.database.search` (or `load` with --file): what the runtime reads."""
    from bole_tune.config import CommitConfig

    if args.file:
        data, where = _call(database.load, args.file), str(args.file)
    else:
        found = _found(args)
        data, where = found.as_data(), found.where
    if args.json:
        print(render.json_text(data))
        return 0
    commits = data.get("commit_configs") or {}
    commit_line = ([f"[bold]commit_configs[/] ({len(commits)}; config b_k/b_v/v_span/num_warps/num_stages): "
                    + ", ".join(f"{name} {CommitConfig.from_dict(e['config']).text}"
                                for name, e in sorted(commits.items()))] if commits else [])
    _say([f"[bold]{where}[/] — {data['device'].get('name', '?')} (schema {data['schema_version']})",
          render.configs(data), *commit_line, *render.curve_summaries(data)])
    return 0


def cmd_lookup(args) -> int:
    """`bole_tune.lookup.decide` (`decide_commit` with --commit): the config tree_verify(config=None), or
    tree_commit(config=None) / tree_commit_layers(config=None), would run, and why."""
    from bole_tune.lookup import decide, decide_commit, policy
    from bole_tune.shapes import HeadShape

    if args.hv % args.hk:
        raise UsageError(f"--hv {args.hv} must be a multiple of --hk {args.hk}")
    if args.layers is not None and not args.commit:
        raise UsageError("--layers: only with --commit (the layers one commit launch covers)")
    if args.fold + args.commit + args.ring > 1:
        raise UsageError("--fold, --ring, --commit: the folded verify's, a ring write's or the commit's config: "
                         "give one of them")
    slug = args.gpu or fingerprint().slug
    try:
        heads = HeadShape(hk=args.hk, hv=args.hv, dk=args.dk, dv=args.dv).per_rank(args.tp)
    except ValueError as error:
        raise UsageError(f"--tp: {str(error).removeprefix('tp: ')}") from None
    key = database.ShapeKey.bucketed(heads, args.dtype, args.tree_size, args.batch, args.tp, fold=args.fold,
                                     ring=args.ring)
    mode = args.policy or _call(policy)
    if args.commit:
        commit_key = database.CommitKey(shape=key, layers=args.layers or 1)
        decision = _call(decide_commit, commit_key, slug, mode, args.db_dir, num_requests=args.batch)
        if args.json:
            print(render.json_text({"gpu": slug, "key": commit_key.text, "policy": mode, "how": decision.how,
                                    "reason": decision.reason, "config": decision.config.as_dict(),
                                    "tuned_p50_us": decision.latency_us, "source": decision.source}))
            return 0
        console.print(f"{commit_key.text} on {slug}: [bold]{decision.config}[/] ({decision.how}: {decision.reason})")
        return 0
    decision = _call(decide, key, slug, mode, args.db_dir)
    if args.json:
        print(render.json_text({"gpu": slug, "key": key.text, "policy": mode, "how": decision.how,
                                "reason": decision.reason, "config": decision.config.as_dict(),
                                "kernel": decision.kernel, "tuned_p50_us": decision.latency_us,
                                "source": decision.source}))
        return 0
    kernel = f" on the {decision.kernel} kernel" if decision.kernel else ""
    console.print(f"{key.text} on {slug}: [bold]{decision.config}[/]{kernel} ({decision.how}: {decision.reason})")
    return 0


def cmd_step(args) -> int:
    """`bole_tune.step_latency.measure_and_store`."""
    from bole_tune.step_latency import measure_and_store

    _call(check_outputs, args, db_dir=True)
    with render.progress_bar(console) as bar:
        task = bar.add_task("step latency", total=None)
        result = _call(measure_and_store, args.model, args.batch, args.tree_size, args.context, args.repeats,
                       serial=not args.no_serial, attention=args.attention, db_dir=args.db_dir,
                       replace_corrupt=args.replace_corrupt,
                       progress=lambda m, b, t, _: bar.update(task, advance=1, description=f"{m.name} B={b} T={t}"))
    _say([*result.notes, render.step(result), f"step curves written: {result.path}"])
    return 0


def cmd_budget(args) -> int:
    """`bole_tune.budget.store_budgets`."""
    from bole_tune.budget import store_budgets

    _call(check_outputs, args, db_dir=True, export=True)
    result = _call(store_budgets, args.model, args.acceptance, args.engine, args.gpu, args.db_dir, args.export)
    _say([*render.budgets(result), f"budgets written: {result.path}", *(f"written: {f}" for f in result.exported)])
    return 0


def cmd_calibrate(args) -> int:
    """`bole_tune.acceptance.calibrate` (and `save_acceptance`)."""
    from bole_tune.acceptance import calibrate, save_acceptance

    _call(check_outputs, args, out=False)
    model, stats = _call(calibrate, args.log, args.name)
    console.print(f"fitted on {stats['rounds']} rounds: per depth {render.numbers(model.depth_acceptance)}; "
                  f"alternatives {render.numbers(model.alternative_share)}; below one x{model.branch_continuation:.2f}")
    if args.out:
        save_acceptance(model, args.out, f"fitted by bole-tune calibrate from {args.log} ({stats['rounds']} rounds)")
        console.print(f"written: {args.out}")
    return 0


def cmd_report(args) -> int:
    """`bole_tune.report.write_report` on the database `show` shows."""
    from bole_tune.report import write_report

    _call(check_outputs, args, out=True)
    data = _found(args).as_data()
    files = _call(write_report, data, args.out)
    _say([*render.report_summary(data), *(f"written: {f}" for f in files)])
    return 0


def cmd_validate(args) -> int:
    """`bole_tune.validate.validate_layers` and `validate_generation`."""
    import torch

    from bole_tune import validate
    from bole_tune.kernels.common import use_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = validate.PRODUCTION if args.production else validate.ModelSize()
    kernels = "the Triton kernels" if use_triton(torch.device(device)) else "the PyTorch fallback (no GPU, no Triton)"
    console.print(f"[bold]bole-tune validate[/] on {device}, running {kernels}: transformers' Qwen3.5 with GDN "
                  f"heads {size.heads.label}")
    try:
        layers = validate.validate_layers(size, device, trees=args.trees)
    except RuntimeError as error:
        if "transformers" in str(error):
            raise UsageError(str(error)) from None
        raise
    generation = (None if args.skip_generation
                  else validate.validate_generation(size, device, prompts=args.prompts, new_tokens=args.tokens))
    _say(render.validation(layers, generation, args.tokens))
    return 0 if layers.passed and (generation is None or generation.passed) else 1


# ---- the parser ----------------------------------------------------------------------------------

FLAG = {"action": "store_true"}
MODELS = {"action": "append", "help": f"model profile, repeatable (default: {', '.join(DEFAULT_MODELS)})"}
GPU = {"help": "GPU slug, e.g. nvidia-h200 (default: this machine's)"}
DB_DIR = {"type": Path, "help": "tuning database folder, read alone and written (default: $BOLE_TUNE_DB, else "
                                "~/.local/share/bole-tune/tuning_db, read before the database shipped with bole-tune)"}
POSITIVE = {"type": integer(1)}
BATCHES = {"type": integers(MAX_BATCH), "help": f"batch sizes, e.g. 1,4,16 (at most {MAX_BATCH})"}
TREE_SIZES = {"type": integers(MAX_TREE_SIZE), "help": f"nodes per request, e.g. 16,64 (at most {MAX_TREE_SIZE})"}
REPEATS = {"type": integer(MIN_REPEATS, MAX_REPEATS), "help": "timed replays per measurement"}
TP = {"type": integer(1), "default": 1, "help": "tensor-parallel degree: heads per rank = heads / tp"}
TUNING = {"--model": MODELS, "--dtype": {"choices": list(DTYPES), "default": "bf16"}, "--tp": TP,
          "--quick": {**FLAG, "help": "small grid (batch 1,4,16; tree 16,64,128), 16 trials (12 per commit study); "
                                      "tune --commit --quick: batch 1-32, tree 8-64"},
          "--batch": BATCHES, "--tree-size": TREE_SIZES, "--repeats": {**REPEATS, "default": 30},
          "--trials": {**POSITIVE, "help": "Optuna trials per bucket, at most one per config (default 32, 16 quick; "
                                         "with tune --commit: per commit study, default 24, 12 quick)"},
          "--storage": {"help": "Optuna storage URL (default: an SQLite file in ~/.cache/bole-tune); an interrupted "
                                "run resumes from it; more hosts join with the same command and storage"},
          "--workers": {**POSITIVE, "help": "worker processes on this host (default: one per visible GPU)"},
          "--sampler": {"choices": ["tpe", "grid", "random"], "default": "tpe",
                        "help": "Optuna sampler (grid: every config, split among the workers)"},
          "--replace-corrupt": {**FLAG, "help": "if the database file is corrupt, keep a copy and start a new one"},
          "--db-dir": DB_DIR}

COMMANDS = {
    "profile": (cmd_profile, "tune every bucket and measure latency curves; write the tuning database",
                "For each model's GDN heads: tune tree_verify's and the commit's tile configs per (tree size, batch) "
                "bucket with Optuna (every candidate checked against the float64 reference first), then measure the "
                "per-layer latency of tree_verify (tuned and default), serial_verify, tree_commit and a layer's round "
                "(tuned verify plus tuned commit; serial_verify plus its copy), and write it all with provenance "
                "to <db-dir>/<gpu>.yaml. Without a GPU it measures the CPU fallback and says so.",
                {**TUNING, "--no-serial": {**FLAG, "help": "skip the serial baseline curve"},
                 "--curve-batch": {**BATCHES, "help": "batch sizes of the latency curves (default: as tuned)"},
                 "--curve-tree-size": {**TREE_SIZES, "help": "tree sizes of the latency curves (default: as tuned)"},
                 "--remeasure": {**FLAG, "help": "measure curve points again though this code measured them"}}),
    "tune": (cmd_tune, "tune tile configs per bucket (no curves)",
             "Run the Optuna studies only. --exhaustive measures every config instead (the yardstick); --record "
             "FILE saves every measurement; --replay FILE runs the tuner on recorded measurements (no GPU needed). "
             "--commit tunes the commit's launches instead of tree_verify's; --fold the folded verify's "
             "(tree_verify with pending=); --ring a PendingRing's write round.",
             {**TUNING, "--exhaustive": {**FLAG, "help": "measure every config of the search space"},
              "--record": {"type": Path, "help": "write every measurement to this JSON file"},
              "--replay": {"type": Path, "help": "answer from a recording instead of the GPU"},
              "--replay-delay": {"type": seconds, "default": 0.0, "help": "seconds each replayed measurement takes"},
              "--commit": {**FLAG, "help": "tune the commit (tree_commit, and tree_commit_layers over all of the "
                                           "model's GDN layers) instead of tree_verify, in this process; --trials "
                                           "counts commit trials (default 24, 12 with --quick)"},
              "--fold": {**FLAG, "help": "tune the folded verify (tree_verify with pending=: the previous round's "
                                         "commit in the same launch; keys end in -fold) instead of tree_verify"},
              "--ring": {**FLAG, "help": "tune a PendingRing's write round (its R rounds of pending tokens folded "
                                         "into the slots; keys end in -ring; timed with the tables full, R = "
                                         f"{RING_ROUNDS}) instead of tree_verify"}}),
    "show": (cmd_show, "render the tuning database the runtime reads (rich tables, or --json)",
             "The tuned configs, curves and budgets of one GPU, merged from the folders the runtime reads "
             "(bole_tune.database), or of one --file.",
             {"--gpu": GPU, "--file": {"type": Path, "help": "a database file to show instead"},
              "--json": {**FLAG, "help": "print the database as JSON"}, "--db-dir": DB_DIR}),
    "lookup": (cmd_lookup, "print the config the runtime would pick for a shape, and why",
               "Resolve a tile config as tree_verify(config=None) does: the exact bucket, else the nearest tuned "
               "bucket, else the default (policy from BOLE_TUNE_LOOKUP).",
               {"--gpu": GPU, **{f"--{h}": {**POSITIVE, "required": True, "help": "model heads, split over --tp ranks"}
                                 for h in ("hv", "hk")}, "--dtype": {"choices": list(DTYPES), "default": "bf16"},
                **{f"--{h}": {"type": int, "choices": SUPPORTED_HEAD_DIMS, "required": True} for h in ("dk", "dv")},
                "--tree-size": {**POSITIVE, "required": True, "help": "nodes of the largest tree in the batch"},
                "--batch": {**POSITIVE, "required": True, "help": "requests in the batch"}, "--tp": TP,
                "--policy": {"choices": ["nearest", "strict", "default"], "help": "override BOLE_TUNE_LOOKUP"},
                "--commit": {**FLAG, "help": "the commit's config (tree_commit / tree_commit_layers) instead"},
                "--fold": {**FLAG, "help": "the folded verify's config (tree_verify with pending=) instead"},
                "--ring": {**FLAG, "help": "a PendingRing's write round's config instead"},
                "--layers": {**POSITIVE, "help": "with --commit: layers one launch commits (default 1)"},
                "--json": FLAG, "--db-dir": DB_DIR}),
    "env": (cmd_env, "fingerprint this machine's GPU (NVML matched by UUID / PCI bus id)",
            "What bole-tune records about this GPU (or the CPU): name, UUID, PCI bus id, compute capability, memory, "
            "caches, driver and CUDA versions, clocks, power limit, and its database file.",
            {"--json": {**FLAG, "help": "print JSON instead of a table"},
             "--device": {"help": "torch device, e.g. cuda:1 (default: the current one)"}}),
    "bench": (cmd_bench, "time tree_verify against serial_verify (and tree_commit) on one GDN layer",
              "Time one GDN layer's tree verification: tree_verify against the serial per-node-snapshot verifier "
              "engines use (serial_verify), and the commit. Without a GPU it times small CPU cases and says so.",
              {"--model": {"action": "append", "help": "model profile (repeatable; default qwen3.5-9b: a quick look "
                                                       "at one layer, not a database to fill)"},
               "--batch": BATCHES, "--tree-size": TREE_SIZES, "--dtype": {"choices": list(DTYPES), "default": "bf16"},
               "--max-depth": {"type": integer(1, MAX_TREE_DEPTH), "default": 8,
                               "help": f"tree depth bound (edges), default 8, at most {MAX_TREE_DEPTH}"},
               "--no-serial": {**FLAG, "help": "skip the serial baseline"},
               "--no-commit": {**FLAG, "help": "skip tree_commit and the rounds"},
               "--chain": {**FLAG, "help": "each request a chain of T nodes (an MTP drafter's proposal)"},
               "--ring-rounds": {"type": int, "default": None, "choices": range(1, 17), "metavar": "R",
                                 "help": f"rounds a PendingRing keeps pending in the ring rows (default {RING_ROUNDS}, "
                                         "or where the Gluon verify runs a case's ring rounds the most up to it that "
                                         "kernel takes: 3 for trees of depth 8)"},
               "--repeats": {**REPEATS, "default": 50}, "--lookup": {**FLAG, "help": "only time the runtime lookup"},
               "--json": {"type": Path, "help": "also write the rows as JSON to this file"}}),
    "step": (cmd_step, "measure the whole verification step of each model (needs a GPU)",
             "Time one GDN layer's round (conv, gates, tree_verify, commit; and through serial_verify), one attention "
             "layer (tree attention over a KV context, as engines run it) and the LM head at the model's real shapes "
             "with random weights, as CUDA graphs, per batch and tree size; the step is their sum over the model's "
             "layers. Writes step curves to the database.",
             {"--model": MODELS, "--batch": {**BATCHES, "help": "batch sizes (default 1,2,4,8,16,32)"},
              "--tree-size": {**TREE_SIZES, "help": "verified tokens per request, 1 = no speculation (default 1-6, "
                                                   f"8, 12, 16, 24, 32, 48, 64, 96, 128; at most {MAX_TREE_SIZE})"},
              "--attention": {"type": lambda text: text.replace(",", " ").split(), "default": ["split"],
                              "help": "tree attention methods to time, the fastest counts: split, flex"},
              "--context": {"type": integer(1, MAX_CONTEXT), "default": 4096,
                            "help": "KV context length of the attention layers"},
              "--no-serial": {**FLAG, "help": "skip the serial_verify variant"},
              "--repeats": {**REPEATS, "default": 20}, "--replace-corrupt": FLAG, "--db-dir": DB_DIR}),
    "budget": (cmd_budget, "choose the draft shape per batch size, model, workload and engine; export engine files",
               "Per batch size, the shape each engine can build (SGLang beam trees, vLLM chains, any tree for bole) "
               "that maximises expected tokens per second on the step curve; stored in the user's database.",
               {"--model": {"action": "append", "help": "repeatable (default: every model with a step curve)"},
                "--acceptance": {"action": "append", "help": "workload (profile or YAML), repeatable (default: all)"},
                "--engine": {"action": "append", "choices": ["sglang", "vllm", "bole"], "help": "default: all"},
                "--gpu": GPU, "--export": {"type": Path, "help": "folder for engine files"}, "--db-dir": DB_DIR}),
    "calibrate": (cmd_calibrate, "fit an acceptance model to a JSONL log of real rounds",
                  "Fit per-depth acceptance and rank shares from a log (one JSON object per request and round: "
                  "parents, ranks, accepted; see bole_tune.acceptance).",
                  {"log": {"type": Path}, "--name": {"help": "name of the fitted model (default: the log's name)"},
                   "--out": {"type": Path, "help": "write the model as YAML here (default: print it)"}}),
    "report": (cmd_report, "plots (PNG and SVG): step latency, tokens/s against budget per workload and engine, "
               "tree vs serial verification", None,
               {"--gpu": GPU, "--out": {"type": Path, "default": Path("bole-tune-report"), "help": "output folder"},
                "--db-dir": DB_DIR}),
    "validate": (cmd_validate, "prove the tree step exact against transformers' Qwen3.5 and lossless end to end",
                 "Check transformers' own Qwen3.5 (random weights): every tree node's GDN-layer output and committed "
                 "state against it token by token, and speculative decoding against its greedy generate. Needs "
                 "transformers (pip install -e '.[validate]').",
                 {"--production": {**FLAG, "help": "Qwen3.5-9B GDN heads (Hk 16, Hv 32, dk = dv = 128); best on a GPU"},
                  "--trees": {**POSITIVE, "default": 3, "help": "random trees in the layer check"},
                  "--prompts": {**POSITIVE, "default": 3, "help": "prompts in the generation check"},
                  "--tokens": {**POSITIVE, "default": 200, "help": "tokens generated per prompt"},
                  "--skip-generation": {**FLAG, "help": "only the layer check"}}),
}


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line naming the flag (exit status 2), as every other error is."""

    def error(self, message):
        sys.exit(_fail(f"{self.prog}: {message} (see {self.prog} --help)"))


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="bole-tune",
        description="Exact, fast tree speculative decoding for hybrid-attention LLMs (Qwen3.5 / Qwen3-Next): "
                    "benchmark, tune and look up the Bole verifier on your GPU.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (func, summary, description, arguments) in COMMANDS.items():
        p = sub.add_parser(name, help=summary, description=description or summary)
        for flag, options in arguments.items():
            p.add_argument(flag, **options)
        p.set_defaults(func=func)
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
    from bole_tune.profiler import WorkerFailure
    from bole_tune.runners import DeviceLost, RecordingIncomplete

    try:
        return args.func(args)
    except (UsageError, RecordingIncomplete, ValueError) as error:  # ValueError: the library's bad value or file
        return _fail(f"bole-tune {args.command}: {error}")
    except OSError as error:  # a file the checks could not foresee (removed, full disk): its name, one line
        return _fail(f"bole-tune {args.command}: {error.filename or ''}: {error.strerror or error}")
    except (DeviceLost, WorkerFailure) as error:
        return _fail(f"bole-tune {args.command}: {error}", 3)
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]")
        return 130


if __name__ == "__main__":
    sys.exit(main())
