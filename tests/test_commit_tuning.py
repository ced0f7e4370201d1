"""The commit's launch as tuning knobs: `CommitConfig`, the commit search space, studies over commit buckets
(one-layer and all-layer launches) that record only configs whose pool matches `commit_closed_form`, the
database's ``commit_configs`` section, the runtime lookup behind ``tree_commit(config=None)``, and the
profiler's round curves. Kernels run under TRITON_INTERPRET=1 on tiny shapes (Hv 2, dk = dv = 32)."""

import dataclasses
import inspect
import json
import math
import time
import warnings

import optuna
import pytest
import torch

from bole_tune import database, lookup
from bole_tune.commit_bench import COMMIT_TOLERANCE, CommitBench
from bole_tune.config import COMMIT_FALLBACK_PROGRAMS, CommitConfig, KernelConfig, default_commit_config
from bole_tune.database import CommitKey, DatabaseError, ShapeKey
from bole_tune.kernels import LayerResults, tree_commit, tree_commit_layers, tree_verify
from bole_tune.kernels.reference import commit_closed_form
from bole_tune.kernels.verify import tree_commit as commit_module
from bole_tune.profiles import ProfileError, resolve_model
from bole_tune.runners import GPURunner, Measurement, ReplayRunner
from bole_tune.search_space import SearchSpace, feasible
from bole_tune.shapes import HeadShape
from bole_tune.tuner import study_name, tune_bucket, tune_bucket_buffered
from bole_tune.workloads import make_inputs, make_tree
from conftest import HAS_CUDA
from helpers import TOLERANCE, assert_close
from test_database import shape_key

F32, BF16 = torch.float32, torch.bfloat16
TINY = HeadShape(hk=1, hv=2, dk=32, dv=32)
NINE_B = HeadShape(hk=16, hv=32, dk=128, dv=128)
GPU = torch.device("cuda", 0)  # a device object only: nothing runs on it in these tests
SLUG = "test-gpu"
SPACE = SearchSpace.load(kind="commit")
TINY_SPACE_TEXT = """b_k: [16]
b_v: [16]
num_warps: [2]
num_stages: [1]
commit:
  b_k: [16, 32]
  b_v: [16]
  v_span: [16, 32]
  num_warps: [2]
  num_stages: [2]
"""


def commit_key(heads=NINE_B, tree=64, batch=16, layers=1, dtype="bf16", tp=1) -> CommitKey:
    return CommitKey(shape=ShapeKey(heads=heads, dtype=dtype, tree_bucket=tree, batch_bucket=batch, tp=tp),
                     layers=layers)


def commit_entry(key: CommitKey, config: CommitConfig, p50: float = 10.0) -> dict:
    return {"key": key.as_dict(), "config": config.as_dict(),
            "latency_us": {"p20": p50 - 1, "p50": p50, "p80": p50 + 1}, "rel_error": 1e-7,
            "trials": {"total": 12, "measured": 10}, "provenance": {"date": database.now()}}


# ---- the config ---------------------------------------------------------------------------------

def test_commit_config_knobs_and_round_trips():
    config = CommitConfig(b_k=128, b_v=16, v_span=64, num_warps=2, num_stages=3)
    assert CommitConfig.knobs() == ("b_k", "b_v", "v_span", "num_warps", "num_stages", "tma")
    assert config.text == "128/16/64/2/3" and CommitConfig.from_text(config.text) == config
    assert CommitConfig.from_dict(config.as_dict()) == config
    assert CommitConfig.from_dict({"b_k": 32, "b_v": 16, "v_span": 32}) == CommitConfig(32, 16, 32, 2, 3)
    assert config.fits(128, 128) and not config.fits(32, 128) and not config.fits(128, 32)
    assert config.programs(128, 128) == 2
    assert KernelConfig.from_text("64/32/4/2") == KernelConfig(64, 32, 4, 2)  # the verifier's config unchanged


@pytest.mark.parametrize("make, message", [
    (lambda: CommitConfig(48, 16, 64), "CommitConfig.b_k: expected a power of two >= 16"),
    (lambda: CommitConfig(64, 8, 64), "CommitConfig.b_v: expected a power of two >= 16"),
    (lambda: CommitConfig(64, 16, 24), "CommitConfig.v_span: expected a power of two >= 16"),
    (lambda: CommitConfig(64, 32, 16), "CommitConfig.b_v: expected at most v_span"),
    (lambda: CommitConfig(64, 16, 64, num_warps=3), "CommitConfig.num_warps"),
    (lambda: CommitConfig(64, 16, 64, num_stages=0), "CommitConfig.num_stages"),
    (lambda: CommitConfig(64, True, 64), "CommitConfig.b_v"),
    (lambda: CommitConfig.from_dict({"b_k": 64, "b_v": 16}), "v_span: missing"),
    (lambda: CommitConfig.from_dict({"b_k": 64, "b_v": 16, "v_span": 64, "b_t": 16}), "b_t: unknown knob"),
    (lambda: CommitConfig.from_text("64/16/64"), "expected 5 values"),
], ids=["b_k", "b_v", "v_span", "b_v-above-span", "warps", "stages", "bool", "missing", "unknown", "text"])
def test_commit_config_validation_names_the_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_the_untuned_fallback_fills_the_gpu_and_is_not_in_the_kernel_signature():
    # one request of the 9B: 32 heads -> spans of 16 rows and 64 columns give 32 x 8 x 2 = 512 >= 264 programs
    assert default_commit_config(32, 128, 128) == CommitConfig(64, 16, 16, 2, 3)
    assert default_commit_config(16 * 32, 128, 128) == CommitConfig(128, 16, 128, 2, 3)
    assert default_commit_config(24 * 32, 128, 128) == CommitConfig(128, 16, 128, 2, 3)  # all 24 layers at B=1
    small = default_commit_config(2, 32, 32)
    assert small == CommitConfig(32, 16, 16, 2, 3) and small.fits(32, 32)
    for programs in (1, 7, 32, 100, 264, 1000):
        config = default_commit_config(programs, 128, 128)
        assert programs * config.programs(128, 128) >= COMMIT_FALLBACK_PROGRAMS or config.v_span == 16
    for function in (tree_commit, tree_commit_layers):
        parameters = inspect.signature(function).parameters
        assert "config" in parameters and parameters["config"].default is None
        assert not {"b_k", "b_v", "num_warps", "v_span", "num_stages"} & set(parameters), function.__name__
    assert not hasattr(commit_module, "COMMIT_TARGET_PROGRAMS")


