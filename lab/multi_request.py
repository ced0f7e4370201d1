"""Issue 17: the stream verify with several requests per program, one flattened key loop across them, so that
Triton's software pipeline requests the next request's state tiles while this one's factors are solved.

At B=16 the shipped stream verify (one program per head and request, `b_v = 128`) is one wave of 512 small
programs that all stream their state, then all solve their factors with nothing in flight, then all read out:
16 us against an 8 us read floor (BENCHMARKS.md, "Fifth session"). Here a program owns one value head of ``R``
requests and walks ``R * dk / b_k`` key steps in one loop; the factor solve and the readout of a request run in a
branch at its last key step, and the pipeliner keeps the next steps' loads (the next request's state tiles
included) in flight across it. Verify only (no fold), the kernel's blocks are the shipped kernel's.
Each launch is checked against the float64 reference before it is timed.

    python3 lab/multi_request.py [--json OUT] [--repeats 30] [--smoke]
"""

from __future__ import annotations

import json

import torch
import triton
import triton.language as tl

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.kernels import tree_verify
from bole_tune.kernels.common import dot_precision, gram_dtype
from bole_tune.kernels.verify.blocks import floored, qk_chunk_gram, state_products
from bole_tune.kernels.verify.resident import head_factors, readout
from bole_tune.shapes import HeadShape
from bole_tune.timing import time_launches
from bole_tune.workloads import relative_error
from round_timing import HEADS_9B, lab_parser


@triton.jit
def fresh_sums(B_T: tl.constexpr, D_V: tl.constexpr):
    """A request's sums, zero: the Gram products, the squared norms, the state products."""
    return (tl.zeros([B_T, B_T], dtype=tl.float32), tl.zeros([B_T, B_T], dtype=tl.float32),
            tl.zeros([B_T], dtype=tl.float32), tl.zeros([B_T], dtype=tl.float32),
            tl.zeros([B_T, D_V], dtype=tl.float32), tl.zeros([B_T, D_V], dtype=tl.float32))


