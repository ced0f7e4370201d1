"""Issue 17: the stream verify's state products with the state tile as the left operand (``ROWS_FIRST``).

The resident kernel's state-first order ("stream") takes ``Q S^T`` as ``[B_T, b_k] x [b_k, b_v]``: 16 rows of
nodes (a tree of 4 padded to 16) against the state tile transposed. Its transpose, ``S Q^T`` as ``[b_v, b_k] x
[b_k, B_T]``, puts the 128 value rows of the tile where the tensor cores want many rows and uses the tile as it
was loaded; the readout then works on ``[b_v, B_T]`` tiles (``U^T = R'^T W^T``, ``O^T = a_q Q S^T + R'^T M^T``).
This script times both orders (`run.ROWS_FIRST` set for the verify and the folded verify alike), verify and folded
round, at each bucket's tuned tiles and, for the swept cases, both orders at the same eight other tiles; one CUDA
graph over rotating input sets, after checking each launch against the float64 reference (outputs, and the folded
launch's committed slots).

    python3 lab/rows_first.py [--json OUT] [--repeats 30] [--no-sweep]
"""

from __future__ import annotations


from bole_tune.config import KernelConfig
from bole_tune.kernels.verify import run as run_module
from bole_tune.shapes import HeadShape
from round_timing import HEADS_9B, RoundSets, best_rows, lab_parser, show, swapped, write_json

CASES = [(16, 4, "chain", True), (32, 8, "chain", True), (16, 8, "random", False), (16, 16, "random", False),
         (32, 4, "chain", False)]
SWEEP = [KernelConfig(32, b_v, w, s) for b_v in (128, 64) for w in (2, 4) for s in (2, 3)]
ORDERS = {"shipped order": False, "rows first": True}

def main() -> None:
    parser = lab_parser()
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    heads, device, cases, sweep = HEADS_9B, "cuda", CASES, SWEEP
    if args.smoke:
        heads, device, cases, sweep = HeadShape(hk=2, hv=4, dk=32, dv=32), "cpu", [(2, 4, "chain", True)], \
            [KernelConfig(16, 32, 4, 1)]
    kernels = ORDERS
    rows = []
    for batch, size, kind, sweeping in cases:
        sets = RoundSets(heads, batch, size, kind, device)
        tuned, tuned_fold = sets.tuned, sets.tuned_fold
        print(f"B={batch} T={size} {kind}: tuned {tuned.variant} {tuned.config}, fold {tuned_fold.variant} "
              f"{tuned_fold.config}", flush=True)
        row = {"batch": batch, "tree_size": size, "kind": kind, "tuned": str(tuned.config),
               "tuned_fold": str(tuned_fold.config), "runs": []}
        launches = [tuned.replace(variant="stream", v_split=heads.dv // tuned.config.b_v)]
        if tuned_fold.config != tuned.config:
            launches.append(tuned_fold.replace(variant="stream", v_split=heads.dv // tuned_fold.config.b_v))
        if sweeping and not args.no_sweep:
            launches += [sets.bench.launch(config=c, variant="stream") for c in sweep if c.fits(heads.dk, heads.dv)]
        for launch in launches:
            for name, rows_first in kernels.items():
                with swapped(run_module, "ROWS_FIRST", {"verify": rows_first, "fold": rows_first}):
                    entry = {"config": str(launch.config), "kernel": name,
                             **sets.measure(launch, args.repeats, timed=not args.smoke)}
                print("   ", show(entry), flush=True)
                row["runs"].append(entry)
        rows.append(row)
        sets.release()
    best_rows(rows, kernels)
    write_json(rows, args.json)
    nan = float("nan")
    print("\n| 9B, us | verify: shipped / rows first (tuned tiles) | best verify: shipped / rows first | "
          "best folded: shipped / rows first |")
    print("|---|---|---|---|")
    for row in rows:
        first = [next((r.get("verify", nan) for r in row["runs"] if r["kernel"] == name), nan) for name in kernels]
        bv = [row.get(f"best_verify {name}", {}) for name in kernels]
        bf = [row.get(f"best_folded {name}", {}) for name in kernels]
        print(f"| B={row['batch']} T={row['tree_size']} {row['kind']} | {first[0]:.1f} / {first[1]:.1f} | "
              + " / ".join(f"{b.get('verify', nan):.1f} ({b.get('config', '')})" for b in bv) + " | "
              + " / ".join(f"{b.get('folded', nan):.1f} ({b.get('config', '')})" for b in bf) + " |")


if __name__ == "__main__":
    main()
