"""What the tenth session's lab scripts (`order_mix.py`, `tma_state.py`, `split_stream.py`) share: one line per
measured row, the rows written as JSON, and the kernel `run.py` launches swapped for one call."""

from __future__ import annotations

import cProfile
import io
import json
import pstats

from bole_tune.kernels.verify import run as run_module


def profile_calls(fn, calls: int, lines: int = 25) -> str:
    """cProfile of ``calls`` calls of ``fn``: its ``lines`` costliest functions by their own time (the host-path
    scripts' ``--profile``)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(lines)
    return out.getvalue()


def interleaved(rows: dict, timer, turns: int, calls: int, warm: int) -> dict:
    """Each row's median over ``turns`` turns of ``timer(fn, calls)`` (us a call), every turn timing every row in
    order after ``warm`` calls of each: the host's state drifts, so rows compared with each other are timed side by
    side, and a slow spell lands on every row of a turn, not on the rows that happened to run in it."""
    for fn in rows.values():
        for _ in range(warm):
            fn()
    times = {name: [] for name in rows}
    for _ in range(turns):
        for name, fn in rows.items():
            times[name].append(timer(fn, calls))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def show(row: dict, rows: list) -> None:
    """Print ``row`` on one line (floats to four digits) and keep it."""
    print(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    rows.append(row)


def save(path: str | None, rows: list) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


def with_resident(kernel, fn):
    """``fn()`` with ``kernel`` standing in for `run.RESIDENT` (the stream launch's kernel)."""
    shipped = run_module.RESIDENT
    run_module.RESIDENT = kernel
    try:
        return fn()
    finally:
        run_module.RESIDENT = shipped


def release(device) -> None:
    """Hand the cached blocks of the last case back (on a GPU) before the next case allocates its own."""
    if str(device) == "cuda":
        import torch

        torch.cuda.empty_cache()


def ring_check(bench, launch, split, shipped, rounds: int = 2, steps: int = 5) -> float:
    """Largest relative difference, over ``steps`` rounds of a `PendingRing` of ``rounds`` rounds (read and write
    rounds), between the shipped kernel's outputs and the split's, and of the slots after a final flush."""
    from bole_tune.kernels import PendingRing, tree_verify

    tree, x, _ = bench.reference()
    c = bench.case
    accepted = bench.deepest(tree)
    worst = 0.0
    pools, outs = [], []
    for kernel in (shipped, split):
        pool = x.state.clone()
        ring = PendingRing(pool.shape[0], rounds, tree.depth + 1, tree.num_nodes, tree.num_requests, pool.device)
        arena = ring.results(c.shape, c.dtype)
        got = []
        run_module.RESIDENT = kernel
        try:
            for _ in range(steps):
                step = ring.begin(tree)
                res = tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, x.state_indices, tree, launch=launch,
                                  ring=step.layer(arena))
                got.append(res.o.float().clone())
                ring.end(step, x.state_indices, accepted)
            ring.flush(x.state_indices, [pool], [arena])
        finally:
            run_module.RESIDENT = shipped
        pools.append(pool)
        outs.append(got)
    for a, b in zip(*outs):
        worst = max(worst, float((a - b).norm() / a.norm()))
    used = x.state_indices.long()
    return max(worst, float((pools[0][used] - pools[1][used]).norm() / pools[0][used].norm()))


def check_and_time(row: dict, bench, kernel, launch, fold_launch, repeats: int, rounds: int, timed: bool = True,
                   ring_against=None) -> bool:
    """``kernel`` standing in for `run.RESIDENT`: checked against the float64 reference (the verify with ``launch``,
    the fold with ``fold_launch``: outputs and committed slots; with ``ring_against``, five ring rounds against that
    kernel), then (``timed``) the verify, the folded round and the ring's rounds timed; into ``row``. A failure is
    recorded in ``row["failed"]`` (False returned): a lab sweep goes on."""
    from bole_tune.kernels import tree_verify

    try:
        row["error"] = with_resident(kernel, lambda: bench.check(tree_verify, launch))
        row["fold_error"], row["fold_state_error"] = with_resident(kernel, lambda: bench.fold_errors(fold_launch))
        if ring_against is not None:
            row["ring_vs_shipped"] = ring_check(bench, launch, kernel, ring_against)
        if timed:
            row["verify"] = with_resident(kernel, lambda: bench.time_verify(tree_verify, launch, repeats)[0].p50_us)
            row["folded"] = with_resident(kernel, lambda: bench.time_folded(fold_launch, repeats).p50_us)
            ring = with_resident(kernel, lambda: bench.time_ring(rounds, 24, repeats, read_launch=launch,
                                                                 write_launch=fold_launch))
            row.update({key: t.p50_us for key, t in ring.items()})
        return True
    except Exception as e:  # noqa: BLE001 - a lab sweep records what failed and goes on
        row["failed"] = f"{type(e).__name__}: {str(e)[:200]}"
        return False
