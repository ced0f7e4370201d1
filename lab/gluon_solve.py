"""Issue 17: the Gluon verify's factors by doubling against level sweeps (H200, 9B heads, bf16, 64-node trees).

The kernel solves ``X = (I + G)^-1 = sum_m A^m`` (``A = -G``, nilpotent: ``A^m = 0`` past the tree's depth ``d``).
Level sweeps ``Y <- A (I + Y)`` take ``d`` dependent wgmma steps (3.4 us of a program's 21.8 at B=16 with depth 8,
`lab/gluon_phases.py`). By doubling, ``X = (I + T_0)(I + T_1) ... (I + T_{L-1})`` with ``T_0 = A``,
``T_l = T_{l-1}^2`` and ``2^L > d``: ``T_l`` squared and ``P <- P (I + T_{l-1})`` issued together, so ``L`` dependent
steps: 4 for depth 8, 3 for depths 4-7.

Measured in the thirty-first session (BENCHMARKS.md), doubling was 2.1-2.9 us faster a B=16 round of the ring of
three and as accurate on the GPU's random trees, so `gluon.solve_factors` now doubles; the sweeps are kept here
(`SOLVE_SWEEPS`) as the variant "sweeps", to re-measure against.

    python3 lab/gluon_solve.py --emulate        # CPU: both solves' rounding emulated against float64
    python3 lab/gluon_solve.py --compile-only   # CPU: each variant compiled for sm_90
    python3 lab/gluon_solve.py [--batch 16 --batch 32] [--variant sweeps] [--turns 2] [--json OUT]   # H200

Variants (`PATCHES`, joined by +): "sweeps" (the level sweeps in place of the doubling), and "early-corrections" (a
read round's corrections issued with the Gram products: no faster on the H200); by default each and both.

On the GPU the shipped kernel's source is copied with the variant's patches and launched in place of the shipped one
through `run.run_launch` (both through Triton's own launch, so they differ only in the patches); each is checked
against float64 (the verify; a ring of three over four rounds: outputs and flushed slots), then the verify and a ring
of three's rounds are timed in alternating turns (`CaseBench`, one CUDA graph over rotating input sets).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch

from bole_tune.shapes import HeadShape

HEADS_9B = HeadShape(hk=16, hv=32, dk=128, dv=128)
LAYERS = 24
TOLERANCE = 5e-3

SOLVE_SWEEPS = '''
    @gluon.jit
    def solve_sweeps(w_smem, m_smem, x_smem, b_qk, b_kk, m_anc, o_i, o_j, beta_i, beta_j, r_q_i, r_k_i, r_k_j,
                      decay, p_depth, zeros_t):
        """The factors as shipped before doubling: ``G`` (negated) and ``C`` first, then
        ``X = (I + G)^-1 = I + Y`` by level sweeps ``Y <- -G (I + Y)`` (fp16 operands, fp32 accumulation; ``G`` links
        a node to its proper ancestors only), leaving ``W = X D_beta`` in ``w_smem`` and ``M = C X D_beta`` in
        ``m_smem`` (``x_smem`` the sweeps' scratch). As many sweeps as the tree's block depth at ``p_depth``."""
        w_smem.store(gl.where(m_anc & (o_i[:, None] != o_j[None, :]),
                              -(beta_i * r_k_i)[:, None] * decay * r_k_j[None, :] * b_kk, 0.0).to(gl.float16))
        m_smem.store((r_q_i[:, None] * decay * r_k_j[None, :] * b_qk).to(gl.float16))
        b_y = zeros_t
        for _ in range(gl.load(p_depth)):
            gl.thread_barrier()
            x_smem.store(gl.where(o_i[:, None] == o_j[None, :], 1.0, b_y).to(gl.float16))
            fence_async_shared()
            gl.thread_barrier()
            b_y = warpgroup_mma(w_smem, x_smem, zeros_t, use_acc=False)
        gl.thread_barrier()
        b_x = gl.where(o_i[:, None] == o_j[None, :], 1.0, b_y)
        x_smem.store(b_x.to(gl.float16))
        fence_async_shared()
        gl.thread_barrier()
        b_m = warpgroup_mma(m_smem, x_smem, zeros_t, use_acc=False) * beta_j[None, :]
        gl.thread_barrier()
        w_smem.store((b_x * beta_j[None, :]).to(gl.float16))
        m_smem.store(b_m.to(gl.float16))
        fence_async_shared()
        gl.thread_barrier()
'''


EARLY_ISSUE_AT = """        if RING or FOLD:
            # what the tokens' weights are worked out from, requested now"""
EARLY_ISSUE = """        if RING:  # the corrections' products with the Gram products (their keys came with q and k)
            b_dq = gl.zeros([B_T, B_P], gl.float32, layout=MMA_P)
            b_dk = gl.zeros([B_T, B_P], gl.float32, layout=MMA_P)
            for c in gl.static_range(NK):
                b_dq = warpgroup_mma(q_smem.index(c), kp_smem.index(c).permute((1, 0)), b_dq, is_async=True)
                b_dk = warpgroup_mma(k_smem.index(c), kp_smem.index(c).permute((1, 0)), b_dk, is_async=True)
"""
LATE_ISSUE = """            b_dq = gl.zeros([B_T, B_P], gl.float32, layout=MMA_P)
            b_dk = gl.zeros([B_T, B_P], gl.float32, layout=MMA_P)
            for c in gl.static_range(NK):
                b_dq = warpgroup_mma(q_smem.index(c), kp_smem.index(c).permute((1, 0)), b_dq, is_async=True)
                b_dk = warpgroup_mma(k_smem.index(c), kp_smem.index(c).permute((1, 0)), b_dk, is_async=True)
            b_dq, b_dk = warpgroup_mma_wait(num_outstanding=0, deps=(b_dq, b_dk))
"""
PATCHES = ("sweeps", "early-corrections")
"""What `patched_source` can change: the factors by level sweeps (`SOLVE_SWEEPS`); a read round's corrections
``[Q; K] K_p^T`` issued with the Gram products instead of after their wait (0.8-0.9 us a program after it at B=16,
`lab/gluon_phases.py`; compiled for sm_90: no spill at 16 entries, 16 bytes of stack at 32)."""


def patched_source(patches: tuple) -> str:
    """The shipped kernel's source with ``patches`` (of `PATCHES`) applied."""
    from bole_tune.kernels.verify import gluon

    src = Path(gluon.__file__).read_text()
    if "early-corrections" in patches:
        if src.count(EARLY_ISSUE_AT) != 1 or src.count(LATE_ISSUE) != 1:
            raise SystemExit("the kernel changed: its corrections are not where this script expects")
        src = src.replace(EARLY_ISSUE_AT, EARLY_ISSUE + EARLY_ISSUE_AT, 1)
        wait = "            b_dq, b_dk = warpgroup_mma_wait(num_outstanding=0, deps=(b_dq, b_dk))\n"
        src = src.replace(LATE_ISSUE, wait, 1)
    if "sweeps" in patches:
        src = sweeps(src)
    return src.replace("from ..common import LOG_DECAY_FLOOR", "from bole_tune.kernels.common import LOG_DECAY_FLOOR")


def sweeps(src: str) -> str:
    call = "        solve_factors(w_smem, m_smem, x_smem, b_qk, b_kk, m_anc,"
    if src.count(call) != 1 or "    @gluon.jit\n    def solve_factors(" not in src:
        raise SystemExit("the kernel changed: its solve_factors call or definition is not where this script expects")
    src = src.replace(call, "        solve_sweeps(w_smem, m_smem, x_smem, b_qk, b_kk, m_anc,", 1)
    definition = "    @gluon.jit\n    def solve_factors("
    return src.replace(definition, SOLVE_SWEEPS + "\n" + definition, 1)


def load_patched(patches: tuple):
    path = Path(tempfile.mkdtemp()) / f"gluon_{'_'.join(p.replace('-', '_') for p in patches)}.py"
    path.write_text(patched_source(patches))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def emulate(trials: int = 60) -> dict:
    """Both solves with the kernel's roundings (fp16 operands, fp32 accumulation) on 64-node random trees of depth
    <= 8 against ``(I + G)^-1`` in float64: the worst ``max |X - X64| / max |X64|``, for independent keys and for
    keys sharing a common direction (larger ``G``), ``beta`` uniform or 1."""
    from bole_tune.workloads import make_tree

    def f16(x):
        return x.to(torch.float16).to(torch.float64)

    def f32(x):
        return x.to(torch.float32).to(torch.float64)

    gen = torch.Generator().manual_seed(0)
    worst = {}
    for trial in range(trials):
        tree = make_tree([64], "random", max_depth=8, seed=trial, device="cpu")
        parents = tree._host_parents[0]
        n = len(parents)
        anc = torch.zeros(n, n, dtype=torch.bool)
        depth = [0] * n
        for i, p in enumerate(parents):
            depth[i] = 0 if p < 0 else depth[p] + 1
            j = p
            while j >= 0:
                anc[i, j], j = True, parents[j]
        d = max(depth)
        shared = trial % 3  # 0: independent keys; 1, 2: a common direction of that weight
        k = torch.randn(n, 128, dtype=torch.float64, generator=gen) + shared * torch.randn(1, 128, dtype=torch.float64,
                                                                                          generator=gen)
        k = torch.nn.functional.normalize(k, dim=1)
        beta = torch.rand(n, dtype=torch.float64, generator=gen) if trial % 2 else torch.ones(n, dtype=torch.float64)
        g = -0.5 * torch.rand(n, dtype=torch.float64, generator=gen)
        logp = torch.zeros(n, dtype=torch.float64)
        for i, p in enumerate(parents):
            logp[i] = g[i] + (logp[p] if p >= 0 else 0.0)
        decay = torch.where(anc, torch.exp(logp[:, None] - logp[None, :]), torch.zeros(()))
        big_g = beta[:, None] * decay * (k @ k.T)
        eye = torch.eye(n, dtype=torch.float64)
        x64 = torch.linalg.inv(eye + big_g)
        a16 = f16(-big_g)
        y = torch.zeros(n, n, dtype=torch.float64)
        for _ in range(d):  # the shipped sweeps
            y = f32(a16 @ f16(torch.where(eye.bool(), 1.0, y)))
        swept = torch.where(eye.bool(), 1.0, y)
        t, p = a16, f32(eye + a16)  # the doubling: P = (I + T_0), then P (I + T_l) with T_l = T_{l-1}^2
        for _ in range(1, d.bit_length()):
            t = f16(f32(t @ t))
            p = f32(p + f16(p) @ t)
        key = f"keys shared {shared}, beta {'uniform' if trial % 2 else 1}"
        for name, x in (("sweeps", swept), ("doubling", p)):
            err = ((x - x64).abs().max() / x64.abs().max()).item()
            worst.setdefault(key, {}).setdefault(name, 0.0)
            worst[key][name] = max(worst[key][name], err)
    return worst


def levels_in_order(a: torch.Tensor, depth: int) -> torch.Tensor:
    """`gluon.solve_factors`' levels in the kernel's order and conditions, in float64 without rounding: ``X`` from
    ``A = -G`` of a forest ``depth`` deep (the two shared-memory buffers by turns, as in the kernel)."""
    buffers = {"w": a.clone(), "x": None}
    p = torch.eye(a.shape[0], dtype=a.dtype) + a
    for level in range(1, 7):
        src, dst = ("w", "x") if level % 2 == 1 else ("x", "w")
        if (1 << level) <= depth:
            square = buffers[src] @ buffers[src]
            if level >= 2:
                p = p + p @ buffers[src]
            buffers[dst] = square
        elif (1 << level) <= 2 * depth and level >= 2:
            p = p + p @ buffers[src]
    return p


def check_levels() -> int:
    """`levels_in_order` against ``(I + G)^-1`` for trees of every depth 0-63 (64 nodes: a chain that deep and random
    nodes under it): how many are wrong (beyond 1e-9)."""
    gen = torch.Generator().manual_seed(0)
    wrong = 0
    for depth in range(64):
        n = 64 if depth else 1
        parents, depths = [-1] + list(range(depth)), list(range(depth + 1))
        while len(parents) < n:
            p = int(torch.randint(0, len(parents), (), generator=gen))
            if depths[p] < depth:
                parents.append(p)
                depths.append(depths[p] + 1)
        big_g = torch.zeros(n, n, dtype=torch.float64)
        for i, p in enumerate(parents):
            while p >= 0:
                big_g[i, p] = 0.5 * torch.randn((), dtype=torch.float64, generator=gen).item()
                p = parents[p]
        x = torch.linalg.inv(torch.eye(n, dtype=torch.float64) + big_g)
        wrong += (levels_in_order(-big_g, depth) - x).abs().max().item() > 1e-9
    return wrong


def compile_only(variants: dict) -> None:
    """Each variant's modes compiled for sm_90 on the CPU (`gluon.compile_report`) beside the shipped kernel's."""
    from bole_tune.kernels.verify import gluon

    reports = {"shipped": gluon.compile_report(32),
               **{name: gluon.compile_report(32, fn=module.gluon_verify_kernel) for name, module in variants.items()}}
    for name, report in reports.items():
        for mode, r in report.items():
            print(f"{mode}, {name}: {r['registers']} registers, {r['stack']} B stack, {r['local']} B spilled, "
                  f"{r['shared']} B shared")


def on_gpu(variants: dict, batches: list, turns: int, repeats: int) -> list:
    from bole_tune.bench import BenchCase, CaseBench
    from bole_tune.kernels import tree_verify
    from bole_tune.kernels.verify import gluon, run as run_mod

    kernels = {"shipped": gluon.gluon_verify_kernel,
               **{name: module.gluon_verify_kernel for name, module in variants.items()}}
    chosen = ["shipped"]

    def launch(q, k, v, g, beta, pool, state_indices, tree, shape, res, config, ring=None):
        grid, a, meta = gluon.launch_args(q, k, v, g, beta, pool, state_indices, tree, shape, res, config, ring)
        kernels[chosen[0]][grid](*a, **meta)

    run_mod.gluon_launch = launch
    outs = []
    for batch in batches:
        bench = CaseBench(BenchCase(HEADS_9B, batch, 64, torch.bfloat16, 8, label="qwen3.5-9b", kind="random"), "cuda")
        read, write = bench.launch(), bench.launch(ring=True)
        out = {"batch": batch, "errors": {}, "us": {}}
        right = []
        for name in kernels:
            chosen[0] = name
            o, s = bench.ring_errors(read, write, rounds=3)
            v = bench.check(tree_verify, read)
            out["errors"][name] = {"verify": v, "ring outputs": o, "ring slots": s}
            wrong = max(o, s, v) > TOLERANCE
            print(f"B={batch} {name}: errors verify {v:.1e}, ring {o:.1e} / {s:.1e}"
                  + (" WRONG: not timed" if wrong else ""), flush=True)
            if not wrong:
                right.append(name)
        for turn in range(turns):
            for name in (right if turn % 2 == 0 else right[::-1]):
                chosen[0] = name
                row = out["us"].setdefault(name, {})
                row.setdefault("verify", []).append(bench.time_verify(tree_verify, read, repeats=repeats)[0].p50_us)
                t = bench.time_ring(3, LAYERS, repeats, read_launch=read, write_launch=write)
                for key in ("ring_reads", "ring_read", "ring_write", "round_ring"):
                    row.setdefault(key, []).append(t[key].p50_us)
                print(f"B={batch} turn {turn} {name}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in row.items()),
                      flush=True)
        outs.append(out)
    return outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, action="append")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--variant", action="append", help=f"patches joined by +, of {PATCHES} (default: each, "
                        "and both)")
    parser.add_argument("--emulate", action="store_true")
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.emulate:
        print(f"the kernel's levels in float64, trees of depth 0-63: {check_levels()} wrong")
        for key, row in emulate().items():
            print(f"{key}: " + ", ".join(f"{name} {err:.2e}" for name, err in row.items()))
        return
    variants = {"+".join(patches): load_patched(patches) for patches in
                [tuple(v.split("+")) for v in args.variant or ["sweeps", "early-corrections",
                                                               "sweeps+early-corrections"]]}
    if args.compile_only:
        compile_only(variants)
        return
    if not torch.cuda.is_available():
        sys.exit("no GPU here: run on the H200 (or --emulate, --compile-only)")
    outs = on_gpu(variants, args.batch or [16, 32], args.turns, args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps(outs, indent=1))
    for o in outs:
        print(f"\n| B={o['batch']} T=64, us (median of turns) | verify | read rounds | write | ring of 3 |")
        print("|---|---|---|---|---|")
        for name, row in o["us"].items():
            med = {k: sorted(v)[len(v) // 2] for k, v in row.items()}
            print(f"| {name} | {med['verify']:.2f} | {med['ring_reads']:.2f} | {med['ring_write']:.2f} | "
                  f"{med['round_ring']:.2f} |")


if __name__ == "__main__":
    main()
