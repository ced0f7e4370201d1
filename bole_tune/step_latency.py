"""Latency of a whole verification step of the target model, measured on the GPU by layer groups.

One GDN layer, one full-attention layer (each with its FFN, dense or mixture of experts) and the LM
head are built at the model's real shapes with random bf16 weights and timed, each as one CUDA
graph, for N verified tokens at batch B (every request a tree of N / B nodes):

- GDN layer: input projections (q, k, v, z and the b, a gates), SiLU, tree_verify with the tuned config
  (or serial_verify, to show what it costs), gated RMS norm, output projection, FFN;
- attention layer: q (with its output gate), k, v projections, attention of each request's nodes over a
  KV context of ``context`` tokens plus the tree's ancestors (tree mask), output projection, FFN; the
  masked attention is timed through two PyTorch formulations and the faster counts (see
  `StepModel.attention_layer`), since PyTorch has no tree-attention kernel of its own;
- MoE FFN: router, then the experts N tokens with top-k routing touch (expected count under uniform
  routing) as one batched product over exactly those experts' weights, plus the shared expert;
- LM head over the N tokens.

The step is ``gdn_layers * gdn + attention_layers * attention + lm_head``: the model is never held
whole, so every model fits one GPU; the database records this method.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from bole_tune import database
from bole_tune.fingerprint import fingerprint
from bole_tune.kernels import serial_verify, tree_verify
from bole_tune.profiler import provenance
from bole_tune.profiles import DEFAULT_MODELS, ModelProfile, resolve_model
from bole_tune.timing import time_launches
from bole_tune.workloads import make_inputs, make_tree

METHOD = ("one GDN layer, one attention layer (each with its FFN; the faster of two masked-attention calls) and "
          "the LM head, each a CUDA graph timed with events (median of replays); "
          "step = gdn_layers x GDN + attention_layers x attention + LM head")
ATTENTION_VARIANTS = ("gqa", "grouped")


@dataclass(frozen=True)
class StepPoint:
    batch: int
    tree_size: int  # nodes per request (1 = no speculation)
    gdn_us: float
    gdn_serial_us: float | None
    attention_us: float
    lm_head_us: float
    step_us: float
    step_serial_us: float | None
    attention_variants_us: dict | None = None

    @property
    def tokens(self) -> int:
        return self.batch * self.tree_size

    def as_dict(self) -> dict:
        d = {"batch": self.batch, "tree_size": self.tree_size, "tokens": self.tokens,
             "gdn_us": round(self.gdn_us, 2), "attention_us": round(self.attention_us, 2),
             "lm_head_us": round(self.lm_head_us, 2), "step_us": round(self.step_us, 2)}
        if self.gdn_serial_us is not None:
            d["gdn_serial_us"] = round(self.gdn_serial_us, 2)
            d["step_serial_us"] = round(self.step_serial_us, 2)
        if self.attention_variants_us:
            d["attention_variants_us"] = {k: round(v, 2) for k, v in self.attention_variants_us.items()}
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
        hk, hv, dk, dv = h.hk, h.hv, h.dk, h.dv
        self.tree = make_tree([tree_size] * batch, max_depth=max_depth, seed=1, device=device)
        n = self.tree.num_nodes
        g = torch.Generator(device=device).manual_seed(2)
        self.x = torch.randn(n, model.hidden_size, generator=g, device=device, dtype=torch.bfloat16)
        self.state = make_inputs(self.tree, hk, hv, dk, dv, torch.bfloat16, device, num_slots=batch).state
        self.slots = torch.arange(batch, dtype=torch.int32, device=device)
        a = model.attention
        self.k_cache = torch.randn(batch, a.num_kv_heads, context, a.head_dim, generator=g, device=device,
                                   dtype=torch.bfloat16)
        self.v_cache = torch.randn_like(self.k_cache)
        self.mask = self._attention_mask(batch, tree_size, context)
        group = a.num_heads // a.num_kv_heads
        # additive mask, rows repeated for the grouped query heads: [B, 1, group * T, context + T]
        self.grouped_mask = torch.zeros(self.mask.shape, dtype=torch.bfloat16, device=device).masked_fill(
            ~self.mask, float("-inf")).repeat(1, 1, group, 1)

    def _attention_mask(self, batch, size, context):
        masks = [self.tree.ancestor_mask(r, self.device) for r in range(batch)]
        tree_part = torch.stack(masks)  # [B, T, T]
        full = torch.ones(batch, size, context + size, dtype=torch.bool, device=self.device)
        full[:, :, context:] = tree_part
        return full[:, None]  # [B, 1, T, context + T]

    def gdn_layer(self, verify) -> torch.Tensor:
        hk, hv, dk, dv = self.heads.hk, self.heads.hv, self.heads.dk, self.heads.dv
        n = self.x.shape[0]
        x = _rms(self.x)
        proj = F.silu(x @ self.wt.gdn_in)
        q, k, v, z = torch.split(proj, [hk * dk, hk * dk, hv * dv, hv * dv], dim=-1)
        b, a = (x @ self.wt.gdn_gates).chunk(2, dim=-1)
        beta = torch.sigmoid(b.float())
        g = -F.softplus(a.float())
        res = verify(q.view(n, hk, dk), k.view(n, hk, dk), v.view(n, hv, dv), g, beta, self.state, self.slots,
                     self.tree, validate=False)
        o = _rms(res.o.reshape(n, hv * dv)) * F.silu(z)
        y = self.x + o @ self.wt.gdn_out
        return y + _ffn(_rms(y), self.model, self.wt)

    def attention_layer(self, variant: str = "grouped") -> torch.Tensor:
        """One attention layer and its FFN. ``variant``: how the masked attention is called.

        "grouped": the query heads of a key head become extra query rows ``[B, kv, group * T, hd]`` with
        an additive mask (PyTorch's memory-efficient kernel, flat in T); "gqa": one call with
        ``enable_gqa`` and a boolean mask (PyTorch's math kernel, fastest for T = 1). The step takes
        the faster: an engine runs its best attention kernel for each shape.
        """
        a = self.model.attention
        batch, size = self.mask.shape[0], self.mask.shape[2]
        group = a.num_heads // a.num_kv_heads
        x = _rms(self.x)
        q, gate = (x @ self.wt.attn_q).chunk(2, dim=-1)
        k, v = (x @ self.wt.attn_kv).chunk(2, dim=-1)
        k = k.view(batch, size, a.num_kv_heads, a.head_dim).transpose(1, 2)
        v = v.view(batch, size, a.num_kv_heads, a.head_dim).transpose(1, 2)
        keys = torch.cat([self.k_cache, k], dim=2)
        values = torch.cat([self.v_cache, v], dim=2)
        if variant == "grouped":
            q = q.view(batch, size, a.num_kv_heads, group, a.head_dim).permute(0, 2, 3, 1, 4)
            q = q.reshape(batch, a.num_kv_heads, group * size, a.head_dim)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=self.grouped_mask)
            out = out.view(batch, a.num_kv_heads, group, size, a.head_dim).permute(0, 3, 1, 2, 4)
        elif variant == "gqa":
            q = q.view(batch, size, a.num_heads, a.head_dim).transpose(1, 2)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, enable_gqa=True)
            out = out.transpose(1, 2)
        else:
            raise ValueError(f"variant: expected 'grouped' or 'gqa', got {variant!r}")
        out = out.reshape(batch * size, -1) * torch.sigmoid(gate)
        y = self.x + out @ self.wt.attn_out
        return y + _ffn(_rms(y), self.model, self.wt)

    def lm_head(self) -> torch.Tensor:
        return _rms(self.x) @ self.wt.lm_head


def measure_step_curve(model: ModelProfile, batches, tree_sizes, context: int = 4096, device="cuda",
                       repeats: int = 20, serial: bool = True, progress=None) -> list[StepPoint]:
    """Step latency at every (batch, tree size); tree size 1 is plain decoding."""
    weights = _Weights(model, device)
    points = []
    for batch in batches:
        for size in tree_sizes:
            m = StepModel(model, batch, size, weights, context, device)
            gdn = time_launches(lambda _: m.gdn_layer(tree_verify), 1, device, repeats=repeats).p50_us
            gdn_serial = None
            if serial and size > 1:
                gdn_serial = time_launches(lambda _: m.gdn_layer(serial_verify), 1, device, repeats=repeats).p50_us
            variants = {name: time_launches(lambda _: m.attention_layer(name), 1, device, repeats=repeats).p50_us
                        for name in ATTENTION_VARIANTS}
            attention = min(variants.values())
            lm = time_launches(lambda _: m.lm_head(), 1, device, repeats=repeats).p50_us
            others = model.num_attention_layers * attention + lm
            step = model.num_gdn_layers * gdn + others
            step_serial = model.num_gdn_layers * gdn_serial + others if gdn_serial is not None else None
            points.append(StepPoint(batch, size, gdn, gdn_serial, attention, lm, step, step_serial, variants))
            if progress:
                progress(model, batch, size, points[-1])
            del m
    return points


STEP_BATCHES = (1, 2, 4, 8, 16, 32)
STEP_TREE_SIZES = (1, 4, 8, 16, 32, 64, 128)


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


def measure_and_store(models=None, batches=STEP_BATCHES, tree_sizes=STEP_TREE_SIZES, context: int = 4096,
                      repeats: int = 20, serial: bool = True, db_dir=None, replace_corrupt: bool = False,
                      progress=None) -> StepResult:
    """Measure the verification step of each model (`DEFAULT_MODELS` when None; names or profiles) on this
    machine's GPU, or its CPU without one, and store each model's curve in ``<db_dir>/<gpu>.yaml`` as soon
    as it is measured. ``progress(model, batch, tree_size, point)`` after each point."""
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
    for model in profiles:
        points = measure_step_curve(model, batches, tree_sizes, context, device, repeats, serial=serial,
                                    progress=progress)
        database.update(path, device=fp.as_dict(), step_curves={f"{model.name}/bf16":
                                                                step_curve_entry(model, points, context, fp)})
        result.points[model.name] = points
    return result
