"""The Gluon verify (`kernels/verify/gluon.py`, sm_90 only): where the planner sends a launch to it, how it falls back,
that every mode compiles for sm_90 within two programs an SM (on the CPU, without a GPU), and on the H200 that its
verify, its ring read rounds and its ring write rounds match the float64 node-by-node recurrence over consecutive
rounds, and that its results commit right."""

import json
import random
import subprocess
import sys
import warnings

import pytest
import torch

from bole_tune import binaries
from bole_tune.config import KernelConfig, default_config
from bole_tune.kernels import PendingRing, plan_launch, tree_commit, tree_verify
from bole_tune.kernels.reference import verify_reference
from bole_tune.kernels.verify import gluon as gluon_module
from bole_tune.kernels.verify import planner as planner_module
from bole_tune.kernels.verify.planner import H200_POLICY, Launch, Planner
from bole_tune.kernels.verify.ring import RingRead, RingRound
from bole_tune.search_space import SearchSpace
from bole_tune.shapes import HeadShape
from bole_tune.tree import TreeBatch
from bole_tune.tuner import GLUON_STARTS
from bole_tune.workloads import make_inputs, make_tree
from helpers import TOLERANCE, assert_close
from test_folded_commit import accepted_of

BF16, F32 = torch.bfloat16, torch.float32
HEADS_9B = HeadShape(hk=16, hv=32, dk=128, dv=128)
GLUON_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
requires_sm90 = pytest.mark.skipif(not GLUON_GPU, reason="the Gluon verify runs on an sm_90 GPU (H100/H200) only")
TWO_PROGRAMS_AN_SM = 233472 // 2 - 1024  # Hopper's 228 KiB an SM over two programs, less each block's reserved 1 KiB


def _source(heads, dtype, max_tree_size, num_requests, device):
    return default_config(heads.dk, heads.dv), None


def _plan(planner, batch=16, size=64, dtype=BF16, depth=8, heads=HEADS_9B, **kwargs):
    return planner.plan(heads, dtype, num_requests=batch, max_tree_size=size, depth=depth, device="cuda",
                        check=False, **kwargs)


@pytest.fixture
def sm90(monkeypatch):
    """The planner's device check answering as an sm_90 GPU would (the CPU tests of its decisions)."""
    monkeypatch.setattr(planner_module, "gluon_device_refusal", lambda device: "")


def test_planner_sends_64_node_resident_launches_to_gluon(sm90):
    planner = Planner(config_source=_source)
    assert _plan(planner).gluon  # B=16 T=64: the resident kernel, one program per head
    assert _plan(planner, batch=8, size=40).gluon  # B=8 trees of 33-64 nodes: 64-row blocks
    assert _plan(planner, ring=True).gluon  # a ring's write round
    assert not _plan(planner, fold=True).gluon  # a pending fold stays on the Triton kernel
    assert not _plan(planner, size=32).gluon  # 32-row blocks
    assert not _plan(planner, dtype=F32).gluon and not _plan(planner, dtype=torch.float16).gluon
    assert not _plan(planner, depth=20).gluon  # deeper than the fp16 sweeps allow
    assert not _plan(planner, batch=1).gluon  # the fused kernel
    assert not _plan(planner, heads=HeadShape(hk=16, hv=32, dk=64, dv=64)).gluon
    assert not _plan(planner, gluon=False).gluon  # what the tuner times
    launch = _plan(planner)
    assert (launch.variant, launch.v_split, launch.state_split, launch.sweep_f16) == ("resident", 1, True, True)


def _tuned(config, variant="resident"):
    def source(heads, dtype, max_tree_size, num_requests, device, fold=False, ring=False):
        return config, variant
    return source


