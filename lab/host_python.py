"""The Python part of an eager call's host time, on a machine without a GPU: the calls of `host_path.py` with CPU
tensors, every Triton launch left out (the launcher does nothing) and the kernels' modules told that Triton runs
(so the checks, the planner, the result pool, the keys and the launch arguments all run as on the GPU). What is
left out is the C launcher itself (5-11 us on the H200 machine, `host_path.py`'s "compiled.run alone") and the
device's own queueing. The figures are this CPU's: compare versions side by side in one run (the rows interleaved
over turns), as ratios, never against the GPU host's.

    python3 lab/host_python.py [--batch 1] [--tree-size 4] [--turns 5] [--profile ROW]

The results are not valid (no kernel runs): this times host code only.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

from bole_tune.kernels import (LayerResults, PendingCommit, PendingPaths, tree_commit, tree_commit_layers,  # noqa: E402
                               tree_verify)
from bole_tune.kernels import launcher  # noqa: E402
from bole_tune.kernels.verify import pending as pending_module  # noqa: E402
from bole_tune.kernels.verify import ring as ring_module  # noqa: E402
from bole_tune.kernels.verify import tree_commit as commit_module  # noqa: E402
from bole_tune.kernels.verify import tree_verify as verify_module  # noqa: E402
from bole_tune.kernels.verify.checks import check_pending, check_verify_inputs  # noqa: E402
from bole_tune.kernels.verify.result import result_buffers  # noqa: E402
from bole_tune.kernels.verify.run import run_launch  # noqa: E402
from bole_tune.workloads import make_inputs, make_tree  # noqa: E402
from lab_rows import interleaved, profile_calls  # noqa: E402


def launches_left_out() -> None:
    """Every module that asks whether Triton runs is told it does; every kept-binary launch does nothing."""
    for module in (verify_module, commit_module, pending_module, ring_module):
        module.use_triton = lambda device: True
    launcher.FastLauncher.launch_keyed = lambda self, *args, **kwargs: None
    launcher.FastLauncher.__call__ = lambda self, *args, **kwargs: None


def per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) * 1e6 / calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tree-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--profile", help="cProfile this row (its name as printed) after the table")
    args = parser.parse_args()
    tree = make_tree([args.tree_size] * args.batch, "chain", device="cpu")
    x = make_inputs(tree, 16, 32, 128, 128, torch.bfloat16, "cpu", seed=1)
    a = x.args(tree)
    launches_left_out()
    accepted = torch.full((args.batch,), args.tree_size - 1, dtype=torch.int32)
    paths = PendingPaths(tree, accepted, torch.arange(args.batch, dtype=torch.int32))
    res, res2 = tree_verify(*a), tree_verify(*a)
    shape = check_verify_inputs(*a, None, None)
    pending = PendingCommit(paths, res)
    states = x.state[None].expand(24, *x.state.shape).contiguous()
    layers = LayerResults.empty(24, tree, shape.heads, torch.bfloat16, "cpu")
    kept = [tree_verify(*a)]
    stacks = [LayerResults.empty(24, tree, shape.heads, torch.bfloat16, "cpu") for _ in range(2)]
    turn = [0]

    def folded_layers():  # an engine's folded round over stacked results: two sets, alternating, layer 5 each round
        turn[0] += 1
        out, prev = stacks[turn[0] % 2], stacks[(turn[0] + 1) % 2]
        tree_verify(*a, out=out.layer(5, tree), pending=PendingCommit(paths, prev.layer(5, tree)))

    def folded_default():  # an engine's default folded call: the result it returns is the next call's pending
        kept[0] = tree_verify(*a, pending=PendingCommit(paths, kept[0]))

    launch = verify_module.PLANNER.plan(shape.heads, torch.bfloat16, num_requests=args.batch,
                                        max_tree_size=tree.max_tree_size, depth=tree.depth, device="cpu")
    rows = {
        "tree_verify (default)": lambda: tree_verify(*a),
        "tree_verify out=": lambda: tree_verify(*a, out=res2),
        "tree_verify out=layers.layer(l)": lambda: tree_verify(*a, out=layers.layer(5)),
        "folded (pending=, out=)": lambda: tree_verify(*a, out=res2, pending=pending),
        "folded (pending=, default)": folded_default,
        "folded (out=, pending= layer views)": folded_layers,
        "tree_commit": lambda: tree_commit(x.state, x.state_indices, res, accepted),
        "tree_commit_layers (24)": lambda: tree_commit_layers(states, x.state_indices, layers, tree, accepted),
        "  check_verify_inputs": lambda: check_verify_inputs(*a, None, None),
        "  check_pending": lambda: check_pending(pending, shape, x.q.device, res2, None),
        "  result_buffers (pool)": lambda: result_buffers(shape, torch.bfloat16, x.q.device, tree, None),
        "  run_launch": lambda: run_launch(launch, *a, shape, res2, True),
        "  run_launch (folded)": lambda: run_launch(launch, *a, shape, res2, True, pending),
        "  torch.empty x1": lambda: torch.empty(64),
    }
    print(f"B={args.batch} T={args.tree_size} chain, 9B heads, bf16, CPU tensors, launches left out; "
          f"{args.turns} turns of {args.calls} calls, medians")
    for name, t in interleaved(rows, per_call, args.turns, args.calls, 300).items():
        print(f"{name:32s} {t:7.2f} us/call")
    if args.profile:
        print(profile_calls(rows[args.profile], args.calls))


if __name__ == "__main__":
    main()
