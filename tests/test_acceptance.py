"""Acceptance profiles: the shipped ones reproduce the published figures they were fitted to, bad profiles
are refused naming the field, and calibration recovers a known model from logged rounds."""

import json
import random

import pytest

from bole_tune.acceptance import (AcceptanceModel, calibrate, conditional_from_unconditional, fit_rejection_scale,
                                  list_acceptance_models, load_acceptance)
from bole_tune.draft_trees import SGLangBeam, tree_depths
from bole_tune.profiles import ProfileError

# The tree the MAT profiles state they were fitted under: SGLang beam, 8 steps, top-4, 32 draft tokens.
PAPER_TREE = (8, 4, 32)


def mean_accepted_tokens(model, steps=PAPER_TREE[0], topk=PAPER_TREE[1], draft_tokens=PAPER_TREE[2]):
    """MAT as the paper and the engines count it: accepted draft tokens plus the target's own token."""
    return 1 + SGLangBeam(model, steps, topk).expected_accepted(draft_tokens)


def test_the_three_workloads_are_shipped():
    assert {"qwen3.5-mtp-mbpp", "qwen3.5-mtp-gsm8k", "qwen3.5-mtp-cnndm"} <= set(list_acceptance_models())


@pytest.mark.parametrize("model, published", [
    (None, 6.88), ("Qwen3.5-9B", 6.88), ("Qwen3.5-4B", 6.38), ("Qwen3.5-27B", 6.62), ("Qwen3.5-122B-A10B", 6.40),
], ids=["default", "9B", "4B", "27B", "122B"])
def test_mbpp_profile_gives_the_papers_mat_on_the_stated_tree(model, published):
    """Bole paper Table 8 (MBPP, native-MTP trees top-4 depth 8), within the rounding of the stored rates."""
    assert mean_accepted_tokens(load_acceptance("qwen3.5-mtp-mbpp", model=model)) == pytest.approx(published, abs=0.01)


def test_cnndm_profile_gives_the_papers_mat():
    assert mean_accepted_tokens(load_acceptance("qwen3.5-mtp-cnndm")) == pytest.approx(4.98, abs=0.01)


def test_gsm8k_profile_reproduces_the_published_mtp3_chain():
    """Qwen3.5-122B MTP-3 (vllm-ascend issue 9871): unconditional 0.867, 0.743, 0.615, accept length 3.22."""
    model = load_acceptance("qwen3.5-mtp-gsm8k")
    path = 1.0
    for depth, published in zip((1, 2, 3), (0.867, 0.743, 0.615)):
        path *= model.child_probability(depth, 1)
        assert path == pytest.approx(published, abs=5e-4)
    assert 1 + model.chain_accepted(3) == pytest.approx(3.22, abs=0.01)
    # the paper's GSM8K MAT (7.08) is a cross-check the chain data misses; the profile says by how much
    assert 5.0 < mean_accepted_tokens(model) < 7.08


def test_qwen3_next_variant_is_the_published_conditional_chain():
    """speculators PR 366: conditional 0.873, 0.778, 0.675."""
    model = load_acceptance("qwen3.5-mtp-gsm8k", model="qwen3-next-80b-a3b")
    assert model.variant == "Qwen3-Next-80B-A3B"
    assert model.depth_acceptance[:3] == (0.873, 0.778, 0.675)


def test_published_sibling_shares_are_used():
    """DDTree (vllm PR 42910): rank-1 alternative 37% of first mismatches, top-3 alternatives 58%."""
    for name in ("qwen3.5-mtp-mbpp", "qwen3.5-mtp-gsm8k", "qwen3.5-mtp-cnndm"):
        model = load_acceptance(name)
        a = model.depth_acceptance[0]
        assert model.child_probability(1, 2) == pytest.approx((1 - a) * 0.37)
        assert sum(model.child_probability(1, r) for r in (2, 3, 4)) == pytest.approx((1 - a) * 0.58)
        assert model.branch_continuation == pytest.approx(0.22 / 0.745, abs=0.001)


def test_unconditional_rates_convert_to_conditional():
    assert conditional_from_unconditional([0.867, 0.743, 0.615]) == pytest.approx((0.867, 0.857, 0.82772), abs=1e-4)
    assert conditional_from_unconditional([0.5, 0.0, 0.0]) == (0.5, 0.0, 0.0)


def write(tmp_path, **fields):
    path = tmp_path / "p.yaml"
    path.write_text(json.dumps({"name": "p", **fields}))
    return str(path)


