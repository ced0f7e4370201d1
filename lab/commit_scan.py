"""The all-layer commit's path scan and its first state tile, compiled for the H200 (sm_90) on a machine without a
GPU: what the binary costs (registers, spills, instructions) with the scan's candidate block ``B_T`` at each width
(`tree_commit.SCAN_BLOCK`), for the tuned all-layer launch of B=16 (24 layers) at trees of 8 and 64 nodes (issue 17:
20.7 us a layer at 64-node trees against 19.6 at 8-node ones, the same tuned config), and with the first state tile
read by pointers before the path is found, the rest by TMA (`tree_commit.TMA_FIRST_BY_POINTER`), and with each
request's path read from a table worked out once per launch (`tree_commit.PATH_TABLE_MIN_BLOCK`).

    python3 lab/commit_scan.py [--batch 16] [--layers 24] [--widths 8,16,32,64] [--tree-size 8,64]
    python3 lab/commit_scan.py --time --widths 16,32,64 [--json OUT]          # on the H200
    TRITON_INTERPRET=1 python3 lab/commit_scan.py --time --smoke --batch 2 --layers 2 --turns 1 --repeats 1

The kernel scans ``accepted // B_T + 1`` blocks of ``B_T`` candidates (`blocks.path_factors`), each a ``[B_P, B_T]``
compare: the result is the same at every ``B_T`` (the CPU tests run the commit at several), only its cost differs.
Static counts only: the launch's time is measured on the GPU (``--time``: each width's launch side by side, one CUDA
graph over rotating sets, every width first checked against the float64 closed form).
"""

from __future__ import annotations

import argparse
import os
import sys

if "--time" not in sys.argv:
    os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: compilable kernels

import torch  # noqa: E402

from bole_tune.config import CommitConfig  # noqa: E402
from bole_tune.kernels.verify import tree_commit as commit_module  # noqa: E402

TUNED = CommitConfig(b_k=128, b_v=16, v_span=128, num_warps=2, num_stages=3, tma=1)  # B=16, L=24, every tree bucket


def _heads(smoke: bool = False):
    from bole_tune.shapes import HeadShape
    return HeadShape(hk=1, hv=2, dk=32, dv=32) if smoke else HeadShape(hk=16, hv=32, dk=128, dv=128)


