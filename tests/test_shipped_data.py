"""The data the repository ships, read as the runtime and the docs read it: the tuning database under
tuning_db/, and the H200 exhaustive recording behind the README's tuner claim."""

import json
import os
import re
from pathlib import Path

import optuna
import pytest

from bole_tune import budget, database, lookup
from bole_tune.config import KernelConfig
from bole_tune.database import ShapeKey
from bole_tune.replay_study import key_from_text, replay_against_exhaustive
from bole_tune.runners import RecordingIncomplete, ReplayRunner
from bole_tune.search_space import SearchSpace
from bole_tune.tuner import tune_bucket

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "tuning_db"
SHIPPED_FILES = sorted(SHIPPED.glob("*.yaml"))
H200_EXHAUSTIVE = ROOT / "benchmarks" / "h200-2026-11-29" / "exhaustive-9b.json"

# what the runtime reads of a budget's batch entry: `get_budget` returns it (tokens, nodes per request,
# the tree's depth, width, parents and ranks, the batch sizes it serves), the engine exports read the rest
BUDGET_BATCH_FIELDS = ("batch", "serves", "tokens", "nodes_per_request", "draft_tokens", "shape", "depth", "width",
                       "parents", "ranks", "expected_accepted", "step_us", "draft_us", "tokens_per_second",
                       "speedup_vs_no_speculation", "speedup_vs_fixed_chain")
# what `StepCurve` and the budget planner read of a step-curve point
STEP_POINT_FIELDS = ("batch", "tree_size", "step_us", "gdn_us", "attention_us", "lm_head_us")


@pytest.fixture
def shipped_db(monkeypatch):
    """BOLE_TUNE_DB pointing at the shipped tuning_db/ folder, with no parse or decision cached."""
    monkeypatch.setenv("BOLE_TUNE_DB", str(SHIPPED))
    lookup.clear_cache()
    budget.clear_cache()
    yield SHIPPED
    lookup.clear_cache()
    budget.clear_cache()


def test_the_h200_database_is_shipped():
    assert SHIPPED / "nvidia-h200.yaml" in SHIPPED_FILES


@pytest.mark.parametrize("path", SHIPPED_FILES, ids=lambda p: p.name)
def test_shipped_database_loads_and_validates(path):
    data = database.load(path)
    assert data["device"].get("slug") == path.stem, "the file name is the slug the runtime looks for"
    assert data["configs"], f"{path.name}: no tuned configs"
    for name, entry in data["configs"].items():
        assert ShapeKey.from_dict(entry["key"], f"{path.name}: configs.{name}.key").text == name
        assert KernelConfig(**entry["config"]).text
    for name, entry in data["budgets"].items():
        where = f"{path.name}: budgets.{name}"
        assert entry["batches"], f"{where}: no batch sizes"
        for batch, info in entry["batches"].items():
            missing = [f for f in BUDGET_BATCH_FIELDS if f not in info]
            assert not missing, f"{where}.batches.{batch}: missing {missing}"
            assert info["tokens"] == int(batch) * info["nodes_per_request"]
            assert len(info["parents"]) == len(info["ranks"]) == info["draft_tokens"]
            if entry["engine"] in ("sglang", "vllm"):
                assert entry["engine"] in info, f"{where}.batches.{batch}: no {entry['engine']} settings"
        curve_name = entry.get("step_curve", name)
        assert curve_name in data["step_curves"], f"{where}.step_curve: no step curve {curve_name!r}"
    for name, entry in data["step_curves"].items():
        where = f"{path.name}: step_curves.{name}"
        for i, point in enumerate(entry["points"]):
            missing = [f for f in STEP_POINT_FIELDS if f not in point]
            assert not missing, f"{where}.points[{i}]: missing {missing}"
        curve = budget.StepCurve(entry["points"])
        for b in curve.batches:
            for field in STEP_POINT_FIELDS[2:]:
                assert curve.value(b, curve.max_tree_size(b), field) >= 0


