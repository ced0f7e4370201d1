"""The budget: trees each engine can build (SGLang's beam against hand-worked cases), the optimiser per
engine, bucket semantics, get_budget (from a GPU slug on a CPU machine, cached) and its bad inputs."""

import itertools
import json
import subprocess
import sys

import pytest

from bole_tune import budget, database
from bole_tune.acceptance import AcceptanceModel
from bole_tune.draft_trees import (DraftTree, SGLangBeam, best_first_tree, chain_tree, check_sglang_shape,
                                   path_probabilities)

# rank 1: a_d; rank 2: (1 - a_d) * 0.5; below an accepted rank-2 node everything x continuation
HAND = AcceptanceModel("hand", (0.8, 0.6, 0.5), (0.5,), 1.0)
HAND_BRANCH = AcceptanceModel("hand", (0.8, 0.6, 0.5), (0.5,), 0.5)
MODEL = AcceptanceModel("test", (0.8, 0.7, 0.6, 0.5), (0.4, 0.2), 0.5)


def test_sglang_beam_steps2_topk2_by_hand():
    # level 1: 0.8 (rank 1), 0.1 (rank 2); level 2 from both beam nodes:
    #   under 0.8: 0.48, 0.16; under 0.1: 0.06, 0.02 -> best 3 of all: 0.8, 0.48, 0.16
    beam = SGLangBeam(HAND, 2, 2)
    tree = beam.tree(4)
    assert (tree.parents, tree.ranks) == ((-1, 0, 0), (1, 1, 2))
    assert tree.probabilities == pytest.approx((0.8, 0.48, 0.16))
    tree = beam.tree(5)  # + the rank-2 root child 0.1, which comes first in SGLang's list order
    assert (tree.parents, tree.ranks) == ((-1, -1, 0, 0), (1, 2, 1, 2))
    assert tree.expected_accepted == pytest.approx(1.54)
    assert beam.max_draft_tokens == 7 and beam.drafter_tokens() == [1, 2]


def test_sglang_beam_keeps_only_the_best_topk_per_level():
    # steps 3: level 3 expands only the best 2 of level 2 (0.48 and 0.16), never 0.06 or 0.02
    beam = SGLangBeam(HAND, 3, 2)
    full = beam.tree(beam.max_draft_tokens)
    assert len(full.parents) == 2 + 4 + 4
    level2 = {n: p for n, p in enumerate(full.probabilities) if full.depths[n] == 2}
    parents3 = {full.parents[n] for n in range(len(full.parents)) if full.depths[n] == 3}
    assert sorted(level2[p] for p in parents3) == pytest.approx([0.16, 0.48])
    # the continuation factor lowers what hangs below an alternative: 0.1 * 0.6 * 0.5 = 0.03
    branch = SGLangBeam(HAND_BRANCH, 2, 2).tree(7)
    assert sorted(branch.probabilities) == pytest.approx(sorted([0.8, 0.1, 0.48, 0.16, 0.03, 0.01]))


def test_sglang_topk1_is_the_chain():
    for steps in (1, 3, 5):
        tree = SGLangBeam(MODEL, steps, 1).tree(steps + 1)
        assert tree == chain_tree(MODEL, steps)
        assert tree.parents == tuple(range(-1, steps - 1))


@pytest.mark.parametrize("steps, topk", [(2, 3), (3, 4), (4, 2), (5, 3)])
def test_sglang_trees_are_ancestor_closed_and_the_best_candidates(steps, topk):
    beam = SGLangBeam(MODEL, steps, topk)
    scores = sorted((c[2] for c in beam.candidates), reverse=True)
    for n in range(2, beam.max_draft_tokens + 1):
        tree = beam.tree(n)
        assert len(tree.parents) == n - 1 and all(-1 <= p < i for i, p in enumerate(tree.parents))
        assert tree.depth <= steps
        assert tree.probabilities == pytest.approx(path_probabilities(MODEL, tree.parents, tree.ranks))
        assert tree.expected_accepted == pytest.approx(sum(scores[: n - 1]))
        siblings = {}
        for p, r in zip(tree.parents, tree.ranks):
            siblings.setdefault(p, []).append(r)
        assert all(len(set(rs)) == len(rs) and max(rs) <= topk for rs in siblings.values())


