"""Issue 17: where a program of the Gluon verify spends its time, phase by phase, in each mode (the verify, a ring's
read round at 16 and 32 entries, its write round), H200, 9B heads, bf16, random 64-node trees of depth <= 8.

The shipped kernel's source (`kernels/verify/gluon.py`) is copied into a temporary module with a timer stamp after
each phase (thread 0 of the program stores ``%clock64`` and ``%globaltimer``; one extra pointer argument), and
launched in place of the shipped one through `run.run_launch` on the bench's rotating input sets. Per phase: the
median over programs and launches of its cycles, in us at the clock the stamps themselves show; per launch: its
span, each program's span, and how the programs' starts fall into waves. The stamps add a few stores per program:
read the phases against each other, not as the shipped kernel's exact times.

    python3 lab/gluon_phases.py [--batch 16] [--launches 8] [--json OUT]
    python3 lab/gluon_phases.py --compile-only     # no GPU: each mode of the stamped kernel compiled for sm_90

In the shipped kernel a ring round's tokens' keys are requested with q and k ("q/k issued") and their updates with v
("v issued"); "tokens issued" is stamped only where a kernel requests them in groups of their own.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.kernels.verify import gluon, run as run_mod
from bole_tune.shapes import HeadShape

HEADS_9B = HeadShape(hk=16, hv=32, dk=128, dv=128)
PHASES = ["start", "q/k issued", "v issued", "tokens issued", "q/k arrived", "norms, keys out", "gram",
          "ring D products", "solve", "all copies in", "weights, decay", "tile 0 start", "tile 0 state products",
          "tile 1 start", "tile 1 state products", "end"]
TILE_STAMP = PHASES.index("tile 0 start")
INNER = ["fold update in", "staging free", "tile sent", "state products"]
"""Stamps of each state tile (value tile t, key chunk c: ``len(PHASES) + (t * NK + c) * 4 + j``): a write round's
fold update waited for, its staging buffer free (the previous TMA store read), its TMA store issued, and in every
mode the tile's state products waited for."""
N_TILES = 8  # (128 / b_v) * (128 / b_k) at the 32/64 tiles every mode runs here
N_STAMPS = len(PHASES) + 4 * N_TILES

# (a line of the shipped kernel, which occurrence, the stamp's index, the stamp's line relative to the anchor's (0:
# before it, 1: after it), the stamp's indentation)
ANCHORS = [
    ("write_keys = (i_h % group) == 0", 0, "0", 1, 8),
    ("async_copy.commit_group()", 0, "1", 1, 8),
    ("async_copy.commit_group()", 1, "2", 1, 8),
    ("async_copy.commit_group()", 3, "3", 1, 12),  # a ring's round: its tokens' updates requested (where apart)
    ("ssq_q = gl.zeros([B_T], gl.float32, layout=gl.SliceLayout(1, LD))", 0, "4", 0, 8),
    ("# Gram products on wgmma, from shared memory", 0, "5", 0, 8),
    ("b_qk, b_kk = warpgroup_mma_wait(num_outstanding=0, deps=(b_qk, b_kk))", 0, "6", 1, 8),
    ("dk_smem.store((b_dk / ds).to(gl.float16))", 0, "7", 1, 12),
    ("block_depth_ptr + i_r, zeros_t)", 0, "8", 1, 8),
    ("if FOLD:", 0, "9", 0, 8),  # the one after the solve's wait_group(0)
    ("# the state stream: per value tile Q S^T and K S^T on the two bf16 parts of S, then the readout", 0, "10", 0,
     8),
    ("b_qs = zeros_o", 0, "11 + 2 * t", 0, 12),
    ("d_cur = warpgroup_mma_wait(num_outstanding=0, deps=(d_cur,))", 0, "16 + (t * NK + c) * 4", 1, 20),
    ("tma.store_wait(0)", 0, "17 + (t * NK + c) * 4", 2, 20),
    ("tma.async_copy_shared_to_global(s_desc, [s_row + t * B_V, c * B_K], s_out)", 0, "18 + (t * NK + c) * 4", 1, 20),
    ("b_qs, b_ks = warpgroup_mma_wait(num_outstanding=0, deps=(b_qs, b_ks))", 0, "19 + (t * NK + c) * 4", 1, 16),
    ("b_qs = b_qs * ring_c", 0, "12 + 2 * t", -1, 12),  # before the `if RING:` that holds it
    ("tma.store_wait(0)", 1, "15", 1, 8),
]

