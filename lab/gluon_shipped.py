"""Issue 17 with the Gluon verify shipped (`kernels/verify/gluon.py`): what a layer's round costs through the public
API, the Gluon launches side by side with the Triton launches they replace, in one run (H200, 9B heads, bf16,
random trees of 64 nodes and depth <= 8).

For each batch: both launches checked against float64 first (the verify on the bench's reference instance; a
`PendingRing` of R rounds over R + 1 rounds, outputs and flushed slots), then, timed as every figure in BENCHMARKS.md
(one CUDA graph over rotating input sets, medians), in alternating order over ``--turns``:

- ``verify``: `tree_verify` alone;
- ``ring R``: `CaseBench.time_ring`'s ``round_ring`` (((R - 1) read rounds + a write round) / R + the table update
  over 24 layers), every request accepting its deepest node (the fullest tables), for R = 3 (tables 32 wide: the
  Gluon rounds) and R = 2;
- ``verify + all-layer commit``: the verify plus the per-layer share of one `tree_commit_layers` launch for 24 layers.

    python3 lab/gluon_shipped.py [--batch 16] [--turns 2] [--json OUT]     # H200
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.config import KernelConfig
from bole_tune.kernels import tree_verify
from bole_tune.shapes import HeadShape

HEADS_9B = HeadShape(hk=16, hv=32, dk=128, dv=128)
TRITON_TUNED = KernelConfig(32, 64, 4, 3)
LAYERS = 24


def run(batch: int, turns: int, repeats: int) -> dict:
    bench = CaseBench(BenchCase(HEADS_9B, batch, 64, torch.bfloat16, 8, label="qwen3.5-9b", kind="random"), "cuda")
    # the Gluon launches as the database gives them; the Triton resident kernel with its own tuned tiles (the
    # buckets' entries before the Gluon configs joined the search space)
    launches = {"gluon": (bench.launch(), bench.launch(ring=True)),
                "triton": (bench.launch(TRITON_TUNED, tuned_on="resident", gluon=False),
                           bench.launch(TRITON_TUNED, tuned_on="resident", ring=True, gluon=False))}
    if not launches["gluon"][0].gluon or not launches["gluon"][1].gluon:
        raise SystemExit(f"the planner did not send B={batch} to the Gluon verify: {launches['gluon']}")
    out = {"batch": batch, "launches": {k: [str(x) for x in v] for k, v in launches.items()}, "errors": {},
           "us": {}}
    for name, (read, write) in launches.items():
        errors = {"verify": bench.check(tree_verify, read)}
        for rounds in (3, 2):
            o, s = bench.ring_errors(read, write, rounds=rounds)
            errors[f"ring {rounds}"] = (o, s)
            if max(o, s) > 5e-3:
                raise SystemExit(f"{name} ring of {rounds} is wrong at B={batch}: outputs {o:.1e}, slots {s:.1e}")
        out["errors"][name] = errors
        print(f"B={batch} {name}: errors {errors}", flush=True)
    commit = bench.time_commit_layers(LAYERS, repeats).p50_us
    out["us"]["all-layer commit share"] = [commit]
    for turn in range(turns):
        order = list(launches.items()) if turn % 2 == 0 else list(launches.items())[::-1]
        for name, (read, write) in order:
            row = out["us"].setdefault(name, {})
            v = bench.time_verify(tree_verify, read, repeats=repeats)[0].p50_us
            row.setdefault("verify", []).append(v)
            row.setdefault("verify + all-layer commit", []).append(v + commit)
            for rounds in (3, 2):
                t = bench.time_ring(rounds, LAYERS, repeats, read_launch=read, write_launch=write)
                row.setdefault(f"ring {rounds}", []).append(t["round_ring"].p50_us)
                row.setdefault(f"ring {rounds} read", []).append(t["ring_read"].p50_us)
                row.setdefault(f"ring {rounds} write", []).append(t["ring_write"].p50_us)
            print(f"B={batch} turn {turn} {name}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in row.items()), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, action="append")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no GPU here: run on the H200")
    outs = [run(b, args.turns, args.repeats) for b in (args.batch or [16])]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(outs, f, indent=1)
    for o in outs:
        print(f"\n| B={o['batch']} T=64, us (min over turns) | Gluon | Triton | ratio |")
        print("|---|---|---|---|")
        for key in o["us"]["gluon"]:
            g, t = min(o["us"]["gluon"][key]), min(o["us"]["triton"][key])
            print(f"| {key} | {g:.1f} | {t:.1f} | {g / t:.3f} |")
        print(f"(all-layer commit share {o['us']['all-layer commit share'][0]:.1f} us)")


if __name__ == "__main__":
    main()
