"""The YAML tuning database: round trip, merging, validation, corruption, concurrent writers."""

import multiprocessing
import os

import pytest
import yaml

from bole_tune import database
from bole_tune.database import DatabaseError, ShapeKey
from bole_tune.shapes import BATCH_BUCKETS, TREE_BUCKETS, HeadShape, batch_bucket, tree_bucket


def shape_key(hv=32, hk=16, tree=64, batch=16, dtype="bf16", dk=128, dv=128, tp=1) -> ShapeKey:
    return ShapeKey(heads=HeadShape(hk=hk, hv=hv, dk=dk, dv=dv), dtype=dtype, tree_bucket=tree, batch_bucket=batch,
                    tp=tp)


KEY = shape_key()


def _triton_version() -> str:
    import triton
    return triton.__version__


def entry(key=KEY, b_v=64, p50=40.0):
    return {"key": key.as_dict(), "config": {"b_k": 64, "b_v": b_v, "num_warps": 8, "num_stages": 2},
            "latency_us": {"p20": p50 - 1, "p50": p50, "p80": p50 + 1},
            "default_config": {"b_k": 64, "b_v": 32, "num_warps": 4, "num_stages": 2},
            "default_latency_us": {"p20": 2 * p50 - 1, "p50": 2 * p50, "p80": 2 * p50 + 1},
            "trials": {"total": 10, "measured": 9}, "provenance": {"triton": _triton_version(), "date": database.now()}}


def test_round_trip_and_merge(tmp_path):
    path = tmp_path / "gpu.yaml"
    database.update(path, device={"slug": "gpu", "name": "GPU"}, configs={KEY.text: entry()})
    other = shape_key(hv=48)
    database.update(path, configs={other.text: entry(other, b_v=32)},
                    curves={"m/k/bf16": {"model": "m", "kernel": "k", "dtype": "bf16", "provenance": {},
                                         "points": [{"batch": 1, "tree_size": 8, "p20": 1, "p50": 2, "p80": 3}]}})
    data = database.load(path)
    assert set(data["configs"]) == {KEY.text, other.text}, "re-profiling one shape dropped another"
    assert data["configs"][other.text]["config"]["b_v"] == 32
    assert data["device"]["slug"] == "gpu"
    assert data["curves"]["m/k/bf16"]["points"][0]["p50"] == 2
    database.update(path, configs={KEY.text: entry(b_v=128)})
    assert database.load(path)["configs"][KEY.text]["config"]["b_v"] == 128, "an entry was not replaced"
    assert not list(tmp_path.glob("*.tmp")), "a temporary file was left behind"


def curve(points, date, shape=None):
    return {"model": "m", "kernel": "k", "dtype": "bf16", "shape": shape or {"hv": 32, "hk": 16, "dk": 128, "dv": 128},
            "provenance": {"date": date, "driver": "d"},
            "points": [{"batch": b, "tree_size": t, "p20": v - 1, "p50": v, "p80": v + 1} for b, t, v in points]}