def test_the_tuned_config_decides_the_gluon_launch_and_its_tiles(sm90):
    """A bucket's tuned config says whether its launches run the Gluon verify (gluon=1) and with which tiles; a Triton
    config runs the Triton kernel; an untuned bucket runs the Gluon verify with the untuned tiles."""
    tuned = KernelConfig(64, 32, 4, 1, gluon=1)
    launch = _plan(Planner(config_source=_tuned(tuned)))
    assert launch.gluon and launch.config == tuned and (launch.variant, launch.v_split) == ("resident", 1)
    triton = _plan(Planner(config_source=_tuned(KernelConfig(32, 64, 4, 3))))
    assert not triton.gluon and triton.config == KernelConfig(32, 64, 4, 3)
    untuned = _plan(Planner(config_source=_source))
    assert untuned.gluon and untuned.config == gluon_module.UNTUNED_CONFIG
    # a write round folds 64-row state tiles: 64/32 runs on Triton's kernel there, with the same tiles
    write = _plan(Planner(config_source=_tuned(tuned)), ring=True)
    assert not write.gluon and write.config == KernelConfig(64, 32, 4, 1)
    assert _plan(Planner(config_source=_tuned(KernelConfig(64, 64, 4, 2, gluon=1))), ring=True).gluon
    # tiles the Gluon verify does not take (128-wide key chunks, 8 warps, 3 stages): the Triton kernel, same tiles
    for config in (KernelConfig(128, 32, 4, 2, gluon=1), KernelConfig(32, 64, 8, 2, gluon=1),
                   KernelConfig(32, 64, 4, 3, gluon=1)):
        launch = _plan(Planner(config_source=_source), config=config, tuned_on="resident")
        assert not launch.gluon and launch.config == config.replace(gluon=0), config
        with pytest.raises(ValueError, match="gluon: .*the Gluon verify (takes tiles|runs 4 warps|keeps 1 or 2)"):
            _plan(Planner(config_source=_source), config=config, tuned_on="resident", gluon=True)
    # gluon=False: the Triton kernel with a Gluon config's tiles (the switch off in the launch's config)
    off = _plan(Planner(config_source=_tuned(tuned)), gluon=False)
    assert not off.gluon and off.config == tuned.replace(gluon=0)
    # a Gluon config where the bucket's launches are not resident ones of one program per head: the fused kernel
    fused = _plan(Planner(config_source=_tuned(tuned, "fused")), batch=1)
    assert fused.variant == "fused" and not fused.gluon and fused.config.gluon == 0


def test_gluon_tiles_are_refused_by_name():
    refusal = gluon_module.tile_refusal
    for config in GLUON_STARTS:
        assert refusal(config, "verify") == ""
        assert (refusal(config, "read") == "") is (refusal(config, "write") == "") is (config.b_v == 64)
    assert "b_k, b_v in (32, 64), not 16/64" in refusal(KernelConfig(16, 64, 4, 2, gluon=1))
    assert "4 warps" in refusal(KernelConfig(32, 64, 2, 2, gluon=1))
    assert "not 3" in refusal(KernelConfig(32, 64, 4, 3, gluon=1))
    assert "b_v = 32" in refusal(KernelConfig(32, 32, 4, 2, gluon=1), "write")
    assert "read round on the Gluon verify takes 64-wide" in refusal(KernelConfig(64, 32, 4, 2, gluon=1), "read")


def test_the_tuner_gives_gluon_buckets_the_ring_tiles_only(sm90):
    """A bucket's verify config also runs a ring's rounds: its Gluon candidates are the ring's tiles (32/64), with
    either number of stages; the others are refused by name."""
    from bole_tune.database import ShapeKey
    from bole_tune.search_space import feasible, for_key, gluon_bucket_refusal

    key = ShapeKey(heads=HEADS_9B, dtype="bf16", tree_bucket=64, batch_bucket=16)
    allowed = [c for c in for_key(SearchSpace.load(), key).configs() if c.gluon and not gluon_bucket_refusal(c, key)]
    assert {c.text for c in allowed} == {"32/64/4/2/1", "32/64/4/1/1"}
    assert "RING_TILES" in gluon_bucket_refusal(KernelConfig(64, 64, 4, 1, gluon=1), key)
    assert feasible(KernelConfig(32, 64, 4, 2, gluon=1), 128, 128, 64, "bf16", bucket=key) == (True, "")
    assert not feasible(KernelConfig(32, 64, 4, 2, gluon=1), 128, 128, 64, "bf16")[0]  # needs its bucket


def test_planner_never_sends_a_launch_to_gluon_off_sm90():
    planner = Planner(config_source=_source)
    if not GLUON_GPU:
        assert not _plan(planner).gluon  # this machine has no sm_90 GPU
    cpu = planner.plan(HEADS_9B, BF16, num_requests=16, max_tree_size=64, depth=8, device="cpu", check=False)
    assert not cpu.gluon
    with pytest.raises(ValueError, match="gluon: .*not a CUDA device"):
        planner.plan(HEADS_9B, BF16, num_requests=16, max_tree_size=64, depth=8, device="cpu", check=False,
                     gluon=True)


