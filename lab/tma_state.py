"""Issue 17, tenth session: the stream launch reading its state tiles through a TMA tensor descriptor instead of
per-thread pointer loads. 9B heads, bf16, CUDA graphs, one run.

A text-patched copy of the resident kernel (`patched_kernel.py`) takes one more argument, ``s_desc``, a
`triton.tools.tensor_descriptor.TensorDescriptor` over the pool seen as ``[slots * Hv * dv, dk]`` rows with
``[b_v, b_k]`` blocks, and its state-first branch loads each tile with ``s_desc.load`` (on the H200 a bulk tensor
copy into shared memory that Triton's pipeliner multi-buffers behind mbarriers; no address arithmetic per thread).
The fold's write-back stays a pointer store. Each launch is checked against the float64 reference (outputs; the
folded launch's committed slots too), then timed beside the shipped kernel at the same tiles.

    python3 lab/tma_state.py [--json OUT] [--repeats 30] [--modes load,store,both] [--ring 2] [--tuned-only]
    TRITON_INTERPRET=1 python3 lab/tma_state.py --smoke [--modes ...] [--ring 2]   # the checks only, small heads

Fourteenth session: ``--modes store`` moves only the folded tiles' write-back by TMA (``if pending:`` a descriptor
store instead of a masked pointer store), ``both`` loads and stores; ``--ring R`` also runs a ring of R rounds on the
folded rows (its write rounds are the folded launch; outputs and flushed slots checked against float64 first).
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.config import KernelConfig
from bole_tune.kernels import tree_verify
from bole_tune.kernels.verify import run as run_module
from bole_tune.shapes import HeadShape
from lab_rows import release, save, show, with_resident
from patched_kernel import patched_resident_kernel
from ring_correct_dot import against_float64

LOAD_OLD = """            b_s = tl.load(p_state + o_v[:, None] * stride_s_v + o_k[None, :], eviction_policy=STATE_HINT)
            if CORRECT and CORRECT_FIRST:"""
LOAD_NEW = """            b_s = s_desc.load([((slot * H_V + i_h) * D_V + i_part * B_V).to(tl.int32), i_k])
            if CORRECT and CORRECT_FIRST:"""
STORE_OLD = """                tl.store(p_state + o_v[:, None] * stride_s_v + o_k[None, :], b_s, mask=pending)
            if ROWS_FIRST:"""
STORE_NEW = """                if pending:
                    s_desc.store([((slot * H_V + i_h) * D_V + i_part * B_V).to(tl.int32), i_k], b_s)
            if ROWS_FIRST:"""
SIG_OLD = """    CORRECT_FIRST: tl.constexpr = False, STATE_HINT: tl.constexpr = "",
):"""
SIG_NEW = """    CORRECT_FIRST: tl.constexpr = False, STATE_HINT: tl.constexpr = "",
    s_desc=None,
):"""
MODES = {"load": [(LOAD_OLD, LOAD_NEW), (SIG_OLD, SIG_NEW)], "store": [(STORE_OLD, STORE_NEW), (SIG_OLD, SIG_NEW)],
         "both": [(LOAD_OLD, LOAD_NEW), (STORE_OLD, STORE_NEW), (SIG_OLD, SIG_NEW)]}
"""What each mode moves by TMA in the state-first branch: the state tiles' loads (the tenth session's experiment),
the folded tiles' write-back (a folded verify's and a ring write round's; fourteenth session), or both."""

CASES = [(16, 4, "chain"), (32, 8, "chain"), (16, 8, "random")]
CONFIGS = [None, KernelConfig(32, 128, 4, 3), KernelConfig(32, 128, 2, 4)]


@triton.jit
def stream_floor_kernel(state_ptr, slots_ptr, out_ptr, s_desc, H_V: tl.constexpr, D_V: tl.constexpr,
                        D_K: tl.constexpr, B_V: tl.constexpr, B_K: tl.constexpr, TMA: tl.constexpr):
    """Read one (head, request)'s ``[D_V, D_K]`` state in ``[B_V, B_K]`` tiles (as the stream verify does, one
    program per head and value tile) and write one number: what a read-only stream of this grid can reach."""
    i_h = tl.program_id(0).to(tl.int64)
    i_r = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + i_r).to(tl.int64)
    o_v = tl.arange(0, B_V)
    acc = tl.zeros([B_V, B_K], dtype=tl.float32)
    for i_k in range(0, D_K, B_K):
        if TMA:
            acc += s_desc.load([((slot * H_V + i_h) * D_V).to(tl.int32), i_k])
        else:
            o_k = i_k + tl.arange(0, B_K)
            acc += tl.load(state_ptr + ((slot * H_V + i_h) * D_V + o_v[:, None]) * D_K + o_k[None, :])
    tl.store(out_ptr + i_r * H_V + i_h, tl.sum(tl.sum(acc, 1), 0))


