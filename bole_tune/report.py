"""Plots a person wants to see, from one tuning database: PNG and SVG of each.

1. step latency against verified tokens per batch size, with the near-free region (within 10% of the
   step at N = B) shaded;
2. expected tokens per second against the tree budget per batch size, with the chosen point;
3. the verification step with tree_verify against serial_verify.
"""

from __future__ import annotations

from pathlib import Path

from bole_tune.acceptance import AcceptanceModel
from bole_tune.budget import StepCurve, plan_budgets

NEAR_FREE = 1.10  # a step within 10% of plain decoding's counts as near free


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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

    budgets = data.get("budgets", {})
    if budgets:
        fig, axes = _panels(plt, len(budgets))
        for ax, (name, budget) in zip(axes, budgets.items()):
            if budget.get("step_curve") not in curves:
                raise ValueError(f"budgets.{name}.step_curve: no step curve {budget.get('step_curve')!r} in the "
                                 "database (run bole-tune step, then bole-tune budget)")
            a = budget["acceptance"]
            model = AcceptanceModel(a["name"], tuple(a["depth_acceptance"]), tuple(a["rank_share"]))
            plan = plan_budgets(model, StepCurve(curves[budget["step_curve"]]["points"]))
            for batch, info in sorted(plan["batches"].items()):
                xs, ys = zip(*info["curve"])
                line, = ax.plot(xs, [y / 1000 for y in ys], label=f"B={batch}")
                chosen = info["choice"]
                ax.plot([chosen.nodes_per_request], [chosen.tokens_per_second / 1000], marker="*", markersize=12,
                        color=line.get_color())
            _finish(ax, "verified tokens per request (tree budget)", "expected tokens/s (thousands)",
                    f"{name}: chosen budget (star)\nacceptance {a['name']}")
        files += _save(fig, out, "budget")

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
