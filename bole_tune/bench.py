"""Benchmarks of one GDN layer's verification: tree_verify against serial_verify, and tree_commit.

A `CaseBench` holds one case (shape, batch, tree size, dtype): a fresh random instance with its
float64 reference for the correctness gate, and rotating input sets larger than the L2 cache for
timing. Every kernel is checked against the reference before it is timed; a wrong kernel is never
timed. Rows carry the shape, the times (p20/p50/p80), the byte floor and the method, ready for
BENCHMARKS.md or the tuning database.
"""

from __future__ import annotations

import datetime as _dt
import platform
from dataclasses import dataclass

import torch

from bole_tune.config import KernelConfig
from bole_tune.profiles import GDNShape
from bole_tune.timing import Timing, l2_cache_bytes, rotation_count, time_eager_host, time_launches
from bole_tune.workloads import make_inputs, make_tree, relative_error

COPY_BANDWIDTH_H200 = 4.25e12  # bytes/s, read + write, measured (../shared/DESIGN.md §6)
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def accepted_error(dtype: torch.dtype) -> float:
    """The relative error a config may show on the reference instance to be timed and recorded: half
    the contract's bound. Right configs land near 2e-3 with 16-bit inputs, while a Triton miscompile
    seen on the H200 came out at 1.3e-2 on one instance and under 1e-2 on another; the tuner must not
    record a config on a lucky instance."""
    return TOLERANCE[dtype] / 2
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
CHECK_BATCH = 2  # requests in the reference instance: the kernels do not depend on the batch size


class WrongResult(AssertionError):
    """A kernel's output disagrees with the float64 reference: it must not be timed or recorded."""


@dataclass(frozen=True)
class BenchCase:
    shape: GDNShape
    batch: int
    tree_size: int
    dtype: torch.dtype = torch.bfloat16
    max_depth: int = 8
    label: str = ""

    @property
    def num_nodes(self) -> int:
        return self.batch * self.tree_size

    def floor_bytes(self) -> int:
        """Read S_pre, q, k, v and the gates once; write o once (../shared/DESIGN.md §6)."""
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
    import triton

    from bole_tune import __version__

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
        self._reference = None
        self._sets = {}

    def launch_kwargs(self, verify, config: KernelConfig | None, variant: str | None = None) -> dict:
        """Keyword arguments that make ``verify`` run this case's kernel and config.

        For `tree_verify` the config (``None``: the database's for this case), the kernel variant and
        the resident kernel's value split are resolved for the full case and passed explicitly, so the
        reference check, which runs on a smaller batch, checks exactly the kernel and launch that are timed.
        """
        from bole_tune.kernels import tree_verify

        if verify is not tree_verify:
            return {"config": config} if config is not None else {}
        config, variant = self.launch(config, variant)
        return {"config": config, "variant": variant, "v_split": self.value_split(config)}

    def value_split(self, config: KernelConfig) -> int:
        """The resident kernel's programs per head for this case: it follows the batch, so it is pinned
        to the full case's, as are the kernel and config."""
        from bole_tune.database import batch_bucket
        from bole_tune.kernels.tree_verify_resident import resident_split

        c = self.case
        return resident_split(batch_bucket(c.batch), c.shape.hv, c.shape.dv, config.b_v)

    def launch(self, config: KernelConfig | None = None, variant: str | None = None) -> tuple[KernelConfig, str]:
        """(config, kernel variant) `tree_verify` runs for this case; ``None``: as tree_verify decides."""
        from bole_tune.kernels.common import VerifyShape
        from bole_tune.kernels.tree_verify import resolve_launch

        c = self.case
        tree, pool, _, _ = self.sets(64)
        shape = VerifyShape(tree.num_nodes, c.batch, pool.shape[0], c.shape.hk, c.shape.hv, c.shape.dk, c.shape.dv,
                            c.shape.dk ** -0.5)
        return resolve_launch(shape, c.dtype, tree, self.device, config, variant)

    def resident_check(self, config: KernelConfig | None = None) -> tuple[float, float] | None:
        """(error, allowed) of the resident kernel's runtime self-check for this case's launch with
        ``config``, or None when the case runs on the fused kernel (or on the CPU, where no binary exists).

        `tree_verify` runs a config that fails this check on the fused kernel instead; the tuner uses it
        so that a config recorded for the resident kernel really runs there.
        """
        from bole_tune.config import node_block
        from bole_tune.kernels.common import VerifyShape
        from bole_tune.kernels.tree_verify import check_resident

        config, variant = self.launch(config)
        if variant != "resident" or self.device.type != "cuda":
            return None
        c = self.case
        shape = VerifyShape(0, c.batch, 1, c.shape.hk, c.shape.hv, c.shape.dk, c.shape.dv, c.shape.dk ** -0.5)
        return check_resident(config, node_block(c.tree_size), shape, c.dtype, torch.float32, True, self.device,
                              self.value_split(config))

    # correctness ------------------------------------------------------------------------------
    def reference(self):
        if self._reference is None:
            from bole_tune.kernels.reference import verify_reference

            c = self.case
            tree = make_tree([c.tree_size] * min(c.batch, CHECK_BATCH), max_depth=c.max_depth,
                             seed=self.seed + 1, device=self.device)
            x = make_inputs(tree, c.shape.hk, c.shape.hv, c.shape.dk, c.shape.dv, c.dtype, self.device,
                            seed=self.seed + 1)
            self._reference = (tree, x, verify_reference(*x.args(tree), keep_states=False))
        return self._reference

    def error(self, verify, config: KernelConfig | None = None, variant: str | None = None) -> float:
        """Relative error of ``verify`` (with ``config``, if it takes one) on the reference instance."""
        tree, x, ref = self.reference()
        res = verify(*x.args(tree), validate=False, **self.launch_kwargs(verify, config, variant))
        return relative_error(res.o, ref.o)

    def check(self, verify, config: KernelConfig | None = None, variant: str | None = None) -> float:
        """Relative error on the reference instance; `WrongResult` above `accepted_error`."""
        error = self.error(verify, config, variant)
        bound = accepted_error(self.case.dtype)
        if not error <= bound:
            raise WrongResult(f"{getattr(verify, '__name__', verify)} with {config} is wrong on {self.case}: "
                              f"relative error {error:.2e} > {bound:.0e}")
        return error

    # timing -----------------------------------------------------------------------------------
    def sets(self, most: int):
        """(tree, pool, per-set inputs, per-set slot indices), enough sets to exceed the L2 cache."""
        c = self.case
        num_sets = rotation_count(c.floor_bytes(), l2_cache_bytes(self.device), most=most)
        if num_sets not in self._sets:
            tree = make_tree([c.tree_size] * c.batch, max_depth=c.max_depth, seed=self.seed, device=self.device)
            s = c.shape
            pool = make_inputs(tree, s.hk, s.hv, s.dk, s.dv, c.dtype, self.device, num_slots=c.batch * num_sets,
                               seed=self.seed).state
            inputs = [make_inputs(tree, s.hk, s.hv, s.dk, s.dv, c.dtype, self.device, num_slots=1,
                                  seed=self.seed + 100 + i) for i in range(num_sets)]
            slots = [torch.arange(i * c.batch, (i + 1) * c.batch, dtype=torch.int32, device=self.device)
                     for i in range(num_sets)]
            self._sets = {num_sets: (tree, pool, inputs, slots)}
        return self._sets[num_sets]

    def time_verify(self, verify, config: KernelConfig | None = None, repeats: int = 50,
                    most_sets: int = 64, eager: bool = False, variant: str | None = None) -> tuple[Timing, float | None]:
        tree, pool, inputs, slots = self.sets(most_sets)
        kwargs = self.launch_kwargs(verify, config, variant)

        def launch(i):
            x = inputs[i]
            verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, validate=False, **kwargs)

        timing = time_launches(launch, len(inputs), self.device, repeats=repeats)
        host = time_eager_host(launch, len(inputs), self.device) if eager else None
        return timing, host

    def time_commit(self, repeats: int = 50) -> Timing:
        """tree_commit of each request's deepest node, after a verification of each set."""
        from bole_tune.kernels import tree_commit, tree_verify

        tree, pool, inputs, slots = self.sets(64)
        results = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, validate=False)
                   for i, x in enumerate(inputs)]
        depths, offsets = tree.node_depth.tolist(), tree.offsets.tolist()
        accepted = torch.tensor([max(range(self.case.tree_size), key=lambda n: depths[offsets[r] + n])
                                 for r in range(self.case.batch)], dtype=torch.int32, device=self.device)

        def launch(i):
            tree_commit(pool, slots[i], results[i], accepted, validate=False)

        return time_launches(launch, len(inputs), self.device, repeats=repeats)


