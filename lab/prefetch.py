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

import pathlib
import tempfile

from bole_tune.config import KernelConfig
from bole_tune.kernels.launcher import FastLauncher
from bole_tune.kernels.verify import run as run_module
from bole_tune.shapes import HeadShape
from patched_kernel import patched_resident_kernel
from round_timing import lab_parser, print_best, swapped, sweep, write_json

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
    """Each variant's name and the context it runs in (its launcher swapped in for the one run.py calls)."""
    early = [(LOOP, EARLY_LOOP), (PATH, EARLY)]
    switch = "    ROWS_FIRST: tl.constexpr = False,\n"
    patches = {"unroll": [(LOOP, UNROLLED)],
               "early2": early + [(switch, switch + "    EARLY_ALL: tl.constexpr = False,\n")],
               "early_all": early + [(switch, switch + "    EARLY_ALL: tl.constexpr = True,\n")]}
    launchers = {name: FastLauncher(patched_resident_kernel(p, name, workdir)) for name, p in patches.items()}
    return {"shipped": None, **{name: (lambda k=k: swapped(run_module, "RESIDENT", k)) for name, k in launchers.items()}}


def main() -> None:
    parser = lab_parser()
    args = parser.parse_args()
    kernels = variants(pathlib.Path(tempfile.mkdtemp()))
    if args.smoke:
        rows = sweep([(2, 4, "chain")], [KernelConfig(16, 32, 4, 1)], kernels, 1, HeadShape(hk=2, hv=4, dk=64, dv=32),
                     "cpu", timed=False)
    else:
        rows = sweep(CASES, TILES, kernels, args.repeats)
    write_json(rows, args.json)
    print_best(rows, kernels)


if __name__ == "__main__":
    main()
