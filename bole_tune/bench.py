"""Benchmarks of one GDN layer's verification: tree_verify against serial_verify, and tree_commit.

A `CaseBench` holds one case (shape, batch, tree size, dtype): a fresh random instance with its
float64 reference for the correctness gate, and rotating input sets larger than the L2 cache for
timing. Every kernel is checked against the reference before it is timed; a wrong kernel is never
timed. Rows carry the shape, the times (p20/p50/p80), the byte floor and the method, ready for
BENCHMARKS.md or the tuning database.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
from dataclasses import dataclass

import torch
import triton

from bole_tune import __version__
from bole_tune.config import RING_ROUNDS, KernelConfig
from bole_tune.kernels import (PLANNER, LayerResults, Launch, PendingCommit, PendingPaths, PendingRing, serial_verify,
                               tree_commit, tree_commit_layers, tree_verify)
from bole_tune.kernels.reference import commit_closed_form, verify_reference
from bole_tune.kernels.verify.gluon import gluon_ring_rounds
from bole_tune.kernels.verify.run import ring_columns
from bole_tune.kernels.verify.self_check import accepted_error
from bole_tune.shapes import HeadShape, dtype_name
from bole_tune.timing import Timing, l2_cache_bytes, rotation_count, time_eager_host, time_launches
from bole_tune.workloads import make_inputs, make_tree, relative_error

COPY_BANDWIDTH_H200 = 4.25e12  # bytes/s, read + write, measured (BENCHMARKS.md, "How figures are measured")
CHECK_BATCH = 2  # requests in the reference instance: the kernels do not depend on the batch size


class WrongResult(AssertionError):
    """A kernel's output disagrees with the float64 reference: it must not be timed or recorded."""


@dataclass(frozen=True)
class BenchCase:
    shape: HeadShape
    batch: int
    tree_size: int
    dtype: torch.dtype = torch.bfloat16
    max_depth: int = 8
    label: str = ""
    kind: str = "random"  # or "chain": each request one path of tree_size nodes (an MTP drafter's proposal)

    @property
    def num_nodes(self) -> int:
        return self.batch * self.tree_size

    def floor_bytes(self) -> int:
        """Read S_pre, q, k, v and the gates once; write o once: the verifier's byte floor."""
        s = self.shape
        element = torch.empty((), dtype=self.dtype).element_size()
        n = self.num_nodes
        state = self.batch * s.hv * s.dv * s.dk * 4
        inputs = n * (2 * s.hk * s.dk + s.hv * s.dv) * element + 2 * n * s.hv * 4
        return state + inputs + n * s.hv * s.dv * element

    def state_bytes(self) -> int:
        return self.batch * self.shape.hv * self.shape.dv * self.shape.dk * 4


