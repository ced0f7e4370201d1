"""Where tree_verify's time goes on a GPU: variants that leave one stage out, timed side by side.

Usage (on the GPU machine, from the repository root):
    python3 scripts/kernel_lab.py --ablation OUT.json     stage ablations of the shipped kernel
    python3 scripts/kernel_lab.py OUT.json [--commit]     shipped kernel against the two-stage experiment
    python3 scripts/kernel_lab.py --factored OUT.json     fused against the factored experiment; commit tiles
    python3 scripts/kernel_lab.py --factored-ablation OUT.json   the factored experiment's stages patched out
    python3 scripts/kernel_lab.py --resident OUT.json     fused, factored and resident kernels across cases
    python3 scripts/kernel_lab.py --resident-lab OUT.json the resident kernel's stages patched out; value splits
    python3 scripts/kernel_lab.py --resident-cand OUT.json candidate resident kernels against the shipped one
    python3 scripts/kernel_lab.py --commit-cand OUT.json   tree_commit variants and launches, beside the copy floor
    python3 scripts/kernel_lab.py --split OUT.json         bf16 hi + lo state products against tf32, both kernels
    python3 scripts/kernel_lab.py --readout OUT.json       outputs-only verifier + replaying commit (experiment)
    python3 scripts/kernel_lab.py --maxnreg OUT.json       register caps on the resident and readout kernels
    ncu ... python3 scripts/kernel_lab.py --ncu            a few plain launches for Nsight Compute
Add --smoke to run either on the CPU interpreter at tiny shapes (proves the script runs).

Ablation variants are the shipped kernel's source with one textual patch, written to a temporary
module and launched with the shipped wrapper's arguments. Variants that drop a stage compute wrong
outputs: they are timed, never used. Differences of medians place the time of each stage (METHOD.md).
The two-stage and factored experiments (benchmarks/experiments/) split the verifier into a factor
kernel and a value kernel; BENCHMARKS.md records what they measured and why they were not shipped
(the resident kernel, kernels/tree_verify_resident.py, came out of the factored one).
Results of the 2026-11-29 runs: benchmarks/experiments/*.json.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import pathlib
import sys
import tempfile

import torch
from bole_tune.kernels import tree_verify as shipped_module_fn  # noqa: F401  (imports the package)
from bole_tune.kernels.common import (
    check_verify_inputs,
    dot_precision,
    gram_dtype,
    result_buffers,
    token_head_strides,
)

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.config import KernelConfig, node_block
from bole_tune.profiles import load_model

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "kernels" / "tree_verify.py"
EXPERIMENTS = ROOT / "benchmarks" / "experiments"

PATCHES = {
    "base": [],
    "nograms": [
        ("            b_qk = tl.dot(b_q.to(GRAM_DTYPE), tl.trans(b_k.to(GRAM_DTYPE)), b_qk, input_precision=DOT_PRECISION)\n", ""),
        ("            b_kk = tl.dot(b_k.to(GRAM_DTYPE), tl.trans(b_k.to(GRAM_DTYPE)), b_kk, input_precision=DOT_PRECISION)\n", ""),
    ],
    "nostate": [
        ("            b_qs, b_ks = state_products(b_q, b_k, b_s, b_qs, b_ks, DOT_PRECISION, GRAM_DTYPE, False)\n", ""),
        ("            b_s = tl.load(p_state + o_k[None, :])\n", ""),
    ],
    "nooutdot": [
        ("        b_o = tl.dot(b_c_ii, b_u, b_o, input_precision=DOT_PRECISION)\n", ""),
    ],
}


def load_variant(name: str, patches):
    text = SRC.read_text()
    for old, new in patches:
        assert old in text, (name, old)
        text = text.replace(old, new)
    return load_module(text, f"tv_{name}").tree_verify_fwd_kernel


def prepare(q, k, v, g, beta, state, state_indices, tree, scale, out):
    """What every lab wrapper does before its launch: checks, last-dim-contiguous inputs, result buffers."""
    shape = check_verify_inputs(q, k, v, g, beta, state, state_indices, tree, scale, False)
    q, k, v = (token_head_strides(x) for x in (q, k, v))
    return shape, q, k, v, result_buffers(shape, q[0].dtype, q[0].device, tree, out)


def make_verify(kernel, b_t_override=None, zero_depth=False):
    def verify(q, k, v, g, beta, state, state_indices, tree, scale=None, use_qk_l2norm=True, config=None,
               validate=False, out=None):
        shape, (q2, sq_n, sq_h), (k2, sk_n, sk_h), (v2, sv_n, sv_h), res = prepare(
            q, k, v, g, beta, state, state_indices, tree, scale, out)
        b_t = b_t_override or node_block(tree.max_tree_size)
        block_depth, max_blocks = tree.block_depths(b_t)
        if zero_depth:
            block_depth = torch.zeros_like(block_depth)
        kernel[(shape.dv // config.b_v, shape.hv, shape.num_requests)](
            q2, k2, v2, g, beta, state, state_indices,
            tree.offsets, tree.dfs_enter, tree.dfs_exit, block_depth,
            res.o, res.u, res.log_decay, res.k, res.k_scale,
            shape.scale, max_blocks, shape.hv, shape.hk,
            sq_n, sq_h, sk_n, sk_h, sv_n, sv_h,
            g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
            state.stride(0), state.stride(1), state.stride(2),
            D_K=shape.dk, D_V=shape.dv, B_T=b_t, B_K=config.b_k, B_V=config.b_v,
            USE_QK_L2NORM=bool(use_qk_l2norm), DOT_PRECISION=dot_precision(q.dtype), GRAM_DTYPE=gram_dtype(q),
            num_warps=config.num_warps, num_stages=config.num_stages)
        return res
    return verify


def label(c: KernelConfig) -> str:
    return f"{c.b_k}/{c.b_v}/{c.num_warps}/{c.num_stages}"


def ncu_case():
    """A few plain launches of the shipped kernels at 9B B=16 T=64, for ncu to read."""
    from bole_tune.kernels import tree_commit, tree_verify

    from bole_tune.workloads import make_inputs, make_tree

    shape = load_model("qwen3.5-9b").gdn()
    tree = make_tree([64] * 16, device="cuda")
    x = make_inputs(tree, shape.hk, shape.hv, shape.dk, shape.dv, torch.bfloat16, "cuda")
    accepted = torch.full((16,), 5, dtype=torch.int32, device="cuda")
    for _ in range(8):  # the database's config (the resident kernel at this case since the fourth session)
        res = tree_verify(*x.args(tree), validate=False)
        tree_commit(x.state, x.args(tree)[6], res, accepted, validate=False)
    torch.cuda.synchronize()


@functools.cache
def two_stage_module():
    return load_module((EXPERIMENTS / "two_stage_tree_verify.py").read_text(), "two_stage_tv")


def make_two_stage(factor=None, stages="fv"):
    """The two-stage experiment's verifier, stage 1's launch overridden, or one stage alone (timing)."""
    tv = two_stage_module()

    def verify(q, k, v, g, beta, state, state_indices, tree, scale=None, use_qk_l2norm=True, config=None,
               validate=False, out=None):
        shape, (q2, sq_n, sq_h), (k2, sk_n, sk_h), (v2, sv_n, sv_h), res = prepare(
            q, k, v, g, beta, state, state_indices, tree, scale, out)
        b_t = node_block(tree.max_tree_size)
        block_depth, max_blocks = tree.block_depths(b_t)
        f_b_k, f_warps, f_stages = factor or tv.factor_launch(b_t, shape.dk)
        key = (shape.num_requests, max_blocks, shape.hv, b_t, shape.num_nodes, shape.hk)
        if key not in SCRATCH:
            SCRATCH[key] = (torch.empty((2, shape.num_requests, max_blocks, shape.hv, b_t, b_t), device=q.device),
                            torch.empty((shape.num_nodes, shape.hk), device=q.device))
        factors, q_scale = SCRATCH[key]
        hv, hk, dk, dv = shape.hv, shape.hk, shape.dk, shape.dv
        if "f" in stages:
            tv.tree_factor_kernel[(max_blocks, hv, shape.num_requests)](
                q2, k2, g, beta, tree.offsets, tree.dfs_enter, tree.dfs_exit, block_depth,
                factors[0], factors[1], res.log_decay, res.k, res.k_scale, q_scale,
                shape.scale, max_blocks, hv, hk, sq_n, sq_h, sk_n, sk_h,
                g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
                D_K=dk, B_T=b_t, B_K=f_b_k, USE_QK_L2NORM=True, DOT_PRECISION=dot_precision(q.dtype),
                GRAM_DTYPE=gram_dtype(q), num_warps=f_warps, num_stages=f_stages)
        if "v" in stages:
            tv.tree_value_kernel[(dv // config.b_v, hv, shape.num_requests)](
                q2, k2, v2, beta, state, state_indices, tree.offsets, tree.dfs_enter, tree.dfs_exit,
                factors[0], factors[1], res.log_decay, res.k_scale, q_scale, res.o, res.u,
                max_blocks, hv, hk, sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, beta.stride(0), beta.stride(1),
                state.stride(0), state.stride(1), state.stride(2),
                D_K=dk, D_V=dv, B_T=b_t, B_K=config.b_k, B_V=config.b_v,
                DOT_PRECISION=dot_precision(q.dtype), GRAM_DTYPE=gram_dtype(q),
                num_warps=config.num_warps, num_stages=config.num_stages)
        return res
    return verify


SCRATCH = {}


def time_commits(bench, rows):
    """tree_commit's tile choices at one case (each request commits its deepest node)."""
    from bole_tune.kernels import tree_commit, tree_verify

    from bole_tune.timing import time_launches

    tree, pool, inputs, slots = bench.sets(64)
    results = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, validate=False,
                           config=KernelConfig(32, 64, 4, 2)) for i, x in enumerate(inputs)]
    depths, offsets = tree.node_depth.tolist(), tree.offsets.tolist()
    c = bench.case
    accepted = torch.tensor([max(range(c.tree_size), key=lambda n: depths[offsets[r] + n]) for r in range(c.batch)],
                            dtype=torch.int32, device=bench.device)
    for b_k, b_v, warps in [(128, 32, 4), (128, 16, 4), (128, 16, 2), (64, 32, 4), (128, 64, 8), (128, 128, 8),
                            (64, 64, 4), (32, 128, 4), (128, 8 * 2, 1), (64, 16, 2)]:
        def launch(i, b_k=b_k, b_v=b_v, warps=warps):
            tree_commit(pool, slots[i], results[i], accepted, validate=False, b_k=b_k, b_v=b_v, num_warps=warps)
        try:
            timing = time_launches(launch, len(inputs), bench.device, repeats=15)
        except Exception as exc:  # noqa: BLE001
            print("commit", b_k, b_v, warps, "failed", str(exc)[:120])
            continue
        rows.append({"kernel": "commit", "batch": c.batch, "tree": c.tree_size, "b_k": b_k, "b_v": b_v,
                     "warps": warps, "p50_us": round(timing.p50_us, 2)})
        print(f"commit B={c.batch} T={c.tree_size} {b_k}/{b_v}/{warps}: {timing.p50_us:.2f} us", flush=True)