def compiled_rows(batch: int, layers: int, tree_sizes, widths) -> list[dict]:
    from bole_tune.binaries import CommitCase, binary_report, captured_commit, compile_for, unavailable

    reason = unavailable()
    if reason:
        raise SystemExit(f"cannot compile here: {reason}")
    rows = []
    for tree_size in tree_sizes:
        # the tuned all-layer launch, captured from a CPU call (nothing runs); the batch is not specialised
        fn, args, meta, grid = captured_commit(CommitCase("tuned", _heads(), "bf16", tree_size, layers, TUNED))
        for width, first, table in ([(w, False, False) for w in widths] + [(meta["B_T"], True, False)]
                                    + [(meta["B_T"], False, True)]):
            report = binary_report(compile_for(fn, args, dict(meta, B_T=width, TMA_FIRST_BY_POINTER=first,
                                                              PATH_TABLE=table)))
            rows.append({"tree_size": tree_size, "shipped_B_T": meta["B_T"], "B_T": width, "first_by_pointer": first,
                         "path_table": table,
                         **{k: report[k] for k in ("registers", "stack", "shared", "instructions")},
                         "ops": dict(list(report["ops"].items())[:12])})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--tree-size", default="8,64")
    parser.add_argument("--widths", default="8,16,32,64")
    parser.add_argument("--time", action="store_true", help="time each width on the GPU (checked first)")
    parser.add_argument("--first-widths", default="", help="with --time: rows of the first tile by pointers with the "
                        "scan at these widths too")
    parser.add_argument("--config", choices=("tuned", "database"), default="tuned", help="with --time: the B=16 "
                        "all-layer launch's config at every batch (tuned), or the shipped database's for each bucket")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="write the timed rows here")
    parser.add_argument("--smoke", action="store_true", help="with --time: a dry run on the CPU (TRITON_INTERPRET=1, "
                        "small heads, 2 layers, 2 requests; nothing worth reading in its times)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.tree_size.split(",")]
    widths = [int(w) for w in args.widths.split(",")]
    if not args.time:
        for r in compiled_rows(args.batch, args.layers, sizes, widths):
            print(f"T={r['tree_size']:3d} B_T={r['B_T']:3d} (shipped {r['shipped_B_T']:3d})"
                  f"{' first tile by pointers' if r['first_by_pointer'] else ''}"
                  f"{' path from a table' if r['path_table'] else ''} registers={r['registers']} "
                  f"stack={r['stack']} shared={r['shared']} instructions={r['instructions']}  "
                  + " ".join(f"{k}:{v}" for k, v in r["ops"].items()))
        return
    timed_rows(args.batch, args.layers, sizes, widths, args.turns, args.repeats, args.json, args.smoke,
               [int(w) for w in args.first_widths.split(",") if w], args.config)


SWITCHED = ("scan", "first", "table", "first table")  # the shipped kernel's rows, set by `switches`
SHIPPED = (commit_module.SCAN_BLOCK, commit_module.TMA_FIRST_BY_POINTER, commit_module.PATH_TABLE_MIN_BLOCK)


def switches(kind: str | None, width: int | None) -> None:
    """Set the commit's switches for one kind of row ("scan": the scan at ``width``, the first tile by TMA; "first":
    the first tile by pointers, the scan at ``width`` (None: the shipped rule's); "table": the path from a table, the
    first tile by TMA; "first table": the path from a table, the first tile by pointers), or back to the shipped ones
    (None)."""
    if kind is None:
        commit_module.SCAN_BLOCK, commit_module.TMA_FIRST_BY_POINTER, commit_module.PATH_TABLE_MIN_BLOCK = SHIPPED
        return
    commit_module.SCAN_BLOCK = width if kind in ("scan", "first") else None
    commit_module.TMA_FIRST_BY_POINTER = kind in ("first", "first table")
    commit_module.PATH_TABLE_MIN_BLOCK = 16 if kind in ("table", "first table") else None


def timed_rows(batch: int, layers: int, tree_sizes, widths, turns: int, repeats: int, path: str | None,
               smoke: bool = False, first_widths=(), config_from: str = "tuned") -> list:
    """On the GPU, per tree size: the tuned all-layer launch at each scan width (`tree_commit.SCAN_BLOCK`), the lab's
    lean commit whose path comes from a table worked out once per launch (`commit_lean.py`, the table's launch
    timed with it), and the copy floor (`mul_(1.0)` over the pools' bytes); every launch checked against the closed
    form first (one that is off is reported, not timed), then ``turns`` turns in alternating order, us per layer.
    ``first_widths``: rows of the first tile by pointers with the scan at each of these widths too. ``config_from``:
    "tuned", the B=16 all-layer launch's config at every batch, or "database", the runtime's lookup for each bucket
    (the shipped database's entry)."""
    from bole_tune.commit_bench import CommitBench
    from bole_tune.database import CommitKey
    from commit_lean import copy_floor_row, launch_error, launch_us_per_layer, lean_launch
    from lab_rows import release, save, show

    device, heads, rows = ("cpu", _heads(True), []) if smoke else ("cuda", _heads(), [])
    smoke_config = CommitConfig(b_k=16, b_v=16, v_span=32, num_warps=2, num_stages=2, tma=0)
    for tree_size in tree_sizes:
        config = smoke_config if smoke else TUNED
        if config_from == "database" and not smoke:
            config = commit_module.commit_config(heads.hk, heads.hv, heads.dk, heads.dv, torch.bfloat16, tree_size,
                                                 batch, layers, torch.device(device))
        bench = CommitBench(CommitKey.bucketed(heads, "bf16", tree_size, batch, layers=layers), device,
                            most_sets=2 if smoke else None)
        kinds = {f"scan {w}": ("scan", w) for w in widths}
        kinds["tma first by pointer"] = ("first", None)
        kinds.update({f"first + scan {w}": ("first", w) for w in first_widths})
        kinds["path table"] = ("table", None)
        kinds["first + path table"] = ("first table", None)
        kinds["lean table split3"] = ("lean", "split3")
        checked = {}
        for name, (kind, arg) in kinds.items():
            if kind in SWITCHED:
                switches(kind, arg)
                error = bench.error(config)
                switches(None, None)
            else:
                error = launch_error(bench, lambda *a, u=arg: lean_launch(*a, config, u))
            show({"tree_size": tree_size, "kernel": name, "error": error}, rows)
            if error <= 1e-4:
                checked[name] = (kind, arg)
        for turn in range(turns):
            order = list(checked) if turn % 2 == 0 else list(reversed(checked))
            for name in order:
                kind, arg = checked[name]
                row = {"tree_size": tree_size, "batch": batch, "layers": layers, "turn": turn, "kernel": name,
                       "config": config.text}
                if kind in SWITCHED:
                    switches(kind, arg)
                    row["us_per_layer"] = bench.time(config, repeats).p50_us / layers
                    switches(None, None)
                else:
                    row["us_per_layer"] = launch_us_per_layer(bench, lambda *a, u=arg: lean_launch(*a, config, u),
                                                              layers, device, repeats)
                show(row, rows)
            copy_floor_row(heads, batch, layers, device, repeats, rows)
        bench = None
        release(device)
    save(path, rows)
    print("\nus per layer (median over turns), x copy floor")
    for tree_size in tree_sizes:
        floor = sorted(r["us_per_layer"] for r in rows if r.get("tree_size", tree_size) == tree_size
                       and r.get("kernel") == "mul_ contiguous (copy floor)")
        mine = [r for r in rows if r.get("tree_size") == tree_size and "us_per_layer" in r]
        for name in dict.fromkeys(r["kernel"] for r in mine):
            t = sorted(r["us_per_layer"] for r in mine if r["kernel"] == name)
            print(f"T={tree_size:3d} {name:22s} {t[len(t) // 2]:7.2f}  {t[len(t) // 2] / floor[len(floor) // 2]:.3f}x")
    return rows


if __name__ == "__main__":
    main()
