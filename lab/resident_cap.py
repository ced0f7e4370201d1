"""Issue 17, B=16 64-node trees: the resident kernel on 8-warp programs with their registers capped at 128.

Every tile of the shipped 4-warp resident launch at 64 nodes compiles to 253-255 registers a thread (`sass_stats.py`;
BENCHMARKS.md, "Seventeenth session"), so two 4-warp programs share an SM: 8 warps, latency-bound (Nsight Compute:
0.29 instructions per scheduler and cycle), and B=16's 512 programs take two waves. Its 8-warp tiles compile to 220-224
registers, one program per SM, which is why the tuner never chose them. Capped at 128 (``maxnreg``), an 8-warp
program spills 104 bytes at 32/32/8/2 and 16/32/8/2 (240 at 32/64/8/2) and two fit an SM: 16 warps per SM, twice
the warps the shipped launch has, the same programs per SM. This script answers whether that is faster.

Each launch is checked first on the bench's reference instance against the float64 recurrence: the outputs, and the
state a commit of every request's deepest node leaves (so the updates ``u`` are checked too); a launch above the
accepted error is reported and not timed. Then the verify alone is timed (one CUDA graph over rotating sets, median).

    python3 lab/resident_cap.py [--json OUT] [--repeats 30] [--smoke] [--fold]

``--fold`` also checks (`CaseBench.fold_errors`) and times (`CaseBench.time_folded`) each candidate as the folded
verify (the previous round's paths committed in the same launch), on the resident kernel.

``--smoke`` runs small heads through the CPU interpreter (the cap is a compile option the interpreter ignores): the
script's path, not its figures.
"""

from __future__ import annotations

import contextlib

import torch

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.config import KernelConfig
from bole_tune.kernels import tree_commit, tree_verify
from bole_tune.kernels.reference import verify_reference
from bole_tune.kernels.verify import run as run_module
from bole_tune.shapes import HeadShape
from bole_tune.kernels.verify.self_check import accepted_error
from bole_tune.workloads import relative_error
from reg_cap import CappedLauncher
from round_timing import HEADS_9B, lab_parser, show, swapped, write_json

CASES = [(16, 64, "random"), (8, 64, "random"), (32, 64, "random")]
# (tile, register cap): registers per thread and spill from `sass_stats.py --maxnreg` (B=16 T=64, sm_90); programs
# per SM from the 64K registers an SM holds
CANDIDATES = [
    (KernelConfig(32, 64, 4, 3), None),  # shipped (B 16, 32): 255, no spill, 2 x 4 warps
    (KernelConfig(32, 32, 8, 2), None),  # 220, 1 x 8 warps
    (KernelConfig(32, 32, 8, 2), 128),   # 128, 104 B spilled, 2 x 8 warps
    (KernelConfig(16, 32, 8, 2), 128),   # 128, 104 B, 2 x 8
    (KernelConfig(32, 16, 8, 2), 128),   # 128, 80 B, 2 x 8
    (KernelConfig(32, 32, 8, 3), 128),   # 128, 176 B, 2 x 8
    (KernelConfig(32, 64, 8, 2), 128),   # 128, 240 B, 2 x 8
    (KernelConfig(32, 32, 8, 2), 80),    # 80, 336 B, 3 x 8
    (KernelConfig(16, 32, 8, 2), 80),    # 80, 368 B, 3 x 8
    (KernelConfig(16, 32, 16, 2), None),  # 128, no spill, 1 x 16 warps
    (KernelConfig(32, 32, 16, 2), 64),   # 64, 304 B, 2 x 16
    (KernelConfig(16, 32, 16, 2), 64),
]


def errors(bench: CaseBench, launch) -> tuple[float, float]:
    """(outputs, committed state) relative errors of ``launch`` on the bench's reference instance against float64."""
    tree, x, _ = bench.reference()
    ref = verify_reference(*x.args(tree), keep_states=True)
    res = tree_verify(*x.args(tree), validate=False, launch=launch)
    accepted = bench.deepest(tree)
    pool = x.state.clone()
    tree_commit(pool, x.state_indices, res, accepted, validate=False)
    want = ref.committed(x.state, x.state_indices, tree, accepted)
    return relative_error(res.o, ref.o), relative_error(pool, want)


def main() -> None:
    parser = lab_parser()
    parser.add_argument("--fold", action="store_true", help="also check and time each candidate as the folded verify")
    parser.add_argument("--batch", type=int, action="append", help="only this batch's case (repeatable)")
    parser.add_argument("--only", type=int, action="append", help="only candidate N of CANDIDATES (repeatable)")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    heads = HeadShape(hk=2, hv=4, dk=32, dv=32) if args.smoke else HEADS_9B
    cases = [(2, 16, "random")] if args.smoke else [c for c in CASES if not args.batch or c[0] in args.batch]
    candidates = ([(KernelConfig(16, 16, 4, 1), None), (KernelConfig(16, 16, 8, 1), 128)] if args.smoke
                  else [c for i, c in enumerate(CANDIDATES) if not args.only or i in args.only])
    repeats = 2 if args.smoke else args.repeats
    bound = accepted_error(torch.bfloat16)
    rows = []
    for batch, size, kind in cases:
        bench = CaseBench(BenchCase(heads, batch, size, torch.bfloat16, 8, label="qwen3.5-9b", kind=kind), device)
        shipped = bench.launch()
        print(f"B={batch} T={size} {kind}: shipped {shipped.variant} {shipped.config}", flush=True)
        row = {"batch": batch, "tree_size": size, "kind": kind, "shipped": str(shipped.config), "runs": []}
        for config, cap in candidates:
            launch = bench.launch(config=config, variant="resident")
            entry = {"config": str(config), "variant": launch.variant, "maxnreg": cap}
            context = swapped(run_module, "RESIDENT", CappedLauncher(cap)) if cap else contextlib.nullcontext()
            try:
                with context:
                    entry["error"], entry["state_error"] = errors(bench, launch)
                    if entry["error"] <= bound and entry["state_error"] <= bound:
                        timing, _ = bench.time_verify(tree_verify, launch, repeats=repeats)
                        entry["verify"] = timing.p50_us
                    else:
                        entry["status"] = "wrong: not timed"
                    if args.fold:
                        folded = bench.launch(config=config, variant="resident", fold=True)
                        entry["fold_error"], entry["fold_state_error"] = bench.fold_errors(folded)
                        if max(entry["fold_error"], entry["fold_state_error"]) <= bound:
                            entry["folded"] = bench.time_folded(folded, repeats=repeats).p50_us
            except Exception as e:  # noqa: BLE001 - a lab sweep records what failed and goes on
                entry["status"] = f"{type(e).__name__}: {str(e)[:300]}"
            print("   ", show(entry), flush=True)
            row["runs"].append(entry)
        rows.append(row)
        del bench
        if device == "cuda":
            torch.cuda.empty_cache()
    write_json(rows, args.json)
    head = " | ".join(f"B={r['batch']} T={r['tree_size']}" for r in rows)
    print("\n| 9B, verify" + (" / folded" if args.fold else "") + f" us | {head} |")
    print("|---|" + "---|" * len(rows))
    for i, run in enumerate(rows[0]["runs"]):
        cells = [str(r["runs"][i].get("verify", r["runs"][i].get("status", "-")))
                 + (f" / {r['runs'][i].get('folded', '-')}" if args.fold else "") for r in rows]
        print(f"| {run['config']} cap {run['maxnreg']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
