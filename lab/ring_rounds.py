"""Issue 17: how many rounds should a `PendingRing` keep? The ring's layer round (``round_ring``: ``((R - 1) read +
write) / R`` plus the table update's share over the 9B's 24 GDN layers, `CaseBench.time_ring`) at R = 2, 3 and 4
for the issue's target cases, side by side in one process, the rings alternating over several turns (the median
of the turns per R), each ring's outputs and flushed slots first checked against the float64 recurrence
(`CaseBench.ring_errors`). 9B heads, bf16, CUDA graphs over rotating input sets.

    python3 lab/ring_rounds.py [--json OUT] [--turns 2] [--repeats 30]
"""

from __future__ import annotations

import argparse
import json

import torch

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.profiles import resolve_model

# (batch, nodes per request, kind): the targets and the grid's widest chains
CASES = [(1, 4, "chain"), (1, 8, "random"), (16, 4, "chain"), (16, 64, "random"), (32, 8, "chain"), (32, 4, "chain")]
ROUNDS = (2, 3, 4)
TOLERANCE = 2e-2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    model = resolve_model("qwen3.5-9b")
    layers = model.num_gdn_layers
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = []
    for batch, size, kind in CASES:
        bench = CaseBench(BenchCase(model.heads(), batch, size, kind=kind, label=model.name), device)
        default = bench.ring_rounds()
        for r in ROUNDS:
            errors = bench.ring_errors(rounds=r)
            worst = max(errors) if isinstance(errors, tuple) else errors
            if worst > TOLERANCE:
                raise SystemExit(f"B={batch} T={size} {kind} ring of {r}: error {worst:.2e} > {TOLERANCE}")
        turns = {r: [] for r in ROUNDS}
        for _ in range(args.turns):
            for r in ROUNDS:
                t = bench.time_ring(r, layers, args.repeats)
                turns[r].append({k: v.p50_us for k, v in t.items()})
        row = {"batch": batch, "tree_size": size, "kind": kind, "depth": bench.depth(), "bench_default": default}
        for r in ROUNDS:
            ordered = sorted(turns[r], key=lambda t: t["round_ring"])
            row[f"ring of {r}"] = ordered[len(ordered) // 2]
            row[f"ring of {r} turns"] = [round(t["round_ring"], 2) for t in turns[r]]
        results.append(row)
        print(f"B={batch:2d} T={size:3d} {kind:6s} depth {row['depth']} (bench keeps {default}): "
              + "  ".join(f"R={r} {row[f'ring of {r}']['round_ring']:6.1f} (read {row[f'ring of {r}']['ring_read']:.1f}"
                          f" write {row[f'ring of {r}']['ring_write']:.1f})" for r in ROUNDS), flush=True)
        del bench
        torch.cuda.empty_cache() if device == "cuda" else None
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
