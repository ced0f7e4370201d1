"""Rich tables of what the library returns: the command line prints them, a notebook can too.

Each function takes a library result (a `ProfileResult`, a database as `bole_tune.database.search`
returns it, a `BudgetResult`, bench rows, ...) and returns a `rich.table.Table` (or lines, JSON text, a
progress bar); nothing here measures, reads or writes anything.
"""

from __future__ import annotations

import json
import math

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from bole_tune.config import SHORT_RING_ROUNDS, KernelConfig
from bole_tune.database import ShapeKey


def table(title: str, columns, left=("model",)) -> Table:
    """A table whose ``left`` columns are left-aligned (and never wrapped), the others right-aligned."""
    t = Table(title=title)
    for column in columns:
        t.add_column(column, justify="left" if column in left else "right", no_wrap=column in left)
    return t


def facts(title: str, pairs) -> Table:
    """A two-column table of (name, value) pairs, e.g. a `bole_tune.fingerprint.Fingerprint`'s facts."""
    t = Table(title=title, show_header=False)
    t.add_column("fact", style="bold")
    t.add_column("value")
    for name, value in pairs:
        t.add_row(name, str(value))
    return t


def json_text(data) -> str:
    """``data`` as JSON that every parser reads: a non-finite number (``.inf`` in a YAML file) becomes null,
    not the ``Infinity`` that `json.dumps` writes by default and JSON does not have."""
    def finite(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: finite(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [finite(v) for v in value]
        return value
    return json.dumps(finite(data), indent=1, default=str, allow_nan=False)


def progress_bar(console) -> Progress:
    """A bar per stage with done/total, elapsed time and an estimate of the time left."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("eta"), TimeRemainingColumn(), console=console)


def stage_progress(bar: Progress):
    """A `bole_tune.profiler.Progress` callback drawing one bar per stage on ``bar``."""
    tasks = {}

    def report(p):
        if p.stage not in tasks:
            tasks[p.stage] = bar.add_task(p.stage, total=p.total)
        bar.update(tasks[p.stage], completed=p.done, total=p.total, description=f"{p.stage} {p.label}".strip())
    return report


def geometric_mean(values) -> float:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def tuning(results) -> Table:
    """Per bucket: the best config, its time against the default's, and what the search met."""
    t = table("tuned tile configs (tree_verify, one GDN layer)", ("bucket", "best config", "p50 us", "default us",
              "speedup", "measured", "wrong", "infeasible"), left=("bucket", "best config"))
    for r in results:
        d, counts = r.default_measurement, [str(r.counts.get(k, 0)) for k in ("measured", "wrong", "infeasible")]
        if r.best is None:
            t.add_row(r.key.text, "[red]none worked[/]", "", "", "", *counts)
            continue
        t.add_row(r.key.text, str(r.best), f"{r.best_measurement.p50_us:.1f}",
                  f"{d.p50_us:.1f}" if d and d.status == "ok" else "-", f"{r.speedup:.2f}x" if r.speedup else "-",
                  *counts)
    speedups = [r.speedup for r in results if r.speedup]
    if speedups:
        t.caption = f"geometric-mean speedup over the default config: {geometric_mean(speedups):.2f}x"
    return t


def curves(rows) -> Table:
    """Per model, batch and tree size: each kernel's p50 (`bole_tune.profiler.measure_curves` rows)."""
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    t = table("per-layer latency, p50 us (median of timed replays)", ("model", "B", "T", *kernels))
    grouped = {}
    for r in rows:
        grouped.setdefault((r["model"], r["batch"], r["tree_size"]), {})[r["kernel"]] = r["p50"]
    for (model, batch, size), values in grouped.items():
        t.add_row(model, str(batch), str(size), *[f"{values[k]:.1f}" if k in values else "" for k in kernels])
    return t


def configs(data: dict) -> Table:
    """The tuned configs of a database, sorted by key; the caption names the Triton versions and dates."""
    t = Table(title=f"tuned configs (T: tree-size bucket, B: batch bucket; config: {'/'.join(KernelConfig.knobs())})")
    for column, width in (("shape", 19), ("T", 3), ("B", 2), ("config", 11), ("kernel", 8), ("p50 us", 6),
                          ("p20-p80", 11), ("default us", 6), ("speedup", 5), ("measured", 3)):
        t.add_column(column, min_width=width, no_wrap=True,
                     justify="left" if column in ("shape", "config", "kernel", "p20-p80") else "right")
    versions, dates = set(), set()
    for key, e in sorted((ShapeKey.from_dict(e["key"]), e) for e in data["configs"].values()):
        h, lat, prov = key.heads, e["latency_us"], e["provenance"]
        versions.add(str(prov.get("triton", "?")))
        dates.add(str(prov.get("date", "?"))[:10])
        shape = f"Hv{h.hv} Hk{h.hk} {h.dk}/{h.dv} {key.dtype}" + (f" TP{key.tp}" if key.tp != 1 else "")
        # the folded verify's and a ring write round's own entries
        kernel = e.get("kernel", "fused") + (" folded" if key.fold else " ring write" if key.ring else "")
        t.add_row(shape, str(key.tree_bucket), str(key.batch_bucket), KernelConfig.from_dict(e["config"]).text,
                  kernel, f"{lat['p50']:.1f}", f"{lat['p20']:.1f}-{lat['p80']:.1f}",
                  f"{e['default_latency_us']['p50']:.1f}" if "default_latency_us" in e else "-",
                  f"{e['speedup_vs_default']:.2f}x" if "speedup_vs_default" in e else "-",
                  str(e.get("trials", {}).get("measured", "")))
    if data["configs"]:
        t.caption = (f"triton {', '.join(sorted(versions))}; measured {', '.join(sorted(dates))} "
                     "(full provenance: --json)")
    return t


def curve_summaries(data: dict) -> list[str]:
    """One line per latency curve, step curve section and budget section of a database."""
    lines = []
    for name, curve in data["curves"].items():
        points = curve["points"]
        more = f" (+{len(points) - 8} more)" if len(points) > 8 else ""
        lines.append(f"[bold]curve[/] {name}: "
                     + ", ".join(f"B{p['batch']}/T{p['tree_size']}: {p['p50']:.1f}" for p in points[:8]) + f"{more} us")
    for section in ("budgets", "step_curves"):
        if data.get(section):
            lines.append(f"[bold]{section}[/]: {', '.join(data[section])}")
    return lines


GDN_ROUND_LABELS = {"verify + commit": "commit", "verify + all-layer commit": "all layers", "folded": "folded",
                    "ring": "ring", f"ring of {SHORT_RING_ROUNDS}": f"ring of {SHORT_RING_ROUNDS}"}
"""Short names of `bole_tune.step_latency.GDN_ROUNDS` for the step table (a Gluon ring, ``ring of 3``, by its name)."""

STEP_FIELDS = ("gdn_us", "gdn_serial_us", "attention_us", "lm_head_us", "step_us", "step_serial_us")


def step(result) -> Table:
    """The points `bole_tune.step_latency.measure_and_store` measured, per model, batch and tree size."""
    t = table(f"verification step on {result.device_name}, us (p50)",
              ("model", "B", "T", "tokens", "GDN layer", "GDN round", "GDN serial", "attention", "LM head", "step",
               "step serial"))
    for model, points in result.points.items():
        for point in points:
            d = point.as_dict()
            cells = [f"{d[k]:.0f}" if k in d else "-" for k in STEP_FIELDS]
            t.add_row(model, str(point.batch), str(point.tree_size), str(point.tokens), cells[0],
                      GDN_ROUND_LABELS.get(d.get("gdn_round"), d.get("gdn_round", "-")), *cells[1:])
    return t


def numbers(values, digits: int = 3) -> str:
    return ", ".join(f"{v:.{digits}f}" for v in values)


def shape_text(b: dict) -> str:
    """A budget batch entry's shape as the engine is told it: SGLang's (steps, topk, draft tokens), vLLM's K,
    or the tree's nodes per request, depth and width."""
    if "sglang" in b:
        f = b["sglang"]
        return (f"s{f['speculative_num_steps']} k{f['speculative_eagle_topk']} "
                f"n{f['speculative_num_draft_tokens']}")
    if "vllm" in b:
        return f"K={b['vllm']['num_speculative_tokens']}"
    return f"{b['shape']} {b['nodes_per_request']} d{b['depth']} w{b['width']}"


def budget_tables(budgets: dict, where: str, prefix: str = "") -> list[Table]:
    """One table per model: per workload, engine and batch, the chosen shape and what it gains."""
    tables = {}
    for entry in budgets.values():
        if entry["model"] not in tables:
            tables[entry["model"]] = table(f"{prefix}{entry['model']} on {where}: chosen shapes (sglang: steps, topk, draft "
                                           "tokens; x chain: against the best fixed chain)",
                                           ("workload", "engine", "B", "shape", "E[acc]", "tok/s", "x plain",
                                            "x chain"), left=("workload", "engine", "shape"))
        t = tables[entry["model"]]
        for batch, b in sorted(entry["batches"].items(), key=lambda kv: int(kv[0])):
            t.add_row(entry["workload"], entry["engine"], str(batch), shape_text(b), f"{b['expected_accepted']:.2f}",
                      f"{b['tokens_per_second']:.0f}", f"{b['speedup_vs_no_speculation']:.2f}x",
                      f"{b['speedup_vs_fixed_chain']:.2f}x")
    return list(tables.values())


def budgets(result) -> list[Table]:
    """The budgets `bole_tune.budget.store_budgets` chose."""
    return budget_tables(result.budgets, result.slug)


def report_summary(data: dict) -> list[Table]:
    """The budgets of a database (as `bole_tune.database.search` returns it)."""
    return budget_tables(data.get("budgets", {}), data.get("device", {}).get("name", ""), "summary: ")


def bench_progress(rows) -> str:
    """One case's rows in a line: ``  label B=.. T=..: kernel p50 us, ...``."""
    r = rows[0]
    return (f"  {r['label']} B={r['batch']} T={r['tree_size']}: "
            + ", ".join(f"{row['kernel']} {row['p50_us']:.1f} us" for row in rows))


def exhaustive(found: dict) -> list[str]:
    """Per bucket of `bole_tune.profiler.exhaustive`'s result: the best working config of how many."""
    lines = []
    for key, measured in found.items():
        ok = {c: m for c, m in measured.items() if m.status == "ok"}
        if ok:
            best = min(ok, key=lambda c: ok[c].p50_us)
            lines.append(f"  {key}: best {best} {ok[best].p50_us:.1f} us of {len(ok)} working")
    return lines


def bench(rows) -> Table:
    """`bole_tune.bench` rows, with tree_verify's speedup over serial_verify on the same case."""
    t = table("one GDN layer, per call (median of CUDA-graph replays; p20-p80)",
              ("model", "Hv", "B", "T", "kernel", "p50 us", "p20-p80", "floor us", "of floor", "vs serial"),
              left=("model", "kernel"))
    serial = {(r["label"], r["hv"], r["batch"], r["tree_size"], r["kernel"].startswith("round")): r["p50_us"]
              for r in rows if r["kernel"] in ("serial_verify", "round_serial")}
    for r in rows:
        key = (r["label"], r["hv"], r["batch"], r["tree_size"], r["kernel"].startswith("round"))
        compared = r["kernel"] in ("tree_verify", "round_verify_commit", "round_folded", "round_ring")
        speedup = f"{serial[key] / r['p50_us']:.1f}x" if compared and key in serial else ""
        kernel = f"{r['kernel']} ({r['variant']})" if "variant" in r else r["kernel"]
        t.add_row(r["label"], str(r["hv"]), str(r["batch"]), str(r["tree_size"]), kernel, f"{r['p50_us']:.1f}",
                  f"{r['p20_us']:.1f}-{r['p80_us']:.1f}", f"{r['floor_us']:.1f}", f"{r['floor_fraction']:.0%}", speedup)
    return t


def round_verdict(verdict) -> str:
    """`bole_tune.bench.round_verdict` in a line: the range of the cheapest round's speedup over the serial round,
    the slowest case, and in red every case where the serial path is as fast or faster."""
    if not verdict:
        return "no round timed beside the serial round (rounds need the commit and the serial baseline)"
    worst, best = verdict[0], verdict[-1]
    case = lambda v: f"{v['label']} B={v['batch']} T={v['tree_size']}{' chain' if v.get('kind') == 'chain' else ''}"
    line = (f"the cheapest round against the serial round over {len(verdict)} cases: {worst['speedup']:.2f}x-"
            f"{best['speedup']:.1f}x; slowest {case(worst)}: {worst['way']} {worst['round_us']:.1f} us against "
            f"{worst['serial_us']:.1f}")
    slower = [v for v in verdict if v["speedup"] <= 1]
    if slower:
        line += "\n[bold red]not faster than the serial round: " + ", ".join(
            f"{case(v)} ({v['round_us']:.1f} against {v['serial_us']:.1f} us)" for v in slower) + "[/]"
    return line


def validation(layers, generation=None, tokens: int = 0) -> list[str]:
    """What `bole_tune.validate` found, a line per check (PASS/FAIL first) and one per failure."""
    from bole_tune.validate import TOLERANCE

    verdict = {True: "[green]PASS[/]", False: "[red]FAIL[/]"}
    lines = [f"{verdict[layers.passed]} layer step vs transformers token by token: {layers.trees} trees, "
             f"{layers.nodes} nodes; worst relative error: outputs {layers.worst_output_error:.1e}, recurrent state "
             f"{layers.worst_state_error:.1e}, conv state {layers.worst_conv_error:.1e} (bound {TOLERANCE:.0e})"]
    lines += [f"  {failure}" for failure in layers.failures]
    if generation is not None:
        g = generation
        lines.append(f"{verdict[g.passed]} speculative decoding vs transformers' greedy generate: {g.prompts} prompts "
                     f"x {tokens} tokens, identical: {not g.mismatches}; {g.rounds} rounds, mean accepted draft tokens "
                     f"per round {g.mean_accepted:.2f}")
        lines += [f"  {mismatch}" for mismatch in g.mismatches]
    passed = layers.passed and (generation is None or generation.passed)
    lines.append("[bold green]verdict: exact[/]" if passed else "[bold red]verdict: NOT exact[/]")
    return lines
