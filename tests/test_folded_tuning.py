"""The folded verify (tree_verify with pending=) is tuned on its own: its bucket keys (ShapeKey.fold, text ending
in -fold), database entries, lookup (its own entry, else its bucket's verify entry), the planner asking the
config source for it, the tuner's studies and starts, the runner's check and timing, and `bole-tune tune --fold`."""

import dataclasses
import json
import warnings

import pytest
import torch

from bole_tune import database, lookup
from bole_tune.config import KernelConfig
from bole_tune.database import DatabaseError, ShapeKey
from bole_tune.replay_study import key_from_text
from bole_tune.runners import GPURunner, ReplayRunner
from bole_tune.shapes import HeadShape
from bole_tune.tuner import neighbours, tune_bucket, warm_starts
from test_cli import run
from test_database import entry, shape_key
from test_tuner import SPACE, storage, write_recording

SLUG = "test-gpu"
FOLD = dataclasses.replace(shape_key(tree=8, batch=16), fold=True)
HEADS = HeadShape(hk=16, hv=32, dk=128, dv=128)
GPU = torch.device("cuda", 0)


def test_fold_keys_read_back_from_text_and_dict():
    assert FOLD.text == "Hv32-Hk16-dk128-dv128-bf16-T8-B16-fold" and FOLD.as_dict()["fold"] is True
    assert "fold" not in FOLD.verify_key.as_dict()  # verify entries keep the keys they always had
    assert key_from_text(FOLD.text) == FOLD and ShapeKey.from_dict(FOLD.as_dict()) == FOLD
    tp = dataclasses.replace(FOLD, tp=2)
    assert tp.text.endswith("-TP2-fold") and key_from_text(tp.text) == tp
    assert FOLD.verify_key == shape_key(tree=8, batch=16) and FOLD != FOLD.verify_key
    with pytest.raises(DatabaseError, match="key.fold: expected true or false"):
        ShapeKey.from_dict({**FOLD.as_dict(), "fold": "yes"})
    with pytest.raises(ValueError, match="ShapeKey.fold"):
        dataclasses.replace(FOLD, fold=1)


@pytest.fixture
def db(tmp_path, monkeypatch):
    monkeypatch.setenv("BOLE_TUNE_DB", str(tmp_path))
    monkeypatch.delenv("BOLE_TUNE_LOOKUP", raising=False)
    lookup.clear_cache()
    verify = FOLD.verify_key
    database.update(database.database_path(SLUG, tmp_path),
                    configs={verify.text: entry(verify, b_v=64), FOLD.text: entry(FOLD, b_v=32)})
    yield tmp_path
    lookup.clear_cache()


def test_a_folded_launch_takes_its_own_entry_else_its_verify_entry(db):
    assert database.load(database.database_path(SLUG, db))["configs"][FOLD.text]["key"]["fold"] is True
    assert lookup.decide(FOLD, SLUG).how == "exact" and lookup.decide(FOLD, SLUG).config.b_v == 32
    assert lookup.decide(FOLD.verify_key, SLUG).config.b_v == 64  # the verify never takes the folded entry
    other = dataclasses.replace(FOLD, tree_bucket=16)  # no folded entry: the bucket's verify decision
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        decision = lookup.decide(other, SLUG)
    verify = lookup.decide(other.verify_key, SLUG)
    assert (decision.config, decision.how, decision.key) == (verify.config, verify.how, other)
    assert verify.how == "nearest" and verify.config.b_v == 64  # from T8-B16's verify, not its folded entry
    assert lookup.decide(FOLD.verify_key, SLUG, "strict").how == "exact"
    assert lookup.decide(FOLD, SLUG, "strict").config.b_v == 32


def test_the_planner_asks_the_config_source_for_the_folded_launch(db, monkeypatch):
    from bole_tune.kernels.verify.planner import Planner

    monkeypatch.setattr(lookup, "_device_slug", lambda device: SLUG)
    planner = Planner(config_source=lookup.tuned_launch)

    def plan(p, **kwargs):
        return p.plan(HEADS, torch.bfloat16, num_requests=16, max_tree_size=8, depth=7, device=GPU, check=False,
                      **kwargs)

    assert plan(planner).config.b_v == 64 and plan(planner, fold=True).config.b_v == 32
    asked = []

    def old_source(heads, dtype, max_tree_size, num_requests, device):  # written before folded entries
        asked.append(num_requests)
        return KernelConfig(32, 16, 2, 1), None

    assert plan(Planner(config_source=old_source), fold=True).config == KernelConfig(32, 16, 2, 1) and asked == [16]


