"""A ring's write round (a `PendingRing` round folding its R rounds of tokens into the slots) is tuned on its own: its
bucket keys (ShapeKey.ring, text ending in -ring), database entries, lookup (its own entry, else its bucket's folded
verify entry, else the verify's), the planner asking the config source for it, the tuner's starts, the runner's check
and timing, and `bole-tune tune --ring`."""

import dataclasses
import json
import warnings

import pytest
import torch

from bole_tune import database, lookup
from bole_tune.config import KernelConfig
from bole_tune.database import DatabaseError, ShapeKey
from bole_tune.replay_study import key_from_text
from bole_tune.runners import GPURunner
from bole_tune.shapes import HeadShape
from bole_tune.tuner import kernel_starts, neighbours, warm_starts
from test_cli import run
from test_database import entry, shape_key
from test_tuner import write_recording

SLUG = "test-gpu"
RING = dataclasses.replace(shape_key(tree=8, batch=16), ring=True)
HEADS = HeadShape(hk=16, hv=32, dk=128, dv=128)
GPU = torch.device("cuda", 0)


def test_ring_keys_read_back_from_text_and_dict():
    assert RING.text == "Hv32-Hk16-dk128-dv128-bf16-T8-B16-ring" and RING.as_dict()["ring"] is True
    assert "ring" not in RING.verify_key.as_dict() and "fold" not in RING.as_dict()
    assert key_from_text(RING.text) == RING and ShapeKey.from_dict(RING.as_dict()) == RING
    tp = dataclasses.replace(RING, tp=2)
    assert tp.text.endswith("-TP2-ring") and key_from_text(tp.text) == tp
    assert RING.verify_key == shape_key(tree=8, batch=16)
    assert RING.fold_key == dataclasses.replace(shape_key(tree=8, batch=16), fold=True)
    with pytest.raises(DatabaseError, match="key.ring: expected true or false"):
        ShapeKey.from_dict({**RING.as_dict(), "ring": 1})
    with pytest.raises(ValueError, match="ShapeKey.ring: a ring's write round or the folded verify"):
        dataclasses.replace(RING, fold=True)


@pytest.fixture
def db(tmp_path, monkeypatch):
    monkeypatch.setenv("BOLE_TUNE_DB", str(tmp_path))
    monkeypatch.delenv("BOLE_TUNE_LOOKUP", raising=False)
    lookup.clear_cache()
    verify, fold = RING.verify_key, RING.fold_key
    other = dataclasses.replace(RING, tree_bucket=16)  # T16: a folded entry and no ring entry
    database.update(database.database_path(SLUG, tmp_path),
                    configs={verify.text: entry(verify, b_v=64), fold.text: entry(fold, b_v=32),
                             RING.text: entry(RING, b_v=16), other.fold_key.text: entry(other.fold_key, b_v=128)})
    yield tmp_path
    lookup.clear_cache()


def test_a_ring_write_takes_its_own_entry_else_the_folded_verify_s(db):
    assert lookup.decide(RING, SLUG).how == "exact" and lookup.decide(RING, SLUG).config.b_v == 16
    assert lookup.decide(RING.fold_key, SLUG).config.b_v == 32  # the folded verify never takes the ring's entry
    assert lookup.decide(RING.verify_key, SLUG).config.b_v == 64
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # falling back to the folded verify's entry is silent
        t16 = lookup.decide(dataclasses.replace(RING, tree_bucket=16), SLUG)
        t32 = lookup.decide(dataclasses.replace(RING, tree_bucket=32), SLUG)
    assert (t16.how, t16.config.b_v) == ("fold", 128)
    # T32: neither a ring nor a folded entry: the folded verify's decision, itself the nearest verify entry
    assert t32.how == "nearest" and t32.config.b_v == 64