def ablation(out_path: str):
    """Stage ablations of the shipped kernel at 9B shapes (B = 16, 1, 4; T = 64)."""
    shape = load_model("qwen3.5-9b").gdn()
    kernels = {name: load_variant(name, p) for name, p in PATCHES.items()}
    variants = {name: make_verify(kern) for name, kern in kernels.items()}
    variants["nochain"] = make_verify(kernels["base"], zero_depth=True)
    variants["bt32"] = make_verify(kernels["base"], b_t_override=32)
    variants["bt16"] = make_verify(kernels["base"], b_t_override=16)
    configs = [KernelConfig(32, 128, 8, 3), KernelConfig(32, 64, 4, 3), KernelConfig(32, 64, 8, 3),
               KernelConfig(16, 64, 2, 3), KernelConfig(32, 32, 4, 3), KernelConfig(32, 32, 8, 3)]
    cases = [(16, 64), (1, 64), (4, 64)]
    if "--smoke" in sys.argv:
        from bole_tune.profiles import GDNShape
        shape, configs, cases = GDNShape(2, 4, 32, 32), [KernelConfig(16, 16, 4, 1)], [(2, 40)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for batch, size in cases:
        bench = CaseBench(BenchCase(shape, batch, size, torch.bfloat16), device=device)
        for config in configs:
            for name, verify in variants.items():
                if name.startswith("bt") and int(name[2:]) >= node_block(size):
                    continue
                err = bench.error(verify, config) if name in ("base", "bt32", "bt16") else None
                timing, _ = bench.time_verify(verify, config, repeats=15)
                rows.append({"batch": batch, "tree": size, "config": label(config), "variant": name,
                             "p50_us": round(timing.p50_us, 2), "rel_error": err})
                print(f"B={batch:<3} T={size:<4} {label(config):<14} {name:<9} {timing.p50_us:8.2f} us"
                      + (f"  err {err:.1e}" if err is not None else ""), flush=True)
    pathlib.Path(out_path).write_text(json.dumps(rows, indent=1))


FACTORED_CONFIGS = [(b_k, b_v, w, st) for b_k, b_v, w, st in [
    (32, 32, 4, 2), (64, 32, 4, 2), (32, 32, 4, 3), (64, 32, 4, 3), (128, 32, 4, 1), (32, 32, 2, 2),
    (32, 16, 2, 2), (64, 16, 2, 2), (32, 16, 4, 3), (32, 64, 4, 2), (64, 64, 4, 2), (32, 64, 8, 2),
    (64, 64, 8, 3), (32, 64, 4, 3), (64, 128, 8, 2), (32, 128, 8, 3), (16, 32, 4, 3), (16, 64, 4, 4),
    (128, 64, 8, 1), (64, 32, 8, 2)]]


@functools.cache
def factored_module(source: str | None = None, name: str = "factored_tv"):
    """The factored experiment (benchmarks/experiments/factored_tree_verify.py), or a patched copy."""
    return load_module(source or (EXPERIMENTS / "factored_tree_verify.py").read_text(), name)


def factored(out_path: str):
    """The fused kernel (database config) against the factored experiment's value-kernel configs."""
    from bole_tune.kernels import tree_verify

    fm = factored_module()
    smoke = "--smoke" in sys.argv
    device = "cuda" if torch.cuda.is_available() else "cpu"
    models = {m: load_model(m).gdn() for m in ("qwen3.5-9b", "qwen3.5-27b", "qwen3.5-122b-a10b")}
    cases = [("qwen3.5-9b", 16, 64), ("qwen3.5-9b", 1, 64), ("qwen3.5-9b", 4, 64), ("qwen3.5-9b", 8, 64),
             ("qwen3.5-9b", 2, 64), ("qwen3.5-9b", 16, 16), ("qwen3.5-9b", 16, 32), ("qwen3.5-9b", 32, 64),
             ("qwen3.5-27b", 16, 64), ("qwen3.5-122b-a10b", 16, 64), ("qwen3.5-122b-a10b", 1, 64),
             ("qwen3.5-122b-a10b", 4, 32)]
    configs = [KernelConfig(*c) for c in FACTORED_CONFIGS]
    if "--first" in sys.argv:  # the first case only, with the configs that came out best there
        cases, configs = cases[:1], [KernelConfig(64, 64, 4, 2), KernelConfig(32, 32, 4, 3), KernelConfig(32, 64, 4, 2)]
    if smoke:
        from bole_tune.profiles import GDNShape
        models = {"tiny": GDNShape(2, 4, 32, 32)}
        cases, configs = [("tiny", 2, 20)], [KernelConfig(16, 16, 4, 1), KernelConfig(32, 32, 4, 2)]
    rows, best = [], {}

    fused = functools.partial(tree_verify, variant="fused")
    for model, batch, size in cases:
        bench = CaseBench(BenchCase(models[model], batch, size, torch.bfloat16), device=device)
        first = (model, batch, size) == cases[0]
        record(rows, bench, "fused", configs[0] if smoke else database_config(bench), fused)
        ranked = [KernelConfig(*map(int, c.split("/"))) for c, _ in sorted(best.items(), key=lambda kv: kv[1])[:8]]
        for config in configs if first else ranked:
            t = record(rows, bench, "factored", config, fm.tree_verify)
            if t is not None and first:
                best[label(config)] = t
        if first and not smoke and best:
            top = ranked[0] if ranked else KernelConfig(*map(int, min(best, key=best.get).split("/")))
            record(rows, bench, "f-only", top, functools.partial(fm.tree_verify, stages="f"), check=False)
            record(rows, bench, "v-only", top, functools.partial(fm.tree_verify, stages="v"), check=False)
            for warps in (4, 8, 16):
                record(rows, bench, f"fwarps{warps}", top, functools.partial(fm.tree_verify, factor_launch=warps))
        if (model, batch, size) == ("qwen3.5-9b", 16, 64) or smoke:
            commit_lab(bench, rows, smoke)
        pathlib.Path(out_path).write_text(json.dumps(rows, indent=1))


def record(rows, bench, name, config, verify, check=True, model=None) -> float | None:
    """Check (unless ``check`` is False), time and print one variant at one case; append its row.

    Returns the p50 in us, or None when it failed to run or its error is above `accepted_error`."""
    from bole_tune.bench import accepted_error

    c = bench.case
    row = {"model": model or str(c.shape), "batch": c.batch, "tree": c.tree_size, "variant": name,
           "config": label(config)}
    where = f"{row['model']:<18} B={c.batch:<3} T={c.tree_size:<4} {name:<10} {label(config):<12}"
    try:
        err = bench.error(verify, config) if check else None
        timing, _ = bench.time_verify(verify, config, repeats=15)
    except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result too
        print(f"{where} FAILED {str(exc)[:150]}")
        rows.append({**row, "error": str(exc)[:300]})
        return None
    rows.append({**row, "p50_us": round(timing.p50_us, 2), "rel_error": err})
    print(f"{where} {timing.p50_us:8.2f} us" + (f"  err {err:.1e}" if err is not None else ""), flush=True)
    return timing.p50_us if err is None or err <= accepted_error(c.dtype) else None


def database_config(bench) -> KernelConfig:
    """The config tree_verify(config=None) would launch for this case (from the tuning database)."""
    from bole_tune.kernels.common import VerifyShape
    from bole_tune.lookup import config_for

    c, (tree, pool, _, _) = bench.case, bench.sets(64)
    shape = VerifyShape(tree.num_nodes, c.batch, pool.shape[0], c.shape.hk, c.shape.hv, c.shape.dk, c.shape.dv, 1.0)
    return config_for(shape, c.dtype, tree, bench.device)


def commit_lab(bench, rows, smoke):
    """tree_commit's tiles and spans at one case, each checked against the closed form first."""
    from bole_tune.kernels import tree_commit, tree_verify
    from bole_tune.kernels.reference import commit_closed_form
    from bole_tune.timing import time_launches

    tree, pool, inputs, slots = bench.sets(64)
    results = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, validate=False)
               for i, x in enumerate(inputs)]
    depths, offsets = tree.node_depth.tolist(), tree.offsets.tolist()
    c = bench.case
    accepted = torch.tensor([max(range(c.tree_size), key=lambda n: depths[offsets[r] + n]) for r in range(c.batch)],
                            dtype=torch.int32, device=bench.device)
    choices = [(128, 32, 4, 32, 1), (128, 32, 4, 128, 2), (128, 32, 4, 128, 3), (128, 32, 4, 128, 4),
               (128, 16, 4, 128, 4), (128, 64, 4, 128, 3), (128, 32, 4, 64, 3), (64, 32, 4, 128, 3),
               (128, 16, 2, 128, 3), (128, 16, 2, 64, 3), (128, 32, 8, 128, 3), (64, 16, 2, 128, 4)]
    if smoke:
        choices = [(32, 16, 4, 32, 1), (32, 16, 4, 32, 2)]
    for b_k, b_v, warps, span, stages in choices:
        kw = dict(b_k=b_k, b_v=b_v, num_warps=warps, v_span=span, num_stages=stages)
        pristine, expected = pool.clone(), pool.clone()
        commit_closed_form(expected, slots[0], results[0], accepted, validate=False)
        update = (expected - pristine).norm()
        trial = pool.clone()
        tree_commit(trial, slots[0], results[0], accepted, validate=False, **kw)
        err = float((trial - expected).norm() / expected.norm())

        def launch(i, kw=kw):
            tree_commit(pool, slots[i], results[i], accepted, validate=False, **kw)
        try:
            timing = time_launches(launch, len(inputs), bench.device, repeats=15)
        except Exception as exc:  # noqa: BLE001
            print("commit", kw, "failed", str(exc)[:120])
            continue
        rows.append({"kernel": "commit", "batch": c.batch, "tree": c.tree_size, **kw,
                     "p50_us": round(timing.p50_us, 2), "rel_error": err})
        print(f"commit B={c.batch} T={c.tree_size} {kw}: {timing.p50_us:.2f} us err {err:.1e}", flush=True)


