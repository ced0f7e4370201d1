"""Issue 17, twelfth session: the ring's read and write rounds at tile configs of their own.

A `PendingRing`'s read round runs the verify's tuned config and its write round the folded verify's; neither was
tuned with the ring's pending tokens in it (up to ``(R - 1) x`` a round's tokens in a read, ``R x`` in a write),
and at B=32 (8-node chains, R = 4) the read costs 48.7 us against the verify's 30.5 and the write 85.8 against the
folded round's 74.2 (`lab/ring_early.py`). Here each round's launch is swept over a few stream-order configs, the
other round kept at the shipped launch (`CaseBench.time_ring`, 24 layers, one CUDA graph, median per launch).

Every launch is checked first: the verify with its config against the float64 reference (`CaseBench.check`), and
five rounds of a ring (R = 4) run with it against the same ring run with the shipped launches (outputs and the
flushed slots); a launch off by more than 5e-3 is reported and not timed.

    python3 lab/ring_configs.py [--json OUT] [--repeats 10]
    TRITON_INTERPRET=1 python3 lab/ring_configs.py --smoke
"""

from __future__ import annotations

import argparse

import torch

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.config import KernelConfig as K
from bole_tune.kernels import PendingRing, tree_verify
from bole_tune.shapes import HeadShape
from lab_rows import release, save, show

CASES = [(32, 8, "chain"), (16, 4, "chain")]
CONFIGS = [K(32, 32, 4, 2), K(32, 64, 4, 3), K(64, 32, 4, 2), K(64, 64, 4, 2), K(32, 128, 8, 3), K(64, 128, 8, 2),
           K(128, 32, 4, 2), K(32, 64, 2, 3)]
RESIDENT_READS = [K(32, 64, 4, 2), K(64, 64, 8, 2)]
"""Read rounds on the factor-first order too (the planner's value split)."""
ROUNDS = 4


def ring_outputs(bench, read, write, steps: int = 5):
    """Outputs of ``steps`` rounds of a ring (read rounds at ``read``, write rounds at ``write``) and the flushed
    slots, on the reference instance."""
    tree, x, _ = bench.reference()
    c = bench.case
    pool = x.state.clone()
    ring = PendingRing(pool.shape[0], ROUNDS, tree.depth + 1, tree.num_nodes, tree.num_requests, pool.device)
    arena = ring.results(c.shape, c.dtype)
    accepted = bench.deepest(tree)
    got = []
    for _ in range(steps):
        step = ring.begin(tree)
        res = tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, x.state_indices, tree, ring=step.layer(arena),
                          launch=write if step.write else read)
        got.append(res.o.float().clone())
        ring.end(step, x.state_indices, accepted)
    ring.flush(x.state_indices, [pool], [arena])
    return got, pool[x.state_indices.long()]


def difference(a, b) -> float:
    outs_a, pool_a = a
    outs_b, pool_b = b
    worst = max(float((p - q).norm() / q.norm()) for p, q in zip(outs_a, outs_b))
    return max(worst, float((pool_a - pool_b).norm() / pool_b.norm()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    heads = HeadShape(hk=2, hv=4, dk=32, dv=32) if args.smoke else HeadShape(hk=16, hv=32, dk=128, dv=128)
    device = "cpu" if args.smoke else "cuda"
    rows = []
    for batch, size, kind in [(2, 8, "chain")] if args.smoke else CASES:
        bench = CaseBench(BenchCase(heads, batch, size, torch.bfloat16, 8, label="qwen3.5-9b", kind=kind), device)
        read0, write0 = bench.launch(), bench.launch(fold=True)
        shipped = ring_outputs(bench, read0, write0)
        base = {"batch": batch, "tree_size": size, "kind": kind}
        show(dict(base, read_launch=str(read0), write_launch=str(write0)), rows)
        configs = [K(16, 16, 2, 1), K(32, 16, 4, 1)] if args.smoke else CONFIGS
        trials = [("shipped", read0, write0)]
        for config in configs:
            trials.append(("read", bench.launch(config=config, variant="stream"), write0))
            trials.append(("write", read0, bench.launch(config=config, variant="stream", fold=True)))
        for config in [] if args.smoke else RESIDENT_READS:
            trials.append(("read", bench.launch(config=config, variant="resident"), write0))
        for which, read, write in trials:
            launch = read if which != "write" else write
            row = dict(base, swept=which, config="/".join(map(str, (launch.config.b_k, launch.config.b_v,
                                                                    launch.config.num_warps,
                                                                    launch.config.num_stages))),
                       variant=launch.variant, v_split=launch.v_split)
            try:
                row["verify_error"] = bench.check(tree_verify, bench.launch(config=launch.config,
                                                                            variant=launch.variant))
                row["ring_vs_shipped"] = difference(ring_outputs(bench, read, write), shipped)
                if row["ring_vs_shipped"] <= 5e-3 and not args.smoke:
                    ring = bench.time_ring(ROUNDS, 24, args.repeats, read_launch=read, write_launch=write)
                    row.update({key: t.p50_us for key, t in ring.items()})
            except Exception as e:  # noqa: BLE001 - a lab sweep records what failed and goes on
                row["failed"] = f"{type(e).__name__}: {str(e)[:200]}"
            show(row, rows)
        bench = None  # its buffers go before the next case's
        release(device)
    save(args.json, rows)


if __name__ == "__main__":
    main()
