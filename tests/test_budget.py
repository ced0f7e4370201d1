"""The hardware-aware budget: best-first trees, the optimiser, calibration, exports, get_budget."""

import itertools
import json
import random

import pytest

from bole_tune import budget, database
from bole_tune.acceptance import AcceptanceModel, calibrate, load_acceptance
from bole_tune.budget import DraftTree, StepCurve, best_first_tree, build_budgets, engine_settings, tree_depths
from bole_tune.profiles import ProfileError
from bole_tune.step_latency import experts_touched

MODEL = AcceptanceModel("test", (0.8, 0.7, 0.6, 0.5), (1.0, 0.15, 0.05))


def expected_accepted(model, parents, ranks):
    depths = tree_depths(parents)
    probs = []
    for p, r, d in zip(parents, ranks, depths):
        probs.append((1.0 if p < 0 else probs[p]) * model.child_probability(d, r))
    return sum(probs)


def all_trees(n, max_rank):
    """Every draft tree of n nodes (parent before child, distinct ranks 1..k among siblings)."""
    for parents in itertools.product(*[range(-1, i) for i in range(n)]):
        children = {}
        for i, p in enumerate(parents):
            children.setdefault(p, []).append(i)
        if any(len(c) > max_rank for c in children.values()):
            continue
        for assignment in itertools.product(*[itertools.permutations(range(1, max_rank + 1), len(c))
                                              for c in children.values()]):
            ranks = [0] * n
            for kids, rs in zip(children.values(), assignment):
                for kid, r in zip(kids, rs):
                    ranks[kid] = r
            yield parents, ranks


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_best_first_tree_is_optimal_by_brute_force(n):
    best = max(expected_accepted(MODEL, p, r) for p, r in all_trees(n, MODEL.max_rank))
    tree = best_first_tree(MODEL, n)
    assert len(tree.parents) == n
    assert tree.expected_accepted == pytest.approx(best, rel=1e-12)
    assert tree.expected_accepted == pytest.approx(expected_accepted(MODEL, tree.parents, tree.ranks))


def test_chain_matches_the_published_product():
    model = load_acceptance("qwen3-next-mtp-gsm8k")
    chain = best_first_tree(model, 3, chain=True)
    assert chain.parents == (-1, 0, 1)
    assert chain.expected_accepted == pytest.approx(0.873 + 0.873 * 0.778 + 0.873 * 0.778 * 0.675)


def constructed_curve(free_until=16, slope=40.0, base=1000.0, batches=(1, 4)):
    points = []
    for b in batches:
        for t in (1, 2, 4, 8, 16, 32, 64):
            step = base * b ** 0.5 + slope * max(0, b * t - free_until)
            points.append({"batch": b, "tree_size": t, "tokens": b * t, "step_us": step, "attention_us": 5.0,
                           "lm_head_us": 5.0, "gdn_us": 1.0})
    return StepCurve(points)


def test_optimiser_agrees_with_brute_force_over_budgets():
    curve = constructed_curve()
    for batch in curve.batches:
        chosen = budget.choose(MODEL, curve, batch)
        brute = None
        for size in range(1, curve.max_tree_size(batch) + 1):
            for chain in (False, True):
                tree = best_first_tree(MODEL, size - 1, chain=chain)
                rate = batch * (1 + tree.expected_accepted) / (
                    (curve.value(batch, size) + curve.draft_cost(batch, tree)) * 1e-6)
                if brute is None or rate > brute[0]:
                    brute = (rate, size)
        assert chosen.tokens_per_second == pytest.approx(brute[0])
        assert chosen.nodes_per_request == brute[1]


def test_budget_shrinks_when_verification_stops_being_free():
    cheap = budget.choose(MODEL, constructed_curve(free_until=256), 4)
    costly = budget.choose(MODEL, constructed_curve(free_until=4, slope=400.0), 4)
    assert costly.nodes_per_request < cheap.nodes_per_request


def test_build_budgets_and_engine_exports_round_trip(tmp_path):
    entry = build_budgets(MODEL, constructed_curve())
    for batch, b in entry["batches"].items():
        assert b["nodes_per_request"] == b["draft_nodes_per_request"] + 1
        assert len(b["parents"]) == b["draft_nodes_per_request"]
        assert b["speedup_vs_no_speculation"] >= 1.0 and b["speedup_vs_fixed_budget"] >= 1.0 - 1e-9
    settings = engine_settings(entry)
    path = tmp_path / "sglang.json"
    path.write_text(json.dumps(settings["sglang"]))
    back = json.loads(path.read_text())["per_batch_size"]
    for batch, b in entry["batches"].items():
        assert back[str(batch)]["speculative_num_draft_tokens"] == b["nodes_per_request"]
        assert back[str(batch)]["speculative_num_steps"] == b["depth"]
        assert settings["vllm"]["num_speculative_tokens_per_batch_size"][str(batch)] == b["chain_length"]


