"""Reliability: nothing hangs or takes the machine down, and every bad input is one line, exit 2, named.

Classes of issue 19, each tested at its mechanism: sizes and worker counts bounded where they enter (the
tree generator linear, `--workers` bounded by the host and the job); a storage several processes open for
the first time at once; output paths checked before any work; profile, acceptance and log loaders that
name the file, line and field; flags and environment values out of range refused, not read as something
else. CLI cases run as a user runs them: a subprocess, its stderr and exit status.
"""

import json
import multiprocessing
import os
import random
import subprocess
import sys
import time

import pytest
import yaml

from bole_tune import database, render
from bole_tune.acceptance import calibrate, load_acceptance
from bole_tune.arguments import check_output, write_or_rescue
from bole_tune.profiles import ProfileError, load_model
from bole_tune.search_space import SearchSpace
from bole_tune.tuner import open_storage, tune_bucket
from bole_tune.workers import Job, check_workers, run_workers, worker_limit
from bole_tune.workloads import MAX_TREE_SIZE, tree_parents
from test_database import KEY, entry
from test_tuner import write_recording

MODELS = os.path.join(os.path.dirname(__file__), "..", "profiles", "models")
GOOD_MODEL = open(os.path.join(MODELS, "qwen3.5-9b.yaml")).read()
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def run_cli(*args, timeout=120, env=None):
    full_env = {**os.environ, "COLUMNS": "80", **(env or {})}  # narrow: a wrapped error would show as two lines
    full_env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", "bole_tune.cli", *map(str, args)], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


# ---- hangs and resource blow-ups ---------------------------------------------------------------------

def quadratic_tree_parents(size, kind, max_depth, rng):
    """The definition, rescanning every earlier node for each new one (what the generator did before)."""
    parents, depths = [-1], [0]
    for n in range(1, size):
        if rng.random() < (0.15 if kind == "forest" else 0.0):
            parents.append(-1)
            depths.append(0)
            continue
        candidates = [j for j in range(n) if depths[j] < max_depth]
        p = rng.choice(candidates)
        parents.append(p)
        depths.append(depths[p] + 1)
    return parents


@pytest.mark.parametrize("kind", ["random", "forest"])
@pytest.mark.parametrize("max_depth", [1, 2, 8])
def test_tree_generator_keeps_its_distribution(kind, max_depth):
    """The same trees, node for node, as the definition: node n hangs off a uniformly chosen earlier node of
    depth < max_depth (so every shipped measurement's trees are unchanged)."""
    for seed in range(5):
        for size in (1, 2, 9, 200):
            expected = quadratic_tree_parents(size, kind, max_depth, random.Random(seed))
            assert tree_parents(size, kind, max_depth, random.Random(seed)) == expected


def test_tree_generator_is_linear():
    """60,000 nodes: 0.05 s linear; the quadratic generator took 12 s for 20,000 (about 100 s here) and hours
    for the 10^6 of `bench --tree-size 1000000`."""
    start = time.perf_counter()
    parents = tree_parents(60_000, "random", 8)
    assert time.perf_counter() - start < 10
    assert len(parents) == 60_000


@pytest.mark.parametrize("max_depth", [0, -1, 2.5, True])
def test_tree_generator_refuses_a_depth_bound_below_one(max_depth):
    with pytest.raises(ValueError, match="max_depth"):
        tree_parents(10, "random", max_depth)


def test_worker_count_is_bounded_by_host_and_job(tmp_path):
    limit, reason = worker_limit("replay", 10**9)
    assert 1 <= limit <= 4 * (os.cpu_count() or 1), reason
    assert worker_limit("replay", 3)[0] <= 3
    assert check_workers(1, "replay", 1) == 1
    with pytest.raises(ValueError, match=r"--workers: 10000 is more than .* \(at most \d+: "):
        check_workers(10_000, "replay", 10**9)
    with pytest.raises(ValueError, match="--workers: 5 .*at most 4: 4 trials in the job"):
        check_workers(5, "replay", 4)
    with pytest.raises(ValueError, match="--workers: must be a positive int"):
        check_workers(0, "replay", 4)
    job = Job(keys=[KEY.as_dict()], storage="sqlite://", slug="replay-gpu", n_trials=4,
              runner={"kind": "replay", "path": str(tmp_path / "none.json")})
    with pytest.raises(ValueError, match="--workers"):  # the library refuses too, before starting a process
        run_workers(job, 10_000, tmp_path / "job.json")
    assert not list(tmp_path.iterdir()), "a refused job started workers or wrote files"


def _open_default_storage(cache: str, start: float, results) -> None:
    os.environ["XDG_CACHE_HOME"] = cache
    while time.time() < start:
        pass
    try:
        open_storage(None)
        results.put("ok")
    except Exception as error:  # reported to the test, which shows it
        results.put(f"{type(error).__name__}: {error}")