@pytest.mark.parametrize("shape, field", [
    ((0, 2, 4), "speculative_num_steps"), ((3, 0, 4), "speculative_eagle_topk"),
    ((3, 1, 5), "speculative_num_draft_tokens: 5 with speculative_eagle_topk 1"),
    ((2, 2, 8), "speculative_num_draft_tokens: 8 is outside 2..7"), ((2, 2, 1), "speculative_num_draft_tokens"),
    ((2, True, 4), "speculative_eagle_topk"),
])
def test_impossible_sglang_shapes_name_the_flag(shape, field):
    with pytest.raises(ValueError, match=field):
        check_sglang_shape(*shape)
    if shape[1] == 2 and shape[0] == 2:
        with pytest.raises(ValueError, match=field):
            SGLangBeam(MODEL, 2, 2).tree(shape[2])


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
    best = max(sum(path_probabilities(MODEL, p, r)) for p, r in all_trees(n, MODEL.max_rank))
    tree = best_first_tree(MODEL, n)
    assert len(tree.parents) == n
    assert tree.expected_accepted == pytest.approx(best, rel=1e-12)
    assert tree.probabilities == pytest.approx(path_probabilities(MODEL, tree.parents, tree.ranks))


def test_best_first_tree_respects_max_depth():
    tree = best_first_tree(AcceptanceModel("deep", (0.99,), (0.01,)), 20, max_depth=3)
    assert tree.depth == 3


def constructed_curve(free_until=16, slope=40.0, base=1000.0, batches=(1, 4, 16), sizes=(1, 2, 4, 8, 16, 32, 64)):
    points = []
    for b in batches:
        for t in sizes:
            step = base * b ** 0.5 + slope * max(0, b * t - free_until)
            points.append({"batch": b, "tree_size": t, "tokens": b * t, "step_us": step, "attention_us": 20.0 + t,
                           "lm_head_us": 30.0 + b * t, "gdn_us": 1.0})
    return points


def curve_entry(**kwargs):
    return {"model": "Qwen3.5-9B", "dtype": "bf16", "points": constructed_curve(**kwargs), "provenance": {"date": "d"}}


@pytest.mark.parametrize("engine", budget.ENGINES)
def test_chosen_shapes_are_feasible_for_their_engine(engine):
    entry = budget.build_budget("Qwen3.5-9B", MODEL, engine, curve_entry())
    assert entry["engine"] == engine and set(entry["batches"]) == {1, 4, 16}
    for batch, b in entry["batches"].items():
        n = b["nodes_per_request"]
        assert b["tokens"] == batch * n and b["draft_tokens"] == n - 1 == len(b["parents"])
        assert b["speedup_vs_fixed_chain"] >= 1.0 - 1e-9  # every engine can run the fixed chain
        if engine == "vllm":
            assert b["shape"] == "chain" and b["vllm"] == {"num_speculative_tokens": n - 1}
            assert b["parents"] == list(range(-1, n - 2))
        if engine == "sglang":
            flags = b["sglang"]
            check_sglang_shape(flags["speculative_num_steps"], flags["speculative_eagle_topk"], n)
            tree = SGLangBeam(MODEL, flags["speculative_num_steps"], flags["speculative_eagle_topk"]).tree(n)
            assert (list(tree.parents), list(tree.ranks)) == (b["parents"], b["ranks"])
        if engine != "sglang":
            assert "sglang" not in b
    database.validate({"schema_version": 1, "budgets": {budget.budget_name("Qwen3.5-9B", "test", engine): entry}},
                      "test")


def test_vllm_choice_agrees_with_brute_force_over_chains():
    points = constructed_curve()
    curve = budget.StepCurve(points)
    entry = budget.build_budget("Qwen3.5-9B", MODEL, "vllm", curve_entry())
    for batch in curve.batches:
        def rate(k):
            draft = k * (curve.value(batch, 1, "attention_us") + curve.value(batch, 1, "lm_head_us"))
            return batch * (1 + MODEL.chain_accepted(k)) / ((curve.value(batch, k + 1) + draft) * 1e-6)
        best = max(range(1, 9), key=rate)
        assert entry["batches"][batch]["vllm"]["num_speculative_tokens"] == best
        assert entry["batches"][batch]["tokens_per_second"] == pytest.approx(rate(best), rel=1e-3)
        assert entry["batches"][batch]["speedup_vs_no_speculation"] == pytest.approx(
            rate(best) / (batch / (curve.value(batch, 1) * 1e-6)), rel=1e-3)


def test_bole_beats_or_ties_the_engines_it_can_imitate():
    rates = {e: budget.build_budget("Qwen3.5-9B", MODEL, e, curve_entry())["batches"] for e in budget.ENGINES}
    for batch in rates["bole"]:
        assert rates["bole"][batch]["tokens_per_second"] >= rates["vllm"][batch]["tokens_per_second"] - 0.1


