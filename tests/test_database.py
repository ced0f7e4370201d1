"""The YAML tuning database: round trip, merging, validation, corruption, concurrent writers."""

import multiprocessing
import os

import pytest
import yaml

from bole_tune import database
from bole_tune.database import DatabaseError, ShapeKey

KEY = ShapeKey(32, 16, 128, 128, "bf16", 64, 16)


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
    other = ShapeKey(48, 16, 128, 128, "bf16", 64, 16)
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
        key = ShapeKey(16 * (worker + 1), 16, 128, 128, "bf16", database.TREE_BUCKETS[i % 6],
                       database.BATCH_BUCKETS[i // 6])
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
    assert [database.tree_bucket(t) for t in (1, 8, 9, 64, 65, 300)] == [8, 8, 16, 64, 128, 256]
    assert [database.batch_bucket(b) for b in (1, 3, 16, 17, 100)] == [1, 4, 16, 32, 32]


def test_search_directories_follow_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("BOLE_TUNE_DB", str(tmp_path))
    assert database.search_directories() == [tmp_path]
    monkeypatch.delenv("BOLE_TUNE_DB")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    dirs = database.search_directories()
    assert dirs[0] == tmp_path / "bole-tune" / "tuning_db" and dirs[-1] == database.SHIPPED_DIR
    assert os.path.isdir(database.SHIPPED_DIR)
