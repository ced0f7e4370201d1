"""Runtime lookup: exact, nearest, default and strict policies; one warning per miss."""

import warnings

import pytest
import torch

from bole_tune import database, lookup
from bole_tune.config import KernelConfig, default_config
from bole_tune.shapes import HeadShape
from test_database import entry, shape_key

SLUG = "test-gpu"


@pytest.fixture
def db(tmp_path, monkeypatch):
    monkeypatch.setenv("BOLE_TUNE_DB", str(tmp_path))
    monkeypatch.delenv("BOLE_TUNE_LOOKUP", raising=False)
    lookup.clear_cache()
    keys = {"T64-B16": shape_key(), "T16-B1": shape_key(tree=16, batch=1)}
    database.update(database.database_path(SLUG, tmp_path),
                    configs={keys["T64-B16"].text: entry(keys["T64-B16"], b_v=128),
                             keys["T16-B1"].text: entry(keys["T16-B1"], b_v=16)})
    yield tmp_path
    lookup.clear_cache()


def test_exact(db):
    d = lookup.decide(shape_key(), SLUG)
    assert d.how == "exact" and d.config.b_v == 128 and d.latency_us == 40.0


def test_nearest_bucket(db):
    d = lookup.decide(shape_key(tree=128), SLUG)
    assert d.how == "nearest" and d.config.b_v == 128, "T128/B16 should take T64/B16, one step away"
    d = lookup.decide(shape_key(tree=8, batch=2), SLUG)
    assert d.how == "nearest" and d.config.b_v == 16


def test_other_heads_fall_back_to_default(db):
    d = lookup.decide(shape_key(hv=64), SLUG)
    assert d.how == "default" and d.config == default_config(128, 128)


def test_nearest_skips_configs_that_do_not_fit(db, tmp_path):
    small = shape_key(hv=4, hk=4, batch=1, dtype="fp32", dk=32, dv=32)
    bad = entry(small)
    bad["config"]["b_v"] = 64  # cannot tile dv=32
    database.update(database.database_path(SLUG, db), configs={small.text: bad})
    d = lookup.decide(shape_key(hv=4, hk=4, tree=32, batch=1, dtype="fp32", dk=32, dv=32), SLUG)
    assert d.how == "default"


def test_strict_and_default_policies(db, monkeypatch):
    monkeypatch.setenv("BOLE_TUNE_LOOKUP", "strict")
    assert lookup.decide(shape_key(), SLUG).how == "exact"
    with pytest.raises(LookupError, match="strict"):
        lookup.decide(shape_key(tree=128), SLUG)
    monkeypatch.setenv("BOLE_TUNE_LOOKUP", "default")
    d = lookup.decide(shape_key(), SLUG)
    assert d.how == "default" and d.config == default_config(128, 128)
    monkeypatch.setenv("BOLE_TUNE_LOOKUP", "fastest")
    with pytest.raises(ValueError, match="BOLE_TUNE_LOOKUP: unknown policy 'fastest'"):
        lookup.policy()


HEADS = HeadShape(hk=16, hv=32, dk=128, dv=128)
GPU = torch.device("cuda", 0)


def test_one_warning_per_miss_and_for_another_triton(db, monkeypatch):
    monkeypatch.setattr(lookup, "_device_slug", lambda device: SLUG)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            config, _ = lookup.tuned_launch(HEADS, torch.bfloat16, 100, 16, GPU)
        lookup.tuned_launch(HEADS, torch.bfloat16, 120, 15, GPU)  # same bucket T128-B16
    assert config == KernelConfig(64, 128, 8, 2)
    misses = [w for w in caught if "no tuned config" in str(w.message)]
    assert len(misses) == 1, [str(w.message) for w in caught]
    assert not [w for w in caught if "was tuned with triton" in str(w.message)]


