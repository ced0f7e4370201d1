"""Compile a verify launch for the H200 (sm_90) on a machine without a GPU and report what the binary costs: registers,
spills, shared memory, and its SASS instructions by kind. The launch is the one `tree_verify` would run (its arguments
captured from a CPU call with CPU tensors of the same dtypes and alignments), compiled by Triton's own CUDA backend
and ptxas, read back with the cuobjdump and nvdisasm Triton ships.

    python3 lab/sass_stats.py --batch 16 --tree-size 4 --kind chain [--fold] [--config 32/128/2/3] [--variant stream]
    python3 lab/sass_stats.py --batch 32 --tree-size 8 --ring read     # a PendingRing's read (or write) round, R=4
    python3 lab/sass_stats.py --batch 32 --tree-size 8 --ring write --tma store   # with tma_state.py's patch
    python3 lab/sass_stats.py --batch 32 --tree-size 8 --stack 0       # q and k on two tiles (trees of <= 8 nodes)

Static counts only: what an instruction costs on the GPU is measured there.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.config import KernelConfig
from bole_tune.kernels import tree_verify
from bole_tune.kernels.verify import run as run_module
from bole_tune.shapes import HeadShape

BIN = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_for_h200(fn, args: tuple, meta: dict):
    """``fn`` compiled for sm_90 with ``args`` (CPU tensors stand for device ones) and ``meta``."""
    backend = make_backend(GPUTarget("cuda", 90, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = {k: v for k, v in meta.items()}
    bound, specialization, _ = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, None)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options.__dict__)


def sass_report(compiled) -> dict:
    work = pathlib.Path(tempfile.mkdtemp())
    cubin = work / "k.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    usage = subprocess.run([str(BIN / "cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True,
                           text=True).stdout
    sass = subprocess.run([str(BIN / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True).stdout
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if m:
            ops[m.group(1).split(".")[0]] += 1
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    local = re.search(r"LOCAL:(\d+)", usage)
    return {"registers": int(regs.group(1)) if regs else None, "stack": int(stack.group(1)) if stack else None,
            "local": int(local.group(1)) if local else None, "shared": compiled.metadata.shared,
            "instructions": sum(ops.values()), "ops": dict(ops.most_common())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tree-size", type=int, default=4)
    parser.add_argument("--kind", default="chain")
    parser.add_argument("--variant", default="stream")
    parser.add_argument("--config", help="b_k/b_v/num_warps/num_stages")
    parser.add_argument("--fold", action="store_true")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--rows-first", type=int, choices=(0, 1), help="override run.ROWS_FIRST for this launch")
    parser.add_argument("--ring", choices=("read", "write"), help="a PendingRing's round (R = 4) instead")
    parser.add_argument("--stack", type=int, choices=(0, 1), help="override the launch's stacked rows (stack_qk)")
    parser.add_argument("--tma", choices=("load", "store", "both"),
                        help="the resident kernel patched by `tma_state.MODES` (state tiles moved by TMA)")
    parser.add_argument("--maxnreg", type=int, help="cap the registers per thread (ptxas spills what does not fit)")
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    heads = HeadShape(hk=16, hv=32, dk=128, dv=128)
    case = BenchCase(heads, args.batch, args.tree_size, torch.bfloat16, 8, kind=args.kind)
    bench = CaseBench(case, "cpu")
    config = KernelConfig(*map(int, args.config.split("/"))) if args.config else None
    launch = bench.launch(config=config, variant=args.variant, fold=args.fold or args.ring == "write")
    if args.stack is not None:
        launch = launch.replace(stack_qk=bool(args.stack))
    captured = {}
    if args.rows_first is not None:
        run_module.ROWS_FIRST["fold" if args.fold else "verify"] = bool(args.rows_first)

    def capture(key, grid, fast_args, build_args, build_meta):
        captured.update(args=build_args(), meta=build_meta(), grid=grid)

    kernel = run_module.RESIDENT if launch.variant != "fused" else run_module.FUSED
    original = kernel.launch_keyed
    kernel.launch_keyed = capture
    saved = run_module.use_triton if hasattr(run_module, "use_triton") else None
    try:
        tree, x, _ = bench.reference()
        import bole_tune.kernels.verify.tree_verify as tv
        use = tv.use_triton
        tv.use_triton = lambda device: True
        try:
            if args.ring:
                from bole_tune.kernels import PendingRing

                ring = PendingRing(x.state.shape[0], 4, tree.depth + 1, tree.num_nodes, tree.num_requests, "cpu")
                step = ring.begin(tree, write=args.ring == "write")
                tree_verify(*x.args(tree), validate=False, launch=launch,
                            ring=step.layer(ring.results(heads, torch.bfloat16)))
            else:
                tree_verify(*x.args(tree), validate=False, launch=launch)
        finally:
            tv.use_triton = use
    finally:
        kernel.launch_keyed = original
    meta = dict(captured["meta"])
    meta["GRAM_DTYPE"] = triton.language.bfloat16  # the GPU's (the CPU interpreter's is fp32)
    meta["DOT_PRECISION"] = "tf32"
    fn, call_args = kernel.fn, captured["args"]
    if args.tma:
        import tempfile

        from patched_kernel import patched_resident_kernel
        from tma_state import MODES
        from triton.tools.tensor_descriptor import TensorDescriptor

        fn = patched_resident_kernel(MODES[args.tma], f"sass_{args.tma}", pathlib.Path(tempfile.mkdtemp()))
        state = call_args[5]
        dk = state.shape[-1]
        meta["s_desc"] = TensorDescriptor(state, [state.numel() // dk, dk], [dk, 1], [meta["B_V"], meta["B_K"]])
    if args.maxnreg:
        meta["maxnreg"] = args.maxnreg
    compiled = compile_for_h200(fn, call_args, meta)
    report = sass_report(compiled)
    print(f"{launch.variant} {launch.config} stack={launch.stack_qk} fold={args.fold} ring={args.ring} tma={args.tma} maxnreg={args.maxnreg} grid={captured['grid']} registers={report['registers']} "
          f"stack={report['stack']} local={report['local']} shared={report['shared']} "
          f"instructions={report['instructions']}")
    print(" ".join(f"{k}:{v}" for k, v in list(report["ops"].items())[:args.top]))


if __name__ == "__main__":
    main()
