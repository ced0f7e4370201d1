"""Issue 17: what streaming a pool of fp32 states costs on this GPU, the floor a commit (read and write each state
once) can approach, measured the way the rounds are (one CUDA graph, median per launch).

For 9B heads (32 value heads of 128 x 128 fp32 states, 2 MiB per request) at B requests and L layers:
  copy      `copy_` of one contiguous buffer into another (read + write)
  in place  `mul_(1.0)` on the buffer (read + write of the same bytes)
  triton    a Triton kernel scaling the buffer in place, 16 KiB per program
each once over L layers' states in one launch ("L24", the all-layer commit's bytes) and over one layer's states
rotating through buffers larger than the L2 cache ("L1", a per-layer commit's bytes), per layer.

    python3 lab/stream_floor.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from bole_tune.timing import l2_cache_bytes, rotation_count, time_launches

STATE_BYTES = 32 * 128 * 128 * 4  # one 9B request's states in one layer


@triton.jit
def scale_in_place(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) * 1.0, mask=m)


def measure(buffers: list[torch.Tensor], repeats: int) -> dict[str, float]:
    others = [torch.empty_like(b) for b in buffers]
    n = buffers[0].numel()
    out = {
        "copy": time_launches(lambda i: others[i].copy_(buffers[i]), len(buffers), "cuda", repeats=repeats).p50_us,
        "in place": time_launches(lambda i: buffers[i].mul_(1.0), len(buffers), "cuda", repeats=repeats).p50_us,
    }
    for block, warps in ((4096, 4), (4096, 8), (8192, 8)):
        out[f"triton {block}/{warps}"] = time_launches(
            lambda i: scale_in_place[(triton.cdiv(n, block),)](buffers[i], n, BLOCK=block, num_warps=warps),
            len(buffers), "cuda", repeats=repeats).p50_us
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    rows = []
    for batch in (1, 16, 32):
        for layers in (1, 24):
            size = layers * batch * STATE_BYTES
            count = rotation_count(2 * size, l2_cache_bytes("cuda"), most=64)
            buffers = [torch.randn(size // 4, device="cuda") for _ in range(count)]
            times = {k: v / layers for k, v in measure(buffers, args.repeats).items()}
            floor = 2 * batch * STATE_BYTES / 4.25e12 * 1e6
            rows.append({"batch": batch, "layers": layers, "sets": count, "us_per_layer": times,
                         "floor_4_25_us": floor})
            print(f"B={batch:>2} L{layers:<2} ({count} sets): " + ", ".join(f"{k} {v:.1f}" for k, v in times.items())
                  + f" us a layer | 4.25 TB/s floor {floor:.1f}", flush=True)
            del buffers
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