def test_studies_of_folded_buckets_start_from_their_verify_config():
    verify, config, near = FOLD.verify_key, KernelConfig(128, 32, 4, 2), KernelConfig(32, 64, 2, 3)
    other_fold = dataclasses.replace(FOLD, tree_bucket=16)
    tuned = {verify.text: (verify, config), other_fold.text: (other_fold, near)}
    assert warm_starts(FOLD, tuned) == [config, near]
    assert neighbours(FOLD, tuned) == [near] and neighbours(verify, tuned) == []  # no mixing of the two launches


def test_tune_bucket_runs_a_folded_study(tmp_path):
    result = tune_bucket(ReplayRunner(write_recording(tmp_path / "rec.json", key=FOLD)), FOLD, SPACE,
                         storage(tmp_path), 12, "replay-gpu")
    assert result.key == FOLD and result.best is not None and result.study_name.endswith("-fold")


def test_the_fold_check_of_a_batch_larger_than_its_reference_instance():
    """The fold's check runs on CHECK_BATCH requests whatever the batch timed (a 16-request bucket once failed here)."""
    from bole_tune.bench import CHECK_BATCH, BenchCase, CaseBench

    bench = CaseBench(BenchCase(HeadShape(hk=1, hv=2, dk=32, dv=32), 16, 8, torch.float32, 8, label="x"), "cpu")
    o_error, state_error = bench.fold_errors(bench.launch(KernelConfig(16, 16, 4, 1)))
    assert bench.reference()[0].num_requests == CHECK_BATCH < 16
    assert o_error < 1e-3 and state_error < 1e-5


def test_the_runner_checks_and_times_the_folded_round_on_the_cpu(monkeypatch):
    from bole_tune.bench import CaseBench

    key = ShapeKey(heads=HeadShape(hk=1, hv=2, dk=32, dv=32), dtype="fp32", tree_bucket=8, batch_bucket=1, fold=True)
    runner = GPURunner("cpu", repeats=3)
    m = runner.measure(key, KernelConfig(16, 16, 4, 1))
    assert m.status == "ok" and m.rel_error < 1e-3 and m.p50_us > 0, m
    o_error, state_error = runner.bench(key).fold_errors(runner.bench(key).launch(KernelConfig(16, 16, 4, 1)))
    assert o_error < 1e-3 and state_error < 1e-5
    monkeypatch.setattr(CaseBench, "fold_errors", lambda self, launch=None: (1e-4, 3e-2))
    m = runner.measure(key, KernelConfig(16, 16, 4, 1))
    assert m.status == "wrong" and "folded state" in m.message, m


def test_tune_fold_on_the_command_line(tmp_path):
    recording = write_recording(tmp_path / "rec.json", key=FOLD)
    db_dir = tmp_path / "db"
    common = ["tune", "--replay", str(recording), "--model", "qwen3.5-9b", "--batch", "16", "--tree-size", "8",
              "--trials", "12", "--storage", f"sqlite:///{tmp_path / 's.db'}", "--db-dir", str(db_dir)]
    refused = run(*common, "--fold", "--commit")
    assert refused.returncode != 0 and "--fold" in refused.stderr and "Traceback" not in refused.stderr
    result = run(*common, "--fold")
    assert result.returncode == 0, result.stderr
    assert "folded verify" in result.stdout and FOLD.text in result.stdout
    configs = database.load(db_dir / "replay-gpu.yaml")["configs"]
    assert list(configs) == [FOLD.text] and configs[FOLD.text]["key"]["fold"] is True
    assert json.loads(json.dumps(configs[FOLD.text]["key"])) == FOLD.as_dict()
    lookup_args = ["lookup", "--gpu", "replay-gpu", "--hv", "32", "--hk", "16", "--dk", "128", "--dv", "128",
                   "--tree-size", "8", "--batch", "16", "--db-dir", str(db_dir), "--json"]
    folded = json.loads(run(*lookup_args, "--fold").stdout)
    assert (folded["key"], folded["how"], folded["config"]) == (FOLD.text, "exact", configs[FOLD.text]["config"])
    plain = json.loads(run(*lookup_args).stdout)  # the verify has no entry here: never the folded one
    assert plain["key"] == FOLD.verify_key.text and plain["how"] == "default"
