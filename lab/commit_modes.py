"""Issue 17, eleventh session: the commit kernel's two switches side by side, then the commit tuned with the fastest.

`tree_commit.COMMIT_PRODUCT` ("split3": three exact tf32 passes; "split2": two, the remainder rounded) and
`tree_commit.COMMIT_PREFETCH` (each state tile's successor requested before the tile is updated), over a few tile
configs, at B=16 and B=32 for the all-layer launch (24 layers) and one layer at B=16 (`CommitBench`: every config
checked against the closed form before it is timed; one CUDA graph, median per launch, per layer), beside
`mul_(1.0)` over a contiguous buffer of the same bytes. The mode with the lowest geometric mean of its best configs
over the all-layer cases is written to ``--mode-out``; ``--tune DB_DIR`` then runs ``bole-tune tune --commit
--quick --model qwen3.5-9b`` in this process with that mode set.

    python3 lab/commit_modes.py [--json OUT] [--mode-out MODE.json] [--tune DB_DIR --storage URL]
    TRITON_INTERPRET=1 python3 lab/commit_modes.py --smoke

`COMMIT_PREFETCH` exists at commit 61b417d only (it lost, and main's kernel dropped it): run this script from a
checkout of that commit (`git worktree add /tmp/c 61b417d`).
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from bole_tune.commit_bench import CommitBench
from bole_tune.config import CommitConfig as C
from bole_tune.database import CommitKey
from bole_tune.kernels.verify import tree_commit as tc
from bole_tune.shapes import HeadShape
from bole_tune.timing import time_launches
from lab_rows import release, save, show

MODES = [("split3", False), ("split3", True), ("split2", False), ("split2", True)]
CASES = [(16, 24), (32, 24), (16, 1)]
CONFIGS = [C(128, 16, 128, 2, 3), C(128, 16, 128, 2, 2), C(64, 16, 128, 2, 3), C(128, 32, 128, 4, 2),
           C(128, 16, 64, 2, 3), C(64, 16, 64, 2, 2)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--mode-out")
    parser.add_argument("--tune")
    parser.add_argument("--storage")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if not hasattr(tc, "COMMIT_PREFETCH"):
        raise SystemExit("lab/commit_modes.py: this kernel has no COMMIT_PREFETCH switch; run it at commit 61b417d")
    heads = HeadShape(hk=2, hv=4, dk=32, dv=32) if args.smoke else HeadShape(hk=16, hv=32, dk=128, dv=128)
    device = "cpu" if args.smoke else "cuda"
    rows, best = [], {}
    for batch, layers in [(2, 2)] if args.smoke else CASES:
        bench = CommitBench(CommitKey.bucketed(heads, "bf16", 8, batch, layers=layers), device,
                            most_sets=2 if args.smoke else None)
        for product, prefetch in MODES:
            tc.COMMIT_PRODUCT, tc.COMMIT_PREFETCH = product, prefetch
            for config in [C(32, 16, 32, 2, 1), C(16, 16, 32, 1, 2)] if args.smoke else CONFIGS:
                row = {"batch": batch, "layers": layers, "product": product, "prefetch": prefetch,
                       "config": config.text}
                try:
                    row["error"] = bench.check(config)
                    if not args.smoke:
                        row["us_per_layer"] = bench.time(config, args.repeats).p50_us / layers
                        if layers > 1:
                            key = (product, prefetch)
                            best.setdefault(key, {})
                            best[key][batch] = min(best[key].get(batch, math.inf), row["us_per_layer"])
                except Exception as e:  # noqa: BLE001 - a sweep records what failed and goes on
                    row["failed"] = f"{type(e).__name__}: {str(e)[:160]}"
                show(row, rows)
        if not args.smoke:
            _, states, _, _, _ = bench.sets()
            flat = torch.empty(states[:, :batch].numel(), dtype=torch.float32, device=device)
            bufs = [flat, torch.empty_like(flat)]
            floor = time_launches(lambda i: bufs[i].mul_(1.0), 2, device, args.repeats).p50_us / layers
            show({"batch": batch, "layers": layers, "floor mul_ contiguous": floor}, rows)
            bufs = flat = states = None
        bench = None
        release(device)
    tc.COMMIT_PRODUCT, tc.COMMIT_PREFETCH = "split3", False
    if best:
        score = {k: math.exp(sum(map(math.log, v.values())) / len(v)) for k, v in best.items()}
        product, prefetch = min(score, key=score.get)
        show({"chosen": f"{product} prefetch={prefetch}",
              "scores": "; ".join(f"{p}/{f}: {s:.2f}" for (p, f), s in score.items())}, rows)
        if args.mode_out:
            with open(args.mode_out, "w") as f:
                json.dump({"product": product, "prefetch": prefetch, "scores": {f"{p}/{f}": s for (p, f), s in
                                                                                score.items()}}, f)
        tc.COMMIT_PRODUCT, tc.COMMIT_PREFETCH = product, prefetch
    save(args.json, rows)
    if args.tune:
        from bole_tune.cli import main as cli_main

        print(f"tuning the commit with COMMIT_PRODUCT={tc.COMMIT_PRODUCT} COMMIT_PREFETCH={tc.COMMIT_PREFETCH}",
              flush=True)
        cli_main(["tune", "--commit", "--quick", "--model", "qwen3.5-9b", "--db-dir", args.tune,
                  *(["--storage", args.storage] if args.storage else [])])


if __name__ == "__main__":
    main()