def environment() -> dict:
    """Versions and device of this process, for provenance."""
    env = {"torch": str(torch.__version__), "triton": str(triton.__version__), "bole_tune": __version__,
           "python": platform.python_version(),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    else:
        env["gpu"] = "none (CPU)"
    return env


class CaseBench:
    """One case, ready to be checked and timed many times (configs, verifiers) without rebuilding."""

    def __init__(self, case: BenchCase, device="cuda", seed: int = 0):
        self.case, self.device, self.seed = case, torch.device(device), seed
        self._reference = self._instance = None
        self._tree = None
        self._sets = {}

    def launch(self, config: KernelConfig | None = None, variant: str | None = None,
               tuned_on: str | None = None, fold: bool = False, ring: bool = False,
               gluon: bool | None = None) -> Launch:
        """The launch `tree_verify` runs for this case: the planner's, for the full batch (``config=None``:
        the database's; ``tuned_on``: the kernel a given config was tuned on). A resident launch whose
        self-check fails comes back on the fused kernel with ``fallback`` set, as `tree_verify` would run it.
        The reference check, on a smaller batch, runs this same launch: what is checked is what is timed. ``fold``:
        the folded verify's launch; ``ring``: a `PendingRing` write round's; ``gluon``: as `Planner.plan` (None: the
        Gluon verify where the planner runs it; False: the Triton kernels, whose tiles the tuner sweeps)."""
        c = self.case
        return PLANNER.plan(c.shape, c.dtype, num_requests=c.batch, max_tree_size=c.tree_size,
                            depth=self.depth(), device=self.device,
                            config=config, variant=variant, tuned_on=tuned_on, fold=fold, ring=ring, gluon=gluon)

    def depth(self) -> int:
        """The deepest tree of the timed batch and of the reference instance (what a launch must take)."""
        return max(self.tree().depth, self.reference_instance()[0].depth)

    def ring_rounds(self) -> int:
        """The rounds of the ring this case's ring rows keep by default: `RING_ROUNDS`, or where its ring rounds
        run on the Gluon verify, the most up to it whose tables that kernel takes (`gluon.gluon_ring_rounds`: 3 for
        the 9-node paths of trees of depth 8, whose ring of 4 only the slower Triton kernel runs), as an engine keeps
        there (`GPURunner.ring_rounds` times the tuner's ring writes the same way)."""
        if not self.launch(ring=True).gluon:
            return RING_ROUNDS
        return gluon_ring_rounds(self.depth() + 1, RING_ROUNDS) or RING_ROUNDS

    def _kwargs(self, verify, launch: Launch | None) -> dict:
        return {"launch": launch or self.launch()} if verify is tree_verify else {}

    # correctness ------------------------------------------------------------------------------
    def reference_instance(self):
        """(tree, inputs) of the reference instance (a smaller batch), without its float64 outputs."""
        if self._instance is None:
            c, s = self.case, self.case.shape
            tree = make_tree([c.tree_size] * min(c.batch, CHECK_BATCH), c.kind, max_depth=c.max_depth,
                             seed=self.seed + 1, device=self.device)
            self._instance = (tree, make_inputs(tree, s.hk, s.hv, s.dk, s.dv, c.dtype, self.device, seed=self.seed + 1))
        return self._instance

    def reference(self):
        """(tree, inputs, float64 outputs) of the reference instance."""
        if self._reference is None:
            tree, x = self.reference_instance()
            self._reference = (tree, x, verify_reference(*x.args(tree), keep_states=False))
        return self._reference

    def error(self, verify, launch: Launch | None = None) -> float:
        """Relative error of ``verify`` on the reference instance (`tree_verify` with ``launch``, default
        `launch()`)."""
        tree, x, ref = self.reference()
        res = verify(*x.args(tree), validate=False, **self._kwargs(verify, launch))
        return relative_error(res.o, ref.o)

    def check(self, verify, launch: Launch | None = None) -> float:
        """Relative error on the reference instance; `WrongResult` above `accepted_error`."""
        error = self.error(verify, launch)
        bound = accepted_error(self.case.dtype)
        if not error <= bound:
            raise WrongResult(f"{getattr(verify, '__name__', verify)} with {launch} is wrong on {self.case}: "
                              f"relative error {error:.2e} > {bound:.0e}")
        return error

    def fold_errors(self, launch: Launch | None = None) -> tuple[float, float]:
        """The folded launch (``tree_verify(..., pending=...)`` with ``launch``) on the reference instance, folding
        in a first round's paths to each request's deepest node: (its outputs' relative error against the
        float64 reference run on the committed pool, its committed slots' against `commit_closed_form` of the
        same factors)."""
        tree, x, _ = self.reference()
        launch = launch or self.launch()
        pool, slots = x.state.clone(), x.state_indices
        first = tree_verify(*x.args(tree), validate=False, launch=launch)
        accepted = self.deepest(tree)
        expected = pool.clone()
        commit_closed_form(expected, slots, first, accepted, validate=False)
        first.committed.zero_()
        ref = verify_reference(x.q, x.k, x.v, x.g, x.beta, expected, slots, tree, keep_states=False)
        paths = PendingPaths.between_rounds(tree, accepted, slots, slots, pool.shape[0])
        res = tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots, tree, validate=False, launch=launch,
                          pending=PendingCommit(paths, first))
        used = slots.long()
        return relative_error(res.o, ref.o), relative_error(pool[used], expected[used])

    def ring_errors(self, read: Launch | None = None, write: Launch | None = None, rounds: int = RING_ROUNDS,
                    steps: int | None = None) -> tuple[float, float]:
        """A `PendingRing` of ``rounds`` rounds on the reference instance, each request accepting its deepest node
        every round, over ``steps`` rounds (default ``rounds + 1``: at least one write round), the reads on ``read``
        (default the verify's launch) and the writes on ``write`` (default the ring write's): (the worst relative
        error of a round's outputs, that of the slots after a final flush), against the float64 recurrence run
        round after round."""
        tree, x, _ = self.reference()
        c = self.case
        read, write = read or self.launch(), write or self.launch(ring=True)
        pool, truth = x.state.clone(), x.state.clone()  # truth: committed in float64 each round, kept in fp32
        ring = PendingRing(pool.shape[0], rounds, tree.depth + 1, tree.num_nodes, tree.num_requests, pool.device)
        arena = ring.results(c.shape, c.dtype)
        accepted = self.deepest(tree)
        worst = 0.0
        for _ in range(steps or rounds + 1):
            step = ring.begin(tree)
            res = tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, x.state_indices, tree, ring=step.layer(arena),
                              launch=write if step.write else read, validate=False)
            ref = verify_reference(x.q, x.k, x.v, x.g, x.beta, truth, x.state_indices, tree)
            worst = max(worst, relative_error(res.o, ref.o))
            truth = ref.committed(truth, x.state_indices, tree, accepted).float()
            ring.end(step, x.state_indices, accepted)
        ring.flush(x.state_indices, [pool], [arena])
        used = x.state_indices.long()
        return worst, relative_error(pool[used], truth[used])

    # timing -----------------------------------------------------------------------------------
    def tree(self):
        """The batch's trees, which every rotating set of `sets` verifies (made once; nothing else allocated)."""
        if self._tree is None:
            c = self.case
            self._tree = make_tree([c.tree_size] * c.batch, c.kind, max_depth=c.max_depth, seed=self.seed,
                                   device=self.device)
        return self._tree

    def sets(self, most: int):
        """(tree, pool, per-set inputs, per-set slot indices), enough sets to exceed the L2 cache."""
        c = self.case
        num_sets = rotation_count(c.floor_bytes(), l2_cache_bytes(self.device), most=most)
        if num_sets not in self._sets:
            tree = self.tree()
            s = c.shape
            pool = make_inputs(tree, s.hk, s.hv, s.dk, s.dv, c.dtype, self.device, num_slots=c.batch * num_sets,
                               seed=self.seed).state
            inputs = [make_inputs(tree, s.hk, s.hv, s.dk, s.dv, c.dtype, self.device, num_slots=1,
                                  seed=self.seed + 100 + i) for i in range(num_sets)]
            slots = [torch.arange(i * c.batch, (i + 1) * c.batch, dtype=torch.int32, device=self.device)
                     for i in range(num_sets)]
            self._sets = {num_sets: (tree, pool, inputs, slots)}
        return self._sets[num_sets]

    def time_verify(self, verify, launch: Launch | None = None, repeats: int = 50, most_sets: int = 64,
                    eager: bool = False) -> tuple[Timing, float | None]:
        tree, pool, inputs, slots = self.sets(most_sets)
        kwargs = self._kwargs(verify, launch)

        def launch(i):
            x = inputs[i]
            verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, validate=False, **kwargs)

        timing = time_launches(launch, len(inputs), self.device, repeats=repeats)
        host = time_eager_host(launch, len(inputs), self.device) if eager else None
        return timing, host

    def deepest(self, tree) -> torch.Tensor:
        """Each request's deepest node: the longest path a commit can have."""
        depths, offsets = tree.node_depth.tolist(), tree.offsets.tolist()
        return torch.tensor([max(range(offsets[r + 1] - offsets[r]), key=lambda n: depths[offsets[r] + n])
                             for r in range(tree.num_requests)], dtype=torch.int32, device=self.device)

    def time_commit(self, repeats: int = 50) -> Timing:
        """tree_commit of each request's deepest node, after a verification of each set."""
        tree, pool, inputs, slots = self.sets(64)
        results = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, validate=False)
                   for i, x in enumerate(inputs)]
        accepted = self.deepest(tree)

        def launch(i):  # each timed commit commits a fresh result (a result's paths are committed once)
            results[i].committed.zero_()
            tree_commit(pool, slots[i], results[i], accepted, validate=False)

        return time_launches(launch, len(inputs), self.device, repeats=repeats)

    def time_folded(self, launch: Launch | None = None, repeats: int = 50) -> Timing:
        """The folded round: ``tree_verify(..., pending=...)`` committing the previous round's paths (each
        request's deepest node) of the same slots, one launch a layer. Each call first zeroes the previous
        result's commit marks (a fresh previous round each time; a memset an engine does not pay)."""
        tree, pool, inputs, slots = self.sets(64)
        launch, accepted = launch or self.launch(fold=True), self.deepest(tree)
        previous = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=launch)
                    for i, x in enumerate(inputs)]
        outs = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=launch)
                for i, x in enumerate(inputs)]
        pending = [PendingCommit(PendingPaths.between_rounds(tree, accepted, slots[i], slots[i], pool.shape[0]),
                                 previous[i]) for i in range(len(inputs))]

        def folded(i):
            x = inputs[i]
            previous[i].committed.zero_()
            tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=launch, out=outs[i], pending=pending[i])

        return time_launches(folded, len(inputs), self.device, repeats=repeats)

    def _rings(self, rounds: int, read: Launch, write: Launch, held: int) -> list:
        """One `PendingRing` of ``rounds`` rounds (and its arena) per input set, ``held`` rounds already run on it
        (each request accepting its deepest node: the most tokens)."""
        tree, pool, inputs, slots = self.sets(64)
        c, accepted = self.case, self.deepest(tree)
        rings = []
        for i, x in enumerate(inputs):
            ring = PendingRing(pool.shape[0], rounds, tree.depth + 1, tree.num_nodes, c.batch, self.device)
            arena = ring.results(c.shape, c.dtype)
            for _ in range(held):
                step = ring.begin(tree)
                tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, ring=step.layer(arena),
                            launch=write if step.write else read)
                ring.end(step, slots[i], accepted)
            rings.append((ring, arena))
        return rings

    def _ring_verify(self, rings, i: int, launch: Launch) -> None:
        tree, pool, inputs, slots = self.sets(64)
        ring, arena = rings[i]
        x = inputs[i]
        tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, validate=False, launch=launch,
                    ring=ring.begin(tree).layer(arena))

    def time_ring_write(self, launch: Launch | None = None, rounds: int = RING_ROUNDS, repeats: int = 50) -> Timing:
        """A `PendingRing` write round alone (``launch``, default the ring write's): the tables holding ``rounds``
        rounds of each request's deepest path, all folded into the slots and written (what `bole-tune tune --ring`
        times)."""
        launch = launch or self.launch(ring=True)
        rings = self._rings(rounds, self.launch(), launch, rounds)
        return time_launches(lambda i: self._ring_verify(rings, i, launch), len(rings), self.device, repeats=repeats)

    def time_ring(self, rounds: int = RING_ROUNDS, layers: int = 1, repeats: int = 50, read_launch: Launch | None = None,
                  write_launch: Launch | None = None) -> dict[str, Timing]:
        """A `PendingRing` of ``rounds`` rounds, each request accepting its deepest node every round (the most
        tokens). A cycle is a write round (all ``rounds`` rounds folded in and written: ``ring_write``) and ``R - 1``
        read rounds, the ``h``-th holding ``h`` rounds, each reading the table entries those can fill
        (`PendingRing.round_width`): each distinct width is timed once, with the most rounds it holds. ``ring_read``
        is the fullest read round (``R - 1`` rounds held), ``ring_reads`` the cycle's read rounds on average,
        ``ring_end`` the round's table update (once per round for every layer, shown per layer over ``layers``), and
        ``round_ring`` one layer's round over a cycle: ``(sum of the read rounds + write) / R + end / layers``. The
        read rounds run ``read_launch`` (default the verify's), the write round ``write_launch`` (the ring write's)."""
        tree, pool, inputs, slots = self.sets(64)
        accepted = self.deepest(tree)
        read_launch, write_launch = read_launch or self.launch(), write_launch or self.launch(ring=True)
        probe = PendingRing(pool.shape[0], rounds, tree.depth + 1, tree.num_nodes, self.case.batch, "cpu")

        def width(held: int) -> int:  # the entries a read round holding ``held`` rounds reads on the read launch
            return ring_columns(read_launch, probe.round_width(held), probe.width)

        fullest = {}  # width -> the most rounds a read round of the cycle holds at it
        for held in range(1, rounds):
            fullest[width(held)] = max(fullest.get(width(held), 0), held)
        reads = {}
        for held in sorted(fullest.values()):
            rings = self._rings(rounds, read_launch, write_launch, held)
            reads[held] = time_launches(lambda i: self._ring_verify(rings, i, read_launch), len(inputs), self.device,
                                        repeats=repeats)
        rings = self._rings(rounds, read_launch, write_launch, rounds - 1)
        steps = [ring.begin(tree) for ring, _ in rings]
        end = time_launches(lambda i: rings[i][0].end(steps[i], slots[i], accepted, validate=False), len(inputs),
                            self.device, repeats=repeats)
        for (ring, _), step in zip(rings, steps):  # the tables now hold R rounds: the next round writes
            ring.held, ring.rounds_begun = rounds, step.position + 1
        write = time_launches(lambda i: self._ring_verify(rings, i, write_launch), len(inputs), self.device,
                              repeats=repeats)
        # each read round of the cycle at its width's timing
        cycle_reads = [reads[fullest[width(held)]] for held in range(1, rounds)]

        def mean(field: str, timings: list) -> float:
            return sum(getattr(t, field) for t in timings) / len(timings)

        def cycle(field: str) -> float:
            return (sum(getattr(t, field) for t in cycle_reads) + getattr(write, field)) / rounds + getattr(end, field) / layers

        widths = ", ".join(f"{width(h)} entries with {h} held" for h in range(1, rounds)) or "none"
        method = (f"{write.method}; R={rounds}: (the R - 1 read rounds ({widths}) + the write round) / R + the round's "
                  f"table update / {layers} layers")
        timings = {"ring_write": write, "ring_end": end,
                   "round_ring": Timing(cycle("p20_us"), cycle("p50_us"), cycle("p80_us"), method=method,
                                        samples=write.samples)}
        if cycle_reads:
            timings["ring_read"] = reads[rounds - 1]
            timings["ring_reads"] = Timing(mean("p20_us", cycle_reads), mean("p50_us", cycle_reads),
                                           mean("p80_us", cycle_reads), method=f"the mean of the cycle's read rounds "
                                           f"({widths})", samples=write.samples)
        return timings

    def time_rounds(self, layers: int, repeats: int = 50, ring_rounds: int = RING_ROUNDS) -> dict[str, Timing]:
        """What one GDN layer's round costs, each timed the same way (one CUDA graph over the rotating sets):

        round_verify_commit: `tree_verify` then `tree_commit` (two launches a layer);
        round_folded: `time_folded` with the folded launch's own config (one launch a layer);
        tree_commit_layers: one commit launch for ``layers`` layers, per layer (one set: the layers'
            states already exceed the L2 cache);
        round_serial: `serial_verify` then a copy of one state per request, what a snapshot engine's commit
            is (a copy of the accepted node's snapshot into the slot);
        round_ring (with ring_read, ring_write, ring_end): a `PendingRing` of ``ring_rounds`` rounds (`time_ring`).
        """
        tree, pool, inputs, slots = self.sets(64)
        launch, accepted = self.launch(), self.deepest(tree)
        outs = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=launch)
                for i, x in enumerate(inputs)]

        def verify_commit(i):
            x = inputs[i]
            tree_commit(pool, slots[i], tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=launch,
                                                    out=outs[i]), accepted)

        timings = {"round_verify_commit": time_launches(verify_commit, len(inputs), self.device, repeats=repeats),
                   "round_folded": self.time_folded(self.launch(fold=True), repeats),
                   **self.time_ring(ring_rounds, layers, repeats)}
        timings["tree_commit_layers"] = self.time_commit_layers(layers, repeats, launch)
        timings["round_serial"] = self.time_serial_round(repeats)
        return timings

    def time_commit_layers(self, layers: int, repeats: int = 50, launch: Launch | None = None) -> Timing:
        """One `tree_commit_layers` launch for ``layers`` layers (each request's deepest node accepted), per layer
        (one set: the layers' states already exceed the L2 cache); the results from ``launch`` (default the
        verify's)."""
        tree, pool, inputs, slots = self.sets(64)
        launch, accepted = launch or self.launch(), self.deepest(tree)
        x, h = inputs[0], self.case.shape
        stacked = LayerResults.empty(layers, tree, h, self.case.dtype, self.device)
        states = torch.stack([pool[slots[0].long()]] * layers)  # [L, B, Hv, dv, dk]: each request's own slot
        own = torch.arange(self.case.batch, dtype=torch.int32, device=self.device)
        for layer in range(layers):
            tree_verify(x.q, x.k, x.v, x.g, x.beta, states[layer], own, tree, launch=launch, out=stacked.layer(layer))
        whole = time_launches(lambda _: (stacked.committed.zero_(), tree_commit_layers(states, own, stacked, tree, accepted)),
                              1, self.device, repeats=repeats)
        return Timing(whole.p20_us / layers, whole.p50_us / layers, whole.p80_us / layers,
                      method=f"{whole.method}, {layers} layers in one launch, per layer", samples=whole.samples)

    def time_serial_round(self, repeats: int = 50) -> Timing:
        """The serial engine's round: `serial_verify` then a copy of one state per request into its slot (what a
        snapshot engine's commit is: the accepted node's snapshot copied over the slot)."""
        tree, pool, inputs, slots = self.sets(2)
        snapshot = torch.zeros_like(pool[:self.case.batch])

        def serial(i):
            x = inputs[i]
            serial_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, validate=False)
            pool.index_copy_(0, slots[i].long(), snapshot)

        return time_launches(serial, len(inputs), self.device, repeats=repeats)