def test_the_planner_asks_the_config_source_for_the_ring_write(db, monkeypatch):
    from bole_tune.kernels.verify.planner import Planner

    monkeypatch.setattr(lookup, "_device_slug", lambda device: SLUG)

    def plan(p, **kwargs):
        return p.plan(HEADS, torch.bfloat16, num_requests=16, max_tree_size=8, depth=7, device=GPU, check=False,
                      **kwargs)

    planner = Planner(config_source=lookup.tuned_launch)
    assert [plan(planner, **k).config.b_v for k in ({}, {"fold": True}, {"ring": True})] == [64, 32, 16]

    def fold_only(heads, dtype, max_tree_size, num_requests, device, fold=False):  # written before ring entries
        return KernelConfig(32, 16 if fold else 64, 2, 1), None

    assert plan(Planner(config_source=fold_only), ring=True).config.b_v == 16  # asked as for the folded verify


def test_studies_of_ring_writes_start_from_their_fold_and_verify_configs():
    verify, fold = RING.verify_key, RING.fold_key
    a, b, near = KernelConfig(128, 32, 4, 2), KernelConfig(32, 64, 2, 3), KernelConfig(32, 128, 2, 2)
    other_ring = dataclasses.replace(RING, tree_bucket=16)  # a neighbour
    tuned = {verify.text: (verify, a), fold.text: (fold, b), other_ring.text: (other_ring, near)}
    assert warm_starts(RING, tuned) == [b, a, near]
    assert neighbours(RING, tuned) == [near] and neighbours(fold, tuned) == []
    stream = dataclasses.replace(RING, batch_bucket=32)
    assert kernel_starts(stream)[:2] == [KernelConfig(32, 64, 2, 3), KernelConfig(32, 128, 2, 2)]


def test_the_runner_checks_and_times_the_ring_write_on_the_cpu(monkeypatch):
    from bole_tune.bench import CaseBench

    key = ShapeKey(heads=HeadShape(hk=1, hv=2, dk=32, dv=32), dtype="fp32", tree_bucket=8, batch_bucket=1, ring=True)
    runner = GPURunner("cpu", repeats=3)
    m = runner.measure(key, KernelConfig(16, 16, 4, 1))
    assert m.status == "ok" and m.rel_error < 1e-3 and m.p50_us > 0, m
    monkeypatch.setattr(CaseBench, "ring_errors", lambda self, read=None, write=None, rounds=None: (1e-4, 3e-2))
    m = runner.measure(key, KernelConfig(16, 16, 4, 1))
    assert m.status == "wrong" and "the ring's slots" in m.message, m


def test_a_gluon_bucket_s_ring_write_takes_the_verify_s_gluon_config_not_the_folded_verify_s(tmp_path, monkeypatch):
    """The Gluon verify runs a ring's write rounds but not a PendingCommit fold: in a bucket whose verify entry is a
    Gluon config, a ring write without its own entry runs that, not the folded verify's (Triton) entry; elsewhere
    the folded verify's, as before."""
    monkeypatch.setenv("BOLE_TUNE_DB", str(tmp_path))
    monkeypatch.delenv("BOLE_TUNE_LOOKUP", raising=False)
    lookup.clear_cache()
    t64 = dataclasses.replace(shape_key(tree=64, batch=16), ring=True)
    gluon_entry = {**entry(t64.verify_key, b_v=64), "config": {"b_k": 32, "b_v": 64, "num_warps": 4, "num_stages": 2,
                                                               "gluon": 1}}
    database.update(database.database_path(SLUG, tmp_path),
                    configs={t64.verify_key.text: gluon_entry, t64.fold_key.text: entry(t64.fold_key, b_v=32),
                             RING.verify_key.text: entry(RING.verify_key, b_v=64),
                             RING.fold_key.text: entry(RING.fold_key, b_v=32)})
    try:
        decision = lookup.decide(t64, SLUG)
        assert decision.config == KernelConfig(32, 64, 4, 2, gluon=1) and decision.how == "verify", decision
        assert "Gluon" in decision.reason
        assert lookup.decide(t64.fold_key, SLUG).config.b_v == 32  # the folded verify keeps its own entry
        assert lookup.decide(RING, SLUG).config.b_v == 32  # a Triton bucket: the folded verify's entry
        monkeypatch.setenv("BOLE_TUNE_LOOKUP", "strict")
        lookup.clear_cache()
        assert lookup.decide(t64, SLUG).config.gluon == 1
    finally:
        lookup.clear_cache()


