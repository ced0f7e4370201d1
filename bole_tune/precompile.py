"""Compile many tile configs at once, in worker processes, into Triton's on-disk cache.

Tuning on a GPU is dominated by compile time (each config is its own kernel), not by timing. Worker
processes compile candidates in parallel by running tree_verify once on a one-request instance with
exactly the launch's specialisation (same kernel variant, head sizes, dtype, node block and value split); the
tuner's own launches then load the cached binaries. Failures are ignored here: the tuner meets them again and records them.
"""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context

from bole_tune.config import KernelConfig
from bole_tune.database import ShapeKey


def _compile(key_dict: dict, configs: list[tuple], variant: str = "fused") -> int:
    import torch

    from bole_tune.bench import DTYPES
    from bole_tune.kernels import tree_verify
    from bole_tune.kernels.tree_verify_resident import resident_split
    from bole_tune.workloads import make_inputs, make_tree

    key = ShapeKey.from_dict(key_dict)
    tree = make_tree([key.tree_bucket], device="cuda")
    x = make_inputs(tree, key.hk, key.hv, key.dk, key.dv, DTYPES[key.dtype], "cuda")
    done = 0
    for values in configs:
        config = KernelConfig(*values)
        try:  # the value split of the key's batch, not of this one-request instance
            with warnings.catch_warnings():  # a config failing the resident self-check: the tuner reports it
                warnings.simplefilter("ignore", UserWarning)
                tree_verify(*x.args(tree), config=config, validate=False, variant=variant,
                            v_split=resident_split(key.batch_bucket, key.hv, key.dv, config.b_v))
            torch.cuda.synchronize()
            done += 1
        except Exception:  # recorded by the tuner when it meets the config
            torch.cuda.synchronize()
    return done


def precompile(keys: list[ShapeKey], configs: list[KernelConfig], workers: int | None = None,
               progress=None) -> int:
    """Compile ``configs`` for every distinct specialisation among ``keys``; returns how many compiled."""
    import torch

    if not torch.cuda.is_available() or not configs:
        return 0
    from bole_tune.config import node_block
    from bole_tune.kernels.tree_verify import pick_variant

    distinct = {}
    for key in keys:  # kernels are specialised on head sizes, dtype and node block, not on batch or heads
        variant = pick_variant(key.batch_bucket, key.hv, key.tree_bucket)
        # but for the resident kernel's value split, which follows (batch bucket x heads)
        split_on = key.batch_bucket * key.hv if variant == "resident" else 0
        distinct.setdefault((variant, key.dk, key.dv, key.dtype, node_block(key.tree_bucket), split_on), (key, variant))
    workers = workers or max(1, min(16, (os.cpu_count() or 2) - 1))
    tasks = []
    for key, variant in distinct.values():
        values = [(c.b_k, c.b_v, c.num_warps, c.num_stages) for c in configs if c.fits(key.dk, key.dv)]
        chunk = max(1, -(-len(values) // workers))
        tasks += [(key.as_dict(), values[i:i + chunk], variant) for i in range(0, len(values), chunk)]
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
