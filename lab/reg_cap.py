"""Issue 17: the folded stream launch with its registers capped (Triton's ``maxnreg``), so more programs share an SM.

Nsight Compute of the B=16 folded launch (`ncu_stream.py`; BENCHMARKS.md, "Eighth session") shows 248 registers a
thread, four 2-warp programs per SM (registers and shared memory both allow four), 1.94 waves and no eligible warp
in 68% of the scheduler's cycles. A cap of 200 or 168 registers lets five or six in, if it does not spill too much.
Each launch is checked against the float64 reference before it is timed (`round_timing.RoundSets`).

    python3 lab/reg_cap.py [--json OUT] [--repeats 30]
"""

from __future__ import annotations


from bole_tune.config import KernelConfig
from bole_tune.kernels.launcher import FastLauncher
from bole_tune.kernels.verify import resident
from bole_tune.kernels.verify import run as run_module
from round_timing import lab_parser, print_best, sweep, swapped, write_json

CASES = [(16, 4, "chain"), (32, 8, "chain"), (16, 8, "random")]
TILES = [KernelConfig(32, 64, 2, 3), KernelConfig(32, 64, 2, 2), KernelConfig(32, 128, 2, 3)]
CAPS = [None, 224, 200, 168]


class CappedLauncher:
    """`FastLauncher.launch_keyed` of the resident kernel with ``maxnreg`` added to each launch."""

    def __init__(self, cap: int):
        self.cap, self.base = cap, FastLauncher(resident.tree_verify_resident_kernel)

    def launch_keyed(self, key, grid, fast_args, args, meta):
        self.base.launch_keyed(None if key is None else (key, self.cap), grid, fast_args, args,
                               lambda: {**meta(), "maxnreg": self.cap})


def main() -> None:
    args = lab_parser(smoke=False).parse_args()
    capped = {c: CappedLauncher(c) for c in CAPS if c}
    variants = {f"cap {c}" if c else "no cap": (lambda c=c: swapped(run_module, "RESIDENT", capped[c])) if c else None
                for c in CAPS}
    rows = sweep(CASES, TILES, variants, args.repeats)
    write_json(rows, args.json)
    print_best(rows, variants)


if __name__ == "__main__":
    main()
