"""Compile many tile configs at once, in worker processes, into Triton's on-disk cache.

Tuning on a GPU is dominated by compile time (each config is its own kernel), not by timing. Worker
processes compile candidates in parallel by running each launch the planner gives a bucket (kernel
variant, node block, value split, precision switches) once on a one-request instance; the tuner's own
launches then load the cached binaries. Failures are ignored here: the tuner meets them again and
records them.
"""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context

import torch

from bole_tune.config import KernelConfig
from bole_tune.database import ShapeKey
from bole_tune.kernels import PLANNER, Launch, tree_verify
from bole_tune.search_space import gluon_bucket_refusal
from bole_tune.shapes import HeadShape, torch_dtype
from bole_tune.workloads import make_inputs, make_tree

MAX_DEPTH = 8  # the depth bound of the trees the tuner times (`bench.BenchCase.max_depth`)


def _compile(heads: HeadShape, dtype: str, tree_size: int, launches: list[Launch]) -> int:
    tree = make_tree([tree_size], max_depth=MAX_DEPTH, device="cuda")
    x = make_inputs(tree, heads.hk, heads.hv, heads.dk, heads.dv, torch_dtype(dtype), "cuda")
    done = 0
    for launch in launches:
        try:
            with warnings.catch_warnings():  # a config failing the resident self-check: the tuner reports it
                warnings.simplefilter("ignore", UserWarning)
                tree_verify(*x.args(tree), validate=False, launch=launch)
            torch.cuda.synchronize()
            done += 1
        except Exception:  # recorded by the tuner when it meets the config
            torch.cuda.synchronize()
    return done


def precompile(keys: list[ShapeKey], configs: list[KernelConfig], workers: int | None = None,
               progress=None) -> int:
    """Compile ``configs`` for every distinct launch among ``keys``; returns how many compiled."""
    if not torch.cuda.is_available() or not configs:
        return 0
    # kernels are specialised on head sizes, dtype and the launch, not on batch or head counts
    distinct: dict[tuple, tuple] = {}
    for key in keys:
        for config in configs:
            if not config.fits(key.heads.dk, key.heads.dv) or (config.gluon and gluon_bucket_refusal(config, key)):
                continue
            # as the tuner's runner plans it (`GPURunner`): a Gluon config on the Gluon verify, any other on Triton's
            launch = PLANNER.plan(key.heads, torch_dtype(key.dtype), num_requests=key.batch_bucket,
                                  max_tree_size=key.tree_bucket, depth=MAX_DEPTH, device="cuda", config=config,
                                  check=False, ring=key.ring)
            distinct.setdefault((launch, key.heads.dk, key.heads.dv, key.dtype), (key, launch))
    groups: dict[tuple, list[Launch]] = {}
    for key, launch in distinct.values():
        groups.setdefault((key.heads, key.dtype, key.tree_bucket), []).append(launch)
    workers = workers or max(1, min(16, (os.cpu_count() or 2) - 1))
    tasks = []
    for (heads, dtype, tree_size), launches in groups.items():
        chunk = max(1, -(-len(launches) // workers))
        tasks += [(heads, dtype, tree_size, launches[i:i + chunk]) for i in range(0, len(launches), chunk)]
    compiled = 0
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(_compile, *task) for task in tasks]
        for future in as_completed(futures):
            try:
                compiled += future.result()
            except Exception:  # a worker that died (e.g. a crashing config) costs only its chunk
                pass
            if progress:
                progress(len(futures))
    return compiled
