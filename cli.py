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
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    import torch

    from bole_tune.bench import BenchCase, CaseBench, DTYPES, bench_commit, bench_verify, environment
    from bole_tune.profiles import ProfileError, resolve_model

    has_gpu = torch.cuda.is_available()
    device = "cuda" if has_gpu else "cpu"
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
        table.add_row(r["label"], str(r["hv"]), str(r["batch"]), str(r["tree_size"]), r["kernel"],
                      f"{r['p50_us']:.1f}", f"{r['p20_us']:.1f}-{r['p80_us']:.1f}", f"{r['floor_us']:.1f}",
                      f"{r['floor_fraction']:.0%}", speedup)
    return table


def _write_json(path: Path, data) -> None:
    from bole_tune.atomic import write_text_atomic
    write_text_atomic(path, json.dumps(data, indent=1, default=str) + "\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bole-tune",
        description="Exact, fast tree speculative decoding for hybrid-attention LLMs (Qwen3.5 / Qwen3-Next): "
                    "benchmark, tune and look up the Bole verifier on your GPU.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_bench(sub)
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
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]")
        return 130


if __name__ == "__main__":
    sys.exit(main())
