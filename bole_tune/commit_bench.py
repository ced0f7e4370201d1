"""Checking and timing commit launches (`tree_commit`, `tree_commit_layers`) for the tuner and the profiler.

A `CommitBench` holds one commit bucket (`CommitKey`: the verification bucket and the layers one launch
commits): a small instance with its reference (`commit_closed_form`, the PyTorch closed form of
docs/math.md §4, per layer) for the correctness gate, and rotating input sets larger than the L2 cache for
timing, each a verified batch whose requests commit their deepest node (the longest path). Every config is
checked before it is timed; one whose pool differs from the reference, or that writes a slot it must leave,
is never timed (`WrongCommit`).

`precompile_commits` compiles the candidate configs of many buckets in parallel worker processes first: a
commit binary depends on the config, the head sizes, the dtype and the node block only (not on the batch or
the layers), so the tuner's own launches then load cached binaries.
"""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context

import torch

from bole_tune.bench import BenchCase
from bole_tune.config import CommitConfig, node_block
from bole_tune.database import CommitKey
from bole_tune.kernels import LayerResults, tree_commit, tree_commit_layers, tree_verify
from bole_tune.kernels.reference import commit_closed_form
from bole_tune.shapes import HeadShape, torch_dtype
from bole_tune.timing import Timing, l2_cache_bytes, rotation_count, time_launches
from bole_tune.workloads import make_inputs, make_tree

COMMIT_TOLERANCE = 1e-4
"""Largest relative error (over the committed slots, against `commit_closed_form`) a commit config may show
to be timed or recorded. Both evaluate the same fp32 expression (the kernel's products in IEEE fp32): right
configs land near 1e-7; a wrong tile or a missed path node is off by 1e-2 or more."""
CHECK_REQUESTS = 3  # the check's requests: the deepest node, a random node, and -1 (a slot left as it is)
MAX_DEPTH = 8  # the depth bound of the trees timed (`bench.BenchCase.max_depth`)


class WrongCommit(AssertionError):
    """A commit config's pool disagrees with the reference: it must not be timed or recorded."""


def _deepest(tree) -> torch.Tensor:
    depths, offsets = tree.node_depth.tolist(), tree.offsets.tolist()
    return torch.tensor([max(range(size), key=lambda n: depths[offsets[r] + n]) for r, size in enumerate(tree.sizes)],
                        dtype=torch.int32, device=tree.device)


