"""A cheaper host path into Triton's compiled kernels, for the launches of every eager call.

``kernel[grid](*args, **meta)`` in Triton 3.6 binds every argument, asks Triton's specialiser about each
one (alignment, divisibility by 16, equality to 1, integer width), hashes the result and only then
launches: about half of an eager `tree_verify` call's host time at one request (BENCHMARKS.md, "Host time
of an eager call"). `FastLauncher` does the first launch of each specialisation through Triton (which
compiles and returns the compiled kernel), keys it on what Triton specialises on, computed directly from
the arguments (each tensor's dtype and 16-byte alignment; each integer's equality to 1, divisibility by 16
and 32/64-bit width; the meta-parameters and launch options), and launches later calls of that key through
the compiled kernel's own launcher, as Triton's ``run`` ends.

The key is conservative: an argument that would make Triton choose another specialisation makes another
key (and so a Triton launch, which compiles or finds that specialisation). Off CUDA (the CPU interpreter)
every launch goes through Triton. If the compiled kernel's interface is not the one this was written for
(another Triton release), the launcher turns itself off with one warning and every launch goes through
Triton. ``BOLE_TUNE_FAST_LAUNCH=0`` turns it off for a process.
"""

from __future__ import annotations

import os
import warnings

import torch

try:  # Triton's runtime pieces the direct launch uses (present in the 3.x series this was written for)
    from triton.runtime.driver import driver as _driver
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - another Triton layout: every launch goes through Triton
    _driver = _knobs = None

_I32 = (-2 ** 31, 2 ** 31 - 1)


def _spec(value):
    """What Triton specialises a runtime argument on (a superset: more keys, never fewer)."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() & 15 == 0
    if isinstance(value, bool):
        return bool, value
    if isinstance(value, int):
        return int, value == 1, value % 16 == 0, _I32[0] <= value <= _I32[1]
    if isinstance(value, float):
        return float
    return type(value), value


def enabled() -> bool:
    return os.environ.get("BOLE_TUNE_FAST_LAUNCH", "1").strip().lower() not in ("0", "false", "no", "off")


class FastLauncher:
    """Launches one `triton.jit` function: ``launcher(grid, args, meta, num_warps, num_stages)`` does what
    ``fn[grid](*args, **meta, num_warps=..., num_stages=...)`` does (``args`` the runtime arguments in
    order, ``meta`` the constexpr meta-parameters by name)."""

    def __init__(self, fn):
        self.fn = fn
        params = getattr(fn, "params", None)  # None under TRITON_INTERPRET=1: every launch goes through Triton
        self.names = tuple(p.name for p in params or ())
        self.defaults = {p.name: p.default for p in params or () if p.is_constexpr and p.has_default}
        self.kernels: dict = {}
        self.active = _driver is not None and params is not None
        self.direct = 0  # launches that skipped Triton's binder (tests and benchmarks read it)

    def __call__(self, grid, args: tuple, meta: dict, num_warps: int, num_stages: int):
        first = args[0]
        if not (self.active and first.is_cuda and enabled()):
            return self.fn[grid](*args, **meta, num_warps=num_warps, num_stages=num_stages)
        key = (tuple(meta.items()), num_warps, num_stages, first.device.index, tuple(map(_spec, args)))
        kernel = self.kernels.get(key)
        if kernel is None:
            kernel = self.fn[grid](*args, **meta, num_warps=num_warps, num_stages=num_stages)
            if hasattr(kernel, "result"):  # an asynchronous compile's future
                kernel = kernel.result()
            self.kernels[key] = kernel
            return kernel
        try:
            full = args + tuple(meta[name] if name in meta else self.defaults[name]
                                for name in self.names[len(args):])
            device = _driver.active.get_current_device()
            stream = _driver.active.get_current_stream(device)
            grid = tuple(grid) + (1,) * (3 - len(grid))
            kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata,
                       kernel.launch_metadata(grid, stream, *full), _knobs.runtime.launch_enter_hook,
                       _knobs.runtime.launch_exit_hook, *full)
        except (AttributeError, KeyError, TypeError) as error:  # another Triton's interface: Triton's own path
            self.active = False
            warnings.warn(f"bole-tune: direct kernel launch unavailable with this Triton ({type(error).__name__}: "
                          f"{error}); launching through Triton (slower host path)", stacklevel=3)
            return self.fn[grid](*args, **meta, num_warps=num_warps, num_stages=num_stages)
        self.direct += 1
        return kernel
