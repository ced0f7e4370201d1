"""Issue 17, tenth session: the stream verify split in two launches the other way round from the seventh session's.

The read-only stream of the stream verify's own grid (one program per head streaming 64 KiB) reaches 2.4-3.1 TB/s at
B=16 and 3.2-3.5 at B=32 (`tma_state.py --floor`), while programs of 16 KiB reach the copy rate. So here:

1. a stream launch (`stream_products_kernel`, a lab kernel): one program per ``[b_v, dk]`` slab of one head's state,
   ``b_v`` as small as 16-32 rows: it reads the slab (with a pending round: folds it in and writes the slab back, as
   the folded launch does) and stores the products ``Q S^T`` and ``K S^T`` of its ``b_v`` value columns,
   ``[nodes, Hv, dv]`` fp32 each, complete over ``dk`` (no reduction, no atomics): nothing else;
2. the stream verify (a text patch of `resident.py`) with its state loads and products taken out: it reads those
   products instead, and does what it did after the stream (Gram products, factors, readout; a ring's read round its
   corrections).

Each launch pair is checked against the float64 reference (the folded one's committed slots too), then timed beside
the shipped kernel (verify, folded round, ring read and write rounds), at a few tiles of the stream launch.

    python3 lab/split_stream.py [--json OUT] [--repeats 30]
    TRITON_INTERPRET=1 python3 lab/split_stream.py --smoke      # the checks only, small heads on the CPU
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

import torch
import triton
import triton.language as tl

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.kernels import tree_verify
from bole_tune.kernels.verify import run as run_module
from bole_tune.kernels.verify.blocks import fold_apply, fold_updates, pending_tokens, state_products
from bole_tune.shapes import HeadShape
from lab_rows import check_and_time, release, save, show, with_resident
from patched_kernel import patched_resident_kernel


@triton.jit
def stream_products_kernel(
    q_ptr, k_ptr, state_ptr, state_indices_ptr, offsets_ptr, pq_ptr, pk_ptr,
    fold_map_ptr, fold_rows_ptr, fold_u_ptr, fold_logp_ptr, fold_k_ptr, fold_k_scale_ptr, fold_committed_ptr, epoch,
    H_V, H_K, stride_q_n, stride_q_h, stride_k_n, stride_k_h, stride_s_slot, stride_s_h, stride_s_v,
    D_K: tl.constexpr, D_V: tl.constexpr, B_T: tl.constexpr, B_K: tl.constexpr, B_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FOLD: tl.constexpr, RING: tl.constexpr, B_P: tl.constexpr, FOLD_DOT: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)
    i_r = tl.program_id(2).to(tl.int64)
    i_hk = i_h // (H_V // H_K)
    bos = tl.load(offsets_ptr + i_r).to(tl.int64)
    num_nodes = tl.load(offsets_ptr + i_r + 1).to(tl.int64) - bos
    slot = tl.load(state_indices_ptr + i_r).to(tl.int64)
    o_i = tl.arange(0, B_T)
    m_i = o_i < num_nodes
    rows = bos + o_i
    o_v = i_v * B_V + tl.arange(0, B_V)
    p_state = state_ptr + slot * stride_s_slot + i_h * stride_s_h
    if FOLD:
        rows_p, m_p, weight_p, decay_p, pending = pending_tokens(
            RING, i_r, slot, i_h, i_hk, fold_map_ptr, fold_rows_ptr, fold_logp_ptr, fold_k_scale_ptr, fold_committed_ptr,
            epoch, H_V, H_K, B_P)
        b_upw = fold_updates(rows_p, m_p, weight_p, o_v, i_h, fold_u_ptr, H_V, D_V)
    b_qs = tl.zeros([B_T, B_V], dtype=tl.float32)
    b_ks = tl.zeros([B_T, B_V], dtype=tl.float32)
    for i_k in range(0, D_K, B_K):
        o_k = i_k + tl.arange(0, B_K)
        b_s = tl.load(p_state + o_v[:, None] * stride_s_v + o_k[None, :])
        b_q = tl.load(q_ptr + rows[:, None] * stride_q_n + i_hk * stride_q_h + o_k[None, :], mask=m_i[:, None], other=0)
        b_k = tl.load(k_ptr + rows[:, None] * stride_k_n + i_hk * stride_k_h + o_k[None, :], mask=m_i[:, None], other=0)
        if FOLD:
            b_s = fold_apply(b_s, b_upw, rows_p, m_p, decay_p, o_k, i_hk, fold_k_ptr, H_K, D_K, FOLD_DOT)
            tl.store(p_state + o_v[:, None] * stride_s_v + o_k[None, :], b_s, mask=pending)
        b_qs, b_ks = state_products(b_q, b_k, b_s, b_qs, b_ks, DOT_PRECISION, tl.float32, False)
    p_out = rows[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :]
    tl.store(pq_ptr + p_out, b_qs, mask=m_i[:, None])
    tl.store(pk_ptr + p_out, b_ks, mask=m_i[:, None])


# the stream verify without its state: the products come from the stream launch
LOAD_OLD = """            b_s = tl.load(p_state + o_v[:, None] * stride_s_v + o_k[None, :])
            b_q, b_k, b_qk, b_kk, ssq_q, ssq_k = qk_chunk_gram("""
LOAD_NEW = """            b_q, b_k, b_qk, b_kk, ssq_q, ssq_k = qk_chunk_gram("""
PRODUCTS_OLD = """            if ROWS_FIRST:
                b_qs, b_ks = state_products_rows_first(b_q, b_k, b_s, b_qs, b_ks, DOT_PRECISION)
            else:
                b_qs, b_ks = state_products(b_q, b_k, b_s, b_qs, b_ks, DOT_PRECISION, GRAM_DTYPE, STATE_SPLIT)
        if CORRECT:"""
PRODUCTS_NEW = """        p_prod = rows[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :]
        b_qs = tl.load(pq_ptr + p_prod, mask=m_i[:, None], other=0)
        b_ks = tl.load(pk_ptr + p_prod, mask=m_i[:, None], other=0)
        if CORRECT:"""
FOLD_OLD = """            if FOLD and not CORRECT:
                b_s = fold_apply(b_s, b_upw, rows_p, m_p, decay_p, o_k, i_hk, fold_k_ptr, H_K, D_K, FOLD_DOT)
                tl.store(p_state + o_v[:, None] * stride_s_v + o_k[None, :], b_s, mask=pending)
            if ROWS_FIRST:
                b_qs, b_ks = state_products_rows_first"""
FOLD_NEW = """            if ROWS_FIRST:
                b_qs, b_ks = state_products_rows_first"""
SIG_OLD = """    ROWS_FIRST: tl.constexpr = False, RING: tl.constexpr = False, CORRECT: tl.constexpr = False,
):"""
SIG_NEW = """    ROWS_FIRST: tl.constexpr = False, RING: tl.constexpr = False, CORRECT: tl.constexpr = False,
    pq_ptr=None, pk_ptr=None,
):"""
PATCHES = [(LOAD_OLD, LOAD_NEW), (FOLD_OLD, FOLD_NEW), (PRODUCTS_OLD, PRODUCTS_NEW), (SIG_OLD, SIG_NEW)]

CASES = [(32, 8, "chain"), (16, 4, "chain"), (16, 8, "random")]
STREAM_TILES = [(32, 32, 2, 3), (32, 64, 4, 2), (16, 128, 2, 2), (32, 128, 4, 1), (64, 32, 4, 3)]  # b_v, b_k, w, s


class SplitLauncher:
    """Stands in for `run.RESIDENT`: the stream launch (``tile``: b_v, b_k, warps, stages), then the patched verify."""

    def __init__(self, second, tile, parts: str = "both"):
        # parts: "both", or "stream" / "second" alone, or "second_nosweep" (the second without its level sweeps)
        self.second, self.tile, self.parts = second, tile, parts
        self.scratch = {}

    def launch_keyed(self, key, grid, fast_args, args, meta):
        a, m = args(), meta()
        q, k, state, state_indices, offsets = a[0], a[1], a[5], a[6], a[7]
        fold, scalars = a[17:25], a[25:]
        h_v, h_k = scalars[1], scalars[2]
        sq0, sq1, sk0, sk1 = scalars[3:7]
        ss = scalars[13:16]
        n, d_v, d_k = q.shape[1] if q.dim() == 4 else q.shape[0], state.shape[-2], state.shape[-1]
        shape = (n, h_v, d_v)
        if shape not in self.scratch:
            self.scratch = {shape: (torch.empty(shape, device=q.device), torch.empty(shape, device=q.device))}
        pq, pk = self.scratch[shape]
        correct = m.get("CORRECT", False)
        fold_here = m["FOLD"] and not correct
        num_requests = grid[1]
        if self.parts != "second":
            self.stream(q, k, state, state_indices, offsets, pq, pk, fold, h_v, h_k, (sq0, sq1, sk0, sk1), ss, m,
                        fold_here, num_requests, d_k, d_v)
        m2 = dict(m, ROWS_FIRST=False, STATE_SPLIT=False)
        if not correct:
            m2.update(FOLD=False, RING=False, CORRECT=False)
        if self.parts == "second_nosweep":  # timing only: no level sweeps (every tree's depth given as 0)
            a = (*a[:10], torch.zeros_like(a[10]), *a[11:])
        if self.parts != "stream":
            self.second[grid](*a, pq_ptr=pq, pk_ptr=pk, **m2)

    def stream(self, q, k, state, state_indices, offsets, pq, pk, fold, h_v, h_k, strides, ss, m, fold_here,
               num_requests, d_k, d_v):
        b_v, b_k, warps, stages = self.tile
        sq0, sq1, sk0, sk1 = strides
        stream_products_kernel[(d_v // b_v, h_v, num_requests)](
            q, k, state, state_indices, offsets, pq, pk, *fold, h_v, h_k, sq0, sq1, sk0, sk1, *ss,
            D_K=d_k, D_V=d_v, B_T=m["B_T"], B_K=b_k, B_V=b_v, DOT_PRECISION=m["DOT_PRECISION"], FOLD=fold_here,
            RING=bool(m.get("RING", False)) and fold_here, B_P=m.get("B_P", 16), FOLD_DOT=m.get("FOLD_DOT", "ieee"),
            num_warps=warps, num_stages=stages)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--parts", action="store_true", help="also time the two launches of the verify apart")
    parser.add_argument("--tiles", help="the stream launch's tiles, b_v/b_k/warps/stages,... (default: five)")
    args = parser.parse_args()
    heads = HeadShape(hk=2, hv=4, dk=32, dv=32) if args.smoke else HeadShape(hk=16, hv=32, dk=128, dv=128)
    device = "cpu" if args.smoke else "cuda"
    cases = [(2, 4, "chain"), (3, 8, "random")] if args.smoke else CASES
    tiles = [(16, 16, 2, 2), (32, 32, 4, 1)] if args.smoke else STREAM_TILES
    if args.tiles:
        tiles = [tuple(int(x) for x in t.split("/")) for t in args.tiles.split(",")]
    second = patched_resident_kernel(PATCHES, "split_stream", pathlib.Path(tempfile.mkdtemp()))
    shipped = run_module.RESIDENT
    rows = []

    for batch, size, kind in cases:
        case = BenchCase(heads, batch, size, torch.bfloat16, 8, label="qwen3.5-9b", kind=kind)
        bench = CaseBench(case, device)
        launch = bench.launch(variant="stream")
        flaunch = bench.launch(variant="stream", fold=True)
        for tile in [None] + tiles:
            kernel = shipped if tile is None else SplitLauncher(second, tile)
            row = {"batch": batch, "tree_size": size, "kind": kind, "split": tile, "config": str(launch.config)}
            # the split's fold happens in the stream launch: the verify's tiles serve the second launch
            ok = check_and_time(row, bench, kernel, launch, flaunch if tile is None else launch, args.repeats,
                                args.rounds, not args.smoke, ring_against=None if tile is None else shipped)
            if ok and tile is not None and args.parts and not args.smoke:
                for parts in ("stream", "second", "second_nosweep"):
                    alone = SplitLauncher(second, tile, parts)
                    row[f"verify_{parts}_alone"] = with_resident(alone, lambda: bench.time_verify(
                        tree_verify, launch, args.repeats)[0].p50_us)
                    row[f"folded_{parts}_alone"] = with_resident(alone, lambda: bench.time_folded(
                        launch, args.repeats).p50_us)
            show(row, rows)
        bench = None  # its buffers go before the next case's
        release(device)
    save(args.json, rows)


if __name__ == "__main__":
    main()
