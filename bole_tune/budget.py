"""The hardware-aware tree-token budget: per batch size, the draft shape an engine can build that maximises
tokens per second, and `get_budget`, the runtime's lookup of it.

For batch B and a shape verifying N tokens per request (N = 1: no speculation), the expected throughput is

    B * (1 + E[accepted]) / (step(B, N) + draft(B, shape))

``step`` is the measured latency of one verification step (`StepCurve`, from the database), E[accepted]
comes from an acceptance model (`bole_tune.acceptance`), and ``draft`` is the drafter the model profile
names (MTP: per draft step, ``layers`` full-attention decoder layers and the LM head over the tokens
that step runs, read off the same step curve's per-layer parts). The shapes searched are the ones the
engine executes (`bole_tune.draft_trees`): SGLang EAGLE beam trees of (num_steps, topk,
num_draft_tokens), vLLM chains of K, and for bole-tune's own verifier any tree (best-first) or chain.

**Buckets.** Budgets are computed at the step curve's measured batch sizes B_1 < ... < B_n. The entry of
B_i serves batch sizes B_(i-1) + 1 .. B_i (B_0 = 0; it is the largest batch it was chosen for), and the
entry of B_n also serves every batch above it: each entry's ``serves`` is [low, high] (high null for the
last). `get_budget` and the engine exports use exactly these ranges.

Database entries: section ``budgets``, named ``<Model>/<dtype>[/TP<n>]/<workload>/<engine>``.
"""

from __future__ import annotations

import bisect
import math
import operator
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bole_tune import database
from bole_tune.acceptance import DEFAULT_WORKLOAD, AcceptanceModel, list_acceptance_models, load_acceptance
from bole_tune.draft_trees import MAX_DEPTH, DraftTree, SGLangBeam, best_first_tree, chain_tree
from bole_tune.engines.exports import export_engine_settings
from bole_tune.fingerprint import fingerprint, slugify
from bole_tune.profiles import DrafterShape, ModelProfile, ProfileError, resolve_model

ENGINES = ("sglang", "vllm", "bole")
DEFAULT_ENGINE = "bole"
MAX_TOPK = 8  # SGLang's widest beam searched (its documented EAGLE examples use topk up to 8)
METHOD = ("per batch: the engine-buildable shape maximising B * (1 + E[accepted]) / (step + draft); step from the "
          "step curve (interpolated in tree size), draft = per drafter step (layers x attention_us + lm_head_us) at "
          "the tokens per request that step runs; E[accepted] from the acceptance profile")


ENGINE_GDN_ROUND = {"sglang": "verify + all-layer commit"}
"""The GDN round an engine's integration runs where it runs one way (`bole_tune.step_latency.GDN_ROUNDS`): bole-tune's
SGLang adapter verifies each layer and commits all of them in one launch. The other engines' budgets take the step
curve's cheapest way at each point (an engine of one's own can run any of them)."""


def _with_round(point: dict, gdn_layers: int, way: str) -> dict:
    """``point`` with its GDN layers' round taken ``way`` instead of the cheapest (unchanged where the point did not
    time that way: curves measured before the ways were)."""
    rounds = point.get("gdn_rounds_us") or {}
    if way not in rounds:
        return point
    return {**point, "step_us": point["step_us"] + gdn_layers * (rounds[way] - point["gdn_us"]), "gdn_us": rounds[way],
            "gdn_round": way}