# ---- the kernel with given configs (interpreter) ------------------------------------------------

def commit_case(device, sizes=(9, 5), dtype=F32, seed=3):
    tree = make_tree(list(sizes), max_depth=6, seed=seed, device=device)
    x = make_inputs(tree, TINY.hk, TINY.hv, TINY.dk, TINY.dv, dtype, device, seed=seed)
    res = tree_verify(*x.args(tree))
    accepted = torch.tensor([sizes[0] - 1, -1], device=device)
    expected = x.state.clone()
    commit_closed_form(expected, x.state_indices, res, accepted)
    res.committed.zero_()
    return tree, x, res, accepted, expected


@pytest.mark.parametrize("config", [CommitConfig(16, 16, 16, 2, 2), CommitConfig(32, 16, 32, 4, 3),
                                    CommitConfig(32, 16, 32, 2, 3, tma=1), CommitConfig(16, 16, 16, 2, 2, tma=1)],
                         ids=lambda c: c.text)
def test_tree_commit_with_a_given_config_matches_the_closed_form(device, config, monkeypatch):
    monkeypatch.setattr(commit_module, "TMA_OFF_GPU", True)  # tma=1: by TMA here too (the interpreter runs it)
    tree, x, res, accepted, expected = commit_case(device)
    if config.tma and commit_module.use_triton(x.state.device):
        assert commit_module.tma_state_loads(x.state, config)
    tree_commit(x.state, x.state_indices, res, accepted, config=config)
    assert_close(x.state, expected, TOLERANCE[F32], f"pool after tree_commit with {config}")


def test_a_tma_commit_where_tma_cannot_read_falls_back_to_pointer_loads(device, monkeypatch):
    """A tma=1 launch over a pool TMA cannot read (strided, or off a GPU without the switch) reads by pointers:
    the same committed state, no error."""
    tree, x, res, accepted, expected = commit_case(device)
    config = CommitConfig(32, 16, 32, 2, 3, tma=1)
    slots, hv, dv, dk = x.state.shape
    strided = torch.zeros(slots, hv + 1, dv, dk, device=device)[:, :hv]  # each slot padded by a head
    strided.copy_(x.state)
    monkeypatch.setattr(commit_module, "TMA_OFF_GPU", True)
    assert not commit_module.tma_state_loads(strided, config)  # not contiguous
    assert not commit_module.tma_state_loads(x.state, CommitConfig(32, 512, 512, 2, 3, tma=1))  # taller than a box
    tree_commit(strided, x.state_indices, res, accepted, config=config)
    assert_close(strided, expected, TOLERANCE[F32], "strided pool after a tma=1 tree_commit")
    monkeypatch.setattr(commit_module, "TMA_OFF_GPU", False)
    if device == "cpu":
        assert not commit_module.tma_state_loads(x.state, config)
        expected_again = x.state.clone()
        res.committed.zero_()  # the strided commit marked the requests committed
        commit_closed_form(expected_again, x.state_indices, res, accepted)
        res.committed.zero_()
        tree_commit(x.state, x.state_indices, res, accepted, config=config)
        assert_close(x.state, expected_again, TOLERANCE[F32], "pool after a tma=1 tree_commit read by pointers")


def test_the_tma_knob_is_a_switch_and_a_pointer_config_keeps_its_text():
    assert CommitConfig(128, 16, 128, 2, 3).text == "128/16/128/2/3"
    assert CommitConfig(128, 16, 128, 2, 3, tma=1).text == "128/16/128/2/3/1"
    for text in ("128/16/128/2/3", "128/16/128/2/3/1", "128/16/128/2/3/0"):
        config = CommitConfig.from_text(text)
        assert config.tma == (1 if text.endswith("/1") else 0) and CommitConfig.from_text(config.text) == config
    assert CommitConfig.from_dict({"b_k": 32, "b_v": 16, "v_span": 32, "tma": 1}).tma == 1
    for bad in (2, -1, True, "1"):
        with pytest.raises(ValueError, match="CommitConfig.tma: expected 0 .pointer loads. or 1"):
            CommitConfig(32, 16, 32, tma=bad)
    assert "tma" in str(CommitConfig(32, 16, 32, tma=1)) and "tma" not in str(CommitConfig(32, 16, 32))


