"""Issue 17, eleventh session: the path update's product on tensor cores with exact pieces (`blocks.path_product`),
in the commit launches and in the verify's fold, against the fp32 FMAs ("ieee") and Triton's "tf32x3".

"split3" cuts the weighted values into three tf32 pieces that sum to them exactly (the bf16 keys are tf32 values
already), so the three tensor-core passes' products are exact and only the fp32 accumulation rounds; "split2" rounds
the second piece. Both accumulate into the state tile itself (the tile held in the product's layout), which needs
far fewer registers than the FMA product (`python3 lab/sass_stats.py`-style counts, BENCHMARKS.md).

Part 1, the commit (`tree_commit_layers` over 24 layers and `tree_commit` of one layer, `CommitBench`: each config
checked against the closed form, then timed; one CUDA graph, median per launch, per layer), beside `mul_(1.0)` over
a contiguous buffer of the same bytes (the copy floor of the issue's <= 1.25x target).
Part 2, the fold (`run.FOLD_DOT_PRECISION`): the folded verify and the ring's rounds (`lab_rows.check_and_time`:
float64 reference first), 9B heads, bf16.

    python3 lab/exact_split.py [--json OUT] [--part commit|fold|both] [--repeats 20]
    TRITON_INTERPRET=1 python3 lab/exact_split.py --smoke

Part 2 needs the fold's precision in the verify's launch key, which only commit f585fd1 has (the split products
lost in the fold and main's `run.py` went back): on main a swapped precision would reuse the first binary, so the
fold part refuses to run there; check out f585fd1 for it (`git worktree add /tmp/f f585fd1`).
"""

from __future__ import annotations

import argparse

import torch

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.commit_bench import CommitBench
from bole_tune.config import CommitConfig as C
from bole_tune.database import CommitKey
from bole_tune.kernels.verify import run as run_module
from bole_tune.kernels.verify import tree_commit as tc
from bole_tune.lookup import tuned_commit
from bole_tune.shapes import HeadShape
from bole_tune.timing import time_launches
from lab_rows import check_and_time, release, save, show

COMMIT_CASES = [(16, 24), (32, 24), (1, 24), (16, 1), (32, 1)]  # (batch, layers)
CONFIGS = [C(128, 16, 128, 2, 3), C(128, 16, 128, 2, 2), C(128, 32, 128, 4, 2), C(128, 32, 128, 4, 3),
           C(128, 16, 64, 2, 2), C(128, 16, 128, 4, 3), C(64, 16, 128, 2, 3), C(128, 32, 64, 4, 2)]
PRODUCTS = ["ieee", "split3", "split2"]
FOLD_CASES = [(1, 4, "chain"), (16, 4, "chain"), (32, 8, "chain"), (16, 8, "random"), (16, 64, "random")]
FOLD_PRODUCTS = ["tf32x3", "split3", "split2"]


def commit_part(heads, device, repeats, rows, smoke):
    shipped = tc.COMMIT_PRODUCT
    for batch, layers in [(2, 2)] if smoke else COMMIT_CASES:
        key = CommitKey.bucketed(heads, "bf16", 8, batch, layers=layers)
        bench = CommitBench(key, device, most_sets=2 if smoke else None)
        tuned = tuned_commit(heads.hk, heads.hv, heads.dk, heads.dv, torch.bfloat16, 8, batch, layers,
                             torch.device(device)) if not smoke else None
        configs = [C(32, 16, 32, 2, 1)] if smoke else [c for c in dict.fromkeys([tuned] + CONFIGS) if c is not None]
        if smoke or batch == 1 or layers == 1:
            configs = configs[:4]
        base = {"part": "commit", "batch": batch, "layers": layers}
        for product in PRODUCTS:
            tc.COMMIT_PRODUCT = product
            for config in configs:
                row = dict(base, product=product, config=config.text, tuned=config == tuned)
                try:
                    row["error"] = bench.check(config)
                    if not smoke:
                        row["us_per_layer"] = bench.time(config, repeats).p50_us / layers
                except Exception as e:  # noqa: BLE001 - a sweep records what failed and goes on
                    row["failed"] = f"{type(e).__name__}: {str(e)[:160]}"
                show(row, rows)
        tc.COMMIT_PRODUCT = shipped
        if not smoke:
            tree, states, results, slots, accepted = bench.sets()
            if layers > 1:
                flat = torch.empty(states[:, :batch].numel(), dtype=torch.float32, device=device)
                bufs = [flat, torch.empty_like(flat)]
            else:  # one layer: each set's slots, rotating past the L2 cache, in place
                bufs = [states[0, s * batch:(s + 1) * batch] for s in range(len(results))]
            floor = time_launches(lambda i: bufs[i].mul_(1.0), len(bufs), device, repeats).p50_us / layers
            show(dict(base, product="floor: mul_(1.0) in place", us_per_layer=floor), rows)
            bufs = flat = states = results = None
        bench = None
        release(device)


def fold_part(heads, device, repeats, rows, smoke):
    import inspect

    if "path_precision" not in inspect.getsource(run_module):
        raise SystemExit("lab/exact_split.py --part fold: this run.py does not key its launches on the fold's "
                         "precision; run it at commit f585fd1")
    shipped = run_module.FOLD_DOT_PRECISION
    for batch, size, kind in [(2, 8, "chain")] if smoke else FOLD_CASES:
        bench = CaseBench(BenchCase(heads, batch, size, torch.bfloat16, 8, label="qwen3.5-9b", kind=kind), device)
        launch, flaunch = bench.launch(), bench.launch(fold=True)
        for product in FOLD_PRODUCTS:
            run_module.FOLD_DOT_PRECISION = product
            row = {"part": "fold", "batch": batch, "tree_size": size, "kind": kind, "product": product,
                   "launch": f"{flaunch.variant} {flaunch.config.text}"}
            check_and_time(row, bench, run_module.RESIDENT, launch, flaunch, repeats, 4, not smoke)
            show(row, rows)
        run_module.FOLD_DOT_PRECISION = shipped
        bench = None
        release(device)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--part", default="both", choices=("commit", "fold", "both"))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    heads = HeadShape(hk=2, hv=4, dk=32, dv=32) if args.smoke else HeadShape(hk=16, hv=32, dk=128, dv=128)
    device = "cpu" if args.smoke else "cuda"
    rows = []
    if args.part in ("commit", "both"):
        commit_part(heads, device, args.repeats, rows, args.smoke)
    if args.part in ("fold", "both"):
        fold_part(heads, device, args.repeats, rows, args.smoke)
    save(args.json, rows)


if __name__ == "__main__":
    main()