def bench_verify(impl: str, case: BenchCase, device="cuda", config: KernelConfig | None = None,
                 repeats: int = 50, bench: CaseBench | None = None, eager: bool = False) -> dict:
    """Check, then time, one verifier ("bole": tree_verify, "serial": serial_verify) on one case."""
    bench = bench or CaseBench(case, device)
    verify = {"bole": tree_verify, "serial": serial_verify}[impl]
    launch = bench.launch(config) if impl == "bole" else None
    error = bench.check(verify, launch)
    # the serial verifier's snapshots dominate its traffic: two sets suffice and bound its memory
    timing, host = bench.time_verify(verify, launch, repeats, most_sets=2 if impl == "serial" else 64, eager=eager)
    row = _row("tree_verify" if impl == "bole" else "serial_verify", case, timing, device)
    row["rel_error"] = error
    if impl == "bole":
        row["config"], row["variant"] = launch.config.as_dict(), launch.variant
        row["launch"] = {"node_block": launch.node_block, "v_split": launch.v_split,
                         "state_split": launch.state_split, "sweep_f16": launch.sweep_f16, "stack_qk": launch.stack_qk}
    if host is not None:
        row["eager_host_us"] = round(host, 2)
    return row


def bench_commit(case: BenchCase, device="cuda", repeats: int = 50, bench: CaseBench | None = None) -> dict:
    """Time tree_commit of one accepted path per request (each request's deepest node)."""
    bench = bench or CaseBench(case, device)
    row = _row("tree_commit", case, bench.time_commit(repeats), device)
    row["floor_us"] = round(2 * case.state_bytes() / COPY_BANDWIDTH_H200 * 1e6, 2)
    row["floor_fraction"] = round(row["floor_us"] / row["p50_us"], 3)
    return row


