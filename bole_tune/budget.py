"""The hardware-aware tree-token budget: per batch size, the tree that maximises tokens per second.

For batch B and N verified tokens (N = B: no speculation), the expected throughput is

    B * E[accepted + 1] / (step latency(B, N) + draft cost)

with the step latency measured on the GPU (`bole_tune.step_latency`, stored in the database) and
E[accepted] from an acceptance model. Draft nodes are taken best-first by path probability across
all requests (for identical requests that spreads them evenly), which maximises E[accepted] for every
node count because a child is never likelier than its parent nor a sibling than the one ranked above
it. Plain chains (top-1 only) are candidates too. The draft cost of a tree is one drafter step per
depth level, each costing one decoder layer plus the LM head over B x (level width) tokens (an MTP
head), read off the same measured curves.
"""

from __future__ import annotations

import bisect
import heapq
import json
import math
from dataclasses import dataclass
from pathlib import Path

from bole_tune import database
from bole_tune.acceptance import AcceptanceModel, load_acceptance
from bole_tune.atomic import write_text_atomic
from bole_tune.fingerprint import fingerprint
from bole_tune.profiles import ModelProfile, resolve_model


@dataclass(frozen=True)
class DraftTree:
    parents: tuple[int, ...]  # draft nodes only; -1: hangs off the committed token
    ranks: tuple[int, ...]
    probabilities: tuple[float, ...]  # P(node accepted), the product along its path

    @property
    def expected_accepted(self) -> float:
        return sum(self.probabilities)

    @property
    def depth(self) -> int:
        depths = tree_depths(self.parents)
        return max(depths) if depths else 0

    @property
    def width(self) -> int:
        depths = tree_depths(self.parents)
        return max((depths.count(d) for d in set(depths)), default=0)


def tree_depths(parents) -> list[int]:
    depths = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def best_first_tree(model: AcceptanceModel, nodes: int, chain: bool = False) -> DraftTree:
    """The ``nodes``-node draft tree of largest expected accepted length (``chain``: top-1 only)."""
    parents, ranks, probabilities = [], [], []
    depth_of = []
    # heap of candidates: (-probability, tiebreak, parent, rank, depth)
    heap = [(-model.child_probability(1, 1), 0, -1, 1, 1)]
    counter = 1
    while heap and len(parents) < nodes:
        neg_p, _, parent, rank, depth = heapq.heappop(heap)
        if -neg_p <= 0.0:
            break
        index = len(parents)
        parents.append(parent)
        ranks.append(rank)
        probabilities.append(-neg_p)
        depth_of.append(depth)
        base = 1.0 if parent < 0 else probabilities[parent]
        if not chain and rank < model.max_rank:  # next sibling
            heapq.heappush(heap, (-base * model.child_probability(depth, rank + 1), counter, parent, rank + 1, depth))
            counter += 1
        heapq.heappush(heap, (-(-neg_p) * model.child_probability(depth + 1, 1), counter, index, 1, depth + 1))
        counter += 1
    return DraftTree(tuple(parents), tuple(ranks), tuple(probabilities))


class StepCurve:
    """Measured step latency (and its parts) of one model, interpolated in tree size per batch."""

    def __init__(self, points: list[dict]):
        if not points:
            raise ValueError("step curve: no points")
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

    def value(self, batch: int, tree_size: float, field: str = "step_us") -> float:
        pts = self.by_batch[batch]
        sizes = [p["tree_size"] for p in pts]
        if tree_size <= sizes[0]:
            return pts[0][field]
        i = min(bisect.bisect_left(sizes, tree_size), len(pts) - 1)
        lo, hi = pts[i - 1], pts[i]
        t = (tree_size - lo["tree_size"]) / (hi["tree_size"] - lo["tree_size"])
        return lo[field] + t * (hi[field] - lo[field])

    def draft_cost(self, batch: int, tree: DraftTree) -> float:
        """One drafter step per depth level: a decoder layer and the LM head over that level's tokens."""
        depths = tree_depths(tree.parents)
        cost = 0.0
        for d in range(1, (max(depths) if depths else 0) + 1):
            width = depths.count(d)
            cost += self.value(batch, width, "attention_us") + self.value(batch, width, "lm_head_us")
        return cost


@dataclass(frozen=True)
class Choice:
    batch: int
    nodes_per_request: int  # verified tokens per request, the committed token included
    chain: bool
    tree: DraftTree
    step_us: float
    draft_us: float

    @property
    def tokens(self) -> int:
        return self.batch * self.nodes_per_request

    @property
    def expected_tokens(self) -> float:
        """Tokens a request gains per round: the accepted drafts plus the target's own token."""
        return 1.0 + self.tree.expected_accepted

    @property
    def tokens_per_second(self) -> float:
        return self.batch * self.expected_tokens / ((self.step_us + self.draft_us) * 1e-6)