def test_processes_open_a_new_default_storage_at_once(tmp_path):
    """Six processes open the default SQLite storage, never created before, in the same instant (without
    the lock: 'UNIQUE constraint failed: alembic_version.version_num' or 'table ... already exists' in
    every round). Forked from this process, which has imported everything: the children start at once."""
    context = multiprocessing.get_context("fork")
    for round_ in range(3):
        cache = tmp_path / f"cache{round_}"
        results = context.Queue()
        start = time.time() + 1.0
        processes = [context.Process(target=_open_default_storage, args=(str(cache), start, results))
                     for _ in range(6)]
        for p in processes:
            p.start()
        for p in processes:
            p.join(120)
        outcomes = [results.get(timeout=10) for _ in processes]
        assert outcomes == ["ok"] * 6, outcomes


def test_a_study_stops_at_the_size_of_its_search_space(tmp_path):
    from bole_tune.runners import ReplayRunner

    path = tmp_path / "space.yaml"
    path.write_text("b_k: [64]\nb_v: [32, 64]\nnum_warps: [4]\nnum_stages: [2]\n")
    space = SearchSpace.load(path)
    assert space.size == 2
    with pytest.raises(ValueError, match="--trials: 50 is more than the 2 configs of the search space"):
        space.check_trials(50)
    runner = ReplayRunner(write_recording(tmp_path / "rec.json"))
    result = tune_bucket(runner, KEY, space, open_storage(f"sqlite:///{tmp_path / 's.db'}"), 50, "replay-gpu")
    assert result.counts["total"] == 2 and runner.calls == 2


# ---- output paths, checked before any work --------------------------------------------------------------

def test_output_paths(tmp_path):
    folder, file = tmp_path / "folder", tmp_path / "file.txt"
    folder.mkdir()
    file.write_text("x")
    assert check_output(file, "--json") == file  # an existing file is replaced
    assert check_output(tmp_path / "new" / "deeper" / "rows.json", "--json")  # missing folders are created
    assert check_output(tmp_path / "new-folder", "--out", folder=True)
    for path, is_folder, message in [(folder, False, "--json: .* is a folder, expected a file name"),
                                     (file, True, "--out: .* is a file, expected a folder"),
                                     (file / "rows.json", False, "--json: .*file.txt is a file, so .* cannot be"),
                                     (file / "plots", True, "--out: .*file.txt is a file, so .* cannot be")]:
        with pytest.raises(ValueError, match=message):
            check_output(path, message.split(":")[0], folder=is_folder)


