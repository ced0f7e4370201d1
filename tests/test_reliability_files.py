"""Files the tool writes and reads (issue 19): nothing lost, nothing outside its folder, runs that resume.

Classes, one test or table each: the one writer (atomic, mode kept, symlinks followed); the database's one
merge rule (step curves merged point by point, concurrent writers); a loader that refuses duplicate keys
and a file cut short; names that cannot leave their folder; the shipped database read-only; provenance
without paths; the curve phase resuming after a kill; job folders cleaned up.
"""

import json
import multiprocessing
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from bole_tune import database, profiler
from bole_tune.atomic import write_text_atomic
from bole_tune.database import DatabaseError
from bole_tune.fingerprint import Fingerprint
from conftest import HAS_CUDA
from test_cli import TINY_MODEL
from test_database import KEY, entry, shape_key

cpu_only = pytest.mark.skipif(HAS_CUDA, reason="runs the CPU profile; on a GPU profile tunes for real")


def mode_of(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask():
    """Set a umask for the test, restore the old one after."""
    old = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(old)


# ---- the one writer ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mask, expected", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)],
                         ids=["umask-022", "umask-002", "umask-077"])
def test_a_new_file_gets_0666_less_the_umask(tmp_path, umask, mask, expected):
    umask(mask)
    path = tmp_path / "new" / "file.yaml"
    write_text_atomic(path, "a: 1\n")
    assert path.read_text() == "a: 1\n" and mode_of(path) == expected
    assert not [p for p in path.parent.iterdir() if p.name != "file.yaml"], "a temporary file was left"


def test_an_existing_file_keeps_its_mode_unless_one_is_asked_for(tmp_path, umask):
    path = tmp_path / "shared.yaml"
    path.write_text("old\n")
    os.chmod(path, 0o664)
    umask(0o077)
    write_text_atomic(path, "new\n")
    assert path.read_text() == "new\n" and mode_of(path) == 0o664
    write_text_atomic(path, "newer\n", mode=0o640)
    assert mode_of(path) == 0o640


def test_a_symlinked_file_is_updated_where_the_link_points(tmp_path):
    target = tmp_path / "shared" / "nvidia-h200.yaml"
    target.parent.mkdir()
    target.write_text("old\n")
    os.chmod(target, 0o644)
    link = tmp_path / "mine" / "nvidia-h200.yaml"
    link.parent.mkdir()
    link.symlink_to(target)
    write_text_atomic(link, "new\n")
    assert link.is_symlink() and os.readlink(link) == str(target), "the link was replaced by a copy"
    assert target.read_text() == "new\n" and mode_of(target) == 0o644
    assert sorted(p.name for p in target.parent.iterdir()) == ["nvidia-h200.yaml"]


def test_the_database_writes_through_a_symlink_keeping_mode_and_link(tmp_path, umask):
    umask(0o022)
    real = tmp_path / "team" / "gpu.yaml"
    database.update(real, configs={KEY.text: entry()})
    assert mode_of(real) == 0o644, "a new database must be readable by the others (not 0600)"
    os.chmod(real, 0o664)
    link = tmp_path / "me" / "gpu.yaml"
    link.parent.mkdir()
    link.symlink_to(real)
    other = shape_key(hv=48)
    database.update(link, configs={other.text: entry(other)})
    assert link.is_symlink() and mode_of(real) == 0o664
    assert set(database.load(real)["configs"]) == {KEY.text, other.text}
    assert not (link.parent / "gpu.yaml.lock").exists(), "the lock must be the target's, shared by every link"


# ---- one merge rule: step curves merged point by point ---------------------------------------------

def step_curve(points, date, context=64):
    return {"model": "M", "dtype": "bf16", "context": context, "layers": {"gdn": 3, "attention": 1},
            "points": [{"batch": b, "tree_size": t, "tokens": b * t, "gdn_us": 1.0, "attention_us": 2.0,
                        "lm_head_us": 3.0, "step_us": v} for b, t, v in points],
            "provenance": {"date": date}}


def test_a_second_step_run_with_other_sizes_keeps_the_first_runs_points(tmp_path):
    path = tmp_path / "gpu.yaml"
    database.update(path, step_curves={"M/bf16": step_curve([(1, 1, 10.0), (1, 4, 12.0)], "day-1")})
    database.update(path, step_curves={"M/bf16": step_curve([(4, 1, 20.0), (1, 4, 11.0)], "day-2")})
    merged = database.load(path)["step_curves"]["M/bf16"]
    got = {(p["batch"], p["tree_size"]): (p["step_us"], p["measured"]) for p in merged["points"]}
    assert got == {(1, 1): (10.0, "day-1"), (1, 4): (11.0, "day-2"), (4, 1): (20.0, "day-2")}
    assert [r["date"] for r in merged["provenance"]["earlier_runs"]] == ["day-1"]
    # another context measures something else: it replaces the curve (the name holds one context)
    database.update(path, step_curves={"M/bf16": step_curve([(2, 2, 30.0)], "day-3", context=128)})
    assert [(p["batch"], p["tree_size"]) for p in database.load(path)["step_curves"]["M/bf16"]["points"]] == [(2, 2)]