FACTOR_PATCHES = {
    "f-base": [],
    "f-nosweep": [("    for _ in range(0, tl.load(block_depth_ptr + i_r)):\n", "    for _ in range(0, 0):\n")],
    "f-1sweep": [("    for _ in range(0, tl.load(block_depth_ptr + i_r)):\n", "    for _ in range(0, 1):\n")],
    "f-nogram": [
        ("        b_qk = tl.dot(b_q.to(GRAM_DTYPE), tl.trans(b_k.to(GRAM_DTYPE)), b_qk, input_precision=DOT_PRECISION)\n", ""),
        ("        b_kk = tl.dot(b_k.to(GRAM_DTYPE), tl.trans(b_k.to(GRAM_DTYPE)), b_kk, input_precision=DOT_PRECISION)\n", "")],
    "f-nomat": [("    b_m = tl.dot(b_c, b_x, input_precision=DOT_PRECISION)\n", "    b_m = b_c + b_x\n")],
}
VALUE_PATCHES = {
    "v-base": [],
    "v-nostate": [
        ("        b_s = tl.load(p_state + o_k[None, :])\n", ""),
        ("        b_qs = tl.dot(b_q.to(tl.float32), tl.trans(b_s), b_qs, input_precision=DOT_PRECISION)\n",
         "        b_qs += tl.sum(b_q.to(tl.float32), axis=1)[:, None]\n"),
        ("        b_ks = tl.dot(b_k.to(tl.float32), tl.trans(b_s), b_ks, input_precision=DOT_PRECISION)\n",
         "        b_ks += tl.sum(b_k.to(tl.float32), axis=1)[:, None]\n")],
    "v-nosolve": [
        ("    b_u = tl.dot(b_w, b_r, input_precision=DOT_PRECISION)\n", "    b_u = b_r\n"),
        ("    b_o = tl.dot(b_m, b_r, a_q[:, None] * b_qs, input_precision=DOT_PRECISION)\n",
         "    b_o = a_q[:, None] * b_qs + b_r\n"),
        ("    b_w = tl.load(w_ptr + p_tt)\n", ""), ("    b_m = tl.load(m_ptr + p_tt)\n", "")],
    "v-bf16state": [
        ("        b_qs = tl.dot(b_q.to(tl.float32), tl.trans(b_s), b_qs, input_precision=DOT_PRECISION)\n",
         "        b_qs = tl.dot(b_q, tl.trans(b_s.to(b_q.dtype)), b_qs)\n"),
        ("        b_ks = tl.dot(b_k.to(tl.float32), tl.trans(b_s), b_ks, input_precision=DOT_PRECISION)\n",
         "        b_ks = tl.dot(b_k, tl.trans(b_s.to(b_k.dtype)), b_ks)\n")],
}


def compiled_stats(fn) -> str:
    """Registers, spills and shared memory of a jitted function's compiled variants (latest last)."""
    stats = []
    for caches in getattr(fn, "device_caches", {}).values():
        for kernel in caches[0].values():
            kernel._init_handles()
            stats.append(f"regs {kernel.n_regs} spills {kernel.n_spills} smem {kernel.metadata.shared}")
    return stats[-1] if stats else "?"


def factored_ablation(out_path: str):
    """Where the factored experiment's time goes: each kernel alone, with one stage patched out."""
    text = (EXPERIMENTS / "factored_tree_verify.py").read_text()
    smoke = "--smoke" in sys.argv
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def patched(name, patches):
        source = text
        for old, new in patches:
            assert old in source, (name, old)
            source = source.replace(old, new)
        return factored_module(source, f"tf_{name.replace('-', '_')}")

    if smoke:
        from bole_tune.profiles import GDNShape
        bench = CaseBench(BenchCase(GDNShape(2, 4, 32, 32), 2, 20, torch.bfloat16), device=device)
        configs, warps_list = [KernelConfig(16, 16, 4, 1)], [4]
    else:
        bench = CaseBench(BenchCase(load_model("qwen3.5-9b").gdn(), 16, 64, torch.bfloat16), device=device)
        configs, warps_list = [KernelConfig(64, 64, 4, 2), KernelConfig(32, 32, 4, 3), KernelConfig(64, 32, 4, 2)], [4, 8]
    rows = []

    def run(name, module, config, check, **kwargs):
        verify = functools.partial(module.tree_verify, **kwargs)
        timing, _ = bench.time_verify(verify, config, repeats=15)
        row = {"variant": name, "config": label(config), "p50_us": round(timing.p50_us, 2),
               "rel_error": bench.error(verify, config) if check else None}
        kernel = module.tree_factor_kernel if kwargs.get("stages") == "f" else module.tree_value_kernel
        row["stats"] = compiled_stats(kernel)
        rows.append(row)
        print(row, flush=True)

    for warps in warps_list:
        for name, patches in FACTOR_PATCHES.items():
            run(f"{name}-w{warps}", patched(name, patches), configs[0], False, stages="f", factor_launch=warps)
    for config in configs:
        for name, patches in VALUE_PATCHES.items():
            if name == "v-bf16state":  # a change of precision: checked against the reference
                run(name, patched(name, patches), config, True)
            else:
                run(name, patched(name, patches), config, False, stages="v")
    pathlib.Path(out_path).write_text(json.dumps(rows, indent=1))