def test_the_tuner_times_a_gluon_bucket_s_ring_write_on_a_ring_the_gluon_verify_takes(monkeypatch):
    """`bole-tune tune --ring` of a bucket whose launches run on the Gluon verify times its candidates on the
    longest ring (up to RING_ROUNDS) whose tables the Gluon verify takes, so its Gluon configs are timed at all and
    its Triton ones on the same ring; elsewhere on RING_ROUNDS rounds."""
    from bole_tune import runners as runners_module
    from bole_tune.config import RING_ROUNDS
    from bole_tune.kernels.verify.gluon import MAX_RING_WIDTH, gluon_ring_rounds
    from bole_tune.kernels import PendingRing

    assert [gluon_ring_rounds(p, 4) for p in (4, 8, 9, 16, 17, 33)] == [4, 4, 3, 2, 1, 0]
    for path in (4, 8, 9, 16, 17):
        r = gluon_ring_rounds(path, 4)
        assert PendingRing.table_width(r, path) <= MAX_RING_WIDTH
        assert r == 4 or PendingRing.table_width(r + 1, path) > MAX_RING_WIDTH
    t64 = dataclasses.replace(shape_key(tree=64, batch=16), ring=True)
    gpu = GPURunner.__new__(GPURunner)
    gpu.device = torch.device("cuda")
    monkeypatch.setattr(runners_module, "gluon_device_refusal", lambda device: "")
    assert gpu.ring_rounds(t64, 9) == 3 and gpu.ring_rounds(t64, 8) == RING_ROUNDS == 4
    assert gpu.ring_rounds(RING, 9) == RING_ROUNDS  # 8-node trees: the Triton kernels' ring
    assert gpu.ring_rounds(t64.verify_key, 9) == RING_ROUNDS  # not a ring write
    monkeypatch.setattr(runners_module, "gluon_device_refusal", lambda device: "not sm_90")
    assert gpu.ring_rounds(t64, 9) == RING_ROUNDS


def test_the_runner_checks_and_times_the_ring_write_on_its_ring_rounds(monkeypatch):
    from bole_tune.bench import CaseBench

    key = ShapeKey(heads=HeadShape(hk=1, hv=2, dk=32, dv=32), dtype="fp32", tree_bucket=8, batch_bucket=1, ring=True)
    runner = GPURunner("cpu", repeats=3)
    asked = []
    errors, timing = CaseBench.ring_errors, CaseBench.time_ring_write
    monkeypatch.setattr(CaseBench, "ring_errors", lambda self, read=None, write=None, rounds=None:
                        asked.append(("check", rounds)) or errors(self, read, write, rounds))
    monkeypatch.setattr(CaseBench, "time_ring_write", lambda self, launch=None, rounds=None, repeats=50:
                        asked.append(("time", rounds)) or timing(self, launch, rounds, repeats))
    monkeypatch.setattr(GPURunner, "ring_rounds", lambda self, key, max_path: 2)
    m = runner.measure(key, KernelConfig(16, 16, 4, 1))
    assert m.status == "ok" and asked == [("check", 2), ("time", 2)], (m, asked)
    assert "a ring of 2 rounds" in m.method


