"""Issue 17, the ring of pending rounds: what a verify costs that applies pending paths to its products as
corrections instead of writing them into the state. 9B heads, bf16, CUDA graphs, one run.

With pending tokens j (keys k_j, updates u_j, weights w_j = exp(L - L_j) and total decay P = exp(L)) the state a
round must read is S' = P S + sum_j w_j u_j k_j^T (docs/math.md, "A ring of pending rounds"). The verify needs only
S' q_i and S' k_i, which are P (S q_i) + sum_j w_j (k_j . q_i) u_j: a [T, m] x [m, b_v] product per value tile,
against the fold's [b_v, m] x [m, b_k] product on every state tile and its write-back. This script times a copy of
the resident kernel (both orders) whose fold is replaced by those corrections (the state is read, never written),
fed by the previous round's path exactly as the folded launch is (one round pending, m <= 16: the token count of a
ring of four rounds of 4-node chains), beside the plain verify, the folded verify and the all-layer commit; it
first checks the copy's outputs against the shipped folded launch (the same S'). The ring itself (a per-slot
buffer of pending tokens, its append and its write-back every R rounds) is not built; the projected round is the
corrections' verify plus the all-layer commit's share, commit / R.

    python3 lab/ring_corrections.py [--json OUT] [--repeats 30] [--dot tf32x3|tf32|gram] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import textwrap

import torch

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.config import KernelConfig
from bole_tune.kernels import PendingCommit, PendingPaths, tree_verify
from bole_tune.kernels.launcher import FastLauncher
from bole_tune.kernels.verify import run as run_module
from bole_tune.shapes import HeadShape
from bole_tune.timing import time_launches
from patched_kernel import patched_resident_kernel

CASES = [(16, 4, "chain"), (32, 8, "chain"), (16, 64, "random"), (1, 4, "chain")]

# the state-first order: one value tile, the corrections' dot products ride along the key steps
FIRST_INIT = """        if FOLD:
            b_upw = fold_updates(rows_p, m_p, weight_p, o_v, i_h, fold_u_ptr, H_V, D_V)
        for i_k in range(0, D_K, B_K):"""
FIRST_INIT_RING = """        b_qp = tl.zeros([B_T, B_P], dtype=tl.float32)
        b_kp = tl.zeros([B_T, B_P], dtype=tl.float32)
        if FOLD:
            b_upw = fold_updates(rows_p, m_p, weight_p, o_v, i_h, fold_u_ptr, H_V, D_V)
        for i_k in range(0, D_K, B_K):"""
FIRST_FOLD = """            if FOLD:
                b_s = fold_apply(b_s, b_upw, rows_p, m_p, decay_p, o_k, i_hk, fold_k_ptr, H_K, D_K, FOLD_DOT)
                tl.store(p_state + o_v[:, None] * stride_s_v + o_k[None, :], b_s, mask=pending)
            b_qs, b_ks = state_products(b_q, b_k, b_s, b_qs, b_ks, DOT_PRECISION, GRAM_DTYPE, STATE_SPLIT)
        b_w, b_m, a_q, a_k = head_factors("""
FIRST_RING = """            b_qs, b_ks = state_products(b_q, b_k, b_s, b_qs, b_ks, DOT_PRECISION, GRAM_DTYPE, STATE_SPLIT)
            if FOLD:
                b_kpc = tl.load(fold_k_ptr + rows_p[:, None] * (H_K * D_K) + i_hk * D_K + o_k[None, :],
                                mask=m_p[:, None], other=0).to(LOOP_DTYPE)
                b_qp = tl.dot(b_q.to(LOOP_DTYPE), tl.trans(b_kpc), b_qp, input_precision=LOOP_DOT)
                b_kp = tl.dot(b_k.to(LOOP_DTYPE), tl.trans(b_kpc), b_kp, input_precision=LOOP_DOT)
        if FOLD:
            b_qs = decay_p * b_qs + tl.dot(b_qp, tl.trans(b_upw), input_precision=FOLD_DOT)
            b_ks = decay_p * b_ks + tl.dot(b_kp, tl.trans(b_upw), input_precision=FOLD_DOT)
        b_w, b_m, a_q, a_k = head_factors("""
# the factors-first order (value tiles outside, key steps inside): the same lines, one level deeper, ending in the
# value tile's readout
def _deeper(text: str, last: str) -> str:
    return textwrap.indent(text.rsplit("\n", 1)[0], "    ") + "\n" + last


SECOND_INIT, SECOND_INIT_RING = (_deeper(t, "            for i_k in range(0, D_K, B_K):") for t in (FIRST_INIT, FIRST_INIT_RING))
SECOND_FOLD, SECOND_RING = (_deeper(t, "            readout(") for t in (FIRST_FOLD, FIRST_RING))
# the state-first branch also has the S Q^T order (ROWS_FIRST); the copy keeps Q S^T and is run with it
FIRST_FOLD = FIRST_FOLD.replace("""            b_qs, b_ks = state_products(""", """            if ROWS_FIRST:
                b_qs, b_ks = state_products_rows_first(b_q, b_k, b_s, b_qs, b_ks, DOT_PRECISION)
            else:
                b_qs, b_ks = state_products(""")
PATCHES = [(FIRST_INIT, FIRST_INIT_RING), (FIRST_FOLD, FIRST_RING), (SECOND_INIT, SECOND_INIT_RING),
           (SECOND_FOLD, SECOND_RING)]


DOTS = {  # --dot: (operand type of the key steps' products, their precision, the final products' precision)
    "tf32x3": ("tl.float32", '"tf32x3"', '"tf32x3"'),
    "tf32": ("tl.float32", '"tf32"', '"tf32"'),
    "gram": ("GRAM_DTYPE", '"tf32"', '"tf32"'),  # q, k and the pending keys as the Gram products take them (bf16)
}


def ring_kernel(workdir: pathlib.Path, dot: str = "tf32x3"):
    """A copy of the resident kernel whose fold is applied to its products as corrections (no state write), their
    products as `DOTS` names them (the fold's own "tf32x3"; one "tf32" pass, a correction being not kept; or the key
    steps' products on the inputs' 16-bit operands as the Gram products are)."""
    loop_dtype, loop_dot, final_dot = DOTS[dot]
    patches = [(old, new.replace("LOOP_DTYPE", loop_dtype).replace("input_precision=LOOP_DOT", f"input_precision={loop_dot}")
                .replace("input_precision=FOLD_DOT", f"input_precision={final_dot}")) for old, new in PATCHES]
    return patched_resident_kernel(patches, f"ring_{dot}", workdir)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--dot", default="tf32x3", choices=sorted(DOTS),
                        help="the corrections' products (DOTS)")
    parser.add_argument("--sweep", action="store_true",
                        help="also time the corrections at other stream tiles (B >= 16 chains: b_k 32/64, 2/4/8 warps)")
    args = parser.parse_args()
    heads = HeadShape(hk=16, hv=32, dk=128, dv=128)
    ring = FastLauncher(ring_kernel(pathlib.Path(tempfile.mkdtemp()), args.dot))
    shipped = run_module.RESIDENT
    epoch = run_module.commit_epoch
    run_module.commit_epoch = lambda: 7  # one mark for every launch: a pending path stays pending while timed
    orders = dict(run_module.ROWS_FIRST)
    run_module.ROWS_FIRST.update(fold=False)  # the copy's corrections are written for the Q S^T order
    rows = []
    try:
        for batch, size, kind in CASES:
            case = BenchCase(heads, batch, size, torch.bfloat16, 8, label="qwen3.5-9b", kind=kind)
            bench = CaseBench(case, "cuda")
            tree, pool, inputs, slots = bench.sets(64)
            launch, accepted = bench.launch(), bench.deepest(tree)
            prev = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=launch)
                    for i, x in enumerate(inputs)]
            outs = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=launch)
                    for i, x in enumerate(inputs)]
            pending = [PendingCommit(PendingPaths.between_rounds(tree, accepted, slots[i], slots[i], pool.shape[0]),
                                     prev[i]) for i in range(len(inputs))]
            row = {"batch": batch, "tree_size": size, "kind": kind, "variant": launch.variant, "dot": args.dot,
                   "config": str(launch.config)}
            if launch.variant == "fused":
                print(f"B={batch} T={size}: the fused kernel runs this bucket; the copy is of the resident kernel")
                continue
            # the check: the corrections give the folded launch's outputs (the same S'), the pool left as it was
            x = inputs[0]
            before = pool.clone()
            run_module.RESIDENT = ring
            try:
                got = tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[0], tree, launch=launch, out=outs[0],
                                  pending=pending[0]).o.float().clone()
            finally:
                run_module.RESIDENT = shipped
            row["ring_writes_state"] = not torch.equal(before, pool)
            prev[0].committed.zero_()
            want = tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[0], tree, launch=launch, out=outs[0],
                               pending=pending[0]).o.float()
            row["ring_vs_folded_rel_error"] = float((got - want).norm() / want.norm().clamp_min(1e-30))
            pool.copy_(before)

            def timed(fold: bool, kernel):
                def run(i):
                    x = inputs[i]
                    tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=launch, out=outs[i],
                                pending=pending[i] if fold else None)
                run_module.RESIDENT = kernel
                try:
                    return time_launches(run, len(inputs), "cuda", repeats=args.repeats).p50_us
                finally:
                    run_module.RESIDENT = shipped

            row["verify"] = timed(False, shipped)
            row["folded"] = timed(True, shipped)
            row["ring_corrections"] = timed(True, ring)
            pool.copy_(before)
            if args.sweep and batch >= 16 and kind == "chain":
                row["sweep"] = []
                tuned = launch
                for b_k, b_v, warps in [(bk, 128, w) for bk in (32, 64) for w in (2, 4, 8)]:
                    launch = bench.launch(config=KernelConfig(b_k, b_v, warps, 3), variant="stream")
                    try:
                        entry = {"config": str(launch.config), "ring_corrections": timed(True, ring)}
                    except Exception as e:  # noqa: BLE001 - a lab sweep records what failed and goes on
                        entry = {"config": str(launch.config), "status": f"{type(e).__name__}: {str(e)[:160]}"}
                    pool.copy_(before)
                    row["sweep"].append(entry)
                    print("   ", " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in entry.items()), flush=True)
                launch = tuned
                best = min((e for e in row["sweep"] if "ring_corrections" in e), key=lambda e: e["ring_corrections"])
                row["ring_corrections_best"], row["ring_best_config"] = best["ring_corrections"], best["config"]
            rounds = bench.time_rounds(args.layers, args.repeats)
            row["tree_commit_layers"] = rounds["tree_commit_layers"].p50_us
            ring_us = row.get("ring_corrections_best", row["ring_corrections"])
            for r in (4, 8):
                row[f"projected_ring_round_R{r}"] = ring_us + row["tree_commit_layers"] / r
            print(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                           if k != "sweep"), flush=True)
            rows.append(row)
            del bench, tree, pool, inputs, prev, outs, pending
            torch.cuda.empty_cache()
    finally:
        run_module.commit_epoch = epoch
        run_module.ROWS_FIRST.update(orders)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