RESIDENT_CONFIGS = [(b_k, b_v, w, st) for b_k in (32, 64, 128) for b_v in (32, 64) for w in (4, 8)
                    for st in (1, 2, 3)] + [(32, 16, 4, 2), (64, 16, 4, 2), (64, 128, 8, 2), (32, 128, 8, 2)]


def resident(out_path: str):
    """Fused (database config) against the factored experiment and the resident kernel, across cases."""
    from bole_tune.kernels import tree_verify

    smoke = "--smoke" in sys.argv
    device = "cuda" if torch.cuda.is_available() else "cpu"
    models = {m: load_model(m).gdn() for m in ("qwen3.5-9b", "qwen3.5-27b", "qwen3.5-122b-a10b")}
    cases = [("qwen3.5-9b", 16, 64), ("qwen3.5-9b", 1, 64), ("qwen3.5-9b", 4, 64), ("qwen3.5-9b", 16, 16),
             ("qwen3.5-9b", 16, 32), ("qwen3.5-9b", 32, 64), ("qwen3.5-9b", 8, 8), ("qwen3.5-27b", 16, 64),
             ("qwen3.5-122b-a10b", 16, 64), ("qwen3.5-122b-a10b", 1, 16)]
    configs = [KernelConfig(*c) for c in RESIDENT_CONFIGS]
    if smoke:
        from bole_tune.profiles import GDNShape
        models = {"tiny": GDNShape(2, 4, 32, 32)}
        cases, configs = [("tiny", 2, 20), ("tiny", 1, 9)], [KernelConfig(16, 16, 4, 1), KernelConfig(32, 32, 4, 2)]
    variants = {"fused": functools.partial(tree_verify, variant="fused"),
                "factored": functools.partial(factored_module().tree_verify, factor_launch=4),
                "resident": functools.partial(tree_verify, variant="resident")}
    rows, best = [], {}
    for model, batch, size in cases:
        bench = CaseBench(BenchCase(models[model], batch, size, torch.bfloat16), device=device)
        first = (model, batch, size) == cases[0]
        ranked = [KernelConfig(*map(int, c.split("/"))) for c, _ in sorted(best.items(), key=lambda kv: kv[1])[:6]]
        plan = [("fused", configs[0] if smoke else database_config(bench)),
                ("factored", configs[0] if smoke else KernelConfig(64, 64, 4, 2))]
        plan += [("resident", c) for c in (configs if first else ranked)]
        for name, config in plan:
            t = record(rows, bench, name, config, variants[name], model=model)
            if name == "resident" and t is not None and first:
                best[label(config)] = t
        pathlib.Path(out_path).write_text(json.dumps(rows, indent=1))


RESIDENT_SRC = ROOT / "kernels" / "tree_verify_resident.py"
RESIDENT_PATCHES = {
    "r-base": [],
    # (both sweep loops: the fp16 one and the tf32 one)
    "r-nosweep": [("        for _ in range(0, tl.load(block_depth_ptr + i_r)):\n", "        for _ in range(0, 0):\n")],
    "r-nogram": [
        ("        b_qk = tl.dot(b_q.to(GRAM_DTYPE), tl.trans(b_k.to(GRAM_DTYPE)), b_qk, input_precision=DOT_PRECISION)\n", ""),
        ("        b_kk = tl.dot(b_k.to(GRAM_DTYPE), tl.trans(b_k.to(GRAM_DTYPE)), b_kk, input_precision=DOT_PRECISION)\n", "")],
    "r-nostate": [
        ("            b_s = tl.load(p_state + o_v[:, None] * stride_s_v + o_k[None, :])\n", ""),
        ("            b_qs, b_ks = state_products(b_q, b_k, b_s, b_qs, b_ks, DOT_PRECISION, GRAM_DTYPE, STATE_SPLIT)\n",
         "            b_qs += tl.sum(b_q.to(tl.float32), axis=1)[:, None]\n"
         "            b_ks += tl.sum(b_k.to(tl.float32), axis=1)[:, None]\n")],
    "r-nosolve": [
        ("        b_u = tl.dot(b_w, b_r, input_precision=DOT_PRECISION)\n", "        b_u = b_r\n"),
        ("        b_o = tl.dot(b_m, b_r, a_q[:, None] * b_qs, input_precision=DOT_PRECISION)\n",
         "        b_o = a_q[:, None] * b_qs + b_r\n")],
    "r-novalue": [("    for i_v in range(0, D_V // V_SPLIT, B_V):\n", "    for i_v in range(0, 0, B_V):\n")],
    # candidates (exact math, checked): W and M through an L2-resident scratch instead of registers
    "c-scratch": [
        ("    o_ptr, u_ptr, logp_ptr, k_out_ptr, k_scale_ptr,\n", "    o_ptr, u_ptr, logp_ptr, k_out_ptr, k_scale_ptr, scratch_ptr,\n"),
        ("    b_w = b_x * b_beta[None, :]\n",
         "    b_w = b_x * b_beta[None, :]\n"
         "    p_tt = scratch_ptr + ((i_r * H_V + i_h) * V_SPLIT + i_part) * (2 * B_T * B_T) + o_i[:, None] * B_T + o_i[None, :]\n"
         "    tl.store(p_tt, b_w)\n    tl.store(p_tt + B_T * B_T, b_m)\n    tl.debug_barrier()\n"),
        ("        b_u = tl.dot(b_w, b_r, input_precision=DOT_PRECISION)\n",
         "        b_u = tl.dot(tl.load(p_tt), b_r, input_precision=DOT_PRECISION)\n"),
        ("        b_o = tl.dot(b_m, b_r, a_q[:, None] * b_qs, input_precision=DOT_PRECISION)\n",
         "        b_o = tl.dot(tl.load(p_tt + B_T * B_T), b_r, a_q[:, None] * b_qs, input_precision=DOT_PRECISION)\n")],
    # ... or kept in registers as fp16 with one scale per matrix (and per value tile for R'): the
    # significand of tf32, half the registers, fp16 tensor cores
    "c-fp16": [
        ("    b_m = tl.dot(b_c, b_x, input_precision=DOT_PRECISION) * b_beta[None, :]\n    b_w = b_x * b_beta[None, :]\n",
         "    b_m = tl.dot(b_c, b_x, input_precision=DOT_PRECISION)\n"
         "    s_m = tl.max(tl.max(tl.abs(b_m), axis=1), axis=0) + 1e-30\n"
         "    s_w = tl.max(tl.max(tl.abs(b_x), axis=1), axis=0)\n"
         "    b_m = (b_m * (1.0 / s_m)).to(tl.float16)\n    b_w = (b_x * (1.0 / s_w)).to(tl.float16)\n"),
        ("        b_u = tl.dot(b_w, b_r, input_precision=DOT_PRECISION)\n",
         "        b_r = b_r * b_beta[:, None]\n"
         "        s_r = tl.max(tl.max(tl.abs(b_r), axis=1), axis=0) + 1e-30\n"
         "        b_r16 = (b_r * (1.0 / s_r)).to(tl.float16)\n"
         "        b_u = tl.dot(b_w, b_r16) * (s_w * s_r)\n"),
        ("        b_o = tl.dot(b_m, b_r, a_q[:, None] * b_qs, input_precision=DOT_PRECISION)\n",
         "        b_o = tl.dot(b_m, b_r16) * (s_m * s_r) + a_q[:, None] * b_qs\n")],
}