class StepCurve:
    """Measured step latency (and its parts) of one model, interpolated in tree size per batch."""

    def __init__(self, points: list[dict], gdn_layers: int | None = None, gdn_round: str | None = None):
        """``gdn_round`` (with the model's ``gdn_layers``): the steps as an engine running that GDN round way
        would take them."""
        if not points:
            raise ValueError("step curve: no points")
        if gdn_round is not None and gdn_layers:
            points = [_with_round(p, gdn_layers, gdn_round) for p in points]
        self.by_batch: dict[int, list[dict]] = {}
        for p in points:
            self.by_batch.setdefault(int(p["batch"]), []).append(p)
        for pts in self.by_batch.values():
            pts.sort(key=lambda p: p["tree_size"])

    @property
    def batches(self) -> list[int]:
        return sorted(self.by_batch)

    def max_tree_size(self, batch: int) -> int:
        return self.by_batch[batch][-1]["tree_size"]

    def gdn_round(self, batch: int, tree_size: float) -> str | None:
        """The GDN round way of the measured point nearest ``tree_size`` at ``batch`` (None on older curves)."""
        nearest = min(self.by_batch[batch], key=lambda p: (abs(p["tree_size"] - tree_size), p["tree_size"]))
        return nearest.get("gdn_round")

    @classmethod
    def for_engine(cls, curve_entry: dict, engine: str) -> "StepCurve":
        """A step-curve entry (``step_curves.<model>/<dtype>``) as ``engine`` runs it (`ENGINE_GDN_ROUND`)."""
        layers = (curve_entry.get("layers") or {}).get("gdn")
        return cls(curve_entry["points"], layers, ENGINE_GDN_ROUND.get(engine))

    def value(self, batch: int, tree_size: float, field_name: str = "step_us") -> float:
        pts = self.by_batch[batch]
        sizes = [p["tree_size"] for p in pts]
        if tree_size <= sizes[0] or len(pts) == 1:
            return pts[0][field_name]
        i = min(bisect.bisect_left(sizes, tree_size), len(pts) - 1)
        lo, hi = pts[i - 1], pts[i]
        t = (tree_size - lo["tree_size"]) / (hi["tree_size"] - lo["tree_size"])
        return lo[field_name] + t * (hi[field_name] - lo[field_name])

    def drafter_step(self, batch: int, tokens_per_request: int, drafter: DrafterShape) -> float:
        """One MTP drafter step over ``tokens_per_request`` tokens of each of ``batch`` requests."""
        return (drafter.layers * self.value(batch, tokens_per_request, "attention_us")
                + self.value(batch, tokens_per_request, "lm_head_us"))


@dataclass(frozen=True)
class Shape:
    """One draft shape an engine can run: N verified tokens per request, what it is expected to accept,
    the tokens per request its drafter runs at each step, and the engine's settings for it."""

    engine: str
    nodes_per_request: int
    expected_accepted: float
    drafter_tokens: tuple[int, ...]
    settings: dict | None = None
    build: object = field(default=None, compare=False, repr=False)  # () -> DraftTree

    def tree(self) -> DraftTree:
        return self.build()


def _chains(model: AcceptanceModel, max_nodes: int, max_depth: int, engine: str):
    for k in range(1, min(max_depth, max_nodes - 1) + 1):
        tree = chain_tree(model, k)
        settings = {"vllm": {"num_speculative_tokens": k},
                    "sglang": {"speculative_num_steps": k, "speculative_eagle_topk": 1,
                               "speculative_num_draft_tokens": k + 1}}.get(engine)
        yield Shape(engine, k + 1, tree.expected_accepted, (1,) * k, settings, lambda t=tree: t)


def engine_shapes(engine: str, model: AcceptanceModel, max_nodes: int, max_depth: int = MAX_DEPTH) -> list[Shape]:
    """Every shape of at most ``max_nodes`` verified tokens per request that ``engine`` can run."""
    check_engine(engine)
    if engine == "vllm":
        return list(_chains(model, max_nodes, max_depth, engine))
    if engine == "bole":
        full = best_first_tree(model, max_nodes - 1, max_depth=max_depth)
        shapes = [Shape("bole", 1, 0.0, (), None, lambda: DraftTree((), (), ()))]
        for n in range(1, len(full.parents) + 1):
            tree = DraftTree(full.parents[:n], full.ranks[:n], full.probabilities[:n])
            shapes.append(Shape("bole", n + 1, tree.expected_accepted, tuple(tree.expanded_per_level()), None,
                                lambda t=tree: t))
        return shapes + list(_chains(model, max_nodes, max_depth, engine))
    shapes = list(_chains(model, max_nodes, max_depth, engine))
    for steps in range(1, max_depth + 1):
        for topk in range(2, MAX_TOPK + 1):
            beam = SGLangBeam(model, steps, topk)
            for n in range(2, min(max_nodes, beam.max_draft_tokens) + 1):
                settings = {"speculative_num_steps": steps, "speculative_eagle_topk": topk,
                            "speculative_num_draft_tokens": n}
                shapes.append(Shape("sglang", n, beam.expected_accepted(n), tuple(beam.drafter_tokens()), settings,
                                    lambda b=beam, n=n: b.tree(n)))
    return shapes


@dataclass(frozen=True)
class Evaluated:
    shape: Shape
    batch: int
    step_us: float
    draft_us: float

    @property
    def tokens_per_second(self) -> float:
        return self.batch * (1.0 + self.shape.expected_accepted) / ((self.step_us + self.draft_us) * 1e-6)


def evaluate(shape: Shape, curve: StepCurve, batch: int, drafter: DrafterShape) -> Evaluated:
    draft = sum(curve.drafter_step(batch, w, drafter) for w in shape.drafter_tokens)
    return Evaluated(shape, batch, curve.value(batch, shape.nodes_per_request), draft)