STAMP_FN = '''
    @gluon.jit
    def _stamp(t_ptr, prog, idx):
        L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        o = gl.arange(0, 128, layout=L)
        c = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [o], dtype=gl.int64, is_pure=False, pack=1)
        t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [o], dtype=gl.int64, is_pure=False, pack=1)
        base = t_ptr + (prog * N_STAMPS + idx) * 2
        gl.store(base + o, c, mask=o == 0)
        gl.store(base + 1 + o, t, mask=o == 0)
'''


def instrumented_source() -> str:
    lines = Path(gluon.__file__).read_text().splitlines()
    out = list(lines)
    inserts = []  # (line index to insert before, text)
    for anchor, occurrence, idx, offset, indent in ANCHORS:
        hits = [i for i, line in enumerate(lines) if line.strip() == anchor]
        if len(hits) <= occurrence and idx == "3":  # the tokens' copies share v's group: no stamp of their own
            continue
        if len(hits) <= occurrence:
            raise SystemExit(f"the kernel changed: no occurrence {occurrence} of {anchor!r}")
        inserts.append((hits[occurrence] + offset, " " * indent + f"_stamp(t_ptr, i_r * H_V + i_h, {idx})"))
    for at, text in sorted(inserts, reverse=True):
        out.insert(at, text)
    src = "\n".join(out)
    signature = "stride_s_slot, stride_s_h, stride_s_v,\n        D_K:"
    src = src.replace(signature, signature.replace("stride_s_v,", "stride_s_v, t_ptr,"), 1)
    helper = "    @gluon.jit\n    def table_rows("
    src = src.replace(helper, STAMP_FN.replace("N_STAMPS", str(N_STAMPS)) + "\n" + helper, 1)
    src = src.replace("from ..common import LOG_DECAY_FLOOR", "from bole_tune.kernels.common import LOG_DECAY_FLOOR")
    if "t_ptr,\n        D_K" not in src:
        raise SystemExit("the kernel's signature changed")
    return src