def test_every_model_workload_and_engine_has_a_shipped_h200_budget(shipped_db):
    """`get_budget` answers from the shipped database for every shipped model, workload and engine at every
    batch size, the entry serving that batch size, on this CPU machine (device given as the GPU's slug)."""
    from bole_tune.acceptance import list_acceptance_models
    from bole_tune.profiles import DEFAULT_MODELS, resolve_model

    for model in DEFAULT_MODELS:
        for workload in list_acceptance_models():
            for engine in budget.ENGINES:
                for batch_size in (1, 3, 16, 33, 200):
                    entry = budget.get_budget(batch_size, model=resolve_model(model).name, device="nvidia-h200",
                                              acceptance=workload, engine=engine)
                    lo, hi = entry["serves"]
                    assert lo <= batch_size and (hi is None or batch_size <= hi), (model, workload, engine, entry)


@pytest.mark.parametrize("path", SHIPPED_FILES, ids=lambda p: p.name)
def test_lookup_decides_exact_for_every_shipped_key(path, shipped_db):
    data = database.load(path)
    slug = path.stem
    for name, entry in data["configs"].items():
        key = ShapeKey.from_dict(entry["key"])
        decision = lookup.decide(key, slug, "strict")
        assert decision.how == "exact", (name, decision.reason)
        assert decision.config == KernelConfig(**entry["config"]), name
        assert Path(decision.source).resolve() == path.resolve(), (name, decision.source)


def readme_tuner_claim() -> dict:
    """The README's sentence on the replay: '32 trials land within 3% of the best of all 108 configs in
    118 of 120 seeded runs'. The test checks what the README says, whatever numbers it says."""
    text = " ".join((ROOT / "README.md").read_text().split())
    match = re.search(r"(\d+) trials land within (\d+)% of the best of all (\d+) configs in (\d+) of (\d+) "
                      r"seeded runs", text)
    assert match, "README.md no longer states the tuner's replay figure in the form this test reads"
    trials, percent, configs, within, runs = map(int, match.groups())
    return {"trials": trials, "tolerance": percent / 100, "configs": configs, "within": within, "runs": runs}