# the value loop's q/k tiles without the bf16 -> fp32 conversion: (diagnostic) read from fp32 copies made
# outside the timed launches, or (candidate) the state tile rounded to the inputs' 16-bit type instead
_QK_LOADS = [("            b_q = tl.load(q_ptr + rows[:, None] * stride_q_n + i_hk * stride_q_h + o_k[None, :],\n",
              "            b_q = tl.load(q32_ptr + rows[:, None] * (H_K * D_K) + i_hk * D_K + o_k[None, :],\n"),
             ("            b_k = tl.load(k_ptr + rows[:, None] * stride_k_n + i_hk * stride_k_h + o_k[None, :],\n",
              "            b_k = tl.load(k32_ptr + rows[:, None] * (H_K * D_K) + i_hk * D_K + o_k[None, :],\n")]
RESIDENT_PATCHES["d-qk32"] = [
    ("    o_ptr, u_ptr, logp_ptr, k_out_ptr, k_scale_ptr,\n", "    o_ptr, u_ptr, logp_ptr, k_out_ptr, k_scale_ptr, q32_ptr, k32_ptr,\n"),
    *_QK_LOADS]
# measured in resident-cand-v2.json: "c-bf16s" (S_pre rounded to bf16 once: 58.1 us, but U off by 9e-4 and
# o by 2.6e-3 where the state predicts v) and "c-bf16x2s" (hi + lo bf16 parts: 61.0 against 64.1 us, more
# accurate than tf32), now the shipped `state_products` with STATE_SPLIT; "--split" compares it with tf32.
# the level sweeps transposed: X^T <- I - X^T G^T, so the loop-invariant G^T is the shared-memory operand
# (on the tf32 sweeps, which run since the sixth session only for raw keys or fp32 inputs)
RESIDENT_PATCHES["c-tsweep"] = [
    ("    if SWEEP_F16:\n", "    if False:\n"),
    ("        for _ in range(0, tl.load(block_depth_ptr + i_r)):\n"
     "            b_x = eye - tl.dot(b_gm, b_x, input_precision=DOT_PRECISION)\n",
     "        b_gt = tl.trans(b_gm)\n        b_xt = eye\n        for _ in range(0, tl.load(block_depth_ptr + i_r)):\n"
     "            b_xt = eye - tl.dot(b_xt, b_gt, input_precision=DOT_PRECISION)\n        b_x = tl.trans(b_xt)\n")]
# sixth session: S_pre (and the head's v rows) prefetched into L2 when the program starts, so that the
# value loop's loads would hit L2 while DRAM works during the factor phase (PTX prefetch.global.L2; GPU
# only). Measured in resident-cand-v3.json: slower (69.4 against 60.5 us at 9B B=16 T=64), not shipped
_L2_PREFETCH = (
    "    o_line = tl.arange(0, (D_V // V_SPLIT) * (D_K // 32))\n"
    "    p_lines = (state_ptr + slot * stride_s_slot + i_h * stride_s_h\n"
    "               + (i_part * (D_V // V_SPLIT) + o_line // (D_K // 32)) * stride_s_v + (o_line % (D_K // 32)) * 32)\n"
    "    tl.inline_asm_elementwise(\"prefetch.global.L2 [$1];\\n mov.u32 $0, 0;\", \"=r,l\", [p_lines],\n"
    "                              dtype=tl.int32, is_pure=False, pack=1)\n"
    "    o_vl = tl.arange(0, B_T * 2)\n"
    "    p_vl = v_ptr + (bos + tl.minimum(o_vl // 2, num_nodes - 1)) * stride_v_n + i_h * stride_v_h + i_part * (D_V // V_SPLIT) + (o_vl % 2) * 64\n"
    "    tl.inline_asm_elementwise(\"prefetch.global.L2 [$1];\\n mov.u32 $0, 0;\", \"=r,l\", [p_vl],\n"
    "                              dtype=tl.int32, is_pure=False, pack=1)\n")
RESIDENT_PATCHES["c-l2pf"] = [
    ("    o_i = tl.arange(0, B_T)\n    m_i = o_i < num_nodes\n", _L2_PREFETCH + "    o_i = tl.arange(0, B_T)\n    m_i = o_i < num_nodes\n")]
# measured in resident-cand-v3.json: "c-fp16sweep" (the sweeps and M = C X on fp16 operands: 57.0 against
# 60.5 us at 9B B=16 T=64), now shipped (`common.sweep_f16`, with the rows not yet exact clamped);
# "d-tf32sweep" runs the shipped kernel with the earlier tf32 sweeps, for comparison
RESIDENT_PATCHES["d-tf32sweep"] = [("    if SWEEP_F16:\n", "    if False:\n")]
FP32_COPIES = {}


class WithArgument:
    """A jitted kernel whose launches get more positional arguments at ``index``."""

    def __init__(self, kernel, index, *values):
        self.kernel, self.index, self.values = kernel, index, values

    def __getitem__(self, grid):
        launcher = self.kernel[grid]
        return lambda *args, **kwargs: launcher(*args[:self.index], *self.values, *args[self.index:], **kwargs)


class WithOptions:
    """A jitted kernel whose launches get more compile options (``maxnreg``: registers per thread)."""

    def __init__(self, kernel, **options):
        self.kernel, self.options = kernel, options

    def __getitem__(self, grid):
        launcher = self.kernel[grid]
        return lambda *args, **kwargs: launcher(*args, **kwargs, **self.options)


def resident_variant(name: str, v_split: int, maxnreg: int | None = None):
    """A verifier that launches the resident kernel's source with patch ``name`` and a fixed value split
    (no self-check: ablations compute wrong outputs on purpose)."""
    text = RESIDENT_SRC.read_text()
    for old, new in RESIDENT_PATCHES[name]:
        assert old in text, (name, old)
        text = text.replace(old, new)
    kernel = load_module(text, f"rv_{name.replace('-', '_')}").tree_verify_resident_kernel
    tv = sys.modules["bole_tune.kernels.tree_verify"]

    def verify(q, k, v, g, beta, state, state_indices, tree, scale=None, use_qk_l2norm=True, config=None,
               validate=False, out=None):
        shape, (q2, sq_n, sq_h), (k2, sk_n, sk_h), (v2, sv_n, sv_h), res = prepare(
            q, k, v, g, beta, state, state_indices, tree, scale, out)
        launch = kernel if maxnreg is None else WithOptions(kernel, maxnreg=maxnreg)
        if name == "c-scratch":  # one [2, T, T] fp32 scratch per program, passed after k_scale
            b_t = node_block(tree.max_tree_size)
            scratch = torch.empty(shape.num_requests * shape.hv * v_split * 2 * b_t * b_t, device=q.device)
            launch = WithArgument(kernel, 16, scratch)
        if name == "d-qk32":  # fp32 copies of q and k, made once per input set (outside graph capture)
            key = (q.data_ptr(), k.data_ptr())
            if key not in FP32_COPIES:
                FP32_COPIES[key] = (q.float().contiguous(), k.float().contiguous())
            launch = WithArgument(kernel, 16, *FP32_COPIES[key])
        saved, tv.tree_verify_resident_kernel = tv.tree_verify_resident_kernel, launch
        try:
            tv._launch("resident", q2, k2, v2, g, beta, state, state_indices, tree, shape, res, config,
                       bool(use_qk_l2norm), (sq_n, sq_h, sk_n, sk_h, sv_n, sv_h), v_split)
        finally:
            tv.tree_verify_resident_kernel = saved
        return res
    verify.kernel = kernel
    return verify


def resident_lab(out_path: str):
    """The resident kernel's stages patched out, and its value split, against the fused kernel."""
    from bole_tune.kernels import tree_verify

    smoke = "--smoke" in sys.argv
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = load_model("qwen3.5-9b").gdn()
    main_configs = [KernelConfig(32, 64, 4, 3), KernelConfig(64, 64, 4, 1), KernelConfig(32, 32, 4, 1),
                    KernelConfig(32, 32, 4, 3), KernelConfig(64, 32, 4, 1)]
    # (batch, tree, configs, splits, ablate): ablations at the first config and the largest split
    cases = [(16, 64, main_configs, (1, 2), True), (1, 64, main_configs, (1, 2, 4), True),
             (4, 64, main_configs[:4], (1, 2, 4), False), (8, 64, main_configs[:3], (1, 2), False),
             (1, 16, main_configs[:3], (1, 2, 4), False), (4, 16, main_configs[:3], (1, 2, 4), False),
             (16, 16, main_configs[:3], (1, 2), False), (4, 32, main_configs[:3], (1, 2, 4), False)]
    if smoke:
        from bole_tune.profiles import GDNShape
        shape = GDNShape(2, 4, 32, 32)
        cases = [(2, 20, [KernelConfig(16, 16, 4, 1)], (1, 2), True)]
    modules = {}
    rows = []
    for batch, size, configs, splits, ablate in cases:
        bench = CaseBench(BenchCase(shape, batch, size, torch.bfloat16), device=device)
        record(rows, bench, "fused-db", configs[0] if smoke else database_config(bench),
               functools.partial(tree_verify, variant="fused"), model="qwen3.5-9b")
        for config in configs:
            for v_split in splits:
                if v_split * config.b_v > shape.dv:
                    continue
                names = ["r-base"] + ([n for n in RESIDENT_PATCHES if n != "r-base"]
                                      if ablate and config == configs[0] and v_split == splits[-1] else [])
                for name in names:
                    verify = modules.setdefault((name, v_split), resident_variant(name, v_split))
                    record(rows, bench, f"{name}-s{v_split}", config, verify, check=name == "r-base",
                           model="qwen3.5-9b")
                    rows[-1]["stats"] = compiled_stats(verify.kernel)
                    print("    ", rows[-1]["stats"], flush=True)
        pathlib.Path(out_path).write_text(json.dumps(rows, indent=1))