def test_asking_for_gluon_where_it_cannot_run_names_why(sm90):
    planner = Planner(config_source=_source)
    with pytest.raises(ValueError, match=r"gluon: .*fold=True"):
        _plan(planner, fold=True, gluon=True)
    with pytest.raises(ValueError, match=r"gluon: .*dk, dv = \(128, 128\)"):
        _plan(planner, heads=HeadShape(hk=16, hv=32, dk=64, dv=64), gluon=True)
    launch = Launch("resident", KernelConfig(32, 64, 4, 2), 64, gluon=True)
    with pytest.raises(ValueError, match="launch.gluon: .*float32"):
        planner.given(launch, HEADS_9B, F32, F32, 64, 8, 128 ** -0.5, True, torch.device("cuda"))


def test_a_gluon_launch_that_fails_its_self_check_runs_the_triton_kernel(sm90, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a test GPU")
    asked = []

    def self_check(launch, *args):
        asked.append(launch.gluon)
        if launch.gluon:
            raise RuntimeError("out of resource: shared memory")
        return 1e-3, 5e-3

    planner = Planner(config_source=_source, self_check=self_check)
    with pytest.warns(UserWarning, match="Gluon verify failed its self-check.*out of resource"):
        launch = planner.plan(HEADS_9B, BF16, num_requests=16, max_tree_size=64, depth=8, device="cuda")
    assert asked == [True, False]  # the Gluon launch, then the Triton one it falls back to, each checked
    assert (launch.variant, launch.gluon) == ("resident", False)
    assert "Gluon verify's self-check: RuntimeError: out of resource" in launch.fallback
    assert launch.fallback_error is None  # what runs (the Triton kernel) passed its own check
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decided once: no second warning, no second check
        assert planner.plan(HEADS_9B, BF16, num_requests=16, max_tree_size=64, depth=8, device="cuda") == launch
    assert asked == [True, False]

    wrong = Planner(config_source=_source, self_check=lambda launch, *a: (3e-2, 5e-3) if launch.gluon else (1e-3, 5e-3))
    with pytest.warns(UserWarning, match="relative error 3.0e-02"):
        assert not wrong.plan(HEADS_9B, BF16, num_requests=16, max_tree_size=64, depth=8, device="cuda").gluon


def test_gluon_takes_only_what_it_was_built_for():
    launch = Launch("resident", KernelConfig(32, 64, 4, 2), 64, gluon=True)
    shape = type("Shape", (), {"heads": HEADS_9B})()
    pool = torch.zeros(4, 32, 128, 128)
    q, k = torch.zeros(64, 16, 128, dtype=BF16), torch.zeros(64, 16, 128, dtype=BF16)
    v = torch.zeros(64, 32, 128, dtype=BF16)

    def takes(*, launch=launch, q=q, k=k, v=v, pool=pool, shape=shape, **kw):
        return gluon_module.gluon_takes(launch, q, k, v, pool, shape, **kw)

    assert takes()
    assert not takes(launch=launch.replace(gluon=False))
    assert not takes(pending=object())  # a PendingCommit: the Triton kernel folds it
    assert not takes(pool=pool.transpose(2, 3))  # no TMA view of the pool
    assert not takes(pool=torch.zeros(4 * 32 * 128 * 128 + 1)[1:].view(4, 32, 128, 128))  # 4-byte aligned only
    assert not takes(shape=type("Shape", (), {"heads": HeadShape(hk=16, hv=32, dk=128, dv=64)})())
    fused = torch.zeros(64, 16 * 128 * 3 + 4, dtype=BF16)  # q, k, v cut out of one projection, rows of 6152 bytes
    assert takes(q=fused[:, :2048].view(64, 16, 128)) is False  # a row stride of 6148 elements: not whole 16 bytes
    aligned = torch.zeros(64, 16 * 128 * 3 + 8, dtype=BF16)
    assert takes(q=aligned[:, :2048].view(64, 16, 128), k=aligned[:, 2048:4096].view(64, 16, 128))
    assert not takes(k=aligned[:, 2049:4097].view(64, 16, 128))  # an odd element offset
    assert not takes(launch=launch.replace(config=KernelConfig(128, 32, 4, 2, gluon=1)))  # tiles it does not take
    tree = make_tree([8], device="cpu")
    # 9-node paths: R = 3 -> tables 32 wide, R = 4 -> 64; a round reads what its held rounds fill (16 or 32 entries
    # while at most 3 rounds are held), so a ring of four runs its read rounds here and its write round on Triton's
    for rounds, widths, write_here in ((3, [16, 16, 32, 32], True), (4, [16, 16, 32, 32, 64], False)):
        ring = PendingRing(4, rounds, 9, capacity=64, max_requests=4, device="cpu")
        arena = ring.results(HEADS_9B, BF16)
        for held, width in enumerate(widths):
            ring.held = held
            step = ring.begin(tree)
            assert (step.width, step.write) == (width, held == rounds)
            assert takes(ring=step.layer(arena)) is (write_here or not step.write), (rounds, held)
    ring = PendingRing(4, 3, 9, capacity=64, max_requests=4, device="cpu")
    write = RingRead(RingRound(ring, tree, 0, True), ring.results(HEADS_9B, BF16))  # a write round
    assert takes(ring=write)
    assert not takes(ring=write, launch=launch.replace(config=KernelConfig(64, 32, 4, 2, gluon=1)))  # 32-row tiles


def test_the_l2_prefetch_distance_is_per_multiprocessor_and_in_the_launch(monkeypatch):
    """Each mode's prefetch distance is its `L2_AHEAD_PER_SM` times the device's multiprocessors (the H200's where no GPU
    is asked), and it is in the launch's constants, so a changed setting compiles and keys its own kernel."""
    tree = make_tree([64] * 2, "random", max_depth=8, seed=1, device="cpu")
    x = make_inputs(tree, HEADS_9B.hk, HEADS_9B.hv, HEADS_9B.dk, HEADS_9B.dv, BF16, "cpu", seed=1)
    from bole_tune.kernels.verify.checks import check_verify_inputs
    from bole_tune.kernels.verify.result import result_buffers
    shape = check_verify_inputs(*x.args(tree), None, False)
    res = result_buffers(shape, BF16, "cpu", tree, None)
    ring = PendingRing(x.state.shape[0], 3, 9, capacity=tree.num_nodes, max_requests=2, device="cpu")
    read = RingRead(RingRound(ring, tree, 0, False), ring.results(HEADS_9B, BF16))
    for per_sm in (0, 2, 5):
        monkeypatch.setitem(gluon_module.L2_AHEAD_PER_SM, "verify", per_sm)
        monkeypatch.setitem(gluon_module.L2_AHEAD_PER_SM, "read", per_sm + 1)
        _, _, meta = gluon_module.launch_args(*x.args(tree)[:7], tree, shape, res, gluon_module.UNTUNED_CONFIG)
        assert meta["L2_AHEAD"] == per_sm * gluon_module.H200_SMS and meta["MODE"] == 0
        _, _, meta = gluon_module.launch_args(*x.args(tree)[:7], tree, shape, res, gluon_module.UNTUNED_CONFIG, read)
        assert meta["L2_AHEAD"] == (per_sm + 1) * gluon_module.H200_SMS and meta["MODE"] == 1


def test_every_mode_compiles_for_sm90_within_two_programs_an_sm():
    """Compiled here, without a GPU (a process without TRITON_INTERPRET): a compile error, or shared memory past two
    programs an SM (the B=16 launch then runs in three waves, not two), shows before any device run."""
    tools = binaries.missing_tools()
    if tools:
        pytest.skip(f"Triton's wheel here ships no {', '.join(tools)}: nothing to compile with")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", "import json; from bole_tune.kernels.verify.gluon import "
                           "compile_report; print(json.dumps(compile_report()))"], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(report) == {"verify", "read", "write"}
    for mode, row in report.items():
        assert row["num_warps"] == 4, mode
        assert row["registers"] <= 255, (mode, row)
        assert row["shared"] <= TWO_PROGRAMS_AN_SM, (mode, row)
        assert row["stack"] <= 64, (mode, row)  # a few spilled bytes at most (255 registers a thread)


