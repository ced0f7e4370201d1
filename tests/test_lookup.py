"""Runtime lookup: exact, nearest, default and strict policies; one warning per miss."""

import warnings

import pytest
import torch

from bole_tune import database, lookup
from bole_tune.config import KernelConfig, default_config
from bole_tune.database import ShapeKey
from test_database import entry

SLUG = "test-gpu"


@pytest.fixture
def db(tmp_path, monkeypatch):
    monkeypatch.setenv("BOLE_TUNE_DB", str(tmp_path))
    monkeypatch.delenv("BOLE_TUNE_LOOKUP", raising=False)
    lookup.clear_cache()
    keys = {"T64-B16": ShapeKey(32, 16, 128, 128, "bf16", 64, 16), "T16-B1": ShapeKey(32, 16, 128, 128, "bf16", 16, 1)}
    database.update(database.database_path(SLUG, tmp_path),
                    configs={keys["T64-B16"].text: entry(keys["T64-B16"], b_v=128),
                             keys["T16-B1"].text: entry(keys["T16-B1"], b_v=16)})
    yield tmp_path
    lookup.clear_cache()


def test_exact(db):
    d = lookup.decide(ShapeKey(32, 16, 128, 128, "bf16", 64, 16), SLUG)
    assert d.how == "exact" and d.config.b_v == 128 and d.latency_us == 40.0


def test_nearest_bucket(db):
    d = lookup.decide(ShapeKey(32, 16, 128, 128, "bf16", 128, 16), SLUG)
    assert d.how == "nearest" and d.config.b_v == 128, "T128/B16 should take T64/B16, one step away"
    d = lookup.decide(ShapeKey(32, 16, 128, 128, "bf16", 8, 2), SLUG)
    assert d.how == "nearest" and d.config.b_v == 16


def test_other_heads_fall_back_to_default(db):
    d = lookup.decide(ShapeKey(64, 16, 128, 128, "bf16", 64, 16), SLUG)
    assert d.how == "default" and d.config == default_config(128, 128)


def test_nearest_skips_configs_that_do_not_fit(db, tmp_path):
    small = ShapeKey(4, 4, 32, 32, "fp32", 64, 1)
    bad = entry(small)
    bad["config"]["b_v"] = 64  # cannot tile dv=32
    database.update(database.database_path(SLUG, db), configs={small.text: bad})
    d = lookup.decide(ShapeKey(4, 4, 32, 32, "fp32", 32, 1), SLUG)
    assert d.how == "default"


def test_strict_and_default_policies(db, monkeypatch):
    monkeypatch.setenv("BOLE_TUNE_LOOKUP", "strict")
    assert lookup.decide(ShapeKey(32, 16, 128, 128, "bf16", 64, 16), SLUG).how == "exact"
    with pytest.raises(LookupError, match="strict"):
        lookup.decide(ShapeKey(32, 16, 128, 128, "bf16", 128, 16), SLUG)
    monkeypatch.setenv("BOLE_TUNE_LOOKUP", "default")
    d = lookup.decide(ShapeKey(32, 16, 128, 128, "bf16", 64, 16), SLUG)
    assert d.how == "default" and d.config == default_config(128, 128)
    monkeypatch.setenv("BOLE_TUNE_LOOKUP", "fastest")
    with pytest.raises(ValueError, match="BOLE_TUNE_LOOKUP: unknown policy 'fastest'"):
        lookup.policy()


def test_one_warning_per_miss_and_for_another_triton(db, monkeypatch):
    monkeypatch.setattr(lookup, "_device_slug", lambda device: SLUG)
    shape = type("S", (), {"hv": 32, "hk": 16, "dk": 128, "dv": 128})()
    tree = type("T", (), {"max_tree_size": 100, "num_requests": 16})()
    other_tree = type("T", (), {"max_tree_size": 120, "num_requests": 15})()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            config = lookup.config_for(shape, torch.bfloat16, tree, torch.device("cuda", 0))
        lookup.config_for(shape, torch.bfloat16, other_tree, torch.device("cuda", 0))  # same bucket T128-B16
    assert config == KernelConfig(64, 128, 8, 2)
    misses = [w for w in caught if "no tuned config" in str(w.message)]
    assert len(misses) == 1, [str(w.message) for w in caught]
    assert not [w for w in caught if "was tuned with triton" in str(w.message)]


