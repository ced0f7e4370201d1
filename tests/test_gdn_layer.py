"""The rest of the GDN layer on a tree: causal convolution, its commit, gate preparation."""

import pytest
import torch

from bole_tune import TreeBatch
from bole_tune.gdn_layer import GDNLayerParams, GDNStepResult, gdn_tree_commit, gdn_tree_step
from bole_tune.kernels import gdn_gates, tree_conv, tree_conv_commit
from bole_tune.shapes import HeadShape
from bole_tune.kernels.reference import tree_conv_commit_reference, tree_conv_reference
from bole_tune.workloads import make_tree, relative_error
from conftest import requires_gpu

F32, BF16 = torch.float32, torch.bfloat16


def conv_case(device, sizes, kind, channels, width, dtype, seed=0):
    tree = make_tree(sizes, kind, max_depth=5, seed=seed, device=device)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tree.num_nodes, channels, generator=g).to(device, dtype)
    state = torch.randn(2 * len(sizes) + 1, channels, width - 1, generator=g).to(device, dtype)
    weight = torch.randn(channels, width, generator=g).to(device, dtype)
    slots = torch.randperm(state.shape[0], generator=g)[: len(sizes)].to(device, torch.int32)
    return tree, x, state, weight, slots


@pytest.mark.parametrize("sizes, kind, channels, width, dtype", [
    ([1, 9, 30], "random", 40, 4, F32),
    ([12], "chain", 33, 4, F32),
    ([20, 3], "star", 64, 4, BF16),
    ([17, 8], "forest", 130, 4, F32),
    ([10], "chain", 16, 2, F32),
    ([7, 5], "random", 24, 3, F32),
], ids=["random-C40-W4-fp32", "chain-C33", "star-bf16", "forest-C130", "width2", "width3"])
def test_tree_conv_and_commit_match_the_reference(device, sizes, kind, channels, width, dtype):
    tree, x, state, weight, slots = conv_case(device, sizes, kind, channels, width, dtype)
    before = state.clone()
    out = torch.full_like(x, float("nan"))
    y = tree_conv(x, state, weight, slots, tree, out=out)
    assert y is out and torch.isfinite(y).all(), "an output element was not written"
    assert torch.equal(state, before), "tree_conv wrote the conv state"
    tolerance = 1e-2 if dtype == BF16 else 1e-5
    assert relative_error(y, tree_conv_reference(x, state, weight, slots, tree)) <= tolerance
    accepted = torch.tensor([s - 1 if i % 3 != 2 else -1 for i, s in enumerate(sizes)], device=device)
    ours, expected = state.clone(), state.clone()
    tree_conv_commit(ours, slots, x, tree, accepted)
    tree_conv_commit_reference(expected, slots, x, tree, accepted)
    assert torch.equal(ours, expected)
    named = set(slots.tolist())
    for slot in range(state.shape[0]):
        if slot not in named:
            assert torch.equal(ours[slot], before[slot]), f"slot {slot} changed"


def test_conv_and_its_commit_take_strided_slots_and_accepted_nodes_by_their_values(device):
    """Slots and accepted nodes given as strided views (every other element of a larger tensor) are their values:
    the kernels read them by index, so they are copied first (before, a view's neighbour in memory named the slot)."""
    tree, x, state, weight, slots = conv_case(device, [6, 4, 5], "random", 24, 4, F32, seed=2)
    accepted = torch.tensor([5, -1, 2], dtype=torch.int32, device=device)

    def strided(t, pad):
        return torch.stack([t, torch.full_like(t, pad)], 1).reshape(-1)[::2]

    assert relative_error(tree_conv(x, state, weight, strided(slots, 0), tree),
                          tree_conv_reference(x, state, weight, slots, tree)) <= 1e-5
    ours, expected = state.clone(), state.clone()
    tree_conv_commit(ours, strided(slots, 0), x, tree, strided(accepted, 0))
    tree_conv_commit_reference(expected, slots, x, tree, accepted)
    assert torch.equal(ours, expected)


def test_conv_window_reaches_into_the_committed_state(device):
    """A root's window is (state[-3], state[-2], state[-1], x): checked by hand, width 4."""
    tree = TreeBatch.from_parents([[-1, 0]], device=device)
    x = torch.tensor([[1.0], [2.0]], device=device)
    state = torch.tensor([[[10.0, 20.0, 30.0]]], device=device)
    weight = torch.tensor([[1000.0, 100.0, 10.0, 1.0]], device=device)
    y = tree_conv(x, state, weight, torch.tensor([0], device=device), tree, activation=None)
    assert y[0, 0].item() == pytest.approx(10 * 1000 + 20 * 100 + 30 * 10 + 1)
    assert y[1, 0].item() == pytest.approx(20 * 1000 + 30 * 100 + 1 * 10 + 2)
    tree_conv_commit(state, torch.tensor([0], device=device), x, tree, torch.tensor([1], device=device))
    assert state[0, 0].tolist() == [30.0, 1.0, 2.0]