def plain(curve: StepCurve, batch: int) -> float:
    """Tokens per second without speculation."""
    return batch / (curve.value(batch, 1) * 1e-6)


def plan(engine: str, model: AcceptanceModel, curve: StepCurve, drafter: DrafterShape = DrafterShape(),
         max_depth: int = MAX_DEPTH) -> dict:
    """Per measured batch: the best shape, every shape's rate by N (``by_nodes``: the best shape at each N),
    and the best fixed chain (one K at every batch, the geometric mean of its rates the largest)."""
    shapes = engine_shapes(engine, model, max(curve.max_tree_size(b) for b in curve.batches), max_depth)
    per_batch = {}
    for batch in curve.batches:
        limit = curve.max_tree_size(batch)
        steps = [0.0] + [curve.value(batch, n) for n in range(1, limit + 1)]
        drafts = {}  # tokens per request -> one drafter step

        def draft(widths):
            for w in widths:
                if w not in drafts:
                    drafts[w] = curve.drafter_step(batch, w, drafter)
            return sum(drafts[w] for w in widths)

        rated = [Evaluated(s, batch, steps[s.nodes_per_request], draft(s.drafter_tokens)) for s in shapes
                 if s.nodes_per_request <= limit]
        if not rated:
            raise ValueError(f"step curve at batch {batch}: no tree size above 1, no {engine} shape fits")
        by_nodes = {}
        for e in rated:
            if e.shape.nodes_per_request not in by_nodes or e.tokens_per_second > by_nodes[e.shape.nodes_per_request]:
                by_nodes[e.shape.nodes_per_request] = e.tokens_per_second
        per_batch[batch] = {"best": max(rated, key=lambda e: e.tokens_per_second), "by_nodes": sorted(by_nodes.items())}
    chain_lengths = range(1, min(max_depth, min(curve.max_tree_size(b) for b in curve.batches) - 1) + 1)
    chains = {k: {b: evaluate(s, curve, b, drafter).tokens_per_second for b in curve.batches}
              for k, s in zip(chain_lengths, _chains(model, 10 ** 9, len(chain_lengths), "vllm"))}
    fixed = max(chains, key=lambda k: sum(math.log(r) for r in chains[k].values())) if chains else None
    for batch, info in per_batch.items():
        info["plain"] = plain(curve, batch)
        info["fixed_chain"] = chains[fixed][batch] if fixed else info["plain"]
    return {"fixed_chain": fixed or 0, "batches": per_batch}


def serves(batches) -> dict[int, list]:
    """The batch sizes each measured batch's entry serves (see the module's "Buckets")."""
    batches = sorted(batches)
    out = {}
    for i, b in enumerate(batches):
        low = batches[i - 1] + 1 if i else 1
        out[b] = [low, b if i < len(batches) - 1 else None]
    return out


def batch_entry(info: dict, served: list, engine: str, curve: StepCurve | None = None) -> dict:
    best: Evaluated = info["best"]
    shape, tree = best.shape, best.shape.tree()
    n = shape.nodes_per_request
    entry = {"batch": best.batch, "serves": served, "shape": "chain" if tree.width <= 1 else "tree",
             "nodes_per_request": n, "draft_tokens": n - 1, "tokens": best.batch * n, "depth": tree.depth,
             "width": tree.width, "parents": list(tree.parents), "ranks": list(tree.ranks)}
    if engine in ("sglang", "vllm"):
        entry[engine] = dict(shape.settings)
    rate = best.tokens_per_second
    entry.update({"expected_accepted": round(shape.expected_accepted, 4),
                  "expected_tokens_per_round": round(1 + shape.expected_accepted, 4),
                  "step_us": round(best.step_us, 2), "draft_us": round(best.draft_us, 2),
                  "tokens_per_second": round(rate, 1),
                  "speedup_vs_no_speculation": round(rate / info["plain"], 4),
                  "speedup_vs_fixed_chain": round(rate / info["fixed_chain"], 4)})
    way = curve.gdn_round(best.batch, n) if curve is not None else None
    if way:
        entry["gdn_round"] = way  # the GDN round the step was measured with: run it that way
    return entry


