"""Issue 17: one B=16 launch of the stream verify and one of its folded round, for Nsight Compute.

Three resident-kernel launches come first (the previous round, and a warm-up of each); the fourth is the verify at
the bucket's tuned tiles and the fifth the folded round at its own. Run as

    ncu --clock-control none -k regex:tree_verify_resident --launch-skip 3 --launch-count 2 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section SchedulerStats --section MemoryWorkloadAnalysis python3 lab/ncu_stream.py [--batch 16 --size 4]
"""

from __future__ import annotations

import argparse

import torch

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.kernels import PendingCommit, PendingPaths, tree_verify
from round_timing import HEADS_9B


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=4)
    args = parser.parse_args()
    bench = CaseBench(BenchCase(HEADS_9B, args.batch, args.size, torch.bfloat16, 8, label="qwen3.5-9b", kind="chain"),
                      "cuda")
    tree, pool, inputs, slots = bench.sets(2)
    x, s = inputs[0], slots[0]
    verify, folded = bench.launch(), bench.launch(fold=True)
    print("verify:", verify.variant, verify.config, "folded:", folded.variant, folded.config, flush=True)
    prev = tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, s, tree, launch=verify)  # launch 1
    paths = PendingPaths.between_rounds(tree, bench.deepest(tree), s, s, pool.shape[0])
    out = tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, s, tree, launch=verify)  # launch 2
    prev.committed.zero_()
    tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, s, tree, launch=folded, out=out,
                pending=PendingCommit(paths, prev))  # launch 3
    torch.cuda.synchronize()
    tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, s, tree, launch=verify, out=out)  # launch 4: profiled
    prev.committed.zero_()
    tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, s, tree, launch=folded, out=out,
                pending=PendingCommit(paths, prev))  # launch 5: profiled
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
