"""Compile a verify launch for the H200 (sm_90) on a machine without a GPU and report what the binary costs: registers,
spills, shared memory, and its SASS instructions by kind. The launch is the one `tree_verify` would run (its arguments
captured from a CPU call with CPU tensors of the same dtypes and alignments), compiled by Triton's own CUDA backend
and ptxas, read back with the cuobjdump and nvdisasm Triton ships.

    python3 lab/sass_stats.py --batch 16 --tree-size 4 --kind chain [--fold] [--config 32/128/2/3] [--variant stream]
    python3 lab/sass_stats.py --batch 32 --tree-size 8 --ring read     # a PendingRing's read (or write) round, R=4
    python3 lab/sass_stats.py --batch 32 --tree-size 8 --ring write --tma store   # with tma_state.py's patch
    python3 lab/sass_stats.py --batch 32 --tree-size 8 --stack 0       # q and k on two tiles (trees of <= 8 nodes)

Static counts only: what an instruction costs on the GPU is measured there. The capture, compile and report are
`bole_tune.binaries` (which CI runs on the shipped database's launches); this script picks any launch.
"""

from __future__ import annotations

import argparse
import os

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: compilable kernels, not interpreted ones

import pathlib  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402

from bole_tune.bench import BenchCase, CaseBench  # noqa: E402
from bole_tune.binaries import binary_report, captured_launch, compile_for  # noqa: E402
from bole_tune.config import KernelConfig  # noqa: E402
from bole_tune.kernels.verify import run as run_module  # noqa: E402
from bole_tune.shapes import HeadShape  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tree-size", type=int, default=4)
    parser.add_argument("--kind", default="chain")
    parser.add_argument("--variant", default="stream")
    parser.add_argument("--config", help="b_k/b_v/num_warps/num_stages")
    parser.add_argument("--fold", action="store_true", help="the folded verify (a previous round's paths committed)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--rows-first", type=int, choices=(0, 1), help="override run.ROWS_FIRST for this launch")
    parser.add_argument("--ring", choices=("read", "write"), help="a PendingRing's round (R = 4) instead")
    parser.add_argument("--stack", type=int, choices=(0, 1), help="override the launch's stacked rows (stack_qk)")
    parser.add_argument("--tma", choices=("load", "store", "both"),
                        help="the resident kernel patched by `tma_state.MODES` (state tiles moved by TMA)")
    parser.add_argument("--maxnreg", type=int, help="cap the registers per thread (ptxas spills what does not fit)")
    args = parser.parse_args()
    heads = HeadShape(hk=16, hv=32, dk=128, dv=128)
    case = BenchCase(heads, args.batch, args.tree_size, torch.bfloat16, 8, kind=args.kind)
    bench = CaseBench(case, "cpu")
    config = KernelConfig(*map(int, args.config.split("/"))) if args.config else None
    launch = bench.launch(config=config, variant=args.variant, fold=args.fold or args.ring == "write",
                          ring=args.ring == "write")
    if args.stack is not None:
        launch = launch.replace(stack_qk=bool(args.stack))
    if args.rows_first is not None:
        run_module.ROWS_FIRST["fold" if args.fold else "verify"] = bool(args.rows_first)
    fn, call_args, meta, grid = captured_launch(bench, launch, args.ring, args.fold)
    if args.tma:
        from patched_kernel import patched_resident_kernel
        from tma_state import MODES
        from triton.tools.tensor_descriptor import TensorDescriptor

        fn = patched_resident_kernel(MODES[args.tma], f"sass_{args.tma}", pathlib.Path(tempfile.mkdtemp()))
        state = call_args[5]
        dk = state.shape[-1]
        meta["s_desc"] = TensorDescriptor(state, [state.numel() // dk, dk], [dk, 1], [meta["B_V"], meta["B_K"]])
    if args.maxnreg:
        meta["maxnreg"] = args.maxnreg
    report = binary_report(compile_for(fn, call_args, meta))
    print(f"{launch.variant} {launch.config} stack={launch.stack_qk} fold={bool(meta.get('FOLD'))} ring={args.ring} "
          f"tma={args.tma} maxnreg={args.maxnreg} grid={grid} registers={report['registers']} "
          f"stack={report['stack']} local={report['local']} shared={report['shared']} "
          f"instructions={report['instructions']}")
    print(" ".join(f"{k}:{v}" for k, v in list(report["ops"].items())[:args.top]))


if __name__ == "__main__":
    main()