def test_a_partial_re_profile_keeps_the_points_it_did_not_measure(tmp_path):
    path = tmp_path / "gpu.yaml"
    database.update(path, curves={"m/k/bf16": curve([(1, 8, 5.0), (16, 64, 70.0), (16, 128, 180.0)], "day-1")})
    database.update(path, curves={"m/k/bf16": curve([(16, 64, 62.0)], "day-2")})
    merged = database.load(path)["curves"]["m/k/bf16"]
    got = {(p["batch"], p["tree_size"]): (p["p50"], p["measured"]) for p in merged["points"]}
    assert got == {(1, 8): (5.0, "day-1"), (16, 64): (62.0, "day-2"), (16, 128): (180.0, "day-1")}
    assert merged["provenance"]["date"] == "day-2"
    assert [r["date"] for r in merged["provenance"]["earlier_runs"]] == ["day-1"]
    # a third run keeps the chain; a curve of another head shape replaces the old one outright
    database.update(path, curves={"m/k/bf16": curve([(1, 8, 4.0)], "day-3")})
    merged = database.load(path)["curves"]["m/k/bf16"]
    assert [r["date"] for r in merged["provenance"]["earlier_runs"]] == ["day-1", "day-2"]
    assert {(p["batch"], p["tree_size"]): p["measured"] for p in merged["points"]}[(16, 64)] == "day-2"
    other = curve([(2, 8, 9.0)], "day-4", shape={"hv": 48, "hk": 16, "dk": 128, "dv": 128})
    database.update(path, curves={"m/k/bf16": other})
    assert database.load(path)["curves"]["m/k/bf16"] == other


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.update(schema_version=99), "schema_version 99 is not understood"),
    (lambda d: d.update(extra=1), "extra: unknown top-level field"),
    (lambda d: d["configs"][KEY.text]["config"].update(b_k=20), f"configs.{KEY.text}.config"),
    (lambda d: d["configs"][KEY.text]["latency_us"].pop("p50"), f"configs.{KEY.text}.latency_us.p50"),
    (lambda d: d["configs"][KEY.text]["key"].update(dtype="int8"), f"configs.{KEY.text}.key.dtype"),
    (lambda d: d["configs"][KEY.text]["key"].update(tree_bucket=48), f"configs.{KEY.text}.key.tree_bucket"),
    (lambda d: d["configs"][KEY.text].pop("provenance"), f"configs.{KEY.text}.provenance"),
    (lambda d: d.update(configs=[]), "configs: expected a mapping"),
], ids=["schema", "unknown-field", "bad-config", "missing-p50", "bad-dtype", "bad-bucket", "no-provenance",
        "configs-list"])
def test_validation_names_file_and_field(tmp_path, mutate, field):
    path = tmp_path / "gpu.yaml"
    database.update(path, configs={KEY.text: entry()})
    data = yaml.safe_load(path.read_text())
    mutate(data)
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(DatabaseError) as info:
        database.load(path)
    assert str(path) in str(info.value) and field in str(info.value)


def test_unknown_schema_lists_understood_versions(tmp_path):
    path = tmp_path / "gpu.yaml"
    path.write_text("schema_version: 7\n")
    with pytest.raises(DatabaseError, match=r"reads versions \[1\]"):
        database.load(path)