def test_gates_match_transformers_formula(device):
    g_ = torch.Generator().manual_seed(1)
    a = (torch.randn(29, 6, generator=g_) * 12).to(device)
    b = (torch.randn(29, 6, generator=g_) * 4).to(device, BF16)
    a_log, dt_bias = torch.randn(6, generator=g_).to(device), torch.randn(6, generator=g_).to(device)
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    want_g = -a_log.exp() * torch.nn.functional.softplus(a + dt_bias)
    assert g.dtype == beta.dtype == F32
    assert relative_error(g, want_g) < 1e-6
    assert relative_error(beta, torch.sigmoid(b.float())) < 1e-6
    out = (torch.full_like(g, float("nan")), torch.full_like(g, float("nan")))
    written = gdn_gates(a, b, a_log, dt_bias, out=out)
    assert written[0] is out[0] and written[1] is out[1]
    assert torch.equal(out[0], g) and torch.equal(out[1], beta)  # the same launch, into the given buffers


@pytest.mark.parametrize("call, error, message", [
    (lambda t, x, s, w, i: tree_conv(x[:-1], s, w, i, t), ValueError, "x: expected shape"),
    (lambda t, x, s, w, i: tree_conv(x, s[:, :, :2], w, i, t), ValueError, "weight: expected shape"),
    (lambda t, x, s, w, i: tree_conv(x, s, w, i.float(), t), TypeError, "state_indices: dtype"),
    (lambda t, x, s, w, i: tree_conv(x, s, w, i + 100, t), ValueError, "slot index >= num_slots"),
    (lambda t, x, s, w, i: tree_conv(x.to(torch.int32), s, w, i, t), TypeError, "x: dtype"),
    (lambda t, x, s, w, i: tree_conv(x * float("nan"), s, w, i, t), ValueError, "x: contains NaN"),
    (lambda t, x, s, w, i: tree_conv(x, s, w, i, t, activation="gelu"), ValueError, "activation"),
    (lambda t, x, s, w, i: tree_conv(x, s.transpose(1, 2).contiguous().transpose(1, 2), w, i, t), ValueError,
     "contiguous"),
    (lambda t, x, s, w, i: tree_conv_commit(s, i, x, t, torch.tensor([99, 0])), ValueError, "accepted"),
    (lambda t, x, s, w, i: gdn_gates(x[:, :2], x[:, :3], w[:2, 0], w[:2, 1]), ValueError, "b: expected shape"),
    (lambda t, x, s, w, i: gdn_gates(x[:, :2], x[:, :2] * float("inf"), w[:2, 0], w[:2, 1]), ValueError,
     "b: contains NaN or inf"),
    (lambda t, x, s, w, i: gdn_gates(x[:, :2], x[:, :2], w[:3, 0], w[:2, 1]), ValueError, "a_log: expected shape"),
    (lambda t, x, s, w, i: gdn_gates(x[:, :2], x[:, :2], w[:2, 0], w[:2, 1], out=(x[:, :2], x[:, :2])), ValueError,
     r"out\[0\] \(g\): expected a contiguous float32 tensor of shape \(7, 2\)"),
    (lambda t, x, s, w, i: gdn_gates(x[:, :2], x[:, :2], w[:2, 0], w[:2, 1], out=(torch.zeros(7, 2),) * 2),
     ValueError, "out: g and beta must be two tensors"),
    (lambda t, x, s, w, i: gdn_gates(x[:, :2], x[:, :2], w[:2, 0], w[:2, 1], out=torch.zeros(7, 2)), TypeError,
     r"out: expected a \(g, beta\) pair"),
], ids=["rows", "width", "slot-dtype", "slot-range", "x-dtype", "nan", "activation", "strided-state",
        "accepted", "gate-shape", "gate-inf", "a-log-shape", "gate-out-strided", "gate-out-same", "gate-out-type"])
def test_bad_inputs_are_refused(call, error, message, monkeypatch):
    monkeypatch.setenv("BOLE_TUNE_VALIDATE", "1")  # values (slots, NaN, accepted) are checked when asked
    tree, x, state, weight, slots = conv_case("cpu", [4, 3], "random", 8, 4, F32)
    with pytest.raises(error, match=message):
        call(tree, x, state, weight, slots)


def test_layer_step_rejects_wrong_projection_width():
    tree = make_tree([3], device="cpu")
    params = GDNLayerParams(torch.zeros(8 * 3, 4), torch.zeros(2), torch.zeros(2),
                            heads=HeadShape(hk=1, hv=2, dk=4, dv=8))
    with pytest.raises(ValueError, match=r"mixed_qkv: expected shape \[N, 24\]"):
        gdn_tree_step(torch.zeros(3, 20), torch.zeros(3, 2), torch.zeros(3, 2), params, torch.zeros(1, 2, 8, 4),
                      torch.zeros(1, 24, 3), torch.zeros(1, dtype=torch.int32), tree)
    with pytest.raises(TypeError, match="step: expected the GDNStepResult"):
        gdn_tree_commit(torch.zeros(1, 2, 8, 4), torch.zeros(1, 24, 3), torch.zeros(1, dtype=torch.int32), None,
                        torch.zeros(1, dtype=torch.int32))


@requires_gpu
@pytest.mark.gpu
def test_gpu_conv_at_production_width():
    tree, x, state, weight, slots = conv_case("cuda", [64] * 4, "random", 2 * 16 * 128 + 32 * 128, 4, BF16)
    y = tree_conv(x, state, weight, slots, tree, out=torch.full_like(x, float("nan")))
    assert relative_error(y, tree_conv_reference(x, state, weight, slots, tree)) < 1e-2
    assert isinstance(GDNStepResult, type)