def test_database_from_another_triton_is_used_with_one_warning(db, monkeypatch):
    stale_key = ShapeKey(32, 16, 128, 128, "bf16", 32, 4)
    stale = entry(stale_key, b_v=32)
    stale["provenance"]["triton"] = "0.0.1"
    path = database.database_path("old-gpu", db)
    database.update(path, configs={stale_key.text: stale})
    monkeypatch.setattr(lookup, "_device_slug", lambda device: "old-gpu")
    shape = type("S", (), {"hv": 32, "hk": 16, "dk": 128, "dv": 128})()
    tree = type("T", (), {"max_tree_size": 32, "num_requests": 4})()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert lookup.config_for(shape, torch.bfloat16, tree, torch.device("cuda", 0)).b_v == 32
    assert len([w for w in caught if "was tuned with triton 0.0.1" in str(w.message)]) == 1


def test_unreadable_database_falls_back_with_a_warning(db, monkeypatch):
    database.database_path(SLUG, db).write_text("schema_version: [")
    monkeypatch.setattr(lookup, "_device_slug", lambda device: SLUG)
    shape = type("S", (), {"hv": 32, "hk": 16, "dk": 128, "dv": 128})()
    tree = type("T", (), {"max_tree_size": 64, "num_requests": 16})()
    with pytest.warns(UserWarning, match="unreadable database"):
        assert lookup.config_for(shape, torch.bfloat16, tree, torch.device("cuda", 0)) == default_config(128, 128)


def test_tensor_parallel_entries_serve_the_ranks_heads(db, monkeypatch):
    """A TP4 deployment of Qwen3.5-122B-A10B runs 16 value and 4 key heads per rank."""
    from bole_tune.profiles import resolve_model

    shape = resolve_model("qwen3.5-122b-a10b").gdn(tp=4)
    assert (shape.hv, shape.hk) == (16, 4)
    tp_key = ShapeKey(shape.hv, shape.hk, 128, 128, "bf16", 64, 16, tp=4)
    assert tp_key.text.endswith("-TP4")
    database.update(database.database_path(SLUG, db), configs={tp_key.text: entry(tp_key, b_v=64)})
    decision = lookup.decide(ShapeKey(16, 4, 128, 128, "bf16", 64, 16), SLUG)
    assert decision.how == "exact" and decision.config.b_v == 64
    monkeypatch.setattr(lookup, "_device_slug", lambda device: SLUG)
    runtime_shape = type("S", (), {"hv": 16, "hk": 4, "dk": 128, "dv": 128})()
    tree = type("T", (), {"max_tree_size": 64, "num_requests": 16})()
    assert lookup.config_for(runtime_shape, torch.bfloat16, tree, torch.device("cuda", 0)).b_v == 64
    with pytest.raises(ValueError, match="tp=3"):
        resolve_model("qwen3.5-122b-a10b").gdn(tp=3)


def test_the_kernel_a_config_was_tuned_on_comes_with_it(db, monkeypatch):
    """Entries name the tree_verify variant they were tuned on; older entries (no field) were all fused."""
    from bole_tune.kernels.common import VerifyShape
    from bole_tune.kernels.tree_verify import resolve_launch
    from bole_tune.tree import TreeBatch

    key = ShapeKey(32, 16, 128, 128, "bf16", 32, 16)
    tuned = entry(key, b_v=64)
    tuned["kernel"] = "resident"
    database.update(database.database_path(SLUG, db), configs={key.text: tuned})
    assert lookup.decide(key, SLUG).kernel == "resident"
    assert lookup.decide(ShapeKey(32, 16, 128, 128, "bf16", 64, 16), SLUG).kernel == "fused"
    assert lookup.decide(ShapeKey(64, 16, 128, 128, "bf16", 64, 16), SLUG).kernel is None  # the default

    monkeypatch.setattr(lookup, "_device_slug", lambda device: SLUG)
    shape = VerifyShape(16 * 20, 16, 16, 16, 32, 128, 128, 128 ** -0.5)
    tree = TreeBatch.from_parents([[-1] + list(range(19))] * 16)
    device = torch.device("cuda", 0)
    assert resolve_launch(shape, torch.bfloat16, tree, device) == (KernelConfig(64, 64, 8, 2), "resident")
    # an explicit variant wins; an explicit config takes the variant by batch and tree size
    assert resolve_launch(shape, torch.bfloat16, tree, device, variant="fused")[1] == "fused"
    assert resolve_launch(shape, torch.bfloat16, tree, device, config=KernelConfig(16, 16, 2, 1))[1] == "resident"
    lookup.clear_cache()
    tree = TreeBatch.from_parents([[-1] + list(range(63))] * 16)  # T64-B16: tuned before the field existed
    assert resolve_launch(shape, torch.bfloat16, tree, device)[1] == "fused"