def test_every_gluon_config_of_the_search_space_compiles_for_sm90():
    """Each Gluon config the tuner may try (its tiles and stages), in each mode its tiles take, compiles for sm_90 and
    fits one program in an SM's shared memory (what it costs is the tuner's to measure)."""
    tools = binaries.missing_tools()
    if tools:
        pytest.skip(f"Triton's wheel here ships no {', '.join(tools)}: nothing to compile with")
    configs = [c for c in SearchSpace.load().configs() if c.gluon and c != gluon_module.UNTUNED_CONFIG]
    assert {c.text for c in configs} == {c.text for c in GLUON_STARTS} - {gluon_module.UNTUNED_CONFIG.text}
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json; from bole_tune.config import KernelConfig; from bole_tune.kernels.verify.gluon import "
            "compile_report; print(json.dumps({t: compile_report(config=KernelConfig.from_text(t)) for t in %r}))"
            % [c.text for c in configs])
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for config in configs:
        modes = report[config.text]
        assert set(modes) == {m for m in ("verify", "read", "write") if not gluon_module.tile_refusal(config, m)}
        for mode, row in modes.items():
            assert row["num_warps"] == 4 and row["registers"] <= 255, (config.text, mode, row)
            assert row["shared"] <= 232448 - 1024, (config.text, mode, row)  # one program an SM at least


