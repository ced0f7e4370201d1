"""Issue 17: the folded round (commit of the previous round inside this round's verify) with the fold's product in
fp32 FMAs ("ieee") or three tf32 tensor-core passes ("tf32x3"), against verify alone and verify + tree_commit,
side by side in one process, 9B heads, bf16, CUDA graphs over rotating sets (bole_tune.timing.time_launches).
Also the fold's accuracy against the closed-form commit of the same factors.

    python3 lab/fold_precision.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json

import torch

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.kernels import PendingCommit, PendingPaths, tree_commit, tree_verify
from bole_tune.kernels.reference import commit_closed_form
from bole_tune.kernels.verify import run as run_module
from bole_tune.shapes import HeadShape
from bole_tune.timing import time_launches
from bole_tune.workloads import relative_error

CASES = [(16, 4, "chain"), (16, 64, "random"), (32, 8, "chain"), (1, 4, "chain")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    heads = HeadShape(hk=16, hv=32, dk=128, dv=128)
    rows = []
    for batch, size, kind in CASES:
        case = BenchCase(heads, batch, size, torch.bfloat16, 8, label="qwen3.5-9b", kind=kind)
        bench = CaseBench(case, "cuda")
        tree, pool, inputs, slots = bench.sets(64)
        launch, accepted = bench.launch(), bench.deepest(tree)
        prev = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=launch) for i, x in enumerate(inputs)]
        outs = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=launch) for i, x in enumerate(inputs)]
        pending = [PendingCommit(PendingPaths.between_rounds(tree, accepted, slots[i], slots[i], pool.shape[0]), prev[i])
                   for i in range(len(inputs))]
        n = len(inputs)

        def verify(i):
            x = inputs[i]
            tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=launch, out=outs[i])

        def verify_commit(i):
            verify(i)
            tree_commit(pool, slots[i], outs[i], accepted)

        def folded(i):
            x = inputs[i]
            prev[i].committed.zero_()
            tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=launch, out=outs[i], pending=pending[i])

        row = {"batch": batch, "tree_size": size, "kind": kind, "variant": launch.variant, "sets": n}
        row["verify"] = time_launches(verify, n, "cuda", repeats=args.repeats).p50_us
        row["verify_commit"] = time_launches(verify_commit, n, "cuda", repeats=args.repeats).p50_us
        row["memset"] = time_launches(lambda i: prev[i].committed.zero_(), n, "cuda", repeats=args.repeats).p50_us
        for precision in ("ieee", "tf32x3"):
            run_module.FOLD_DOT_PRECISION = precision
            row[f"folded_{precision}"] = time_launches(folded, n, "cuda", repeats=args.repeats).p50_us
            # accuracy: the fold's committed state against the closed form of the same factors
            x = inputs[0]
            prev[0].committed.zero_()
            expected = pool.clone()
            commit_closed_form(expected, slots[0], prev[0], accepted, validate=False)
            prev[0].committed.zero_()
            tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[0], tree, launch=launch, out=outs[0], pending=pending[0])
            s = slots[0].long()
            row[f"fold_error_{precision}"] = relative_error(pool[s], expected[s])
        run_module.FOLD_DOT_PRECISION = "tf32x3"
        if launch.variant == "resident":  # more programs per head: value splits
            for split in (2, 4, 8):
                if split * launch.config.b_v > heads.dv:
                    continue
                other = launch.replace(v_split=split)

                def folded_split(i, other=other):
                    x = inputs[i]
                    prev[i].committed.zero_()
                    tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=other, out=outs[i],
                                pending=pending[i])

                def verify_split(i, other=other):
                    x = inputs[i]
                    tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=other, out=outs[i])

                row[f"verify_split{split}"] = time_launches(verify_split, n, "cuda", repeats=args.repeats).p50_us
                row[f"folded_split{split}"] = time_launches(folded_split, n, "cuda", repeats=args.repeats).p50_us
                print(f"    v_split {split} (was {launch.v_split}, {launch.config}): verify {row[f'verify_split{split}']:6.1f} "
                      f"folded {row[f'folded_split{split}']:6.1f}", flush=True)
        if False:
            other = bench.launch(variant="fused")

            def folded_fused(i):
                x = inputs[i]
                prev[i].committed.zero_()
                tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=other, out=outs[i],
                            pending=pending[i])

            def verify_fused(i):
                x = inputs[i]
                tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=other, out=outs[i])

            row["fused_config"] = str(other.config)
            row["verify_fused"] = time_launches(verify_fused, n, "cuda", repeats=args.repeats).p50_us
            row["folded_fused_tf32x3"] = time_launches(folded_fused, n, "cuda", repeats=args.repeats).p50_us
            print(f"    fused {other.config}: verify {row['verify_fused']:6.1f} folded {row['folded_fused_tf32x3']:6.1f}")
        run_module.FOLD_DOT_PRECISION = "ieee"
        rows.append(row)
        print(f"B={batch:>2} T={size:>3} {kind:6s} {launch.variant:8s} verify {row['verify']:6.1f}  +commit "
              f"{row['verify_commit']:6.1f}  folded ieee {row['folded_ieee']:6.1f} tf32x3 {row['folded_tf32x3']:6.1f} "
              f"(memset {row['memset']:4.1f})  err ieee {row['fold_error_ieee']:.1e} tf32x3 {row['fold_error_tf32x3']:.1e}",
              flush=True)
        del bench, tree, pool, inputs, prev, outs, pending
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
