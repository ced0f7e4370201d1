"""Issue 17: the Gluon verify's launches as shipped in this tree, each first checked against float64: the verify
alone and a ring of three's rounds (its read rounds, its write round, the round over a cycle with the table update's
share over 24 layers), H200, 9B heads, bf16, random 64-node trees of depth <= 8, CUDA graphs over rotating input
sets (`CaseBench`). One JSON line per batch; `lab/gluon_ab.sh` runs it in two trees, alternating.

    python3 lab/gluon_times.py [--batch 16 --batch 32] [--repeats 30] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.kernels import tree_verify
from bole_tune.shapes import HeadShape

HEADS_9B = HeadShape(hk=16, hv=32, dk=128, dv=128)
LAYERS = 24
TOLERANCE = 5e-3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, action="append")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no GPU here: run on the H200")
    rows = []
    for batch in args.batch or [16, 32]:
        bench = CaseBench(BenchCase(HEADS_9B, batch, 64, torch.bfloat16, 8, label="qwen3.5-9b", kind="random"), "cuda")
        read, write = bench.launch(), bench.launch(ring=True)
        o, s = bench.ring_errors(read, write, rounds=3)
        v = bench.check(tree_verify, read)
        if max(o, s, v) > TOLERANCE:
            sys.exit(f"wrong at B={batch}: verify {v:.1e}, ring outputs {o:.1e}, slots {s:.1e}")
        t = bench.time_ring(3, LAYERS, args.repeats, read_launch=read, write_launch=write)
        row = {"batch": batch, "errors": [v, o, s], "gluon": [read.gluon, write.gluon],
               "verify": bench.time_verify(tree_verify, read, repeats=args.repeats)[0].p50_us,
               **{k: t[k].p50_us for k in ("ring_reads", "ring_read", "ring_write", "round_ring")}}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
