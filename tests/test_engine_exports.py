"""Engine exports (bole_tune.engines): the files SGLang 0.5.23 and vLLM 0.33.0 load, run through the engines'
own parsers, and the errors bad budget entries get.

The engine half needs the engines' configuration code (python3 scripts/engine_packages.py [DIR]; the tests
read DIR from $BOLE_TUNE_ENGINE_PACKAGES, default ~/.cache/bole-tune/engine-packages). Without it those
tests skip visibly, or fail with one line when BOLE_TUNE_REQUIRE_ENGINES=1 (as in CI). Each engine runs
once per session, in a subprocess, on every file the fixtures export (about 15 s each on a CPU).
"""

import json
import os
import stat

import pytest
import yaml

from bole_tune.engines import ExportError, engine_settings, export_engine_settings, vllm_speculative_config
from bole_tune.engines.engine_check import EngineUnavailable, check_with_engine
from bole_tune.engines.exports import VLLM_LAST_RANGE_END

PACKAGES = os.environ.get("BOLE_TUNE_ENGINE_PACKAGES", os.path.expanduser("~/.cache/bole-tune/engine-packages"))


def batch_entry(batch, served, k=None, sglang=None, engine="sglang"):
    """One batch's entry in the budget schema: a chain of k draft tokens, or SGLang's (steps, topk, draft)."""
    steps, topk, draft = sglang or (k, 1, k + 1)
    nodes = draft if engine == "sglang" else k + 1
    entry = {"batch": batch, "serves": served, "shape": "chain" if topk == 1 else "tree",
             "nodes_per_request": nodes, "draft_tokens": nodes - 1, "tokens": batch * nodes,
             "depth": steps if engine == "sglang" else k, "width": topk, "parents": [-1] + list(range(nodes - 2)),
             "ranks": [1] * (nodes - 1), "expected_accepted": 2.5, "tokens_per_second": 100.0 * batch}
    if engine == "sglang":
        entry["sglang"] = {"speculative_num_steps": steps, "speculative_eagle_topk": topk,
                           "speculative_num_draft_tokens": draft}
    elif engine == "vllm":
        entry["vllm"] = {"num_speculative_tokens": k}
    return entry


def budget(engine, batches, workload="qwen3.5-mtp-mbpp"):
    return {"model": "Qwen3.5-9B", "dtype": "bf16", "tp": 1, "workload": workload, "engine": engine,
            "batches": batches}


def sglang_chains():
    return budget("sglang", {1: batch_entry(1, [1, 1], 5), 4: batch_entry(4, [2, 4], 3),
                             16: batch_entry(16, [5, None], 2)})


def sglang_tree_then_chain():
    """A top-4 tree at batch 1 and a chain above; keys as strings, as after a JSON round trip."""
    entry = budget("sglang", {1: batch_entry(1, [1, 1], sglang=(3, 4, 8)), 8: batch_entry(8, [2, None], 3)},
                   workload="qwen3.5-mtp-gsm8k")
    return json.loads(json.dumps(entry))


def vllm_chains():
    return budget("vllm", {1: batch_entry(1, [1, 1], 4, engine="vllm"), 2: batch_entry(2, [2, 2], 4, engine="vllm"),
                           8: batch_entry(8, [3, 8], 2, engine="vllm"),
                           32: batch_entry(32, [9, None], 1, engine="vllm")})


def served_by(entry, batch):
    """The batch entry serving ``batch`` by its ``serves`` range (None: no upper end)."""
    for settings in entry["batches"].values():
        low, high = settings["serves"]
        if low <= batch and (high is None or batch <= high):
            return settings
    raise AssertionError(f"no entry serves batch {batch}")


# --- the exporters, without the engines -----------------------------------------------------------------

