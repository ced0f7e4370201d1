"""The tuning loop on a CPU: Optuna over a runner that replays recorded measurements."""

import dataclasses
import json
import math
import warnings

import optuna
import torch
import pytest

from bole_tune.config import KernelConfig
from bole_tune.runners import DeviceLost, Measurement, RecordingRunner, ReplayRunner
from bole_tune.search_space import SearchSpace, feasible
from bole_tune.tuner import exhaustive_bucket, polish_trials, step_neighbours, tune_bucket
from test_database import shape_key

KEY = shape_key()
SPACE = SearchSpace.load()


def synthetic_cost(c: KernelConfig) -> float:
    """A smooth landscape with one best region (b_v 128, 8 warps, 2 stages), like the H200's."""
    return (40 + 12 * abs(math.log2(c.b_v / 128)) + 6 * abs(math.log2(c.num_warps / 8))
            + 4 * abs(c.num_stages - 2) + 3 * abs(math.log2(c.b_k / 64)))


def write_recording(path, wrong=(), infeasible=(), key=KEY):
    measurements = {}
    for c in SPACE.configs():
        text = c.text
        if text in wrong:
            m = Measurement("wrong", rel_error=0.5, message="relative error 5e-1")
        elif text in infeasible:
            m = Measurement("infeasible", message="OutOfResources")
        else:
            t = synthetic_cost(c)
            m = Measurement("ok", t - 0.5, t, t + 0.5, 1e-3, method="replay")
        measurements.setdefault(key.text, {})[text] = m.as_dict()
    path.write_text(json.dumps({"device": {"slug": "replay-gpu", "name": "Replay GPU"}, "measurements": measurements}))
    return path


def storage(tmp_path):
    return optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'studies.sqlite3'}")


def test_tuner_finds_the_best_region_with_few_trials(tmp_path):
    runner = ReplayRunner(write_recording(tmp_path / "rec.json"))
    best = min(synthetic_cost(c) for c in SPACE.configs())
    n_trials = int(0.3 * len(SPACE.configs()))
    result = tune_bucket(runner, KEY, SPACE, storage(tmp_path), n_trials, "replay-gpu")
    assert result.best_measurement.p50_us <= 1.03 * best, (result.best, result.best_measurement)
    assert result.counts["measured"] <= n_trials
    assert runner.calls == result.counts["measured"], "a config was measured twice"
    assert result.default == KernelConfig(64, 32, 4, 2) and result.default_measurement.status == "ok"


def test_step_neighbours_change_one_parameter_by_one_step():
    found = step_neighbours(KernelConfig(32, 64, 4, 2), SPACE)
    assert set(found) == {KernelConfig(16, 64, 4, 2), KernelConfig(64, 64, 4, 2), KernelConfig(32, 32, 4, 2),
                          KernelConfig(32, 128, 4, 2), KernelConfig(32, 64, 2, 2), KernelConfig(32, 64, 8, 2),
                          KernelConfig(32, 64, 4, 1), KernelConfig(32, 64, 4, 3), KernelConfig(32, 64, 4, 2, gluon=1)}
    # the gluon switch turned on only where the Gluon verify takes the tiles (not 3 stages)
    assert KernelConfig(32, 64, 4, 3, gluon=1) not in step_neighbours(KernelConfig(32, 64, 4, 3), SPACE)
    # at the edge of the space only the inner side exists
    assert KernelConfig(16, 16, 2, 1) not in step_neighbours(KernelConfig(16, 16, 2, 1), SPACE)
    assert len(step_neighbours(KernelConfig(16, 16, 2, 1), SPACE)) == 4


def test_polish_phase_walks_from_the_samplers_best_to_its_best_neighbour(tmp_path):
    """A sampler stuck on the default config: only the polish phase measures anything new."""
    measured_texts = []

    class Logged(ReplayRunner):
        def measure(self, key, config):
            measured_texts.append(config.text)
            return super().measure(key, config)

    fused_key = shape_key(tree=128)  # no kernel-specific starting configs
    runner = Logged(write_recording(tmp_path / "rec.json", key=fused_key))
    default = KernelConfig(64, 32, 4, 2)
    with warnings.catch_warnings():  # PartialFixedSampler is marked experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        stuck = optuna.samplers.PartialFixedSampler(
            {"b_k": 64, "b_v": 32, "num_warps": 4, "num_stages": 2}, optuna.samplers.RandomSampler(seed=0))
    result = tune_bucket(runner, fused_key, SPACE, storage(tmp_path), 32, "replay-gpu", sampler=stuck)
    neighbours = [c for c in step_neighbours(default, SPACE) if feasible(c, 128, 128, 128, "bf16")[0]]
    # the default, then its 7 neighbours, then the walk goes on from the best of them with what is left
    assert result.counts["measured"] == 1 + polish_trials(32) == 9
    assert {c.text for c in neighbours} <= set(measured_texts)
    assert synthetic_cost(result.best) <= min(synthetic_cost(c) for c in neighbours) < synthetic_cost(default)