def test_budget_shrinks_when_verification_stops_being_free():
    cheap = budget.build_budget("M", MODEL, "bole", curve_entry(free_until=1024))["batches"][4]
    costly = budget.build_budget("M", MODEL, "bole", curve_entry(free_until=4, slope=400.0))["batches"][4]
    assert costly["nodes_per_request"] < cheap["nodes_per_request"]


def test_serves_buckets():
    assert budget.serves([1, 4, 16]) == {1: [1, 1], 4: [2, 4], 16: [5, None]}
    assert budget.serves([8]) == {8: [1, None]}


@pytest.fixture
def stored(tmp_path, monkeypatch):
    """Budgets of Qwen3.5-9B for two workloads and every engine stored for the slug 'test-gpu'."""
    monkeypatch.setenv("BOLE_TUNE_DB", str(tmp_path))
    budget.clear_cache()
    database.update(database.database_path("test-gpu", tmp_path), device={"slug": "test-gpu"},
                    step_curves={"Qwen3.5-9B/bf16": {**curve_entry(), "provenance": {"date": "d"}}})
    result = budget.store_budgets(models=["qwen3.5-9b"], workloads=["qwen3.5-mtp-mbpp", "qwen3.5-mtp-cnndm"],
                                  slug="test-gpu")
    yield result
    budget.clear_cache()


def test_store_budgets_writes_every_combination_without_paths(stored, tmp_path):
    assert stored.path == tmp_path / "test-gpu.yaml"
    names = set(database.load(stored.path)["budgets"])
    assert names == {f"Qwen3.5-9B/bf16/{w}/{e}" for w in ("qwen3.5-mtp-mbpp", "qwen3.5-mtp-cnndm")
                     for e in budget.ENGINES}
    text = json.dumps(stored.budgets, default=str)
    assert "/work/" not in text and str(tmp_path) not in text and ".yaml" not in text
    prov = stored.budgets["Qwen3.5-9B/bf16/qwen3.5-mtp-mbpp/bole"]["provenance"]["acceptance"]
    assert prov["name"] == "qwen3.5-mtp-mbpp" and any("Table 8" in s for s in prov["sources"])


def test_get_budget_buckets_round_up_and_the_largest_serves_above(stored):
    entry = stored.budgets["Qwen3.5-9B/bf16/qwen3.5-mtp-mbpp/bole"]["batches"]
    got = budget.get_budget(3, model="qwen3.5-9b", device="test-gpu")
    assert got["batch_bucket"] == 4 and got["nodes_per_request"] == entry[4]["nodes_per_request"]
    assert budget.get_budget(1, model="Qwen3.5-9B", device="test-gpu")["batch_bucket"] == 1
    assert budget.get_budget(2, model="Qwen3.5-9B", device="test-gpu")["batch_bucket"] == 4
    assert budget.get_budget(5, model="Qwen3.5-9B", device="test-gpu")["batch_bucket"] == 16
    assert budget.get_budget(1000, model="Qwen3.5-9B", device="test-gpu")["serves"] == [5, None]
    sglang = budget.get_budget(4, model="Qwen3.5-9B", device="test-gpu", acceptance="qwen3.5-mtp-cnndm",
                               engine="sglang")
    assert sglang["budget"] == "Qwen3.5-9B/bf16/qwen3.5-mtp-cnndm/sglang" and "sglang" in sglang


def test_get_budget_is_cached_after_the_first_call(stored):
    got = budget.get_budget(3, model="qwen3.5-9b", device="test-gpu", engine="vllm")
    assert budget.budget_lookup_cost_ns(model="qwen3.5-9b", device="test-gpu", calls=1000, engine="vllm") > 0
    stored.path.unlink()
    assert budget.get_budget(3, model="qwen3.5-9b", device="test-gpu", engine="vllm") is got


@pytest.mark.parametrize("kwargs, error, message", [
    ({"batch_size": 0}, ValueError, "batch_size"), ({"batch_size": -2}, ValueError, "batch_size"),
    ({"batch_size": 1.5}, ValueError, "batch_size"), ({"batch_size": float("nan")}, ValueError, "batch_size"),
    ({"batch_size": True}, ValueError, "batch_size"), ({"batch_size": "4"}, ValueError, "batch_size"),
    ({"engine": "trt"}, ValueError, "engine: unknown 'trt'"),
    ({"acceptance": "nope"}, ValueError, "acceptance: unknown workload 'nope'"),
    ({"acceptance": "qwen3.5-mtp-gsm8k"}, LookupError, "model: no budget Qwen3.5-9B/bf16/qwen3.5-mtp-gsm8k/bole"),
    ({"model": "no-such-model"}, ValueError, "model: "),
    ({"model": "qwen3.5-27b"}, LookupError, "model: no budget Qwen3.5-27B"),
    ({"device": "Not A Slug"}, ValueError, "device"),
], ids=["zero", "negative", "float", "nan", "bool", "text", "engine", "workload", "workload-not-stored", "model",
        "model-no-budget", "device"])
