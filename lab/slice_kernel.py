"""Issue 17: the slice kernel (kernels/verify/slice.py: one program per [b_v, dk] state slice, loaded first)
against the planner's launch (fused or resident), verify alone and with the commit folded in, side by side in
one process; 9B heads, bf16, CUDA graphs over rotating sets (bole_tune.timing.time_launches). Each slice
config's outputs and folded pool are compared with the planner's launch before it is timed.

    python3 lab/slice_kernel.py [--json OUT] [--quick]
"""

from __future__ import annotations

import argparse
import json

import torch

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.config import KernelConfig
from bole_tune.kernels import PendingCommit, PendingPaths, tree_commit, tree_verify
from bole_tune.shapes import HeadShape
from bole_tune.timing import time_launches
from bole_tune.workloads import relative_error

CASES = [(1, 4, "chain"), (1, 8, "random"), (16, 4, "chain"), (32, 8, "chain"), (16, 64, "random"), (4, 16, "random"),
         (8, 8, "chain")]
SLICE_CONFIGS = [KernelConfig(32, b_v, w, 1) for b_v in (16, 32, 64) for w in (2, 4, 8)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny heads on the CPU interpreter (the script runs)")
    args = parser.parse_args()
    heads = HeadShape(hk=16, hv=32, dk=128, dv=128)
    device = "cuda"
    if args.smoke:
        heads, device, args.repeats = HeadShape(hk=1, hv=2, dk=32, dv=32), "cpu", 3
        global CASES
        CASES = CASES[:1]
    rows = []
    for batch, size, kind in CASES:
        case = BenchCase(heads, batch, size, torch.bfloat16, 8, label="qwen3.5-9b", kind=kind)
        bench = CaseBench(case, device)
        tree, pool, inputs, slots = bench.sets(64)
        launch, accepted = bench.launch(), bench.deepest(tree)
        prev = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=launch) for i, x in enumerate(inputs)]
        outs = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=launch) for i, x in enumerate(inputs)]
        pending = [PendingCommit(PendingPaths.between_rounds(tree, accepted, slots[i], slots[i], pool.shape[0]), prev[i])
                   for i in range(len(inputs))]
        n = len(inputs)

        def timed(run_launch, fold):
            def verify(i):
                x = inputs[i]
                tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=run_launch, out=outs[i])

            def folded(i):
                x = inputs[i]
                prev[i].committed.zero_()
                tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=run_launch, out=outs[i],
                            pending=pending[i])
            return time_launches(folded if fold else verify, n, device, repeats=args.repeats).p50_us

        def outcome(run_launch):
            """(o, folded slots) of set 0 from a fixed pool copy, for comparing launches."""
            x, saved = inputs[0], pool.clone()
            prev[0].committed.zero_()
            res = tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[0], tree, launch=run_launch, out=outs[0],
                              pending=pending[0])
            o, folded_slots = res.o.clone(), pool[slots[0].long()].clone()
            pool.copy_(saved)
            return o, folded_slots

        row = {"batch": batch, "tree_size": size, "kind": kind, "variant": launch.variant,
               "config": str(launch.config), "v_split": launch.v_split}
        row["verify"] = timed(launch, False)
        row["folded"] = timed(launch, True)
        row["memset"] = time_launches(lambda i: prev[i].committed.zero_(), n, device, repeats=args.repeats).p50_us
        row["verify_commit"] = time_launches(
            lambda i: (tree_verify(inputs[i].q, inputs[i].k, inputs[i].v, inputs[i].g, inputs[i].beta, pool, slots[i],
                                   tree, launch=launch, out=outs[i]), tree_commit(pool, slots[i], outs[i], accepted)),
            n, device, repeats=args.repeats).p50_us
        print(f"B={batch:>2} T={size:>3} {kind:6s} {launch.variant:8s} {launch.config} split {launch.v_split}: verify "
              f"{row['verify']:6.1f} folded {row['folded']:6.1f} (memset {row['memset']:4.1f}) verify+commit "
              f"{row['verify_commit']:6.1f}", flush=True)
        row["slice"] = []
        for config in SLICE_CONFIGS[:3] if args.quick else SLICE_CONFIGS:
            if size > 16 and config.num_warps < 4:
                continue
            other = bench.launch(config=config, variant="slice")
            try:
                o_ref, s_ref = outcome(launch)  # timing folds again and again: compare on the pool as it is now
                o, s = outcome(other)
                err_o, err_s = relative_error(o, o_ref), relative_error(s, s_ref)
                entry = {"config": str(config), "err_o": err_o, "err_state": err_s}
                if err_o > 1e-2 or err_s > 1e-5:
                    entry["status"] = "wrong"
                else:
                    entry["verify"] = timed(other, False)
                    entry["folded"] = timed(other, True)
            except Exception as e:  # noqa: BLE001 - a lab sweep records what failed and goes on
                entry = {"config": str(config), "status": f"{type(e).__name__}: {str(e)[:200]}"}
            row["slice"].append(entry)
            print(f"    slice {config}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                                   for k, v in entry.items() if k != "config"), flush=True)
        rows.append(row)
        del bench, tree, pool, inputs, prev, outs, pending
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("\ncase                      planner verify/folded   best slice verify (config)   best slice folded (config)")
    for r in rows:
        ok = [e for e in r["slice"] if "verify" in e]
        bv = min(ok, key=lambda e: e["verify"], default=None)
        bf = min(ok, key=lambda e: e["folded"], default=None)
        print(f"B={r['batch']:>2} T={r['tree_size']:>3} {r['kind']:6s} {r['variant']:8s} {r['verify']:6.1f} / "
              f"{r['folded']:6.1f}   " + (f"{bv['verify']:6.1f} ({bv['config']})   {bf['folded']:6.1f} ({bf['config']})"
                                          if bv else "none"))


if __name__ == "__main__":
    main()