def test_tuner_replayed_on_the_h200_recording_meets_the_readme_claim():
    """32 trials (30% of the 108-config space) per study, sampler seeds 0..29 on each of the
    recording's four buckets: 120 studies, each within 3% of the exhaustive best in as many runs as
    the README claims (about 10 s on one CPU core)."""
    claim = readme_tuner_claim()
    shipped = SearchSpace.load()
    # the recording covers the space as it was when it was made: b_k up to 64 (128 joined later), no Gluon configs
    space = SearchSpace({**shipped.values, "b_k": tuple(b for b in shipped.values["b_k"] if b <= 64), "gluon": (0,)},
                        source=shipped.source)
    assert set(shipped.values["b_k"]) - set(space.values["b_k"]) == {128}
    assert claim["configs"] == len(space.configs()), "the README's search-space size is not the recorded one"
    assert claim["trials"] == int(0.3 * claim["configs"]), "the claim is about 30% of the space"
    runner = ReplayRunner(H200_EXHAUSTIVE)
    buckets = runner.keys()
    assert claim["runs"] % len(buckets) == 0, f"{claim['runs']} runs do not split over {len(buckets)} buckets"
    seeds = range(claim["runs"] // len(buckets))
    results = replay_against_exhaustive(runner, claim["trials"], seeds, space)
    assert sum(len(b.runs) for b in results) == claim["runs"]
    within = sum(b.within(claim["tolerance"]) for b in results)
    report = "\n".join(b.summary() for b in results)
    assert within >= claim["within"], f"{within} of {claim['runs']} runs within 3% (README: {claim['within']})\n{report}"
    for b in results:
        assert all(r.configs_measured <= claim["trials"] for r in b.runs), b.summary()


def test_key_from_text_reads_back_every_key_text():
    for text in ReplayRunner(H200_EXHAUSTIVE).keys():
        assert key_from_text(text).text == text
    for entry in database.load(SHIPPED / "nvidia-h200.yaml")["configs"].values():
        key = ShapeKey.from_dict(entry["key"])
        assert key_from_text(key.text) == key
    with pytest.raises(ValueError, match="not a bucket key"):
        key_from_text("Hv32-Hk16-dk128")


def incomplete_recording(tmp_path, drop_config: str):
    """The H200 recording without ``drop_config`` in its first bucket."""
    data = json.loads(H200_EXHAUSTIVE.read_text())
    key_text = next(iter(data["measurements"]))
    del data["measurements"][key_text][drop_config]
    path = tmp_path / "incomplete.json"
    path.write_text(json.dumps(data))
    return path, key_text


def test_a_config_missing_from_the_recording_is_an_error_not_infeasible(tmp_path):
    default = "64/32/4/2"  # every study measures the default config first
    path, key_text = incomplete_recording(tmp_path, default)
    runner = ReplayRunner(path)
    key = key_from_text(key_text)
    with pytest.raises(RecordingIncomplete) as raised:
        runner.measure(key, KernelConfig(64, 32, 4, 2))
    message = str(raised.value)
    assert path.name in message and key_text in message and default in message
    assert isinstance(raised.value, ValueError)
    with pytest.raises(RecordingIncomplete, match=re.escape(default)):  # the tuner does not swallow it
        tune_bucket(runner, key, SearchSpace.load(), optuna.storages.InMemoryStorage(), 8, "replay")


def test_a_bucket_missing_from_the_recording_is_an_error(tmp_path):
    data = json.loads(H200_EXHAUSTIVE.read_text())
    first, second = list(data["measurements"])[:2]
    del data["measurements"][second]
    path = tmp_path / "three-buckets.json"
    path.write_text(json.dumps(data))
    with pytest.raises(RecordingIncomplete, match=re.escape(second)) as raised:
        ReplayRunner(path).measure(key_from_text(second), KernelConfig(64, 32, 4, 2))
    assert path.name in str(raised.value)
    assert ReplayRunner(path).measure(key_from_text(first), KernelConfig(64, 32, 4, 2)).status == "ok"


def _has_build_backend() -> bool:
    """pyproject.toml's build requirements importable here: setuptools >= 68 and wheel (setuptools >= 70.1 builds
    wheels by itself)."""
    import importlib.util

    try:
        import setuptools
    except ImportError:
        return False
    version = tuple(int(part) for part in setuptools.__version__.split(".")[:2] if part.isdigit())
    return version >= (70, 1) or (version >= (68,) and importlib.util.find_spec("wheel") is not None)


def test_a_regular_install_finds_its_code_and_its_data(tmp_path):
    """A non-editable install (what `pip install bole-tune` gives) imports the library, not the YAML data
    folder, under `bole_tune.profiles`, and finds the shipped profiles, search space and database."""
    import shutil
    import subprocess
    import sys

    source, target = tmp_path / "src", tmp_path / "site"  # a copy: a build writes into its source folder
    for name in ("bole_tune", "kernels", "profiles", "tuning_db"):
        shutil.copytree(ROOT / name, source / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("cli.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    # the build backend pyproject.toml names, from this environment where it has one (a machine without a network,
    # like the GPU machine, cannot fetch it into an isolated build environment), else fetched as pip does
    flags = ["--no-build-isolation"] if _has_build_backend() else []
    built = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *flags, "--target",
                            str(target), str(source)], capture_output=True, text=True, cwd=tmp_path)
    assert built.returncode == 0, built.stderr[-2000:]
    code = ("from bole_tune.profiles import load_model, DEFAULT_MODELS; from bole_tune.search_space import SearchSpace; "
            "from bole_tune import database; from bole_tune.acceptance import list_acceptance_models; "
            "import bole_tune.kernels, bole_tune.cli; "
            "assert database.SHIPPED_DIR.is_relative_to(%r), database.SHIPPED_DIR; "
            "print(load_model('qwen3.5-9b').name, len(SearchSpace.load().configs()), "
            "len(database.load(database.SHIPPED_DIR / 'nvidia-h200.yaml')['configs']) > 0, "
            "len(list_acceptance_models()) > 0)" % str(target))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={**env, "PYTHONPATH": str(target)})
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.split() == ["Qwen3.5-9B", "152", "True", "True"], ran.stdout
