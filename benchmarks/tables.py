"""Markdown tables for BENCHMARKS.md, read from a tuning database (nothing typed by hand).

Usage: python benchmarks/tables.py [tuning_db/nvidia-h200.yaml]

Per model: tree_verify (tuned config) p50, its speedup over serial_verify, over the default config,
the fraction of the byte floor, and tree_commit, each as a batch x tree-size matrix; then the
geometric mean of tuned over default across every tuned bucket.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

from bole_tune import database
from bole_tune.bench import COPY_BANDWIDTH_H200, BenchCase
from bole_tune.shapes import HeadShape


def matrix(title: str, values: dict, batches, sizes, fmt) -> str:
    lines = [f"{title}", "", "| B \\ T | " + " | ".join(str(t) for t in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    for b in batches:
        cells = [fmt(values[(b, t)]) if (b, t) in values else "" for t in sizes]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(path: str = "tuning_db/nvidia-h200.yaml") -> None:
    data = database.load(Path(path))
    curves = data["curves"]
    models = list(dict.fromkeys(c["model"] for c in curves.values()))
    for model in models:
        by_kernel = {c["kernel"]: c for c in curves.values() if c["model"] == model and c.get("tp", 1) == 1}
        if "tree_verify_tuned" not in by_kernel:
            continue
        shape = HeadShape(**{k: by_kernel["tree_verify_tuned"]["shape"][k] for k in ("hk", "hv", "dk", "dv")})
        p50 = {k: {(p["batch"], p["tree_size"]): p["p50"] for p in c["points"]} for k, c in by_kernel.items()}
        tuned = p50["tree_verify_tuned"]
        batches = sorted({b for b, _ in tuned})
        sizes = sorted({t for _, t in tuned})
        floor = {bt: BenchCase(shape, bt[0], bt[1], torch.bfloat16).floor_bytes() / COPY_BANDWIDTH_H200 * 1e6
                 for bt in tuned}
        print(f"#### {model} (Hk {shape.hk}, Hv {shape.hv}, dk = dv = {shape.dk})\n")
        print(matrix("tree_verify with the tuned config, p50 us:", tuned, batches, sizes, lambda x: f"{x:.1f}"))
        if "serial_verify" in p50:
            ratio = {bt: p50["serial_verify"][bt] / tuned[bt] for bt in tuned if bt in p50["serial_verify"]}
            print(matrix("speedup over serial_verify (serial p50 / tree_verify p50):", ratio, batches, sizes,
                         lambda x: f"{x:.1f}x"))
        if "tree_verify_default" in p50:
            ratio = {bt: p50["tree_verify_default"][bt] / tuned[bt] for bt in tuned}
            print(matrix("tuned over the default config (default p50 / tuned p50):", ratio, batches, sizes,
                         lambda x: f"{x:.2f}x"))
        share = {bt: floor[bt] / tuned[bt] for bt in tuned}
        print(matrix("fraction of the byte floor (floor us / tree_verify us):", share, batches, sizes,
                     lambda x: f"{100 * x:.0f}%"))
        if "tree_commit" in p50:
            print(matrix("tree_commit (each request's deepest node), p50 us:", p50["tree_commit"], batches, sizes,
                         lambda x: f"{x:.1f}"))
    step_table(data)
    budget_table(data)
    speedups = [e["speedup_vs_default"] for e in data["configs"].values() if e.get("speedup_vs_default")]
    if speedups:
        geo = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
        print(f"Tuned over default across {len(speedups)} tuned buckets: geometric mean {geo:.2f}x "
              f"(min {min(speedups):.2f}x, max {max(speedups):.2f}x).")


def step_table(data: dict) -> None:
    print("| model | B=1: step at 1 / 16 / 128 tokens per request (ms) | B=16: 1 / 16 / 128 | whole step at B=16, "
          "T=128: GDN layers through serial_verify vs tree_verify |")
    print("|---|---|---|---|")
    for curve in data.get("step_curves", {}).values():
        pts = {(p["batch"], p["tree_size"]): p for p in curve["points"]}

        def ms(b, t, pts=pts):
            return f"{pts[(b, t)]['step_us'] / 1000:.1f}" if (b, t) in pts else "-"
        tail = ""
        if (16, 128) in pts and "step_serial_us" in pts[(16, 128)]:
            s, tr = pts[(16, 128)]["step_serial_us"] / 1000, pts[(16, 128)]["step_us"] / 1000
            tail = f"serial {s:.0f} ms vs tree {tr:.0f} ms ({s / tr:.2f}x)"
        print(f"| {curve['model']} | {ms(1, 1)}/{ms(1, 16)}/{ms(1, 128)} | {ms(16, 1)}/{ms(16, 16)}/{ms(16, 128)} | "
              f"{tail} |")
    print()


def budget_table(data: dict) -> None:
    print("| model | B | tokens | nodes/request | shape | depth | width | E[accepted] | tokens/s | vs no speculation "
          "| vs best fixed budget |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, entry in data.get("budgets", {}).items():
        model = name.split("/")[0]
        for batch, b in sorted(entry["batches"].items(), key=lambda kv: int(kv[0])):
            print(f"| {model} | {batch} | {b['tokens']} | {b['nodes_per_request']} | {b['shape']} | {b['depth']} | "
                  f"{b['width']} | {b['expected_mean_accepted']:.2f} | {b['tokens_per_second']:.0f} | "
                  f"{b['speedup_vs_no_speculation']:.2f}x | {b['speedup_vs_fixed_budget']:.2f}x |")
    print()


if __name__ == "__main__":
    main(*sys.argv[1:])