@pytest.mark.parametrize("fields, message", [
    ({"depth_acceptance": [1.2], "alternative_share": [0.3]}, "depth_acceptance[0]: expected a probability"),
    ({"depth_acceptance": [0.9, float("nan")]}, "depth_acceptance[1]"),
    ({"depth_acceptance_unconditional": [0.8, 0.6, 0.7]}, "depth_acceptance_unconditional[2]: 0.7 > 0.6"),
    ({"depth_acceptance": [0.9], "alternative_share": [0.2, 0.3]}, "alternative_share[1]: 0.3 > 0.2"),
    ({"depth_acceptance": [0.9], "alternative_share": [0.6, 0.5]}, "alternative_share: sums to 1.100"),
    ({"depth_acceptance": [0.9, 0.2], "alternative_share": [0.5]}, "depth_acceptance[1]: 0.2 makes the rank-2"),
    ({"depth_acceptance": [0.9], "branch_continuation": 1.5}, "branch_continuation: expected a probability"),
    ({"depth_acceptance": [0.9], "depth_acceptance_unconditional": [0.9]}, "give it or depth_acceptance_uncond"),
    ({"depth_acceptance": [0.9], "rank_share": [1.0]}, "rank_share: unknown field"),
    ({"depth_acceptance": [0.9], "models": {"X": {"depth_acceptance": [-0.1]}}}, "models.X: depth_acceptance[0]"),
], ids=["above-1", "nan", "unconditional-rises", "shares-rise", "shares-exceed-1", "rank2-above-rank1",
        "continuation", "both-forms", "unknown-field", "variant"])
def test_bad_profiles_are_refused_naming_file_and_field(tmp_path, fields, message):
    path = write(tmp_path, **fields)
    with pytest.raises(ProfileError) as info:
        load_acceptance(path)
    assert path in str(info.value) and message in str(info.value), str(info.value)


def test_unknown_profile_names_the_known_ones():
    with pytest.raises(ProfileError, match="acceptance model 'nope': unknown.*qwen3.5-mtp-mbpp"):
        load_acceptance("nope")


def test_fit_rejection_scale_hits_its_target():
    base = AcceptanceModel("b", (0.8, 0.7, 0.6))
    factor, fitted = fit_rejection_scale(base, 1.5, lambda m: m.chain_accepted(3))
    assert fitted.chain_accepted(3) == pytest.approx(1.5, abs=1e-9)
    assert 1 - fitted.depth_acceptance[0] == pytest.approx(factor * 0.2)
    with pytest.raises(ValueError, match="target 3.5"):
        fit_rejection_scale(base, 3.5, lambda m: m.chain_accepted(3))


def synthetic_log(path, model, rounds=6000, width=3, depth=4, seed=0):
    """Rounds drafted as full trees of the given width and depth; acceptance drawn from ``model``, which the
    simulation reads only through the definition of its terms (not `child_probability`)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rounds):
            parents, ranks = [], []
            frontier = [-1]
            for _d in range(depth):
                nxt = []
                for p in frontier:
                    for r in range(1, width + 1):
                        parents.append(p)
                        ranks.append(r)
                        nxt.append(len(parents) - 1)
                frontier = nxt[:width]
            depths = tree_depths(parents)
            accepted, current, off = [], -1, False
            while True:
                kids = [i for i, p in enumerate(parents) if p == current]
                if not kids:
                    break
                a = model.depth_acceptance[min(1 if current < 0 else depths[current] + 1, 4) - 1]
                scale = model.branch_continuation if off else 1.0
                u, chosen = rng.random(), None
                for kid in kids:
                    share = a if ranks[kid] == 1 else (1 - a) * model.alternative_share[ranks[kid] - 2]
                    u -= share * scale
                    if u < 0:
                        chosen = kid
                        break
                if chosen is None:
                    break
                accepted.append(chosen)
                off = off or ranks[chosen] > 1
                current = chosen
            f.write(json.dumps({"parents": parents, "ranks": ranks, "accepted": accepted}) + "\n")
    return path


def test_calibration_recovers_a_known_model(tmp_path):
    truth = AcceptanceModel("truth", (0.75, 0.65, 0.55, 0.45), (0.4, 0.25), 0.4)
    fitted, stats = calibrate(synthetic_log(tmp_path / "log.jsonl", truth), max_rank=3)
    assert stats["rounds"] == 6000
    assert fitted.depth_acceptance == pytest.approx(truth.depth_acceptance, abs=0.03)
    assert fitted.alternative_share == pytest.approx(truth.alternative_share, abs=0.04)
    assert fitted.branch_continuation == pytest.approx(truth.branch_continuation, abs=0.06)


@pytest.mark.parametrize("line, message", [
    ('{"parents": [0], "ranks": [1], "accepted": []}', "must precede"),
    ('{"parents": [-1], "ranks": [1, 1], "accepted": []}', "ranks has 2 entries"),
    ('{"parents": [-1, 0], "ranks": [1, 1], "accepted": [1]}', "not on a path"),
    ('{"parents": [-1], "ranks": [0], "accepted": []}', "ranks start at 1"),
    ('not json', "expected an object"),
])
def test_calibration_rejects_bad_logs(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        calibrate(path)
