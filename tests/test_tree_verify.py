"""tree_verify, serial_verify and tree_commit against the float64 node-by-node reference.

CPU cases run under TRITON_INTERPRET=1 with small shapes; GPU cases (production head sizes) run on
a CUDA device and are skipped visibly without one.
"""

import functools
import random

import pytest
import torch

from bole_tune import KernelConfig, TreeBatch
from bole_tune.kernels import PLANNER, Launch, serial_verify, tree_commit, tree_verify
from bole_tune.kernels.reference import verify_reference
from bole_tune.kernels.verify.planner import H200_POLICY
from bole_tune.kernels.verify.result import VerifyShape, result_buffers
from bole_tune.shapes import HeadShape
from bole_tune.workloads import make_inputs, make_tree, tree_parents
from conftest import requires_gpu
from helpers import TOLERANCE, assert_close, poisoned_out

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# id -> (tree sizes, tree kind, Hk, Hv, dk = dv, dtype, g range)
CPU_CASES = {
    "B3-T[1,7,20]-random-Hk1-Hv2-D32-fp32": ([1, 7, 20], "random", 1, 2, 32, F32, (-2.0, 0.0)),
    "B2-T[5,33]-random-Hk2-Hv4-D32-bf16": ([5, 33], "random", 2, 4, 32, BF16, (-2.0, 0.0)),
    "B1-T70-chain-Hk1-Hv1-D32-fp32": ([70], "chain", 1, 1, 32, F32, (-0.3, 0.0)),
    "B2-T[24,9]-star-Hk1-Hv4-D32-fp16": ([24, 9], "star", 1, 4, 32, F16, (-2.0, 0.0)),
    "B2-T[30,12]-forest-Hk2-Hv2-D64-fp32": ([30, 12], "forest", 2, 2, 64, F32, (-1.0, 0.0)),
    "B2-T[17,3]-random-Hk1-Hv2-D128-bf16": ([17, 3], "random", 1, 2, 128, BF16, (-2.0, 0.0)),
    "B1-T40-random-Hk1-Hv1-D32-fp32-g0": ([40], "random", 1, 1, 32, F32, (0.0, 0.0)),
    "B2-T[21,6]-random-Hk1-Hv2-D32-fp32-g-20": ([21, 6], "random", 1, 2, 32, F32, (-20.0, -20.0)),
}
CPU_SLOW_CASES = {
    "B1-T256-chain-Hk1-Hv1-D32-fp32": ([256], "chain", 1, 1, 32, F32, (-0.1, 0.0)),
    "B2-T[256,100]-random-Hk1-Hv2-D32-bf16": ([256, 100], "random", 1, 2, 32, BF16, (-2.0, 0.0)),
}
GPU_CASES = {
    "B4-T64-random-Hk16-Hv32-D128-bf16": ([64] * 4, "random", 16, 32, 128, BF16, (-2.0, 0.0)),
    "B3-T[1,100,256]-random-Hk16-Hv48-D128-bf16": ([1, 100, 256], "random", 16, 48, 128, BF16, (-2.0, 0.0)),
    "B2-T[64,37]-random-Hk16-Hv64-D128-fp16": ([64, 37], "random", 16, 64, 128, F16, (-2.0, 0.0)),
    "B2-T[128,19]-random-Hk16-Hv32-D128-fp32": ([128, 19], "random", 16, 32, 128, F32, (-2.0, 0.0)),
    "B1-T256-chain-Hk16-Hv32-D128-fp32": ([256], "chain", 16, 32, 128, F32, (-0.05, 0.0)),
    "B2-T[256,7]-chain-Hk4-Hv16-D64-bf16": ([256, 7], "chain", 4, 16, 64, BF16, (-0.05, 0.0)),
    "B3-T[50,64,3]-star-Hk8-Hv16-D32-bf16": ([50, 64, 3], "star", 8, 16, 32, BF16, (-2.0, 0.0)),
    "B4-T[90,40,13,2]-forest-Hk16-Hv32-D128-bf16": ([90, 40, 13, 2], "forest", 16, 32, 128, BF16, (-20.0, 0.0)),
    "B16-T64-random-Hk16-Hv32-D128-bf16": ([64] * 16, "random", 16, 32, 128, BF16, (-2.0, 0.0)),
}