def test_a_bad_commit_config_is_refused_naming_the_argument(device):
    tree, x, res, accepted, _ = commit_case(device)
    with pytest.raises(TypeError, match="config: expected a CommitConfig or None, got KernelConfig"):
        tree_commit(x.state, x.state_indices, res, accepted, config=KernelConfig(16, 16, 2, 1))
    with pytest.raises(TypeError, match="config: expected a CommitConfig"):
        tree_commit(x.state, x.state_indices, res, accepted, config={"b_k": 16})
    if device == "cpu" and not commit_module.use_triton(torch.device("cpu")):
        return  # the PyTorch fallback has no tiles to check
    with pytest.raises(ValueError, match="config: tiles b_k=64, v_span=32 must divide dk=32, dv=32"):
        tree_commit(x.state, x.state_indices, res, accepted, config=CommitConfig(64, 16, 32))
    states = x.state[None].clone()
    results = LayerResults.empty(1, tree, TINY, F32, device)
    with pytest.raises(TypeError, match="config: expected a CommitConfig"):
        tree_commit_layers(states, x.state_indices, results, tree, accepted, config="128/16/128/2/3")


def test_config_none_asks_the_config_source_on_a_gpu_and_falls_back_elsewhere(monkeypatch):
    asked = []

    def source(*args):
        asked.append(args)
        return CommitConfig(32, 16, 32, 2, 2)

    previous = commit_module.set_commit_config_source(source)
    try:
        assert commit_module.commit_config(1, 2, 32, 32, BF16, 8, 1, 3, GPU) == CommitConfig(32, 16, 32, 2, 2)
        assert asked == [(1, 2, 32, 32, BF16, 8, 1, 3, GPU)]
        # off a GPU the source is not asked (no tuned binaries there): the untuned fallback
        assert commit_module.commit_config(1, 2, 32, 32, BF16, 8, 1, 3, torch.device("cpu")) == \
            default_commit_config(3 * 1 * 2, 32, 32)
        commit_module.set_commit_config_source(lambda *args: None)  # a source with nothing: the fallback
        assert commit_module.commit_config(1, 2, 32, 32, BF16, 8, 4, 1, GPU) == default_commit_config(8, 32, 32)
    finally:
        commit_module.set_commit_config_source(previous)


def test_the_default_config_source_is_the_database_lookup(db, monkeypatch):
    """Resolved by name on first use (kernels/ never imports the database layer): lookup.tuned_commit."""
    key = commit_key(layers=24)
    stored = CommitConfig(64, 32, 64, 4, 2)
    database.update(database.database_path(SLUG, db), commit_configs={key.text: commit_entry(key, stored)})
    monkeypatch.setattr(lookup, "_device_slug", lambda device: SLUG)
    previous = commit_module.set_commit_config_source(None)
    try:
        assert commit_module.commit_config(16, 32, 128, 128, BF16, 50, 13, 24, GPU) == stored
        assert commit_module._config_source is lookup.tuned_commit
    finally:
        commit_module.set_commit_config_source(previous)


# ---- the database and the lookup ---------------------------------------------------------------

@pytest.fixture
def db(tmp_path, monkeypatch):
    monkeypatch.setenv("BOLE_TUNE_DB", str(tmp_path))
    monkeypatch.delenv("BOLE_TUNE_LOOKUP", raising=False)
    lookup.clear_cache()
    yield tmp_path
    lookup.clear_cache()


def test_commit_keys_name_the_bucket_and_the_layers_per_launch():
    key = commit_key(layers=24, tp=4)
    assert key.text == "Hv32-Hk16-dk128-dv128-bf16-T64-B16-TP4-L24"
    assert CommitKey.from_dict(key.as_dict()) == key and key.programs_per_tile == 24 * 16 * 32
    assert CommitKey.bucketed(NINE_B, BF16, 50, 13, layers=24) == commit_key(layers=24)
    with pytest.raises(ValueError, match="CommitKey.layers"):
        CommitKey(shape=key.shape, layers=0)
    with pytest.raises(DatabaseError, match="key.layers: expected a positive int"):
        CommitKey.from_dict(key.shape.as_dict())


def test_the_commit_section_round_trips_beside_the_verifier_entries(tmp_path):
    path = tmp_path / "gpu.yaml"
    verify_key = shape_key()
    from test_database import entry as verify_entry

    database.update(path, configs={verify_key.text: verify_entry(verify_key)})
    one, all_layers = commit_key(), commit_key(layers=24)
    database.update(path, commit_configs={one.text: commit_entry(one, CommitConfig(128, 16, 128, 2, 3)),
                                          all_layers.text: commit_entry(all_layers, CommitConfig(64, 16, 64, 2, 3))})
    database.clear_cache()
    data = database.load(path)
    assert set(data["configs"]) == {verify_key.text}, "a commit write dropped the verifier's entries"
    assert data["commit_configs"][all_layers.text]["config"] == CommitConfig(64, 16, 64, 2, 3).as_dict()
    assert path.read_text().startswith("# bole-tune sha256 ") and "2 commit_configs" in path.read_text().split("\n")[0]
    # one merge rule: an entry replaces the one of its name, the others are kept
    database.update(path, commit_configs={one.text: commit_entry(one, CommitConfig(32, 16, 32, 2, 2))})
    data = database.load(path)
    assert data["commit_configs"][one.text]["config"]["b_k"] == 32 and all_layers.text in data["commit_configs"]
    found = database.search("gpu", tmp_path)
    assert found.source("commit_configs", one.text) == path