def u_errors(bench, verify, config) -> dict:
    """Relative errors of U (what tree_commit adds to the state) against the float64 closed form, on the
    reference instance and on the same instance with values the state predicts (`predicted_values`)."""
    from bole_tune.bench import relative_error
    from bole_tune.kernels.reference import verify_closed_form
    from bole_tune.workloads import predicted_values

    tree, x, _ = bench.reference()
    out = {}
    for name, v in (("u_err", x.v), ("u_err_cancel", predicted_values(x, tree))):
        args = list(x.args(tree))
        args[2] = v
        res = verify(*args, validate=False, **bench.launch_kwargs(verify, config, None))
        ref = verify_closed_form(*args, dtype=torch.float64)
        out[name] = relative_error(res.u, ref.u)
        if name == "u_err_cancel":
            out["o_err_cancel"] = relative_error(res.o, ref.o)
    return out


def resident_candidates(out_path: str):
    """Candidate resident kernels against the shipped one, checked (names: argv[3], comma-separated)."""
    smoke = "--smoke" in sys.argv
    device = "cuda" if torch.cuda.is_available() else "cpu"
    models = {m: load_model(m).gdn() for m in ("qwen3.5-9b", "qwen3.5-27b", "qwen3.5-122b-a10b")}
    configs = [KernelConfig(*c) for c in [(32, 64, 4, 3), (64, 64, 4, 1), (64, 64, 4, 2), (32, 64, 4, 2),
                                          (32, 32, 4, 2), (64, 128, 8, 2)]]
    cases = [("qwen3.5-9b", 16, 64), ("qwen3.5-9b", 16, 16), ("qwen3.5-9b", 32, 64), ("qwen3.5-9b", 16, 32),
             ("qwen3.5-27b", 16, 64)]
    # v1 (fourth session): r-base, c-scratch, c-fp16; v2: without the q/k conversions of the value loop
    names = sys.argv[3].split(",") if len(sys.argv) > 3 and not sys.argv[3].startswith("-") else \
        ["r-base", "d-qk32", "c-tsweep"]
    if smoke:
        from bole_tune.profiles import GDNShape
        models = {"tiny": GDNShape(2, 4, 32, 32)}
        cases, configs = [("tiny", 2, 20)], [KernelConfig(16, 16, 4, 1)]
    modules = {name: resident_variant(name, 1) for name in names + ["r-nosolve", "r-nostate", "r-nosweep"]}
    rows, best = [], {name: {} for name in names}
    for model, batch, size in cases:
        bench = CaseBench(BenchCase(models[model], batch, size, torch.bfloat16), device=device)
        first = (model, batch, size) == cases[0]
        for name in names:
            plan = configs if first else [KernelConfig(*map(int, c.split("/")))
                                          for c, _ in sorted(best[name].items(), key=lambda kv: kv[1])[:3]]
            for config in plan:
                t = record(rows, bench, name, config, modules[name], model=model)
                rows[-1]["stats"] = compiled_stats(modules[name].kernel)
                if t is not None and config == plan[0]:
                    rows[-1].update(u_errors(bench, modules[name], config))
                print("    ", rows[-1]["stats"], {k: f"{v:.1e}" for k, v in rows[-1].items() if "err_" in k or
                                                   k == "u_err"}, flush=True)
                if first and t is not None:
                    best[name][label(config)] = t
        if first and "--ablate" in sys.argv:  # where the shipped kernel's time goes at its best config
            top = min(best["r-base"], key=best["r-base"].get) if best["r-base"] else label(configs[0])
            for name in ("r-nosolve", "r-nostate", "r-nosweep"):
                record(rows, bench, name, KernelConfig(*map(int, top.split("/"))), modules[name], check=False,
                       model=model)
                rows[-1]["stats"] = compiled_stats(modules[name].kernel)
        pathlib.Path(out_path).write_text(json.dumps(rows, indent=1))


def split_lab(out_path: str):
    """The state products with S_pre as two bf16 parts (shipped, `common.state_split`) against one tf32
    product, both kernels, at the database's config of each case: time and errors (o; U where the state
    predicts v)."""
    tv = sys.modules["bole_tune.kernels.tree_verify"]
    from bole_tune.kernels import tree_verify

    smoke = "--smoke" in sys.argv
    device = "cuda" if torch.cuda.is_available() else "cpu"
    models = {m: load_model(m).gdn() for m in ("qwen3.5-9b", "qwen3.5-27b", "qwen3.5-122b-a10b")}
    cases = [("qwen3.5-9b", 16, 64), ("qwen3.5-9b", 8, 64), ("qwen3.5-9b", 32, 64), ("qwen3.5-9b", 16, 16),
             ("qwen3.5-9b", 1, 64), ("qwen3.5-9b", 4, 64), ("qwen3.5-9b", 1, 16), ("qwen3.5-9b", 4, 16),
             ("qwen3.5-9b", 16, 128), ("qwen3.5-9b", 4, 256), ("qwen3.5-9b", 1, 256), ("qwen3.5-27b", 16, 64),
             ("qwen3.5-27b", 1, 64), ("qwen3.5-122b-a10b", 16, 64), ("qwen3.5-122b-a10b", 4, 32)]
    if smoke:
        from bole_tune.profiles import GDNShape
        models, cases = {"tiny": GDNShape(2, 4, 32, 32)}, [("tiny", 2, 20)]
    original, rows = tv.state_split, []
    for model, batch, size in cases:
        bench = CaseBench(BenchCase(models[model], batch, size, torch.bfloat16), device=device)
        config = KernelConfig(16, 16, 4, 1) if smoke else database_config(bench)
        variant = bench.launch(config, None)[1]  # what launch_kwargs pins for tree_verify: the database's
        verify = tree_verify
        for name, split in (("tf32", lambda dtype, node_block: False),
                            ("split", lambda dtype, node_block: dtype == torch.bfloat16)):
            tv.state_split = split
            try:
                t = record(rows, bench, f"{name}-{variant}", config, verify, model=model)
                if t is not None:
                    rows[-1].update(u_errors(bench, verify, config))
                    print("    ", {k: f"{v:.1e}" for k, v in rows[-1].items() if "err" in k}, flush=True)
            finally:
                tv.state_split = original
        pathlib.Path(out_path).write_text(json.dumps(rows, indent=1))


COMMIT_SRC = ROOT / "kernels" / "tree_commit.py"
_COMMIT_DOT = ('                b_s = decay * b_s + tl.dot(tl.trans(b_u * weight[:, None]), b_k, input_precision="ieee")\n')
COMMIT_PATCHES = {
    "k-base": [],
    # the path update on tensor cores: three tf32 passes (about fp32 accuracy), or one
    "k-tf32x3": [('input_precision="ieee"', 'input_precision="tf32x3"')],
    "k-tf32": [('input_precision="ieee"', 'input_precision="tf32"')],
    # the next state tile's load issued before this tile's update and store (two tiles in flight)
    "k-prefetch": [
        ("            for i_c in range(0, V_SPAN // B_V):\n"
         "                o_c = i_c * B_V + tl.arange(0, B_V)\n"
         "                o_v = i_span * V_SPAN + o_c\n"
         "                b_s = tl.load(p_slab + o_c[:, None] * stride_s_v)\n",
         "            b_next = tl.load(p_slab + tl.arange(0, B_V)[:, None] * stride_s_v)\n"
         "            for i_c in range(0, V_SPAN // B_V):\n"
         "                o_c = i_c * B_V + tl.arange(0, B_V)\n"
         "                o_v = i_span * V_SPAN + o_c\n"
         "                b_s = b_next\n"
         "                b_next = tl.load(p_slab + (o_c + B_V)[:, None] * stride_s_v,\n"
         "                                 mask=(o_c + B_V)[:, None] < V_SPAN, other=0.0)\n")],
    # ablation (wrong outputs, timed only): no path update at all, the state only decayed
    "k-nodot": [(_COMMIT_DOT, "                b_s = decay * b_s + tl.sum(b_u * weight[:, None], axis=0)[:, None]\n")],
}
COMMIT_PATCHES["k-tf32x3-prefetch"] = COMMIT_PATCHES["k-tf32x3"] + COMMIT_PATCHES["k-prefetch"]