def run_case(device, sizes, kind, hk, hv, d, dtype, g_range, verify=tree_verify, config=None, seed=0):
    tree = make_tree(sizes, kind, max_depth=8, seed=seed, device=device)
    x = make_inputs(tree, hk, hv, d, d, dtype, device, g_range=g_range, seed=seed)
    pool_before = x.state.clone()
    out = poisoned_out(x, tree)
    kwargs = {"config": config} if config is not None else {}
    res = verify(*x.args(tree), out=out, **kwargs)
    assert torch.equal(x.state, pool_before), "verification wrote the state pool"
    ref = verify_reference(*x.args(tree))
    tolerance = TOLERANCE[dtype]
    assert_close(res.o, ref.o, tolerance, "o")
    assert torch.isfinite(res.u).all() and torch.isfinite(res.log_decay).all() and torch.isfinite(res.k_scale).all()
    assert torch.equal(res.k, x.k), "the kept keys differ from the input keys"

    # commit a different node per request: the deepest, a random one, and -1 for one request
    rng = random.Random(seed)
    accepted = []
    for r, size in enumerate(sizes):
        choice = rng.choice(["deepest", "random", "none"] if len(sizes) > 1 else ["deepest", "random"])
        depths = [len(tree.path_to(r, n)) for n in range(size)]
        accepted.append({"deepest": max(range(size), key=depths.__getitem__),
                         "random": rng.randrange(size), "none": -1}[choice])
    accepted = torch.tensor(accepted, dtype=torch.int64, device=device)
    tree_commit(x.state, x.state_indices, res, accepted)
    expected = ref.committed(pool_before, x.state_indices, tree, accepted)
    assert_close(x.state, expected, tolerance, "committed state")
    named = set(x.state_indices.tolist())
    for slot in range(x.state.shape[0]):
        if slot not in named:
            assert torch.equal(x.state[slot], pool_before[slot]), f"slot {slot} is not in state_indices but changed"
    return res


VARIANT_CASES = [(case, variant) for case in CPU_CASES for variant in ("fused", "resident")
                 if variant == "fused" or max(CPU_CASES[case][0]) <= 64]


@pytest.mark.parametrize("case,variant", VARIANT_CASES, ids=[f"{c}-{v}" for c, v in VARIANT_CASES])
def test_tree_verify_matches_reference(device, case, variant):
    run_case(device, *CPU_CASES[case], verify=functools.partial(tree_verify, variant=variant))


def test_variant_choice():
    """The resident kernel from 512 (request bucket x head) pairs up (in its state-first order for trees of at
    most 16 nodes), from 256 for trees of more than 32 nodes, up to 64 for trees of at most 32 nodes, and only
    for trees of at most 64 nodes."""
    pick = H200_POLICY.variant
    assert (H200_POLICY.resident_min_heads, H200_POLICY.resident_min_heads_large_trees) == (512, 256)
    assert pick(16, 32, 64) == "resident"
    assert pick(12, 32, 64) == "resident"  # batch bucket 16: the bucket's tuned config is for it
    assert pick(8, 32, 64) == "resident"
    assert pick(8, 32, 33) == "resident"
    assert pick(8, 32, 32) == "fused"
    assert pick(4, 32, 64) == "fused"
    assert pick(16, 32, 65) == "fused"
    assert pick(8, 64, 16) == "stream"  # from 512 heads, trees of at most 16 nodes: the state-first order
    assert pick(16, 32, 17) == "resident"
    assert pick(4, 64, 8) == "fused"
    assert pick(1, 32, 64) == "fused"
    assert pick(100, 32, 1) == "stream"
    # one or two requests of small trees: the resident kernel, its rows split over programs
    assert (H200_POLICY.resident_max_heads_small, H200_POLICY.small_tree) == (64, 32)
    assert pick(1, 32, 4) == "resident"
    assert pick(2, 32, 32) == "resident"
    assert pick(1, 64, 16) == "resident"
    assert pick(3, 32, 8) == "fused"  # batch bucket 4
    assert pick(1, 32, 33) == "fused"  # tree bucket 64
    assert pick(1, 128, 8) == "fused"


def test_resident_split():
    """A head's value rows go to more programs at small batches, never below one b_v tile per part."""
    split = H200_POLICY.value_split
    assert split(16, 32, 128, 64) == 1  # 512 programs already
    assert split(4, 32, 128, 32) == 1  # 128
    assert split(2, 32, 128, 32) == 2
    assert split(1, 32, 128, 64) == 2  # capped by dv / b_v
    assert split(1, 32, 128, 16) == 4
    assert split(1, 8, 128, 16) == 8
    assert split(32, 64, 128, 16) == 1
    assert split(3, 32, 128, 32) == split(4, 32, 128, 32)  # decided on the batch bucket


@pytest.mark.parametrize("variant,v_split,b_v,b_k", [("resident", 1, 16, 16), ("resident", 2, 16, 16),
                                                     ("resident", 4, 16, 16), ("stream", 4, 16, 16),
                                                     ("stream", 2, 32, 16), ("stream", 1, 64, 16),
                                                     ("stream", 2, 32, 32), ("stream", 1, 64, 32)])
