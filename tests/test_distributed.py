"""Distributed tuning: worker processes sharing studies in PostgreSQL, SIGKILL and resume, crashes.

The PostgreSQL tests need a real server: `.ci/run` starts one (scripts/start_postgres.sh) and sets
BOLE_TUNE_TEST_POSTGRES; run locally, the fixture starts one the same way (its own, on a free port,
stopped again after the tests), or skips visibly (fails when BOLE_TUNE_REQUIRE_POSTGRES=1, as in CI).
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import optuna
import pytest

from bole_tune import database
from bole_tune.search_space import SearchSpace
from bole_tune.tuner import FINISHED, open_storage, study_name
from test_tuner import KEY, synthetic_cost, write_recording

ROOT = Path(__file__).resolve().parent.parent
SPACE = SearchSpace.load()
BEST = min(synthetic_cost(c) for c in SPACE.configs())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def postgres_url():
    """The server of BOLE_TUNE_TEST_POSTGRES, else one of our own on a free port and in a fresh data
    folder (so it is never someone else's server), stopped and removed when the module is done."""
    url = os.environ.get("BOLE_TUNE_TEST_POSTGRES")
    if url:
        yield url
        return
    script, port = str(ROOT / "scripts" / "start_postgres.sh"), str(free_port())
    data = tempfile.mkdtemp(prefix="bole-tune-pg-test-")
    env = {**os.environ, "BOLE_TUNE_PG_DATA": data}
    try:
        started = subprocess.run(["bash", script, port], capture_output=True, text=True, env=env)
        url = started.stdout.strip().splitlines()[-1] if started.returncode == 0 and started.stdout.strip() else ""
        if not url:
            if os.environ.get("BOLE_TUNE_REQUIRE_POSTGRES") == "1":
                pytest.fail("PostgreSQL is required here but could not be started (scripts/start_postgres.sh): "
                            + started.stderr[-500:])
            pytest.skip("no PostgreSQL server (scripts/start_postgres.sh could not start one)")
        yield url
    finally:
        subprocess.run(["bash", script, "stop", port], capture_output=True, text=True, env=env)
        shutil.rmtree(data, ignore_errors=True)


def recording(tmp_path, name, crashes=()):
    path = write_recording(tmp_path / f"{name}.json")
    data = json.loads(path.read_text())
    data["device"]["slug"] = f"replay-{name}-{uuid.uuid4().hex[:8]}"
    if crashes:
        data["crashes"] = {KEY.text: list(crashes)}
    path.write_text(json.dumps(data))
    return path, data["device"]["slug"]


def tune_command(rec, storage, db_dir, *extra):
    return [sys.executable, "-m", "bole_tune.cli", "tune", "--replay", str(rec), "--model", "qwen3.5-9b",
            "--batch", "16", "--tree-size", "64", "--storage", storage, "--db-dir", str(db_dir), *extra]


def run(command, env=None, timeout=600):
    full = {**os.environ, "COLUMNS": "160", **(env or {})}
    full.pop("TRITON_INTERPRET", None)
    return subprocess.run(command, capture_output=True, text=True, env=full, timeout=timeout)


def trials_of(storage_url, slug):
    return optuna.load_study(study_name=study_name(slug, KEY), storage=open_storage(storage_url)).get_trials()


def test_three_workers_share_one_postgres_study(tmp_path, postgres_url):
    rec, slug = recording(tmp_path, "three")
    result = run(tune_command(rec, postgres_url, tmp_path / "db3", "--workers", "3", "--sampler", "grid",
                              "--trials", str(len(SPACE.configs())), "--replay-delay", "0.01"))
    assert result.returncode == 0, result.stderr[-2000:]
    trials = trials_of(postgres_url, slug)
    numbers = [t.number for t in trials]
    assert sorted(numbers) == list(range(len(trials))), "a trial number is missing or recorded twice"
    assert all(t.state in FINISHED for t in trials), "a trial was left unfinished"
    covered = {tuple(sorted(t.params.items())) for t in trials}
    # every point of the grid (the recording is of an sm_90 GPU and the bucket takes Gluon configs: the gluon knob's
    # points too, those with tiles the Gluon verify does not take pruned)
    assert len(covered) == SPACE.grid_size, "the grid was not covered"
    workers = {t.user_attrs["worker"] for t in trials}
    assert len(workers) == 3, f"expected 3 worker processes, saw {workers}"
    three = database.load(tmp_path / "db3" / f"{slug}.yaml")["configs"][KEY.text]

    rec1, slug1 = recording(tmp_path, "one")
    one_url = f"sqlite:///{tmp_path / 'one.sqlite3'}"
    result = run(tune_command(rec1, one_url, tmp_path / "db1", "--workers", "1", "--sampler", "grid",
                              "--trials", str(len(SPACE.configs()))))
    assert result.returncode == 0, result.stderr[-2000:]
    one = database.load(tmp_path / "db1" / f"{slug1}.yaml")["configs"][KEY.text]
    assert three["config"] == one["config"] and three["latency_us"] == one["latency_us"]
    assert three["latency_us"]["p50"] == pytest.approx(BEST)
    assert set(three["provenance"]["workers"]) == workers


def test_sigkill_then_resume_redoes_no_finished_trial(tmp_path):
    rec, slug = recording(tmp_path, "kill")
    url = f"sqlite:///{tmp_path / 'kill.sqlite3'}"
    command = tune_command(rec, url, tmp_path / "db", "--trials", "16", "--replay-delay", "0.25")
    env = {**os.environ, "BOLE_TUNE_HEARTBEAT": "1", "COLUMNS": "160"}
    env.pop("TRITON_INTERPRET", None)
    first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    deadline = time.time() + 120
    done_before = []
    while time.time() < deadline:
        time.sleep(0.3)
        try:
            done_before = [t for t in trials_of(url, slug) if t.state in FINISHED]
        except KeyError:
            continue
        if len(done_before) >= 5:
            break
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(30)
    time.sleep(0.5)
    done_before = {t.number: t for t in trials_of(url, slug) if t.state in FINISHED}
    assert 5 <= len(done_before) < 16, "the kill did not land mid-run"
    time.sleep(3.5)  # three missed heartbeats: the killed trial is stale
    second = run(command, env={"BOLE_TUNE_HEARTBEAT": "1"})
    assert second.returncode == 0, second.stderr[-2000:]
    after = trials_of(url, slug)
    finished = [t for t in after if t.state in FINISHED]
    assert len(finished) == 16
    for number, before in done_before.items():
        now = after[number]
        assert now.state == before.state and now.params == before.params and now.value == before.value
        assert now.user_attrs.get("worker") == before.user_attrs.get("worker"), f"trial {number} was redone"
    first_workers = {t.user_attrs.get("worker") for t in done_before.values()}
    redone = [t for t in finished if t.number not in done_before and t.user_attrs.get("worker") in first_workers]
    assert not redone


def test_crashing_candidate_fails_only_its_trial(tmp_path):
    crash = "64/32/4/2"  # the default config: every study tries it first
    rec, slug = recording(tmp_path, "crash", crashes=[crash])
    url = f"sqlite:///{tmp_path / 'crash.sqlite3'}"
    result = run(tune_command(rec, url, tmp_path / "db", "--trials", "12"))
    assert result.returncode == 0, result.stderr[-2000:]
    trials = trials_of(url, slug)
    crashed = [t for t in trials if t.params in ({"b_k": 64, "b_v": 32, "num_warps": 4, "num_stages": 2},
                                                  {"b_k": 64, "b_v": 32, "num_warps": 4, "num_stages": 2, "gluon": 0})]
    assert crashed and crashed[0].user_attrs["status"] == "infeasible"
    assert "crashed the GPU context" in crashed[0].user_attrs["reason"]
    assert len([t for t in trials if t.state in FINISHED]) == 12
    entry = database.load(tmp_path / "db" / f"{slug}.yaml")["configs"][KEY.text]
    assert entry["config"] != {"b_k": 64, "b_v": 32, "num_warps": 4, "num_stages": 2}
    assert entry["trials"]["infeasible"] >= 1
