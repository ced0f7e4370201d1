"""Issue 17: does the stream launch wait on its own loads? Its key loop unrolled, and its first state tiles
requested before the previous round's path is read.

The state-first branch of the resident kernel (`kernels/verify/resident.py`, ``STATE_FIRST``) walks the key
chunks of its value tile in a loop: each step loads a ``[b_v, b_k]`` state tile, and in the folded launch applies
the pending path to it and writes it back, before the next step's load is issued. Its folded launch first reads
the pending path (two dependent loads) before any state tile is requested. Variants, each a text-patched copy of
the kernel (`patched_kernel.py`), timed beside the shipped one:

  unroll:    the key loop as ``tl.static_range`` (one straight block: the compiler may issue every chunk's loads
             early)
  early2:    unrolled, and the first two chunks' state tiles requested at the top of the program, before the
             pending path and the first Gram chunk
  early_all: unrolled, every chunk's state tile requested at the top

Each launch is checked and timed by `round_timing.RoundSets`. Measured on the H200 (BENCHMARKS.md, "Eighth
session"): every variant slower, 25-45% (the unrolled loop loses Triton's software pipelining of the key loop).

    python3 lab/prefetch.py [--json OUT] [--repeats 30] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile

from bole_tune.config import KernelConfig
from bole_tune.kernels.launcher import FastLauncher
from bole_tune.kernels.verify import run as run_module
from bole_tune.shapes import HeadShape
from patched_kernel import patched_resident_kernel
from round_timing import HEADS_9B, RoundSets, best_rows, print_best, show

CASES = [(16, 4, "chain"), (32, 8, "chain"), (16, 8, "random")]
TILES = [KernelConfig(32, 64, 2, 3), KernelConfig(32, 128, 2, 3), KernelConfig(32, 64, 4, 3), KernelConfig(64, 64, 2, 3)]

LOOP = """        for i_k in range(0, D_K, B_K):
            o_k = i_k + tl.arange(0, B_K)
            b_s = tl.load(p_state + o_v[:, None] * stride_s_v + o_k[None, :])
"""
UNROLLED = """        for i_k in tl.static_range(0, D_K, B_K):
            o_k = i_k + tl.arange(0, B_K)
            b_s = tl.load(p_state + o_v[:, None] * stride_s_v + o_k[None, :])
"""
EARLY_LOOP = """        for i_k in tl.static_range(0, D_K, B_K):
            o_k = i_k + tl.arange(0, B_K)
            if i_k == 0:
                b_s = b_s0
            elif i_k == B_K:
                b_s = b_s1
            elif i_k == 2 * B_K and EARLY_ALL:
                b_s = b_s2
            elif i_k == 3 * B_K and EARLY_ALL:
                b_s = b_s3
            else:
                b_s = tl.load(p_state + o_v[:, None] * stride_s_v + o_k[None, :])
"""
PATH = """    p_state = state_ptr + slot * stride_s_slot + i_h * stride_s_h
    if FOLD:"""
EARLY = """    p_state = state_ptr + slot * stride_s_slot + i_h * stride_s_h
    if STATE_FIRST:  # the first state tiles requested before anything else is read
        o_v0 = i_part * B_V + tl.arange(0, B_V)
        o_k0 = tl.arange(0, B_K)
        b_s0 = tl.load(p_state + o_v0[:, None] * stride_s_v + o_k0[None, :])
        b_s1 = tl.load(p_state + o_v0[:, None] * stride_s_v + (B_K + o_k0[None, :]) % D_K)
        if EARLY_ALL:
            b_s2 = tl.load(p_state + o_v0[:, None] * stride_s_v + (2 * B_K + o_k0[None, :]) % D_K)
            b_s3 = tl.load(p_state + o_v0[:, None] * stride_s_v + (3 * B_K + o_k0[None, :]) % D_K)
    if FOLD:"""


def variants(workdir: pathlib.Path) -> dict:
    early = [(LOOP, EARLY_LOOP), (PATH, EARLY)]
    return {
        "shipped": run_module.RESIDENT,
        "unroll": FastLauncher(patched_resident_kernel([(LOOP, UNROLLED)], "unroll", workdir)),
        "early2": FastLauncher(patched_resident_kernel(early + [("    ROWS_FIRST: tl.constexpr = False,\n",
                                                                  "    ROWS_FIRST: tl.constexpr = False,\n"
                                                                  "    EARLY_ALL: tl.constexpr = False,\n")],
                                                       "early2", workdir)),
        "early_all": FastLauncher(patched_resident_kernel(early + [("    ROWS_FIRST: tl.constexpr = False,\n",
                                                                     "    ROWS_FIRST: tl.constexpr = False,\n"
                                                                     "    EARLY_ALL: tl.constexpr = True,\n")],
                                                          "early_all", workdir)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--smoke", action="store_true", help="small heads on the CPU interpreter: the script runs")
    args = parser.parse_args()
    heads, device, cases, tiles = HEADS_9B, "cuda", CASES, TILES
    if args.smoke:
        heads, device, cases, tiles = HeadShape(hk=2, hv=4, dk=64, dv=32), "cpu", [(2, 4, "chain")], \
            [KernelConfig(16, 32, 4, 1)]
    kernels = variants(pathlib.Path(tempfile.mkdtemp()))
    shipped = run_module.RESIDENT
    rows = []
    for batch, size, kind in cases:
        sets = RoundSets(heads, batch, size, kind, device)
        print(f"B={batch} T={size} {kind}: tuned {sets.tuned.variant} {sets.tuned.config}, fold "
              f"{sets.tuned_fold.variant} {sets.tuned_fold.config}", flush=True)
        row = {"batch": batch, "tree_size": size, "kind": kind, "tuned": str(sets.tuned.config),
               "tuned_fold": str(sets.tuned_fold.config), "runs": []}
        for config in tiles:
            launch = sets.bench.launch(config=config, variant="stream")
            for name, kernel in kernels.items():
                run_module.RESIDENT = kernel  # the launcher run.py calls
                try:
                    entry = {"config": str(config), "kernel": name, **sets.measure(launch, args.repeats,
                                                                                   timed=not args.smoke)}
                finally:
                    run_module.RESIDENT = shipped
                print("   ", show(entry), flush=True)
                row["runs"].append(entry)
        rows.append(row)
        sets.release()
    best_rows(rows, kernels)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print_best(rows, kernels)


if __name__ == "__main__":
    main()