def test_resident_value_split_matches_reference(device, variant, v_split, b_v, b_k):
    """Every split of a head's value rows over programs writes every output row, and only once each; so does the
    state-first order (one value tile per program, the factors after the stream), in key steps and in one step of
    whole key rows (b_k = dk)."""
    tree = make_tree([13, 1, 20], "random", seed=21, device=device)
    x = make_inputs(tree, 2, 4, 32, 64, torch.float32, device, seed=21)
    ref = verify_reference(*x.args(tree))
    shape = VerifyShape(heads=HeadShape(hk=2, hv=4, dk=32, dv=64), num_nodes=tree.num_nodes, num_requests=3,
                        num_slots=x.state.shape[0], scale=32 ** -0.5)
    res = result_buffers(shape, torch.float32, torch.device(device), tree, None)
    for buf in (res.o, res.u, res.log_decay, res.k, res.k_scale):
        buf.fill_(float("nan"))
    launch = Launch(variant, KernelConfig(b_k, b_v, 4, 1), node_block=32, v_split=v_split)
    tree_verify(*x.args(tree), out=res, launch=launch)
    assert_close(res.o, ref.o, TOLERANCE[torch.float32], "o")
    for name in ("u", "log_decay", "k", "k_scale"):
        assert torch.isfinite(getattr(res, name)).all(), f"{name} has unwritten entries at v_split={v_split}"
    assert torch.equal(res.k, x.k)


@pytest.mark.parametrize("dtype,kind,l2norm", [(F32, "random", True), (BF16, "chain", True), (F16, "random", False)])
@pytest.mark.parametrize("rows_first", [False, True])
@pytest.mark.parametrize("config", [KernelConfig(16, 16, 2, 1), KernelConfig(32, 32, 4, 2)])
def test_stacked_rows_match_reference_and_the_two_tile_launch(device, dtype, kind, l2norm, rows_first, config,
                                                              monkeypatch):
    """A stream launch on stacked rows (trees of at most 8 nodes: q and k in one 16-row tile) writes what the same
    launch on separate q and k tiles writes (outputs, the commit's updates, logP, keys and key scales), within the
    reference's bound; in either order of the state products and with or without the keys' L2 norm."""
    from bole_tune.kernels.verify import run as run_module

    monkeypatch.setattr(run_module, "ROWS_FIRST", {"verify": rows_first, "fold": rows_first})
    tree = make_tree([8, 3, 1, 6], kind, seed=31, device=device)
    x = make_inputs(tree, 2, 4, 32, 32, dtype, device, seed=31)
    ref = verify_reference(*x.args(tree), use_qk_l2norm=l2norm)
    launch = PLANNER.plan(HeadShape(hk=2, hv=4, dk=32, dv=32), dtype, num_requests=4, max_tree_size=8,
                          depth=tree.depth, device=device, config=config, variant="stream", use_qk_l2norm=l2norm)
    assert launch.stack_qk and launch.node_block == 16
    stacked = tree_verify(*x.args(tree), launch=launch, use_qk_l2norm=l2norm, out=poisoned_out(x, tree))
    apart = tree_verify(*x.args(tree), launch=launch.replace(stack_qk=False), use_qk_l2norm=l2norm)
    assert_close(stacked.o, ref.o, TOLERANCE[dtype], "o")
    for name in ("o", "u", "log_decay", "k", "k_scale"):
        assert_close(getattr(stacked, name), getattr(apart, name), 1e-5, name)
    assert torch.equal(stacked.k, x.k)


@pytest.mark.parametrize("v_split", [3, 0, 4, True, 2.0])
def test_bad_value_split_is_refused(device, v_split):
    tree = make_tree([9], "random", seed=5, device=device)
    x = make_inputs(tree, 1, 2, 32, 32, torch.float32, device, seed=5)
    with pytest.raises(ValueError, match="v_split: expected a power of two"):
        tree_verify(*x.args(tree), config=KernelConfig(16, 16, 4, 1), variant="resident", v_split=v_split)


def test_resident_refuses_large_trees(device):
    tree = make_tree([65, 3], "random", seed=11, device=device)
    x = make_inputs(tree, 1, 2, 32, 32, torch.float32, device, seed=11)
    with pytest.raises(ValueError, match="variant: 'resident' takes trees of at most 64 nodes"):
        tree_verify(*x.args(tree), variant="resident")


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CPU_SLOW_CASES), ids=list(CPU_SLOW_CASES))
def test_tree_verify_large_trees(device, case):
    run_case(device, *CPU_SLOW_CASES[case])


@pytest.mark.parametrize("case", ["B3-T[1,7,20]-random-Hk1-Hv2-D32-fp32", "B2-T[5,33]-random-Hk2-Hv4-D32-bf16",
                                  "B1-T70-chain-Hk1-Hv1-D32-fp32"])