def test_wrong_and_infeasible_configs_are_never_chosen(tmp_path):
    best = KernelConfig(64, 128, 8, 2)
    runner = ReplayRunner(write_recording(tmp_path / "rec.json", wrong={best.text},
                                          infeasible={KernelConfig(32, 128, 8, 2).text}))
    result = tune_bucket(runner, KEY, SPACE, storage(tmp_path), 30, "replay-gpu",
                         warm_start=[best, KernelConfig(32, 128, 8, 2)])
    assert result.best not in (best, KernelConfig(32, 128, 8, 2))
    assert result.counts["wrong"] == 1 and result.counts["infeasible"] == 1
    trials = optuna.load_study(study_name=result.study_name, storage=storage(tmp_path)).trials
    wrong = [t for t in trials if t.user_attrs.get("status") == "wrong"]
    assert wrong and "relative error" in wrong[0].user_attrs["reason"]


def test_interrupted_study_resumes_without_redoing_trials(tmp_path):
    runner = ReplayRunner(write_recording(tmp_path / "rec.json"))
    first = tune_bucket(runner, KEY, SPACE, storage(tmp_path), 6, "replay-gpu")
    calls = runner.calls
    again = tune_bucket(runner, KEY, SPACE, storage(tmp_path), 6, "replay-gpu")
    assert runner.calls == calls and again.counts["total"] == first.counts["total"] == 6
    more = tune_bucket(runner, KEY, SPACE, storage(tmp_path), 14, "replay-gpu")
    assert more.counts["total"] == 14 and runner.calls <= calls + 8


def test_warm_start_is_tried_first(tmp_path):
    runner = ReplayRunner(write_recording(tmp_path / "rec.json"))
    seeds = [KernelConfig(64, 128, 8, 2)]
    result = tune_bucket(runner, KEY, SPACE, storage(tmp_path), 2, "replay-gpu", warm_start=seeds)
    assert result.best == seeds[0]


class CrashingRunner:
    name = "crashing"

    def __init__(self, inner, crash: KernelConfig):
        self.inner, self.crash = inner, crash

    def fingerprint(self):
        return self.inner.fingerprint()

    def measure(self, key, config):
        if config == self.crash:
            raise DeviceLost("illegal memory access")
        return self.inner.measure(key, config)


def test_a_crashing_config_stops_the_run_and_is_not_retried(tmp_path):
    replay = ReplayRunner(write_recording(tmp_path / "rec.json"))
    crash = KernelConfig(32, 64, 4, 2)
    with pytest.raises(DeviceLost, match="run the same command again"):
        tune_bucket(CrashingRunner(replay, crash), KEY, SPACE, storage(tmp_path), 10, "replay-gpu",
                    warm_start=[crash])
    result = tune_bucket(CrashingRunner(replay, crash), KEY, SPACE, storage(tmp_path), 10, "replay-gpu")
    assert result.counts["total"] == 10 and result.best != crash and result.counts["infeasible"] == 1


def test_exhaustive_and_recording_round_trip(tmp_path):
    source = ReplayRunner(write_recording(tmp_path / "rec.json"))
    recorder = RecordingRunner(source, tmp_path / "copy.json")
    found = exhaustive_bucket(recorder, KEY, SPACE)
    assert len(found) == len(SPACE.configs())
    copy = ReplayRunner(tmp_path / "copy.json")
    # configs pruned before compiling (too much shared memory, Gluon tiles other than the ring's) never reach the
    # runner, so the copy lacks them
    pruned = {text for text, m in found.items() if m.status == "infeasible" and "shared memory" in m.message}
    assert all(KernelConfig.from_text(text).b_k == 128 for text in pruned)
    pruned |= {text for text, m in found.items() if m.status == "infeasible" and "RING_TILES" in m.message}
    assert len(pruned - {t for t in pruned if KernelConfig.from_text(t).b_k == 128}) == 6  # 8 Gluon configs, 2 kept
    assert copy.measurements[KEY.text] == {text: m for text, m in source.measurements[KEY.text].items()
                                           if text not in pruned}


def test_pruning_before_compile():
    ok, reason = feasible(KernelConfig(64, 128, 8, 3), 128, 128, 64, "fp32", shared_memory_limit=100 * 1024)
    assert not ok and "shared memory" in reason
    ok, reason = feasible(KernelConfig(64, 32, 4, 2), 32, 32, 64, "bf16")
    assert not ok and "divide" in reason


def test_bad_recording_is_refused(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"measurements": {KEY.text: {"64/32/4/2": {"status": "fast"}}}}))
    with pytest.raises(ValueError, match="status"):
        ReplayRunner(path)