def commit_variant(name: str):
    """tree_commit's wrapper and kernel from its source with patch ``name``."""
    text = COMMIT_SRC.read_text()
    for old, new in COMMIT_PATCHES[name]:
        assert old in text, (name, old)
        text = text.replace(old, new)
    return load_module(text, f"kc_{name.replace('-', '_')}").tree_commit


def commit_candidates(out_path: str):
    """tree_commit variants and launches at 9B B=16 T=64 and B=16 T=16, checked against the closed form,
    beside the copy floor (the same bytes decayed in place by one torch multiply)."""
    from bole_tune.kernels import tree_verify
    from bole_tune.kernels.reference import commit_closed_form
    from bole_tune.timing import time_launches

    smoke = "--smoke" in sys.argv
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape, cases = load_model("qwen3.5-9b").gdn(), [(16, 64), (16, 16)]
    launches = [(128, 16, 2, 128, 3), (128, 32, 4, 128, 3), (128, 32, 2, 128, 3), (128, 64, 4, 128, 3),
                (128, 16, 1, 128, 3), (64, 32, 2, 128, 3), (128, 16, 2, 64, 3), (128, 32, 4, 64, 3)]
    if smoke:
        from bole_tune.profiles import GDNShape
        shape, cases, launches = GDNShape(2, 4, 32, 32), [(2, 20)], [(32, 16, 4, 32, 1), (16, 16, 2, 32, 2)]
    variants = {name: commit_variant(name) for name in COMMIT_PATCHES}
    rows = []
    for batch, size in cases:
        bench = CaseBench(BenchCase(shape, batch, size, torch.bfloat16), device=device)
        tree, pool, inputs, slots = bench.sets(64)
        results = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, validate=False)
                   for i, x in enumerate(inputs)]
        depths, offsets = tree.node_depth.tolist(), tree.offsets.tolist()
        accepted = torch.tensor([max(range(size), key=lambda n: depths[offsets[r] + n]) for r in range(batch)],
                                dtype=torch.int32, device=device)
        slab = torch.randn(len(inputs), batch * shape.hv * shape.dv * shape.dk, device=device)
        floor = time_launches(lambda i: slab[i].mul_(0.999), len(inputs), device, repeats=15)
        rows.append({"kernel": "copy-floor", "batch": batch, "tree": size, "p50_us": round(floor.p50_us, 2)})
        print(f"B={batch} T={size} copy floor (decay in place, same bytes): {floor.p50_us:.2f} us", flush=True)
        pristine, expected = pool.clone(), pool.clone()
        commit_closed_form(expected, slots[0], results[0], accepted, validate=False)
        update = (expected - pristine).norm()
        for name, commit in variants.items():
            for b_k, b_v, warps, span, stages in launches if name in ("k-base", "k-tf32x3-prefetch") else launches[:3]:
                kw = dict(b_k=b_k, b_v=b_v, num_warps=warps, v_span=span, num_stages=stages)
                where = f"B={batch} T={size} {name:<18} {b_k}/{b_v}/{warps}/{span}/{stages}"
                try:
                    trial = pristine.clone()
                    commit(trial, slots[0], results[0], accepted, validate=False, **kw)
                    err = float((trial - expected).norm() / update)

                    def launch(i, kw=kw, commit=commit):
                        commit(pool, slots[i], results[i], accepted, validate=False, **kw)
                    timing = time_launches(launch, len(inputs), device, repeats=15)
                except Exception as exc:  # noqa: BLE001 - a launch that does not compile is a result too
                    print(f"{where} FAILED {str(exc)[:150]}", flush=True)
                    rows.append({"kernel": name, "batch": batch, "tree": size, **kw, "error": str(exc)[:300]})
                    continue
                rows.append({"kernel": name, "batch": batch, "tree": size, **kw, "p50_us": round(timing.p50_us, 2),
                             "update_rel_error": err})
                print(f"{where} {timing.p50_us:8.2f} us  update err {err:.1e}", flush=True)
        pathlib.Path(out_path).write_text(json.dumps(rows, indent=1))


def readout_lab(out_path: str):
    """The readout experiment (benchmarks/experiments/readout_tree_verify.py: outputs only, one state
    product; the commit replays the accepted path) against the shipped verifier and commit."""
    from bole_tune.kernels import tree_commit, tree_verify
    from bole_tune.kernels.reference import commit_closed_form, verify_closed_form
    from bole_tune.timing import time_launches
    from bole_tune.workloads import predicted_values, relative_error

    ro = load_module((EXPERIMENTS / "readout_tree_verify.py").read_text(), "readout_tv")
    smoke = "--smoke" in sys.argv
    device = "cuda" if torch.cuda.is_available() else "cpu"
    models = {m: load_model(m).gdn() for m in ("qwen3.5-9b", "qwen3.5-27b")}
    configs = [KernelConfig(*c) for c in [(32, 64, 4, 3), (64, 64, 4, 2), (64, 128, 4, 2), (32, 128, 4, 3),
                                          (64, 128, 8, 2), (32, 128, 8, 3), (64, 64, 8, 2), (32, 64, 4, 2),
                                          (128, 64, 4, 1), (64, 32, 4, 2), (32, 32, 4, 3)]]
    cases = [("qwen3.5-9b", 16, 64), ("qwen3.5-9b", 8, 64), ("qwen3.5-9b", 32, 64), ("qwen3.5-9b", 16, 32),
             ("qwen3.5-9b", 16, 16), ("qwen3.5-27b", 16, 64), ("qwen3.5-9b", 4, 64)]
    launches = [(16, 2, 128, 3), (32, 4, 128, 3), (16, 4, 128, 2), (8, 1, 128, 3), (16, 2, 64, 3), (32, 2, 128, 2)]
    if smoke:
        from bole_tune.profiles import GDNShape
        models = {"tiny": GDNShape(2, 4, 32, 32)}
        cases, configs, launches = [("tiny", 2, 20)], [KernelConfig(16, 16, 4, 1)], [(16, 2, 32, 1)]
    rows, ranked = [], []
    for model, batch, size in cases:
        bench = CaseBench(BenchCase(models[model], batch, size, torch.bfloat16), device=device)
        record(rows, bench, "shipped", database_config(bench), tree_verify, model=model)
        plan = configs if not ranked else ranked[:4]
        times = {}
        # where the state predicts v: the reference and the shipped verifier's error, once per case
        tree, x, _ = bench.reference()
        args = list(x.args(tree))
        args[2] = predicted_values(x, tree)
        ref = verify_closed_form(*args, dtype=torch.float64)
        shipped_cancel = relative_error(tree_verify(*args, validate=False).o, ref.o)
        for config in plan:
            t = record(rows, bench, "readout", config, ro.tree_verify, model=model)
            if t is not None:
                times[config] = t
                rows[-1]["o_err_cancel"] = relative_error(ro.tree_verify(*args, config=config).o, ref.o)
                rows[-1]["o_err_cancel_shipped"] = shipped_cancel
                print(f"    predicted values: o err {rows[-1]['o_err_cancel']:.1e} "
                      f"(shipped {rows[-1]['o_err_cancel_shipped']:.1e})", flush=True)
        if not ranked:
            ranked = sorted(times, key=times.get)
        if (batch < 16 and not smoke) or not times:
            pathlib.Path(out_path).write_text(json.dumps(rows, indent=1))
            continue
        # commits: the shipped one (U from the verifier) against the replay, each checked
        tree, pool, inputs, slots = bench.sets(64)
        shipped = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, validate=False)
                   for i, x in enumerate(inputs)]
        best = min(times, key=times.get)
        replays = [ro.tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, config=best)
                   for i, x in enumerate(inputs)]
        depths, offsets = tree.node_depth.tolist(), tree.offsets.tolist()
        accepted = torch.tensor([max(range(size), key=lambda n: depths[offsets[r] + n]) for r in range(batch)],
                                dtype=torch.int32, device=device)
        pristine, expected = pool.clone(), pool.clone()
        commit_closed_form(expected, slots[0], shipped[0], accepted, validate=False)
        update = (expected - pristine).norm()
        kinds = [("commit-shipped", None)] + [("commit-replay", launch) for launch in launches]
        for name, launch in kinds:
            where = f"{model:<18} B={batch:<3} T={size:<4} {name:<15} {launch}"
            try:
                trial = pristine.clone()
                if launch is None:
                    tree_commit(trial, slots[0], shipped[0], accepted, validate=False)
                    fn = lambda i: tree_commit(pool, slots[i], shipped[i], accepted, validate=False)  # noqa: E731
                else:
                    kw = dict(zip(("b_v", "num_warps", "v_span", "num_stages"), launch))
                    ro.tree_commit(trial, slots[0], replays[0], accepted, **kw)
                    fn = lambda i, kw=kw: ro.tree_commit(pool, slots[i], replays[i], accepted, **kw)  # noqa: E731
                err = float((trial - expected).norm() / update)
                timing = time_launches(fn, len(inputs), device, repeats=15)
            except Exception as exc:  # noqa: BLE001 - a launch that does not compile is a result too
                print(f"{where} FAILED {str(exc)[:150]}", flush=True)
                rows.append({"kernel": name, "model": model, "batch": batch, "tree": size, "launch": launch,
                             "error": str(exc)[:300]})
                continue
            rows.append({"kernel": name, "model": model, "batch": batch, "tree": size, "launch": launch,
                         "p50_us": round(timing.p50_us, 2), "update_rel_error": err})
            print(f"{where} {timing.p50_us:8.2f} us  update err {err:.1e}", flush=True)
        pathlib.Path(out_path).write_text(json.dumps(rows, indent=1))