def synthetic_log(path, model, rounds=4000, width=3, depth=4, seed=0):
    """Rounds drafted as full trees of the given width and depth; acceptance drawn from ``model``."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rounds):
            parents, ranks = [], []
            frontier = [-1]
            for d in range(1, depth + 1):
                nxt = []
                for p in frontier:
                    for r in range(1, width + 1):
                        parents.append(p)
                        ranks.append(r)
                        nxt.append(len(parents) - 1)
                frontier = nxt[:width]
            accepted, current = [], -1
            while True:
                kids = [i for i, p in enumerate(parents) if p == current]
                if not kids:
                    break
                d = 1 if current < 0 else tree_depths(parents)[current] + 1
                u, chosen = rng.random(), None
                for kid in kids:
                    u -= model.child_probability(d, ranks[kid])
                    if u < 0:
                        chosen = kid
                        break
                if chosen is None:
                    break
                accepted.append(chosen)
                current = chosen
            f.write(json.dumps({"parents": parents, "ranks": ranks, "accepted": accepted}) + "\n")
    return path


def test_calibration_recovers_a_known_model(tmp_path):
    truth = AcceptanceModel("truth", (0.75, 0.65, 0.5, 0.4), (1.0, 0.2, 0.1))
    fitted, stats = calibrate(synthetic_log(tmp_path / "log.jsonl", truth), max_rank=3)
    assert stats["rounds"] == 4000
    for got, want in zip(fitted.depth_acceptance, truth.depth_acceptance):
        assert got == pytest.approx(want, abs=0.04)
    for got, want in zip(fitted.rank_share, truth.rank_share):
        assert got == pytest.approx(want, abs=0.04)


@pytest.mark.parametrize("line, message", [
    ('{"parents": [0], "ranks": [1], "accepted": []}', "must precede"),
    ('{"parents": [-1], "ranks": [1, 1], "accepted": []}', "ranks has 2 entries"),
    ('{"parents": [-1, 0], "ranks": [1, 1], "accepted": [1]}', "not on a path"),
    ('not json', "expected an object"),
])
def test_calibration_rejects_bad_logs(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        calibrate(path)


@pytest.mark.parametrize("fields, message", [
    ({"depth_acceptance": [0.9], "rank_share": [1.0, 0.3]}, "sum\\(rank_share\\)"),
    ({"depth_acceptance": [1.2], "rank_share": [1.0]}, "depth_acceptance\\[0\\]"),
    ({"depth_acceptance": [0.5], "rank_share": [0.9]}, "rank_share\\[0\\]"),
])
def test_acceptance_model_validation(tmp_path, fields, message):
    path = tmp_path / "m.yaml"
    path.write_text(json.dumps({"name": "m", **fields}))
    with pytest.raises(ProfileError, match=message):
        load_acceptance(str(path))


def test_get_budget_reads_the_database_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("BOLE_TUNE_DB", str(tmp_path))
    budget.clear_cache()
    from bole_tune.fingerprint import fingerprint
    slug = fingerprint().slug
    entry = build_budgets(MODEL, constructed_curve())
    entry["provenance"] = {"date": database.now()}
    database.update(database.database_path(slug, tmp_path),
                    budgets={budget.budget_name("Qwen3.5-9B"): json.loads(json.dumps(entry, default=str))})
    got = budget.get_budget(3, model="qwen3.5-9b")
    assert got["batch_bucket"] == 4 and got["nodes_per_request"] == entry["batches"][4]["nodes_per_request"]
    assert budget.get_budget(100, model="Qwen3.5-9B")["batch_bucket"] == 4  # above the largest bucket
    (tmp_path / f"{slug}.yaml").unlink()
    assert budget.get_budget(3, model="qwen3.5-9b") is got, "not cached"
    with pytest.raises(ValueError, match="batch_size"):
        budget.get_budget(0, model="qwen3.5-9b")
    budget.clear_cache()


def test_experts_touched():
    assert experts_touched(1, 256, 8) == 8
    assert experts_touched(10_000, 256, 8) == 256
    assert 8 < experts_touched(16, 256, 8) < 128


def test_draft_tree_shape():
    tree = DraftTree((-1, 0, 0, 1), (1, 1, 2, 1), (0.9, 0.7, 0.1, 0.5))
    assert tree.depth == 3 and tree.width == 2 and tree.expected_accepted == pytest.approx(2.2)
