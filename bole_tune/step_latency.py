"""Latency of a whole verification step of the target model, measured on the GPU by layer groups.

One GDN layer, one full-attention layer (each with its FFN, dense or mixture of experts) and the LM
head are built at the model's real shapes with random bf16 weights and timed, each as one CUDA
graph, for N verified tokens at batch B (every request a tree of N / B nodes):

- GDN layer, the round an engine pays per layer: input projections, the tree-parallel short convolution
  and the gates (`gdn_tree_step`: conv, gates, `tree_verify` with the tuned configs), gated RMS norm,
  output projection and FFN, and the commit of each request's deepest node (the recurrent and the conv
  state). The commit is timed each way an engine can run it (`GDN_ROUNDS`), and the cheapest counts, named
  per point as ``gdn_round``: a one-layer commit after the layer (`gdn_tree_commit`), the layer with its
  conv commit plus its share of one `tree_commit_layers` launch for all of the model's GDN layers, or the
  folded verify (the previous round's commit inside this round's `tree_verify`, two result buffers
  alternating, then the conv commit). With ``serial`` the same layer through `serial_verify` and a copy of one
  state per request (what a snapshot engine's commit costs) is timed beside it;
- attention layer: q (with its output gate), k, v projections, attention of each request's tree tokens
  over a KV context of ``context`` tokens and over their own tree ancestors, as engines run it
  (`bole_tune.tree_attention`: the exact prefix/tree split merged by log-sum-exp, or FlexAttention;
  each requested method is timed and the fastest counts, named per point as ``attention_kernel``),
  output projection, FFN;
- MoE FFN: router, then the experts N tokens with top-k routing touch (expected count under uniform
  routing) as one batched product over exactly those experts' weights, plus the shared expert;
- LM head over the N tokens.

The step is ``gdn_layers * gdn + attention_layers * attention + lm_head``: the model is never held
whole, so every model fits one GPU; the database records this method. Tree size 1 is plain decoding.
The drafter's cost is read off the same points (an MTP draft step is one decoder layer and the LM head
over the tokens it drafts: ``attention_us`` and ``lm_head_us`` at that many tokens per request).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from bole_tune import database
from bole_tune.fingerprint import fingerprint
from bole_tune.gdn_layer import GDNLayerParams, gdn_tree_commit, gdn_tree_step
from bole_tune.config import RING_ROUNDS, SHORT_RING_ROUNDS
from bole_tune.kernels import (PLANNER, LayerResults, PendingCommit, PendingPaths, PendingRing, gdn_gates,
                               serial_verify, tree_commit_layers, tree_conv, tree_conv_commit, tree_verify)
from bole_tune.kernels.verify.gluon import gluon_ring_rounds
from bole_tune.profiler import FLUSH_SECONDS, provenance
from bole_tune.profiles import DEFAULT_MODELS, ModelProfile, resolve_model
from bole_tune.timing import time_launches
from bole_tune.tree_attention import METHODS as ATTENTION_METHODS
from bole_tune.tree_attention import flex_block_mask, tree_attention
from bole_tune.workloads import make_inputs, make_tree

METHOD = ("one GDN layer round (conv, gates, tree_verify with the tuned configs, commit: the cheapest of a one-layer "
          "commit, the share of one commit launch for all GDN layers, the folded verify, and a ring of pending "
          "rounds), one attention layer "
          "(tree attention as engines run it: the fastest of the methods timed) each with its FFN, and the LM "
          "head, each a CUDA graph timed with events (median of replays); "
          "step = gdn_layers x GDN + attention_layers x attention + LM head")
SERIAL_MAX_TREE = 64  # serial_verify's snapshots make larger trees slow to time and say nothing new

GDN_ROUNDS = ("verify + commit", "verify + all-layer commit", "folded", "ring", f"ring of {SHORT_RING_ROUNDS}")
"""The ways a GDN layer's round is timed (`StepModel.gdn_round_us`); a point's ``gdn_us`` is the cheapest:
``verify + commit`` the layer then `gdn_tree_commit` (one-layer recurrent commit and conv commit);
``verify + all-layer commit`` the layer with its conv commit, plus one `tree_commit_layers` launch over all of the
model's GDN layers divided by their number; ``folded`` the layer whose `tree_verify` commits the previous round's
path first (``pending``), then its conv commit; ``ring`` the layer reading its state through a `PendingRing` of
`RING_ROUNDS` rounds of pending paths (``ring``), then its conv commit, over a cycle: ``((R - 1) read rounds + one
write round) / R`` plus the ring's table update (once per round for every layer) divided by the layers; ``ring of 2``
the same with a ring of `SHORT_RING_ROUNDS` rounds (``PendingRing(..., rounds=2, ...)``). Where a point's ring rounds
run on the Gluon verify and its tables take fewer than `RING_ROUNDS` rounds of its paths (9-node paths: three), that
ring is timed too, as ``ring of 3`` (`StepModel.ring_ways`): the ring an engine and `bole-tune bench` keep there."""


@dataclass(frozen=True)
class StepPoint:
    batch: int
    tree_size: int  # nodes per request (1 = no speculation)
    gdn_us: float  # one GDN layer's round: verify and commit, the cheapest way (`GDN_ROUNDS`)
    gdn_serial_us: float | None
    attention_us: float
    lm_head_us: float
    step_us: float
    step_serial_us: float | None
    attention_kernel: str = ""
    attention_methods_us: dict | None = None
    gdn_round: str = ""  # which of `GDN_ROUNDS` gdn_us is
    gdn_rounds_us: dict | None = None  # each way timed

    @property
    def tokens(self) -> int:
        return self.batch * self.tree_size

    def as_dict(self) -> dict:
        d = {"batch": self.batch, "tree_size": self.tree_size, "tokens": self.tokens,
             "gdn_us": round(self.gdn_us, 2), "attention_us": round(self.attention_us, 2),
             "lm_head_us": round(self.lm_head_us, 2), "step_us": round(self.step_us, 2),
             "attention_kernel": self.attention_kernel}
        if self.gdn_serial_us is not None:
            d["gdn_serial_us"] = round(self.gdn_serial_us, 2)
            d["step_serial_us"] = round(self.step_serial_us, 2)
        if self.gdn_round:
            d["gdn_round"] = self.gdn_round
        if self.gdn_rounds_us:
            d["gdn_rounds_us"] = {k: round(v, 2) for k, v in self.gdn_rounds_us.items()}
        if self.attention_methods_us:  # each method timed: its p50, or why it could not run
            d["attention_methods_us"] = {k: round(v, 2) if isinstance(v, float) else v
                                         for k, v in self.attention_methods_us.items()}
        return d


def experts_touched(tokens: int, num_experts: int, top_k: int) -> int:
    """Expected distinct experts ``tokens`` tokens reach with top-k routing spread uniformly."""
    return max(top_k, min(num_experts, round(num_experts * (1 - (1 - top_k / num_experts) ** tokens))))


class _Weights:
    """Random bf16 weights of one GDN layer, one attention layer, their FFNs and the LM head."""

    def __init__(self, model: ModelProfile, device, dtype=torch.bfloat16):
        g = torch.Generator(device=device).manual_seed(0)
        h = model.hidden_size

        def w(rows, cols):
            return torch.randn(rows, cols, generator=g, device=device, dtype=dtype) * (rows ** -0.5)

        hk, hv, dk, dv = model.gdn.hk, model.gdn.hv, model.gdn.dk, model.gdn.dv
        a = model.attention
        self.gdn_in = w(h, 2 * hk * dk + 2 * hv * dv)
        self.gdn_gates = w(h, 2 * hv)
        self.gdn_out = w(hv * dv, h)
        self.attn_q = w(h, 2 * a.num_heads * a.head_dim)  # query and its output gate
        self.attn_kv = w(h, 2 * a.num_kv_heads * a.head_dim)
        self.attn_out = w(a.num_heads * a.head_dim, h)
        f = model.ffn
        if f.kind == "dense":
            self.ffn_up = w(h, 2 * f.intermediate_size)
            self.ffn_down = w(f.intermediate_size, h)
        else:
            self.router = w(h, f.num_experts)
            self.experts_up = torch.randn(f.num_experts, h, 2 * f.expert_intermediate_size, generator=g,
                                          device=device, dtype=dtype) * h ** -0.5
            self.experts_down = torch.randn(f.num_experts, f.expert_intermediate_size, h, generator=g,
                                            device=device, dtype=dtype) * f.expert_intermediate_size ** -0.5
            self.shared_up = w(h, 2 * f.shared_intermediate_size)
            self.shared_down = w(f.shared_intermediate_size, h)
        self.lm_head = w(h, model.vocab_size)


def _rms(x):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


def _ffn(x, model: ModelProfile, wt: _Weights):
    f = model.ffn
    if f.kind == "dense":
        gate, up = (x @ wt.ffn_up).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ wt.ffn_down
    tokens = x.shape[0]
    x @ wt.router  # routing scores (their top-k is data dependent; its cost is the product)
    touched = experts_touched(tokens, f.num_experts, f.top_k)
    per_expert = math.ceil(tokens * f.top_k / touched)
    routed = x[torch.arange(touched * per_expert, device=x.device) % tokens].view(touched, per_expert, -1)
    gate, up = torch.bmm(routed, wt.experts_up[:touched]).chunk(2, dim=-1)
    y = torch.bmm(F.silu(gate) * up, wt.experts_down[:touched])
    out = y.view(-1, x.shape[1])[:tokens]
    shared_gate, shared_up = (x @ wt.shared_up).chunk(2, dim=-1)
    return out + (F.silu(shared_gate) * shared_up) @ wt.shared_down


class StepModel:
    """The layer groups of one model at one (batch, tree size), ready to be captured and timed."""

    def __init__(self, model: ModelProfile, batch: int, tree_size: int, weights: _Weights, context: int, device,
                 max_depth: int = 8):
        self.model, self.wt, self.device = model, weights, torch.device(device)
        self.heads = h = model.gdn
        self.tree = make_tree([tree_size] * batch, max_depth=max_depth, seed=1, device=device)
        n = self.tree.num_nodes
        g = torch.Generator(device=device).manual_seed(2)
        self.x = torch.randn(n, model.hidden_size, generator=g, device=device, dtype=torch.bfloat16)
        self.params = GDNLayerParams(
            conv_weight=torch.randn(2 * h.hk * h.dk + h.hv * h.dv, model.conv_width, generator=g, device=device,
                                    dtype=torch.bfloat16) * 0.5,
            a_log=torch.rand(h.hv, generator=g, device=device) * 2, dt_bias=torch.randn(h.hv, generator=g, device=device),
            heads=h)
        self.state = make_inputs(self.tree, h.hk, h.hv, h.dk, h.dv, torch.bfloat16, device, num_slots=batch).state
        self.snapshot = self.state.clone()  # the serial engine's commit copies one snapshot per request
        self.conv_state = torch.randn(batch, self.params.channels, model.conv_width - 1, generator=g, device=device,
                                      dtype=torch.bfloat16)
        self.slots = torch.arange(batch, dtype=torch.int32, device=device)
        depths, offsets = self.tree.node_depth.tolist(), self.tree.offsets.tolist()
        self.accepted = torch.tensor([max(range(tree_size), key=lambda i: depths[offsets[r] + i]) for r in range(batch)],
                                     dtype=torch.int32, device=device)  # the deepest node: the longest commit
        a = model.attention
        self.k_cache = torch.randn(batch, a.num_kv_heads, context, a.head_dim, generator=g, device=device,
                                   dtype=torch.bfloat16)
        self.v_cache = torch.randn_like(self.k_cache)
        self.tree_mask = torch.stack([self.tree.ancestor_mask(r, self.device) for r in range(batch)])  # [B, T, T]
        self._block_mask = None
        self._folds, self._paths = None, None  # `gdn_folded_rounds`' result buffers and paths, made on first use

    def gdn_layer(self, verify: str = "bole", commit: str = "layer", out=None, pending=None, ring=None) -> torch.Tensor:
        """One GDN layer's round: ``verify`` "bole" (the tree step and its commit) or "serial". ``commit`` (bole):
        "layer" commits the recurrent and the conv state after the layer (`gdn_tree_commit`), "conv" the conv
        state alone (the recurrent one is committed by the all-layer launch or the next round's fold); ``out``
        ``pending`` and ``ring`` go to `gdn_tree_step`."""
        h, n = self.heads, self.x.shape[0]
        channels = self.params.channels
        x = _rms(self.x)
        proj = x @ self.wt.gdn_in
        mixed, z = proj[:, :channels], proj[:, channels:]
        b, a = (x @ self.wt.gdn_gates).chunk(2, dim=-1)
        if verify == "bole":
            step = gdn_tree_step(mixed, a, b, self.params, self.state, self.conv_state, self.slots, self.tree,
                                 validate=False, out=out, pending=pending, ring=ring)
            if commit == "layer":
                gdn_tree_commit(self.state, self.conv_state, self.slots, step, self.accepted, validate=False)
            elif commit == "conv":
                tree_conv_commit(self.conv_state, self.slots, step.conv_inputs, self.tree, self.accepted,
                                 validate=False)
            else:
                raise ValueError(f"commit: expected 'layer' or 'conv', got {commit!r}")
            core = step.o
        elif verify == "serial":
            activated = tree_conv(mixed, self.conv_state, self.params.conv_weight, self.slots, self.tree, "silu",
                                  validate=False)
            key_width = h.hk * h.dk
            g, beta = gdn_gates(a, b, self.params.a_log, self.params.dt_bias, validate=False)
            res = serial_verify(activated[:, :key_width].view(n, h.hk, h.dk),
                                activated[:, key_width:2 * key_width].view(n, h.hk, h.dk),
                                activated[:, 2 * key_width:].view(n, h.hv, h.dv), g, beta, self.state, self.slots,
                                self.tree, validate=False)
            self.state.copy_(self.snapshot)
            core = res.o
        else:
            raise ValueError(f"verify: expected 'bole' or 'serial', got {verify!r}")
        o = _rms(core.reshape(n, h.hv * h.dv)) * F.silu(z)
        y = self.x + o @ self.wt.gdn_out
        return y + _ffn(_rms(y), self.model, self.wt)

    def gdn_folded_rounds(self) -> torch.Tensor:
        """Two consecutive rounds of the layer, each `tree_verify` committing the previous round's path of each
        request first, the results alternating between two buffers as an engine keeps them (each verify marks
        its own result uncommitted, so every replay folds again, with no reset in between)."""
        first, second = self._fold_buffers()
        self.gdn_layer(commit="conv", out=first, pending=PendingCommit(self._paths, second))
        return self.gdn_layer(commit="conv", out=second, pending=PendingCommit(self._paths, first))

    def _fold_buffers(self):
        """The two result buffers the folded rounds alternate between, the second holding a verified round."""
        if self._folds is None:
            stacked = LayerResults.empty(2, self.tree, self.heads, torch.bfloat16, self.device)
            self._folds = (stacked.layer(0, self.tree), stacked.layer(1, self.tree))
            self._paths = PendingPaths.between_rounds(self.tree, self.accepted, self.slots, self.slots,
                                                      self.state.shape[0])
            self.gdn_layer(commit="conv", out=self._folds[1])  # a verified previous round to fold first
        return self._folds

    def gdn_round_us(self, repeats: int) -> dict[str, float]:
        """The layer's round timed each way of `GDN_ROUNDS` (p50, us per layer and round)."""
        def time(fn, per: int = 1) -> float:
            return time_launches(lambda _: fn(), 1, self.device, repeats=repeats).p50_us / per

        ways = {"verify + commit": time(lambda: self.gdn_layer("bole", "layer"))}
        layers = max(1, self.model.num_gdn_layers)
        with _AllLayerCommit(self, layers) as commit:
            ways["verify + all-layer commit"] = time(lambda: self.gdn_layer("bole", "conv")) + time(commit, layers)
        ways["folded"] = time(self.gdn_folded_rounds, 2)
        for name, rounds in self.ring_ways().items():
            ways[name] = self.gdn_ring_round_us(time, layers, rounds)
        return ways

    def ring_ways(self) -> dict[str, int]:
        """The rings the layer's round is timed with, name -> rounds: ``ring`` (`RING_ROUNDS`), ``ring of 2``
        (`SHORT_RING_ROUNDS`), and where the planner runs this point's ring rounds on the Gluon verify and that
        kernel's tables take fewer than `RING_ROUNDS` rounds of its paths (`gluon.gluon_ring_rounds`: three for the
        9-node paths of trees of depth 8, whose ring of four only the slower Triton kernel runs), that ring too, as
        ``ring of 3``: the ring an engine keeps there, and the one `bole-tune bench` times (`CaseBench.ring_rounds`)."""
        ways = {"ring": RING_ROUNDS, f"ring of {SHORT_RING_ROUNDS}": SHORT_RING_ROUNDS}
        rounds = gluon_ring_rounds(self.tree.depth + 1, RING_ROUNDS)
        if 0 < rounds < RING_ROUNDS and rounds not in ways.values() and self.ring_on_gluon():
            ways[f"ring of {rounds}"] = rounds
        return ways

    def ring_on_gluon(self) -> bool:
        """Whether the planner runs this point's ring rounds on the Gluon verify (an sm_90 GPU, the bucket's
        launch resident on 64-row trees; `Planner.plan` with ``ring=True``)."""
        tree = self.tree
        return PLANNER.plan(self.heads, torch.bfloat16, num_requests=tree.num_requests,
                            max_tree_size=tree.max_tree_size, depth=tree.depth, device=self.device, ring=True).gluon

    def gdn_ring_round_us(self, time, layers: int, rounds: int = RING_ROUNDS) -> float:
        """The layer's round with a `PendingRing` of ``rounds`` rounds, each request accepting its deepest node: a
        read round timed with the tables holding ``rounds - 1`` rounds (the fullest a read round sees), the write
        round with ``rounds``, and the table update once; ``((R - 1) read + write) / R + update / layers``."""
        tree, slots, accepted = self.tree, self.slots, self.accepted
        ring = PendingRing(self.state.shape[0], rounds, tree.depth + 1, tree.num_nodes, tree.num_requests, self.device)
        arena = ring.results(self.heads, torch.bfloat16)

        def layer():
            return self.gdn_layer(commit="conv", ring=ring.begin(tree).layer(arena))

        for _ in range(rounds - 1):
            step = ring.begin(tree)
            self.gdn_layer(commit="conv", ring=step.layer(arena))
            ring.end(step, slots, accepted, validate=False)
        read = time(layer)
        step = ring.begin(tree)
        ring.end(step, slots, accepted, validate=False)  # R rounds held: the next round writes
        write = time(layer)
        step = ring.begin(tree)
        update = time(lambda: ring.end(step, slots, accepted, validate=False))
        return ((rounds - 1) * read + write) / rounds + update / layers

    def attention_layer(self, method: str = "split") -> torch.Tensor:
        """One attention layer and its FFN, the tree attention by ``method`` (`bole_tune.tree_attention`)."""
        a = self.model.attention
        batch, size = self.tree_mask.shape[:2]
        x = _rms(self.x)
        q, gate = (x @ self.wt.attn_q).chunk(2, dim=-1)
        k, v = (x @ self.wt.attn_kv).chunk(2, dim=-1)
        q = q.view(batch, size, a.num_heads, a.head_dim).transpose(1, 2)
        k = k.view(batch, size, a.num_kv_heads, a.head_dim).transpose(1, 2)
        v = v.view(batch, size, a.num_kv_heads, a.head_dim).transpose(1, 2)
        if method == "flex" and self._block_mask is None:
            self._block_mask = flex_block_mask(self.tree_mask, self.k_cache.shape[2], a.num_heads)
        out = tree_attention(q, self.k_cache, self.v_cache, k, v, self.tree_mask, method=method,
                             block_mask=self._block_mask)
        out = out.transpose(1, 2).reshape(batch * size, -1) * torch.sigmoid(gate)
        y = self.x + out @ self.wt.attn_out
        return y + _ffn(_rms(y), self.model, self.wt)

    def lm_head(self) -> torch.Tensor:
        return _rms(self.x) @ self.wt.lm_head


class _AllLayerCommit:
    """One `tree_commit_layers` launch over ``layers`` layers' pools (each request's deepest node), ready to time:
    the stacked pools and each layer's verified results, made on entering the ``with`` and freed on leaving it."""

    def __init__(self, m: StepModel, layers: int):
        self.m, self.layers = m, layers

    def __enter__(self):
        m = self.m
        h, tree = m.heads, m.tree
        self.states = m.state.unsqueeze(0).repeat(self.layers, 1, 1, 1, 1)  # [L, B, Hv, dv, dk]
        self.results = LayerResults.empty(self.layers, tree, h, torch.bfloat16, m.device)
        n = tree.num_nodes
        g = torch.Generator(device=m.device).manual_seed(3)
        q, k = (torch.randn(n, h.hk, h.dk, generator=g, device=m.device, dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(n, h.hv, h.dv, generator=g, device=m.device, dtype=torch.bfloat16)
        gate = -torch.rand(n, h.hv, generator=g, device=m.device)
        beta = torch.rand(n, h.hv, generator=g, device=m.device)
        for layer in range(self.layers):
            tree_verify(q, k, v, gate, beta, self.states[layer], m.slots, tree, validate=False,
                        out=self.results.layer(layer, tree))
        return self

    def __call__(self):
        self.results.committed.zero_()  # every replay commits (a result's paths are committed once)
        tree_commit_layers(self.states, self.m.slots, self.results, self.m.tree, self.m.accepted, validate=False)

    def __exit__(self, *exc):
        del self.states, self.results
        return False


def measure_step_curve(model: ModelProfile, batches, tree_sizes, context: int = 4096, device="cuda",
                       repeats: int = 20, serial: bool = True, attention=("split",), progress=None) -> list[StepPoint]:
    """Step latency at every (batch, tree size); tree size 1 is plain decoding. ``attention``: the tree
    attention methods to time (the fastest counts); ``serial``: also time the layer through serial_verify
    (trees of at most `SERIAL_MAX_TREE` nodes)."""
    unknown = [m for m in attention if m not in ATTENTION_METHODS]
    if unknown or not attention:
        raise ValueError(f"attention: expected some of {ATTENTION_METHODS}, got {list(attention)!r}")
    weights = _Weights(model, device)
    points = []
    for batch in batches:
        for size in tree_sizes:
            m = StepModel(model, batch, size, weights, context, device)
            rounds = m.gdn_round_us(repeats)
            gdn_round = min(rounds, key=rounds.get)
            gdn = rounds[gdn_round]
            gdn_serial = None
            if serial and 1 < size <= SERIAL_MAX_TREE:
                gdn_serial = time_launches(lambda _: m.gdn_layer("serial"), 1, device, repeats=repeats).p50_us
            methods, failed = {}, {}
            for name in attention:
                try:
                    methods[name] = time_launches(lambda _: m.attention_layer(name), 1, device, repeats=repeats).p50_us
                except Exception as error:  # a method without a kernel for this shape (FlexAttention at head dim 256)
                    if len(attention) == 1:
                        raise
                    failed[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
            if not methods:
                raise RuntimeError(f"no tree attention method ran at B={batch} T={size}: {failed}")
            kernel = min(methods, key=methods.get)
            lm = time_launches(lambda _: m.lm_head(), 1, device, repeats=repeats).p50_us
            others = model.num_attention_layers * methods[kernel] + lm
            step = model.num_gdn_layers * gdn + others
            step_serial = model.num_gdn_layers * gdn_serial + others if gdn_serial is not None else None
            points.append(StepPoint(batch, size, gdn, gdn_serial, methods[kernel], lm, step, step_serial, kernel,
                                    {**methods, **failed} if len(attention) > 1 else None, gdn_round, rounds))
            if progress:
                progress(model, batch, size, points[-1])
            del m
    return points


STEP_BATCHES = (1, 2, 4, 8, 16, 32)
STEP_TREE_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


@dataclass
class StepResult:
    """What `measure_and_store` measured and where it wrote it."""

    slug: str
    device_name: str
    path: Path
    on_gpu: bool
    points: dict = field(default_factory=dict)  # model name -> [StepPoint]
    notes: list[str] = field(default_factory=list)


def step_curve_entry(model: ModelProfile, points: list[StepPoint], context: int, fp) -> dict:
    """The database entry (``step_curves.<model>/bf16``) of one model's measured points."""
    return {"model": model.name, "dtype": "bf16", "context": context,
            "layers": {"gdn": model.num_gdn_layers, "attention": model.num_attention_layers},
            "measured_by": "layer groups, summed", "points": [p.as_dict() for p in points],
            "provenance": provenance(fp, METHOD)}


def measure_and_store(models=None, batches=None, tree_sizes=None, context: int = 4096,
                      repeats: int = 20, serial: bool = True, attention=("split",), db_dir=None,
                      replace_corrupt: bool = False,
                      progress=None, checkpoint_s: float = FLUSH_SECONDS) -> StepResult:
    """Measure the verification step of each model (`DEFAULT_MODELS` when None; names or profiles) on this
    machine's GPU, or its CPU without one, and store each model's curve in ``<db_dir>/<gpu>.yaml`` as soon
    as it is measured. ``progress(model, batch, tree_size, point)`` after each point. ``batches``,
    ``tree_sizes``: default `STEP_BATCHES`, `STEP_TREE_SIZES`.

    While a model is measured, the points measured so far are written every ``checkpoint_s`` seconds (merged
    into the stored curve by (batch, tree size), `database.merge_points`: the old curve's other points stay,
    each point naming the run that measured it), so a run that is killed or runs out of time keeps what it
    measured up to its last write; the finished curve replaces them all."""
    batches, tree_sizes = batches or STEP_BATCHES, tree_sizes or STEP_TREE_SIZES
    profiles = [resolve_model(m) if isinstance(m, str) else m for m in (models or DEFAULT_MODELS)]
    if context < 1:
        raise ValueError("--context: must be positive")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fp = fingerprint(device)
    path = database.database_path(fp.slug, db_dir)
    result = StepResult(fp.slug, fp.name, path, on_gpu=device == "cuda")
    note = database.prepare(path, replace_corrupt)
    if note:
        result.notes.append(note)
    if device == "cpu":
        result.notes.append("No CUDA GPU: timed the layers on the CPU with the wall clock; these numbers say "
                            "nothing about a GPU's step.")

    def store(model, points) -> None:
        database.update(path, device=fp.as_dict(), step_curves={f"{model.name}/bf16":
                                                                step_curve_entry(model, points, context, fp)})

    for model in profiles:
        measured, written = [], [time.monotonic()]

        def keep(m, batch, size, point):
            measured.append(point)
            if time.monotonic() - written[0] >= checkpoint_s:
                store(model, measured)
                written[0] = time.monotonic()
            if progress:
                progress(m, batch, size, point)

        points = measure_step_curve(model, batches, tree_sizes, context, device, repeats, serial=serial,
                                    attention=attention, progress=keep)
        store(model, points)
        result.points[model.name] = points
    return result