# ------------------------------------------------------------------------------------------------ on the H200


def _inputs(sizes, seed, num_slots=None):
    tree = make_tree(sizes, "random", max_depth=8, seed=seed, device="cuda")
    x = make_inputs(tree, HEADS_9B.hk, HEADS_9B.hv, HEADS_9B.dk, HEADS_9B.dv, BF16, "cuda", seed=seed,
                    num_slots=num_slots)
    return tree, x


@requires_sm90
@pytest.mark.parametrize("sizes", [[64] * 16, [33, 64, 40, 57, 64, 48, 35, 61], [64] * 8 + [1, 2, 16, 33]])
def test_gluon_verify_and_commit_match_the_reference(sizes):
    tree, x = _inputs(sizes, seed=len(sizes))
    launch = plan_launch(HEADS_9B, BF16, num_requests=tree.num_requests, max_tree_size=tree.max_tree_size,
                         depth=tree.depth, device="cuda")
    assert launch.gluon, launch
    shape = type("Shape", (), {"heads": HEADS_9B})()
    assert gluon_module.gluon_takes(launch, x.q, x.k, x.v, x.state, shape)  # the Gluon kernel runs, not Triton's
    before = x.state.clone()
    res = tree_verify(*x.args(tree), launch=launch)
    assert torch.equal(x.state, before), "the verify wrote the pool"
    ref = verify_reference(*x.args(tree))
    assert_close(res.o, ref.o, TOLERANCE[BF16], "outputs")
    triton = tree_verify(*x.args(tree), launch=launch.replace(gluon=False))
    assert_close(res.o, triton.o, TOLERANCE[BF16], "outputs against the Triton resident kernel")
    rng = random.Random(1)
    accepted = torch.tensor([accepted_of(rng, tree, r) for r in range(tree.num_requests)], device="cuda")
    truth = ref.committed(x.state, x.state_indices, tree, accepted).float()
    tree_commit(x.state, x.state_indices, res, accepted)
    assert_close(x.state, truth, TOLERANCE[F32], "the pool committed from the Gluon verify's factors")


def _parents_of_depth(depth, size, rng):
    """A ``size``-node tree exactly ``depth`` deep: a chain that deep, the other nodes under random shallower nodes."""
    parents, depths = [-1] + list(range(depth)), list(range(depth + 1))
    while len(parents) < size:
        p = rng.randrange(len(parents))
        if depths[p] < depth:
            parents.append(p)
            depths.append(depths[p] + 1)
    return parents


@requires_sm90
def test_gluon_factors_are_right_at_every_depth_it_takes():
    """The factors by doubling take a different number of levels, and a different last level, at each block depth:
    one launch whose requests are 0 to the planner's deepest (12) deep, outputs and the committed pool against float64."""
    rng = random.Random(5)
    deepest = H200_POLICY.sweep_f16_max_depth
    tree = TreeBatch.from_parents([_parents_of_depth(d, 64 if d else 1, rng) for d in range(deepest + 1)],
                                  device="cuda")
    assert tree.depth == deepest and tree.block_depths(64)[0][:, 0].tolist() == list(range(deepest + 1))
    x = make_inputs(tree, HEADS_9B.hk, HEADS_9B.hv, HEADS_9B.dk, HEADS_9B.dv, BF16, "cuda", seed=5)
    launch = plan_launch(HEADS_9B, BF16, num_requests=tree.num_requests, max_tree_size=tree.max_tree_size,
                         depth=tree.depth, device="cuda")
    assert launch.gluon, launch
    res = tree_verify(*x.args(tree), launch=launch)
    ref = verify_reference(*x.args(tree))
    for r in range(tree.num_requests):
        a, b = int(tree.offsets[r]), int(tree.offsets[r + 1])
        assert_close(res.o[a:b], ref.o[a:b], TOLERANCE[BF16], f"outputs of the request {r} deep")
    accepted = torch.tensor([(r, tree.sizes[r] - 1, -1)[r % 3] for r in range(tree.num_requests)], device="cuda")
    truth = ref.committed(x.state, x.state_indices, tree, accepted).float()
    tree_commit(x.state, x.state_indices, res, accepted)
    assert_close(x.state, truth, TOLERANCE[F32], "the pool committed from the factors")