@triton.jit(do_not_specialize=["H_V", "H_K", "B"])
def stream_multi_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, state_indices_ptr,
    offsets_ptr, dfs_enter_ptr, dfs_exit_ptr, block_depth_ptr,
    o_ptr, u_ptr, logp_ptr, k_out_ptr, k_scale_ptr, committed_ptr,
    scale, H_V, H_K, B,
    stride_q_n, stride_q_h, stride_k_n, stride_k_h, stride_v_n, stride_v_h,
    stride_g_n, stride_g_h, stride_beta_n, stride_beta_h,
    stride_s_slot, stride_s_h, stride_s_v,
    D_K: tl.constexpr, D_V: tl.constexpr, B_T: tl.constexpr, B_K: tl.constexpr, R: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr, GRAM_DTYPE: tl.constexpr, SWEEP_F16: tl.constexpr,
):
    # program (value head, group of R requests); one flattened loop over (request of the group, key step)
    i_h = tl.program_id(0).to(tl.int64)
    i_g = tl.program_id(1).to(tl.int64)
    i_hk = i_h // (H_V // H_K)
    write_keys = i_h % (H_V // H_K) == 0
    NK: tl.constexpr = D_K // B_K
    o_i = tl.arange(0, B_T)
    o_v = tl.arange(0, D_V)
    b_qk, b_kk, ssq_q, ssq_k, b_qs, b_ks = fresh_sums(B_T, D_V)
    for it in range(0, R * NK):
        i_r = tl.minimum(i_g * R + it // NK, B - 1)  # a group past the batch redoes the last request (same values)
        i_k = (it % NK) * B_K
        bos = tl.load(offsets_ptr + i_r).to(tl.int64)
        num_nodes = tl.load(offsets_ptr + i_r + 1).to(tl.int64) - bos
        slot = tl.load(state_indices_ptr + i_r).to(tl.int64)
        m_i = o_i < num_nodes
        rows = bos + o_i
        o_k = i_k + tl.arange(0, B_K)
        b_s = tl.load(state_ptr + slot * stride_s_slot + i_h * stride_s_h + o_v[:, None] * stride_s_v + o_k[None, :])
        b_q, b_k, b_qk, b_kk, ssq_q, ssq_k = qk_chunk_gram(
            q_ptr, k_ptr, k_out_ptr, rows, m_i, o_k, i_hk, write_keys,
            stride_q_n, stride_q_h, stride_k_n, stride_k_h, H_K, b_qk, b_kk, ssq_q, ssq_k,
            D_K, USE_QK_L2NORM, DOT_PRECISION, GRAM_DTYPE)
        b_qs, b_ks = state_products(b_q, b_k, b_s, b_qs, b_ks, DOT_PRECISION, GRAM_DTYPE, False)
        if it % NK == NK - 1:
            tl.store(committed_ptr + i_r, 0, mask=i_h == 0)
            enter_i = tl.load(dfs_enter_ptr + rows, mask=m_i, other=-1)
            exit_i = tl.load(dfs_exit_ptr + rows, mask=m_i, other=-2)
            b_beta = tl.load(beta_ptr + rows * stride_beta_n + i_h * stride_beta_h, mask=m_i, other=0).to(tl.float32)
            b_g = floored(tl.load(g_ptr + rows * stride_g_n + i_h * stride_g_h, mask=m_i, other=0).to(tl.float32))
            b_w, b_m, a_q, a_k = head_factors(
                b_qk, b_kk, ssq_q, ssq_k, enter_i, exit_i, b_beta, b_g, tl.load(block_depth_ptr + i_r), scale,
                logp_ptr, k_scale_ptr, rows, m_i, i_h, i_hk, 0, write_keys, H_V, H_K,
                B_T, USE_QK_L2NORM, DOT_PRECISION, SWEEP_F16)
            readout(b_qs, b_ks, a_q, a_k, b_w, b_m, v_ptr, u_ptr, o_ptr, rows, m_i, o_v, i_h, stride_v_n, stride_v_h,
                    H_V, D_V, DOT_PRECISION)
            b_qk, b_kk, ssq_q, ssq_k, b_qs, b_ks = fresh_sums(B_T, D_V)


def multi_verify(x, pool, slots, tree, out, heads: HeadShape, b_k: int, warps: int, stages: int, r: int,
                 sweep_f16: bool):
    """One launch of `stream_multi_kernel` writing into ``out`` (a `TreeVerifyResult` of the same shapes)."""
    block_depth, _ = tree.block_depths(16)
    batch = tree.num_requests
    sq, sk, sv, sg, sb, ss = x.q.stride(), x.k.stride(), x.v.stride(), x.g.stride(), x.beta.stride(), pool.stride()
    stream_multi_kernel[(heads.hv, triton.cdiv(batch, r))](
        x.q, x.k, x.v, x.g, x.beta, pool, slots, tree.offsets, tree.dfs_enter, tree.dfs_exit, block_depth,
        out.o, out.u, out.log_decay, out.k, out.k_scale, out.committed,
        heads.dk ** -0.5, heads.hv, heads.hk, batch, sq[0], sq[1], sk[0], sk[1], sv[0], sv[1], sg[0], sg[1],
        sb[0], sb[1], ss[0], ss[1], ss[2],
        D_K=heads.dk, D_V=heads.dv, B_T=16, B_K=b_k, R=r, USE_QK_L2NORM=True, DOT_PRECISION=dot_precision(x.q.dtype),
        GRAM_DTYPE=gram_dtype(x.q), SWEEP_F16=sweep_f16, num_warps=warps, num_stages=stages)
    return out


CASES = [(16, 4, "chain"), (32, 8, "chain"), (16, 8, "random")]
VARIANTS = [(b_k, w, s, r) for r in (1, 2, 4) for (b_k, w, s) in ((32, 2, 3), (32, 4, 3), (32, 2, 4), (64, 4, 3), (16, 2, 4))]


def main() -> None:
    parser = lab_parser()
    args = parser.parse_args()
    heads, device, cases, variants = HEADS_9B, "cuda", CASES, VARIANTS
    if args.smoke:
        heads, device, cases, variants = HeadShape(hk=2, hv=4, dk=32, dv=32), "cpu", [(3, 4, "chain")], \
            [(16, 4, 1, 2)]
    rows = []
    for batch, size, kind in cases:
        bench = CaseBench(BenchCase(heads, batch, size, torch.bfloat16, 8, label="qwen3.5-9b", kind=kind), device)
        tree, pool, inputs, slots = bench.sets(64)
        shipped = bench.launch()
        sweep_f16 = shipped.sweep_f16
        outs = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=shipped)
                for i, x in enumerate(inputs)]
        rtree, rx, ref = bench.reference()
        row = {"batch": batch, "tree_size": size, "kind": kind, "shipped": str(shipped.config), "runs": []}
        if not args.smoke:
            def verify(i):
                x = inputs[i]
                tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=shipped, out=outs[i])

            row["shipped_verify"] = time_launches(verify, len(inputs), device, repeats=args.repeats).p50_us
        print(f"B={batch} T={size} {kind}: shipped {shipped.variant} {shipped.config} "
              f"{row.get('shipped_verify', float('nan')):.2f} us", flush=True)
        for b_k, warps, stages, r in variants:
            entry = {"b_k": b_k, "warps": warps, "stages": stages, "R": r}
            try:
                expected = tree_verify(*rx.args(rtree), validate=False)
                rout = tree_verify(*rx.args(rtree), validate=False)
                for t in (rout.o, rout.u, rout.log_decay, rout.k_scale):
                    t.fill_(float("nan"))
                multi_verify(rx, rx.state, rx.state_indices, rtree, rout, heads, b_k, warps, stages, r, sweep_f16)
                entry["error"] = relative_error(rout.o, ref.o)
                # the commit's factors, against the shipped verify's
                entry["factor_error"] = max(relative_error(rout.u, expected.u),
                                            relative_error(rout.log_decay, expected.log_decay),
                                            relative_error(rout.k_scale, expected.k_scale))
                if not args.smoke:
                    def multi(i):
                        x = inputs[i]
                        multi_verify(x, pool, slots[i], tree, outs[i], heads, b_k, warps, stages, r, sweep_f16)

                    entry["verify"] = time_launches(multi, len(inputs), device, repeats=args.repeats).p50_us
            except Exception as e:  # noqa: BLE001 - a lab sweep records what failed and goes on
                entry["status"] = f"{type(e).__name__}: {str(e)[:300]}"
            print("   ", entry, flush=True)
            row["runs"].append(entry)
        rows.append(row)
        del bench, tree, pool, inputs, outs
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("\n| 9B, us | shipped stream verify | best multi-request verify (b_k/warps/stages/R) | by R: 1 / 2 / 4 |")
    print("|---|---|---|---|")
    for row in rows:
        ok = [r for r in row["runs"] if "verify" in r and r.get("error", 1) < 1e-2 and r.get("factor_error", 1) < 1e-2]
        best = min(ok, key=lambda r: r["verify"]) if ok else {}
        by_r = [min((r["verify"] for r in ok if r["R"] == n), default=float("nan")) for n in (1, 2, 4)]
        print(f"| B={row['batch']} T={row['tree_size']} {row['kind']} | {row.get('shipped_verify', float('nan')):.1f} | "
              f"{best.get('verify', float('nan')):.1f} ({best.get('b_k')}/{best.get('warps')}/{best.get('stages')}/"
              f"{best.get('R')}) | " + " / ".join(f"{v:.1f}" for v in by_r) + " |")


if __name__ == "__main__":
    main()