def bench_rounds(case: BenchCase, layers: int, device="cuda", repeats: int = 50, bench: CaseBench | None = None,
                 ring_rounds: int | None = None) -> list[dict]:
    """Rows of `CaseBench.time_rounds`: what a layer's round (verify and commit) costs each way, per layer.
    A round's byte floor adds one write of the state to the verifier's. ``ring_rounds``: the ring's rounds (None:
    the case's own, `CaseBench.ring_rounds`)."""
    bench = bench or CaseBench(case, device)
    ring_rounds = ring_rounds or bench.ring_rounds()
    rows = []
    for kernel, timing in bench.time_rounds(layers, repeats, ring_rounds).items():
        row = _row(kernel, case, timing, device)
        floor = {"tree_commit_layers": 2 * case.state_bytes(), "ring_read": case.floor_bytes(),
                 "ring_reads": case.floor_bytes(), "ring_end": 0,
                 "round_ring": case.floor_bytes() + case.state_bytes() / ring_rounds}.get(
            kernel, case.floor_bytes() + case.state_bytes())
        row["floor_us"] = round(floor / COPY_BANDWIDTH_H200 * 1e6, 2)
        row["floor_fraction"] = round(row["floor_us"] / row["p50_us"], 3)
        if kernel.startswith(("ring", "round_ring")):
            row["ring_rounds"] = ring_rounds
        rows.append(row)
    return rows