def candidates(model: AcceptanceModel, curve: StepCurve, batch: int, max_nodes: int | None = None) -> list[Choice]:
    """Every tree size (best-first trees and chains) the curve covers at this batch."""
    limit = min(max_nodes or 10 ** 9, curve.max_tree_size(batch))
    full = best_first_tree(model, limit - 1)
    chain = best_first_tree(model, limit - 1, chain=True)
    out = []
    for size in range(1, limit + 1):
        for is_chain, source in ((False, full), (True, chain)):
            if is_chain and size == 1:
                continue
            if len(source.parents) < size - 1:
                continue
            tree = DraftTree(source.parents[: size - 1], source.ranks[: size - 1], source.probabilities[: size - 1])
            out.append(Choice(batch, size, is_chain, tree, curve.value(batch, size), curve.draft_cost(batch, tree)))
    return out


def choose(model: AcceptanceModel, curve: StepCurve, batch: int, max_nodes: int | None = None) -> Choice:
    return max(candidates(model, curve, batch, max_nodes), key=lambda c: c.tokens_per_second)


def plan_budgets(model: AcceptanceModel, curve: StepCurve, max_nodes: int | None = None) -> dict:
    """Per measured batch: the chosen tree, its gains, and the comparison with fixed budgets."""
    per_batch = {b: candidates(model, curve, b, max_nodes) for b in curve.batches}
    sizes = set.intersection(*({c.nodes_per_request for c in cs if not c.chain} for cs in per_batch.values()))

    def best_at(batch, size):
        return max((c for c in per_batch[batch] if c.nodes_per_request == size),
                   key=lambda c: c.tokens_per_second)

    def geomean_rate(size):
        return math.exp(sum(math.log(best_at(b, size).tokens_per_second) for b in per_batch) / len(per_batch))

    fixed = max(sizes, key=geomean_rate)
    result = {"fixed_budget_nodes_per_request": fixed, "batches": {}}
    for batch, cs in per_batch.items():
        best = max(cs, key=lambda c: c.tokens_per_second)
        plain = best_at(batch, 1)
        result["batches"][batch] = {
            "choice": best, "tokens_per_second": best.tokens_per_second,
            "speedup_vs_no_speculation": best.tokens_per_second / plain.tokens_per_second,
            "speedup_vs_fixed_budget": best.tokens_per_second / best_at(batch, fixed).tokens_per_second,
            "curve": [(c.nodes_per_request, c.tokens_per_second) for c in cs if not c.chain],
        }
    return result


def budget_entry(choice: Choice, info: dict) -> dict:
    t = choice.tree
    return {
        "tokens": choice.tokens, "nodes_per_request": choice.nodes_per_request,
        "draft_nodes_per_request": len(t.parents), "shape": "chain" if t.width <= 1 else "tree",
        "depth": t.depth, "width": t.width, "expected_mean_accepted": round(t.expected_accepted, 4),
        "expected_tokens_per_round": round(choice.expected_tokens, 4),
        "step_us": round(choice.step_us, 2), "draft_us": round(choice.draft_us, 2),
        "tokens_per_second": round(info["tokens_per_second"], 1),
        "speedup_vs_no_speculation": round(info["speedup_vs_no_speculation"], 3),
        "speedup_vs_fixed_budget": round(info["speedup_vs_fixed_budget"], 3),
        "parents": list(t.parents), "ranks": list(t.ranks),
    }


def build_budgets(model: AcceptanceModel, curve: StepCurve, max_nodes: int | None = None) -> dict:
    """Database entries per batch (``batches``) and the fixed budget they were compared with."""
    plan = plan_budgets(model, curve, max_nodes)
    batches = {}
    for batch, info in plan["batches"].items():
        entry = budget_entry(info["choice"], info)
        entry["chain_length"] = best_chain_length(model, curve, batch)
        batches[batch] = entry
    return {"acceptance": model.as_dict(), "fixed_budget_nodes_per_request": plan["fixed_budget_nodes_per_request"],
            "batches": batches}


def engine_settings(budgets: dict) -> dict:
    """SGLang and vLLM settings per batch bucket, from a database budget entry."""
    sglang, vllm = {}, {}
    for batch, b in sorted(budgets["batches"].items(), key=lambda kv: int(kv[0])):
        ranks = b["ranks"]
        sglang[str(batch)] = {"speculative_num_steps": b["depth"],
                              "speculative_eagle_topk": max(ranks) if ranks else 1,
                              "speculative_num_draft_tokens": b["nodes_per_request"]}
        vllm[str(batch)] = b["chain_length"]
    return {"sglang": {"per_batch_size": sglang},
            "vllm": {"num_speculative_tokens_per_batch_size": vllm}}