def load_instrumented():
    path = Path(tempfile.mkdtemp()) / "gluon_stamped.py"
    path.write_text(instrumented_source())
    spec = importlib.util.spec_from_file_location("gluon_stamped", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_only(stamped) -> None:
    """Each mode of the stamped kernel compiled for sm_90 on the CPU (`gluon.compile_report`, with the stamps'
    buffer), its registers and shared memory printed beside the shipped kernel's."""
    shipped = gluon.compile_report(32)
    report = gluon.compile_report(32, fn=stamped.gluon_verify_kernel, extra_args=(torch.zeros(1, dtype=torch.int64),))
    for mode, r in report.items():
        print(f"{mode}: stamped {r['registers']} registers, {r['shared']} B shared; shipped "
              f"{shipped[mode]['registers']}, {shipped[mode]['shared']} B")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, action="append")
    parser.add_argument("--launches", type=int, default=8)
    parser.add_argument("--json")
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    stamped = load_instrumented()
    if args.compile_only:
        compile_only(stamped)
        return
    if not torch.cuda.is_available():
        sys.exit("no GPU here: run on the H200 (or --compile-only)")
    state = {"buf": None, "kept": []}

    def launch(q, k, v, g, beta, pool, state_indices, tree, shape, res, config, ring=None):
        grid, a, meta = gluon.launch_args(q, k, v, g, beta, pool, state_indices, tree, shape, res, config, ring)
        buf = torch.zeros(grid[0] * grid[1] * N_STAMPS * 2, dtype=torch.int64, device=q.device)
        stamped.gluon_verify_kernel[grid](*a, buf, **meta)
        state["kept"].append(buf)

    run_mod.gluon_launch = launch
    outs = []
    for batch in args.batch or [16]:
        bench = CaseBench(BenchCase(HEADS_9B, batch, 64, torch.bfloat16, 8, label="qwen3.5-9b", kind="random"), "cuda")
        read, write = bench.launch(), bench.launch(ring=True)
        tree, pool, inputs, slots = bench.sets(64)
        modes = {"verify": None, "read 16": (read, 1), "read 32": (read, 2), "write 32": (write, 3)}
        result = {"batch": batch, "modes": {}}
        for name, spec in modes.items():
            if spec is None:
                def one(i):
                    x = inputs[i]
                    from bole_tune.kernels import tree_verify
                    tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, validate=False, launch=read)
            else:
                lau, held = spec
                rings = bench._rings(3, read, write, held)
                if held == 3:
                    for ring, _ in rings:
                        ring.held = 3

                def one(i, rings=rings, lau=lau):
                    bench._ring_verify(rings, i, lau)
            for i in range(len(inputs)):  # warm-up: compiled
                one(i)
            torch.cuda.synchronize()
            state["kept"].clear()
            for j in range(args.launches):
                one(j % len(inputs))
            torch.cuda.synchronize()
            stamps = torch.stack([b.view(-1, N_STAMPS, 2) for b in state["kept"]]).cpu()  # [L, P, S, 2]
            clk, gt = stamps[..., 0].double(), stamps[..., 1].double()
            present = (clk != 0).all(dim=(0, 1))
            end = len(PHASES) - 1
            ns_per_cycle = ((gt[:, :, end] - gt[:, :, 0]) / (clk[:, :, end] - clk[:, :, 0])).median().item()
            phases = {}
            last = 0
            for s in range(1, len(PHASES)):
                if not present[s]:
                    continue
                d = (clk[:, :, s] - clk[:, :, last]) * ns_per_cycle / 1e3
                phases[f"{PHASES[last]} -> {PHASES[s]}"] = round(d.median().item(), 3)
                last = s
            inner = {}
            for n in range(N_TILES):
                t, c = divmod(n, N_TILES // 2)
                prev = TILE_STAMP + 2 * t if c == 0 else len(PHASES) + (n - 1) * 4 + 3
                for j, label in enumerate(INNER):
                    at = len(PHASES) + n * 4 + j
                    if not present[at]:
                        continue
                    d = ((clk[:, :, at] - clk[:, :, prev]) * ns_per_cycle / 1e3).median().item()
                    inner[f"-> {label}"] = round(inner.get(f"-> {label}", 0.0) + d, 3)
                    prev = at
            phases.update({f"8 state tiles, sum {k}": v for k, v in inner.items()})
            span = (gt[:, :, end].amax(1) - gt[:, :, 0].amin(1)) / 1e3  # per launch
            program = (gt[:, :, end] - gt[:, :, 0]) / 1e3
            starts = (gt[:, :, 0] - gt[:, :, 0].amin(1, keepdim=True)) / 1e3
            late = (starts > program.median() * 0.5).float().mean().item()
            result["modes"][name] = {"ghz": round(1 / ns_per_cycle, 3),
                                     "launch_span_us": round(span.median().item(), 2),
                                     "program_us": round(program.median().item(), 2),
                                     "program_us_p10_p90": [round(program.quantile(0.1).item(), 2),
                                                            round(program.quantile(0.9).item(), 2)],
                                     "late_start_fraction": round(late, 3), "phases_us": phases}
            print(f"B={batch} {name}: {json.dumps(result['modes'][name])}", flush=True)
        outs.append(result)
    if args.json:
        Path(args.json).write_text(json.dumps(outs, indent=1))
    for r in outs:
        names = list(r["modes"])
        print(f"\n| B={r['batch']} T=64, us per program (median) | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
        keys = []
        for m in r["modes"].values():
            keys += [k for k in m["phases_us"] if k not in keys]
        for k in keys:
            print(f"| {k} | " + " | ".join(str(r["modes"][n]["phases_us"].get(k, "")) for n in names) + " |")
        for f in ("program_us", "launch_span_us", "late_start_fraction", "ghz"):
            print(f"| {f} | " + " | ".join(str(r["modes"][n][f]) for n in names) + " |")


if __name__ == "__main__":
    main()
