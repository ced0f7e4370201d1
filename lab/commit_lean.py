"""Issue 17, eleventh session: the commit at B >= 16 against its floor, taken apart and rebuilt lean.

Three kinds of launch over the same pools `CommitBench` times (24 layers' states, each request's deepest node
committed, input sets rotating past the L2 cache; one CUDA graph, median per launch, per layer):

  shipped   `tree_commit_layers` at the bucket's tuned config (the product)
  floor     the commit's own grid and tiles over the same slots, each tile scaled by 1.0 in place: what reading
            and writing exactly the commit's bytes costs with its indirection (the slot) and nothing else
  lean      a commit whose program asks for its first state tile before anything but the slot, reads its path
            from a table worked out once per launch (`pending_path_rows`, timed with it), and applies the path
            as a dot product over the padded path ("dot", the shipped arithmetic) or as one outer product per
            path node, unrolled, every load issued up front ("rank1")

Every lean launch is checked against `commit_closed_form` (the bench's reference, `CommitBench.reference`) before
it is timed; a wrong one is reported and not timed. Beside them, `mul_(1.0)` over a contiguous buffer of the same
bytes: the copy floor the issue's target (<= 1.25x) is stated against.

    python3 lab/commit_lean.py [--json OUT] [--batch 16,32] [--layers 24] [--repeats 20]
    TRITON_INTERPRET=1 python3 lab/commit_lean.py --smoke
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from bole_tune.commit_bench import CommitBench
from bole_tune.config import CommitConfig, default_commit_config
from bole_tune.database import CommitKey
from bole_tune.kernels import tree_commit_layers
from bole_tune.kernels.verify.blocks import path_product
from bole_tune.kernels.verify.pending import pending_path_rows
from bole_tune.kernels.verify.result import commit_epoch
from bole_tune.lookup import tuned_commit
from bole_tune.shapes import HeadShape
from bole_tune.timing import time_launches
from lab_rows import release, save, show

UPDATES = {"rank1": 1, "dot": 2, "tf32x2": 3, "loop": 4, "split3": 5}
C = CommitConfig
CANDIDATES = [(u, c) for u in ("split3", "tf32x2") for c in (C(128, 16, 128, 2, 3), C(128, 16, 128, 2, 2),
                                                            C(128, 32, 128, 4, 2), C(64, 16, 128, 2, 3))]
FLOORS = [C(128, 16, 128, 2, 3), C(128, 16, 16, 2, 1), C(128, 32, 32, 4, 1)]


@triton.jit(do_not_specialize=["num_requests"])
def pool_scale_kernel(state_ptr, state_indices_ptr, stride_s_layer, stride_s_slot, stride_s_h, stride_s_v,
                      num_requests, D_K: tl.constexpr, B_K: tl.constexpr, B_V: tl.constexpr, V_SPAN: tl.constexpr):
    """The floor: the commit's grid and tiles, each tile read and written back times 1.0."""
    i_tile = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_l = tl.program_id(2).to(tl.int64) // num_requests
    i_r = tl.program_id(2).to(tl.int64) % num_requests
    i_span = i_tile // (D_K // B_K)
    i_k = i_tile % (D_K // B_K)
    slot = tl.load(state_indices_ptr + i_r).to(tl.int64)
    p_slab = (state_ptr + i_l * stride_s_layer + slot * stride_s_slot + i_h * stride_s_h
              + i_span * V_SPAN * stride_s_v + i_k * B_K + tl.arange(0, B_K)[None, :])
    for i_c in range(0, V_SPAN // B_V):
        p = p_slab + (i_c * B_V + tl.arange(0, B_V))[:, None] * stride_s_v
        tl.store(p, tl.load(p) * 1.0)


@triton.jit(do_not_specialize=["epoch", "num_requests", "stride_logp_layer", "stride_k_scale_layer",
                               "stride_committed_layer"])
def commit_lean_kernel(
    state_ptr, state_indices_ptr, accepted_ptr, offsets_ptr, rows_ptr,
    u_ptr, logp_ptr, k_ptr, k_scale_ptr, committed_ptr, epoch,
    stride_s_layer, stride_s_slot, stride_s_h, stride_s_v,
    stride_u_layer, stride_logp_layer, stride_k_layer, stride_k_scale_layer, stride_committed_layer, num_requests,
    H_V: tl.constexpr, H_K: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr,
    B_K: tl.constexpr, B_V: tl.constexpr, V_SPAN: tl.constexpr, B_P: tl.constexpr, UPDATE: tl.constexpr,
):
    i_tile = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_l = tl.program_id(2).to(tl.int64) // num_requests
    i_r = tl.program_id(2).to(tl.int64) % num_requests
    state_ptr += i_l * stride_s_layer
    u_ptr += i_l * stride_u_layer
    logp_ptr += i_l * stride_logp_layer
    k_ptr += i_l * stride_k_layer
    k_scale_ptr += i_l * stride_k_scale_layer
    committed_ptr += i_l * stride_committed_layer
    i_hk = i_h // (H_V // H_K)
    i_span = i_tile // (D_K // B_K)
    i_k = i_tile % (D_K // B_K)
    # the slot, then at once the first state tile: nothing else stands before the stream
    slot = tl.load(state_indices_ptr + i_r).to(tl.int64)
    o_k = i_k * B_K + tl.arange(0, B_K)
    p_slab = state_ptr + slot * stride_s_slot + i_h * stride_s_h + i_span * V_SPAN * stride_s_v + o_k[None, :]
    b_first = tl.load(p_slab + tl.arange(0, B_V)[:, None] * stride_s_v)
    # the path from the table (-1 past the accepted node; all -1: nothing to commit), the mark
    o_p = tl.arange(0, B_P)
    rows = tl.load(rows_ptr + i_r * B_P + o_p).to(tl.int64)
    mark = tl.load(committed_ptr + i_r)
    row_a = tl.max(rows, axis=0)  # parents precede children: the accepted node is the path's last row
    if (row_a >= 0) & ((mark == 0) | (mark == epoch)):
        tl.store(committed_ptr + i_r, epoch)
        logp_a = tl.load(logp_ptr + row_a * H_V + i_h)
        decay = tl.exp(logp_a)
        m_p = rows >= 0
        weight = tl.zeros([B_P], dtype=tl.float32)
        b_k = tl.zeros([B_P, B_K], dtype=tl.float32)
        if (UPDATE == 2) | (UPDATE == 3) | (UPDATE == 5):  # the padded path's factors, once for the program's tiles
            logp_p = tl.load(logp_ptr + rows * H_V + i_h, mask=m_p, other=0)
            scale_p = tl.load(k_scale_ptr + rows * H_K + i_hk, mask=m_p, other=0)
            weight = tl.where(m_p, tl.exp(logp_a - logp_p) * scale_p, 0.0)
            b_k = tl.load(k_ptr + rows[:, None] * (H_K * D_K) + i_hk * D_K + o_k[None, :],
                          mask=m_p[:, None], other=0).to(tl.float32)
        n_path = tl.sum(m_p.to(tl.int32), axis=0)
        # the first tile is the one already requested; the others are read in the loop
        tl.store(p_slab + tl.arange(0, B_V)[:, None] * stride_s_v,
                 lean_tile(b_first, i_span * V_SPAN + tl.arange(0, B_V), rows, m_p, weight, b_k, decay, logp_a,
                           n_path, i_r, i_h, i_hk, o_k, rows_ptr, u_ptr, logp_ptr, k_ptr, k_scale_ptr,
                           H_V, H_K, D_K, D_V, B_P, UPDATE))
        for i_c in range(1, V_SPAN // B_V):
            o_c = i_c * B_V + tl.arange(0, B_V)
            b_s = tl.load(p_slab + o_c[:, None] * stride_s_v)
            tl.store(p_slab + o_c[:, None] * stride_s_v,
                     lean_tile(b_s, i_span * V_SPAN + o_c, rows, m_p, weight, b_k, decay, logp_a, n_path, i_r, i_h,
                               i_hk, o_k, rows_ptr, u_ptr, logp_ptr, k_ptr, k_scale_ptr, H_V, H_K, D_K, D_V, B_P,
                               UPDATE))


@triton.jit
def lean_tile(b_s, o_v, rows, m_p, weight, b_k, decay, logp_a, n_path, i_r, i_h, i_hk, o_k, rows_ptr, u_ptr, logp_ptr,
              k_ptr, k_scale_ptr, H_V: tl.constexpr, H_K: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr,
              B_P: tl.constexpr, UPDATE: tl.constexpr):
    """One committed tile: ``decay * b_s`` plus the path's update over rows ``o_v`` and columns ``o_k``."""
    if UPDATE == 2:  # fp32 FMAs over the padded path (the shipped arithmetic)
        b_u = tl.load(u_ptr + rows[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :], mask=m_p[:, None], other=0)
        b_s = decay * b_s + tl.dot(tl.trans(b_u * weight[:, None]), b_k, input_precision="ieee")
    elif (UPDATE == 3) | (UPDATE == 5):  # tensor cores, exact tf32 pieces (`blocks.path_product`)
        b_u = tl.load(u_ptr + rows[:, None] * (H_V * D_V) + i_h * D_V + o_v[None, :], mask=m_p[:, None], other=0)
        b_s = path_product(decay * b_s, tl.trans(b_u * weight[:, None]), b_k, "split2" if UPDATE == 3 else "split3")
    elif UPDATE == 4:  # one outer product per node the path really has, in a loop
        b_s = decay * b_s
        for p in range(0, n_path):
            row = tl.load(rows_ptr + i_r * B_P + p).to(tl.int64)
            w = tl.exp(logp_a - tl.load(logp_ptr + row * H_V + i_h)) * tl.load(k_scale_ptr + row * H_K + i_hk)
            k_p = tl.load(k_ptr + row * (H_K * D_K) + i_hk * D_K + o_k).to(tl.float32)
            u_p = tl.load(u_ptr + row * (H_V * D_V) + i_h * D_V + o_v)
            b_s += (u_p * w)[:, None] * k_p[None, :]
    else:  # one outer product per table column, unrolled, every load issued up front
        b_s = decay * b_s
        for p in tl.static_range(B_P):
            row = tl.load(rows_ptr + i_r * B_P + p).to(tl.int64)
            ok = row >= 0
            row = tl.maximum(row, 0)
            w = tl.where(ok, tl.exp(logp_a - tl.load(logp_ptr + row * H_V + i_h))
                         * tl.load(k_scale_ptr + row * H_K + i_hk), 0.0)
            k_p = tl.load(k_ptr + row * (H_K * D_K) + i_hk * D_K + o_k, mask=ok, other=0).to(tl.float32)
            u_p = tl.load(u_ptr + row * (H_V * D_V) + i_h * D_V + o_v, mask=ok, other=0)
            b_s += (u_p * w)[:, None] * k_p[None, :]
    return b_s


def lean_launch(states, slots, results, tree, accepted, config: CommitConfig, update: str):
    """One lean launch over every layer of ``states`` ([L, slots, Hv, dv, dk]): the path table, then the commit."""
    identity = torch.arange(tree.num_requests, dtype=torch.int32, device=states.device)
    table = pending_path_rows(tree, accepted, identity)
    layers, hv, dv = states.shape[0], results.u.shape[-2], results.u.shape[-1]
    hk, dk = results.k.shape[-2], results.k.shape[-1]
    grid = ((dv // config.v_span) * (dk // config.b_k), hv, layers * tree.num_requests)
    commit_lean_kernel[grid](
        states, slots, accepted, tree.offsets, table, results.u, results.log_decay, results.k, results.k_scale,
        results.committed, commit_epoch(), states.stride(0), *states.stride()[1:4],
        *(x.stride(0) for x in (results.u, results.log_decay, results.k, results.k_scale, results.committed)),
        tree.num_requests, H_V=hv, H_K=hk, D_K=dk, D_V=dv, B_K=config.b_k, B_V=config.b_v, V_SPAN=config.v_span,
        B_P=table.shape[1], UPDATE=UPDATES[update], num_warps=config.num_warps, num_stages=config.num_stages)


def floor_launch(states, slots, num_requests, config: CommitConfig):
    layers, hv, dv, dk = states.shape[0], states.shape[2], states.shape[3], states.shape[4]
    grid = ((dv // config.v_span) * (dk // config.b_k), hv, layers * num_requests)
    pool_scale_kernel[grid](states, slots, states.stride(0), *states.stride()[1:4], num_requests, D_K=dk,
                            B_K=config.b_k, B_V=config.b_v, V_SPAN=config.v_span, num_warps=config.num_warps,
                            num_stages=config.num_stages)


def launch_error(bench: CommitBench, launch) -> float:
    """Relative error of the slots ``launch(states, slots, results, tree, accepted)`` commits against the reference;
    inf if it touched any other slot or wrote a non-finite value."""
    tree, states, slots, accepted, results, expected = bench.reference()
    trial = states.clone()
    results.committed.zero_()
    launch(trial, slots, results, tree, accepted)
    results.committed.zero_()
    changed = torch.zeros(states.shape[1], dtype=torch.bool, device=states.device)
    changed[slots[accepted >= 0].long()] = True
    if not torch.equal(trial[:, ~changed], states[:, ~changed]):
        return float("inf")
    got, want = trial[:, changed].double(), expected[:, changed].double()
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    return float((got - want).norm() / want.norm())


def commit_case(heads: HeadShape, batch: int, layers: int, device, smoke: bool) -> tuple[CommitBench, CommitConfig]:
    """The lab commits' case: a `CommitBench` of 8-node bf16 trees over ``layers`` layers, and the config the shipped
    launch runs there (the database's, else the untuned fallback; the fallback alone with ``smoke``)."""
    bench = CommitBench(CommitKey.bucketed(heads, "bf16", 8, batch, layers=layers), device,
                        most_sets=2 if smoke else None)
    tuned = (None if smoke else tuned_commit(heads.hk, heads.hv, heads.dk, heads.dv, torch.bfloat16, 8, batch,
                                             layers, torch.device(device)))
    return bench, tuned or default_commit_config(layers * batch * heads.hv, heads.dk, heads.dv)


def launch_us_per_layer(bench: CommitBench, launch, layers: int, device, repeats: int, fresh: bool = True) -> float:
    """Median us per layer of ``launch(states, slots, results, tree, accepted)`` (as `launch_error` calls it) over
    the bench's rotating sets; ``fresh``: each call commits a result whose marks were cleared (not a floor's)."""
    tree, states, results, slots, accepted = bench.sets()

    def one(i):
        if fresh:
            results[i].committed.zero_()
        launch(states, slots[i], results[i], tree, accepted)

    return time_launches(one, len(results), device, repeats).p50_us / layers


def copy_floor_row(heads: HeadShape, batch: int, layers: int, device, repeats: int, rows: list,
                   key: str = "kernel") -> None:
    """`mul_(1.0)` over a contiguous buffer of the pools' bytes: the copy floor the issue's <= 1.25x is stated
    against, us per layer."""
    flats = [torch.empty(layers * batch * heads.hv * heads.dv * heads.dk, device=device) for _ in range(2)]
    row = {"batch": batch, "layers": layers, key: "mul_ contiguous (copy floor)"}
    row["us_per_layer"] = time_launches(lambda i: flats[i].mul_(1.0), 2, device, repeats).p50_us / layers
    show(row, rows)


def shipped_and_copy_floor(bench: CommitBench, tuned: CommitConfig, heads: HeadShape, batch: int, layers: int,
                           device, repeats: int, rows: list, key: str = "kernel") -> None:
    """The two reference rows a lab commit is read against: the shipped launch at ``tuned`` (checked, then timed)
    and `mul_(1.0)` over a contiguous buffer of the same bytes (the copy floor), us per layer."""
    row = {"batch": batch, "layers": layers, "config": tuned.text, key: "shipped", "error": bench.error(tuned)}
    row["us_per_layer"] = bench.time(tuned, repeats).p50_us / layers
    show(row, rows)
    copy_floor_row(heads, batch, layers, device, repeats, rows, key)


def lean_error(bench: CommitBench, config: CommitConfig, update: str) -> float:
    """`launch_error` of the lean launch."""
    return launch_error(bench, lambda *a: lean_launch(*a, config, update))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--batch", default="16,32")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--tree-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    heads = HeadShape(hk=2, hv=4, dk=32, dv=32) if args.smoke else HeadShape(hk=16, hv=32, dk=128, dv=128)
    device = "cpu" if args.smoke else "cuda"
    candidates = ([(u, c) for u in UPDATES for c in (C(32, 16, 16, 2, 1), C(16, 16, 32, 1, 1))] if args.smoke
                  else CANDIDATES)
    layers = 2 if args.smoke else args.layers
    rows = []
    for batch in [2] if args.smoke else [int(b) for b in args.batch.split(",")]:
        key = CommitKey.bucketed(heads, "bf16", args.tree_size, batch, layers=layers)
        bench = CommitBench(key, device, most_sets=2 if args.smoke else None)
        base = {"batch": batch, "tree_size": args.tree_size, "layers": layers}
        for update, config in candidates:
            error = lean_error(bench, config, update)
            row = dict(base, kernel=f"lean-{update}", config=config.text, error=error)
            if error <= 1e-4 and not args.smoke:
                row["us_per_layer"] = launch_us_per_layer(
                    bench, lambda *a, c=config, u=update: lean_launch(*a, c, u), layers, device, args.repeats)
            show(row, rows)
        if args.smoke:
            continue
        tree, states, results, slots, accepted = bench.sets()
        tuned = tuned_commit(heads.hk, heads.hv, heads.dk, heads.dv, torch.bfloat16, args.tree_size, batch, layers,
                             torch.device(device))
        for config in [tuned] + FLOORS if tuned else FLOORS:
            row = dict(base, kernel="floor", config=config.text)
            row["us_per_layer"] = time_launches(lambda i, c=config: floor_launch(states, slots[i], batch, c),
                                                len(results), device, args.repeats).p50_us / layers
            show(row, rows)
        row = dict(base, kernel="shipped", config=tuned.text if tuned else "fallback", error=bench.error(tuned))
        row["us_per_layer"] = bench.time(tuned, args.repeats).p50_us / layers
        show(row, rows)
        flat = torch.empty(states[:, :batch].numel(), dtype=torch.float32, device=device)
        flats = [flat, torch.empty_like(flat)]
        row = dict(base, kernel="mul_ contiguous")
        row["us_per_layer"] = time_launches(lambda i: flats[i].mul_(1.0), 2, device, args.repeats).p50_us / layers
        show(row, rows)
        bench = flat = flats = states = results = None
        release(device)
    save(args.json, rows)


if __name__ == "__main__":
    main()