ROUND_WAYS = ("round_verify_commit", "round_folded", "round_ring")
"""The `bench_rounds` rows that are a whole round of a layer; "verify + all-layer commit" (``tree_verify`` plus
``tree_commit_layers``, the per-layer share of one commit launch for every layer) is the fourth way."""


def round_verdict(rows) -> list[dict]:
    """Per case of ``rows`` (`run_cases` rows, or several runs' rows together) that has a serial round: the cheapest
    of a layer's round's ways against ``round_serial`` (``serial_verify`` then a snapshot engine's commit), the
    issue's "no case slower than the serial path". Cases without rounds (``--no-commit``, ``--no-serial``) are left
    out. Sorted by the ratio, the slowest against serial first."""
    cases: dict = {}
    for r in rows:
        key = (r["label"], r["hv"], r["dtype"], r["batch"], r["tree_size"], r.get("kind", "random"), r["max_depth"])
        cases.setdefault(key, {})[r["kernel"]] = r["p50_us"]
    verdict = []
    for (label, hv, dtype, batch, size, kind, depth), us in cases.items():
        if "round_serial" not in us:
            continue
        ways = {w: us[w] for w in ROUND_WAYS if w in us}
        if "tree_verify" in us and "tree_commit_layers" in us:
            ways["verify + all-layer commit"] = us["tree_verify"] + us["tree_commit_layers"]
        if not ways:
            continue
        way = min(ways, key=ways.get)
        verdict.append({"label": label, "hv": hv, "dtype": dtype, "batch": batch, "tree_size": size, "kind": kind,
                        "max_depth": depth, "way": way, "round_us": round(ways[way], 2),
                        "serial_us": us["round_serial"], "speedup": round(us["round_serial"] / ways[way], 3)})
    return sorted(verdict, key=lambda v: v["speedup"])