def test_database_from_another_triton_is_used_with_one_warning(db, monkeypatch):
    stale_key = shape_key(tree=32, batch=4)
    stale = entry(stale_key, b_v=32)
    stale["provenance"]["triton"] = "0.0.1"
    path = database.database_path("old-gpu", db)
    database.update(path, configs={stale_key.text: stale})
    monkeypatch.setattr(lookup, "_device_slug", lambda device: "old-gpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert lookup.tuned_launch(HEADS, torch.bfloat16, 32, 4, GPU)[0].b_v == 32
    assert len([w for w in caught if "was tuned with triton 0.0.1" in str(w.message)]) == 1


def test_unreadable_database_falls_back_with_a_warning(db, monkeypatch):
    database.database_path(SLUG, db).write_text("schema_version: [")
    monkeypatch.setattr(lookup, "_device_slug", lambda device: SLUG)
    with pytest.warns(UserWarning, match="unreadable database"):
        assert lookup.tuned_launch(HEADS, torch.bfloat16, 64, 16, GPU) == (default_config(128, 128), None)
    monkeypatch.setenv("BOLE_TUNE_LOOKUP", "strict")
    lookup.clear_cache()
    with pytest.raises(database.DatabaseError, match=SLUG):
        lookup.tuned_launch(HEADS, torch.bfloat16, 64, 16, GPU)


def test_tensor_parallel_entries_serve_the_ranks_heads(db, monkeypatch):
    """A TP4 deployment of Qwen3.5-122B-A10B runs 16 value and 4 key heads per rank."""
    from bole_tune.profiles import resolve_model

    heads = resolve_model("qwen3.5-122b-a10b").heads(tp=4)
    assert heads == HeadShape(hk=4, hv=16, dk=128, dv=128)
    tp_key = shape_key(hv=heads.hv, hk=heads.hk, tp=4)
    assert tp_key.text.endswith("-TP4")
    database.update(database.database_path(SLUG, db), configs={tp_key.text: entry(tp_key, b_v=64)})
    decision = lookup.decide(shape_key(hv=16, hk=4), SLUG)
    assert decision.how == "exact" and decision.config.b_v == 64
    monkeypatch.setattr(lookup, "_device_slug", lambda device: SLUG)
    assert lookup.tuned_launch(heads, torch.bfloat16, 64, 16, GPU)[0].b_v == 64
    with pytest.raises(ValueError, match="tp=3"):
        resolve_model("qwen3.5-122b-a10b").heads(tp=3)


def test_the_kernel_a_config_was_tuned_on_comes_with_it(db, monkeypatch):
    """Entries name the tree_verify variant they were tuned on; older entries (no field) were all fused."""
    from bole_tune.kernels.verify.planner import Planner

    key = shape_key(tree=32)
    tuned = entry(key, b_v=64)
    tuned["kernel"] = "resident"
    database.update(database.database_path(SLUG, db), configs={key.text: tuned})
    assert lookup.decide(key, SLUG).kernel == "resident"
    assert lookup.decide(shape_key(), SLUG).kernel == "fused"
    assert lookup.decide(shape_key(hv=64), SLUG).kernel is None  # the default

    monkeypatch.setattr(lookup, "_device_slug", lambda device: SLUG)
    assert lookup.tuned_launch(HEADS, torch.bfloat16, 20, 16, GPU) == (KernelConfig(64, 64, 8, 2), "resident")
    planner = Planner(config_source=lookup.tuned_launch)

    def plan(max_tree_size, **kwargs):
        return planner.plan(HEADS, torch.bfloat16, num_requests=16, max_tree_size=max_tree_size, depth=8,
                            device=GPU, check=False, **kwargs)

    assert (plan(20).config, plan(20).variant) == (KernelConfig(64, 64, 8, 2), "resident")
    # an explicit variant wins; an explicit config takes the variant by batch and tree size
    assert plan(20, variant="fused").variant == "fused"
    assert plan(20, config=KernelConfig(16, 16, 2, 1)).variant == "resident"
    assert lookup.tuned_launch(HEADS, torch.bfloat16, 64, 16, GPU)[1] == "fused"  # tuned before the field existed
    assert plan(64).variant == "fused"


def test_lookup_cost_is_one_dictionary_access(db):
    assert lookup.lookup_cost_ns("cpu", repeats=1000) < 20_000
