"""Timing: warm-up, CUDA-graph replays timed with events, medians (BENCHMARKS.md, "How figures are measured").

A measurement captures one CUDA graph that launches the kernel once per input set, the sets
together larger than the L2 cache, so every launch reads its operands from HBM as in a real model
step. Each replay is timed with CUDA events; the figure per launch is replay time / sets, reported
as p20 / p50 / p80 over the replays. Where capture is impossible the same is done launch by launch
(still with events), and on the CPU with the wall clock; ``method`` says which.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Timing:
    p20_us: float
    p50_us: float
    p80_us: float
    method: str
    samples: int

    def as_dict(self) -> dict:
        return asdict(self)


def quantiles(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)

    def pick(fraction: float) -> float:
        position = fraction * (len(ordered) - 1)
        lo, hi = math.floor(position), math.ceil(position)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (position - lo)

    return pick(0.2), statistics.median(ordered), pick(0.8)


def rotation_count(bytes_per_set: int, l2_bytes: int, most: int = 64) -> int:
    """Input sets needed so that one pass over all of them is at least 3x the L2 cache."""
    return max(2, min(most, math.ceil(3 * l2_bytes / max(1, bytes_per_set))))


def l2_cache_bytes(device) -> int:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(device).L2_cache_size
    return 32 << 20


def time_launches(launch: Callable[[int], object], num_sets: int, device, repeats: int = 50,
                  warmup: int = 3, use_graph: bool = True) -> Timing:
    """Time ``launch(i)`` for i over the input sets; returns microseconds per launch."""
    device = torch.device(device)
    if device.type != "cuda":
        for i in range(min(num_sets, warmup)):
            launch(i)
        samples = []
        for r in range(max(3, repeats // 10)):
            start = time.perf_counter()
            for i in range(num_sets):
                launch(i)
            samples.append((time.perf_counter() - start) * 1e6 / num_sets)
        return Timing(*quantiles(samples), method="cpu wall clock", samples=len(samples))

    def run_all():
        for i in range(num_sets):
            launch(i)

    run_all()  # compile and warm caches outside the graph
    torch.cuda.synchronize(device)
    graph = None
    if use_graph:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        try:
            with torch.cuda.stream(stream):
                run_all()
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run_all()
        except RuntimeError:
            graph = None
            torch.cuda.synchronize(device)
    replay = graph.replay if graph is not None else run_all
    for _ in range(warmup):
        replay()
    torch.cuda.synchronize(device)
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / num_sets)
    method = "cuda graph replay, cuda events" if graph is not None else "eager launches, cuda events"
    return Timing(*quantiles(samples), method=f"{method}, {num_sets} rotating input sets", samples=len(samples))


def time_eager_host(launch: Callable[[int], object], num_sets: int, device, repeats: int = 20) -> float:
    """Median wall-clock microseconds per call, launches issued from Python (host overhead included)."""
    device = torch.device(device)
    for i in range(num_sets):
        launch(i)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(num_sets):
            launch(i)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - start) * 1e6 / num_sets)
    return statistics.median(samples)