def stream_floor(heads, batch: int, repeats: int) -> list[dict]:
    """The read-only stream at the verify's grid (b_v = dv), pointer loads and TMA, 2/4/8 warps, 2-4 stages."""
    from bole_tune.timing import l2_cache_bytes, rotation_count, time_launches

    state_bytes = batch * heads.hv * heads.dv * heads.dk * 4
    sets = rotation_count(state_bytes, l2_cache_bytes("cuda"), most=64)
    pool = torch.randn(sets * batch, heads.hv, heads.dv, heads.dk, device="cuda")
    slots = [torch.arange(i * batch, (i + 1) * batch, dtype=torch.int32, device="cuda") for i in range(sets)]
    out = torch.empty(batch * heads.hv, device="cuda")
    rows = []
    for b_k in (32, 64):
        desc = TensorDescriptor(pool, [pool.numel() // heads.dk, heads.dk], [heads.dk, 1], [heads.dv, b_k])
        for tma in (False, True):
            for warps in (2, 4, 8):
                for stages in (2, 3, 4):
                    def launch(i):
                        stream_floor_kernel[(heads.hv, batch)](pool, slots[i], out, desc, heads.hv, heads.dv, heads.dk,
                                                                heads.dv, b_k, tma, num_warps=warps, num_stages=stages)
                    try:
                        us = time_launches(launch, sets, "cuda", repeats=repeats).p50_us
                        rows.append({"floor": True, "batch": batch, "b_k": b_k, "tma": tma, "warps": warps,
                                     "stages": stages, "us": us, "TB/s": round(state_bytes / us / 1e6, 2)})
                    except Exception as e:  # noqa: BLE001
                        rows.append({"floor": True, "batch": batch, "b_k": b_k, "tma": tma, "warps": warps,
                                     "stages": stages, "error": f"{type(e).__name__}: {str(e)[:120]}"})
                    print(rows[-1], flush=True)
    return rows


class DescLauncher:
    """Stands in for `run.RESIDENT`: launches the patched kernel through Triton with the pool's descriptor."""

    def __init__(self, fn):
        self.fn = fn

    def launch_keyed(self, key, grid, fast_args, args, meta):
        a, m = args(), meta()
        state = a[5]
        dk = state.shape[-1]
        desc = TensorDescriptor(state, [state.numel() // dk, dk], [dk, 1], [m["B_V"], m["B_K"]])
        self.fn[grid](*a, s_desc=desc, **m)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--floor", action="store_true", help="also the read-only stream at B=16 and 32")
    parser.add_argument("--modes", default="load", help="comma list of load, store, both (MODES)")
    parser.add_argument("--ring", type=int, default=0, metavar="R",
                        help="also a ring of R rounds (24 layers) on the folded rows, checked against float64")
    parser.add_argument("--tuned-only", action="store_true", help="only the planner's launch (config None)")
    args = parser.parse_args()
    heads = HeadShape(hk=2, hv=4, dk=32, dv=32) if args.smoke else HeadShape(hk=16, hv=32, dk=128, dv=128)
    device = "cpu" if args.smoke else "cuda"
    cases = [(2, 4, "chain"), (3, 8, "random")] if args.smoke else CASES
    configs = [None, KernelConfig(16, 32, 2, 2)] if args.smoke else [None] if args.tuned_only else CONFIGS
    workdir = pathlib.Path(tempfile.mkdtemp())
    kernels = [("shipped", run_module.RESIDENT)] + [
        (mode, DescLauncher(patched_resident_kernel(MODES[mode], f"tma_{mode}", workdir)))
        for mode in args.modes.split(",")]
    rows = []
    if args.floor and not args.smoke:
        for batch in (16, 32):
            rows += stream_floor(heads, batch, args.repeats)

    for batch, size, kind in cases:
        case = BenchCase(heads, batch, size, torch.bfloat16, 8, label="qwen3.5-9b", kind=kind)
        bench = CaseBench(case, device)
        for config in configs:
            for fold in (False, True):
                try:
                    launch = bench.launch(config=config, variant="stream", fold=fold)
                except Exception as e:  # noqa: BLE001 - a lab sweep records what it could not plan
                    print(f"B={batch} T={size} {config} fold={fold}: {type(e).__name__}: {e}", flush=True)
                    continue
                row = {"batch": batch, "tree_size": size, "kind": kind, "fold": fold, "config": str(launch.config)}
                for name, kernel in kernels:
                    try:
                        if fold:
                            row[f"{name}_error"], row[f"{name}_state_error"] = with_resident(
                                kernel, lambda: bench.fold_errors(launch))
                        else:
                            row[f"{name}_error"] = with_resident(kernel, lambda: bench.check(tree_verify, launch))
                        if not args.smoke:
                            row[name] = with_resident(kernel, lambda: (
                                bench.time_folded(launch, args.repeats) if fold else
                                bench.time_verify(tree_verify, launch, args.repeats)[0]).p50_us)
                        if fold and args.ring:
                            read = bench.launch()
                            row[f"{name}_ring_errors"] = with_resident(
                                kernel, lambda: against_float64(bench, read, launch))
                            if not args.smoke:
                                ring = with_resident(kernel, lambda: bench.time_ring(
                                    args.ring, 24, max(2, args.repeats // 3), read_launch=read, write_launch=launch))
                                row[f"{name}_ring"] = {k: round(t.p50_us, 2) for k, t in ring.items()}
                    except Exception as e:  # noqa: BLE001
                        row[name] = f"{type(e).__name__}: {str(e)[:160]}"
                show(row, rows)
        bench = None  # its buffers go before the next case's
        release(device)
    save(args.json, rows)


if __name__ == "__main__":
    main()
