"""Issue 17, twelfth session: a ring read round's correction products at the verify's precision (tf32 for 16-bit
inputs, `run.CORRECT_DOT_PRECISION = None`) against three tf32 passes (the write round's, as shipped before), and
taken before the state's stream (`run.CORRECT_BEFORE_STREAM`) or after it.

Per case (9B heads, bf16): the ring's outputs over five rounds (R = 4, read and write rounds) and the flushed slots
against the float64 recurrence (`verify_reference`, the truth pool committed round by round), for each precision;
then the ring's rounds timed side by side (`CaseBench.time_ring`, 24 layers, one CUDA graph, median per launch).

    python3 lab/ring_correct_dot.py [--json OUT] [--repeats 10] [--rounds 2,4]
    TRITON_INTERPRET=1 python3 lab/ring_correct_dot.py --smoke
"""

from __future__ import annotations

import argparse

import torch

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.kernels import PendingRing, tree_verify
from bole_tune.kernels.reference import verify_reference
from bole_tune.kernels.verify import run as run_module
from bole_tune.shapes import HeadShape
from lab_rows import release, save, show

CASES = [(32, 8, "chain"), (32, 4, "chain"), (16, 4, "chain"), (16, 8, "random"), (1, 4, "chain")]
VARIANTS = {"tf32x3, after the stream": ("tf32x3", False), "verify's, after the stream": (None, False),
            "verify's, before the stream": (None, True)}
"""(`run.CORRECT_DOT_PRECISION`, `run.CORRECT_BEFORE_STREAM`); the first is the read round as shipped before."""
ROUNDS = 4


def against_float64(bench, read, write, steps: int = 5) -> tuple[float, float]:
    """(worst relative error of a round's outputs, of the flushed slots) against the float64 recurrence."""
    tree, x, _ = bench.reference()
    c = bench.case
    pool, truth = x.state.clone(), x.state.clone()  # truth: committed in float64 each round, kept in fp32
    ring = PendingRing(pool.shape[0], ROUNDS, tree.depth + 1, tree.num_nodes, tree.num_requests, pool.device)
    arena = ring.results(c.shape, c.dtype)
    accepted = bench.deepest(tree)
    worst = 0.0
    for _ in range(steps):
        step = ring.begin(tree)
        res = tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, x.state_indices, tree, ring=step.layer(arena),
                          launch=write if step.write else read)
        ref = verify_reference(x.q, x.k, x.v, x.g, x.beta, truth, x.state_indices, tree)
        worst = max(worst, float((res.o.double() - ref.o).norm() / ref.o.norm()))
        truth = ref.committed(truth, x.state_indices, tree, accepted).float()
        ring.end(step, x.state_indices, accepted)
    ring.flush(x.state_indices, [pool], [arena])
    used = x.state_indices.long()
    return worst, float((pool[used].double() - truth[used]).norm() / truth[used].norm())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rounds", default=str(ROUNDS), help="comma list of ring sizes R to time (default 4)")
    args = parser.parse_args()
    heads = HeadShape(hk=2, hv=4, dk=32, dv=32) if args.smoke else HeadShape(hk=16, hv=32, dk=128, dv=128)
    device = "cpu" if args.smoke else "cuda"
    rows = []
    shipped = run_module.CORRECT_DOT_PRECISION, run_module.CORRECT_BEFORE_STREAM
    for batch, size, kind in [(2, 8, "chain")] if args.smoke else CASES:
        bench = CaseBench(BenchCase(heads, batch, size, torch.bfloat16, 8, label="qwen3.5-9b", kind=kind), device)
        read, write = bench.launch(), bench.launch(fold=True)
        for name, (precision, before) in VARIANTS.items():
            run_module.CORRECT_DOT_PRECISION, run_module.CORRECT_BEFORE_STREAM = precision, before
            row = {"batch": batch, "tree_size": size, "kind": kind, "corrections": name}
            try:
                row["o_error"], row["state_error"] = against_float64(bench, read, write)
                for r in [] if args.smoke else map(int, args.rounds.split(",")):
                    times = bench.time_ring(r, 24, args.repeats, read_launch=read, write_launch=write)
                    row.update({(k if r == ROUNDS else f"{k}_R{r}"): t.p50_us for k, t in times.items()})
            except Exception as e:  # noqa: BLE001 - a lab sweep records what failed and goes on
                row["failed"] = f"{type(e).__name__}: {str(e)[:200]}"
            show(row, rows)
        run_module.CORRECT_DOT_PRECISION, run_module.CORRECT_BEFORE_STREAM = shipped
        bench = None
        release(device)
    save(args.json, rows)


if __name__ == "__main__":
    main()