def maxnreg_lab(out_path: str):
    """Register caps (ptxas ``maxnreg``) on the resident kernel and the readout experiment: more programs
    per SM at the price of spills. Each launch checked against the float64 reference."""
    smoke = "--smoke" in sys.argv
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ro = load_module((EXPERIMENTS / "readout_tree_verify.py").read_text(), "readout_tv")
    models = {m: load_model(m).gdn() for m in ("qwen3.5-9b", "qwen3.5-27b")}
    configs = [KernelConfig(*c) for c in [(32, 64, 4, 3), (64, 64, 4, 3), (32, 64, 4, 2), (32, 128, 4, 3),
                                          (32, 64, 8, 3), (64, 64, 8, 2)]]
    caps = [None, 168, 128, 96]
    cases = [("qwen3.5-9b", 16, 64), ("qwen3.5-9b", 32, 64), ("qwen3.5-9b", 8, 64), ("qwen3.5-27b", 16, 64),
             ("qwen3.5-9b", 16, 32), ("qwen3.5-9b", 16, 16)]
    if smoke:
        from bole_tune.profiles import GDNShape
        models = {"tiny": GDNShape(2, 4, 32, 32)}
        cases, configs, caps = [("tiny", 2, 20)], [KernelConfig(16, 16, 4, 1)], [None]
    verifiers = {}
    for cap in caps:
        verifiers[("resident", cap)] = resident_variant("r-base", 1, cap)
        verifiers[("readout", cap)] = functools.partial(ro.tree_verify, maxnreg=cap)
        verifiers[("readout", cap)].kernel = ro.tree_verify_readout_kernel
    rows, plan = [], [(name, cap, config) for (name, cap) in verifiers for config in configs
                      if not (config.num_warps == 8 and cap is not None and cap > 128)]
    for model, batch, size in cases:
        bench = CaseBench(BenchCase(models[model], batch, size, torch.bfloat16), device=device)
        times = {}
        for name, cap, config in plan:
            verify = verifiers[(name, cap)]
            t = record(rows, bench, f"{name}-r{cap}", config, verify, model=model)
            rows[-1]["stats"] = compiled_stats(verify.kernel)
            print("    ", rows[-1]["stats"], flush=True)
            if t is not None:
                times[(name, cap, config)] = t
        if len(plan) > 8:  # later cases: the 6 best launches and each kernel's best uncapped one
            ranked = sorted(times, key=times.get)
            plan = ranked[:6] + [min((k for k in ranked if k[:2] == (name, None)), key=times.get)
                                 for name in ("resident", "readout") if any(k[:2] == (name, None) for k in ranked)]
            plan = list(dict.fromkeys(plan))
        pathlib.Path(out_path).write_text(json.dumps(rows, indent=1))


LABS = {"--maxnreg": maxnreg_lab, "--readout": readout_lab, "--split": split_lab, "--commit-cand": commit_candidates,
        "--resident-cand": resident_candidates, "--resident-lab": resident_lab, "--resident": resident,
        "--factored-ablation": factored_ablation, "--factored": factored, "--ablation": ablation}


def main():
    if sys.argv[1] == "--ncu":
        return ncu_case()
    if sys.argv[1] in LABS:
        return LABS[sys.argv[1]](sys.argv[2])
    out_path = sys.argv[1]
    shape = load_model("qwen3.5-9b").gdn()
    old = load_fused()
    variants = {"fused": old, "two": make_two_stage()}
    for f in [(64, 2, 2), (64, 8, 2), (128, 4, 1), (64, 4, 1), (32, 4, 3)]:
        variants[f"two-f{f[0]}-{f[1]}-{f[2]}"] = make_two_stage(factor=f)
    variants["f-only"] = make_two_stage(stages="f")
    variants["v-only"] = make_two_stage(stages="v")
    configs = [KernelConfig(64, 128, 8, 2), KernelConfig(32, 128, 8, 2), KernelConfig(64, 64, 4, 2),
               KernelConfig(32, 64, 4, 2), KernelConfig(16, 64, 2, 3), KernelConfig(32, 32, 4, 3),
               KernelConfig(32, 32, 2, 2), KernelConfig(64, 128, 4, 1), KernelConfig(128, 64, 4, 1),
               KernelConfig(32, 128, 8, 3)]
    cases = [(16, 64), (1, 64), (16, 16), (16, 128)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if "--smoke" in sys.argv:  # the CPU interpreter, tiny shapes: proves the script runs
        from bole_tune.profiles import GDNShape
        shape, configs, cases = GDNShape(2, 4, 32, 32), [KernelConfig(16, 16, 4, 1)], [(2, 20)]
        variants = {"fused": old, "two": make_two_stage(), "f-only": make_two_stage(stages="f"),
                    "two-f": make_two_stage(factor=(32, 2, 1))}
    rows = []
    for batch, size in cases:
        bench = CaseBench(BenchCase(shape, batch, size, torch.bfloat16), device=device)
        for config in configs:
            for name, verify in variants.items():
                if name == "fused" and config != KernelConfig(32, 128, 8, 3) and "--smoke" not in sys.argv:
                    continue
                if name.startswith("two-f") and (batch, size) not in ((16, 64), (1, 64)) or \
                        name.startswith("two-f") and config != configs[0]:
                    continue
                err = None if name.endswith("only") else bench.error(verify, config)
                try:
                    timing, _ = bench.time_verify(verify, config, repeats=15)
                except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a result too
                    rows.append({"batch": batch, "tree": size, "config": label(config), "variant": name,
                                 "error": str(exc)[:200]})
                    print(f"B={batch:<3} T={size:<4} {label(config):<14} {name:<14} FAILED {str(exc)[:150]}")
                    continue
                rows.append({"batch": batch, "tree": size, "config": label(config), "variant": name,
                             "p50_us": round(timing.p50_us, 2), "rel_error": err})
                print(f"B={batch:<3} T={size:<4} {label(config):<14} {name:<14} {timing.p50_us:8.2f} us"
                      + (f"  err {err:.1e}" if err is not None else ""), flush=True)
        if batch == 16 and size == 64 and "--smoke" not in sys.argv and "--commit" in sys.argv:
            time_commits(bench, rows)
        pathlib.Path(out_path).write_text(json.dumps(rows, indent=1))


def load_fused():
    """The shipped fused one-kernel verifier."""
    return importlib.import_module("bole_tune.kernels.tree_verify").tree_verify


def load_module(source: str, name: str):
    """Import kernel source text as a module (Triton reads a jitted function's source from its file)."""
    text = source.replace("\nfrom .", "\nfrom bole_tune.kernels.")
    path = pathlib.Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    main()