@pytest.mark.parametrize("mutate, field", [
    (lambda e: e["config"].update(v_span=24), ".config.CommitConfig.v_span"),
    (lambda e: e["config"].update(b_v=64, v_span=32), ".config.CommitConfig.b_v"),
    (lambda e: e["config"].update(b_k=256), ".config: tiles b_k=256"),
    (lambda e: e["key"].pop("layers"), ".key.layers"),
    (lambda e: e["key"].update(layers=2), ".key: describes"),
    (lambda e: e["latency_us"].pop("p50"), ".latency_us.p50"),
    (lambda e: e.pop("provenance"), ".provenance"),
], ids=["span", "b_v-above-span", "tile-too-wide", "no-layers", "other-key", "no-p50", "no-provenance"])
def test_a_bad_commit_entry_is_refused_naming_the_file_and_field(tmp_path, mutate, field):
    key = commit_key()
    entry = commit_entry(key, CommitConfig(128, 16, 128, 2, 3))
    mutate(entry)
    path = tmp_path / "gpu.yaml"
    with pytest.raises(DatabaseError, match=f"commit_configs.{key.text}{field}".replace(".", r"\.")):
        database.update(path, commit_configs={key.text: entry})
    assert not path.exists(), "a refused entry was written"


def test_lookup_returns_what_was_stored_exact_nearest_and_the_silent_fallback(db, monkeypatch):
    stored = {commit_key(batch=16): CommitConfig(128, 16, 128, 2, 3),
              commit_key(batch=1): CommitConfig(64, 16, 16, 2, 4),
              commit_key(batch=1, layers=24): CommitConfig(128, 32, 64, 4, 3)}
    database.update(database.database_path(SLUG, db),
                    commit_configs={k.text: commit_entry(k, c) for k, c in stored.items()})
    for key, config in stored.items():
        decision = lookup.decide_commit(key, SLUG)
        assert (decision.how, decision.config, decision.latency_us) == ("exact", config, 10.0), key.text
    # nearest by programs (layers x batch) and tree bucket: 24 layers at B=2 is next to 24 layers at B=1
    near = lookup.decide_commit(commit_key(batch=2, layers=24), SLUG)
    assert near.how == "nearest" and near.config == CommitConfig(128, 32, 64, 4, 3) and "24 layers" in near.reason
    assert lookup.decide_commit(commit_key(batch=8, tree=128), SLUG).config == CommitConfig(128, 16, 128, 2, 3)
    other = lookup.decide_commit(commit_key(heads=HeadShape(hk=16, hv=48, dk=128, dv=128)), SLUG)
    assert other.how == "default" and other.config == default_commit_config(16 * 48, 128, 128)
    monkeypatch.setenv("BOLE_TUNE_LOOKUP", "strict")
    with pytest.raises(LookupError, match="strict: no tuned commit config for .*-L24"):
        lookup.decide_commit(commit_key(batch=2, layers=24), SLUG)
    monkeypatch.setenv("BOLE_TUNE_LOOKUP", "default")
    assert lookup.decide_commit(commit_key(batch=1), SLUG).config == default_commit_config(32, 128, 128)
    monkeypatch.delenv("BOLE_TUNE_LOOKUP")
    # the runtime source: the stored config for the bucket, cached, no warning for a missing bucket
    monkeypatch.setattr(lookup, "_device_slug", lambda device: SLUG)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lookup.tuned_commit(16, 32, 128, 128, BF16, 64, 1, 24, GPU) == CommitConfig(128, 32, 64, 4, 3)
        assert lookup.tuned_commit(16, 32, 128, 128, BF16, 40, 9, 1, GPU) == CommitConfig(128, 16, 128, 2, 3)
        assert lookup.tuned_commit(16, 48, 128, 128, BF16, 64, 3, 1, GPU) == default_commit_config(3 * 48, 128, 128)


def test_the_cached_commit_lookup_costs_well_under_two_microseconds(db, monkeypatch):
    monkeypatch.setattr(lookup, "_device_slug", lambda device: SLUG)
    args = (16, 32, 128, 128, BF16, 64, 16, 1, GPU)
    lookup.tuned_commit(*args)
    runs = []
    for _ in range(7):  # the best of several runs: a loaded CI machine only adds time, never removes it
        start = time.perf_counter_ns()
        for _ in range(20_000):
            lookup.tuned_commit(*args)
        runs.append((time.perf_counter_ns() - start) / 20_000)
    assert min(runs) < 2000, runs
    assert lookup.commit_lookup_cost_ns(GPU, repeats=20_000) < 20_000  # the helper `bole-tune bench --lookup` prints