def export_engine_settings(entry: dict, model_name: str, folder) -> list[Path]:
    """Write `engine_settings` of a budget entry as ``sglang-<model>.json`` and ``vllm-<model>.json``."""
    settings = engine_settings(entry)
    folder, stem = Path(folder), model_name.lower()
    files = []
    for engine in ("sglang", "vllm"):
        path = folder / f"{engine}-{stem}.json"
        write_text_atomic(path, json.dumps(settings[engine], indent=1) + "\n")
        files.append(path)
    return files


@dataclass
class BudgetResult:
    """What `store_budgets` chose and where it wrote it."""

    slug: str
    path: Path  # the database file written
    acceptance: AcceptanceModel
    budgets: dict  # budget name -> database entry
    exported: list[Path]


def store_budgets(acceptance="qwen3-next-mtp-gsm8k", models=None, slug: str | None = None, db_dir=None,
                  export=None) -> BudgetResult:
    """Choose the tree-token budget per batch size for each model from its stored step curve, store the
    budgets in the database and, with ``export`` (a folder), write SGLang and vLLM settings files.

    acceptance: an `AcceptanceModel`, or its name or YAML file. models: names or profiles (default: every
    model with a step curve). slug: the GPU (default: this machine's). The step curves are read as
    `bole_tune.database.search` reads them; the budgets go to ``<db_dir>/<slug>.yaml``. Nothing is
    written if a model has no step curve (`LookupError`) or the database is unreadable (`DatabaseError`).
    """
    if not isinstance(acceptance, AcceptanceModel):
        acceptance = load_acceptance(acceptance)
    slug = slug or fingerprint().slug
    found = database.search(slug, db_dir)
    if not found.files:
        raise LookupError(f"no tuning database for {slug}: {found.where} (run bole-tune step first)")
    curves = found.entries("step_curves")
    names = ([(m if isinstance(m, ModelProfile) else resolve_model(m)).name for m in models] if models
             else [c["model"] for c in curves.values()])
    budgets = {}
    for name in names:
        curve = curves.get(f"{name}/bf16")
        if curve is None:
            raise LookupError(f"no step curve for {name} in {found.where} (run bole-tune step --model ... first)")
        entry = build_budgets(acceptance, StepCurve(curve["points"]))
        entry["step_curve"] = f"{name}/bf16"
        entry["provenance"] = {"date": database.now(), "step_curve_date": curve["provenance"].get("date", ""),
                               "acceptance_source": acceptance.source, "method": "best-first trees and chains; "
                               "tokens/s = B * E[accepted + 1] / (step + draft)"}
        budgets[budget_name(name)] = entry
    path = database.database_path(slug, db_dir)
    database.update(path, budgets=budgets)
    exported = []
    for name in names if export else ():
        exported += export_engine_settings(budgets[budget_name(name)], name, export)
    return BudgetResult(slug, path, acceptance, budgets, exported)


def best_chain_length(model: AcceptanceModel, curve: StepCurve, batch: int) -> int:
    chains = [c for c in candidates(model, curve, batch) if c.chain or c.nodes_per_request == 1]
    return len(max(chains, key=lambda c: c.tokens_per_second).tree.parents)


_cache: dict = {}


def get_budget(batch_size: int, model: str, device=None, dtype: str = "bf16", tp: int = 1) -> dict:
    """The tree-token budget an engine should use at ``batch_size`` on this GPU (cached after the first call).

    Returns the database entry of the batch bucket that holds ``batch_size`` (the largest measured
    batch for anything above it): tokens, nodes per request, depth, width, the tree's parents, ...
    """
    key = (batch_size, model, device, dtype, tp)
    hit = _cache.get(key)
    if hit is not None:
        return hit
    entry = _lookup_budget(batch_size, model, device, dtype, tp)
    _cache[key] = entry
    return entry


def _budgets_for(slug: str, name: str) -> dict:
    """The budget entry ``name`` of ``slug`` as `bole_tune.database.search` reads the database."""
    found = database.search(slug)
    budgets = found.entries("budgets")
    if name not in budgets:
        raise LookupError(f"no budget for {name} on {slug} in {found.where} (run bole-tune step and bole-tune budget)")
    return budgets[name]


def _lookup_budget(batch_size, model, device, dtype, tp) -> dict:
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    profile = resolve_model(model)
    slug = fingerprint(device).slug
    budgets = _budgets_for(slug, budget_name(profile.name, dtype, tp))
    by_batch = {int(b): entry for b, entry in budgets["batches"].items()}  # JSON round trips make keys strings
    batches = sorted(by_batch)
    chosen = next((b for b in batches if batch_size <= b), batches[-1])
    return by_batch[chosen] | {"batch_bucket": chosen}


def budget_name(model_name: str, dtype: str = "bf16", tp: int = 1) -> str:
    return f"{model_name}/{dtype}" + (f"/TP{tp}" if tp != 1 else "")


def clear_cache() -> None:
    """Forget cached budgets and parsed database files."""
    _cache.clear()
    database.clear_cache()