def test_a_run_writing_point_by_point_lists_each_earlier_run_once(tmp_path):
    path = tmp_path / "gpu.yaml"
    database.update(path, step_curves={"M/bf16": step_curve([(1, 1, 10.0), (1, 2, 11.0)], "day-1")})
    for size in (4, 8, 16):  # one run, three writes
        database.update(path, step_curves={"M/bf16": step_curve([(1, size, 12.0)], "day-2")})
    merged = database.load(path)["step_curves"]["M/bf16"]
    assert len(merged["points"]) == 5 and [r["date"] for r in merged["provenance"]["earlier_runs"]] == ["day-1"]
    database.update(path, step_curves={"M/bf16": step_curve([(1, 1, 9.0), (1, 2, 9.5)], "day-3")})
    merged = database.load(path)["step_curves"]["M/bf16"]
    assert [r["date"] for r in merged["provenance"]["earlier_runs"]] == ["day-2"], "a run owning no point is listed"


def _step_writer(path, batch):
    database.update(path, step_curves={"M/bf16": step_curve([(batch, t, 10.0 + t) for t in (1, 2, 4)],
                                                             f"run-{batch}")})


def test_concurrent_step_runs_lose_no_point(tmp_path):
    path = tmp_path / "gpu.yaml"
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_step_writer, args=(str(path), b)) for b in (1, 2, 4, 8)]
    for p in writers:
        p.start()
    for p in writers:
        p.join(120)
        assert p.exitcode == 0
    points = database.load(path)["step_curves"]["M/bf16"]["points"]
    assert {(p["batch"], p["tree_size"]) for p in points} == {(b, t) for b in (1, 2, 4, 8) for t in (1, 2, 4)}
    assert all(p["measured"] == f"run-{p['batch']}" for p in points)


# ---- a loader that refuses duplicate keys and a file cut short --------------------------------------

def _written(path) -> str:
    database.update(path, configs={k.text: entry(k) for k in (KEY, shape_key(hv=48), shape_key(hv=64))},
                    step_curves={"M/bf16": step_curve([(1, 1, 10.0), (1, 4, 12.0)], "day-1")})
    return path.read_text()


@pytest.mark.parametrize("make, line", [
    (lambda body: body + "configs: {}\n", "configs"),
    (lambda body: body.replace("configs:\n", f"configs:\n  {KEY.text}: {{}}\n", 1), KEY.text),
    (lambda body: body + body, "schema_version"),
], ids=["top-level-twice", "nested-twice", "two-files-concatenated"])
def test_a_key_given_twice_is_refused_naming_file_key_and_line(tmp_path, make, line):
    path = tmp_path / "gpu.yaml"
    body = _written(path).partition("\n")[2]  # without the digest line: as a hand-made file would be
    path.write_text(make(body))
    with pytest.raises(DatabaseError) as info:
        database.load(path)
    message = str(info.value)
    assert str(path) in message and repr(line) in message and "line " in message and "first at line" in message
    before = path.read_text()
    with pytest.raises(DatabaseError, match="Nothing was written"):
        database.update(path, configs={KEY.text: entry(b_v=16)})
    assert path.read_text() == before, "the next write made the loss permanent"


def test_every_write_puts_a_digest_and_counts_first(tmp_path):
    text = _written(tmp_path / "gpu.yaml")
    first = text.splitlines()[0]
    assert first.startswith("# bole-tune sha256 ") and "3 configs, 0 curves, 0 budgets, 1 step_curves" in first


def test_a_file_cut_short_at_any_line_is_refused(tmp_path):
    path = tmp_path / "gpu.yaml"
    lines = _written(path).splitlines(keepends=True)
    assert len(lines) > 20
    for keep in range(1, len(lines)):
        path.write_text("".join(lines[:keep]))
        database.clear_cache()
        with pytest.raises(DatabaseError, match="does not match the digest"):
            database.load(path)


def test_a_file_without_a_digest_loads_and_a_hand_edit_is_refused_until_its_digest_line_goes(tmp_path):
    assert database.load(database.SHIPPED_DIR / "nvidia-h200.yaml")["configs"], "the shipped file has no digest"
    path = tmp_path / "gpu.yaml"
    text = _written(path)
    path.write_text(text.replace("b_v: 64", "b_v: 128", 1))
    with pytest.raises(DatabaseError, match="delete line 1"):
        database.load(path)
    path.write_text(text.replace("b_v: 64", "b_v: 128", 1).partition("\n")[2])
    assert any(e["config"]["b_v"] == 128 for e in database.load(path)["configs"].values())
    database.update(path, configs={shape_key(hv=96).text: entry(shape_key(hv=96))})
    assert path.read_text().startswith("# bole-tune sha256 "), "the next write puts the digest back"


