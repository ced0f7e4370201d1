"""Where the host time of the SGLang adapter's eager round goes (`SGLangTreeVerifyKernel`: ``target_verify`` per
layer, then ``commit`` once for all layers), beside SGLang 0.5.23's own kernel issued the same way. Wall time per
call in a loop of eager calls (the device drained before and after; `host_path.interleaved`: the rows side by
side over several turns, the median kept), then a cProfile of the adapter's rounds.

    BOLE_TUNE_ENGINE_PACKAGES=.sgk python3 lab/adapter_host.py [--batch 1] [--steps 3 --topk 1 --draft 4] [--json F]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats

import torch

from bole_tune.acceptance import load_acceptance
from bole_tune.draft_trees import SGLangBeam
from bole_tune.engines.sglang import SGLangTreeVerifyKernel, import_sglang_kernels, sglang_parents, sglang_tree
from bole_tune.kernels import gdn_gates, tree_verify
from bole_tune.shapes import HeadShape
from host_path import interleaved

LAYERS = 24  # the 9B's GDN layers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--topk", type=int, default=1)
    parser.add_argument("--draft", type=int, default=4)
    parser.add_argument("--json")
    args = parser.parse_args()
    device, dtype = "cuda", torch.bfloat16
    h = HeadShape(hk=16, hv=32, dk=128, dv=128)
    fused, scatter = import_sglang_kernels()
    local = [-1] + [p + 1 for p in SGLangBeam(load_acceptance("qwen3.5-mtp-mbpp"), args.steps, args.topk)
                    .tree(args.draft).parents]
    depth = [0] * len(local)
    for i, p in enumerate(local[1:], 1):
        depth[i] = depth[p] + 1
    deepest = max(range(len(local)), key=lambda i: depth[i])
    b, t = args.batch, args.draft
    n = b * t
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*size, scale=1.0, dt=dtype):
        return (torch.randn(*size, generator=gen, device=device) * scale).to(dt)

    q, k = rand(LAYERS, 1, n, h.hk, h.dk), rand(LAYERS, 1, n, h.hk, h.dk)
    v, a, bb = rand(LAYERS, 1, n, h.hv, h.dv), rand(LAYERS, n, h.hv), rand(LAYERS, n, h.hv)
    pools = rand(LAYERS, b, h.hv, h.dv, h.dk, scale=0.1, dt=torch.float32)
    a_log, dt_bias = rand(h.hv, scale=0.5, dt=torch.float32), rand(h.hv, dt=torch.float32)
    slots = torch.arange(b, dtype=torch.int32, device=device)
    parents = torch.tensor([sglang_parents(local)] * b, dtype=torch.int32, device=device)
    qsl = torch.arange(0, n + 1, t, dtype=torch.int32, device=device)
    steps_acc = torch.full((b,), deepest, dtype=torch.int64, device=device)
    snapshots = torch.empty(LAYERS, b + 1, t, h.hv, h.dv, h.dk, dtype=torch.float32, device=device)
    rows_idx = torch.arange(b, dtype=torch.int32, device=device)
    kernel = SGLangTreeVerifyKernel(pools=pools, max_depth=args.steps)
    kernel.reserve(b, t, h, dtype, device)

    def sglang_round():
        for l in range(LAYERS):
            fused(A_log=a_log, dt_bias=dt_bias, q=q[l], k=k[l], v=v[l], a=a[l], b=bb[l],
                  initial_state_source=pools[l], initial_state_indices=slots, cu_seqlens=qsl,
                  use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0, is_kda=False,
                  disable_state_update=True, intermediate_states_buffer=snapshots[l],
                  intermediate_state_indices=rows_idx, cache_steps=t, retrieve_parent_token=parents)
        scatter(pools, snapshots, slots, steps_acc)

    def verify_layers():
        for l in range(LAYERS):
            kernel.target_verify(a_log, dt_bias, q[l], k[l], v[l], a[l], bb[l], ssm_states=pools[l],
                                 cache_indices=slots, query_start_loc=qsl, cache_steps=t,
                                 retrieve_parent_token=parents)

    def adapter_round():
        verify_layers()
        kernel.commit(steps_acc, slots)

    adapter_round()
    rnd = kernel.round_for(parents)
    tree = rnd.tree
    g0, beta0 = gdn_gates(a[0], bb[0], a_log, dt_bias, validate=False)
    fixed = rnd.results.layer(0, tree)

    per_layer = {
        "SGLang round (per layer)": (sglang_round, LAYERS),
        "adapter round (per layer)": (adapter_round, LAYERS),
        "adapter target_verify x24 (per layer)": (verify_layers, LAYERS),
        "adapter commit (per round)": (lambda: kernel.commit(steps_acc, slots), 1),
        "sglang_tree (per round)": (lambda: sglang_tree(parents, args.steps), 1),
        "gdn_gates": (lambda: gdn_gates(a[0], bb[0], a_log, dt_bias, validate=False), 1),
        "results.layer(l, tree)": (lambda: rnd.results.layer(0, tree), 1),
        "tree_verify out=fresh views": (lambda: tree_verify(q[0, 0], k[0, 0], v[0, 0], g0, beta0, pools[0], rnd.slots,
                                                           tree, out=rnd.results.layer(0, tree)), 1),
        "tree_verify out=one result": (lambda: tree_verify(q[0, 0], k[0, 0], v[0, 0], g0, beta0, pools[0], rnd.slots,
                                                          tree, out=fixed), 1),
        "tree_verify default": (lambda: tree_verify(q[0, 0], k[0, 0], v[0, 0], g0, beta0, pools[0], rnd.slots, tree), 1),
        "torch.empty x1": (lambda: torch.empty(16, device=device), 1),
    }
    us = interleaved({name: fn for name, (fn, _) in per_layer.items()}, turns=5, calls=200, warm=20)
    us = {name: us[name] / per_layer[name][1] for name in us}
    print(f"B={b} ({args.steps},{args.topk},{t}), 9B heads, {LAYERS} layers, bf16; us per call (eager, wall time)")
    for name, value in us.items():
        print(f"{name:42s} {value:8.1f}")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(100):
        adapter_round()
    torch.cuda.synchronize()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
    print(text.getvalue()[:9000])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"us_per_call": us, "profile_tottime": text.getvalue()}, f, indent=1)


if __name__ == "__main__":
    main()