def bench_verify(impl: str, case: BenchCase, device="cuda", config: KernelConfig | None = None,
                 repeats: int = 50, bench: CaseBench | None = None, eager: bool = False) -> dict:
    """Check, then time, one verifier ("bole": tree_verify, "serial": serial_verify) on one case."""
    from bole_tune.kernels import serial_verify, tree_verify

    bench = bench or CaseBench(case, device)
    verify = {"bole": tree_verify, "serial": serial_verify}[impl]
    error = bench.check(verify, config if impl == "bole" else None)
    # the serial verifier's snapshots dominate its traffic: two sets suffice and bound its memory
    timing, host = bench.time_verify(verify, config if impl == "bole" else None, repeats,
                                     most_sets=2 if impl == "serial" else 64, eager=eager)
    row = _row("tree_verify" if impl == "bole" else "serial_verify", case, timing, device)
    row["rel_error"] = error
    if impl == "bole":
        launched, variant = bench.launch(config)
        row["config"], row["variant"] = launched.as_dict(), variant
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


def _row(kernel: str, case: BenchCase, timing: Timing, device) -> dict:
    floor_us = case.floor_bytes() / COPY_BANDWIDTH_H200 * 1e6
    s = case.shape
    return {
        "kernel": kernel, "label": case.label, "hk": s.hk, "hv": s.hv, "dk": s.dk, "dv": s.dv,
        "dtype": DTYPE_NAMES[case.dtype], "batch": case.batch, "tree_size": case.tree_size,
        "max_depth": case.max_depth, "p20_us": round(timing.p20_us, 2), "p50_us": round(timing.p50_us, 2),
        "p80_us": round(timing.p80_us, 2), "floor_us": round(floor_us, 2),
        "floor_fraction": round(floor_us / timing.p50_us, 3), "method": timing.method,
        "device": str(device),
    }
