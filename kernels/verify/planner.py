"""The launch planner: everything a `tree_verify` launch runs with, decided in one place.

Given the head shape, the input dtype, the batch's tree (requests, largest tree, depth), the device
and optionally a config or a kernel variant, `Planner.plan` returns the whole `Launch`: which kernel
(fused or resident), its tile config, its node block, the resident kernel's value split and the two
precision switches (state split, fp16 sweeps). The runtime (`tree_verify`), the benchmarks, the
profiler, the precompiler and the tuner's runner all ask it, so what is timed and recorded is what
runs.

Tuned configs come from a *config source*: a function ``(heads, dtype, max_tree_size, num_requests,
device[, fold]) -> (KernelConfig, variant tuned on or None)`` (``fold=True`` for a launch that folds the
previous round's commit in, where the source takes that keyword). The kernels do not read the tuning database
themselves; the default source is `DEFAULT_CONFIG_SOURCE`, a module path resolved the first time a
launch on a GPU asks for a tuned config (the database layer, which sits above the kernels). Tests and
engines pass their own with `Planner(config_source=...)`.

The planner also owns the resident kernel's self-check: Triton 3.6 miscompiles a few resident configs
on the H200 (b_k <= 32 with 3+ stages and 128-wide value tiles came out at relative error 1.4e-2), so
the first resident launch of each specialisation in a process is checked once against the float64
reference on a one-request instance; a config that fails runs on the fused kernel instead, with one
warning. The check is injectable (``self_check=``) and its results are cached per specialisation.

Every threshold measured on a GPU lives in `LaunchPolicy` (`H200_POLICY`).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from bole_tune.config import KernelConfig, default_config, node_block
from bole_tune.shapes import HeadShape, batch_bucket, tree_bucket

from .gluon import HEAD_DIMS as GLUON_HEAD_DIMS
from .gluon import UNTUNED_CONFIG as GLUON_UNTUNED_CONFIG
from .gluon import gluon_ready, tile_refusal
from .resident import RESIDENT_MAX_NODES

VARIANTS = ("fused", "resident", "stream")
"""The kernels a launch runs on: the fused kernel, the resident kernel, and the resident kernel streaming its one
value tile of S_pre first (`resident.py`, ``STATE_FIRST``)."""
DEFAULT_CONFIG_SOURCE = "bole_tune.lookup:tuned_launch"


@dataclass(frozen=True)
class LaunchPolicy:
    """The GPU-specific thresholds of the planner, measured on the H200 (9B/27B/122B heads, bf16;
    BENCHMARKS.md, "Choosing the kernel and its switches").

    resident_min_heads: (batch bucket x value heads) from which the resident kernel runs: from 512 it
        beats the fused kernel (B=16 T=64: 63 against 87 us; T=16: 23 against 26 us).
    resident_min_heads_large_trees, large_tree: from 256 heads it wins on trees of more than 32 nodes
        (B=8 T=64: 32 against 45 us), but not on small ones (B=8 T=8: 13.5 against 12.1 us).
    resident_max_heads_small, small_tree: at most this many heads (one or two 9B requests) the resident kernel
        also runs trees of at most ``small_tree`` nodes, its head's rows split over programs, with whole key rows
        per step (b_k = 128, a tile the tuner's space gained in the same change): 9B B=1 4-chain 5.7 against
        6.8 us, B=1 T=16 6.2 against 8.5, B=2 T=16 7.0 against 8.0; from four requests the fused kernel keeps
        its place (B=4 T=8 8.9 us, resident no better), and at B=1 T=64 the fused kernel stays ahead.
    resident_target_programs: the resident kernel splits a head's value rows over 2, 4, ... programs
        while a launch has fewer programs than this (9B B=1 T=64: 4 parts 17.4 us, one 24.8 us; at
        B=4, 128 programs, 2 parts gain nothing).
    state_split_min_block: bf16 inputs take S_pre as two bf16 parts in the resident kernel's state
        products from this node block on (T=64: 3-10% faster, 9B B=16 61.8 against 64.0 us, and 2.5x
        more accurate where the state predicts v; mixed on smaller trees).
    stream_min_heads, stream_max_tree: from this many heads, trees of at most this many nodes run the resident kernel
        in its state-first order ("stream": one value tile per program, ``dv / b_v`` programs per head, the Gram
        products in the state stream's key steps, the factors after it): 9B B=16 4-chain verify 16.1 against 16.8 us,
        folded 40.5 against 46.1; T=16 17.9 against 18.7, folded 42.6 against 48.4; B=32 8-chain 32.1 against 32.6
        (`lab/state_first.py`); at T=64 it is slower (92 against 57 us). Only where the bucket's config was tuned on
        it or is given: an untuned bucket keeps the resident kernel (the default config's narrow value tiles would
        repeat the factors over four programs per head).
    stack_max_tree: trees of at most this many nodes (at most half the node block) run a "stream" launch on stacked
        rows (``STACK``: q and k of each node in one ``B_T``-row tile, so every product of the launch is one product,
        not two; docs/math.md §3, "Stacked rows"); 0 never.
    gluon_block: the node block whose resident launches run the Gluon verify on an sm_90 GPU (`gluon`).
    sweep_f16_max_depth, sweep_f16_max_scale: the resident kernel's level sweeps run on fp16 tensor
        cores for 16-bit inputs with L2-normalised keys, trees at most this deep (partial sums stay
        below 2^(depth - 1) = 2048) and q scales at most this large (5-8% faster at T=64).
    """

    resident_min_heads: int = 512
    resident_min_heads_large_trees: int = 256
    large_tree: int = 32
    resident_max_heads_small: int = 64
    small_tree: int = 32
    resident_target_programs: int = 128
    state_split_min_block: int = 64
    stream_min_heads: int = 512
    stream_max_tree: int = 16
    stack_max_tree: int = 8
    sweep_f16_max_depth: int = 12
    sweep_f16_max_scale: float = 256.0
    gluon_block: int = 64

    def gluon(self, variant: str, dtype: torch.dtype, block: int, v_split: int, sweep_f16: bool, fold: bool) -> bool:
        """Whether a launch may run the Gluon verify (`gluon.py`, where its config asks for it or its bucket is
        untuned, and the device and the tiles take it): resident launches of one
        program per head on ``gluon_block``-row trees (33-64 nodes) of bf16 inputs with fp16 sweeps, the verify or a
        ring's round (a `PendingCommit` fold stays on the Triton kernel). H200, 9B heads, T=64, 32/64 tiles, against the Triton
        resident launch in the same run: B=8 / 16 / 32 verify 23.8 / 49.0 / 95.2 us against 29.5 / 56.6 / 109.5, a
        ring of three rounds 31.4 / 59.9 / 113.9 against 53.7 / 102.4 / 198.8 (BENCHMARKS.md, "Twenty-third
        session"); ``gluon_block`` 0: never."""
        return (variant == "resident" and block == self.gluon_block and v_split == 1 and sweep_f16
                and dtype == torch.bfloat16 and not fold)

    def variant(self, num_requests: int, hv: int, max_tree_size: int) -> str:
        """The kernel for this batch, decided on its buckets (not exact sizes), so a tuned config always
        runs on the kernel it was tuned for."""
        heads, size = batch_bucket(num_requests) * hv, tree_bucket(max_tree_size)
        if heads >= self.stream_min_heads and size <= self.stream_max_tree:
            return "stream"
        if max_tree_size <= RESIDENT_MAX_NODES and (
                heads >= self.resident_min_heads
                or (heads >= self.resident_min_heads_large_trees and size > self.large_tree)
                or (heads <= self.resident_max_heads_small and size <= self.small_tree)):
            return "resident"
        return "fused"

    def untuned_variant(self, num_requests: int, hv: int, max_tree_size: int) -> str:
        """The kernel a bucket without a tuned config runs: `variant`, but "resident" for "stream" (the default
        config's narrow value tiles would repeat the factors over several programs per head)."""
        variant = self.variant(num_requests, hv, max_tree_size)
        return "resident" if variant == "stream" else variant

    def stack(self, variant: str, max_tree_size: int, block: int) -> bool:
        """Whether a launch runs on stacked rows: a "stream" launch whose trees fill at most half its node block."""
        return variant == "stream" and 2 * max_tree_size <= block and max_tree_size <= self.stack_max_tree

    def value_split(self, num_requests: int, hv: int, dv: int, b_v: int) -> int:
        """Programs sharing one head's value rows in the resident kernel: 1 at large batches, up to
        ``dv / b_v`` at small ones; each part recomputes the head's factors (``T^3``) and streams
        ``dv / parts`` rows of ``S_pre``. Decided on the batch bucket, as tuned."""
        parts, programs = 1, batch_bucket(num_requests) * hv
        while 2 * parts * b_v <= dv and programs * 2 * parts <= self.resident_target_programs:
            parts *= 2
        return parts

    def state_split(self, dtype: torch.dtype, block: int) -> bool:
        """S_pre as two bf16 parts (16 significant bits against tf32's 11) in the resident kernel: bf16
        inputs on large node blocks only. fp16 keeps tf32 (an fp16 part would overflow past 65504), fp32
        tf32x3; the fused kernel never splits (up to 47% slower with it, and a miscompiled config)."""
        return dtype == torch.bfloat16 and block >= self.state_split_min_block

    def sweep_f16(self, dtype: torch.dtype, use_qk_l2norm: bool, depth: int, scale: float) -> bool:
        """fp16 operands for the resident kernel's level sweeps: exact entries of ``(I + G)^-1`` are at most
        1 with L2-normalised keys and beta in [0, 1], but a row deeper than the sweeps done holds a partial
        Neumann sum of up to ``2^(depth - 1)`` (docs/math.md §3); fp16 keeps tf32's 11 bits at twice its
        rate and lacks only range."""
        return (dtype in (torch.bfloat16, torch.float16) and bool(use_qk_l2norm)
                and depth <= self.sweep_f16_max_depth and scale <= self.sweep_f16_max_scale)


H200_POLICY = LaunchPolicy()


@dataclass(frozen=True)
class Launch:
    """One verification launch, as it runs.

    variant: "fused", "resident" or "stream" (`VARIANTS`); config: its tiles; node_block: rows solved together
    (``B_T``); v_split: the resident kernel's programs per head (1 for the fused kernel, ``dv / b_v`` for "stream");
    state_split, sweep_f16: the resident kernel's precision switches (False for the fused kernel); stack_qk: a "stream"
    launch on stacked rows (`LaunchPolicy.stack_max_tree`); gluon: the resident launch runs the Gluon verify
    (`gluon.py`; sm_90 only, `LaunchPolicy.gluon`), the Triton resident kernel where a round's tensors do not fit it
    (`gluon.gluon_takes`); fallback: why a resident
    launch was moved to the fused kernel ("" if it was not), with the self-check's error if it failed.
    """

    variant: str
    config: KernelConfig
    node_block: int
    v_split: int = 1
    state_split: bool = False
    sweep_f16: bool = False
    stack_qk: bool = False
    gluon: bool = False
    fallback: str = ""
    fallback_error: float | None = None

    def replace(self, **changes) -> "Launch":
        """A copy with some fields changed: how a benchmark compares switches on the shipped kernels."""
        return dataclasses.replace(self, **changes)


_gluon_devices: dict = {}


def gluon_device_refusal(device: torch.device) -> str:
    """`gluon.gluon_ready` of ``device``, asked once per device."""
    why = _gluon_devices.get(device)
    if why is None:
        why = _gluon_devices[device] = gluon_ready(device)
    return why


def _power_of_two(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1 and value & (value - 1) == 0


SelfCheck = Callable[..., tuple[float, float]]

_generation = [0]


def forget_plans() -> None:
    """Make every planner plan again (what the database layer calls when it forgets its cached decisions)."""
    _generation[0] += 1


class Planner:
    """Plans launches under one `LaunchPolicy`, with one config source and one self-check cache."""

    def __init__(self, policy: LaunchPolicy = H200_POLICY, config_source: Callable | None = None,
                 self_check: SelfCheck | None = None):
        self.policy = policy
        self._config_source = config_source
        self.self_check = self_check
        self.checks: dict[tuple, tuple[float, float]] = {}
        self._keywords_of, self._keywords = None, frozenset()
        self._plans: dict[tuple, Launch] = {}
        self._plans_made_with: tuple = ()

    @property
    def config_source(self) -> Callable:
        if self._config_source is None:
            module, name = DEFAULT_CONFIG_SOURCE.split(":")
            self._config_source = getattr(importlib.import_module(module), name)
        return self._config_source

    def _source_takes(self, keyword: str) -> bool:
        """Whether the config source takes ``keyword`` ("fold", "ring"; looked up once per source: a signature costs
        host time)."""
        source = self.config_source
        if self._keywords_of is not source:
            try:
                takes = frozenset(inspect.signature(source).parameters) & {"fold", "ring"}
            except (TypeError, ValueError):  # a callable without a signature: asked as for the verify
                takes = frozenset()
            self._keywords_of, self._keywords = source, takes
        return keyword in self._keywords

    def plan(self, heads: HeadShape, dtype: torch.dtype, *, num_requests: int, max_tree_size: int, depth: int,
             device, config: KernelConfig | None = None, variant: str | None = None, v_split: int | None = None,
             tuned_on: str | None = None, scale: float | None = None, use_qk_l2norm: bool = True,
             gate_dtype: torch.dtype = torch.float32, check: bool = True, fold: bool = False,
             ring: bool = False, gluon: bool | None = None) -> Launch:
        """`_plan`, remembered per arguments: a plan is a pure function of them, the policy, the config source's
        answer (cached there per bucket) and the self-check's (cached per specialisation), so a call seen before
        costs one dictionary access. Forgotten by `clear`, by `forget_plans` (the database layer's
        ``clear_cache``), and when the policy or the config source is replaced."""
        key = (heads, dtype, num_requests, max_tree_size, depth, device, config, variant, v_split, tuned_on, scale,
               use_qk_l2norm, gate_dtype, check, fold, ring, gluon)
        try:
            launch = self._remembered().get(key)
        except TypeError:  # an unhashable argument: planned (and refused) without the table
            launch, key = None, None
        if launch is None:
            launch = self._plan(heads, dtype, num_requests=num_requests, max_tree_size=max_tree_size, depth=depth,
                                device=device, config=config, variant=variant, v_split=v_split, tuned_on=tuned_on,
                                scale=scale, use_qk_l2norm=use_qk_l2norm, gate_dtype=gate_dtype, check=check,
                                fold=fold, ring=ring, gluon=gluon)
            if key is not None:
                self._remember(key, launch)
        return launch

    def _plan(self, heads: HeadShape, dtype: torch.dtype, *, num_requests: int, max_tree_size: int, depth: int,
              device, config: KernelConfig | None = None, variant: str | None = None, v_split: int | None = None,
              tuned_on: str | None = None, scale: float | None = None, use_qk_l2norm: bool = True,
              gate_dtype: torch.dtype = torch.float32, check: bool = True, fold: bool = False,
              ring: bool = False, gluon: bool | None = None) -> Launch:
        """The launch for a batch of ``num_requests`` trees (the largest ``max_tree_size`` nodes, the
        deepest ``depth`` edges) of ``heads`` in ``dtype`` on ``device``.

        config: None takes the tuned one (on a GPU; the default elsewhere) and the kernel it was tuned on.
        variant: force "fused", "resident" or "stream". tuned_on: the kernel a given ``config`` was tuned on,
            followed (without a forced variant) where that kernel takes the batch. v_split: force the resident
            kernel's value split (a power of two with ``v_split * b_v <= dv``; "stream" runs ``dv / b_v``). check: run the resident self-check (a
            launch that fails it comes back on the fused kernel with ``fallback`` set). fold: the launch folds the
            previous round's commit in (``pending=``): the config source is asked for that launch's own tuned
            config (``fold=True``; a source without that keyword is asked as for the verify). ring: the launch is a
            `PendingRing`'s write round (its R rounds of tokens folded in): asked with ``ring=True`` (a source without
            that keyword is asked as for the folded verify). gluon: None runs the Gluon verify with a Gluon config's
            tiles (``config.gluon = 1``, tuned or given) where the policy, the tiles and the device take it
            (`LaunchPolicy.gluon`, `gluon.tile_refusal`, `gluon.gluon_ready`), and in a bucket without a tuned
            config with `gluon.UNTUNED_CONFIG`; a Triton config (``gluon = 0``) runs the Triton kernels, and so does
            a Gluon config the launch cannot take (with its tiles). False: never; True: requires it (the config's
            tiles where it is a Gluon config, else the untuned ones; a ValueError naming why not).
        """
        device = torch.device(device)
        if variant is not None and variant not in VARIANTS:
            raise ValueError(f"variant: expected one of {VARIANTS} or None, got {variant!r}")
        if v_split is not None and not _power_of_two(v_split):
            raise ValueError(f"v_split: expected a power of two (programs per head) or None, got {v_split!r}")
        if variant in ("resident", "stream") and max_tree_size > RESIDENT_MAX_NODES:
            raise ValueError(f"variant: {variant!r} takes trees of at most {RESIDENT_MAX_NODES} nodes per request; "
                             f"this batch has a tree of {max_tree_size}")
        untuned = config is None
        if config is None:
            if device.type == "cuda":
                extra = ({"ring": True} if ring and self._source_takes("ring")
                         else {"fold": True} if (fold or ring) and self._source_takes("fold") else {})
                config, tuned_on = self.config_source(heads, dtype, max_tree_size, num_requests, device, **extra)
            else:
                config = default_config(heads.dk, heads.dv)
        if variant is None and tuned_on in VARIANTS and (tuned_on == "fused" or max_tree_size <= RESIDENT_MAX_NODES):
            variant = tuned_on
        untuned = untuned and tuned_on is None
        if not isinstance(config, KernelConfig):
            raise TypeError(f"config: expected a KernelConfig or None, got {type(config).__name__}")
        triton_config = config.replace(gluon=0) if config.gluon else config  # what runs where the Gluon verify cannot
        if not config.fits(heads.dk, heads.dv):
            raise ValueError(f"config: tiles b_k={config.b_k}, b_v={config.b_v} must divide dk={heads.dk}, dv={heads.dv}")
        if v_split is not None and v_split * config.b_v > heads.dv:
            raise ValueError(f"v_split: expected a power of two with v_split * b_v <= dv = {heads.dv} "
                             f"(b_v = {config.b_v}), got {v_split!r}")
        if variant is None:  # the state-first order only with tiles tuned (or given) for it
            variant = (self.policy.untuned_variant if untuned else self.policy.variant)(
                num_requests, heads.hv, max_tree_size)
        if variant == "stream" and v_split is not None and v_split * config.b_v != heads.dv:
            raise ValueError(f"v_split: 'stream' runs one value tile per program, dv / b_v = {heads.dv // config.b_v} "
                             f"programs per head; got {v_split!r}")
        block = node_block(max_tree_size)
        if variant == "fused":
            return Launch("fused", triton_config, block)
        scale = heads.dk ** -0.5 if scale is None else float(scale)
        if variant == "stream":
            v_split = heads.dv // config.b_v
        launch = Launch(variant, triton_config, block,
                        v_split=v_split or self.policy.value_split(num_requests, heads.hv, heads.dv, config.b_v),
                        state_split=self.policy.state_split(dtype, block),
                        sweep_f16=self.policy.sweep_f16(dtype, use_qk_l2norm, depth, scale),
                        stack_qk=self.policy.stack(variant, max_tree_size, block))
        if gluon is True or (gluon is None and (config.gluon or untuned)):
            # the Gluon verify with the config's tiles where it is a Gluon config (gluon=1, tuned or given), else
            # (an untuned bucket, or gluon=True) with the untuned ones
            tiles = config if config.gluon else GLUON_UNTUNED_CONFIG
            why = self.gluon_refusal(launch.replace(config=tiles), heads, dtype, fold, device, ring=ring)
            if gluon and why:
                raise ValueError(f"gluon: this launch cannot run the Gluon verify: {why}")
            if not why:
                launch = launch.replace(config=tiles, gluon=True)
        if not check:
            return launch
        return self.checked(launch, heads, dtype, gate_dtype, scale, use_qk_l2norm, device,
                            deep=depth > self.policy.sweep_f16_max_depth)

    def gluon_refusal(self, launch: Launch, heads: HeadShape, dtype: torch.dtype, fold: bool, device,
                      ring: bool = False) -> str:
        """"" if ``launch`` may run the Gluon verify, else why not (the policy's conditions, the head dims it was
        measured on, the config's tiles (``ring``: as a ring's write round takes them), the device)."""
        if not self.policy.gluon(launch.variant, dtype, launch.node_block, launch.v_split, launch.sweep_f16, fold):
            return (f"it runs resident launches of one program per head on {self.policy.gluon_block}-row trees of "
                    f"bf16 inputs with fp16 sweeps, without a pending fold (got {launch.variant!r}, node block "
                    f"{launch.node_block}, v_split {launch.v_split}, {dtype}, sweep_f16={launch.sweep_f16}, "
                    f"fold={fold})")
        if (heads.dk, heads.dv) != GLUON_HEAD_DIMS:
            return f"it takes dk, dv = {GLUON_HEAD_DIMS}, got {heads.dk}, {heads.dv}"
        why = tile_refusal(launch.config, "write" if ring else "verify")
        return why or gluon_device_refusal(torch.device(device))

    def given(self, launch: Launch, heads: HeadShape, dtype: torch.dtype, gate_dtype: torch.dtype, max_tree_size: int,
              depth: int, scale: float, use_qk_l2norm: bool, device) -> Launch:
        """A launch given to `tree_verify` (``launch=``): refused by `check_launch` if it cannot run this batch, else
        `checked`; remembered per arguments like `plan` (a refused one is never remembered)."""
        key = ("given", launch, heads, dtype, gate_dtype, max_tree_size, depth, scale, use_qk_l2norm, device)
        try:
            kept = self._remembered().get(key)
        except TypeError:  # not a Launch (unhashable): refused by name below
            kept, key = None, None
        if kept is not None:
            return kept
        self.check_launch(launch, heads, dtype, max_tree_size, depth, scale, use_qk_l2norm)
        if launch.gluon:
            why = self.gluon_refusal(launch, heads, dtype, False, device)
            if why:
                raise ValueError(f"launch.gluon: this batch cannot run the Gluon verify: {why}")
        checked = self.checked(launch, heads, dtype, gate_dtype, scale, use_qk_l2norm, device,
                               depth > self.policy.sweep_f16_max_depth)
        if key is not None:
            self._remember(key, checked)
        return checked

    def _remembered(self) -> dict:
        """The remembered launches, emptied first if what they were made with changed."""
        made_with = (_generation[0], self.policy, self._config_source, self.self_check)
        if made_with != self._plans_made_with:
            self._plans.clear()
            self._plans_made_with = made_with
        return self._plans

    def _remember(self, key: tuple, launch: Launch) -> None:
        if launch.fallback.startswith("not checked"):  # a capture's stand-in is planned again after it
            return
        if len(self._plans) >= 4096:  # a process whose shapes keep changing keeps a bounded table
            self._plans.clear()
        self._plans[key] = launch

    def check_launch(self, launch: Launch, heads: HeadShape, dtype: torch.dtype, max_tree_size: int, depth: int,
                     scale: float, use_qk_l2norm: bool) -> None:
        """Refuse a given ``launch`` that cannot run this batch correctly (naming the field)."""
        if not isinstance(launch, Launch):
            raise TypeError(f"launch: expected a Launch (plan_launch), got {type(launch).__name__}")
        if launch.variant not in VARIANTS:
            raise ValueError(f"launch.variant: expected one of {VARIANTS}, got {launch.variant!r}")
        if not isinstance(launch.config, KernelConfig) or not launch.config.fits(heads.dk, heads.dv):
            raise ValueError(f"launch.config: {launch.config} does not tile dk={heads.dk}, dv={heads.dv}")
        block = node_block(max_tree_size)
        if launch.node_block != block:
            raise ValueError(f"launch.node_block: {launch.node_block}, but a batch whose largest tree has "
                             f"{max_tree_size} nodes is solved in blocks of {block}")
        if launch.stack_qk and (launch.variant != "stream" or launch.state_split or 2 * max_tree_size > block):
            raise ValueError("launch.stack_qk: stacked rows need a 'stream' launch without the state split on trees "
                             f"of at most half its node block ({block // 2} nodes; got variant {launch.variant!r}, "
                             f"state_split={launch.state_split}, a tree of {max_tree_size})")
        if launch.variant == "fused":
            if launch.v_split != 1 or launch.state_split or launch.sweep_f16:
                raise ValueError("launch: the fused kernel has no value split, state split or fp16 sweeps "
                                 f"(got v_split={launch.v_split}, state_split={launch.state_split}, "
                                 f"sweep_f16={launch.sweep_f16})")
            return
        if max_tree_size > RESIDENT_MAX_NODES:
            raise ValueError(f"launch.variant: {launch.variant!r} takes trees of at most {RESIDENT_MAX_NODES} nodes "
                             f"per request; this batch has a tree of {max_tree_size}")
        if not _power_of_two(launch.v_split) or launch.v_split * launch.config.b_v > heads.dv:
            raise ValueError(f"launch.v_split: expected a power of two with v_split * b_v <= dv = {heads.dv}, "
                             f"got {launch.v_split!r}")
        if launch.variant == "stream" and launch.v_split * launch.config.b_v != heads.dv:
            raise ValueError(f"launch.v_split: 'stream' streams one value tile per program, so v_split * b_v must be "
                             f"dv = {heads.dv} (got v_split={launch.v_split}, b_v={launch.config.b_v})")
        if launch.state_split and dtype != torch.bfloat16:
            raise ValueError(f"launch.state_split: splits S_pre into bf16 parts, for bf16 inputs only (got {dtype})")
        if launch.sweep_f16 and not self.policy.sweep_f16(dtype, use_qk_l2norm, depth, scale):
            raise ValueError("launch.sweep_f16: fp16 sweeps need 16-bit inputs, L2-normalised keys, trees at most "
                             f"{self.policy.sweep_f16_max_depth} deep and scale <= {self.policy.sweep_f16_max_scale} "
                             f"(this batch: {dtype}, depth {depth}, scale {scale:g})")

    def checked(self, launch: Launch, heads: HeadShape, dtype: torch.dtype, gate_dtype: torch.dtype, scale: float,
                use_qk_l2norm: bool, device: torch.device, deep: bool) -> Launch:
        """``launch``, or the same config on the fused kernel if it is a resident launch whose compiled
        specialisation fails the self-check (checked once per process and specialisation; ``deep``: a
        batch deeper than the fp16 sweeps allow, checked on a chain). A Gluon launch that fails it (or whose
        kernel does not compile) runs on the Triton resident kernel instead, itself checked. Inside a CUDA graph capture no
        check can run: an unchecked specialisation runs on the fused kernel."""
        if launch.variant == "fused" or device.type != "cuda" or self.self_check is None:
            return launch  # the CPU interpreter runs the kernel's semantics, not a compiled binary
        key = (launch.variant, launch.config, launch.node_block, launch.v_split, launch.state_split, launch.sweep_f16,
               launch.stack_qk, launch.gluon, heads, float(scale), dtype, gate_dtype, bool(use_qk_l2norm), device,
               deep)
        result = self.checks.get(key)
        if result is None:
            if torch.cuda.is_current_stream_capturing():
                return Launch("fused", launch.config, launch.node_block,
                              fallback="not checked yet, and no check can run inside a CUDA graph capture")
            if launch.gluon:  # a GPU-only kernel: a compile failure (or a wrong result) runs the Triton kernel
                try:
                    result = self.self_check(launch, heads, dtype, gate_dtype, scale, use_qk_l2norm, device, deep)
                except Exception as error:  # noqa: BLE001 - whatever stops it, the Triton kernel runs instead
                    result = (float("inf"), 0.0, f"{type(error).__name__}: {error}")
                self.checks[key] = result
                if not result[0] <= result[1]:
                    why = result[2] if len(result) > 2 else f"relative error {result[0]:.1e} against float64"
                    warnings.warn(f"bole-tune: the Gluon verify failed its self-check on "
                                  f"{torch.cuda.get_device_name(device)} ({why}); running the Triton resident "
                                  "kernel instead", stacklevel=4)
            else:
                try:
                    result = self.self_check(launch, heads, dtype, gate_dtype, scale, use_qk_l2norm, device, deep)
                except Exception as error:  # noqa: BLE001 - a compile failure (Triton 3.6 on sm_100 refuses some
                    # resident launches): the fused kernel runs instead
                    result = (float("inf"), 0.0, f"it did not compile or run: {type(error).__name__}: "
                                                  f"{str(error).splitlines()[0] if str(error) else ''}")
                self.checks[key] = result
            error, tolerance = result[:2]
            if not error <= tolerance and not launch.gluon:
                why = result[2] if len(result) > 2 else (f"relative error {error:.1e} against the float64 reference; "
                                                         "a Triton miscompile")
                warnings.warn(f"bole-tune: the resident tree_verify kernel fails its self-check with {launch.config} "
                              f"(value split {launch.v_split}) at {launch.node_block}-row trees on "
                              f"{torch.cuda.get_device_name(device)} ({why}); running the fused kernel for this config "
                              "instead", stacklevel=4)
        error, tolerance = result[:2]
        if error <= tolerance:
            return launch
        if launch.gluon:
            why = result[2] if len(result) > 2 else f"relative error {error:.2e} against the float64 reference"
            triton_launch = self.checked(launch.replace(gluon=False, config=launch.config.replace(gluon=0)), heads,
                                         dtype, gate_dtype, scale, use_qk_l2norm, device, deep)
            return triton_launch.replace(fallback=triton_launch.fallback or f"the Gluon verify's self-check: {why}; "
                                                                             "runs on the Triton resident kernel")
        why = result[2] if len(result) > 2 else (f"relative error {error:.2e} against the float64 reference (a Triton "
                                                 "miscompile)")
        return Launch("fused", launch.config, launch.node_block, fallback_error=error,
                      fallback=f"the resident kernel's self-check: {why}; runs on the fused kernel")

    def clear(self) -> None:
        """Forget the self-check results and the plans (the next resident launch of each specialisation checks
        again)."""
        self.checks.clear()
        self._plans.clear()