def test_ring_errors_see_a_wrong_write_round(device, monkeypatch):
    """The check the tuner relies on can fail: a write round that folds nothing leaves wrong slots and outputs."""
    from bole_tune.bench import BenchCase, CaseBench
    from bole_tune.kernels.verify import run as run_module

    bench = CaseBench(BenchCase(HeadShape(hk=1, hv=2, dk=32, dv=32), 2, 4, torch.float32, 8, label="x",
                                kind="chain"), device)
    launch = bench.launch(KernelConfig(16, 16, 4, 1))
    good = bench.ring_errors(launch, launch, rounds=2)
    assert good[0] < 1e-3 and good[1] < 1e-4
    shipped = run_module.run_launch

    def forgetful(*args):  # a write round that reads as if nothing were pending (``ring``: run_launch's 14th)
        args = list(args)
        if args[13] is not None and args[13].step.write:
            args[13] = None
        return shipped(*args)

    monkeypatch.setattr("bole_tune.kernels.verify.tree_verify.run_launch", forgetful)
    bad = bench.ring_errors(launch, launch, rounds=2, steps=4)
    assert bad[0] > 1e-2 and bad[1] > 1e-3  # both far above what the tuner accepts for fp32 (1e-3)


def test_tune_ring_on_the_command_line(tmp_path):
    recording = write_recording(tmp_path / "rec.json", key=RING)
    db_dir = tmp_path / "db"
    common = ["tune", "--replay", str(recording), "--model", "qwen3.5-9b", "--batch", "16", "--tree-size", "8",
              "--trials", "12", "--storage", f"sqlite:///{tmp_path / 's.db'}", "--db-dir", str(db_dir)]
    refused = run(*common, "--ring", "--fold")
    assert refused.returncode != 0 and "--ring" in refused.stderr and "Traceback" not in refused.stderr
    result = run(*common, "--ring")
    assert result.returncode == 0, result.stderr
    assert "write round" in result.stdout and RING.text in result.stdout
    configs = database.load(db_dir / "replay-gpu.yaml")["configs"]
    assert list(configs) == [RING.text] and configs[RING.text]["key"]["ring"] is True
    lookup_args = ["lookup", "--gpu", "replay-gpu", "--hv", "32", "--hk", "16", "--dk", "128", "--dv", "128",
                   "--tree-size", "8", "--batch", "16", "--db-dir", str(db_dir), "--json"]
    ring = json.loads(run(*lookup_args, "--ring").stdout)
    assert (ring["key"], ring["how"], ring["config"]) == (RING.text, "exact", configs[RING.text]["config"])
    assert json.loads(run(*lookup_args, "--fold").stdout)["how"] != "exact"  # the folded verify: not the ring's


@pytest.mark.parametrize("size,gluon,expected", [(9, True, 3), (8, True, 4), (9, False, 4), (17, True, 1)])
def test_bench_rows_keep_the_ring_the_case_s_kernel_takes(monkeypatch, size, gluon, expected):
    """`bole-tune bench`'s ring rows by default keep the ring an engine keeps there: `RING_ROUNDS` rounds, or on the
    Gluon verify the most its tables take (9-node paths: 3; a ring of 4 would run on the slower Triton kernel)."""
    from bole_tune.bench import BenchCase, CaseBench, bench_rounds
    from bole_tune.config import RING_ROUNDS

    bench = CaseBench(BenchCase(HeadShape(hk=1, hv=2, dk=32, dv=32), 1, size, torch.float32, kind="chain"), "cpu")
    launch = bench.launch(ring=True)
    assert not launch.gluon  # no Gluon on the CPU: RING_ROUNDS
    assert bench.ring_rounds() == RING_ROUNDS == 4
    plan = CaseBench.launch
    monkeypatch.setattr(CaseBench, "launch", lambda self, *a, **kw: dataclasses.replace(plan(self, *a, **kw),
                                                                                        gluon=gluon))
    assert bench.ring_rounds() == expected
    asked = []
    monkeypatch.setattr(CaseBench, "time_rounds", lambda self, layers, repeats, rounds: asked.append(rounds) or {})
    bench_rounds(bench.case, 2, "cpu", bench=bench)
    bench_rounds(bench.case, 2, "cpu", bench=bench, ring_rounds=2)
    assert asked == [expected, 2]
