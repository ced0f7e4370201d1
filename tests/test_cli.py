"""The command line, run the way a user runs it: a subprocess, its output and exit status."""

import json
import re
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
    best = data["configs"][KEY.text]["config"]
    row = re.compile(r"Hv32 Hk16 128/128 bf16\s*│\s*64\s*│\s*16\s*│\s*"
                     + "/".join(str(best[f]) for f in ("b_k", "b_v", "num_warps", "num_stages")))
    assert shown.returncode == 0 and row.search(shown.stdout), shown.stdout
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


def test_retune_measures_the_entry_it_replaces(tmp_path):
    """A second tune of a bucket (fresh Optuna storage, 2 trials: the default and whatever it starts from)
    re-measures the database's entry first, so it keeps the best config the first run found."""
    recording = write_recording(tmp_path / "rec.json")
    db_dir = tmp_path / "db"
    common = ["--replay", str(recording), "--model", "qwen3.5-9b", "--batch", "16", "--tree-size", "64",
              "--db-dir", str(db_dir)]
    first = run("tune", *common, "--trials", "30", "--storage", f"sqlite:///{tmp_path / 'a.db'}")
    assert first.returncode == 0, first.stderr
    best = database.load(db_dir / "replay-gpu.yaml")["configs"][KEY.text]["config"]
    assert best != {"b_k": 64, "b_v": 32, "num_warps": 4, "num_stages": 2}, "the first run kept the default"
    second = run("tune", *common, "--trials", "2", "--storage", f"sqlite:///{tmp_path / 'b.db'}")
    assert second.returncode == 0, second.stderr
    entry = database.load(db_dir / "replay-gpu.yaml")["configs"][KEY.text]
    assert entry["config"] == best and entry["trials"]["measured"] == 2


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
    assert "the cheapest round against the serial round over 1 cases" in result.stdout


def test_the_round_verdict_names_the_cheapest_way_and_every_case_not_faster_than_serial(tmp_path):
    import json

    from bole_tune.bench import round_verdict, verdict_of_files

    def rows(batch, size, **us):
        return [{"kernel": k, "label": "m", "hv": 32, "dtype": "bf16", "batch": batch, "tree_size": size,
                 "max_depth": 8, "p50_us": v} for k, v in us.items()]

    fast = rows(1, 4, tree_verify=5.0, tree_commit_layers=1.5, round_verify_commit=10.0, round_folded=9.0,
                round_ring=7.0, round_serial=13.0)
    slow = rows(32, 2, tree_verify=20.0, round_verify_commit=40.0, round_ring=31.0, round_serial=30.0)
    verdict = round_verdict(fast + slow + rows(4, 8, tree_verify=9.0))  # a case without rounds is left out
    assert [(v["batch"], v["way"], v["round_us"]) for v in verdict] == [(32, "round_ring", 31.0),
                                                                       (1, "verify + all-layer commit", 6.5)]
    assert verdict[0]["speedup"] == pytest.approx(30 / 31, abs=1e-3) and verdict[1]["speedup"] == pytest.approx(2.0)
    chain = [{**r, "kind": "chain", "p50_us": 2 * r["p50_us"]} for r in fast]  # the same size as a chain: its own case
    assert sorted((v["kind"], v["round_us"]) for v in round_verdict(fast + chain)) == [("chain", 13.0),
                                                                                      ("random", 6.5)]
    (tmp_path / "a.json").write_text(json.dumps({"rows": fast}))
    (tmp_path / "b.json").write_text(json.dumps({"rows": slow}))
    lines = []
    assert verdict_of_files([tmp_path / "a.json"], lines.append) == 0
    assert verdict_of_files([tmp_path / "a.json", tmp_path / "b.json"], lines.append) == 1
    assert "not faster than the serial round: m B=32 T=2 (31.0 against 30.0 us)" in lines[-1]


TINY_MODEL = """name: Tiny-MoE
hidden_size: 128
num_layers: 8
layers_per_attention: 4
vocab_size: 1000
attention: {num_heads: 4, num_kv_heads: 2, head_dim: 32}
gdn: {num_key_heads: 2, num_value_heads: 4, key_head_dim: 32, value_head_dim: 32, conv_width: 4}
ffn: {kind: moe, num_experts: 16, top_k: 2, expert_intermediate_size: 64, shared_intermediate_size: 64}
"""


