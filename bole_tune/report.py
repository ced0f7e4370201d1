"""Plots a person wants to see, from one tuning database: PNG and SVG of each.

1. ``step_latency``: step latency against verified tokens per batch size, with the near-free region
   (within 10% of the step at N = B) shaded;
2. ``budget-<model>``, one per model with budgets: a panel per workload (rows) and engine (columns),
   expected tokens per second against the budget (verified tokens per request; at each, the best shape
   the engine can build) per batch size, the chosen point starred;
3. ``tree_vs_serial``: the verification step with tree_verify against serial_verify.
"""

from __future__ import annotations

from pathlib import Path

from bole_tune.acceptance import AcceptanceModel
from bole_tune.budget import ENGINES, StepCurve, plan
from bole_tune.fingerprint import slugify
from bole_tune.profiles import DrafterShape

NEAR_FREE = 1.10  # a step within 10% of plain decoding's counts as near free


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plain_numbers(leading=None):
    """Tick labels as plain numbers (not 2^k or 3x10^0); ``leading``: label only values of these first digits."""
    from matplotlib.ticker import FuncFormatter

    def text(value, _):
        return f"{value:g}" if leading is None or f"{value:e}"[0] in leading else ""

    return FuncFormatter(text)


def _save(fig, out: Path, stem: str) -> list[Path]:
    """Write the figure as PNG and SVG, then release it."""
    files = []
    for suffix in ("png", "svg"):
        path = out / f"{stem}.{suffix}"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        files.append(path)
    _pyplot().close(fig)
    return files


def _panels(plt, count: int):
    """One row of ``count`` panels."""
    fig, axes = plt.subplots(1, count, figsize=(5 * count, 4), squeeze=False)
    return fig, axes[0]


def _finish(ax, xlabel: str, ylabel: str, title: str, legend_size: int = 8) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(_plain_numbers())
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=legend_size)


def write_report(data: dict, out) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    curves = data.get("step_curves", {})
    if not curves:
        raise ValueError("the database has no step curves (run bole-tune step, then bole-tune budget)")
    plt = _pyplot()
    files = []
    device = data.get("device", {}).get("name", "")

    fig, axes = _panels(plt, len(curves))
    for ax, curve in zip(axes, curves.values()):
        by_batch = StepCurve(curve["points"]).by_batch
        for batch, pts in sorted(by_batch.items()):
            tokens = [p["tokens"] for p in pts]
            steps = [p["step_us"] / 1000 for p in pts]
            line, = ax.plot(tokens, steps, marker="o", label=f"B={batch}")
            free = [t for t, s in zip(tokens, steps) if s <= NEAR_FREE * steps[0]]
            ax.axvspan(tokens[0], max(free), color=line.get_color(), alpha=0.08)
        _finish(ax, "verified tokens per step (all requests)", "step latency (ms)",
                f"{curve['model']} on {device}\n(shaded: within 10% of plain decoding)")
    files += _save(fig, out, "step_latency")

    by_model = {}
    for name, budget in data.get("budgets", {}).items():
        if budget["step_curve"] not in curves:
            raise ValueError(f"budgets.{name}.step_curve: no step curve {budget['step_curve']!r} in the database "
                             "(run bole-tune step, then bole-tune budget)")
        by_model.setdefault(budget["model"], []).append(budget)
    for model, budgets in by_model.items():
        files += _save(_budget_figure(plt, model, budgets, curves, device), out, f"budget-{slugify(model)}")
    serial = {n: c for n, c in curves.items() if any("step_serial_us" in p for p in c["points"])}
    if serial:
        fig, axes = _panels(plt, len(serial))
        for ax, curve in zip(axes, serial.values()):
            for batch, pts in sorted(StepCurve(curve["points"]).by_batch.items()):
                pts = [p for p in pts if "step_serial_us" in p]
                if not pts:
                    continue
                tokens = [p["tokens"] for p in pts]
                line, = ax.plot(tokens, [p["step_us"] / 1000 for p in pts], marker="o", label=f"tree_verify B={batch}")
                ax.plot(tokens, [p["step_serial_us"] / 1000 for p in pts], linestyle="--", color=line.get_color(),
                        label=f"serial_verify B={batch}")
            _finish(ax, "verified tokens per step", "step latency (ms)",
                    f"{curve['model']}\nGDN layers: tree (solid), serial (dashed)", legend_size=7)
        files += _save(fig, out, "tree_vs_serial")
    return files


def _budget_figure(plt, model: str, budgets: list[dict], curves: dict, device: str):
    """Rows: workloads; columns: engines; per batch, tokens/s against tokens per request, chosen starred."""
    workloads = sorted({b["workload"] for b in budgets})
    engines = [e for e in ENGINES if any(b["engine"] == e for b in budgets)]
    fig, axes = plt.subplots(len(workloads), len(engines), figsize=(5 * len(engines), 3.8 * len(workloads)),
                             squeeze=False)
    for budget in budgets:
        ax = axes[workloads.index(budget["workload"])][engines.index(budget["engine"])]
        drafter = DrafterShape(**budget.get("drafter", {}))
        result = plan(budget["engine"], AcceptanceModel.from_dict(budget["acceptance"]),
                      StepCurve.for_engine(curves[budget["step_curve"]], budget["engine"]), drafter)
        for batch, info in sorted(result["batches"].items()):
            xs, ys = zip(*info["by_nodes"])
            line, = ax.plot(xs, [y / 1000 for y in ys], label=f"B={batch}")
            best = info["best"]
            ax.plot([best.shape.nodes_per_request], [best.tokens_per_second / 1000], marker="*", markersize=13,
                    color=line.get_color(), markeredgecolor="black")
            if result["fixed_chain"]:
                ax.plot([result["fixed_chain"] + 1], [info["fixed_chain"] / 1000], marker="x", markersize=8,
                        color=line.get_color())
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(_plain_numbers())
        ax.yaxis.set_minor_formatter(_plain_numbers(leading="25"))
        _finish(ax, "verified tokens per request (budget)", "expected tokens/s (thousands)",
                f"{budget['workload']}, {budget['engine']}", legend_size=7)
    fig.suptitle(f"{model} on {device}: expected tokens/s per budget (star: chosen; x: the best fixed chain)")
    fig.tight_layout()
    return fig
