"""Launching a compiled Triton kernel with less host time (BENCHMARKS.md, "The host path").

``fn[grid](*args, **meta)`` costs 33-53 us of host time on the H200's host for the verify kernels' 56 arguments:
Triton's binder works out each argument's specialisation (13-17 us), turns it into a cache key, looks up the
device, the stream and the launch hooks, then calls the compiled kernel's C launcher (9-11 us, of which a third
is a ``data_ptr`` call and a driver query of each tensor's pointer). `FastLauncher` keeps the compiled kernel of
each specialisation it has seen and later calls its C launcher directly, on one of two keys:

- `FastLauncher.__call__`: a tuple of what Triton specialises on, taken from the arguments themselves (each
  specialised integer's value, each tensor's dtype and 16-byte alignment, each host tensor descriptor's dtype and
  block, the 32/64-bit range of the integers Triton does not specialise, and the launch's constants and options),
  so a call that Triton would compile differently never reuses another call's binary. Building it costs about as much as Triton's binder.
- `FastLauncher.launch_keyed`: a key the caller builds from what it knows (the verify and the commit: their launch
  or config, sizes, dtypes, strides, and which tensors are not 16-byte aligned, `misaligned`; the shapes and dtypes fixed by
  their checks), with each tensor passed as its device address (the C launcher takes an int as the pointer
  itself). The arguments with the tensors and the keywords are built only when no binary is kept under the key.

Triton's own path runs instead: for the first call of each specialisation (it compiles or loads the kernel and
returns it), under ``TRITON_INTERPRET=1`` (nothing is compiled), while a launch hook is installed (a profiler
that expects Triton's launch metadata), and for a kernel whose constants do not all follow its run-time
arguments (the launcher is handed every parameter in order, constants included, which it ignores).
"""

from __future__ import annotations

import re

import torch
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor



def misaligned(pointers: tuple, bits: int) -> tuple | None:
    """A caller key's part for the 16-byte alignment of its tensors (Triton specialises a pointer argument on it):
    None where every one of ``pointers`` is aligned (``bits``, their OR, says so), else which of them are not, so a
    launch on misaligned views (a layer's row of stacked results, a slice at an odd offset) is keyed by the caller
    too, not sent through the argument key (about four times the host time)."""
    if not bits & 15:
        return None
    return tuple(p & 15 != 0 for p in pointers)


def addresses(tensors: tuple) -> tuple[tuple, tuple | None]:
    """The device addresses of ``tensors`` (a launch's fast arguments) and their `misaligned` key part."""
    pointers = tuple(x.data_ptr() for x in tensors)
    bits = 0
    for p in pointers:
        bits |= p
    return pointers, misaligned(pointers, bits)


def _hooked(hook) -> bool:
    """A launch hook is installed (Triton 3.6 keeps an empty chain of hooks when none is)."""
    return hook is not None and bool(getattr(hook, "calls", True))


_driver = []

_TRAP = re.compile(r"^\s*trap;", re.MULTILINE)


def traps(compiled) -> bool:
    """Whether a compiled kernel's PTX holds a ``trap;`` (what Triton leaves where it drops a kernel's body)."""
    asm = getattr(compiled, "asm", None)
    ptx = asm.get("ptx") if asm is not None else None
    return isinstance(ptx, str) and _TRAP.search(ptx) is not None


def refuse_trapped(fn, grid, args: tuple, meta: dict) -> None:
    """Compile ``fn``'s launch without running it (Triton's ``warmup``) and raise where the compiler turned its body
    into a trap (Triton 3.6 does, for sm_100, to the fused verify kernel with fp32 inputs and 64-row blocks: its PTX a
    ``trap;`` in place of the work): launched, it would abort every later call in the process. None of the package's
    kernels traps on purpose (no ``device_assert``). A function without ``warmup`` (the interpreter's) is let through."""
    warmup = getattr(fn, "warmup", None)
    if warmup is None:
        return
    compiled = warmup(*args, grid=grid, **meta)
    if traps(compiled):
        target = getattr(compiled, "metadata", None)
        target = getattr(target, "target", None)
        where = f"for {getattr(target, 'backend', 'cuda')} arch {getattr(target, 'arch', '?')}" if target else ""
        raise RuntimeError(f"{getattr(fn, '__name__', fn)}: Triton compiled this launch {where} to a trap (its body "
                           "left out: a compiler failure); launching it would abort the process's device context. "
                           "Another config, kernel or input dtype may compile (BENCHMARKS.md, \"Thirty-third "
                           "session\")")


def _active_driver():
    """Triton's active driver, looked up once (an import and a property lookup per launch cost host time)."""
    if not _driver:
        from triton.runtime.driver import driver

        _driver.append(driver.active)
    return _driver[0]


def _direct_launch(kernel) -> tuple | None:
    """Triton 3.6's CUDA launcher object without its Python wrapper: ``(launch, cooperative, pdl)`` where the
    wrapper would allocate no scratch memory (the wrapper's only work besides the call), else None."""
    run = getattr(kernel, "run", None)
    try:
        if run.global_scratch_size == 0 and run.profile_scratch_size == 0 and callable(run.launch):
            return run.launch, run.launch_cooperative_grid, run.launch_pdl
    except AttributeError:  # another backend or Triton version: its wrapper runs
        pass
    return None