# ---- names that cannot leave their folder ------------------------------------------------------------

@pytest.mark.parametrize("slug", ["../../x", "..", "a/b", "a\\b", ".hidden", ""])
def test_a_slug_that_is_not_a_file_name_is_refused(tmp_path, slug):
    with pytest.raises(ValueError, match="must be a file name"):
        database.database_path(slug, tmp_path)
    with pytest.raises(ValueError, match="must be a file name"):
        Fingerprint(slug=slug, kind="gpu", name="x")
    with pytest.raises(ValueError, match="must be a file name"):
        database.search(slug, tmp_path)


def test_a_recordings_device_slug_cannot_write_outside_the_database_folder(tmp_path):
    from bole_tune.runners import ReplayRunner

    recording = tmp_path / "rec.json"
    recording.write_text(json.dumps({"device": {"slug": "../../escaped", "name": "x"}, "measurements": {}}))
    with pytest.raises(ValueError, match="'../../escaped'"):
        ReplayRunner(recording).fingerprint()
    assert not list(tmp_path.parent.parent.glob("escaped*"))


# ---- the shipped database is read-only to the tool --------------------------------------------------

def test_the_default_folder_is_never_the_shipped_one(tmp_path, monkeypatch):
    shipped = tmp_path / "site-packages" / "bole_tune" / "tuning_db"
    shipped.mkdir(parents=True)
    monkeypatch.setattr(database, "SHIPPED_DIR", shipped)
    monkeypatch.delenv("BOLE_TUNE_DB", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert database.database_path("nvidia-h200") == tmp_path / "data" / "bole-tune" / "tuning_db" / "nvidia-h200.yaml"
    (tmp_path / "data" / "bole-tune").mkdir(parents=True)
    (tmp_path / "data" / "bole-tune" / "tuning_db").symlink_to(shipped)  # the user's folder leads to the package
    with pytest.raises(ValueError, match="shipped with bole-tune"):
        database.database_path("nvidia-h200")
    assert database.database_path("nvidia-h200", shipped) == shipped / "nvidia-h200.yaml", "explicit: allowed"
    monkeypatch.setenv("BOLE_TUNE_DB", str(shipped))
    assert database.database_path("nvidia-h200") == shipped / "nvidia-h200.yaml", "$BOLE_TUNE_DB: explicit"


def test_budget_for_the_shipped_gpu_writes_the_users_database(tmp_path, monkeypatch):
    from bole_tune.budget import store_budgets

    shipped = database.SHIPPED_DIR / "nvidia-h200.yaml"
    before = shipped.read_bytes(), shipped.stat().st_mtime_ns
    monkeypatch.delenv("BOLE_TUNE_DB", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    result = store_budgets(["qwen3.5-9b"], ["qwen3.5-mtp-mbpp"], ["sglang"], slug="nvidia-h200")
    assert result.path == tmp_path / "bole-tune" / "tuning_db" / "nvidia-h200.yaml" and result.path.exists()
    assert (shipped.read_bytes(), shipped.stat().st_mtime_ns) == before, "the shipped database was written"


# ---- the curve phase resumes; provenance holds no path ----------------------------------------------

@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A tiny model profile, profiled as a user's CPU run does: on the PyTorch fallback, not the interpreter."""
    from bole_tune.profiles import resolve_model

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    path = tmp_path / "tiny-moe.yaml"
    path.write_text(TINY_MODEL)
    return resolve_model(str(path))


def _points(path, model):
    curves = database.load(path)["curves"]
    return {(name, p["batch"], p["tree_size"]): (p["p50"], p["measured"])
            for name, c in curves.items() if c["model"] == model for p in c["points"]}


def _measure(plan, db, **kw):
    """Profile; return the result and the rows measured (not resumed)."""
    result = profiler.profile(plan, db_dir=db, **kw)
    return result, [r for r in result.curve_rows if not r.get("resumed")]


@cpu_only
def test_profile_skips_points_already_measured_alike(tmp_path, tiny, monkeypatch):
    from bole_tune.profiles import resolve_model

    (tmp_path / "tiny-two.yaml").write_text(TINY_MODEL.replace("Tiny-MoE", "Tiny-Two"))
    other = resolve_model(str(tmp_path / "tiny-two.yaml"))
    db = tmp_path / "db"
    first, _ = _measure(profiler.make_plan([tiny]), db)
    (path,) = db.glob("*.yaml")
    a_before = _points(path, "Tiny-MoE")
    assert len(a_before) == 12  # 2 batches x 2 tree sizes x 3 curves (verify, commit, round)
    time.sleep(1.1)  # dates are to the second: a re-measured point would show a new one
    second, measured = _measure(profiler.make_plan([tiny, other]), db)
    assert {r["model"] for r in measured} == {"Tiny-Two"}, "finished points were measured again"
    assert _points(path, "Tiny-MoE") == a_before
    assert "resumed: 12 of 24 curve points" in " ".join(second.notes)
    # other code (or --remeasure) measures them again
    with monkeypatch.context() as patch:
        patch.setattr(profiler, "code_version", lambda: "other")
        _, measured = _measure(profiler.make_plan([tiny]), db)
    assert len(measured) == 12
    _, measured = _measure(profiler.make_plan([tiny]), db, remeasure=True)
    assert len(measured) == 12
    assert all(p[1] != a_before[k][1] for k, p in _points(path, "Tiny-MoE").items())


@cpu_only
def test_provenance_records_no_path_of_this_machine(tmp_path, tiny):
    db = tmp_path / "db"
    profiler.profile(profiler.make_plan([tiny]), db_dir=db)
    (path,) = db.glob("*.yaml")

    def strings(value):
        if isinstance(value, dict):
            for k, v in value.items():
                yield from strings(k)
                yield from strings(v)
        elif isinstance(value, list):
            for v in value:
                yield from strings(v)
        elif isinstance(value, str):
            yield value

    paths = [s for s in strings(database.load(path)) if s.startswith(("/", "~")) or str(tmp_path) in s
             or os.path.expanduser("~") in s]
    assert not paths


KILL_IN_SECOND_MODEL = """
import os, signal, sys
from bole_tune.profiler import make_plan, profile

def progress(report):  # SIGKILL once the second model's first point is measured: the first is written
    if report.stage == "curves" and report.label.startswith("Tiny-Two") and sys.argv[3] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)

profile(make_plan(sys.argv[4:]), db_dir=sys.argv[1], progress=progress)
"""


@cpu_only
def test_profile_killed_between_models_resumes_without_redoing_the_first(tmp_path):
    for name in ("Tiny-MoE", "Tiny-Two"):
        (tmp_path / f"{name}.yaml").write_text(TINY_MODEL.replace("Tiny-MoE", name))
    db = tmp_path / "db"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)

    def run(mode):
        return subprocess.run([sys.executable, "-c", KILL_IN_SECOND_MODEL, str(db), "-", mode,
                               str(tmp_path / "Tiny-MoE.yaml"), str(tmp_path / "Tiny-Two.yaml")],
                              env=env, capture_output=True, text=True, timeout=300)

    killed = run("kill")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    (path,) = db.glob("*.yaml")
    before = _points(path, "Tiny-MoE")
    assert len(before) == 12 and not _points(path, "Tiny-Two")
    time.sleep(1.1)  # dates are to the second: a re-measured point would show a new one
    resumed = run("-")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _points(path, "Tiny-MoE") == before, "the first model's finished points were measured again"
    assert len(_points(path, "Tiny-Two")) == 12
    assert not list(tmp_path.glob("bole-tune-job-*")) and not list(tmp_path.glob(".*.tmp"))


# ---- job folders ---------------------------------------------------------------------------------------

def test_job_folders_are_removed_however_a_run_ends_and_kept_when_a_worker_failed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = tmp_path / f"{profiler._job_prefix(dead.pid)}killed"
    left.mkdir()
    (left / "job.json").write_text("{}")
    alive = tmp_path / f"{profiler._job_prefix(os.getpid())}running"
    alive.mkdir()
    with profiler.job_folder() as folder:
        assert folder.path.parent == tmp_path and folder.path.is_dir()
    assert not left.exists(), "a killed run's folder was left"
    assert alive.exists(), "a running run's folder was removed"
    assert not folder.path.exists()
    with pytest.raises(KeyboardInterrupt):
        with profiler.job_folder() as folder:
            raise KeyboardInterrupt
    assert not folder.path.exists(), "an interrupted run left its folder"
    with profiler.job_folder() as folder:
        (folder.path / "job.json.worker0.log").write_text("boom\n")
        kept = folder.keep()
    assert (kept / "job.json.worker0.log").read_text() == "boom\n" and kept.name.startswith("bole-tune-failed-")
    with profiler.job_folder():
        pass
    assert kept.exists(), "a failed run's logs were removed by the next run"
    mine = tmp_path / "given"
    mine.mkdir()
    with profiler.job_folder(mine):
        pass
    assert mine.exists(), "a folder the caller gave was removed"