def test_the_shipped_database_serves_its_commit_entries_and_falls_back_cleanly(monkeypatch):
    """The shipped H200 file holds the tuned commit launches of the 9B, 27B and 122B (one layer, and all of the
    model's GDN layers per launch): lookup returns them; heads tuned for none of them (the 9B's split four ways by
    tensor parallelism: 4 key and 8 value heads) take the fallback rule, silently."""
    from test_shipped_data import SHIPPED

    monkeypatch.setenv("BOLE_TUNE_DB", str(SHIPPED))
    monkeypatch.delenv("BOLE_TUNE_LOOKUP", raising=False)
    monkeypatch.setattr(lookup, "_device_slug", lambda device: "nvidia-h200")
    lookup.clear_cache()
    try:
        data = database.load(SHIPPED / "nvidia-h200.yaml")
        entries = data["commit_configs"]
        heads = {32: 24, 48: 48, 64: 36}  # value heads -> GDN layers of the 9B, 27B, 122B
        assert data["configs"] and len(entries) == 48 * len(heads)
        for hv, layers in heads.items():
            mine = [e["key"] for e in entries.values() if e["key"]["hv"] == hv]
            assert len(mine) == 48 and {k["layers"] for k in mine} == {1, layers}, hv
        assert all(e["trials"]["wrong"] == 0 and e["trials"]["ok"] > 0 for e in entries.values())
        # the entries whose tuned launch is not the fallback's: lookup must return the stored one
        differ = [e["key"] for e in entries.values() if e["config"] != e["default_config"]]
        assert len({k["hv"] for k in differ}) == len(heads), "a model's entries all equal the fallback"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning spam where a commit entry is missing
            for key in differ:
                stored = entries[f"Hv{key['hv']}-Hk16-dk128-dv128-bf16-T{key['tree_bucket']}-B{key['batch_bucket']}-"
                                 f"L{key['layers']}"]["config"]
                config = lookup.tuned_commit(16, key["hv"], 128, 128, BF16, key["tree_bucket"], key["batch_bucket"],
                                             key["layers"], GPU)
                assert config == CommitConfig.from_dict(stored) != default_commit_config(
                    key["layers"] * key["batch_bucket"] * key["hv"], 128, 128)
            for layers in (1, 24):
                for batch in (1, 16):
                    config = lookup.tuned_commit(4, 8, 128, 128, BF16, 64, batch, layers, GPU)
                    assert config == default_commit_config(layers * batch * 8, 128, 128)
    finally:
        lookup.clear_cache()


# ---- the search space ---------------------------------------------------------------------------

def test_the_commit_search_space_holds_valid_configs_and_the_fallbacks():
    assert SPACE.kind == "commit" and SPACE.config_type is CommitConfig
    assert all(c.b_v <= c.v_span for c in SPACE.configs()) and SPACE.size == len(set(SPACE.configs()))
    assert SPACE.grid_size > SPACE.size  # b_v above v_span: points a grid visits and prunes
    for programs in (32, 64, 512, 768, 24 * 1024):  # the 9B's fallback at every batch, one layer or 24
        assert SPACE.contains(default_commit_config(programs, 128, 128))
    assert SearchSpace.load().size == 144 + 8, "the verifier's space is unchanged (144 Triton configs, 8 Gluon ones)"
    ok, reason = feasible(CommitConfig(128, 16, 128), 32, 32, 8, "bf16")
    assert not ok and "v_span=128 do not divide" in reason
    ok, reason = feasible(CommitConfig(128, 32, 128, 4, 8), 128, 128, 8, "bf16", shared_memory_limit=64 * 1024)
    assert not ok and "shared memory" in reason


def test_the_tma_knob_is_tuned_only_where_the_device_has_tma(tmp_path):
    from bole_tune.search_space import for_device

    assert SPACE.values["tma"] == (0, 1) and SPACE.size == 2 * for_device(SPACE, {}, "cpu").size
    for facts, kind, kept in (({"compute_capability": "9.0"}, "gpu", True), ({"compute_capability": "10.0"}, "gpu", True),
                              ({"compute_capability": "8.0"}, "gpu", False), ({}, "gpu", False),
                              ({"compute_capability": "9.0"}, "cpu", False), ({"compute_capability": "x"}, "gpu", False)):
        space = for_device(SPACE, facts, kind)
        assert (space.values["tma"] == (0, 1)) == kept, (facts, kind)
        assert all(c.tma == 0 for c in space.configs()) != kept
    path = tmp_path / "space.yaml"
    path.write_text(TINY_SPACE_TEXT)  # written before the knob: tma stays off
    assert SearchSpace.load(path, kind="commit").values["tma"] == (0,)
    path.write_text(TINY_SPACE_TEXT + "  tma: [0, 1]\n")
    assert SearchSpace.load(path, kind="commit").size == 2 * 2 * 2
    path.write_text(TINY_SPACE_TEXT + "  tma: [0, 2]\n")
    with pytest.raises(ProfileError, match="commit.CommitConfig.tma: expected 0"):
        SearchSpace.load(path, kind="commit")