class CommitBench:
    """One commit bucket, ready to check and time many configs without rebuilding.

    ``most_sets`` bounds the rotating sets (default: enough to exceed the L2 cache three times on a GPU, two
    on a CPU, where the interpreter is slow and there is no cache to defeat)."""

    def __init__(self, key: CommitKey, device="cuda", seed: int = 0, most_sets: int | None = None):
        if not isinstance(key, CommitKey):
            raise TypeError(f"key: expected a CommitKey, got {type(key).__name__}")
        self.key, self.device, self.seed = key, torch.device(device), seed
        self.case = BenchCase(key.heads, key.batch_bucket, key.tree_bucket, torch_dtype(key.dtype), MAX_DEPTH)
        self.most_sets = most_sets or (64 if self.device.type == "cuda" else 2)
        self._check = None
        self._sets = None

    # correctness ------------------------------------------------------------------------------
    def reference(self):
        """(tree, pristine states [L, slots, ...], slots, accepted, results per layer, expected states)."""
        if self._check is None:
            k, h = self.key, self.key.heads
            tree = make_tree([k.tree_bucket] * CHECK_REQUESTS, max_depth=MAX_DEPTH, seed=self.seed + 1,
                             device=self.device)
            layers = []
            for layer in range(k.layers):
                x = make_inputs(tree, h.hk, h.hv, h.dk, h.dv, self.case.dtype, self.device, seed=self.seed + 1 + layer)
                layers.append(x)
            slots = layers[0].state_indices
            states = torch.stack([x.state for x in layers])  # [L, slots, Hv, dv, dk], each layer its own
            results = LayerResults.empty(k.layers, tree, h, self.case.dtype, self.device)
            for layer, x in enumerate(layers):
                tree_verify(x.q, x.k, x.v, x.g, x.beta, states[layer], slots, tree, validate=False,
                            out=results.layer(layer))
            deepest = _deepest(tree).tolist()
            rng = torch.Generator().manual_seed(self.seed + 2)
            accepted = torch.tensor([deepest[0], int(torch.randint(tree.sizes[1], (1,), generator=rng)), -1],
                                    dtype=torch.int32, device=self.device)
            expected = states.clone()
            for layer in range(k.layers):
                commit_closed_form(expected[layer], slots, results.layer(layer, tree), accepted, validate=False)
            results.committed.zero_()
            self._check = (tree, states, slots, accepted, results, expected)
        return self._check

    def error(self, config: CommitConfig) -> float:
        """Relative error of ``config``'s committed slots against the reference; inf if it wrote anything else
        (a slot of a request that commits nothing, a slot no request names) or produced NaN."""
        tree, states, slots, accepted, results, expected = self.reference()
        trial = states.clone()
        results.committed.zero_()
        if self.key.layers == 1:
            tree_commit(trial[0], slots, results.layer(0, tree), accepted, validate=False, config=config)
        else:
            tree_commit_layers(trial, slots, results, tree, accepted, validate=False, config=config)
        results.committed.zero_()
        changed = torch.zeros(states.shape[1], dtype=torch.bool, device=self.device)
        changed[slots[accepted >= 0].long()] = True
        if not torch.equal(trial[:, ~changed], states[:, ~changed]):
            return float("inf")
        got, want = trial[:, changed].double(), expected[:, changed].double()  # on the device: no large copy
        if not bool(torch.isfinite(got).all()):
            return float("inf")
        return float((got - want).norm() / want.norm())

    def check(self, config: CommitConfig) -> float:
        """`error`; `WrongCommit` above `COMMIT_TOLERANCE`."""
        error = self.error(config)
        if not error <= COMMIT_TOLERANCE:
            raise WrongCommit(f"tree_commit with {config} is wrong on {self.key.text}: relative error {error:.2e} "
                              f"against commit_closed_form (tolerance {COMMIT_TOLERANCE:.0e})")
        return error

    # timing -----------------------------------------------------------------------------------
    def sets(self):
        """(tree, pools ``[L, B x sets, Hv, dv, dk]``, per-set results, per-set slots, accepted)."""
        if self._sets is None:
            k, h, c = self.key, self.key.heads, self.case
            tree = make_tree([k.tree_bucket] * k.batch_bucket, max_depth=MAX_DEPTH, seed=self.seed, device=self.device)
            per_set = k.layers * c.state_bytes()
            num_sets = rotation_count(2 * per_set, l2_cache_bytes(self.device), most=self.most_sets)
            generator = torch.Generator(device=self.device).manual_seed(self.seed)
            states = 0.1 * torch.randn(k.layers, k.batch_bucket * num_sets, h.hv, h.dv, h.dk, dtype=torch.float32,
                                       device=self.device, generator=generator)
            results, slots = [], []
            for i in range(num_sets):
                x = make_inputs(tree, h.hk, h.hv, h.dk, h.dv, c.dtype, self.device, num_slots=1,
                                seed=self.seed + 100 + i)
                own = torch.arange(i * k.batch_bucket, (i + 1) * k.batch_bucket, dtype=torch.int32, device=self.device)
                stacked = LayerResults.empty(k.layers, tree, h, c.dtype, self.device)
                tree_verify(x.q, x.k, x.v, x.g, x.beta, states[0], own, tree, validate=False, out=stacked.layer(0))
                for name in ("o", "u", "log_decay", "k", "k_scale"):  # the layers' factors: layer 0's, copied
                    field = getattr(stacked, name)
                    field[1:] = field[0]
                results.append(stacked)
                slots.append(own)
            self._sets = (tree, states, results, slots, _deepest(tree))
        return self._sets

    def time(self, config: CommitConfig, repeats: int = 30) -> Timing:
        """Time one launch of ``config`` (each request commits its deepest node; every launch a fresh result)."""
        tree, states, results, slots, accepted = self.sets()
        if self.key.layers == 1:
            pool = states[0]
            views = [r.layer(0, tree) for r in results]

            def launch(i):
                views[i].committed.zero_()
                tree_commit(pool, slots[i], views[i], accepted, validate=False, config=config)
        else:
            def launch(i):
                results[i].committed.zero_()
                tree_commit_layers(states, slots[i], results[i], tree, accepted, validate=False, config=config)

        return time_launches(launch, len(results), self.device, repeats=repeats)


# ---- compiling ahead ------------------------------------------------------------------------------

def _compile(heads: HeadShape, dtype: str, tree_size: int, configs: list[CommitConfig]) -> int:
    tree = make_tree([tree_size], max_depth=MAX_DEPTH, device="cuda")
    x = make_inputs(tree, heads.hk, heads.hv, heads.dk, heads.dv, torch_dtype(dtype), "cuda")
    res = tree_verify(*x.args(tree), validate=False)
    accepted = _deepest(tree)
    done = 0
    for config in configs:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res.committed.zero_()
                tree_commit(x.state, x.state_indices, res, accepted, validate=False, config=config)
            torch.cuda.synchronize()
            done += 1
        except Exception:  # recorded by the tuner when it meets the config
            torch.cuda.synchronize()
    return done


def precompile_commits(keys: list[CommitKey], configs: list[CommitConfig], workers: int | None = None,
                       progress=None) -> int:
    """Compile ``configs`` for every distinct (heads, dtype, node block) among ``keys``, in parallel worker
    processes, into Triton's on-disk cache; returns how many compiled (0 without a GPU)."""
    if not torch.cuda.is_available() or not configs:
        return 0
    groups: dict[tuple, list[CommitConfig]] = {}
    for key in keys:
        block = node_block(key.tree_bucket)
        group = groups.setdefault((key.heads, key.dtype, block), [])
        group += [c for c in configs if c.fits(key.heads.dk, key.heads.dv) and c not in group]
    workers = workers or max(1, min(16, (os.cpu_count() or 2) - 1))
    tasks = []
    for (heads, dtype, block), group in groups.items():
        chunk = max(1, -(-len(group) // workers))
        tasks += [(heads, dtype, block, group[i:i + chunk]) for i in range(0, len(group), chunk)]
    compiled = 0
    if not tasks:
        return 0
    with ProcessPoolExecutor(max_workers=min(workers, len(tasks)), mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(_compile, *task) for task in tasks]
        for future in as_completed(futures):
            try:
                compiled += future.result()
            except Exception:  # a worker that died (a crashing config) costs only its chunk
                pass
            if progress:
                progress(len(futures))
    return compiled