def test_sglang_files_per_bucket_and_adaptive(tmp_path):
    paths = export_engine_settings(sglang_chains(), tmp_path)
    stem = "sglang-Qwen3.5-9B-qwen3.5-mtp-mbpp"
    assert [p.name for p in paths] == [f"{stem}-b1-1.yaml", f"{stem}-b2-4.yaml", f"{stem}-b5-max.yaml",
                                       f"{stem}-adaptive.json", f"{stem}-commands.txt"]
    assert yaml.safe_load(paths[1].read_text()) == {
        "speculative-algorithm": "NEXTN", "speculative-num-steps": 3, "speculative-eagle-topk": 1,
        "speculative-num-draft-tokens": 4}
    assert json.loads(paths[3].read_text()) == {"1": {"candidate_steps": [5]}, "2": {"candidate_steps": [3]},
                                                "5": {"candidate_steps": [2]}}
    commands = paths[4].read_text().splitlines()
    assert commands[1] == (f"python -m sglang.launch_server --model-path Qwen/Qwen3.5-9B --config {paths[1]} "
                           "--max-running-requests 4")
    assert "--speculative-adaptive-config" in commands[-1]
    for path in paths:
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path.name


def test_sglang_tree_gets_no_adaptive_config(tmp_path):
    export = engine_settings(sglang_tree_then_chain())
    assert sorted(export.files) == ["sglang-Qwen3.5-9B-qwen3.5-mtp-gsm8k-b1-1.yaml",
                                    "sglang-Qwen3.5-9B-qwen3.5-mtp-gsm8k-b2-max.yaml"]
    assert len(export.notes) == 1 and "batch sizes 1-1" in export.notes[0] and "topk 1" in export.notes[0]
    paths = export_engine_settings(sglang_tree_then_chain(), tmp_path)
    assert paths[-1].read_text().startswith("# no SGLang adaptive config")


def test_vllm_schedule_ranges_from_one(tmp_path):
    config = vllm_speculative_config(vllm_chains())
    assert config == {"method": "mtp", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": [
        [1, 1, 4], [2, 2, 4], [3, 8, 2], [9, VLLM_LAST_RANGE_END, 1]]}
    paths = export_engine_settings(vllm_chains(), tmp_path)
    assert [p.name for p in paths] == ["vllm-Qwen3.5-9B-qwen3.5-mtp-mbpp.json",
                                       "vllm-Qwen3.5-9B-qwen3.5-mtp-mbpp-commands.txt"]
    assert json.loads(paths[0].read_text()) == config
    assert paths[1].read_text() == f"vllm serve Qwen/Qwen3.5-9B --speculative-config '{paths[0].read_text().strip()}'\n"
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in paths)


def test_bole_engine_writes_no_engine_file(tmp_path):
    entry = budget("bole", {1: batch_entry(1, [1, None], 3, engine="bole")})
    paths = export_engine_settings(entry, tmp_path)
    assert [p.name for p in paths] == ["bole-Qwen3.5-9B-qwen3.5-mtp-mbpp-commands.txt"]


def _with(entry, batch, **changes):
    entry["batches"][batch].update(changes)
    return entry


@pytest.mark.parametrize("make, field", [
    (lambda: dict(sglang_chains(), engine="tensorrt"), "engine: unknown 'tensorrt'"),
    (lambda: {k: v for k, v in sglang_chains().items() if k != "model"}, "model: expected"),
    (lambda: dict(sglang_chains(), batches={}), "batches: expected a non-empty mapping"),
    (lambda: dict(sglang_chains(), batches={"x": {}}), "batches: key 'x'"),
    (lambda: _with(sglang_chains(), 4, serves=[1, 4]), "batches.4.serves: [1, 4]"),
    (lambda: _with(sglang_chains(), 4, sglang=None), "batches.4.sglang: missing"),
    (lambda: _with(sglang_chains(), 4, sglang={"speculative_num_steps": 3, "speculative_eagle_topk": 1}),
     "batches.4.sglang.speculative_num_draft_tokens: expected an integer"),
    (lambda: _with(sglang_chains(), 4, sglang={"speculative_num_steps": 3, "speculative_eagle_topk": 1,
                                                "speculative_num_draft_tokens": 6}),
     "batches.4.sglang.speculative_num_draft_tokens: 6, but with topk 1"),
    (lambda: _with(sglang_chains(), 4, sglang={"speculative_num_steps": 2, "speculative_eagle_topk": 2,
                                                "speculative_num_draft_tokens": 8}),
     "batches.4.sglang.speculative_num_draft_tokens: 8, but 2 steps of top-2 beam search propose 6 candidates"),
    (lambda: _with(vllm_chains(), 8, shape="tree"), "batches.8.shape: 'tree', but vLLM verifies chains only"),
    (lambda: _with(vllm_chains(), 8, vllm={"num_speculative_tokens": 0}),
     "batches.8.vllm.num_speculative_tokens: expected an integer >= 1"),
])
def test_bad_entries_name_the_field(tmp_path, make, field):
    with pytest.raises(ExportError) as error:
        export_engine_settings(make(), tmp_path)
    assert field in str(error.value)
    assert not list(tmp_path.iterdir())