@cpu_only
def test_step_budget_report_and_calibrate(tmp_path):
    model = tmp_path / "tiny-moe.yaml"
    model.write_text(TINY_MODEL)
    db = tmp_path / "db"
    step = run("step", "--model", str(model), "--batch", "1,4", "--tree-size", "1,4,8", "--repeats", "3",
               "--context", "64", "--db-dir", str(db))
    assert step.returncode == 0, step.stderr
    (path,) = db.glob("*.yaml")
    data = database.load(path)
    points = data["step_curves"]["Tiny-MoE/bf16"]["points"]
    assert len(points) == 6 and all(p["step_us"] > 0 for p in points)
    assert all(p["step_us"] == pytest.approx(6 * p["gdn_us"] + 2 * p["attention_us"] + p["lm_head_us"], rel=1e-3)
               for p in points)
    assert all(p["gdn_us"] == min(p["gdn_rounds_us"].values()) and p["gdn_round"] in p["gdn_rounds_us"]
               for p in points)
    slug = path.stem
    result = run("budget", "--gpu", slug, "--db-dir", str(db), "--engine", "sglang", "--acceptance",
                 "qwen3.5-mtp-mbpp")
    assert result.returncode == 0, result.stderr
    batches = database.load(path)["budgets"]["Tiny-MoE/bf16/qwen3.5-mtp-mbpp/sglang"]["batches"]
    assert set(batches) == {1, 4}
    assert batches[4]["sglang"]["speculative_num_draft_tokens"] == batches[4]["nodes_per_request"]
    report = run("report", "--gpu", slug, "--db-dir", str(db), "--out", str(tmp_path / "plots"))
    assert report.returncode == 0, report.stderr
    assert "summary" in report.stdout and "Tiny-MoE" in report.stdout
    for stem in ("step_latency", "budget-tiny-moe", "tree_vs_serial"):
        for suffix in ("png", "svg"):
            assert (tmp_path / "plots" / f"{stem}.{suffix}").stat().st_size > 1000
    log = tmp_path / "rounds.jsonl"
    log.write_text("\n".join(json.dumps({"parents": [-1, 0, 0], "ranks": [1, 1, 2], "accepted": a})
                             for a in ([0, 1], [0], [], [0, 1], [0, 1])) + "\n")
    fitted = run("calibrate", str(log), "--out", str(tmp_path / "fitted.yaml"))
    assert fitted.returncode == 0, fitted.stderr
    from bole_tune.acceptance import load_acceptance
    model_fit = load_acceptance(str(tmp_path / "fitted.yaml"))
    assert model_fit.depth_acceptance[0] == pytest.approx(0.8)


def test_budget_and_calibrate_usage_errors(tmp_path):
    assert_usage_error(run("calibrate", str(tmp_path / "missing.jsonl")), "missing.jsonl")
    assert_usage_error(run("budget", "--gpu", "no-such-gpu", "--db-dir", str(tmp_path)), "no tuning database")
    assert_usage_error(run("budget", "--acceptance", "nope"), "acceptance: unknown workload 'nope'")


def test_a_recording_without_a_config_the_tuner_asks_for_is_one_line(tmp_path):
    """A replay whose recording lacks a config of the search space stops with one line naming the recording,
    the bucket and the config (exit 2), not a worker traceback and not a config called infeasible."""
    recording = write_recording(tmp_path / "rec.json")
    data = json.loads(recording.read_text())
    del data["measurements"][KEY.text]["64/32/4/2"]  # the default config: every study measures it first
    recording.write_text(json.dumps(data))
    result = run("tune", "--replay", str(recording), "--model", "qwen3.5-9b", "--batch", "16", "--tree-size", "64",
                 "--trials", "8", "--storage", f"sqlite:///{tmp_path / 's.db'}", "--db-dir", str(tmp_path / "db"))
    assert_usage_error(result, "rec.json", KEY.text, "64/32/4/2")
    assert not (tmp_path / "db" / "replay-gpu.yaml").exists()
