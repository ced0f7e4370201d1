"""Issue 17: the Gluon verify with a later program's inputs prefetched into L2 (`gluon.L2_AHEAD_PER_SM`), side by
side with none, in one run (H200, 9B heads, bf16, random 64-node trees of depth <= 8).

Each setting is a prefetch distance per multiprocessor for the verify and a ring's read round, and one for the write
round; each is first checked against float64 (the verify on the bench's reference instance, a ring of three rounds
over four: outputs and flushed slots), then timed as every figure in BENCHMARKS.md (one CUDA graph over rotating
input sets, medians), settings in alternating order over ``--turns``: the verify alone, and a ring of three's round
(two read rounds and a write round over three, plus the table update's share over 24 layers) with its read and write
rounds.

    python3 lab/gluon_l2.py [--batch 16 --batch 32] [--ahead 0,2,3,4] [--write-ahead 0,3] [--turns 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.kernels import tree_verify
from bole_tune.kernels.verify import gluon
from bole_tune.shapes import HeadShape

HEADS_9B = HeadShape(hk=16, hv=32, dk=128, dv=128)
LAYERS = 24


def setting(ahead: int, write: int) -> None:
    gluon.L2_AHEAD_PER_SM.update(verify=ahead, read=ahead, write=write)


def run(batch: int, settings: list, turns: int, repeats: int) -> dict:
    bench = CaseBench(BenchCase(HEADS_9B, batch, 64, torch.bfloat16, 8, label="qwen3.5-9b", kind="random"), "cuda")
    read, write = bench.launch(), bench.launch(ring=True)
    if not (read.gluon and write.gluon):
        raise SystemExit(f"the planner did not send B={batch} to the Gluon verify: {read}, {write}")
    out = {"batch": batch, "launches": [str(read), str(write)], "errors": {}, "us": {}}
    for ahead, wahead in settings:
        setting(ahead, wahead)
        name = f"ahead {ahead}/SM, write {wahead}/SM"
        o, s = bench.ring_errors(read, write, rounds=3)
        v = bench.check(tree_verify, read)
        out["errors"][name] = {"verify": v, "ring 3": (o, s)}
        if max(o, s, v) > 5e-3:
            raise SystemExit(f"{name} is wrong at B={batch}: verify {v:.1e}, ring outputs {o:.1e}, slots {s:.1e}")
        print(f"B={batch} {name}: errors verify {v:.1e}, ring {o:.1e} / {s:.1e}", flush=True)
    for turn in range(turns):
        for ahead, wahead in (settings if turn % 2 == 0 else settings[::-1]):
            setting(ahead, wahead)
            name = f"ahead {ahead}/SM, write {wahead}/SM"
            row = out["us"].setdefault(name, {})
            row.setdefault("verify", []).append(bench.time_verify(tree_verify, read, repeats=repeats)[0].p50_us)
            t = bench.time_ring(3, LAYERS, repeats, read_launch=read, write_launch=write)
            for key, label in (("round_ring", "ring 3"), ("ring_read", "read"), ("ring_write", "write")):
                row.setdefault(label, []).append(t[key].p50_us)
            print(f"B={batch} turn {turn} {name}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in row.items()), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, action="append")
    parser.add_argument("--ahead", default="0,2,3,4", help="prefetch distances per SM for the verify and read round")
    parser.add_argument("--write-ahead", default="0,3", help="the write round's, each with the best of --ahead's")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no GPU here: run on the H200")
    aheads = [int(x) for x in args.ahead.split(",")]
    writes = [int(x) for x in args.write_ahead.split(",")]
    top = max(aheads)
    settings = [(a, 0) for a in aheads] + [(top, w) for w in writes if w != 0]
    shipped = dict(gluon.L2_AHEAD_PER_SM)
    try:
        outs = [run(b, settings, args.turns, args.repeats) for b in (args.batch or [16, 32])]
    finally:
        gluon.L2_AHEAD_PER_SM.update(shipped)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(outs, f, indent=1)
    for o in outs:
        print(f"\n| B={o['batch']} T=64, us (median over turns) | verify | read | write | ring of 3 |")
        print("|---|---|---|---|---|")
        for name, row in o["us"].items():
            med = {k: sorted(v)[len(v) // 2] for k, v in row.items()}
            print(f"| {name} | {med['verify']:.1f} | {med['read']:.1f} | {med['write']:.1f} | {med['ring 3']:.1f} |")


if __name__ == "__main__":
    main()