def test_serial_verify_matches_reference(device, case):
    run_case(device, *CPU_CASES[case], verify=serial_verify)


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES), ids=list(GPU_CASES))
def test_gpu_production_shapes(case):
    run_case("cuda", *GPU_CASES[case])


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES)[:4], ids=list(GPU_CASES)[:4])
def test_gpu_serial_verify(case):
    run_case("cuda", *GPU_CASES[case], verify=serial_verify)


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["fused", "resident"])
@pytest.mark.parametrize("config", [KernelConfig(16, 16, 2, 1), KernelConfig(32, 64, 4, 2), KernelConfig(128, 128, 8, 3),
                                    KernelConfig(64, 32, 8, 4), KernelConfig(32, 64, 4, 3)], ids=str)
def test_gpu_configs(config, variant):
    run_case("cuda", [64, 64, 20], "random", 16, 32, 128, BF16, (-2.0, 0.0), config=config,
             verify=functools.partial(tree_verify, variant=variant))


@pytest.mark.parametrize("config", [KernelConfig(16, 16, 1, 1), KernelConfig(32, 32, 2, 2)], ids=str)
def test_tile_configs_agree(device, config):
    run_case(device, [19, 4], "random", 2, 4, 32, BF16, (-2.0, 0.0), config=config)


@pytest.mark.parametrize("variant", ["fused", "resident"])
def test_gates_at_their_limits(device, variant):
    """beta exactly 0 and 1 and g exactly 0 mixed in one batch."""
    tree = make_tree([23, 11], "random", seed=3, device=device)
    x = make_inputs(tree, 1, 2, 32, 32, torch.float32, device, seed=3)
    x.beta[::3] = 0.0
    x.beta[1::3] = 1.0
    x.g[::2] = 0.0
    ref = verify_reference(*x.args(tree))
    res = tree_verify(*x.args(tree), out=poisoned_out(x, tree), variant=variant)
    assert_close(res.o, ref.o, 2e-3, "o")


@pytest.mark.parametrize("variant", ["fused", "resident"])
def test_without_l2_norm_and_custom_scale(device, variant):
    tree = make_tree([12, 30], "random", seed=4, device=device)
    x = make_inputs(tree, 2, 2, 32, 32, torch.float32, device, seed=4)
    x.q.mul_(0.1)
    x.k.mul_(0.1)
    ref = verify_reference(*x.args(tree), scale=0.5, use_qk_l2norm=False)
    res = tree_verify(*x.args(tree), scale=0.5, use_qk_l2norm=False, out=poisoned_out(x, tree), variant=variant)
    assert_close(res.o, ref.o, 2e-3, "o")
    assert torch.all(res.k_scale == 1.0)


@pytest.mark.parametrize("variant", ["fused", "resident"])
def test_non_contiguous_inputs(device, variant):
    """q, k, v as views into one fused projection, gates as column views: the same answer."""
    tree = make_tree([9, 14], "random", seed=5, device=device)
    n, hk, hv, d = tree.num_nodes, 2, 4, 32
    x = make_inputs(tree, hk, hv, d, d, torch.float32, device, seed=5)
    fused = torch.cat([x.q.reshape(n, -1), x.k.reshape(n, -1), x.v.reshape(n, -1)], dim=1)
    q = fused[:, : hk * d].view(n, hk, d)
    k = fused[:, hk * d: 2 * hk * d].view(n, hk, d)
    v = fused[:, 2 * hk * d:].view(n, hv, d)
    gates = torch.stack([x.g, x.beta], dim=2)  # g and beta interleaved: stride 2 along the head axis
    assert not q.is_contiguous() and not gates[..., 0].is_contiguous()
    ref = verify_reference(*x.args(tree))
    res = tree_verify(q, k, v, gates[..., 0], gates[..., 1], x.state, x.state_indices, tree, variant=variant)
    assert_close(res.o, ref.o, 2e-3, "o")
    transposed_k = x.k.transpose(1, 2).contiguous().transpose(1, 2)  # last dim not contiguous: copied
    res = tree_verify(x.q, transposed_k, x.v, x.g, x.beta, x.state, x.state_indices, tree, variant=variant)
    assert_close(res.o, ref.o, 2e-3, "o with a strided key dimension")


def test_state_pool_view_with_layer_axis(device):
    """A pool that is one layer of a [layers, slots, ...] buffer is read and committed in place."""
    tree = make_tree([10, 5], "random", seed=6, device=device)
    x = make_inputs(tree, 1, 2, 32, 32, torch.float32, device, num_slots=4, seed=6)
    layers = torch.randn(3, *x.state.shape, device=device)
    layers[1] = x.state
    before = layers.clone()
    ref = verify_reference(*x.args(tree))
    res = tree_verify(x.q, x.k, x.v, x.g, x.beta, layers[1], x.state_indices, tree)
    assert_close(res.o, ref.o, 2e-3, "o")
    accepted = torch.tensor([9, 0], device=device)
    tree_commit(layers[1], x.state_indices, res, accepted)
    assert_close(layers[1], ref.committed(x.state, x.state_indices, tree, accepted), 2e-3, "committed")
    assert torch.equal(layers[0], before[0]) and torch.equal(layers[2], before[2]), "another layer changed"


