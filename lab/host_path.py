"""Where the host time of an eager tree_verify / folded verify / ring verify / tree_commit call goes (issue 17's <= 40 us at
B=1). Wall time per call in a loop of eager calls (no sync inside the loop), and each stage alone.

    python3 lab/host_path.py [--batch 1] [--tree-size 4] [--profile]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from bole_tune.kernels import (PLANNER, LayerResults, PendingCommit, PendingPaths, PendingRing, tree_commit,
                               tree_commit_layers, tree_verify)
from bole_tune.kernels.verify.tree_commit import commit_config
from bole_tune.kernels.verify.checks import check_pending, check_verify_inputs
from bole_tune.kernels.verify.result import RESULT_POOL, TreeVerifyResult, result_buffers
from bole_tune.kernels.verify.run import run_launch
from bole_tune.workloads import make_inputs, make_tree
from lab_rows import interleaved, profile_calls


def timed(fn, calls=2000) -> float:
    """Wall time per call of ``calls`` eager calls, the device drained before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / calls


def per_call(fn, calls=2000) -> float:
    for _ in range(50):
        fn()
    return sorted(timed(fn, calls) for _ in range(5))[2]


def launch_parts(launch, a, shape, res) -> dict:
    """The launch's parts: the caller-keyed launch (the kept binary under the verify's own key), the generic
    argument-keyed one, Triton's own ``fn[grid](...)`` and its binder, and the compiled kernel's C launcher alone
    (all arguments bound beforehand)."""
    from triton.runtime.driver import driver
    from triton.runtime.jit import compute_cache_key

    from bole_tune.kernels.verify import run as run_module

    captured = {}

    class Capture:
        def __init__(self, fast):
            self.fast = fast

        def launch_keyed(self, key, grid, fast_args, args, meta):
            captured.update(fn=self.fast.fn, key=key, grid=grid, fast_args=fast_args, args=args(), meta=meta)
            return self.fast.launch_keyed(key, grid, fast_args, args, meta)

    name = "RESIDENT" if launch.variant != "fused" else "FUSED"
    original = getattr(run_module, name)
    setattr(run_module, name, Capture(original))
    try:
        run_launch(launch, *a, shape, res, True)
    finally:
        setattr(run_module, name, original)
    fn, key, grid, fast_args, args, meta = (captured[x] for x in ("fn", "key", "grid", "fast_args", "args", "meta"))
    kwargs = meta()
    device = driver.active.get_current_device()
    kernel_cache, key_cache, _, _, binder = fn.device_caches[device]
    kw = dict(kwargs, debug=False, instrumentation_mode="")
    bound, spec, options = binder(*args, **kw)
    compiled = kernel_cache[compute_cache_key(key_cache, spec, options)]
    values = list(bound.values())
    stream = driver.active.get_current_stream(device)
    g = tuple(grid) + (1,) * (3 - len(grid))

    def c_launch():
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None, None, None, *values)

    addresses = [x.data_ptr() if isinstance(x, torch.Tensor) else x for x in values]

    def c_launch_addresses():
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *addresses)

    return {
        "  launch_keyed (caller's key)": lambda: original.launch_keyed(key, grid, fast_args, lambda: args, meta),
        "  FastLauncher (argument key)": lambda: original(grid, *args, **kwargs),
        "  argument key alone": lambda: original.key(args, kwargs),
        "  JIT launch (fn[grid](...))": lambda: fn[grid](*args, **kwargs),
        "  binder alone": lambda: binder(*args, **kw),
        "  compiled.run alone (C launcher, tensors)": c_launch,
        "  compiled.run alone (C launcher, addresses)": c_launch_addresses,
        "  current device + stream": lambda: driver.active.get_current_stream(driver.active.get_current_device()),
        f"  ({len(values)} bound arguments, caller key {'set' if key is not None else 'None'})": lambda: None,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tree-size", type=int, default=4)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of the script under TRITON_INTERPRET=1
    tree = make_tree([args.tree_size] * args.batch, "chain", device=dev)
    x = make_inputs(tree, 16, 32, 128, 128, torch.bfloat16, dev, seed=1)
    a = x.args(tree)
    accepted = torch.full((args.batch,), args.tree_size - 1, dtype=torch.int32, device=dev)
    res = tree_verify(*a)
    res2 = tree_verify(*a)
    paths = PendingPaths(tree, accepted, torch.arange(args.batch, dtype=torch.int32, device=dev))
    pending = PendingCommit(paths, res)
    shape = check_verify_inputs(*a, None, None)
    states = x.state[None].expand(24, *x.state.shape).contiguous()
    layers = LayerResults.empty(24, tree, shape.heads, torch.bfloat16, dev)
    for layer in range(24):
        tree_verify(*a, out=layers.layer(layer))
    launch = PLANNER.plan(shape.heads, torch.bfloat16, num_requests=args.batch, max_tree_size=tree.max_tree_size,
                          depth=tree.depth, device=dev)
    ring = PendingRing(x.state.shape[0], 4, tree.depth + 1, tree.num_nodes, args.batch, dev)
    arena = ring.results(shape.heads, torch.bfloat16)
    for _ in range(3):  # three rounds pending: the next round reads, the one after writes
        step = ring.begin(tree)
        tree_verify(*a, ring=step.layer(arena))
        ring.end(step, x.state_indices, accepted)
    read = ring.begin(tree)
    ring.held = ring.rounds
    write = ring.begin(tree)
    # the tuned all-layer launch with TMA loads (a tensor descriptor built and encoded per call)
    tma_config = dataclasses.replace(commit_config(shape.heads.hk, shape.heads.hv, shape.heads.dk, shape.heads.dv,
                                                   torch.bfloat16, tree.max_tree_size, args.batch, 24, torch.device(dev)), tma=1)
    # an engine's round of 24 layers, one call a layer: each layer folds in its result of the round before (kept until
    # then), into its own out= buffers (two sets a layer, alternating) or into the pool's (default)
    own = [[TreeVerifyResult(*RESULT_POOL.fresh(shape, torch.bfloat16, x.q.device)[:6], tree) for _ in range(2)]
           for _ in range(24)]  # the engine's own buffers, not the pool's
    kept = [tree_verify(*a) for _ in range(24)]
    turn = [0]

    def round_out():
        r = turn[0] = turn[0] + 1
        for layer in range(24):
            tree_verify(*a, out=own[layer][r % 2], pending=PendingCommit(paths, own[layer][(r + 1) % 2]))

    def round_default():
        for layer in range(24):
            kept[layer] = tree_verify(*a, pending=PendingCommit(paths, kept[layer]))

    rounds = {"engine round, folded, out= (per layer)": round_out,
              "engine round, folded, default (per layer)": round_default}
    rows = {
        "tree_verify (default eager)": lambda: tree_verify(*a),
        "tree_verify out=": lambda: tree_verify(*a, out=res2),
        "tree_verify launch= out=": lambda: tree_verify(*a, out=res2, launch=launch),
        "tree_verify out=layers.layer(l)": lambda: tree_verify(*a, out=layers.layer(5)),
        "tree_verify folded (pending=, out=)": lambda: tree_verify(*a, out=res2, pending=pending),
        "tree_verify folded (pending=, default)": lambda: tree_verify(*a, pending=pending),
        "tree_verify ring read round (ring=)": lambda: tree_verify(*a, ring=read.layer(arena)),
        "tree_verify ring write round (ring=)": lambda: tree_verify(*a, ring=write.layer(arena)),
        "ring.begin + step.layer": lambda: ring.begin(tree).layer(arena),
        "ring.end (once a round, all layers)": lambda: ring.end(read, x.state_indices, accepted, validate=False),
        "tree_commit": lambda: tree_commit(x.state, x.state_indices, res, accepted),
        "tree_commit_layers (24 layers)": lambda: tree_commit_layers(states, x.state_indices, layers, tree, accepted),
        "tree_commit_layers (24 layers, tma=1)": lambda: tree_commit_layers(states, x.state_indices, layers, tree,
                                                                            accepted, config=tma_config),
        "  check_verify_inputs": lambda: check_verify_inputs(*a, None, None),
        "  check_pending": lambda: check_pending(pending, shape, x.q.device, res2, None),
        "  PLANNER.plan": lambda: PLANNER.plan(shape.heads, torch.bfloat16, num_requests=args.batch,
                                               max_tree_size=tree.max_tree_size, depth=tree.depth, device=dev),
        "  result_buffers (recycled set)": lambda: result_buffers(shape, torch.bfloat16, x.q.device, tree, None),
        "  six fresh buffers (no pool)": lambda: RESULT_POOL.fresh(shape, torch.bfloat16, x.q.device),
        "  run_launch": lambda: run_launch(launch, *a, shape, res2, True),
        "  torch.empty x1": lambda: torch.empty(64, device=dev),
    }
    rows.update(launch_parts(launch, a, shape, res2))
    print(f"B={args.batch} T={args.tree_size} chain, 9B heads, bf16; launch {launch.variant} {launch.config}")
    main = [name for name in rows if not name.startswith(" ")]  # the calls themselves, timed side by side
    measured = dict(interleaved({name: rows[name] for name in main}, timed, 5, 2000, 200))
    measured.update({name: t / 24 for name, t in interleaved(rounds, timed, 5, 100, 200).items()})
    for name, fn in rows.items():  # their parts, each alone
        if name not in main:
            measured[name] = per_call(fn)
    for name, t in measured.items():
        print(f"{name:40s} {t:8.1f} us/call")
    measured = {name.strip(): t for name, t in measured.items()}
    sets = {f"N={key[0]} B={key[1]}": len(entries) for key, entries in RESULT_POOL._sets.items()}
    print(f"recycled result sets after the loops: {sets} ({RESULT_POOL.bytes / 2 ** 20:.2f} MiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "tree_size": args.tree_size, "launch": f"{launch.variant} {launch.config}",
                       "us_per_call": measured, "result_pool_sets": sets}, f, indent=1)
    if args.profile:
        print(profile_calls(lambda: tree_verify(*a), 2000))


if __name__ == "__main__":
    main()
