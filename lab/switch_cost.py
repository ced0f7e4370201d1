"""What a verify launch pays when another kernel ran just before it, against the same launch timed after itself.

Every figure in BENCHMARKS.md times a kernel back to back with itself (one CUDA graph over rotating input sets), as
issue 17's convention asks. The twenty-second session found that two different Gluon binaries alternating cost 4-8 us
a launch more at B=16 than each alone (`gluon_resident.py --fold`'s ``alternating``). In an engine a GDN layer's
launch follows other layers' kernels, so this asks, at B=16 with 64-node trees (9B heads, bf16): for each verify
(the shipped `tree_verify`, `serial_verify`, the lab's Gluon verify and its fold), what does
one launch cost when it alternates with

- ``gemm``: a GEMM of an output projection's size at the tree's tokens (``[B * 64, 4096] x [4096, 4096]``, bf16),
- ``other``: a different large verify binary (the shipped `tree_verify` for the others, `serial_verify` for it),

each pair in one graph, every launch on its own input set; the extra is ``pair - alone - other alone``.

    python3 lab/switch_cost.py [--batch 16] [--repeats 20] [--json OUT]     # H200
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.kernels import serial_verify, tree_verify
from gluon_resident import (FOLD_BASE, FOLD_BEST, FOLD_WIDE_CONFIGS, HEADS_9B, RING_CONFIGS, cycle_us, gluon_verify,
                            on_sets, ring_tokens)


def verifies(bench) -> dict:
    """Name -> ``fn(x, pool, slots, tree)`` of each verify this machine runs."""
    shipped = bench.launch()
    out = {"shipped tree_verify": functools.partial(tree_verify, launch=shipped),
           "serial_verify": serial_verify}
    out["Gluon verify"] = functools.partial(gluon_verify, **FOLD_BASE)
    # the Gluon fold of each request's deepest path of a previous round (the pool written in place)
    from bole_tune.kernels.verify.pending import pending_path_rows

    tree, pool, inputs, slots = bench.sets(64)
    x = inputs[-1]
    prev = tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[-1], tree, validate=False)
    rows = pending_path_rows(tree, bench.deepest(tree), torch.arange(tree.num_requests, dtype=torch.int32,
                                                                      device="cuda"))
    out["Gluon fold"] = functools.partial(gluon_verify, fold=(rows, prev), **FOLD_BEST)
    return out


def ring_with_gemm(bench, gemm, gemm_us: float, repeats: int, width: int = 32, r: int = 3) -> dict:
    """The Gluon ring's rounds (``r - 1`` reads then a write, the best read and write options of the twenty-second
    session, every table of ``width`` full) each followed by the GEMM, as in an engine where a layer's projections run
    between its GDN launches: us a round less the GEMM alone, against the rounds timed alone and projected."""
    tokens = ring_tokens(bench.case.batch, HEADS_9B, width, "cuda")
    read = on_sets(bench, functools.partial(gluon_verify, ring=tokens, **RING_CONFIGS[1]))
    write = on_sets(bench, functools.partial(gluon_verify, fold=(tokens.rows, tokens), **FOLD_WIDE_CONFIGS[0]))
    out = {name: cycle_us(bench, [fn], repeats) for name, fn in (("read", read), ("write", write))}
    round_us = cycle_us(bench, [read, gemm] * (r - 1) + [write, gemm], repeats) / r
    out.update(width=width, rounds=r, with_gemm_us=round_us - gemm_us,
               projected_us=((r - 1) * out["read"] + out["write"]) / r)
    print(f"ring width {width} R={r}: read {out['read']:.1f}, write {out['write']:.1f}, projected "
          f"{out['projected_us']:.1f}; each round followed by the GEMM, less the GEMM: {out['with_gemm_us']:.1f} us",
          flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json")
    parser.add_argument("--ring", action="store_true", help="only the Gluon ring's rounds, each followed by the GEMM")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no GPU here: run on the H200")
    bench = CaseBench(BenchCase(HEADS_9B, args.batch, 64, torch.bfloat16, 8, label="qwen3.5-9b", kind="random"),
                      "cuda")
    inputs = bench.sets(64)[2]
    tokens = args.batch * 64
    a = [torch.randn(tokens, 4096, dtype=torch.bfloat16, device="cuda") for _ in inputs]
    w = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    outs = [torch.empty(tokens, 4096, dtype=torch.bfloat16, device="cuda") for _ in inputs]

    def gemm(i):
        torch.matmul(a[i], w, out=outs[i])

    if args.ring:
        gemm_us = cycle_us(bench, [gemm], args.repeats)
        print(f"gemm alone {gemm_us:.1f} us", flush=True)
        ring_with_gemm(bench, gemm, gemm_us, args.repeats)
        return
    fns = verifies(bench)

    launches = {name: on_sets(bench, fn) for name, fn in fns.items()}
    launches["gemm"] = gemm
    alone = {name: cycle_us(bench, [launch], args.repeats) for name, launch in launches.items()}
    print("alone, us: " + ", ".join(f"{k} {v:.1f}" for k, v in alone.items()), flush=True)
    rows = []
    for name, fn in fns.items():
        other = "serial_verify" if name == "shipped tree_verify" else "shipped tree_verify"
        for partner in ("gemm", other):
            pair = cycle_us(bench, [launches[name], launches[partner]], args.repeats, same_set=True)
            extra = pair - alone[name] - alone[partner]
            rows.append(dict(verify=name, partner=partner, pair_us=pair, alone_us=alone[name],
                             partner_alone_us=alone[partner], extra_us=extra))
            print(f"{name} with {partner}: pair {pair:.1f} us, alone {alone[name]:.1f} + {alone[partner]:.1f}, "
                  f"extra {extra:+.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "alone_us": alone, "rows": rows}, f, indent=1)
    print(f"\n| B={args.batch} T=64, us | alone | with a GEMM between: extra | with another verify between: extra |")
    print("|---|---|---|---|")
    for name in fns:
        cells = [f"{r['extra_us']:+.1f}" for r in rows if r["verify"] == name]
        print(f"| {name} | {alone[name]:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
