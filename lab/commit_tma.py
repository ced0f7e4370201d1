"""Issue 17, fourteenth session: the all-layer commit moving its state tiles by TMA (a tensor descriptor over the pool)
instead of per-thread pointer loads and stores.

The commit at B >= 16 is 1.27x its copy floor (the issue asks <= 1.25x). Each of its programs streams 64 KiB of one
head's state in ``[b_v, b_k]`` tiles, and a tile is the product's accumulator, so Triton's pipeliner does not
prefetch it: one tile in flight per program, and the tile in registers. Through a
`triton.tools.tensor_descriptor.TensorDescriptor` (the layers' pools seen as ``[L * slots * Hv * dv, dk]`` rows,
``[b_v, b_k]`` blocks), each load is a bulk copy into shared memory that the pipeliner multi-buffers behind
mbarriers (``num_stages`` tiles in flight, not held in registers), and each store a bulk copy out. The path's
factors and the product are the shipped kernel's (`blocks.path_factors`, `tree_commit.commit_tile`).

Compiled for sm_90 on the CPU (`--sass`, 9B heads): at 128/16/128/2/3 the TMA commit holds 124 registers a thread
and 34.8 KB of shared memory (two state tiles in flight plus the store's staging tile and the product's operands;
the loop is a `tl.range` with ``num_stages``: a plain `range` was not pipelined, 26.6 KB), against the shipped
kernel's 163 registers and one tile in flight in registers (its pointer loads pipelined the same way: 200 registers);
128/32/128/4/3 101 registers, 61.5 KB; its floor 41 registers. Not yet run on a GPU. A path deeper than ``B_P`` (16)
nodes takes a second pass that reloads tiles the first pass stored by TMA, with no wait on those stores between:
the lab's trees (8 nodes, depth <= 8) never take it; a shipped version must wait for the stores or take that pass
with pointer loads after a fence.

Rows timed side by side (one CUDA graph over rotating sets, median per launch, per layer): the TMA commit at several
tiles, its floor (the same grid and descriptor, each tile read and written back times 1.0), the shipped launch at
its tuned config, and `mul_(1.0)` over a contiguous buffer of the same bytes (the copy floor). Every TMA commit is
checked against `commit_closed_form` (`CommitBench.reference`) before it is timed; a wrong one is not timed.

    python3 lab/commit_tma.py [--json OUT] [--batch 16,32] [--configs 128/16/128/2/3,...] [--repeats 20]
    TRITON_INTERPRET=1 python3 lab/commit_tma.py --smoke
    python3 lab/commit_tma.py --sass [--configs ...]      # compile for sm_90 on this machine: registers, shared memory
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from bole_tune.commit_bench import CommitBench
from bole_tune.config import CommitConfig, node_block
from bole_tune.database import CommitKey
from bole_tune.kernels.common import path_precision
from bole_tune.kernels.verify import tree_commit as commit_module
from bole_tune.kernels.verify.blocks import path_factors
from bole_tune.kernels.verify.result import commit_epoch
from bole_tune.kernels.verify.tree_commit import commit_tile
from bole_tune.shapes import HeadShape
from commit_lean import commit_case, launch_error, launch_us_per_layer, shipped_and_copy_floor
from lab_rows import release, save, show

CONFIGS = "128/16/128/2/3,128/16/128/2/4,128/32/128/4/3,128/32/128/4/4,64/16/128/2/4,32/32/128/2/4,128/64/128/4/2"


@triton.jit
def tma_span(s_desc, state_ptr, row0, col, rows, m_p, weight, decay, b_k, i_h, i_span, u_ptr, H_V,
             D_K: tl.constexpr, D_V: tl.constexpr, B_K: tl.constexpr, B_V: tl.constexpr, V_SPAN: tl.constexpr,
             PRODUCT: tl.constexpr, STAGES: tl.constexpr, TMA_STORE: tl.constexpr):
    """One pass of the path's nodes over the program's ``V_SPAN`` rows: each ``[B_V, b_k]`` tile loaded by TMA,
    decayed and updated (`commit_tile`), stored by TMA (``TMA_STORE``) or by pointers."""
    for i_c in tl.range(V_SPAN // B_V, num_stages=STAGES):
        o_c = i_c * B_V + tl.arange(0, B_V)
        b_s = s_desc.load([row0 + i_c * B_V, col])
        b_new = commit_tile(b_s, o_c, rows, m_p, weight, decay, b_k, i_h, i_span, u_ptr, H_V, D_V, V_SPAN, PRODUCT)
        if TMA_STORE:
            s_desc.store([row0 + i_c * B_V, col], b_new)
        else:
            p = (state_ptr + (row0 + i_c * B_V + tl.arange(0, B_V)).to(tl.int64)[:, None] * D_K
                 + col + tl.arange(0, B_K)[None, :])
            tl.store(p, b_new)


@triton.jit(do_not_specialize=["epoch", "num_requests", "rows_per_layer", "rows_per_slot"])
def commit_tma_kernel(
    s_desc, state_ptr, state_indices_ptr, accepted_ptr, offsets_ptr, dfs_enter_ptr, dfs_exit_ptr, node_depth_ptr,
    u_ptr, logp_ptr, k_ptr, k_scale_ptr, committed_ptr, epoch, rows_per_layer, rows_per_slot,
    stride_u_layer, stride_logp_layer, stride_k_layer, stride_k_scale_layer, stride_committed_layer, num_requests,
    H_V: tl.constexpr, H_K: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr,
    B_T: tl.constexpr, B_K: tl.constexpr, B_V: tl.constexpr, V_SPAN: tl.constexpr, B_P: tl.constexpr,
    PRODUCT: tl.constexpr, FLOOR: tl.constexpr, STAGES: tl.constexpr, TMA_STORE: tl.constexpr,
):
    i_tile = tl.program_id(0)
    i_h = tl.program_id(1)
    i_l = tl.program_id(2) // num_requests
    i_r = tl.program_id(2) % num_requests
    i_hk = i_h // (H_V // H_K)
    i_span = i_tile // (D_K // B_K)
    col = (i_tile % (D_K // B_K)) * B_K
    slot = tl.load(state_indices_ptr + i_r)
    # the pool's rows: [layer, slot, head, value row] flattened (int32: the lab's pools hold < 2^31 rows)
    row0 = i_l * rows_per_layer + slot * rows_per_slot + i_h * D_V + i_span * V_SPAN
    if FLOOR:
        for i_c in tl.range(V_SPAN // B_V, num_stages=STAGES):
            s_desc.store([row0 + i_c * B_V, col], s_desc.load([row0 + i_c * B_V, col]) * 1.0)
    else:
        u_ptr += i_l.to(tl.int64) * stride_u_layer
        logp_ptr += i_l.to(tl.int64) * stride_logp_layer
        k_ptr += i_l.to(tl.int64) * stride_k_layer
        k_scale_ptr += i_l.to(tl.int64) * stride_k_scale_layer
        committed_ptr += i_l.to(tl.int64) * stride_committed_layer
        accepted = tl.load(accepted_ptr + i_r).to(tl.int64)
        bos = tl.load(offsets_ptr + i_r).to(tl.int64)
        num_nodes = tl.load(offsets_ptr + i_r + 1).to(tl.int64) - bos
        mark = tl.load(committed_ptr + i_r)
        if (accepted >= 0) & (accepted < num_nodes) & ((mark == 0) | (mark == epoch)):
            tl.store(committed_ptr + i_r, epoch)
            o_k = col + tl.arange(0, B_K)
            for i_p in range(0, tl.load(node_depth_ptr + bos + accepted) // B_P + 1):
                rows, m_p, weight, logp_a = path_factors(accepted, bos, i_p, i_h.to(tl.int64), i_hk.to(tl.int64),
                                                         dfs_enter_ptr, dfs_exit_ptr, node_depth_ptr, logp_ptr,
                                                         k_scale_ptr, H_V, H_K, B_T, B_P)
                b_k = tl.load(k_ptr + rows[:, None] * (H_K * D_K) + i_hk * D_K + o_k[None, :], mask=m_p[:, None],
                              other=0).to(tl.float32)
                # the first pass decays S_pre; later ones (paths deeper than B_P) add to what it wrote
                decay = tl.where(i_p == 0, tl.exp(logp_a), 1.0)
                tl.debug_barrier()
                tma_span(s_desc, state_ptr, row0, col, rows, m_p, weight, decay, b_k, i_h, i_span, u_ptr, H_V,
                         D_K, D_V, B_K, B_V, V_SPAN, PRODUCT, STAGES, TMA_STORE)


def descriptor(states, config: CommitConfig) -> TensorDescriptor:
    """The layers' pools ``[L, slots, Hv, dv, dk]`` (contiguous) as ``[rows, dk]`` in ``[b_v, b_k]`` blocks."""
    if not states.is_contiguous():
        raise ValueError("states: the TMA commit needs a contiguous pool")
    dk = states.shape[-1]
    return TensorDescriptor(states, [states.numel() // dk, dk], [dk, 1], [config.b_v, config.b_k])


def tma_args(states, slots, results, tree, accepted, config: CommitConfig, floor: bool = False,
             tma_store: bool = True):
    """The launch's grid, arguments and meta-parameters (states ``[L, slots, Hv, dv, dk]``)."""
    layers, num_slots, hv, dv, dk = states.shape
    hk = results.k.shape[-2]
    grid = ((dv // config.v_span) * (dk // config.b_k), hv, layers * tree.num_requests)
    args = (descriptor(states, config), states, slots, accepted, tree.offsets, tree.dfs_enter, tree.dfs_exit, tree.node_depth,
            results.u, results.log_decay, results.k, results.k_scale, results.committed, commit_epoch(),
            num_slots * hv * dv, hv * dv,
            *(x.stride(0) for x in (results.u, results.log_decay, results.k, results.k_scale, results.committed)),
            tree.num_requests)
    meta = dict(H_V=hv, H_K=hk, D_K=dk, D_V=dv, B_T=node_block(tree.max_tree_size), B_K=config.b_k, B_V=config.b_v,
                V_SPAN=config.v_span, B_P=16, PRODUCT=path_precision(commit_module.COMMIT_PRODUCT, results.k.dtype,
                                                                      "ieee"),
                FLOOR=floor, STAGES=config.num_stages, TMA_STORE=tma_store, num_warps=config.num_warps, num_stages=config.num_stages)
    return grid, args, meta


def tma_launch(states, slots, results, tree, accepted, config: CommitConfig, floor: bool = False,
               tma_store: bool = True):
    grid, args, meta = tma_args(states, slots, results, tree, accepted, config, floor, tma_store)
    commit_tma_kernel[grid](*args, **meta)


def sass(heads: HeadShape, configs: list[CommitConfig]) -> None:
    """Compile each config for sm_90 here (no GPU needed): registers, spills, shared memory."""
    from sass_stats import compile_for_h200, sass_report
    key = CommitKey.bucketed(heads, "bf16", 8, 16, layers=2)
    bench = CommitBench(key, "cpu", most_sets=2)
    tree, states, slots, accepted, results, _ = bench.reference()
    for config in configs:
        for floor, store in ((False, True), (False, False), (True, True)):
            grid, args, meta = tma_args(states, slots, results, tree, accepted, config, floor, store)
            name = "floor" if floor else "commit" if store else "commit, pointer stores"
            try:
                report = sass_report(compile_for_h200(commit_tma_kernel, args, meta))
                print(config.text, name,
                      {k: report[k] for k in report if k in ("registers", "spills", "shared", "stack")})
            except Exception as e:  # noqa: BLE001 - a lab sweep reports what failed and goes on
                print(config.text, name, "failed:", type(e).__name__, str(e)[:300])


def shipped_tma(heads: HeadShape, batches: str, layers: int, device, repeats: int, smoke: bool) -> list:
    """The shipped launch's two state loads side by side: its tuned config with ``tma`` 0 and 1 (each checked against
    the closed form, then timed; two turns, the second in reverse order), and the copy floor, us per layer."""
    import dataclasses

    from bole_tune.kernels.verify import tree_commit as shipped

    if smoke:
        shipped.TMA_OFF_GPU = True
    rows = []
    for batch in [2] if smoke else [int(b) for b in batches.split(",")]:
        bench, tuned = commit_case(heads, batch, layers, device, smoke)
        configs = [dataclasses.replace(tuned, tma=0), dataclasses.replace(tuned, tma=1)]
        for turn in range(1 if smoke else 2):
            for config in configs if turn % 2 == 0 else configs[::-1]:
                row = {"batch": batch, "layers": layers, "config": config.text, "turn": turn,
                       "kernel": "shipped, tma loads" if config.tma else "shipped, pointer loads",
                       "error": bench.error(config)}
                if not smoke:
                    row["us_per_layer"] = bench.time(config, repeats).p50_us / layers
                show(row, rows)
        if not smoke:
            from commit_lean import copy_floor_row
            copy_floor_row(heads, batch, layers, device, repeats, rows)
        bench = None
        release(device)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--batch", default="16,32")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--configs", default=CONFIGS, help="b_k/b_v/v_span/warps/stages, comma separated")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--sass", action="store_true")
    parser.add_argument("--shipped", action="store_true",
                        help="the shipped launch (tree_commit_layers) at its tuned config, tma=0 against tma=1")
    args = parser.parse_args()
    heads = HeadShape(hk=2, hv=4, dk=32, dv=32) if args.smoke else HeadShape(hk=16, hv=32, dk=128, dv=128)
    configs = [CommitConfig(*map(int, c.split("/"))) for c in args.configs.split(",") if c]
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                 device="cpu" if args.smoke else "cuda"))
    if args.sass:
        sass(heads, configs)
        return
    device = "cpu" if args.smoke else "cuda"
    layers = 2 if args.smoke else args.layers
    if args.shipped:
        save(args.json, shipped_tma(heads, args.batch, layers, device, args.repeats, args.smoke))
        return
    if args.smoke:
        configs = [CommitConfig(32, 16, 32, 2, 2), CommitConfig(16, 16, 32, 1, 3)]
    rows = []
    for batch in [2] if args.smoke else [int(b) for b in args.batch.split(",")]:
        bench, tuned = commit_case(heads, batch, layers, device, args.smoke)
        for config in configs:
            for store in (True, False):
                row = {"batch": batch, "layers": layers, "config": config.text,
                       "kernel": "tma" if store else "tma loads, pointer stores"}
                try:
                    row["error"] = launch_error(bench, lambda *a, c=config, t=store: tma_launch(*a, c, tma_store=t))
                    if row["error"] <= 1e-4 and not args.smoke:
                        row["us_per_layer"] = launch_us_per_layer(
                            bench, lambda *a, c=config, t=store: tma_launch(*a, c, tma_store=t), layers, device,
                            args.repeats)
                        if store:
                            row["floor_us_per_layer"] = launch_us_per_layer(
                                bench, lambda *a, c=config: tma_launch(*a, c, floor=True), layers, device,
                                args.repeats, fresh=False)
                except Exception as e:  # noqa: BLE001 - a lab sweep records what failed and goes on
                    row["failed"] = f"{type(e).__name__}: {str(e)[:200]}"
                show(row, rows)
        if not args.smoke:
            shipped_and_copy_floor(bench, tuned, heads, batch, layers, device, args.repeats, rows)
        bench = None
        release(device)
    save(args.json, rows)


if __name__ == "__main__":
    main()