# --- through the engines' own parsers -------------------------------------------------------------------

def _engine(engine, checks):
    try:
        return check_with_engine(engine, checks, PACKAGES)
    except EngineUnavailable as error:
        if os.environ.get("BOLE_TUNE_REQUIRE_ENGINES") == "1":
            pytest.fail(f"engine packages: {error}", pytrace=False)
        pytest.skip(f"{error}")


SGLANG_BATCHES = [1, 2, 3, 4, 5, 16, 17, 1000]
VLLM_BATCHES = [1, 2, 3, 5, 8, 9, 32, 33, 512]  # 3 and 5: between measured sizes; 33 and 512: above the largest


@pytest.fixture(scope="module")
def sglang_results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sglang-exports")
    entries = {"chains": sglang_chains(), "tree": sglang_tree_then_chain()}
    files = {name: export_engine_settings(entry, folder) for name, entry in entries.items()}
    checks = [{"kind": "static", "config": str(p)} for paths in files.values() for p in paths if p.suffix == ".yaml"]
    adaptive = [p for p in files["chains"] if p.suffix == ".json"][0]
    checks.append({"kind": "adaptive", "config": str(adaptive), "batches": SGLANG_BATCHES})
    results = _engine("sglang", checks)
    return entries, checks, results


def test_sglang_parses_static_configs_as_the_budget(sglang_results):
    entries, checks, results = sglang_results
    expected = [b["sglang"] for name in ("chains", "tree")
                for _, b in sorted(entries[name]["batches"].items(), key=lambda item: int(item[0]))]
    statics = [r for c, r in zip(checks, results) if c["kind"] == "static"]
    assert len(statics) == len(expected) == 5
    for result, flags in zip(statics, expected):
        assert "error" not in result, result
        assert result["parsed"]["speculative_algorithm"] == "NEXTN"
        assert result["resolved"]["speculative_algorithm"] == "EAGLE"  # NEXTN is EAGLE with the built-in MTP head
        for name, value in flags.items():
            assert result["parsed"][name] == value and result["resolved"][name] == value, name
        assert result["resolved"]["speculative_adaptive"] is False


def test_sglang_adaptive_config_runs_the_budget_per_batch(sglang_results):
    entries, checks, results = sglang_results
    result = results[-1]
    assert "error" not in result, result
    assert result["resolved"]["speculative_adaptive"] is True  # not turned off: every bucket is a topk-1 chain
    assert result["resolved"]["speculative_eagle_topk"] == 1
    for batch in SGLANG_BATCHES:
        want = served_by(entries["chains"], batch)["sglang"]["speculative_num_steps"]
        assert result["steps"][str(batch)] == want, batch


@pytest.fixture(scope="module")
def vllm_results():
    entry = vllm_chains()
    text = json.dumps(vllm_speculative_config(entry), separators=(",", ":"))
    bad = json.dumps(dict(vllm_speculative_config(entry), num_speculative_tokens_per_batch_size=[[2, 8, 2]]))
    checks = [{"json": text, "max_num_seqs": 512, "batches": VLLM_BATCHES},
              {"json": bad, "max_num_seqs": 512, "batches": [1]}]
    return entry, _engine("vllm", checks)


def test_vllm_parses_speculative_config_as_the_budget(vllm_results):
    entry, (result, _) = vllm_results
    assert "error" not in result, result
    assert result["method"] == "mtp" and result["num_speculative_tokens"] == 4
    assert result["schedule"] == vllm_speculative_config(entry)["num_speculative_tokens_per_batch_size"]
    for batch in VLLM_BATCHES:
        assert result["k"][str(batch)] == served_by(entry, batch)["vllm"]["num_speculative_tokens"], batch


def test_vllm_rejects_a_schedule_not_starting_at_one(vllm_results):
    _, (_, rejected) = vllm_results
    assert "must start at 1" in rejected.get("error", ""), rejected