def test_corrupt_file_is_kept_and_never_overwritten(tmp_path):
    path = tmp_path / "gpu.yaml"
    database.update(path, configs={KEY.text: entry()})
    truncated = path.read_text()[: len(path.read_text()) // 2] + "\n  - [unclosed"
    path.write_text(truncated)
    with pytest.raises(DatabaseError, match="gpu.yaml"):
        database.load(path)
    with pytest.raises(DatabaseError, match="Nothing was written"):
        database.update(path, configs={KEY.text: entry(b_v=16)})
    assert path.read_text() == truncated, "a corrupt database was overwritten"
    backups = list(tmp_path.glob("gpu.yaml.corrupt-*"))
    assert backups and backups[0].read_text() == truncated
    database.update(path, configs={KEY.text: entry(b_v=16)}, replace_corrupt=True)
    assert database.load(path)["configs"][KEY.text]["config"]["b_v"] == 16
    assert any(b.read_text() == truncated for b in tmp_path.glob("gpu.yaml.corrupt-*")), "the backup was lost"


def test_empty_file_is_reported(tmp_path):
    path = tmp_path / "gpu.yaml"
    path.write_text("")
    with pytest.raises(DatabaseError, match="empty or truncated"):
        database.load(path)


def _writer(path, worker, count):
    for i in range(count):
        key = shape_key(hv=16 * (worker + 1), tree=TREE_BUCKETS[i % 6], batch=BATCH_BUCKETS[i // 6])
        database.update(path, configs={key.text: entry(key)})


def test_concurrent_writers_lose_nothing(tmp_path):
    path = tmp_path / "gpu.yaml"
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_writer, args=(str(path), w, 9)) for w in range(4)]
    for p in workers:
        p.start()
    for p in workers:
        p.join(120)
        assert p.exitcode == 0
    assert len(database.load(path)["configs"]) == 36, "concurrent writers lost entries"


def test_buckets():
    assert [tree_bucket(t) for t in (1, 8, 9, 64, 65, 300)] == [8, 8, 16, 64, 128, 256]
    assert [batch_bucket(b) for b in (1, 3, 16, 17, 100)] == [1, 4, 16, 32, 32]


def test_search_directories_follow_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("BOLE_TUNE_DB", str(tmp_path))
    assert database.search_directories() == [tmp_path]
    monkeypatch.delenv("BOLE_TUNE_DB")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    dirs = database.search_directories()
    assert dirs[0] == tmp_path / "bole-tune" / "tuning_db" and dirs[-1] == database.SHIPPED_DIR
    assert os.path.isdir(database.SHIPPED_DIR)


# ---- one search rule, one parse per file, budgets and step curves validated -------------------------

def test_user_entries_win_over_shipped_ones_and_show_shows_what_the_runtime_reads(tmp_path, monkeypatch):
    """The user's folder is read before the shipped database: an entry of the same name there wins, every
    other shipped entry is kept, and `show` prints exactly that merge."""
    import json
    import subprocess
    import sys

    from bole_tune import lookup

    monkeypatch.delenv("BOLE_TUNE_DB", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    shipped = database.load(database.SHIPPED_DIR / "nvidia-h200.yaml")
    name, theirs = next(iter(shipped["configs"].items()))
    key = ShapeKey.from_dict(theirs["key"])
    mine = entry(key, b_v=16 if theirs["config"]["b_v"] != 16 else 32)
    user_file = database.database_path("nvidia-h200")
    assert user_file.parent == tmp_path / "bole-tune" / "tuning_db"
    database.update(user_file, configs={key.text: mine})
    lookup.clear_cache()
    found = database.search("nvidia-h200")
    assert found.files == (user_file, database.SHIPPED_DIR / "nvidia-h200.yaml")
    assert found.entries("configs")[name]["config"] == mine["config"]
    assert found.source("configs", name) == user_file
    assert set(found.entries("configs")) == set(shipped["configs"]), "shipped entries were lost in the merge"
    assert found.entries("budgets") == shipped["budgets"]
    decision = lookup.decide(key, "nvidia-h200", "nearest")
    assert decision.how == "exact" and decision.config.as_dict() == mine["config"]
    assert decision.source == str(user_file)
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)
    shown = subprocess.run([sys.executable, "-m", "bole_tune.cli", "show", "--gpu", "nvidia-h200", "--json"],
                           capture_output=True, text=True, env=env, timeout=300)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["configs"] == json.loads(json.dumps(found.entries("configs")))
    # BOLE_TUNE_DB (or --db-dir) is read alone
    monkeypatch.setenv("BOLE_TUNE_DB", str(tmp_path / "elsewhere"))
    assert database.search("nvidia-h200").files == ()
    assert database.search("nvidia-h200", user_file.parent).files == (user_file,)
    lookup.clear_cache()


def test_each_file_is_parsed_once_until_it_changes(tmp_path, monkeypatch):
    from bole_tune import budget, lookup

    path = tmp_path / "gpu.yaml"
    database.update(path, configs={KEY.text: entry()})
    database.clear_cache()
    parsed = []
    real = database._parse
    monkeypatch.setattr(database, "_parse", lambda p: parsed.append(p) or real(p))
    for _ in range(3):
        database.load(path)
        database.search("gpu", tmp_path)
    assert len(parsed) == 1
    database.update(path, configs={shape_key(hv=48).text: entry(shape_key(hv=48))})
    parsed.clear()
    assert len(database.load(path)["configs"]) == 2 and len(parsed) == 1, "a changed file was not read again"
    database.load(path)
    assert len(parsed) == 1
    for clear in (lookup.clear_cache, budget.clear_cache):
        clear()
        database.load(path)
    assert len(parsed) == 3


B = "M/bf16/w/sglang"  # a budget's name: <model>/<dtype>/<workload>/<engine>


def _with_budget_and_step_curve(path):
    from bole_tune.acceptance import AcceptanceModel
    from bole_tune.budget import build_budget

    points = [{"batch": b, "tree_size": t, "tokens": b * t, "gdn_us": 1.0 + t, "attention_us": 5.0,
               "lm_head_us": 5.0, "step_us": 100.0 + b * t, "gdn_serial_us": 2.0 + t, "step_serial_us": 200.0 + b * t}
              for b in (1, 4) for t in (1, 2, 4, 8)]
    step = {"model": "M", "dtype": "bf16", "context": 64, "layers": {"gdn": 3, "attention": 1},
            "measured_by": "layer groups, summed", "points": points, "provenance": {"date": "d"}}
    budget = build_budget("M", AcceptanceModel("w", (0.9, 0.8), (0.4, 0.2)), "sglang", step)
    database.update(path, step_curves={"M/bf16": step}, budgets={B: budget})
    return yaml.safe_load(path.read_text())


def _tree_batch(d):
    """The batch entry of the test budget whose chosen shape is a tree (topk > 1)."""
    return next(b for b in d["budgets"][B]["batches"].values() if b["sglang"]["speculative_eagle_topk"] > 1)


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["budgets"][B]["batches"][4].pop("tokens"), f"budgets.{B}.batches.4.tokens"),
    (lambda d: d["budgets"][B]["batches"][4].update(depth="2"), f"budgets.{B}.batches.4.depth"),
    (lambda d: d["budgets"][B]["batches"][1].update(parents=[5] * d["budgets"][B]["batches"][1]["draft_tokens"]),
     f"budgets.{B}.batches.1.parents[0]"),
    (lambda d: d["budgets"][B]["batches"][1].update(ranks=[]), f"budgets.{B}.batches.1.ranks"),
    (lambda d: d["budgets"][B]["batches"][1].update(draft_tokens=-1), f"budgets.{B}.batches.1.draft_tokens"),
    (lambda d: d["budgets"][B]["batches"][1].update(shape="star"), f"budgets.{B}.batches.1.shape"),
    (lambda d: d["budgets"][B]["batches"][1].update(tokens_per_second=0), "batches.1.tokens_per_second"),
    (lambda d: d["budgets"][B]["batches"].update({"x": {}}), f"budgets.{B}.batches.x"),
    (lambda d: d["budgets"][B]["acceptance"].update(depth_acceptance=[1.5]), "acceptance.depth_acceptance[0]"),
    (lambda d: d["budgets"][B].pop("provenance"), f"budgets.{B}.provenance"),
    (lambda d: d["budgets"][B].update(engine="trt"), f"budgets.{B}.engine"),
    (lambda d: d["budgets"][B].update(workload="other"), f"budgets.{B}: the name of a budget"),
    (lambda d: d["budgets"][B]["batches"][4].update(serves=[3, None]), f"budgets.{B}.batches.4.serves"),
    (lambda d: d["budgets"][B]["batches"][1].update(serves=[1, 4]), f"budgets.{B}.batches.1.serves"),
    (lambda d: _tree_batch(d)["sglang"].update(speculative_eagle_topk=1), "sglang.speculative_num_draft_tokens"),
    (lambda d: _tree_batch(d)["sglang"].update(speculative_num_steps=1), ".sglang: 1 steps"),
    (lambda d: d["budgets"][B]["batches"][1].update(vllm={"num_speculative_tokens": 1}), "batches.1.vllm"),
    (lambda d: d["step_curves"]["M/bf16"]["points"][2].pop("lm_head_us"), "step_curves.M/bf16.points[2].lm_head_us"),
    (lambda d: d["step_curves"]["M/bf16"]["points"][0].update(batch=0), "step_curves.M/bf16.points[0].batch"),
    (lambda d: d["step_curves"]["M/bf16"]["points"][1].update(tokens=7), "step_curves.M/bf16.points[1].tokens"),
    (lambda d: d["step_curves"]["M/bf16"]["points"][1].update(step_us=-1.0), "step_curves.M/bf16.points[1].step_us"),
    (lambda d: d["step_curves"]["M/bf16"]["points"][1].update(step_serial_us="a"), "points[1].step_serial_us"),
    (lambda d: d["step_curves"]["M/bf16"]["points"][1].update(attention_kernel=3), "points[1].attention_kernel"),
    (lambda d: d["step_curves"]["M/bf16"]["points"][1].update(gdn_round=3), "points[1].gdn_round"),
    (lambda d: d["step_curves"]["M/bf16"]["points"][1].update(gdn_rounds_us={"folded": "x"}),
     "points[1].gdn_rounds_us.folded"),
    (lambda d: d["step_curves"]["M/bf16"].update(points=[]), "step_curves.M/bf16.points"),
    (lambda d: d["step_curves"]["M/bf16"].update(dtype="int4"), "step_curves.M/bf16.dtype"),
    (lambda d: d["step_curves"]["M/bf16"].pop("model"), "step_curves.M/bf16.model"),
], ids=["no-tokens", "depth-text", "parent-ahead", "ranks-short", "drafts-negative", "shape", "zero-rate",
        "batch-key", "acceptance", "budget-provenance", "engine", "name", "serves-low", "serves-high", "sglang-topk1",
        "sglang-steps", "other-engine", "no-lm-head", "batch-0", "tokens", "negative-step", "serial-text",
        "attention-kernel", "gdn-round", "gdn-rounds", "no-points", "dtype", "no-model"])