def build_budget(model_name: str, workload: AcceptanceModel, engine: str, curve_entry: dict,
                 drafter: DrafterShape = DrafterShape(), dtype: str = "bf16", tp: int = 1,
                 curve_name: str | None = None) -> dict:
    """The database entry of one (model, workload, engine) from the model's step-curve entry."""
    curve = StepCurve.for_engine(curve_entry, engine)
    result = plan(engine, workload, curve, drafter)
    ranges = serves(result["batches"])
    acceptance = {"name": workload.name, "sources": list(workload.sources)}
    if workload.variant:
        acceptance["variant"] = workload.variant
    return {"model": model_name, "dtype": dtype, "tp": tp, "workload": workload.name, "engine": engine,
            "acceptance": workload.as_dict(), "step_curve": curve_name or step_curve_name(model_name, dtype, tp),
            "drafter": {"kind": drafter.kind, "layers": drafter.layers}, "fixed_chain": result["fixed_chain"],
            "batches": {b: batch_entry(info, ranges[b], engine, curve) for b, info in result["batches"].items()},
            "provenance": {"date": database.now(), "step_curve_date": curve_entry.get("provenance", {}).get("date", ""),
                           "acceptance": acceptance, "method": METHOD}}


def check_engine(engine) -> str:
    if engine not in ENGINES:
        raise ValueError(f"engine: unknown {engine!r} (known: {', '.join(ENGINES)})")
    return engine


def check_workload(name) -> str:
    """A shipped acceptance profile's name, or an acceptance YAML file of one's own."""
    if not isinstance(name, str) or not (name in list_acceptance_models() or
                                         (name.endswith((".yaml", ".yml")) and Path(name).is_file())):
        raise ValueError(f"acceptance: unknown workload {name!r} (shipped: {', '.join(list_acceptance_models())}; "
                         "or an acceptance YAML file)")
    return name


def step_curve_name(model_name: str, dtype: str = "bf16", tp: int = 1) -> str:
    return f"{model_name}/{dtype}" + (f"/TP{tp}" if tp != 1 else "")


def budget_name(model_name: str, workload: str, engine: str, dtype: str = "bf16", tp: int = 1) -> str:
    return f"{step_curve_name(model_name, dtype, tp)}/{workload}/{engine}"


@dataclass
class BudgetResult:
    """What `store_budgets` chose and where it wrote it."""

    slug: str
    path: Path  # the database file written
    budgets: dict  # budget name -> database entry
    exported: list[Path] = field(default_factory=list)


def _drafter_of(name: str) -> DrafterShape:
    """The model profile's drafter; a model without a profile (a step curve measured from a YAML file of
    one's own) gets the default, one MTP layer."""
    try:
        return resolve_model(name).drafter
    except ProfileError:
        return DrafterShape()


def store_budgets(models=None, workloads=None, engines=None, slug: str | None = None, db_dir=None, export=None,
                  dtype: str = "bf16", tp: int = 1) -> BudgetResult:
    """Choose the budget per batch size of every (model, workload, engine) asked for, from the stored step
    curves, and store them all in one write; with ``export`` (a folder) write each engine's files.

    models: names or profiles (default: every model with a step curve). workloads: acceptance profile names
    (default: every shipped one). engines: of `ENGINES` (default: all). slug: the GPU (default: this
    machine's). Curves are read as `bole_tune.database.search` reads them (``db_dir``: that folder alone);
    the budgets go to ``<db_dir>/<slug>.yaml``, by default the user's database, never the shipped
    ``tuning_db/`` unless that folder is passed as ``db_dir``. Nothing is written if anything is missing.
    """
    workloads = [check_workload(w) for w in (workloads or list_acceptance_models())]
    engines = [check_engine(e) for e in (engines or ENGINES)]
    slug = slug or fingerprint().slug
    path = database.database_path(slug, db_dir)  # refuses the shipped tuning_db/ unless passed as db_dir
    found = database.search(slug, db_dir)
    if not found.files:
        raise LookupError(f"no tuning database for {slug}: {found.where} (run bole-tune step first)")
    curves = found.entries("step_curves")
    if models:
        names = [(m if isinstance(m, ModelProfile) else resolve_model(m)).name for m in models]
    else:
        names = sorted({c["model"] for n, c in curves.items() if n == step_curve_name(c["model"], dtype, tp)})
    budgets = {}
    for name in names:
        curve_name = step_curve_name(name, dtype, tp)
        if curve_name not in curves:
            raise LookupError(f"no step curve {curve_name} in {found.where} (run bole-tune step --model ... first)")
        for workload in workloads:
            acceptance = load_acceptance(workload, model=name)
            for engine in engines:
                budgets[budget_name(name, acceptance.name, engine, dtype, tp)] = build_budget(
                    name, acceptance, engine, curves[curve_name], _drafter_of(name), dtype, tp, curve_name)
    database.update(path, budgets=budgets)
    result = BudgetResult(slug, path, budgets)
    if export:
        for entry in budgets.values():
            if entry["engine"] != "bole":
                result.exported += list(export_engine_settings(entry, export))
    return result


# ---- the runtime lookup -------------------------------------------------------------------------

