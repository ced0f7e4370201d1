"""The verifier's, the commit's and the other kernels' launches compiled for the H200 (sm_90) on a machine without a
GPU, and what their binaries cost.

CI has no GPU: its tests run the kernels under ``TRITON_INTERPRET=1``, which proves what they compute but never runs
Triton's compiler, so a kernel change that the interpreter accepts and the compiler rejects (or that no longer fits
an SM's shared memory) would land unseen. Triton ships the CUDA backend's ptxas, cuobjdump and nvdisasm with its
wheel, so the launches `tree_verify` would run can be compiled for sm_90 here: the launch is captured from a CPU call
(CPU tensors of the same dtypes and alignments stand for the device's), its arguments bound as on the GPU (16-bit
Gram products, tf32 dot precision: the interpreter's fp32 is a CPU-only choice), then compiled and read back.

    python -m bole_tune.binaries [--json]     # the shipped database's launches at the issue-17 shapes
    python -m bole_tune.binaries --commits    # every distinct commit launch of the shipped database, and its switches
    python -m bole_tune.binaries --others     # the other kernels an engine launches (tree build, gates, conv, ...)
    python -m bole_tune.binaries --portable   # what a GPU without a tuned database runs, sm_80 to sm_120

It must run in a process without ``TRITON_INTERPRET`` (the interpreter replaces every ``@triton.jit`` function at
import time); `tests/test_binaries.py` starts it that way. Static counts only: what an instruction costs is measured
on the GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import subprocess
import tempfile
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from bole_tune import database
from bole_tune.bench import BenchCase, CaseBench
from bole_tune.config import CommitConfig, default_commit_config, node_block
from bole_tune.database import ShapeKey
from bole_tune.kernels import Launch
from bole_tune.kernels.common import dot_precision
from bole_tune.kernels.launcher import traps
from bole_tune.lookup import decide
from bole_tune.shapes import HeadShape, batch_bucket, dtype_name, torch_dtype, tree_bucket

TOOLS = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
H200 = GPUTarget("cuda", 90, 32)
SM90_SHARED_BYTES = 232448  # the most shared memory one program (CTA) may hold on sm_90 (227 KiB)
ARCH_SHARED_BYTES = {80: 166912, 86: 101376, 89: 101376, 90: SM90_SHARED_BYTES, 100: 232448, 120: 101376}
"""The most shared memory one program may hold, by compute capability: A100 (sm_80) 163 KiB; A10, A40, RTX 3090
(sm_86) and L40S, L4, RTX 4090 (sm_89) 99 KiB; H100, H200 (sm_90) and B200, GB200 (sm_100) 227 KiB; RTX 5090 and RTX
PRO 6000 Blackwell (sm_120) 99 KiB."""
PORTABLE_ARCHES = (80, 89, 100, 120)
"""The architectures `portable_binaries` compiles for: the A100's, the L40S's (whose 99 KiB of shared memory a
program is the sm_86 GPUs' too), the B200's and the RTX 5090's."""
HEADS_9B = HeadShape(hk=16, hv=32, dk=128, dv=128)


def missing_tools() -> list[str]:
    """The CUDA tools this module needs that Triton's wheel here does not ship."""
    return [tool for tool in ("ptxas", "cuobjdump", "nvdisasm") if not (TOOLS / tool).exists()]


def unavailable() -> str | None:
    """Why nothing can be compiled here, or None."""
    missing = missing_tools()
    if missing:
        return f"Triton's CUDA tools are not in its wheel here ({', '.join(missing)} missing from {TOOLS})"
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "TRITON_INTERPRET is set: this process's kernels are interpreted functions, not compilable ones"
    return None


def compile_for(fn, args: tuple, meta: dict, target: GPUTarget = H200):
    """``fn`` (a ``@triton.jit`` kernel) compiled for ``target`` with ``args`` bound as a launch would bind them."""
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, _ = binder(*args, **meta)
    options, signature, constexprs, attrs = fn._pack_args(backend, dict(meta), bound, specialization, None)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def binary_report(compiled) -> dict:
    """Registers per thread, stack bytes (spills), shared memory bytes, SASS instructions and their kinds."""
    with tempfile.TemporaryDirectory() as work:
        cubin = pathlib.Path(work) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(TOOLS / "cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([str(TOOLS / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if m:
            ops[m.group(1).split(".")[0]] += 1

    def field(name):
        m = re.search(rf"{name}:(\d+)", usage)
        return int(m.group(1)) if m else None

    return {"registers": field("REG"), "stack": field("STACK"), "local": field("LOCAL"),
            "shared": compiled.metadata.shared, "num_warps": compiled.metadata.num_warps,
            "instructions": sum(ops.values()), "ops": dict(ops.most_common())}


def captured_launch(bench: CaseBench, launch, ring: str | None = None, fold: bool = False) -> tuple:
    """(kernel, arguments, meta-parameters, grid) of ``launch`` on the bench's reference instance, captured where
    the launcher would start it (nothing runs); ``ring``: "read" or "write", a `PendingRing` round of four; ``fold``:
    the folded verify, committing a previous round's paths to every request's deepest node."""
    from bole_tune.kernels import PendingCommit, PendingPaths, PendingRing, tree_verify
    from bole_tune.kernels.verify import run as run_module
    from bole_tune.kernels.verify import tree_verify as tree_verify_module

    captured = {}

    def capture_for(kernel):
        def capture(key, grid, fast_args, build_args, build_meta):
            captured.update(fn=kernel.fn, args=build_args(), meta=build_meta(), grid=grid)
        return capture

    # both kernels' launches captured (a folded case's previous round may run the other), the last one kept
    originals, use = (run_module.FUSED.launch_keyed, run_module.RESIDENT.launch_keyed), tree_verify_module.use_triton
    run_module.FUSED.launch_keyed = capture_for(run_module.FUSED)
    run_module.RESIDENT.launch_keyed = capture_for(run_module.RESIDENT)
    tree_verify_module.use_triton = lambda device: True  # the Triton path, on CPU tensors
    try:
        tree, x = bench.reference_instance()
        if ring:
            pending = PendingRing(x.state.shape[0], 4, tree.depth + 1, tree.num_nodes, tree.num_requests, "cpu")
            step = pending.begin(tree, write=ring == "write")
            tree_verify(*x.args(tree), validate=False, launch=launch,
                        ring=step.layer(pending.results(bench.case.shape, bench.case.dtype)))
        elif fold:
            previous = tree_verify(*x.args(tree), validate=False, launch=bench.launch())  # its buffers, never run
            paths = PendingPaths.between_rounds(tree, bench.deepest(tree), x.state_indices, x.state_indices,
                                                x.state.shape[0])
            tree_verify(*x.args(tree), validate=False, launch=launch, pending=PendingCommit(paths, previous))
        else:
            tree_verify(*x.args(tree), validate=False, launch=launch)
    finally:
        (run_module.FUSED.launch_keyed, run_module.RESIDENT.launch_keyed), tree_verify_module.use_triton = originals, use
    if not captured:
        raise RuntimeError(f"{launch}: tree_verify launched nothing to capture")
    meta = dict(captured["meta"])
    if "GRAM_DTYPE" in meta:  # the GPU's operands: the inputs' own (the interpreter's fp32 for bf16 is a CPU choice)
        meta["GRAM_DTYPE"] = {torch.bfloat16: triton.language.bfloat16, torch.float16: triton.language.float16,
                              torch.float32: triton.language.float32}[bench.case.dtype]
    if "DOT_PRECISION" in meta:
        meta["DOT_PRECISION"] = dot_precision(bench.case.dtype)
    return captured["fn"], captured["args"], meta, captured["grid"]


@dataclass(frozen=True)
class ShippedCase:
    """A launch of the shipped database at one shape: ``stack`` None takes the planner's stacked-rows choice."""

    name: str
    batch: int
    tree_size: int
    kind: str
    fold: bool = False
    ring: str | None = None
    stack: bool | None = None
    heads: HeadShape = HEADS_9B


SHIPPED_CASES = (
    ShippedCase("B1-chain4", 1, 4, "chain"),
    ShippedCase("B16-chain4", 16, 4, "chain"),
    ShippedCase("B16-chain4-two-tiles", 16, 4, "chain", stack=False),
    ShippedCase("B16-tree64", 16, 64, "random"),
    ShippedCase("B4-tree16", 4, 16, "random"),
    ShippedCase("B32-chain8-folded", 32, 8, "chain", fold=True),
    ShippedCase("B32-chain8-ring-read", 32, 8, "chain", ring="read"),
    ShippedCase("B32-chain8-ring-write", 32, 8, "chain", ring="write"),
)


def entry_cases(slug: str = "nvidia-h200") -> list[ShippedCase]:
    """One case per verify entry of the shipped database for ``slug`` (its heads, its buckets' largest batch and
    tree, random trees of depth <= 8; a ``-ring`` entry as a ring's write round): every launch the database can
    hand `tree_verify` at a bucket's edge."""
    data = database.load(database.SHIPPED_DIR / f"{slug}.yaml")
    cases = []
    for name, entry in sorted(data["configs"].items()):
        key = ShapeKey.from_dict(entry["key"])
        cases.append(ShippedCase(name, key.batch_bucket, key.tree_bucket, "random", fold=key.fold,
                                 ring="write" if key.ring else None, heads=key.heads))
    return cases


def shipped_launch(bench: CaseBench, fold: bool = False, ring: bool = False, slug: str = "nvidia-h200"):
    """The launch `tree_verify(config=None)` runs for the bench's case on ``slug``, from the shipped database."""
    c = bench.case
    key = ShapeKey(heads=c.shape, dtype=dtype_name(c.dtype),
                   tree_bucket=tree_bucket(c.tree_size), batch_bucket=batch_bucket(c.batch), fold=fold and not ring,
                   ring=ring)
    decision = decide(key, slug, "nearest", directory=database.SHIPPED_DIR)
    return bench.launch(config=decision.config, tuned_on=decision.kernel, fold=fold or ring, ring=ring)


def shipped_binaries(cases=SHIPPED_CASES) -> list[dict]:
    """Each case's launch compiled for sm_90, with its `binary_report`."""
    reason = unavailable()
    if reason:
        raise RuntimeError(reason)
    rows = []
    for case in cases:
        bench = CaseBench(BenchCase(case.heads, case.batch, case.tree_size, torch.bfloat16, 8, kind=case.kind), "cpu")
        launch = shipped_launch(bench, fold=case.fold, ring=case.ring == "write")
        if case.stack is not None:
            launch = launch.replace(stack_qk=case.stack)
        fn, args, meta, grid = captured_launch(bench, launch, case.ring, case.fold)
        rows.append({"case": case.name, "variant": launch.variant, "config": str(launch.config),
                     "stack_qk": launch.stack_qk, "fold": bool(meta.get("FOLD")), "ring": bool(meta.get("RING")),
                     "grid": list(grid), **binary_report(compile_for(fn, args, meta))})
    return rows


@dataclass(frozen=True)
class CommitCase:
    """A commit launch: ``layers`` 1 is `tree_commit`'s, more `tree_commit_layers`'s (one binary serves every layer
    count above 1 and every batch: neither is specialised); ``scan_block``, ``first_by_pointer`` and ``path_table``
    set the commit's switches (`tree_commit.SCAN_BLOCK`, `tree_commit.TMA_FIRST_BY_POINTER`,
    `tree_commit.PATH_TABLE_MIN_BLOCK`) for this launch (``first_by_pointer`` and ``path_table`` None: as shipped)."""

    name: str
    heads: HeadShape
    dtype: str
    tree_size: int
    layers: int
    config: CommitConfig
    scan_block: int | None = None
    first_by_pointer: bool | None = None
    path_table: bool | None = None


SWITCH_ENTRY = "Hv32-Hk16-dk128-dv128-bf16-T64-B16-L24"  # the 9B's all-layer commit at B=16 with 64-node trees


def commit_switch_cases(slug: str = "nvidia-h200") -> list[CommitCase]:
    """The shipped database's `SWITCH_ENTRY` launch with its path scanned (16, 32 and 64 wide) instead of read from the
    table, and scanned 32 wide with its first state tile read by TMA instead of by pointers."""
    config = CommitConfig(**database.load(database.SHIPPED_DIR / f"{slug}.yaml")["commit_configs"][SWITCH_ENTRY]["config"])
    return [
        CommitCase("B16-T64-L24-scan16", HEADS_9B, "bf16", 64, 24, config, scan_block=16, path_table=False),
        CommitCase("B16-T64-L24-scan32", HEADS_9B, "bf16", 64, 24, config, path_table=False),
        CommitCase("B16-T64-L24-scan64", HEADS_9B, "bf16", 64, 24, config, scan_block=64, path_table=False),
        CommitCase("B16-T64-L24-scan32-first-by-tma", HEADS_9B, "bf16", 64, 24, config, first_by_pointer=False,
                   path_table=False),
    ]


def commit_entry_cases(slug: str = "nvidia-h200") -> list[CommitCase]:
    """One case per distinct commit binary among the shipped database's ``commit_configs`` for ``slug``: a binary
    depends on the config, the heads, the dtype, the node block (the tree bucket's) and whether one layer or more is
    committed, not on the batch."""
    data = database.load(database.SHIPPED_DIR / f"{slug}.yaml")
    cases = {}
    for name, entry in sorted(data["commit_configs"].items()):
        k = entry["key"]
        heads = HeadShape(hk=k["hk"], hv=k["hv"], dk=k["dk"], dv=k["dv"])
        config = CommitConfig(**entry["config"])
        binary = (heads, k["dtype"], node_block(k["tree_bucket"]), k["layers"] > 1, config)
        cases.setdefault(binary, CommitCase(name, heads, k["dtype"], k["tree_bucket"], k["layers"], config))
    return list(cases.values())


def captured_commit(case: CommitCase) -> tuple:
    """(kernel, arguments, meta-parameters, grid) of ``case``'s launch, captured where the launcher would start it
    from a CPU call with CPU tensors of the launch's dtypes and alignments (nothing runs), TMA loads built as on an
    sm_90 GPU (`tree_commit.TMA_OFF_GPU`)."""
    from bole_tune.kernels import LayerResults, tree_commit, tree_commit_layers
    from bole_tune.kernels.verify import tree_commit as commit_module
    from bole_tune.kernels.verify.pending import path_width
    from bole_tune.workloads import make_tree

    captured = {}

    def capture(key, grid, fast_args, build_args, build_meta):
        captured.update(args=build_args(), meta=build_meta(), grid=grid)

    h, dtype = case.heads, torch_dtype(case.dtype)
    # one request's tree of the bucket's size and of a drafter's depth (<= 8): the node block and the path table's
    # width as the engine's trees give them
    tree = make_tree([case.tree_size], "random", max_depth=8, seed=0, device="cpu")
    layers = 1 if case.layers == 1 else 2  # the layer count is a grid size, not a kernel argument
    states = torch.empty(layers, 2, h.hv, h.dv, h.dk)
    results = LayerResults.empty(layers, tree, h, dtype, "cpu")
    slots, accepted = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    saved = (commit_module.COMMIT.launch_keyed, commit_module.use_triton, commit_module.TMA_OFF_GPU,
             commit_module.SCAN_BLOCK, commit_module.TMA_FIRST_BY_POINTER, commit_module.PATH_TABLE_MIN_BLOCK,
             commit_module.pending_path_rows)
    commit_module.COMMIT.launch_keyed, commit_module.use_triton = capture, (lambda device: True)
    commit_module.TMA_OFF_GPU, commit_module.SCAN_BLOCK = True, case.scan_block
    if case.first_by_pointer is not None:
        commit_module.TMA_FIRST_BY_POINTER = case.first_by_pointer
    if case.path_table is not None:
        commit_module.PATH_TABLE_MIN_BLOCK = 16 if case.path_table else None
    # the table as its own launch would make it (its kernel is compiled with `small_binaries`)
    commit_module.pending_path_rows = lambda tree, accepted, request_map: torch.full(
        (len(request_map), path_width(tree)), -1, dtype=torch.int32)
    try:
        if case.layers == 1:
            tree_commit(states[0], slots, results.layer(0, tree), accepted, validate=False, config=case.config)
        else:
            tree_commit_layers(states, slots, results, tree, accepted, validate=False, config=case.config)
    finally:
        (commit_module.COMMIT.launch_keyed, commit_module.use_triton, commit_module.TMA_OFF_GPU,
         commit_module.SCAN_BLOCK, commit_module.TMA_FIRST_BY_POINTER, commit_module.PATH_TABLE_MIN_BLOCK,
         commit_module.pending_path_rows) = saved
    if not captured:
        raise RuntimeError(f"{case.name}: the commit launched nothing to capture")
    return commit_module.tree_commit_kernel, captured["args"], captured["meta"], captured["grid"]


def commit_binaries(cases) -> list[dict]:
    """Each commit case compiled for sm_90, with its `binary_report` and the switches its meta-parameters show."""
    reason = unavailable()
    if reason:
        raise RuntimeError(reason)
    rows = []
    for case in cases:
        fn, args, meta, grid = captured_commit(case)
        rows.append({"case": case.name, "config": case.config.text, "layers": case.layers,
                     "tree_size": case.tree_size, "B_T": meta["B_T"], "tma": bool(meta["TMA"]),
                     "first_by_pointer": bool(meta["TMA_FIRST_BY_POINTER"]), "path_table": bool(meta["PATH_TABLE"]),
                     "product": meta["PRODUCT"],
                     **binary_report(compile_for(fn, args, meta))})
    return rows


def _small_launches() -> dict:
    """Each of the other kernels' launches as an engine's call makes it (9B heads, bf16, 16 requests of 8-node trees),
    captured where it would start (nothing runs): ``{name: (kernel, arguments, meta-parameters)}``. The calls run with
    ``TRITON_INTERPRET=1`` set for their duration only, so that their wrappers take the Triton path on CPU tensors;
    the kernels themselves were made by this process without it (compilable functions)."""
    from triton.runtime.jit import JITFunction

    from bole_tune.kernels import PendingPaths, PendingRing, gdn_gates, serial_verify, tree_conv, tree_conv_commit
    from bole_tune.kernels.launcher import FastLauncher
    from bole_tune.kernels.tree_build import build_tree_tables
    from bole_tune.workloads import make_inputs, make_tree

    captured, current = {}, [None]

    def keep(fn, args, meta):
        captured.setdefault(current[0], (fn, tuple(args), dict(meta)))

    saved = (FastLauncher.__call__, FastLauncher.launch_keyed, JITFunction.run, os.environ.get("TRITON_INTERPRET"))
    FastLauncher.__call__ = lambda self, grid, *args, **meta: keep(self.fn, args, meta)
    FastLauncher.launch_keyed = lambda self, key, grid, fast, args, meta: keep(self.fn, args(), meta())
    JITFunction.run = lambda self, *args, grid, warmup, **meta: keep(self, args, meta)
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        tree = make_tree([8] * 16, "random", max_depth=8, seed=5, device="cpu")
        h = HEADS_9B
        x = make_inputs(tree, h.hk, h.hv, h.dk, h.dv, torch.bfloat16, "cpu", seed=5)
        accepted = torch.full((16,), 3, dtype=torch.int32)
        channels, width = 2 * h.hk * h.dk + h.hv * h.dv, 4
        conv_x = torch.empty(tree.num_nodes, channels, dtype=torch.bfloat16)
        conv_state = torch.empty(32, channels, width - 1, dtype=torch.bfloat16)
        ring = PendingRing(x.state.shape[0], 3, tree.depth + 1, tree.num_nodes, 16, "cpu")
        calls = {
            "serial_verify": lambda: serial_verify(*x.args(tree), validate=False),
            "pending_path_rows": lambda: PendingPaths(tree, accepted, torch.arange(16, dtype=torch.int32)),
            "ring_append": lambda: ring.end(ring.begin(tree), x.state_indices, accepted, validate=False),
            "tree_build": lambda: build_tree_tables(torch.zeros(16, 8, dtype=torch.int32)),
            "gdn_gates": lambda: gdn_gates(torch.empty(tree.num_nodes, h.hv, dtype=torch.bfloat16),
                                           torch.empty(tree.num_nodes, h.hv, dtype=torch.bfloat16),
                                           torch.zeros(h.hv), torch.zeros(h.hv), validate=False),
            "tree_conv": lambda: tree_conv(conv_x, conv_state, torch.empty(channels, width, dtype=torch.bfloat16),
                                           x.state_indices, tree, validate=False),
            "tree_conv_commit": lambda: tree_conv_commit(conv_state, x.state_indices, conv_x, tree, accepted,
                                                         validate=False),
        }
        for name, call in calls.items():
            current[0] = name
            call()
    finally:
        FastLauncher.__call__, FastLauncher.launch_keyed, JITFunction.run = saved[:3]
        if saved[3] is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved[3]
    missing = set(calls) - set(captured)
    if missing:
        raise RuntimeError(f"launched nothing to capture: {', '.join(sorted(missing))}")
    return captured


def small_binaries() -> list[dict]:
    """The other kernels (serial verify, path table, ring append, tree build, gates, convolution and its commit)
    compiled for sm_90, with their `binary_report`."""
    reason = unavailable()
    if reason:
        raise RuntimeError(reason)
    return [{"case": name, "kernel": fn.__name__, **binary_report(compile_for(fn, args, meta))}
            for name, (fn, args, meta) in _small_launches().items()]


@dataclass(frozen=True)
class PortableCase:
    """A launch `tree_verify(config=None)` runs on a GPU without a tuned database (the planner's untuned rule: the
    default tiles, the variant by batch and tree size, no Gluon verify): ``round`` "verify", "fold" (a folded verify),
    "read" or "write" (a `PendingRing` round of four)."""

    name: str
    batch: int
    tree_size: int
    kind: str
    round: str = "verify"
    dtype: str = "bf16"


PORTABLE_CASES = (
    PortableCase("B1-chain4", 1, 4, "chain"),
    PortableCase("B1-chain4-folded", 1, 4, "chain", "fold"),
    PortableCase("B16-chain8-ring-read", 16, 8, "chain", "read"),
    PortableCase("B16-chain8-ring-write", 16, 8, "chain", "write"),
    PortableCase("B4-tree16", 4, 16, "random"),
    PortableCase("B16-tree64", 16, 64, "random"),
    PortableCase("B16-tree64-ring-write", 16, 64, "random", "write"),
    PortableCase("B2-tree256", 2, 256, "random"),
    PortableCase("B2-tree256-folded", 2, 256, "random", "fold"),
    PortableCase("B16-tree64-fp16", 16, 64, "random", dtype="fp16"),
    PortableCase("B4-tree16-fp32", 4, 16, "random", dtype="fp32"),
)

PORTABLE_COMMITS = tuple(
    CommitCase(f"commit-{dtype}-T{tree}-B{batch}-L{layers}", HEADS_9B, dtype, tree, layers,
               default_commit_config(layers * batch * HEADS_9B.hv, HEADS_9B.dk, HEADS_9B.dv))
    for dtype, tree, batch, layers in (("bf16", 8, 1, 1), ("bf16", 64, 16, 24), ("fp32", 8, 16, 24)))
"""The commit's untuned fallback (`config.default_commit_config`, what a GPU without a tuned database launches), one
layer at one request and all 24 layers at 16: pointer loads (TMA is sm_90's)."""


def portable_binaries(arches=PORTABLE_ARCHES, cases=PORTABLE_CASES, commits=PORTABLE_COMMITS,
                      others: bool = True) -> list[dict]:
    """What a GPU without a tuned database runs (an A100, an L40S: ``tree_verify(config=None)``'s untuned launches,
    the commit's fallback, the other kernels) compiled for each architecture of ``arches``, with its
    `binary_report`, the architecture and the most shared memory one of its programs may hold."""
    reason = unavailable()
    if reason:
        raise RuntimeError(reason)
    launches = []  # (row, (kernel, arguments, meta-parameters), the fused fallback's or None)
    for case in cases:
        dtype = torch_dtype(case.dtype)
        bench = CaseBench(BenchCase(HEADS_9B, case.batch, case.tree_size, dtype, 8, kind=case.kind), "cpu")
        launch = bench.launch(fold=case.round == "fold", ring=case.round == "write")
        ring, fold = case.round if case.round in ("read", "write") else None, case.round == "fold"
        fallback = None
        if launch.variant != "fused":  # what the planner runs where the self-check's compile fails
            fallback = captured_launch(bench, Launch("fused", launch.config, launch.node_block), ring, fold)[:3]
        launches.append(({"case": case.name, "kernel": launch.variant, "config": str(launch.config)},
                         captured_launch(bench, launch, ring, fold)[:3], fallback))
    for case in commits:
        launches.append(({"case": case.name, "kernel": "commit", "config": case.config.text},
                         captured_commit(case)[:3], None))
    if others:
        for name, (fn, args, meta) in _small_launches().items():
            launches.append(({"case": name, "kernel": fn.__name__, "config": ""}, (fn, args, meta), None))
    rows = []
    for arch in arches:
        target = GPUTarget("cuda", arch, 32)
        for row, launch, fallback in launches:
            row = {**row, "arch": arch, "shared_limit": ARCH_SHARED_BYTES[arch], "fallback": ""}
            try:
                report = binary_report(untrapped(compile_for(*launch, target)))
            except Exception as error:  # noqa: BLE001 - a compile failure the planner falls back from, or not
                if fallback is None:
                    raise
                first = (str(error).splitlines() or [""])[0]
                row.update(kernel="fused", fallback=f"{row['kernel']} did not compile ({type(error).__name__}: "
                                                    f"{first})")
                report = binary_report(untrapped(compile_for(*fallback, target)))
            rows.append({**row, **report})
    return rows


def untrapped(compiled):
    """``compiled``, unless the compiler turned its body into a trap (`launcher.refuse_trapped`: what the launcher
    refuses on a GPU), which raises."""
    if traps(compiled):
        raise RuntimeError(f"compiled for {compiled.metadata.target} to a trap")
    return compiled


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    parser.add_argument("--every-entry", action="store_true",
                        help="every verify entry of the shipped database instead of the issue-17 shapes")
    parser.add_argument("--commits", action="store_true",
                        help="every distinct commit launch of the shipped database and the commit's switches instead")
    parser.add_argument("--others", action="store_true",
                        help="the other kernels (serial verify, path table, ring append, tree build, gates, "
                        "convolution)")
    parser.add_argument("--portable", action="store_true",
                        help="what a GPU without a tuned database runs (untuned verify launches, the commit's fallback, "
                        "the other kernels), for sm_80, sm_89, sm_100 and sm_120")
    args = parser.parse_args(argv)
    reason = unavailable()
    if reason:
        parser.exit(2, f"python -m bole_tune.binaries: cannot compile here: {reason}\n")
    if args.portable:
        rows, line = portable_binaries(), "sm_{arch} {case:32s} {kernel:26s} {config:32s} {fallback}"
    elif args.others:
        rows, line = small_binaries(), "{case:20s} {kernel:28s}"
    elif args.commits:
        rows = commit_binaries([*commit_entry_cases(), *commit_switch_cases()])
        line = ("{case:40s} {config:20s} B_T={B_T:<3d} tma={tma!s:5s} first_by_pointer={first_by_pointer!s:5s} "
                "path_table={path_table!s:5s}")
    else:
        rows = shipped_binaries(entry_cases() if args.every_entry else SHIPPED_CASES)
        line = "{case:24s} {variant:8s} {config:32s} stack_qk={stack_qk!s:5s} fold={fold!s:5s} ring={ring!s:5s}"
    if args.json:
        print(json.dumps(rows))
        return
    for r in rows:
        print(line.format(**r) + " registers={registers} stack={stack} shared={shared} instructions={instructions}"
              .format(**r))


if __name__ == "__main__":
    main()