def _row(kernel: str, case: BenchCase, timing: Timing, device) -> dict:
    floor_us = case.floor_bytes() / COPY_BANDWIDTH_H200 * 1e6
    s = case.shape
    return {
        "kernel": kernel, "label": case.label, "hk": s.hk, "hv": s.hv, "dk": s.dk, "dv": s.dv,
        "dtype": dtype_name(case.dtype), "batch": case.batch, "tree_size": case.tree_size, "kind": case.kind,
        "max_depth": case.max_depth, "p20_us": round(timing.p20_us, 2), "p50_us": round(timing.p50_us, 2),
        "p80_us": round(timing.p80_us, 2), "floor_us": round(floor_us, 2),
        "floor_fraction": round(floor_us / timing.p50_us, 3), "method": timing.method,
        "device": str(device),
    }


@dataclass
class BenchRun:
    """What `run_cases` timed: the rows, the environment and, off a GPU, what the CPU numbers mean."""

    environment: dict
    rows: list
    on_gpu: bool
    cpu_note: str = ""


def run_cases(models, batches=None, tree_sizes=None, dtype: torch.dtype = torch.bfloat16, max_depth: int = 8,
              repeats: int = 50, serial: bool = True, commit: bool = True, chain: bool = False,
              ring_rounds: int | None = None, progress=None) -> BenchRun:
    """`bench_verify` (and the serial baseline, `bench_commit` and the layer's round each way, `bench_rounds`)
    for every model profile, batch and tree size (``chain``: each request a chain, not a random tree).

    On a GPU the defaults are B in 1, 4, 16 and T in 16..256; without one, small CPU cases (one key head
    group of 32-wide heads, B=1, T=16) that check the code runs. ``progress(rows)`` after each case.
    """
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    run = BenchRun(environment(), [], on_gpu)
    if on_gpu:
        batches, tree_sizes = batches or [1, 4, 16], tree_sizes or [16, 32, 64, 128, 256]
    else:
        batches, tree_sizes = batches or [1], tree_sizes or [16]
        mode = ("the Triton kernels under TRITON_INTERPRET=1" if os.environ.get("TRITON_INTERPRET") == "1"
                else "the PyTorch closed-form fallback")
        run.cpu_note = (f"No CUDA GPU here: timing {mode} on the CPU, with the wall clock. These numbers check that "
                        "the code runs; they say nothing about GPU speed.")
    for model in models:
        heads = model.heads()
        if not on_gpu:  # keep the CPU run to seconds: one key head group, small heads
            heads = HeadShape(hk=1, hv=heads.group, dk=32, dv=32)
        for batch in batches:
            for size in tree_sizes:
                case = BenchCase(heads, batch, size, dtype, max_depth, label=model.name,
                                 kind="chain" if chain else "random")
                bench = CaseBench(case, device)
                rows = [bench_verify("bole", case, device, repeats=repeats, bench=bench, eager=on_gpu)]
                if serial:
                    rows.append(bench_verify("serial", case, device, repeats=repeats, bench=bench))
                if commit:
                    rows.append(bench_commit(case, device, repeats=repeats, bench=bench))
                    if serial:
                        rows += bench_rounds(case, model.num_gdn_layers, device, repeats=repeats, bench=bench,
                                             ring_rounds=ring_rounds)
                run.rows.extend(rows)
                if progress:
                    progress(rows)
    return run