class FastLauncher:
    """Launches of one ``@triton.jit`` kernel, positional run-time arguments first, constants by keyword."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled: dict[tuple, tuple] = {}
        self.by_caller_key: dict[tuple, tuple] = {}
        self.looked_at: set[tuple] = set()  # argument keys whose binary `refuse_trapped` passed
        params = getattr(fn, "params", None)
        self._kinds = None
        if params is not None:  # a JITFunction (the interpreter's functions are launched through Triton's path)
            self._kinds = tuple("constant" if p.is_constexpr else
                                "range" if p.do_not_specialize else
                                "tensor-any-alignment" if p.do_not_specialize_on_alignment else "value"
                                for p in params)

    def key(self, args: tuple, meta: dict) -> tuple | None:
        """What Triton specialises a launch on, or None where the fast path does not apply (too few kinds known,
        or a constant among the positional arguments)."""
        kinds = self._kinds
        if kinds is None or len(args) > len(kinds):
            return None
        spec = []
        for kind, arg in zip(kinds, args):
            if kind == "constant":
                return None
            if isinstance(arg, torch.Tensor):
                spec.append((arg.dtype, kind == "tensor-any-alignment" or arg.data_ptr() & 15 == 0))
            elif isinstance(arg, TensorDescriptor) or (hasattr(arg, "block_shape") and hasattr(arg, "base")):
                # a host tensor descriptor (Triton's, or Gluon's with its shared-memory layout): the base's dtype,
                # the block, the rank, the padding and the layout
                spec.append(("tensordesc", arg.base.dtype, tuple(arg.block_shape), len(arg.shape),
                             getattr(arg, "padding", None), getattr(arg, "layout", None)))
            elif type(arg) is int and kind == "range":
                spec.append(-0x80000000 <= arg <= 0x7FFFFFFF)
            elif type(arg) is float:
                spec.append(float)
            else:  # specialised integers (their value: 1, divisible by 16, int32 or int64), bools, None
                spec.append(arg)
        return (len(args), *spec, *meta.items())

    def launch_keyed(self, caller_key, grid: tuple, fast_args: tuple, args, meta) -> None:
        """``fn[grid](*args(), **meta())`` where the caller names the specialisation.

        ``caller_key`` must determine everything `key` would take from the arguments (the tensors' dtypes and
        16-byte alignment, the specialised integers' values, the constants and options), or be None (then the
        argument-keyed path runs). ``fast_args`` are the run-time arguments with each tensor given as its device
        address (an int, as Triton's C launcher takes a pointer: no ``data_ptr`` call and no driver query of the
        pointer per tensor); the caller has checked that every tensor lives on the launch's device. ``args`` and
        ``meta`` are functions returning the arguments with the tensors themselves and the constants and options:
        called only when no binary is kept under the key (Triton compiles or loads it from them)."""
        if caller_key is not None and self._kinds is not None:
            device = self.device()
            kept = self.by_caller_key.get((device, caller_key))
            if kept is not None and not (_hooked(knobs.runtime.launch_enter_hook)
                                         or _hooked(knobs.runtime.launch_exit_hook)):
                kernel, constants = kept[0], kept[1]
                grid_x, grid_y, grid_z = (tuple(grid) + (1, 1))[:3]
                direct = kept[2] if len(kept) > 2 else None
                if direct is not None:  # the C launcher itself: no scratch memory to allocate per launch
                    launch, cooperative, pdl = direct
                    launch(grid_x, grid_y, grid_z, self.stream(device), kernel.function, cooperative, pdl, None, None,
                           kernel.packed_metadata, None, None, None, *fast_args, *constants)
                else:
                    kernel.run(grid_x, grid_y, grid_z, self.stream(device), kernel.function, kernel.packed_metadata,
                               None, None, None, *fast_args, *constants)
                return
            kept = self(grid, *args(), **meta())
            if kept is not None:
                if len(self.by_caller_key) >= 4096:  # a bound on what a process with ever-new shapes keeps
                    self.by_caller_key.clear()
                self.by_caller_key[(device, caller_key)] = (*kept, _direct_launch(kept[0]))
            return
        self(grid, *args(), **meta())

    def __call__(self, grid: tuple, *args, **meta):
        """``fn[grid](*args, **meta)``, through the kept binary when this specialisation was launched before.
        Returns the kept ``(binary, constants)`` it launched or kept, or None where Triton's own path ran without
        keeping one."""
        if self._kinds is None:  # the interpreter
            self.fn[grid](*args, **meta)
            return None
        device = self.device()
        key = self.key(args, meta)
        if key is not None:
            key = (device, *key)
        kernel = self.compiled.get(key) if key is not None else None
        if kernel is None or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
            if kernel is None and key is not None and key not in self.looked_at:  # a specialisation not
                refuse_trapped(self.fn, grid, args, meta)  # launched before: compiled (or loaded) and looked at first
                self.looked_at.add(key)
            compiled = self.fn[grid](*args, **meta)
            if key is not None and hasattr(compiled, "packed_metadata") and all(
                    kind == "constant" for kind in self._kinds[len(args):]):
                self.compiled[key] = kernel = (compiled, (None,) * (len(self._kinds) - len(args)))
                return kernel
            return None
        binary, constants = kernel  # the launcher ignores the constants' values: None in their places
        stream = self.stream(device)
        grid_x, grid_y, grid_z = (tuple(grid) + (1, 1))[:3]
        binary.run(grid_x, grid_y, grid_z, stream, binary.function, binary.packed_metadata, None, None, None,
                   *args, *constants)
        return kernel

    @staticmethod
    def device():
        return _active_driver().get_current_device()

    @staticmethod
    def stream(device):
        return _active_driver().get_current_stream(device)

    def clear(self) -> None:
        self.compiled.clear()
        self.by_caller_key.clear()
        self.looked_at.clear()
