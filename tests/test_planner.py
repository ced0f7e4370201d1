"""The launch planner: one decision of what a launch runs, its injectable config source and self-check,
and the kernels package as a leaf that imports nothing of the tuning layers."""

import ast
import dataclasses
import pathlib
import subprocess
import sys

import pytest
import torch

from bole_tune import KernelConfig
from bole_tune.kernels import PLANNER, Launch, Planner, tree_verify
from bole_tune.kernels.reference import verify_reference
from bole_tune.kernels.verify.planner import H200_POLICY
from bole_tune.shapes import HeadShape
from bole_tune.workloads import make_inputs, make_tree
from helpers import TOLERANCE, assert_close

ROOT = pathlib.Path(__file__).resolve().parent.parent
HEADS = HeadShape(hk=1, hv=2, dk=32, dv=32)
BF16 = torch.bfloat16
GPU = torch.device("cuda", 0)  # a device object only: nothing runs on it in these tests
CONFIG = KernelConfig(16, 16, 4, 1)


def test_kernels_import_nothing_of_the_tuning_layers():
    """`import bole_tune.kernels` loads neither the database nor yaml/filelock, and no kernels module names
    a tuning, database or measurement module."""
    out = subprocess.run([sys.executable, "-c", "import bole_tune.kernels, sys; "
                          "print([m for m in ('bole_tune.database', 'bole_tune.lookup', 'bole_tune.bench', "
                          "'bole_tune.tuner', 'yaml', 'filelock', 'optuna') if m in sys.modules])"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    upper = {"database", "lookup", "bench", "tuner", "profiler", "runners", "precompile", "workers", "budget",
             "step_latency", "timing", "fingerprint", "cli", "report", "validate", "gdn_layer"}
    for path in (ROOT / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                assert not (parts[0] == "bole_tune" and len(parts) > 1 and parts[1] in upper), (path, name)


def plan(planner=PLANNER, **kwargs):
    args = dict(num_requests=2, max_tree_size=20, depth=5, device="cpu")
    args.update(kwargs)
    return planner.plan(HEADS, BF16, **args)


def test_plan_decides_the_whole_launch():
    fused = plan(config=CONFIG, variant="fused")
    assert fused == Launch("fused", CONFIG, node_block=32)
    resident = plan(config=CONFIG, variant="resident", max_tree_size=40)
    assert (resident.variant, resident.node_block, resident.state_split, resident.sweep_f16) == ("resident", 64, True,
                                                                                                  True)
    assert resident.v_split == H200_POLICY.value_split(2, HEADS.hv, HEADS.dv, CONFIG.b_v) == 2
    assert not plan(config=CONFIG, variant="resident", depth=13).sweep_f16  # deeper than the fp16 sweeps allow
    assert plan(config=None).config == KernelConfig(32, 32, 4, 2)  # off the GPU: the default, no database


def test_plan_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="variant: expected one of"):
        plan(variant="fast")
    with pytest.raises(ValueError, match="'resident' takes trees of at most 64"):
        plan(variant="resident", max_tree_size=65)
    with pytest.raises(ValueError, match="v_split: expected a power of two"):
        plan(config=CONFIG, v_split=3)
    with pytest.raises(ValueError, match="v_split: expected a power of two with v_split \\* b_v <= dv"):
        plan(config=CONFIG, v_split=4)
    with pytest.raises(TypeError, match="config: expected a KernelConfig"):
        plan(config=(16, 16, 4, 1))
    with pytest.raises(ValueError, match="config: tiles"):
        plan(config=KernelConfig(64, 16, 4, 1))


def test_config_source_is_injected_and_its_tuned_variant_followed():
    asked = []

    def source(heads, dtype, max_tree_size, num_requests, device):
        asked.append((heads, dtype, max_tree_size, num_requests))
        return KernelConfig(32, 16, 2, 3), "resident"

    planner = Planner(config_source=source)
    launch = plan(planner, device=GPU)
    assert asked == [(HEADS, BF16, 20, 2)]
    assert (launch.variant, launch.config) == ("resident", KernelConfig(32, 16, 2, 3))
    # a config tuned on the resident kernel serves a bucket of larger trees on the fused kernel
    assert plan(planner, device=GPU, max_tree_size=65).variant == "fused"
    assert plan(planner, device=GPU, variant="fused").variant == "fused"


def test_the_state_first_order_runs_only_on_configs_tuned_or_given_for_it():
    """From 512 heads and trees of <= 16 nodes the policy takes the resident kernel's state-first order ("stream",
    dv / b_v programs per head); a bucket without a tuned entry keeps the resident kernel, and an entry tuned on
    another kernel keeps that one."""
    assert (H200_POLICY.stream_min_heads, H200_POLICY.stream_max_tree) == (512, 16)
    assert H200_POLICY.variant(16, 32, 16) == "stream" and H200_POLICY.variant(16, 32, 17) == "resident"
    policy = dataclasses.replace(H200_POLICY, stream_min_heads=64)  # these tests' 2 heads: 32 requests
    big = dict(num_requests=32, max_tree_size=8, depth=3, check=False)
    tuned = Planner(policy, config_source=lambda *a: (KernelConfig(16, 32, 4, 3), "stream"))
    launch = plan(tuned, device=GPU, **big)
    assert (launch.variant, launch.v_split) == ("stream", 1)
    untuned = Planner(policy, config_source=lambda *a: (KernelConfig(16, 16, 4, 2), None))
    assert plan(untuned, device=GPU, **big).variant == "resident"
    other = Planner(policy, config_source=lambda *a: (KernelConfig(16, 16, 4, 2), "resident"))
    assert plan(other, device=GPU, **big).variant == "resident"
    given = plan(Planner(policy), config=KernelConfig(16, 16, 4, 2), **big)  # a tuner's trial: dv / b_v parts
    assert (given.variant, given.v_split) == ("stream", 2)
    with pytest.raises(ValueError, match="'stream' runs one value tile per program"):
        plan(config=KernelConfig(16, 16, 4, 2), variant="stream", v_split=1)
    with pytest.raises(ValueError, match="'stream' takes trees of at most 64"):
        plan(variant="stream", max_tree_size=65)


def test_self_check_runs_once_per_specialisation_and_failures_run_fused(monkeypatch):
    calls = []

    def self_check(launch, heads, dtype, gate_dtype, scale, use_qk_l2norm, device, deep):
        calls.append((launch.config, deep))
        return (1.4e-2, 5e-3) if launch.config == CONFIG else (2e-3, 5e-3)

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    planner = Planner(self_check=self_check)
    with pytest.warns(UserWarning, match="fails its self-check with .* a Triton miscompile.* running the fused "
                                         "kernel"):
        bad = plan(planner, config=CONFIG, variant="resident", device=GPU)
    assert (bad.variant, bad.fallback_error) == ("fused", 1.4e-2) and "self-check" in bad.fallback
    assert plan(planner, config=CONFIG, variant="resident", device=GPU) == bad  # cached: no second check
    good = plan(planner, config=KernelConfig(32, 16, 4, 1), variant="resident", device=GPU)
    assert good.variant == "resident" and not good.fallback
    with pytest.warns(UserWarning, match="fails its self-check"):
        plan(planner, config=CONFIG, variant="resident", device=GPU, depth=13)  # another specialisation
    assert calls == [(CONFIG, False), (KernelConfig(32, 16, 4, 1), False), (CONFIG, True)]
    assert plan(planner, config=CONFIG, variant="resident", device="cpu").variant == "resident"  # no check on CPU


def test_a_resident_launch_that_does_not_compile_runs_fused(monkeypatch):
    """Triton 3.6 refuses some resident launches for sm_100 (its software pipeliner, bf16 64-row blocks at 2-3 stages:
    `python -m bole_tune.binaries --portable`): the self-check's compile error is the planner's to take, once per
    specialisation, and the launch runs on the fused kernel with a warning that says why."""
    calls = []

    def self_check(launch, heads, dtype, gate_dtype, scale, use_qk_l2norm, device, deep):
        calls.append(launch.config)
        if launch.config == CONFIG:
            raise RuntimeError("PassManager::run failed\nmore lines of MLIR")
        return 2e-3, 5e-3

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a B200")
    planner = Planner(self_check=self_check)
    with pytest.warns(UserWarning, match="on a B200 \\(it did not compile or run: RuntimeError: PassManager::run failed\\); "
                                         "running the fused kernel"):
        launch = plan(planner, config=CONFIG, variant="resident", device=GPU)
    assert launch.variant == "fused" and launch.config == CONFIG
    assert "did not compile or run: RuntimeError: PassManager::run failed; runs on the fused kernel" in launch.fallback
    assert plan(planner, config=CONFIG, variant="resident", device=GPU) == launch and calls == [CONFIG]  # once
    assert plan(planner, config=KernelConfig(32, 16, 4, 1), variant="resident", device=GPU).variant == "resident"


def test_no_check_inside_a_graph_capture_runs_fused_unchecked(monkeypatch):
    calls = []
    planner = Planner(self_check=lambda *a: calls.append(a) or (0.0, 1.0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    launch = plan(planner, config=CONFIG, variant="resident", device=GPU)
    assert launch.variant == "fused" and "capture" in launch.fallback and not calls and not planner.checks


def test_plans_are_remembered_per_arguments_until_forgotten(monkeypatch):
    """`Planner.plan` asks its config source once per arguments; `clear`, `forget_plans` (what the database
    layer's `lookup.clear_cache` calls), a new policy or a new config source make it plan again, and a capture's
    stand-in (a launch not yet checked) is never remembered."""
    from bole_tune import lookup
    from bole_tune.kernels.verify.planner import forget_plans

    asked = []

    def source(heads, dtype, max_tree_size, num_requests, device):
        asked.append((max_tree_size, num_requests))
        return CONFIG, "resident"

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    planner = Planner(config_source=source, self_check=lambda *a: (0.0, 1.0))
    first = plan(planner, device=GPU)
    assert plan(planner, device=GPU) is first and asked == [(20, 2)]
    plan(planner, device=GPU, num_requests=3)  # another batch: asked
    assert len(asked) == 2
    planner.clear()
    plan(planner, device=GPU)
    forget_plans()
    plan(planner, device=GPU)
    lookup.clear_cache()
    plan(planner, device=GPU)
    planner.policy = dataclasses.replace(H200_POLICY, stream_max_tree=8)
    plan(planner, device=GPU)
    assert len(asked) == 6
    planner._config_source = lambda *a: (KernelConfig(32, 16, 4, 1), "resident")
    assert plan(planner, device=GPU).config == KernelConfig(32, 16, 4, 1)
    with pytest.raises(TypeError, match="config: expected a KernelConfig"):  # unhashable: planned, and refused
        plan(planner, device=GPU, config={"b_k": 16})
    capturing = Planner(config_source=source, self_check=lambda *a: (0.0, 1.0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert "capture" in plan(capturing, device=GPU).fallback
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert plan(capturing, device=GPU).variant == "resident"  # checked now that it can be


def test_a_given_launch_is_checked_once_per_batch_shape(monkeypatch):
    checks = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    planner = Planner(self_check=lambda *a: checks.append(a) or (0.0, 1.0))
    launch = Launch("resident", CONFIG, 32, v_split=2)
    args = (HEADS, BF16, torch.float32, 20, 5, 0.25, True, GPU)
    assert planner.given(launch, *args) is planner.given(launch, *args) and len(checks) == 1
    with pytest.raises(ValueError, match="launch.node_block"):  # another batch: checked against it
        planner.given(launch, HEADS, BF16, torch.float32, 40, 5, 0.25, True, GPU)
    planner.clear()
    planner.given(launch, *args)
    assert len(checks) == 2


def test_a_given_launch_runs_as_given_and_a_wrong_one_is_refused(device):
    tree = make_tree([20, 9], "random", seed=13, device=device)
    x = make_inputs(tree, 1, 2, 32, 32, BF16, device, seed=13)
    ref = verify_reference(*x.args(tree))
    launch = PLANNER.plan(HEADS, BF16, num_requests=2, max_tree_size=20, depth=tree.depth, device=device,
                          config=CONFIG, variant="resident")
    for changed in (launch, launch.replace(sweep_f16=False), launch.replace(v_split=2),
                    launch.replace(variant="stream", v_split=2)):
        assert_close(tree_verify(*x.args(tree), launch=changed).o, ref.o, TOLERANCE[BF16], f"o with {changed}")
    refusals = [
        (launch.replace(node_block=64), "launch.node_block"),
        (Launch("fused", CONFIG, 32, v_split=2), "the fused kernel has no value split"),
        (launch.replace(v_split=4), "launch.v_split"),
        (launch.replace(variant="stream", v_split=1), "launch.v_split: 'stream' streams one value tile"),
        (launch.replace(config=KernelConfig(64, 16, 4, 1)), "launch.config"),
        ("resident", "launch: expected a Launch"),
    ]
    for bad, message in refusals:
        for _ in range(2):  # a refused launch is never remembered: refused again
            with pytest.raises((ValueError, TypeError), match=message):
                tree_verify(*x.args(tree), launch=bad)
    stacked = launch.replace(variant="stream", v_split=2, stack_qk=True)  # stacked rows: at most 8 of 16 rows
    with pytest.raises(ValueError, match="launch.stack_qk: stacked rows need"):
        tree_verify(*x.args(tree), launch=stacked)
    with pytest.raises(ValueError, match="launch.stack_qk: stacked rows need"):
        tree_verify(*x.args(tree), launch=launch.replace(stack_qk=True))
    with pytest.raises(ValueError, match="either a launch or config"):
        tree_verify(*x.args(tree), launch=launch, config=CONFIG)
    deep = make_tree([14], "chain", device=device)
    y = make_inputs(deep, 1, 2, 32, 32, BF16, device)
    with pytest.raises(ValueError, match="launch.sweep_f16"):
        tree_verify(*y.args(deep), launch=launch.replace(node_block=16, v_split=1))


@pytest.mark.parametrize("size,variant,stacked", [(8, "stream", True), (4, "stream", True), (1, "stream", True),
                                                  (9, "stream", False), (8, "resident", False), (8, "fused", False)])
def test_stacked_rows_for_stream_launches_of_small_trees(size, variant, stacked):
    """Trees of at most 8 nodes (half the 16-row node block) run a "stream" launch on stacked rows; a policy with
    ``stack_max_tree = 0`` never does."""
    launch = PLANNER.plan(HEADS, BF16, num_requests=2, max_tree_size=size, depth=size - 1, device="cpu",
                          config=CONFIG, variant=variant)
    assert launch.stack_qk is stacked and launch.node_block == (16 if size <= 16 else 32)
    never = Planner(dataclasses.replace(H200_POLICY, stack_max_tree=0))
    assert not never.plan(HEADS, BF16, num_requests=2, max_tree_size=size, depth=size - 1, device="cpu",
                          config=CONFIG, variant=variant).stack_qk