@pytest.mark.skipif(IS_ROOT, reason="root writes into a read-only folder")
def test_output_in_a_read_only_folder(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with pytest.raises(ValueError, match="--export: cannot write in the folder"):
            check_output(locked / "engines", "--export", folder=True)
    finally:
        locked.chmod(0o755)


def test_results_that_cannot_be_written_are_kept_elsewhere(tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="--json: cannot write .*; the results are in (.+)") as info:
        write_or_rescue(blocker / "rows.json", '{"rows": [1]}', "--json")
    rescue = str(info.value).rsplit("the results are in ", 1)[1]
    try:
        assert open(rescue).read() == '{"rows": [1]}'
    finally:
        os.unlink(rescue)


# ---- loaders: one error naming the file, line and field ---------------------------------------------------

@pytest.mark.parametrize("content, message", [
    (None, "is a folder, expected a file"),
    (b"name: \xff\xfe\n", "not UTF-8 text"),
    (GOOD_MODEL.replace("key_head_dim: 128", "key_head_dim: 100").encode(),
     "gdn.key_head_dim: 100 is not a head size the kernels support"),
    (GOOD_MODEL.replace("value_head_dim: 128", "value_head_dim: 48").encode(), "gdn.value_head_dim: 48"),
], ids=["folder", "not-utf8", "dk-100", "dv-48"])
def test_model_profile_loader(tmp_path, content, message):
    path = tmp_path
    if content is not None:
        path = tmp_path / "model.yaml"
        path.write_bytes(content)
    with pytest.raises(ProfileError, match=message) as info:
        load_model(f"{path}/" if content is None else str(path))
    assert str(path) in str(info.value)


def test_acceptance_loader_names_the_file(tmp_path):
    with pytest.raises(ProfileError, match="is a folder"):
        load_acceptance(str(tmp_path) + "/")
    bad = tmp_path / "w.yaml"
    bad.write_bytes(b"\x80\x81")
    with pytest.raises(ProfileError, match=f"{bad}: not UTF-8"):
        load_acceptance(str(bad))


@pytest.mark.parametrize("line, message", [
    ('{"parents": [-1, "0"], "ranks": [1, 1], "accepted": [0]}', ':2: parents\\[1\\]: expected an int, got \'0\''),
    ('{"parents": [-1, 0], "ranks": [1, 1.5], "accepted": [0]}', ":2: ranks\\[1\\]: expected an int, got 1.5"),
    ('{"parents": [-1, 0], "ranks": [1, 1], "accepted": "0"}', ":2: accepted: expected a list of ints"),
    ('{"parents": [-1, 0], "ranks": [1, 1], "accepted": [true]}', ":2: accepted\\[0\\]: expected an int"),
    ('{"parents": [-1, 0], "ranks": [1, 1]}', ":2: accepted: missing"),
    ('[1, 2]', ":2: expected an object"),
    ('{"parents": [-1, 0}', ":2: expected an object .*; not JSON"),
], ids=["parent-string", "rank-float", "accepted-string", "accepted-bool", "missing", "not-object", "not-json"])
def test_calibrate_names_line_and_field(tmp_path, line, message):
    log = tmp_path / "log.jsonl"
    log.write_text('{"parents": [-1, 0], "ranks": [1, 1], "accepted": [0, 1]}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        calibrate(log)


# ---- values out of range, never read as something else ----------------------------------------------------

def _database_file(tmp_path, **changes):
    e = {**entry(), **changes}
    path = tmp_path / "replay-gpu.yaml"
    path.write_text(yaml.safe_dump({"schema_version": 1, "device": {"slug": "replay-gpu", "name": "Replay GPU"},
                                    "configs": {KEY.text: e}}))
    return path


@pytest.mark.parametrize("changes, message", [
    (dict(kernel="turbo"), "kernel: expected one of fused, resident, stream, got 'turbo'"),
    (dict(latency_us={"p20": 1.0, "p50": float("inf"), "p80": 2.0}), "latency_us.p50: expected a finite"),
    (dict(default_latency_us={"p20": 1.0, "p50": 2.0, "p80": float("nan")}), "default_latency_us.p80"),
], ids=["unknown-kernel", "inf-latency", "nan-latency"])
def test_database_refuses_unknown_kernels_and_non_finite_latencies(tmp_path, changes, message):
    with pytest.raises(database.DatabaseError, match=message):
        database.load(_database_file(tmp_path, **changes))


def test_known_kernels_load(tmp_path):
    for kernel in ("fused", "resident"):
        assert database.load(_database_file(tmp_path, kernel=kernel))["configs"][KEY.text]["kernel"] == kernel


def test_json_output_is_json():
    text = render.json_text({"p50": float("inf"), "rows": [float("nan"), 1.5], "ok": True})
    assert json.loads(text) == {"p50": None, "rows": [None, 1.5], "ok": True}


def test_lookup_policies_are_checked(monkeypatch):
    from bole_tune.lookup import decide, policy

    monkeypatch.setenv("BOLE_TUNE_LOOKUP", "fastest")
    with pytest.raises(ValueError, match="BOLE_TUNE_LOOKUP: unknown policy 'fastest'"):
        policy()
    with pytest.raises(ValueError, match="unknown lookup policy 'fastest'"):
        decide(KEY, "replay-gpu", mode="fastest")


def test_budget_refuses_nan_batch():
    from bole_tune.budget import get_budget

    with pytest.raises(ValueError, match="batch_size"):
        get_budget(float("nan"), "Qwen3.5-9B", device="nvidia-h200")


# ---- the command line: one line on stderr, exit 2, before any work -------------------------------------------

LOOKUP = ["lookup", "--gpu", "replay-gpu", "--hv", "32", "--hk", "16", "--dk", "128", "--dv", "128",
          "--tree-size", "64", "--batch", "16"]
TUNE = ["tune", "--replay", "REC", "--model", "qwen3.5-9b", "--batch", "16", "--tree-size", "64"]

CLI_CASES = {
    "bench-huge-tree": (["bench", "--tree-size", "1000000"],
                        f"--tree-size: expected an integer from 1 to {MAX_TREE_SIZE}, got 1000000"),
    "step-huge-tree": (["step", "--tree-size", "100000"], "--tree-size"),
    "bench-huge-batch": (["bench", "--batch", "100000"], "--batch: expected an integer from 1 to"),
    "profile-curve-tree": (["profile", "--curve-tree-size", "5000"], "--curve-tree-size"),
    "bench-repeats-0": (["bench", "--repeats", "0"], "--repeats: expected an integer from 3"),
    "step-repeats-negative": (["step", "--repeats", "-5"], "--repeats"),
    "tune-repeats-0": ([*TUNE, "--repeats", "0"], "--repeats"),
    "bench-max-depth-0": (["bench", "--max-depth", "0"], "--max-depth: expected an integer from 1"),
    "bench-not-a-number": (["bench", "--batch", "4,x"], "--batch: expected an integer, got 'x'"),
    "workers-10000": ([*TUNE, "--workers", "10000"], "--workers: 10000 is more than this host and job can use"),
    "trials-beyond-space": ([*TUNE, "--trials", "5000"], "--trials: 5000 is more than the 152 configs"),
    "replay-delay-nan": ([*TUNE, "--replay-delay", "nan"], "--replay-delay"),
    "validate-trees-0": (["validate", "--trees", "0"], "--trees"),
    "bench-json-folder": (["bench", "--json", "FOLDER"], "--json: "),
    "bench-json-in-file": (["bench", "--json", "FILE/rows.json"], "is a file, so"),
    "calibrate-out-folder": (["calibrate", "LOG", "--out", "FOLDER"], "--out: "),
    "report-out-file": (["report", "--gpu", "replay-gpu", "--out", "FILE"], "--out: "),
    "budget-export-file": (["budget", "--export", "FILE"], "--export: "),
    "tune-record-folder": ([*TUNE, "--exhaustive", "--record", "FOLDER"], "--record: "),
    "profile-db-dir-file": (["profile", "--model", "qwen3.5-9b", "--db-dir", "FILE"], "--db-dir: "),
    "bench-model-folder": (["bench", "--model", "FOLDER/"], "is a folder, expected a file"),
    "bench-model-not-utf8": (["bench", "--model", "BINARY"], "not UTF-8 text"),
    "bench-model-dk-100": (["bench", "--model", "DK100"], "gdn.key_head_dim: 100"),
    "calibrate-typed-fields": (["calibrate", "BADLOG"], ":1: parents[1]: expected an int, got '0'"),
    "lookup-tp-3": ([*LOOKUP, "--tp", "3"], "--tp: 16 key and 32 value heads cannot be split evenly over tp=3"),
    "lookup-dk-100": ([*LOOKUP[:8], "100", *LOOKUP[9:]], "--dk: invalid choice: 100"),
    "lookup-policy": (LOOKUP, "BOLE_TUNE_LOOKUP: unknown policy 'fastest'"),
    "lookup-inf": ([*LOOKUP, "--json", "--db-dir", "INFDB"], "latency_us.p50: expected a finite"),
    "lookup-kernel": ([*LOOKUP, "--db-dir", "KERNELDB"], "kernel: expected one of fused, resident, stream"),
}


@pytest.fixture
def files(tmp_path):
    folder, file = tmp_path / "folder", tmp_path / "file"
    folder.mkdir()
    file.write_text("x")
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00name")
    (tmp_path / "dk100.yaml").write_text(GOOD_MODEL.replace("key_head_dim: 128", "key_head_dim: 100"))
    (tmp_path / "log.jsonl").write_text('{"parents": [-1, 0], "ranks": [1, 1], "accepted": [0]}\n')
    (tmp_path / "bad.jsonl").write_text('{"parents": [-1, "0"], "ranks": [1, 1], "accepted": [0]}\n')
    for name, changes in (("infdb", dict(latency_us={"p20": 1.0, "p50": float("inf"), "p80": 2.0})),
                          ("kerneldb", dict(kernel="turbo"))):
        (tmp_path / name).mkdir()
        _database_file(tmp_path / name, **changes)
    return {"FOLDER": folder, "FILE": file, "BINARY": tmp_path / "binary.yaml", "DK100": tmp_path / "dk100.yaml",
            "LOG": tmp_path / "log.jsonl", "BADLOG": tmp_path / "bad.jsonl", "INFDB": tmp_path / "infdb",
            "KERNELDB": tmp_path / "kerneldb", "REC": write_recording(tmp_path / "rec.json")}


@pytest.mark.parametrize("case", list(CLI_CASES), ids=list(CLI_CASES))
def test_cli_refuses_in_one_line_before_any_work(tmp_path, files, case):
    argv, fragment = CLI_CASES[case]
    argv = [str(files[a.split("/")[0]]) + a[len(a.split("/")[0]):] if a.split("/")[0] in files else a for a in argv]
    env = {"BOLE_TUNE_LOOKUP": "fastest"} if case == "lookup-policy" else {}
    env["BOLE_TUNE_DB"] = str(tmp_path / "db")  # never the user's database
    started = time.perf_counter()
    result = run_cli(*argv, env=env, timeout=120)
    assert_one_line_error(result, fragment)
    assert time.perf_counter() - started < 60, "refused only after work"
    assert not (tmp_path / "db").exists() or not any((tmp_path / "db").iterdir()), "a refused command wrote"
    assert "written" not in result.stdout and "rows" not in result.stdout


def test_cli_creates_missing_output_folders(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"parents": [-1, 0], "ranks": [1, 1], "accepted": [0, 1]}\n')
    out = tmp_path / "new" / "deeper" / "model.yaml"
    result = run_cli("calibrate", log, "--out", out)
    assert result.returncode == 0, result.stderr
    assert load_acceptance(str(out)).depth_acceptance[0] == 1.0
