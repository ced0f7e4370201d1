"""The command line, run the way a user runs it: a subprocess, its output and exit status."""

import json
import os
import subprocess
import sys

import pytest

from bole_tune import database
from conftest import HAS_CUDA
from test_tuner import KEY, write_recording

cpu_only = pytest.mark.skipif(HAS_CUDA, reason="checks the CPU path; on a GPU this command runs the real GPU job")


def run(*args, env=None, timeout=300):
    full_env = {**os.environ, "COLUMNS": "160", **(env or {})}
    full_env.pop("TRITON_INTERPRET", None)  # the CLI on a CPU machine uses the PyTorch fallback
    return subprocess.run([sys.executable, "-m", "bole_tune.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


def assert_usage_error(result, *fragments):
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr + result.stdout, (fragment, result.stderr)


def test_help_lists_every_command():
    result = run("--help")
    assert result.returncode == 0
    for command in ("profile", "tune", "show", "lookup", "env", "bench"):
        assert command in result.stdout


def test_env_json_describes_this_machine():
    result = run("env", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["slug"] and data["kind"] in ("cpu", "gpu") and data["database"].endswith(f"{data['slug']}.yaml")


@cpu_only
def test_profile_on_the_cpu_writes_a_valid_database(tmp_path):
    result = run("profile", "--model", "qwen3.5-9b", "--db-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "No CUDA GPU" in result.stdout and "fallback" in result.stdout
    (path,) = tmp_path.glob("*.yaml")
    data = database.load(path)
    assert "Qwen3.5-9B/tree_verify_cpu_fallback/bf16" in data["curves"]
    shown = run("show", "--file", str(path), "--json")
    assert json.loads(shown.stdout)["curves"].keys() == data["curves"].keys()


def test_tune_replay_then_show_and_lookup(tmp_path):
    recording = write_recording(tmp_path / "rec.json")
    db_dir = tmp_path / "db"
    result = run("tune", "--replay", str(recording), "--model", "qwen3.5-9b", "--batch", "16", "--tree-size", "64",
                 "--trials", "20", "--storage", f"sqlite:///{tmp_path / 's.db'}", "--db-dir", str(db_dir))
    assert result.returncode == 0, result.stderr
    assert KEY.text in result.stdout and "geometric-mean speedup" in result.stdout
    data = database.load(db_dir / "replay-gpu.yaml")
    assert data["configs"][KEY.text]["trials"]["measured"] <= 20
    shown = run("show", "--gpu", "replay-gpu", "--db-dir", str(db_dir))
    assert shown.returncode == 0 and KEY.text in shown.stdout
    looked = run("lookup", "--gpu", "replay-gpu", "--hv", "32", "--hk", "16", "--dk", "128", "--dv", "128",
                 "--tree-size", "100", "--batch", "16", "--json", "--db-dir", str(db_dir))
    decision = json.loads(looked.stdout)
    assert decision["how"] == "nearest" and decision["key"] == "Hv32-Hk16-dk128-dv128-bf16-T128-B16"
    exact = run("lookup", "--gpu", "replay-gpu", "--hv", "32", "--hk", "16", "--dk", "128", "--dv", "128",
                "--tree-size", "64", "--batch", "9", "--db-dir", str(db_dir))
    assert "exact" in exact.stdout
    strict = run("lookup", "--gpu", "replay-gpu", "--hv", "48", "--hk", "16", "--dk", "128", "--dv", "128",
                 "--tree-size", "64", "--batch", "9", "--policy", "strict", "--db-dir", str(db_dir))
    assert_usage_error(strict, "strict")


@pytest.mark.parametrize("args, fragments", [
    (["bench", "--model", "qwen9"], ["qwen9", "unknown"]),
    (["profile", "--model", "qwen3.5-9b", "--tp", "3"], ["tp=3"]),
    (["profile", "--batch", "0"], ["--batch"]),
    (["tune", "--replay", "/nonexistent.json"], ["nonexistent.json"]),
    (["tune", "--storage", "not-a-url", "--replay", "REC"], ["--storage", "not-a-url"]),
    (["lookup", "--hv", "30", "--hk", "16", "--dk", "128", "--dv", "128", "--tree-size", "64", "--batch", "1"],
     ["multiple"]),
    (["lookup", "--hv", "32", "--hk", "16", "--dk", "100", "--dv", "128", "--tree-size", "64", "--batch", "1"],
     ["--dk"]),
    (["show", "--gpu", "no-such-gpu", "--db-dir", "/tmp"], ["no tuning database for no-such-gpu"]),
], ids=["bad-model", "bad-tp", "bad-batch", "missing-recording", "bad-storage", "heads", "head-size", "no-db"])
def test_usage_errors_are_one_line(tmp_path, args, fragments):
    args = [str(write_recording(tmp_path / "rec.json")) if a == "REC" else a for a in args]
    assert_usage_error(run(*args), *fragments)


def test_corrupt_database_is_reported_not_overwritten(tmp_path):
    path = tmp_path / "replay-gpu.yaml"
    path.write_text("schema_version: 1\nconfigs: [broken\n")
    result = run("tune", "--replay", str(write_recording(tmp_path / "rec.json")), "--model", "qwen3.5-9b",
                 "--batch", "16", "--tree-size", "64", "--trials", "3", "--storage",
                 f"sqlite:///{tmp_path / 's.db'}", "--db-dir", str(tmp_path))
    assert_usage_error(result, "replay-gpu.yaml", "--replace-corrupt")
    assert path.read_text() == "schema_version: 1\nconfigs: [broken\n"


@cpu_only
def test_bench_on_the_cpu_says_what_it_measured():
    result = run("bench", "--repeats", "3")
    assert result.returncode == 0, result.stderr
    assert "No CUDA GPU" in result.stdout and "fallback" in result.stdout
