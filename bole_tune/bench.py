"""Benchmarks of one GDN layer's verification: tree_verify against serial_verify, and tree_commit.

Every case draws fresh random trees (depth <= 8 unless asked otherwise) and inputs, checks the
kernel's output against the float64 reference once (a wrong kernel is never timed), then times it
with `bole_tune.timing`. Rows carry the shape, the times (p20/p50/p80), the byte floor and the
environment, so they can be written to BENCHMARKS.md or the tuning database as they are.
"""

from __future__ import annotations

import datetime as _dt
import platform
from dataclasses import dataclass

import torch

from bole_tune.config import KernelConfig
from bole_tune.profiles import GDNShape
from bole_tune.timing import l2_cache_bytes, rotation_count, time_eager_host, time_launches
from bole_tune.workloads import make_inputs, make_tree, relative_error

COPY_BANDWIDTH_H200 = 4.25e12  # bytes/s, read + write, measured (../shared/DESIGN.md §6)
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 1e-2, torch.float16: 1e-2}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


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

    def set_bytes(self) -> int:
        return self.floor_bytes()


def environment() -> dict:
    """Versions and device of this process, for provenance."""
    import triton

    from bole_tune import __version__

    env = {"torch": torch.__version__, "triton": triton.__version__, "bole_tune": __version__,
           "python": platform.python_version(),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    else:
        env["gpu"] = "none (CPU)"
    return env


def _build(case: BenchCase, device, num_sets: int, seed: int):
    tree = make_tree([case.tree_size] * case.batch, max_depth=case.max_depth, seed=seed, device=device)
    inputs = make_inputs(tree, case.shape.hk, case.shape.hv, case.shape.dk, case.shape.dv, case.dtype, device,
                         num_slots=case.batch * num_sets, seed=seed)
    slot_sets = [inputs.state_indices.new_tensor(list(range(i * case.batch, (i + 1) * case.batch)))
                 for i in range(num_sets)]
    # each set gets its own q, k, v, gates; the pool holds every set's slots
    sets = [inputs] + [make_inputs(tree, case.shape.hk, case.shape.hv, case.shape.dk, case.shape.dv, case.dtype,
                                   device, num_slots=1, seed=seed + i) for i in range(1, num_sets)]
    return tree, inputs.state, sets, slot_sets


class ReferenceCheck:
    """A fresh random instance of a case and its float64 reference, computed once, checked many times."""

    def __init__(self, case: BenchCase, device, seed: int = 1):
        from bole_tune.kernels.reference import verify_reference

        self.case = case
        self.tree = make_tree([case.tree_size] * case.batch, max_depth=case.max_depth, seed=seed, device=device)
        s = case.shape
        self.inputs = make_inputs(self.tree, s.hk, s.hv, s.dk, s.dv, case.dtype, device, seed=seed)
        self.reference = verify_reference(*self.inputs.args(self.tree))

    def error(self, verify, config=None) -> float:
        """Relative error of ``verify``'s outputs (``config`` passed through) on this instance."""
        kwargs = {"config": config} if config is not None else {}
        res = verify(*self.inputs.args(self.tree), validate=False, **kwargs)
        return relative_error(res.o, self.reference.o)


def bench_verify(impl: str, case: BenchCase, device="cuda", config: KernelConfig | None = None,
                 repeats: int = 50, seed: int = 0, check: ReferenceCheck | bool = True, eager: bool = False) -> dict:
    """Time one verifier ("bole" for tree_verify, "serial" for serial_verify) on one case.

    ``check``: True checks against a fresh reference first; a `ReferenceCheck` reuses one.
    """
    from bole_tune.kernels import serial_verify, tree_verify

    verify = {"bole": tree_verify, "serial": serial_verify}[impl]
    if check is True:
        check = ReferenceCheck(case, device)
    error = check.error(verify, config if impl == "bole" else None) if check else None
    if error is not None and error > TOLERANCE[case.dtype]:
        raise AssertionError(f"{impl} is wrong on {case}: relative error {error:.2e}")
    # the serial verifier's snapshots dominate its traffic: two sets suffice and keep memory bounded
    most = 2 if impl == "serial" else 64
    num_sets = rotation_count(case.set_bytes(), l2_cache_bytes(device), most=most)
    tree, pool, sets, slot_sets = _build(case, device, num_sets, seed)
    kwargs = {"config": config} if impl == "bole" else {}

    def launch(i):
        x = sets[i]
        verify(x.q, x.k, x.v, x.g, x.beta, pool, slot_sets[i], tree, validate=False, **kwargs)

    timing = time_launches(launch, num_sets, device, repeats=repeats)
    row = _row("tree_verify" if impl == "bole" else "serial_verify", case, timing, device)
    row["rel_error"] = error
    if impl == "bole":
        from bole_tune.lookup import config_for
        from bole_tune.kernels.common import VerifyShape
        used = config or config_for(VerifyShape(tree.num_nodes, case.batch, pool.shape[0], case.shape.hk,
                                                case.shape.hv, case.shape.dk, case.shape.dv, 1.0),
                                    case.dtype, tree, torch.device(device))
        row["config"] = used.as_dict()
    if eager:
        row["eager_host_us"] = round(time_eager_host(launch, num_sets, device), 2)
    return row


def bench_commit(case: BenchCase, device="cuda", repeats: int = 50, seed: int = 0) -> dict:
    """Time tree_commit of one accepted path per request (the deepest node) after a verification."""
    from bole_tune.kernels import tree_commit, tree_verify

    num_sets = rotation_count(case.batch * case.shape.hv * case.shape.dv * case.shape.dk * 8, l2_cache_bytes(device))
    tree, pool, sets, slot_sets = _build(case, device, num_sets, seed)
    results = [tree_verify(*sets[i].args(tree)[:5], pool, slot_sets[i], tree, validate=False) for i in range(num_sets)]
    depths = tree.node_depth.tolist()
    offsets = tree.offsets.tolist()
    accepted = torch.tensor([max(range(case.tree_size), key=lambda n: depths[offsets[r] + n])
                             for r in range(case.batch)], dtype=torch.int32, device=device)

    def launch(i):
        tree_commit(pool, slot_sets[i], results[i], accepted, validate=False)

    timing = time_launches(launch, num_sets, device, repeats=repeats)
    row = _row("tree_commit", case, timing, device)
    state_bytes = 2 * case.batch * case.shape.hv * case.shape.dv * case.shape.dk * 4
    row["floor_us"] = round(state_bytes / COPY_BANDWIDTH_H200 * 1e6, 2)
    return row


def _row(kernel: str, case: BenchCase, timing, device) -> dict:
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