_cache: dict = {}
_slugs: dict = {}
_TORCH_DEVICE = re.compile(r"^(cpu|cuda|mps|xpu)(:\d+)?$")


def _batch_size(value) -> int:
    if isinstance(value, bool) or isinstance(value, float):
        raise ValueError(f"batch_size: expected a positive int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"batch_size: expected a positive int, got {value!r}") from None
    if value < 1:
        raise ValueError(f"batch_size: expected a positive int, got {value!r}")
    return value


def device_slug(device=None) -> str:
    """The GPU slug of ``device``: a torch device (or its text, ``"cuda:0"``), None (this machine's current
    device) or a slug as it is (``"nvidia-h200"``: read another machine's budgets)."""
    if isinstance(device, str) and not _TORCH_DEVICE.match(device):
        if slugify(device) != device:
            raise ValueError(f"device: {device!r} is neither a torch device nor a GPU slug such as 'nvidia-h200'")
        return device
    key = str(device)
    if key not in _slugs:
        try:
            _slugs[key] = fingerprint(None if device is None else torch.device(device)).slug
        except (RuntimeError, TypeError) as error:
            raise ValueError(f"device: {device!r}: {error}") from None
    return _slugs[key]


def get_budget(batch_size: int, model: str, device=None, acceptance: str | None = None, engine: str | None = None,
               dtype: str = "bf16", tp: int = 1) -> dict:
    """The budget an engine should use at ``batch_size``: the database entry of the bucket that serves it.

    model: a model name (``Qwen3.5-9B`` or ``qwen3.5-9b``). device: a torch device, None (this machine) or a
    GPU slug (``"nvidia-h200"``). acceptance: the workload's acceptance profile (default
    `DEFAULT_WORKLOAD`). engine: ``sglang``, ``vllm`` or ``bole`` (default). Returns the batch entry
    (``nodes_per_request``, ``parents``, ``ranks``, the engine's settings, ``serves``, ...) plus
    ``budget`` (the entry's name); cached per arguments, do not modify it. Raises ValueError naming the
    argument, LookupError when the database has no budget for it.
    """
    if type(batch_size) is not int:
        batch_size = _batch_size(batch_size)
    key = (batch_size, model, device, acceptance, engine, dtype, tp)
    hit = _cache.get(key)
    if hit is not None:
        return hit
    entry = _lookup(_batch_size(batch_size), model, device, acceptance or DEFAULT_WORKLOAD,
                    engine or DEFAULT_ENGINE, dtype, tp)
    _cache[key] = entry
    return entry


def _lookup(batch_size, model, device, acceptance, engine, dtype, tp) -> dict:
    check_engine(engine)
    if not isinstance(acceptance, str):
        raise ValueError(f"acceptance: expected a workload name such as {DEFAULT_WORKLOAD!r}, got {acceptance!r}")
    if not isinstance(model, str):
        raise ValueError(f"model: expected a model name such as 'Qwen3.5-9B', got {model!r}")
    try:
        name = resolve_model(model).name
    except ProfileError as error:
        raise ValueError(f"model: {error}") from None
    slug = device_slug(device)
    found = database.search(slug)
    wanted = budget_name(name, acceptance, engine, dtype, tp)
    budgets = found.entries("budgets")
    entry = budgets.get(wanted)
    if entry is None and acceptance not in {*list_acceptance_models(), *(b["workload"] for b in budgets.values())}:
        raise ValueError(f"acceptance: unknown workload {acceptance!r} "
                         f"(shipped: {', '.join(list_acceptance_models())})")
    if entry is None:
        raise LookupError(f"model: no budget {wanted} on {slug} in {found.where} (run bole-tune step and "
                          "bole-tune budget)")
    for batch, b in entry["batches"].items():
        low, high = b["serves"]
        if low <= batch_size and (high is None or batch_size <= high):
            return {**b, "budget": wanted, "batch_bucket": int(batch)}
    raise LookupError(f"batch_size: {batch_size} is served by no bucket of {wanted} on {slug} ({found.where})")


def budget_lookup_cost_ns(model: str = "Qwen3.5-9B", device="nvidia-h200", calls: int = 100_000, **kwargs) -> float:
    """Nanoseconds per cached `get_budget` call (after one call that reads the database)."""
    get_budget(16, model=model, device=device, **kwargs)
    start = time.perf_counter_ns()
    for _ in range(calls):
        get_budget(16, model=model, device=device, **kwargs)
    return (time.perf_counter_ns() - start) / calls


def clear_cache() -> None:
    """Forget cached budgets and parsed database files."""
    _cache.clear()
    _slugs.clear()
    database.clear_cache()