def test_get_budget_bad_input_names_the_argument(stored, kwargs, error, message):
    args = {"batch_size": 4, "model": "qwen3.5-9b", "device": "test-gpu", **kwargs}
    with pytest.raises(error, match=message):
        budget.get_budget(args.pop("batch_size"), **args)


def test_store_budgets_refuses_unknown_engine_or_workload(stored):
    with pytest.raises(ValueError, match="engine: unknown 'tgi'"):
        budget.store_budgets(models=["qwen3.5-9b"], engines=["tgi"], slug="test-gpu")
    with pytest.raises(ValueError, match="acceptance: unknown workload 'chat'"):
        budget.store_budgets(models=["qwen3.5-9b"], workloads=["chat"], slug="test-gpu")


def test_store_budgets_never_writes_the_shipped_folder_by_default(monkeypatch, tmp_path):
    """Not even when the user's default folder is the shipped one (a symlink): only an explicit folder."""
    (tmp_path / "bole-tune").mkdir()
    (tmp_path / "bole-tune" / "tuning_db").symlink_to(database.SHIPPED_DIR)
    monkeypatch.delenv("BOLE_TUNE_DB", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    before = (database.SHIPPED_DIR / "nvidia-h200.yaml").read_bytes()
    with pytest.raises(ValueError, match="is the database shipped with bole-tune"):
        budget.store_budgets(slug="nvidia-h200")
    assert (database.SHIPPED_DIR / "nvidia-h200.yaml").read_bytes() == before


def test_get_budget_from_the_package_top_without_loading_the_database_early():
    code = ("import sys, bole_tune; import bole_tune.kernels; assert 'bole_tune.database' not in sys.modules; "
            "from bole_tune import get_budget; from bole_tune.budget import get_budget as g; assert get_budget is g")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_draft_tree_shape():
    tree = DraftTree((-1, 0, 0, 1), (1, 1, 2, 1), (0.9, 0.7, 0.1, 0.5))
    assert tree.depth == 3 and tree.width == 2 and tree.expected_accepted == pytest.approx(2.2)
    assert tree.expanded_per_level() == [1, 1, 1]


def test_each_engine_is_budgeted_on_the_gdn_round_it_runs():
    """The step curve's points time the GDN round several ways and count the cheapest; the SGLang adapter runs one
    (verify, then one commit launch for all layers), so SGLang's budgets take the steps that way, and every batch
    entry names the way its step was measured with."""
    entry = curve_entry()
    entry["layers"] = {"gdn": 24, "attention": 8}
    for p in entry["points"]:  # the ring is cheapest below 64 tokens a batch, the all-layer commit 2 us dearer
        ring = p["tokens"] < 64
        p["gdn_rounds_us"] = {"ring": 1.0 if ring else 3.0, "verify + all-layer commit": 3.0 if ring else 1.0}
        p["gdn_round"] = "ring" if ring else "verify + all-layer commit"
    bole = budget.StepCurve.for_engine(entry, "bole")
    sglang = budget.StepCurve.for_engine(entry, "sglang")
    assert sglang.value(1, 4) == pytest.approx(bole.value(1, 4) + 24 * 2.0)  # 4 tokens: the ring was counted
    assert sglang.value(16, 8) == pytest.approx(bole.value(16, 8))  # 128 tokens: the all-layer commit already was
    assert bole.gdn_round(1, 4) == "ring" and sglang.gdn_round(1, 4) == "verify + all-layer commit"
    built = {e: budget.build_budget("Qwen3.5-9B", MODEL, e, entry) for e in ("bole", "sglang")}
    assert all(b["gdn_round"] == "verify + all-layer commit" for b in built["sglang"]["batches"].values())
    for b in built["bole"]["batches"].values():
        assert b["gdn_round"] == ("ring" if b["tokens"] < 64 else "verify + all-layer commit")
    database.validate({"schema_version": 1, "budgets": {budget.budget_name("Qwen3.5-9B", "test", e): built[e]
                                                        for e in built}}, "test")
    # a curve measured before the ways were (no gdn_rounds_us) is read as it is, its entries naming no way
    old = budget.build_budget("Qwen3.5-9B", MODEL, "sglang", curve_entry())
    assert all("gdn_round" not in b for b in old["batches"].values())