def test_resident_buckets_start_from_the_resident_kernels_best_tiles(tmp_path):
    """A bucket that runs on the resident kernel seeds its study with that kernel's lab-best tiles."""
    from bole_tune.tuner import FOLD_STREAM_STARTS, GLUON_STARTS, RESIDENT_STARTS, STREAM_STARTS, kernel_starts

    resident = shape_key()
    fused = shape_key(tree=128)
    # a bf16 bucket of 64-node trees on the resident kernel: then the Gluon configs of the ring's tiles (held at 0
    # off sm_90), one per number of stages
    gluon = [c for c in GLUON_STARTS if (c.b_k, c.b_v) == (32, 64)]
    assert len(gluon) == 2 and kernel_starts(resident) == list(RESIDENT_STARTS) + gluon and kernel_starts(fused) == []
    assert kernel_starts(dataclasses.replace(resident, dtype="fp16")) == list(RESIDENT_STARTS)
    assert kernel_starts(dataclasses.replace(resident, fold=True)) == list(RESIDENT_STARTS)
    assert kernel_starts(shape_key(tree=8)) == list(STREAM_STARTS)  # B=16 T=8: the state-first order
    # its folded launch (state products as S Q^T) starts from that launch's own best tiles first
    folded = kernel_starts(dataclasses.replace(shape_key(tree=8), fold=True))
    assert folded == list(FOLD_STREAM_STARTS + STREAM_STARTS)
    measured = []

    class Logged(ReplayRunner):
        def measure(self, key, config):
            measured.append(config)
            return super().measure(key, config)

    tune_bucket(Logged(write_recording(tmp_path / "rec.json")), resident, SPACE, storage(tmp_path),
                2 + len(RESIDENT_STARTS), "replay-gpu")
    # the default (its Gluon twin, 64/32, pruned: not the ring's tiles), then the resident kernel's tiles
    assert measured[0] == KernelConfig(64, 32, 4, 2) and KernelConfig(64, 32, 4, 2, gluon=1) not in measured
    assert measured[1:1 + len(RESIDENT_STARTS)] == list(RESIDENT_STARTS), measured


def test_a_config_the_resident_self_check_rejects_is_wrong_for_the_tuner(monkeypatch):
    """tree_verify runs such a config on the fused kernel; the tuner must not record it as a resident one."""
    from bole_tune.bench import CaseBench
    from bole_tune.kernels import Launch
    from bole_tune.runners import GPURunner

    key = shape_key(hv=2, hk=1, dk=32, dv=32, dtype="fp32", tree=8, batch=1)
    runner = GPURunner("cpu", repeats=1)
    assert not runner.bench(key).launch(KernelConfig(16, 16, 4, 1)).fallback  # CPU: no compiled binary to check
    failed = Launch("fused", KernelConfig(16, 16, 4, 1), 16, fallback_error=1.3e-2,
                    fallback="the resident kernel's self-check: relative error 1.30e-02")
    monkeypatch.setattr(CaseBench, "launch",
                        lambda self, config=None, variant=None, tuned_on=None, fold=False, ring=False, gluon=None: failed)
    m = runner.measure(key, KernelConfig(16, 16, 4, 1))
    assert m.status == "wrong" and m.rel_error == 1.3e-2 and "self-check" in m.message, m


def test_a_stream_buckets_speedup_is_over_the_default_as_an_untuned_bucket_runs_it(tmp_path):
    """A "stream" bucket runs the resident kernel until it is tuned: its study searches the stream kernel, but the
    default its speedup is over is the default config measured on the resident kernel (recorded once, kept in the
    study); a bucket whose kernel is the same tuned or not measures no such extra point."""
    from bole_tune.kernels import PLANNER
    from bole_tune.runners import UNTUNED_PREFIX
    from bole_tune.tuner import UNTUNED_ATTR, load_result

    stream, resident = shape_key(tree=8), shape_key()
    policy = PLANNER.policy
    assert policy.variant(16, 32, 8) == "stream" and policy.untuned_variant(16, 32, 8) == "resident"
    assert policy.untuned_variant(16, 32, 64) == policy.variant(16, 32, 64) == "resident"
    default = KernelConfig(64, 32, 4, 2)
    path = write_recording(tmp_path / "rec.json", key=stream)
    data = json.loads(path.read_text())
    on_stream = data["measurements"][stream.text][default.text]["p50_us"]
    untuned = Measurement("ok", 17.5, 18.0, 18.5, 1e-3, method="replay")
    data["measurements"][stream.text][UNTUNED_PREFIX + default.text] = untuned.as_dict()
    data["measurements"][resident.text] = {c: m for c, m in data["measurements"][stream.text].items()
                                           if not c.startswith(UNTUNED_PREFIX)}
    path.write_text(json.dumps(data))
    asked = []

    class Logged(ReplayRunner):
        def measure_untuned(self, key, config):
            asked.append((key.text, config))
            return super().measure_untuned(key, config)

    runner, store = Logged(path), storage(tmp_path)
    result = tune_bucket(runner, stream, SPACE, store, 12, "replay-gpu")
    assert asked == [(stream.text, default)]
    assert result.default_measurement.p50_us == 18.0 != on_stream
    assert result.speedup == pytest.approx(18.0 / result.best_measurement.p50_us)
    assert load_result(store, "replay-gpu", stream).default_measurement.p50_us == 18.0  # kept in the study
    tune_bucket(runner, stream, SPACE, store, 14, "replay-gpu")  # resumed: measured once only
    assert len(asked) == 1
    study = optuna.load_study(study_name=result.study_name, storage=store)
    assert study.user_attrs[UNTUNED_ATTR]["p50_us"] == 18.0
    plain = tune_bucket(runner, resident, SPACE, store, 6, "replay-gpu")
    assert len(asked) == 1 and plain.default_measurement.p50_us == on_stream