@pytest.mark.parametrize("text, message", [
    ("b_k: [16]\nb_v: [16]\nnum_warps: [2]\nnum_stages: [1]\n", "commit: missing"),
    (TINY_SPACE_TEXT.replace("v_span: [16, 32]", "v_span: []"), "commit.v_span: the list is empty"),
    (TINY_SPACE_TEXT.replace("v_span: [16, 32]", "v_span: [16, 48]"), "commit.CommitConfig.v_span"),
    (TINY_SPACE_TEXT + "  b_t: [16]\n", "commit.b_t: unknown field"),
    (TINY_SPACE_TEXT.replace("v_span: [16, 32]", "v_span: [16]").replace("b_v: [16]\n  v", "b_v: [32]\n  v"),
     "commit: no valid config"),
], ids=["missing", "empty", "not-power-of-two", "unknown", "no-valid-config"])
def test_commit_search_space_errors(tmp_path, text, message):
    path = tmp_path / "space.yaml"
    path.write_text(text)
    with pytest.raises(ProfileError, match=message):
        SearchSpace.load(path, kind="commit")


# ---- the tuner ----------------------------------------------------------------------------------

def commit_cost(config: CommitConfig, key: CommitKey) -> float:
    """A landscape whose best launch has about 300 programs, 2 warps and 3 stages (like the H200's)."""
    programs = key.programs_per_tile * config.programs(key.heads.dk, key.heads.dv)
    return (5 + 3 * abs(math.log2(programs / 300)) + abs(config.num_warps - 2) + 0.5 * abs(config.num_stages - 3)
            + 0.3 * (config.b_v == 32))


def write_commit_recording(path, keys, wrong=(), cost=commit_cost):
    measurements = {}
    for key in keys:
        for c in SPACE.configs():
            t = cost(c, key)
            m = (Measurement("wrong", rel_error=0.3, message="relative error 3e-1 against commit_closed_form")
                 if c.text in wrong else Measurement("ok", t - 0.1, t, t + 0.1, 1e-7, method="replay"))
            measurements.setdefault(key.text, {})[c.text] = m.as_dict()
    path.write_text(json.dumps({"device": {"slug": "replay-gpu", "name": "Replay GPU"}, "measurements": measurements}))
    return path


def storage(tmp_path):
    return optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'studies.sqlite3'}")


def test_a_commit_study_finds_the_best_region_and_never_chooses_a_wrong_config(tmp_path):
    key = commit_key(batch=1, layers=24)
    best = min(SPACE.configs(), key=lambda c: commit_cost(c, key))
    runner = ReplayRunner(write_commit_recording(tmp_path / "rec.json", [key], wrong={best.text}))
    result = tune_bucket(runner, key, SPACE, storage(tmp_path), 24, "replay-gpu", warm_start=[best])
    assert result.best != best and result.counts["wrong"] == 1
    runner_up = min((c for c in SPACE.configs() if c != best), key=lambda c: commit_cost(c, key))
    assert result.best_measurement.p50_us <= 1.05 * commit_cost(runner_up, key), (result.best, result.counts)
    assert result.default == default_commit_config(24 * 32, 128, 128)  # the study starts from the fallback
    assert result.default_measurement.status == ("wrong" if result.default == best else "ok")
    assert result.study_name == f"bole-tune:replay-gpu:commit:{key.text}"
    trials = optuna.load_study(study_name=result.study_name, storage=storage(tmp_path)).trials
    assert [t.user_attrs["reason"] for t in trials if t.user_attrs.get("status") == "wrong"] == \
        ["relative error 3e-1 against commit_closed_form"]
    with pytest.raises(ValueError, match="needs the commit search space"):
        tune_bucket(runner, key, SearchSpace.load(), storage(tmp_path), 4, "replay-gpu")


def test_a_re_tune_measures_the_known_best_launch_with_its_switch_turned(tmp_path):
    """A 12-trial re-tune from the bucket's entry (a pointer-load launch) measures the same tiles with TMA loads
    too: on the H200 that twin was 4% faster at B=16, and a quick study that only sampled missed it."""
    from bole_tune.tuner import switch_twins

    key = commit_key(batch=16, layers=24)
    entry = CommitConfig(128, 16, 128, 2, 3)
    assert switch_twins(entry, SPACE) == [CommitConfig(128, 16, 128, 2, 3, tma=1)]
    assert switch_twins(entry, SearchSpace({**SPACE.values, "tma": (0,)}, kind="commit")) == []

    def cost(c, k):  # the entry's tiles are the best; TMA loads take 3% off any launch
        base = 5 + 0.5 * sum(getattr(c, n) != getattr(entry, n) for n in ("b_k", "b_v", "v_span", "num_warps",
                                                                            "num_stages"))
        return base * (0.97 if c.tma else 1.0)

    runner = ReplayRunner(write_commit_recording(tmp_path / "rec.json", [key], cost=cost))
    result = tune_bucket(runner, key, SPACE, storage(tmp_path), 12, "replay-gpu", warm_start=[entry])
    assert result.best == CommitConfig(128, 16, 128, 2, 3, tma=1), result.best