def test_budgets_and_step_curves_are_validated_naming_file_and_field(tmp_path, mutate, field):
    path = tmp_path / "gpu.yaml"
    data = _with_budget_and_step_curve(path)
    assert set(database.load(path)["budgets"][B]["batches"]) == {1, 4}
    mutate(data)
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(DatabaseError) as info:
        database.load(path)
    assert str(path) in str(info.value) and field in str(info.value), str(info.value)


def test_budget_batches_keyed_by_strings_load(tmp_path):
    """JSON round trips turn batch keys into strings: those are read as the batch sizes they name."""
    path = tmp_path / "gpu.yaml"
    data = _with_budget_and_step_curve(path)
    data["budgets"][B]["batches"] = {str(b): e for b, e in data["budgets"][B]["batches"].items()}
    path.write_text(yaml.safe_dump(data))
    assert set(database.load(path)["budgets"][B]["batches"]) == {"1", "4"}


def test_the_shipped_database_loads():
    data = database.load(database.SHIPPED_DIR / "nvidia-h200.yaml")
    folded = [text for text in data["configs"] if text.endswith("-fold")]
    ring = [text for text in data["configs"] if text.endswith("-ring")]
    assert len(data["configs"]) - len(folded) - len(ring) == 108 and data["step_curves"]
    # the folded verify's own entries: 9B (one or 16-32 requests), 27B and 122B (16-32 requests), trees of 8 and 16
    # nodes; the 9B's 32-node trees at 16-32 requests too
    assert len(folded) == 16 and all(data["configs"][text]["key"]["fold"] is True for text in folded)
    # a ring write round's own entries: 9B, 27B and 122B, 16-32 requests, trees of 8 and 16 nodes; the 9B's 32-node
    # trees too
    assert len(ring) == 14 and all(data["configs"][text]["key"]["ring"] is True
                                  and ShapeKey.from_dict(data["configs"][text]["key"]).text == text for text in ring)