def test_closed_form_fallback_matches_reference(monkeypatch):
    """Without Triton (CPU, interpreter off) tree_verify runs the dense closed form."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    tree = make_tree([1, 31, 64], "random", seed=7)
    x = make_inputs(tree, 2, 4, 32, 32, torch.float32, "cpu", seed=7)
    ref = verify_reference(*x.args(tree))
    res = tree_verify(*x.args(tree), out=poisoned_out(x, tree))
    assert_close(res.o, ref.o, 1e-4, "o")
    accepted = torch.tensor([0, 30, 63])
    before = x.state.clone()
    tree_commit(x.state, x.state_indices, res, accepted)
    assert_close(x.state, ref.committed(before, x.state_indices, tree, accepted), 1e-4, "committed")


def test_reference_is_the_sequential_recurrence():
    """On a chain the tree reference must equal a plain token-by-token loop written here."""
    tree = TreeBatch.from_parents([tree_parents(6, "chain")])
    x = make_inputs(tree, 1, 1, 16, 16, torch.float32, "cpu", seed=8)
    ref = verify_reference(*x.args(tree), use_qk_l2norm=False, scale=1.0)
    s = x.state[x.state_indices[0]].double()[0].T.clone()  # [dk, dv]
    for i in range(6):
        q, k, v = x.q[i, 0].double(), x.k[i, 0].double(), x.v[i, 0].double()
        gamma, beta = torch.exp(x.g[i, 0].double()), x.beta[i, 0].double()
        u = beta * (v - gamma * (s.T @ k))
        s = gamma * s + torch.outer(k, u)
        assert torch.allclose(ref.o[i, 0], s.T @ q, atol=1e-10)
    assert torch.allclose(ref.states[5, 0], s.T, atol=1e-10)


@pytest.mark.parametrize("variant", ["fused", "resident"])
def test_every_depth_around_the_solver_switch(device, variant):
    """Chains of 1..12 nodes in one batch: block depths 0..11 (each level one substitution sweep)."""
    tree = TreeBatch.from_parents([tree_parents(n, "chain") for n in range(1, 13)], device=device)
    x = make_inputs(tree, 1, 2, 32, 32, torch.float32, device, seed=9)
    ref = verify_reference(*x.args(tree))
    res = tree_verify(*x.args(tree), out=poisoned_out(x, tree), variant=variant)
    assert_close(res.o, ref.o, 2e-3, "o")


@pytest.mark.parametrize("variant", ["fused", "resident"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_correlated_keys_stay_accurate(device, dtype, variant):
    """Nearly equal keys, beta = 1, g = 0: G is almost all ones, the hardest case for the solve."""
    tree = TreeBatch.from_parents([tree_parents(9, "chain"), tree_parents(40, "random", 8)], device=device)
    x = make_inputs(tree, 1, 2, 32, 32, dtype, device, seed=10)
    base = torch.randn(32, generator=torch.Generator().manual_seed(1))
    noise = torch.randn(x.k.shape, generator=torch.Generator().manual_seed(2))
    x.k.copy_((base + 0.05 * noise).to(x.k.dtype))
    x.beta.fill_(1.0)
    x.g.zero_()
    ref = verify_reference(*x.args(tree))
    res = tree_verify(*x.args(tree), out=poisoned_out(x, tree), variant=variant)
    assert_close(res.o, ref.o, TOLERANCE[dtype], "o")
    accepted = torch.tensor([8, 39], device=device)
    before = x.state.clone()
    tree_commit(x.state, x.state_indices, res, accepted)
    assert_close(x.state, ref.committed(before, x.state_indices, tree, accepted), TOLERANCE[dtype], "committed")


def test_fp16_sweeps_are_taken_where_they_stay_in_range():
    sweep_f16 = H200_POLICY.sweep_f16
    assert H200_POLICY.sweep_f16_max_depth == 12
    assert sweep_f16(BF16, True, 12, 0.09) and sweep_f16(F16, True, 8, 1.0)
    assert not sweep_f16(BF16, True, 13, 0.09)  # partial sums past 2^11 on deeper trees
    assert not sweep_f16(BF16, False, 8, 0.09)  # raw keys: G is not bounded by 1
    assert not sweep_f16(F32, True, 8, 0.09) and not sweep_f16(BF16, True, 8, 1000.0)


@pytest.mark.parametrize("keys", ["equal", "alternating"])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_fp16_sweeps_on_deep_chains(device, dtype, keys):
    """16-bit inputs with L2 norm run the resident kernel's level sweeps on fp16 operands on trees up to
    12 deep. Nearly equal (or alternately opposite) keys with beta = 1, g = 0 are the worst case: the
    partial Neumann sums of a chain's rows grow like binomial coefficients. A chain of 13 nodes (depth
    12, fp16) stays accurate; a chain of 64 (63 sweeps) must run on tf32, since in fp16 its partial sums
    overflow (inf, then NaN in o)."""
    for chain in (13, 64):
        tree = TreeBatch.from_parents([tree_parents(chain, "chain"), tree_parents(40, "random", 8)], device=device)
        x = make_inputs(tree, 1, 2, 32, 32, dtype, device, seed=11)
        base = torch.randn(32, generator=torch.Generator().manual_seed(1))
        noise = torch.randn(x.k.shape, generator=torch.Generator().manual_seed(2))
        sign = torch.ones(tree.num_nodes, 1, 1)
        if keys == "alternating":
            sign[1::2] = -1.0
        x.k.copy_((sign * base + 0.05 * noise).to(x.k.dtype))
        x.beta.fill_(1.0)
        x.g.zero_()
        ref = verify_reference(*x.args(tree))
        res = tree_verify(*x.args(tree), out=poisoned_out(x, tree), variant="resident")
        assert_close(res.o, ref.o, TOLERANCE[dtype], f"o (chain of {chain})")
        accepted = torch.tensor([chain - 1, 39], device=device)
        before = x.state.clone()
        tree_commit(x.state, x.state_indices, res, accepted)
        assert_close(x.state, ref.committed(before, x.state_indices, tree, accepted), TOLERANCE[dtype],
                     f"committed (chain of {chain})")


def test_bf16_state_products_keep_sixteen_bits(device):
    """The resident kernel takes S_pre as two bf16 parts (hi + lo) for bf16 inputs on trees of more than 32
    nodes (here 33: node block 64). Where the state predicts v, R = V - P K S_pre is a small difference and
    U shows the state products' rounding: with the lo part dropped (8 bits of S_pre) U is off by about
    1.8e-3 here. The interpreter computes tf32 as fp32, so on the CPU that rounding is
    all there is (bound 1e-4); on a GPU the tf32 solve adds its own (bound 2e-3, as for tf32 alone)."""
    from bole_tune.kernels.reference import verify_closed_form
    from bole_tune.workloads import predicted_values, relative_error

    state_split = H200_POLICY.state_split
    assert state_split(BF16, 64) and not state_split(BF16, 32) and not state_split(F16, 64) and not state_split(F32, 64)
    tree = make_tree([20, 33], max_depth=8, seed=4, device=device)
    x = make_inputs(tree, 1, 2, 64, 64, BF16, device, seed=4)
    x.v = predicted_values(x, tree)
    res = tree_verify(*x.args(tree), out=poisoned_out(x, tree), variant="resident")
    ref = verify_closed_form(*x.args(tree), dtype=torch.float64)
    assert relative_error(res.u, ref.u) <= (1e-4 if device == "cpu" else 2e-3)
    assert_close(res.o, ref.o, TOLERANCE[BF16], "o")


def test_resident_self_check_passes_a_good_config(device):
    """The check the GPU runs once per compiled resident config: here on the interpreter, where it must pass."""
    from bole_tune.kernels.verify.self_check import check_resident

    for deep in (False, True):
        launch = Launch("resident", KernelConfig(16, 16, 4, 1), node_block=16, sweep_f16=not deep)
        error, tolerance = check_resident(launch, HeadShape(hk=1, hv=2, dk=32, dv=32), BF16, torch.float32,
                                          32 ** -0.5, True, torch.device(device), deep)
        assert error <= tolerance, (deep, error, tolerance)


def test_one_commit_launch_for_all_layers_of_sliced_stacks(device):
    """An engine's stacked results as slices of larger buffers (more layers, nodes and requests, as SGLang's adapter
    keeps them): every layer's rows row-major, the layers further apart. The all-layer commit takes them by its quick
    checks (`tree_commit._layers_hold`, no views made) and commits each layer to the float64 reference."""
    from bole_tune.kernels import LayerResults, tree_commit_layers
    from bole_tune.kernels.verify.tree_commit import _layers_hold
    from bole_tune.shapes import HeadShape

    sizes, layers = [5, 1, 9], 3
    tree = make_tree(sizes, "random", seed=33, device=device)
    heads = HeadShape(hk=1, hv=2, dk=32, dv=32)
    big = LayerResults.empty(layers + 2, make_tree([12] * 5, "random", seed=34, device=device), heads, torch.float32,
                             device)
    n, b = tree.num_nodes, tree.num_requests
    results = LayerResults(o=big.o[:layers, :n], u=big.u[:layers, :n], log_decay=big.log_decay[:layers, :n],
                           k=big.k[:layers, :n], k_scale=big.k_scale[:layers, :n], committed=big.committed[:layers, :b])
    assert not results.u.is_contiguous()
    accepted = torch.tensor([4, -1, 8], device=device)
    pools, expected = [], []
    for layer in range(layers):
        x = make_inputs(tree, 1, 2, 32, 32, torch.float32, device, seed=50 + layer)
        if layer:
            x.state_indices.copy_(pools[0][1])
        tree_verify(*x.args(tree), out=results.layer(layer, tree))
        pools.append((x.state, x.state_indices))
        expected.append(verify_reference(*x.args(tree)).committed(x.state, x.state_indices, tree, accepted))
    states = torch.stack([p for p, _ in pools])
    assert _layers_hold(states, pools[0][1], results, tree, accepted), "sliced stacks must take the quick checks"
    tree_commit_layers(states, pools[0][1], results, tree, accepted)
    for layer in range(layers):
        assert_close(states[layer], expected[layer], TOLERANCE[torch.float32], f"layer {layer}")


@pytest.mark.parametrize("loads", ["tuned", "tma", "tma-first-by-pointer", "path-table", "path-table-tma"])
@pytest.mark.parametrize("layers,sizes,kind", [(3, [5, 1, 9], "random"), (1, [20], "random"), (2, [18, 3], "chain")],
                         ids=["L3-B3", "L1-B1", "L2-B2-deep-chain"])
def test_one_commit_launch_for_all_layers(device, layers, sizes, kind, loads, monkeypatch):
    """tree_commit_layers commits every layer's accepted path in one launch: each layer's slot equals the
    float64 reference of that layer, requests with -1 keep theirs, and the pools of other slots are untouched
    (also for paths longer than the 16 nodes a program gathers at once). ``tma``: the state tiles read by TMA
    (two tiles a program, pipelined; on the CPU through the interpreter's tensor descriptors), the first one too, the
    deep chain's later passes reading back by pointers what the first one stored; ``tma-first-by-pointer`` (as
    shipped): the first tile read by pointers before the path is found, the rest by TMA
    (`tree_commit.TMA_FIRST_BY_POINTER`); ``path-table``: each
    request's path read from a table worked out once per launch (`tree_commit.PATH_TABLE_MIN_BLOCK`; launches of two
    or more layers), with pointer or TMA loads."""
    from bole_tune.config import CommitConfig
    from bole_tune.kernels import LayerResults, tree_commit_layers
    from bole_tune.kernels.verify import tree_commit as commit_module
    from bole_tune.shapes import HeadShape

    config = None
    if loads.startswith("path-table"):
        monkeypatch.setattr(commit_module, "PATH_TABLE_MIN_BLOCK", 16)
        launched = []
        original_rows = commit_module.pending_path_rows
        monkeypatch.setattr(commit_module, "pending_path_rows", lambda *a: launched.append(1) or original_rows(*a))
    if loads in ("tma", "tma-first-by-pointer", "path-table-tma"):
        monkeypatch.setattr(commit_module, "TMA_OFF_GPU", True)
        monkeypatch.setattr(commit_module, "TMA_FIRST_BY_POINTER", loads == "tma-first-by-pointer")
        config = CommitConfig(b_k=16, b_v=16, v_span=32, num_warps=2, num_stages=2, tma=1)

    tree = make_tree(sizes, kind, seed=31, device=device)
    assert (tree.depth >= 16) == (kind == "chain")  # a path of more than 16 nodes is gathered in several passes
    heads = HeadShape(hk=1, hv=2, dk=32, dv=32)
    results = LayerResults.empty(layers, tree, heads, torch.float32, device)
    pools, expected = [], []
    accepted = torch.tensor([s - 1 if r != 1 else -1 for r, s in enumerate(sizes)], device=device)
    for layer in range(layers):
        x = make_inputs(tree, 1, 2, 32, 32, torch.float32, device, seed=40 + layer)
        if layer:
            x.state_indices.copy_(pools[0][1])  # one slot per request, the same in every layer's pool
        tree_verify(*x.args(tree), out=results.layer(layer))
        ref = verify_reference(*x.args(tree))
        pools.append((x.state, x.state_indices))
        expected.append(ref.committed(x.state, x.state_indices, tree, accepted))
    states = torch.stack([p for p, _ in pools])
    if config is not None:
        assert commit_module.tma_state_loads(states, config), "the TMA path must be the one under test"
    tree_commit_layers(states, pools[0][1], results, tree, accepted, config=config)
    for layer in range(layers):
        assert_close(states[layer], expected[layer], TOLERANCE[torch.float32], f"layer {layer}")
    if loads.startswith("path-table"):
        assert launched == ([1] if layers > 1 else []), "the table is for launches of two or more layers"


@pytest.mark.parametrize("scan", [None, 16, 32, 64, 128, "table"])
def test_commit_path_scan_at_every_width(device, scan, monkeypatch):
    """The commit finds each path by scanning its request's nodes ``B_T`` at a time (`tree_commit.SCAN_BLOCK`, else
    the tree's node block, 64 here, capped at `tree_commit.SCAN_WIDTH`, 32): at every width the committed slots equal the float64 reference, for accepted
    nodes in the first, a middle and the last scan step, and -1; a scan wider than the trees (128) too, and the path
    read from a table instead (`tree_commit.PATH_TABLE_MIN_BLOCK`, shipped for launches of several layers at this node
    block)."""
    from bole_tune.kernels import LayerResults, tree_commit_layers
    from bole_tune.kernels.verify import tree_commit as commit_module
    from bole_tune.shapes import HeadShape

    if scan == "table":
        monkeypatch.setattr(commit_module, "PATH_TABLE_MIN_BLOCK", 64)
    else:  # scanned: the table (shipped for these trees' node block of 64) off
        monkeypatch.setattr(commit_module, "PATH_TABLE_MIN_BLOCK", None)
        monkeypatch.setattr(commit_module, "SCAN_BLOCK", scan)
    sizes = [48, 40, 37, 45]
    tree = make_tree(sizes, "random", max_depth=8, seed=12, device=device)
    accepted = torch.tensor([47, 20, 3, -1], device=device)
    heads = HeadShape(hk=1, hv=2, dk=16, dv=16)
    results = LayerResults.empty(2, tree, heads, torch.float32, device)
    pools, expected = [], []
    for layer in range(2):
        x = make_inputs(tree, 1, 2, 16, 16, torch.float32, device, seed=70 + layer)
        if layer:
            x.state_indices.copy_(pools[0][1])
        tree_verify(*x.args(tree), out=results.layer(layer))
        pools.append((x.state, x.state_indices))
        expected.append(verify_reference(*x.args(tree)).committed(x.state, x.state_indices, tree, accepted))
    states = torch.stack([p for p, _ in pools])
    tree_commit_layers(states, pools[0][1], results, tree, accepted)
    for layer in range(2):
        assert_close(states[layer], expected[layer], TOLERANCE[torch.float32], f"layer {layer}")
    if scan == 32:  # a width the kernel cannot take is refused by name before anything runs
        monkeypatch.setattr(commit_module, "SCAN_BLOCK", 24)
        before = states.clone()
        with pytest.raises(ValueError, match="SCAN_BLOCK: expected None or a power of two >= 16, got 24"):
            tree_commit_layers(states, pools[0][1], results, tree, accepted)
        assert torch.equal(states, before)


EXTREME_GATES = {
    # a huge decay at the root, then small ones: the child's decays must keep their -0.01 (fp32 path sums did not)
    "root-minus-1e6-then-small": lambda g: (g.fill_(-0.01), g[0].fill_(-1e6)),
    "minus-3e38-twice": lambda g: (g.fill_(-0.5), g[0].fill_(-3e38), g[2].fill_(-3e38)),
    "minus-inf": lambda g: (g.fill_(-0.2), g[1].fill_(float("-inf"))),
    "all-minus-1e4": lambda g: g.fill_(-1e4),
}


@pytest.mark.parametrize("variant", ["fused", "resident", "serial"])
@pytest.mark.parametrize("case", list(EXTREME_GATES), ids=list(EXTREME_GATES))
def test_every_log_decay_below_zero_is_exact(device, case, variant):
    """The accepted range of g is every value <= 0: outputs and the commit stay finite and exact against the
    float64 recurrence (kernels.common.LOG_DECAY_FLOOR)."""
    tree = TreeBatch.from_parents([tree_parents(6, "chain"), [-1, 0, 0, 1, -1, 4]], device=device)
    x = make_inputs(tree, 1, 2, 32, 32, torch.float32, device, seed=3)
    x.beta.fill_(0.9)
    EXTREME_GATES[case](x.g)
    ref = verify_reference(*x.args(tree))
    verify = serial_verify if variant == "serial" else functools.partial(tree_verify, variant=variant)
    res = verify(*x.args(tree), out=poisoned_out(x, tree))
    assert_close(res.o, ref.o, TOLERANCE[torch.float32], "o")
    accepted = torch.tensor([5, 3], device=device)
    before = x.state.clone()
    tree_commit(x.state, x.state_indices, res, accepted)
    assert_close(x.state, ref.committed(before, x.state_indices, tree, accepted), TOLERANCE[torch.float32], "committed")