def test_a_buffered_study_is_stored_and_never_measured_twice(tmp_path):
    key = commit_key(batch=4)
    runner = ReplayRunner(write_commit_recording(tmp_path / "rec.json", [key]))
    first = tune_bucket_buffered(runner, key, SPACE, storage(tmp_path), 10, "replay-gpu")
    calls = runner.calls
    assert 0 < calls <= 10 and first.counts["total"] == 10
    stored = optuna.load_study(study_name=study_name("replay-gpu", key), storage=storage(tmp_path))
    assert len(stored.trials) == 10 and stored.user_attrs["key"] == key.as_dict()
    again = tune_bucket_buffered(runner, key, SPACE, storage(tmp_path), 10, "replay-gpu")
    assert runner.calls == calls and again.best == first.best
    more = tune_bucket_buffered(runner, key, SPACE, storage(tmp_path), 16, "replay-gpu")  # continues, then replaces
    assert more.counts["total"] == 16 and runner.calls <= calls + 6
    assert len(optuna.load_study(study_name=study_name("replay-gpu", key), storage=storage(tmp_path)).trials) == 16


def tiny_model(layers: int = 2):
    """A model profile with tiny GDN heads and ``layers`` GDN layers (one attention layer in four)."""
    return dataclasses.replace(resolve_model("qwen3.5-9b"), name="Tiny", gdn=TINY, num_layers=layers)


def broken(real, bad: CommitConfig, how: str):
    """``real`` (tree_commit or tree_commit_layers), except that with ``bad`` it also corrupts the pool."""
    def commit(state, slots, *args, config=None, **kwargs):
        real(state, slots, *args, config=config, **kwargs)
        if config == bad:
            view = state if state.dim() == 5 else state[None]
            if how == "value":
                view[:, slots[0].long()] += 1e-2  # a committed slot off by a little
            else:
                view[:, -1] += 1.0  # a slot no request names
    return commit


@pytest.mark.parametrize("how", ["value", "other-slot"])
def test_the_tuner_records_only_configs_whose_pool_matches_the_reference(tmp_path, monkeypatch, how):
    """GPURunner on the interpreter: each candidate's pool is checked against commit_closed_form (one-layer and
    all-layer launches); an injected wrong config is measured 'wrong', never timed, never written."""
    from bole_tune import commit_bench
    from bole_tune.profiler import make_plan, plan_commit_keys, tune_commit

    bad = CommitConfig(16, 16, 16, 2, 2)
    monkeypatch.setattr(commit_bench, "tree_commit", broken(tree_commit, bad, how))
    monkeypatch.setattr(commit_bench, "tree_commit_layers", broken(tree_commit_layers, bad, how))
    timed = []
    real_time = CommitBench.time
    monkeypatch.setattr(CommitBench, "time", lambda self, config, repeats=30: timed.append(config) or
                        real_time(self, config, repeats))
    (tmp_path / "space.yaml").write_text(TINY_SPACE_TEXT)
    space = SearchSpace.load(tmp_path / "space.yaml", kind="commit")
    plan = make_plan([tiny_model()], dtype="fp32", batches=[1], tree_sizes=[8], trials=4, repeats=3, commit=True)
    keys = plan_commit_keys(plan)
    assert [k.layers for k in keys] == [1, 2]
    db_path = tmp_path / "db" / "cpu.yaml"
    result = tune_commit(plan, GPURunner("cpu", repeats=3), db_path, f"sqlite:///{tmp_path / 's.db'}",
                         space=space, sampler="grid")
    assert bad not in timed and len(timed) == 2 * (space.size - 1)
    data = database.load(db_path)
    assert set(data["commit_configs"]) == {k.text for k in keys}
    for r in result.commit_tuned:
        assert r.counts["wrong"] == 1 and r.counts["ok"] == space.size - 1 and r.best != bad
        entry = data["commit_configs"][r.key.text]
        assert CommitConfig.from_dict(entry["config"]) == r.best and entry["rel_error"] <= COMMIT_TOLERANCE
        assert entry["provenance"]["triton"] and entry["trials"]["wrong"] == 1
    if how != "value":
        return
    # a space holding only the wrong config records nothing for the bucket
    (tmp_path / "bad.yaml").write_text(TINY_SPACE_TEXT.replace("b_k: [16, 32]", "b_k: [16]")
                                       .replace("v_span: [16, 32]", "v_span: [16]"))
    only_bad = SearchSpace.load(tmp_path / "bad.yaml", kind="commit")
    other = tmp_path / "db2" / "cpu.yaml"
    result = tune_commit(plan, GPURunner("cpu", repeats=3), other, f"sqlite:///{tmp_path / 's2.db'}",
                         space=only_bad)
    assert all(r.best is None for r in result.commit_tuned)
    assert not other.exists() or not database.load(other)["commit_configs"]


def test_the_commit_bench_refuses_a_pool_it_did_not_commit(monkeypatch):
    """Without the fault injection, every config of the tiny space passes; a launch that commits nothing fails."""
    bench = CommitBench(commit_key(heads=TINY, tree=8, batch=1, layers=2, dtype="fp32"), "cpu")
    for config in SearchSpace.load(kind="commit").configs()[:2]:
        if config.fits(32, 32):
            assert bench.error(config) <= COMMIT_TOLERANCE
    from bole_tune import commit_bench

    monkeypatch.setattr(commit_bench, "tree_commit_layers", lambda *args, **kwargs: None)
    assert bench.error(CommitConfig(32, 16, 32, 2, 2)) > 1e-2


# ---- the profiler's round curves and the budget --------------------------------------------------

