"""Inputs on a GPU other than the current one: Triton launches a kernel on the current device, and the kept-binary
launches pass bare addresses, so each public call runs itself under ``torch.cuda.device`` of its inputs
(`common.other_cuda_device`). The GPU test needs two GPUs: the inputs on ``cuda:1`` while ``cuda:0`` is current, every
call's answer against the float64 reference (or the same call made with ``cuda:1`` current), and the current device
left as it was."""

import pytest
import torch

from bole_tune.kernels import (LayerResults, PendingCommit, PendingPaths, PendingRing, gdn_gates, serial_verify,
                               tree_commit, tree_commit_layers, tree_conv, tree_conv_commit, tree_verify)
from bole_tune.kernels import common
from bole_tune.kernels.reference import tree_conv_reference, verify_reference
from bole_tune.kernels.tree_build import build_tree_tables
from bole_tune.shapes import HeadShape
from bole_tune.workloads import make_inputs, make_tree, relative_error
from helpers import TOLERANCE, assert_close

F32 = torch.float32
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
requires_two_gpus = pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA GPUs (inputs on cuda:1 while cuda:0 is "
                                                            "current); run on a machine of two or more GPUs")


class _OnGPU:
    """A stand-in for a tensor on CUDA device ``index`` (what `other_cuda_device` reads of a tensor)."""

    is_cuda = True

    def __init__(self, index):
        self.index = index
        self.device = f"cuda:{index}"

    def get_device(self):
        return self.index


def test_other_cuda_device_names_a_device_other_than_the_current_one(monkeypatch):
    monkeypatch.setattr(common, "_cuda_get_device", lambda: 0)
    assert common.other_cuda_device(_OnGPU(1)) == "cuda:1"
    assert common.other_cuda_device(_OnGPU(0)) is None
    assert common.other_cuda_device(torch.zeros(1)) is None  # a CPU tensor: nothing to switch


@requires_two_gpus
def test_calls_with_inputs_on_another_gpu_than_the_current_one():
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    tree = make_tree([5, 9, 3], "random", max_depth=6, seed=2, device=dev)
    x = make_inputs(tree, 2, 4, 32, 32, F32, dev, seed=2)
    ref = verify_reference(*x.args(tree))
    res = tree_verify(*x.args(tree))
    assert torch.cuda.current_device() == 0, "a call left another device current"
    assert res.o.device == dev
    assert_close(res.o, ref.o, TOLERANCE[F32], "tree_verify on cuda:1")
    assert_close(serial_verify(*x.args(tree)).o, ref.o, TOLERANCE[F32], "serial_verify on cuda:1")

    accepted = torch.tensor([4, -1, 2], dtype=torch.int32, device=dev)
    expected = x.state.clone()
    for r, node in enumerate(accepted.tolist()):
        if node >= 0:
            expected[int(x.state_indices[r])] = ref.states[int(tree.offsets[r]) + node].to(F32)
    pool = x.state.clone()
    tree_commit(pool, x.state_indices, res, accepted)
    assert_close(pool, expected, TOLERANCE[F32], "tree_commit on cuda:1")

    layers = LayerResults.empty(2, tree, HeadShape(hk=2, hv=4, dk=32, dv=32), F32, dev)
    for layer in range(2):
        tree_verify(*x.args(tree), out=layers.layer(layer))
    pools = torch.stack([x.state.clone(), x.state.clone()])
    tree_commit_layers(pools, x.state_indices, layers, tree, accepted)
    assert_close(pools[1], expected, TOLERANCE[F32], "tree_commit_layers on cuda:1")

    # the next round folds this one's paths (computed on cuda:1) into the slots it reads; a result of its own (a
    # committed result's paths are not committed again)
    paths = PendingPaths.between_rounds(tree, accepted, x.state_indices, x.state_indices, x.state.shape[0])
    folded_pool = x.state.clone()
    folded = tree_verify(x.q, x.k, x.v, x.g, x.beta, folded_pool, x.state_indices, tree,
                         pending=PendingCommit(paths, tree_verify(*x.args(tree))))
    assert_close(folded_pool, expected, TOLERANCE[F32], "the fold's committed slots on cuda:1")
    with torch.cuda.device(1):
        same = tree_verify(x.q, x.k, x.v, x.g, x.beta, expected, x.state_indices, tree)
    assert_close(folded.o, same.o, TOLERANCE[F32], "the folded verify's outputs on cuda:1")

    ring = PendingRing(x.state.shape[0], 2, 7, capacity=tree.num_nodes, max_requests=3, device=dev)
    ring.end(ring.begin(tree), x.state_indices, accepted)
    assert ring.count[x.state_indices.long()].tolist() == [len(tree.path_to(0, 4)), 0, len(tree.path_to(2, 2))]

    parent_table = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 2]], dtype=torch.int32, device=dev)
    built = build_tree_tables(parent_table)
    with torch.cuda.device(1):
        want_tables = build_tree_tables(parent_table)
    for name in ("offsets", "parents", "node_depth", "dfs_enter", "dfs_exit"):
        assert torch.equal(getattr(built, name), getattr(want_tables, name)), f"build_tree_tables' {name} on cuda:1"
    assert built.node_depth.tolist() == [0, 1, 2, 2, 0, 1, 1, 2]

    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(tree.num_nodes, 4, generator=gen).to(dev), torch.randn(tree.num_nodes, 4, generator=gen).to(dev)
    a_log, dt_bias = torch.randn(4, generator=gen).to(dev), torch.randn(4, generator=gen).to(dev)
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    assert_close(g, -a_log.exp() * torch.nn.functional.softplus(a + dt_bias), 1e-5, "gdn_gates on cuda:1")
    assert_close(beta, torch.sigmoid(b), 1e-5, "gdn_gates' beta on cuda:1")

    xs = torch.randn(tree.num_nodes, 24, generator=gen).to(dev)
    conv_state = torch.randn(x.state.shape[0], 24, 3, generator=gen).to(dev)
    weight = torch.randn(24, 4, generator=gen).to(dev)
    y = tree_conv(xs, conv_state, weight, x.state_indices, tree)
    assert relative_error(y, tree_conv_reference(xs, conv_state, weight, x.state_indices, tree)) <= 1e-5
    with torch.cuda.device(1):
        want = conv_state.clone()
        tree_conv_commit(want, x.state_indices, xs, tree, accepted)
    got = conv_state.clone()
    tree_conv_commit(got, x.state_indices, xs, tree, accepted)
    assert torch.equal(got, want)
    assert torch.cuda.current_device() == 0, "a call left another device current"