def test_a_gluon_buckets_speedup_is_over_the_gluon_verify_it_runs_untuned(tmp_path, monkeypatch):
    """On an sm_90 GPU an untuned bucket of 64-node bf16 trees runs the Gluon verify with its untuned tiles, not the
    Triton default: the study measures that once, and its result names that config as the default."""
    from bole_tune import runners as runners_module
    from bole_tune.kernels.verify.gluon import UNTUNED_CONFIG
    from bole_tune.runners import UNTUNED_PREFIX, GPURunner
    from bole_tune.tuner import UNTUNED_CONFIG_ATTR, load_result

    key = shape_key()  # B=16 T=64 bf16, the 9B's heads: a Gluon bucket
    path = write_recording(tmp_path / "rec.json", key=key)
    data = json.loads(path.read_text())
    data["measurements"][key.text][UNTUNED_PREFIX + UNTUNED_CONFIG.text] = \
        Measurement("ok", 48.5, 49.0, 49.5, 1e-3, method="replay").as_dict()
    path.write_text(json.dumps(data))
    runner, store = ReplayRunner(path), storage(tmp_path)
    assert runner.untuned_config(key, KernelConfig(64, 32, 4, 2)) == UNTUNED_CONFIG
    result = tune_bucket(runner, key, SPACE, store, 8, "replay-gpu")
    assert result.default == UNTUNED_CONFIG and result.default_measurement.p50_us == 49.0
    assert load_result(store, "replay-gpu", key).default == UNTUNED_CONFIG  # kept in the study
    study = optuna.load_study(study_name=result.study_name, storage=store)
    assert study.user_attrs[UNTUNED_CONFIG_ATTR] == UNTUNED_CONFIG.text
    # and it is the study's first trial: a study that never measured it could record a config slower than it
    assert KernelConfig.from_dict(study.trials[0].params) == UNTUNED_CONFIG
    # the GPU runner's answer: the Gluon tiles on an sm_90 GPU for a Gluon bucket, the default elsewhere
    gpu = GPURunner.__new__(GPURunner)
    gpu.device = torch.device("cuda")
    default = KernelConfig(64, 32, 4, 2)
    monkeypatch.setattr(runners_module, "gluon_device_refusal", lambda device: "")
    assert gpu.untuned_config(key, default) == UNTUNED_CONFIG
    assert gpu.untuned_config(shape_key(tree=16), default) == default  # 16-node trees: the Triton kernels
    monkeypatch.setattr(runners_module, "gluon_device_refusal", lambda device: "sm_80")
    assert gpu.untuned_config(key, default) == default


def test_the_gpu_runner_measures_the_untuned_default_on_the_untuned_kernel(monkeypatch):
    from bole_tune.bench import CaseBench
    from bole_tune.kernels import Launch
    from bole_tune.runners import GPURunner

    key = shape_key(tree=8)  # B=16 x 32 heads, 8 nodes: "stream" when tuned, the resident kernel untuned
    runner = GPURunner("cpu", repeats=1)
    asked = []

    def launch(self, config=None, variant=None, tuned_on=None, fold=False, ring=False, gluon=None):
        asked.append(variant)
        assert gluon is False  # the tuner times the Triton kernel's tiles
        return Launch("fused", config, 16, fallback_error=1.0, fallback="stopped here by the test")

    monkeypatch.setattr(CaseBench, "launch", launch)
    monkeypatch.setattr(CaseBench, "reference", lambda self: None)
    assert runner.measure_untuned(key, KernelConfig(64, 32, 4, 2)).status == "wrong"
    assert runner.measure(key, KernelConfig(64, 32, 4, 2)).status == "wrong"
    assert asked == ["resident", None]