@pytest.mark.skipif(HAS_CUDA, reason="runs the CPU profile; on a GPU profile tunes for real")
def test_the_profile_records_a_round_curve(tmp_path, monkeypatch):
    from bole_tune import profiler

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a user's CPU run: the PyTorch fallback
    plan = profiler.make_plan([tiny_model()], curve_batches=[1, 2], curve_tree_sizes=[8], repeats=3)
    result = profiler.profile(plan, db_dir=tmp_path)
    (path,) = tmp_path.glob("*.yaml")
    curves = database.load(path)["curves"]
    rounds = curves["Tiny/round_verify_commit_cpu_fallback/bf16"]
    assert [(p["batch"], p["tree_size"]) for p in rounds["points"]] == [(1, 8), (2, 8)]
    assert all(p["p50"] > 0 for p in rounds["points"])
    assert {r["kernel"] for r in result.curve_rows} == set(profiler.curve_kernels(False))
    assert profiler.curve_kernels(True) == ["tree_verify_tuned", "tree_verify_default", "serial_verify", "tree_commit",
                                            "round_verify_commit", "round_folded", "round_ring", "round_serial"]
    assert "round_serial" not in profiler.curve_kernels(True, serial=False)


def test_a_round_times_the_tuned_verify_and_the_given_commit_together(device, monkeypatch):
    from bole_tune import profiler
    from bole_tune.bench import BenchCase, CaseBench

    used = []
    real = profiler.tree_commit
    monkeypatch.setattr(profiler, "tree_commit", lambda *a, config=None, **k: used.append(config) or
                        real(*a, config=config, **k))
    bench = CaseBench(BenchCase(TINY, 1, 8, F32), device)
    config = CommitConfig(32, 16, 32, 2, 2)
    timing = profiler.time_round(bench, None, config, repeats=3, most_sets=2)
    assert timing.p50_us > 0 and used and set(used) == {config}


def test_the_step_round_the_budget_reads_commits_with_the_database_config(device, monkeypatch):
    """`bole-tune step` times a GDN layer's round through gdn_tree_commit -> tree_commit(config=None): the config
    source's launch (the tuned one on a GPU). The budget reads that step curve; nothing else to switch."""
    from bole_tune.gdn_layer import GDNStepResult, gdn_tree_commit

    asked = []
    real = commit_module.commit_config
    monkeypatch.setattr(commit_module, "commit_config", lambda *args: asked.append(args) or real(*args))
    tree, x, res, accepted, expected = commit_case(device)
    channels = 2 * TINY.hk * TINY.dk + TINY.hv * TINY.dv
    conv_state = torch.zeros(x.state.shape[0], channels, 3, device=device)
    step = GDNStepResult(o=res.o, verify=res, conv_inputs=torch.randn(tree.num_nodes, channels, device=device))
    gdn_tree_commit(x.state, conv_state, x.state_indices, step, accepted)
    assert_close(x.state, expected, TOLERANCE[F32], "pool after gdn_tree_commit")
    if commit_module.use_triton(x.state.device):
        assert asked and asked[0][7] == 1, "the step's commit did not ask for the one-layer launch's config"


# ---- the command line ---------------------------------------------------------------------------

def test_tune_commit_replay_then_lookup_from_the_command_line(tmp_path, capsys):
    from bole_tune.cli import main
    from test_cli import run

    keys = [commit_key(batch=16), commit_key(batch=16, layers=24)]
    recording = write_commit_recording(tmp_path / "rec.json", keys)
    db_dir = tmp_path / "db"
    storage_url = f"sqlite:///{tmp_path / 's.db'}"
    result = run("tune", "--commit", "--replay", str(recording), "--model", "qwen3.5-9b", "--batch", "16",
                 "--tree-size", "64", "--trials", "10", "--storage", storage_url, "--db-dir", str(db_dir))
    assert result.returncode == 0, result.stderr
    assert "tuned commit configs" in result.stdout and keys[1].text in result.stdout
    data = database.load(db_dir / "replay-gpu.yaml")
    assert set(data["commit_configs"]) == {k.text for k in keys}
    assert all(e["trials"]["total"] == 10 for e in data["commit_configs"].values())
    capsys.readouterr()
    lookup_args = ["lookup", "--gpu", "replay-gpu", "--hv", "32", "--hk", "16", "--dk", "128", "--dv", "128",
                   "--tree-size", "50", "--batch", "12"]
    assert main([*lookup_args, "--commit", "--layers", "24", "--json", "--db-dir", str(db_dir)]) == 0
    decision = json.loads(capsys.readouterr().out)
    assert decision["how"] == "exact" and decision["key"] == keys[1].text
    assert decision["config"] == data["commit_configs"][keys[1].text]["config"]
    assert main(["show", "--gpu", "replay-gpu", "--db-dir", str(db_dir)]) == 0
    assert "commit_configs (2" in capsys.readouterr().out
    for args, message in (
            (["tune", "--commit", "--replay", str(recording), "--workers", "2"], "--workers"),
            (["tune", "--commit", "--replay", str(recording), "--trials", "500"],
             "--trials: 500 is more than the 252 configs of the commit search space"),
            ([*lookup_args, "--layers", "24"], "--layers: only with --commit")):
        assert main([*args, "--db-dir", str(db_dir)]) == 2, args
        assert message in " ".join(capsys.readouterr().err.split()), args