def verdict_of_files(paths, out=print, merged=None) -> int:
    """`round_verdict` over the rows of ``bole-tune bench --json`` files (one grid timed in several runs): the twelve
    slowest cases against the serial round, then the verdict's line; 1 where a case is not faster than the serial
    round, else 0. ``merged``: also write every file's rows and the verdict into one JSON file there (atomically).
    ``python3 -m bole_tune.bench [--merge OUT.json] FILE...``."""
    import json

    from bole_tune.atomic import write_text_atomic
    from bole_tune.render import round_verdict as verdict_line

    rows, env = [], None
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        rows += data["rows"]
        env = env or data.get("environment")
    verdict = round_verdict(rows)
    if merged:
        write_text_atomic(merged, json.dumps({"environment": env, "rows": rows, "round_verdict": verdict}) + "\n")
    out(f"{'B':>3} {'T':>4} {'kind':<6} {'cheapest round':<26} {'us':>8} {'serial us':>9} {'speedup':>7}")
    for v in verdict[:12]:
        out(f"{v['batch']:>3} {v['tree_size']:>4} {v['kind']:<6} {v['way']:<26} {v['round_us']:>8.1f} "
            f"{v['serial_us']:>9.1f} {v['speedup']:>6.2f}x")
    out(verdict_line(verdict).replace("[bold red]", "").replace("[/]", ""))
    return int(any(v["speedup"] <= 1 for v in verdict))


if __name__ == "__main__":
    import sys

    args, merged = sys.argv[1:], None
    if args[:1] == ["--merge"]:
        if len(args) < 2:
            sys.exit("--merge: expected the path of the JSON file to write")
        merged, args = args[1], args[2:]
    if not args:
        sys.exit("usage: python3 -m bole_tune.bench [--merge OUT.json] FILE.json ... (rows of bole-tune bench --json)")
    sys.exit(verdict_of_files(args, merged=merged))