@requires_sm90
@pytest.mark.parametrize("config", GLUON_STARTS, ids=lambda c: c.text)
def test_every_gluon_config_matches_the_reference(config):
    """Each Gluon config the tuner may record (its tiles, and 1 or 2 state tiles in flight): the verify against float64."""
    tree, x = _inputs([33, 64, 40, 57, 64, 48, 35, 61], seed=7)
    launch = plan_launch(HEADS_9B, BF16, num_requests=tree.num_requests, max_tree_size=tree.max_tree_size,
                         depth=tree.depth, device="cuda", config=config, tuned_on="resident")
    assert launch.gluon and launch.config == config, launch
    res = tree_verify(*x.args(tree), launch=launch)
    assert_close(res.o, verify_reference(*x.args(tree)).o, TOLERANCE[BF16], f"outputs with {config.text}")


@requires_sm90
@pytest.mark.parametrize("rounds,batch,config", [(3, 16, None), (2, 8, KernelConfig(64, 64, 4, 1, gluon=1)),
                                                 (1, 8, KernelConfig(32, 64, 4, 1, gluon=1)),
                                                 (3, 8, KernelConfig(64, 32, 4, 2, gluon=1))],
                         ids=lambda p: p.text if isinstance(p, KernelConfig) else str(p))
def test_gluon_ring_rounds_match_the_recurrence(rounds, batch, config):
    """A `PendingRing` over consecutive rounds of 33-64-node trees, every round's read or write on the Gluon kernel
    (tables of width 16-32): outputs, untouched pools in read rounds, written slots in write rounds, and the pool
    after the last flush, against the float64 recurrence; requests accept none, the root, the deepest or any node.
    ``config``: the database's (None) or these Gluon tiles (32-wide value tiles: the ring's rounds on Triton's kernel)."""
    rng = random.Random(rounds)
    num_slots = 2 * batch
    ring = PendingRing(num_slots, rounds, 9, capacity=64 * batch, max_requests=batch, device="cuda")
    assert ring.width <= gluon_module.MAX_RING_WIDTH
    arena = ring.results(HEADS_9B, BF16)
    _, x0 = _inputs([1], seed=99, num_slots=num_slots)
    pool = x0.state
    truth = pool.clone()
    slots = torch.tensor(rng.sample(range(num_slots), batch), dtype=torch.int32, device="cuda")
    writes = 0
    for index in range(3 * rounds + 2):
        tree, x = _inputs([rng.randint(33, 64) for _ in range(batch)], seed=200 + index)
        step = ring.begin(tree)
        launch = plan_launch(HEADS_9B, BF16, num_requests=batch, max_tree_size=tree.max_tree_size, depth=tree.depth,
                             device="cuda", ring=step.write, config=config, tuned_on="resident" if config else None)
        continue_on_triton = bool(config and gluon_module.tile_refusal(config, "write" if step.write else "read"))
        if continue_on_triton and step.write:  # planned on Triton's kernel; a read round is planned as the verify
            assert not launch.gluon and launch.config == config.replace(gluon=0), launch
        else:
            assert launch.gluon, launch
        assert gluon_module.gluon_takes(launch, x.q, x.k, x.v, pool, type("Shape", (), {"heads": HEADS_9B})(),
                                        ring=step.layer(arena)) is not continue_on_triton  # which kernel runs
        before = pool.clone()
        res = tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots, tree, launch=launch, ring=step.layer(arena))
        ref = verify_reference(x.q, x.k, x.v, x.g, x.beta, truth, slots, tree)
        kind = "write" if step.write else "read"
        assert_close(res.o, ref.o, TOLERANCE[BF16], f"round {index} ({kind}) outputs")
        if step.write:
            writes += 1
            assert_close(pool[slots.long()], truth[slots.long()], TOLERANCE[F32], f"round {index}: written slots")
        else:
            assert torch.equal(pool, before), f"round {index}: a read round wrote the pool"
        accepted = torch.tensor([accepted_of(rng, tree, r) for r in range(batch)], device="cuda")
        truth = ref.committed(truth, slots, tree, accepted).float()
        ring.end(step, slots, accepted, validate=True)
    ring.flush(slots, [pool], [arena])
    assert_close(pool, truth, TOLERANCE[F32], "pool after the final flush")
    assert writes == (3 * rounds + 1) // rounds
