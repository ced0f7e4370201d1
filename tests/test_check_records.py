"""The check records of results and pending paths (`result.stamp_result`, `result.stamp_paths`): a buffer checked
once is checked by its record on later calls, and any change that could make it unfit (a field replaced, a tensor
reshaped, restrided or resized in place) sends it through the full checks again, which name what is wrong.

CPU cases run the kernels under TRITON_INTERPRET=1 (tiny shapes), as the rest of the suite."""

import pytest
import torch

from bole_tune.kernels import PendingCommit, PendingPaths, tree_verify
from bole_tune.kernels.reference import verify_reference
from bole_tune.kernels.verify.result import (RESULT_POOL, TreeVerifyResult, checked_paths, checked_result,
                                             result_stamp_of)
from helpers import TOLERANCE, assert_close, empty_pool, small_case  # noqa: F401 (empty_pool: a fixture)

F32 = torch.float32


def case(device, seed=0):
    return small_case(device, seed)


pytestmark = pytest.mark.usefixtures("empty_pool")


def own_buffers(tree, x):
    """A result of the caller's own tensors (not the pool's), as an engine's ``out``."""
    n, b = tree.num_nodes, tree.num_requests
    dev = x.q.device
    return TreeVerifyResult(torch.empty(n, 2, 32, device=dev), torch.empty(n, 2, 32, device=dev),
                            torch.empty(n, 2, device=dev), torch.empty(n, 1, 32, device=dev), torch.empty(n, 1, device=dev),
                            torch.zeros(b, dtype=torch.int32, device=dev), None)


def key_of(tree, x):
    from bole_tune.kernels.verify.checks import check_verify_inputs

    shape = check_verify_inputs(*x.args(tree), None, None)
    return (shape.heads, tree.num_nodes, tree.num_requests, x.q.device)


def test_a_checked_out_keeps_its_record_and_its_answers(device):
    tree, x = case(device)
    out = own_buffers(tree, x)
    assert result_stamp_of(out) is None
    tree_verify(*x.args(tree), out=out)
    record = checked_result(out, key_of(tree, x))
    assert record is not None, "a checked out= buffer has no record"
    for _ in range(2):  # the record serves the next calls: same object, and the answers still right
        x.q.normal_()
        tree_verify(*x.args(tree), out=out)
        assert result_stamp_of(out) is record, "the record was made again although nothing changed"
        assert_close(out.o.float(), verify_reference(*x.args(tree)).o, TOLERANCE[F32], "o through a recorded out")


@pytest.mark.parametrize("change", ["resize_", "as_strided_", "field", "t_"])
def test_an_out_changed_after_its_check_is_refused(device, change):
    tree, x = case(device)
    out = own_buffers(tree, x)
    tree_verify(*x.args(tree), out=out)
    n = tree.num_nodes
    if change == "resize_":  # larger: a new allocation, the old address gone
        out.u.resize_(n + 3, 2, 32)
    elif change == "as_strided_":  # the same shape, no longer contiguous
        out.u.as_strided_((n, 2, 32), (1, n, 2 * n))
    elif change == "field":
        out.u = torch.empty(n - 1, 2, 32, device=x.q.device)
    else:  # the keys' copy transposed in place (a view op that moves the version counter)
        out.k.squeeze_(1).t_()
    with pytest.raises(ValueError, match=r"out\.(u|k)"):
        tree_verify(*x.args(tree), out=out)


def test_a_pending_result_changed_after_its_check_is_refused(device):
    tree, x = case(device)
    res = tree_verify(*x.args(tree))
    accepted = torch.tensor([2, 0], dtype=torch.int32, device=x.q.device)
    paths = PendingPaths(tree, accepted, torch.arange(2, dtype=torch.int32, device=x.q.device))
    out = own_buffers(tree, x)
    tree_verify(*x.args(tree), out=out, pending=PendingCommit(paths, res))
    assert checked_result(res, key_of(tree, x)) is not None, "the pending result was not recorded"
    assert checked_paths(paths, (tree.num_requests, x.q.device)) is not None, "the paths were not recorded"
    res.log_decay.resize_(tree.num_nodes + 1, 2)
    with pytest.raises(ValueError, match=r"pending\.result\.log_decay"):
        tree_verify(*x.args(tree), out=out, pending=PendingCommit(paths, res))


def test_pending_paths_changed_after_their_check_are_refused(device):
    tree, x = case(device)
    res = tree_verify(*x.args(tree))
    paths = PendingPaths(tree, torch.tensor([2, 0], dtype=torch.int32, device=x.q.device),
                         torch.arange(2, dtype=torch.int32, device=x.q.device))
    tree_verify(*x.args(tree), pending=PendingCommit(paths, res))
    paths.path_rows.resize_(2, 8)  # narrower than the tree's paths: the verify would read past each row
    with pytest.raises(ValueError, match=r"pending\.paths\.path_rows"):
        tree_verify(*x.args(tree), pending=PendingCommit(paths, tree_verify(*x.args(tree))))


def test_a_pending_result_must_be_whole_and_contiguous(device):
    """Fields the fold reads by row (log_decay, k_scale, committed) are checked like ``out``'s: a strided one is
    refused by name."""
    tree, x = case(device)
    res = tree_verify(*x.args(tree))
    n = tree.num_nodes
    res.k_scale = torch.empty(n, 2, device=x.q.device)[:, :1]  # the right shape, every other element
    paths = PendingPaths(tree, torch.tensor([1, 1], dtype=torch.int32, device=x.q.device),
                         torch.arange(2, dtype=torch.int32, device=x.q.device))
    with pytest.raises(ValueError, match=r"pending\.result\.k_scale"):
        tree_verify(*x.args(tree), pending=PendingCommit(paths, res))


def committed_reference(tree, x, accepted):
    """The pool after committing ``accepted`` (local nodes, one per request), from the float64 node-by-node states."""
    ref = verify_reference(*x.args(tree))
    expected = x.state.clone()
    for r, node in enumerate(accepted):
        expected[int(x.state_indices[r])] = ref.states[int(tree.offsets[r]) + node].to(F32)
    return expected


def test_a_commit_checks_a_verified_result_by_its_record(device, monkeypatch):
    """The commit takes a result a verify made or checked by its record (no field comparisons), and a result changed
    in place since (its version moved) through the full checks, which name the field."""
    from bole_tune.kernels import tree_commit
    from bole_tune.kernels.verify import checks

    tree, x = case(device, seed=3)
    accepted = [3, 6]
    res = tree_verify(*x.args(tree))

    def no_field_checks(*args, **kwargs):
        raise AssertionError("a recorded result was compared field by field")

    with monkeypatch.context() as m:
        m.setattr(checks, "factors_fit", no_field_checks)
        tree_commit(x.state, x.state_indices, res, torch.tensor(accepted, device=x.q.device))
    x_before = case(device, seed=3)[1]
    assert_close(x.state, committed_reference(tree, x_before, accepted), TOLERANCE[F32], "commit by record")
    res2 = tree_verify(*x.args(tree))
    n = tree.num_nodes
    res2.u.as_strided_((n, 2, 32), (1, n, 2 * n))  # the same shape, its rows no longer where the commit reads them
    before = x.state.clone()
    with pytest.raises(ValueError, match=r"res\.u: must be contiguous"):
        tree_commit(x.state, x.state_indices, res2, torch.tensor(accepted, device=x.q.device))
    assert torch.equal(x.state, before), "a refused commit wrote the pool"


def test_a_commit_of_a_result_without_record_checks_its_factors_not_its_outputs(device):
    """A result the caller assembled (no record) is compared field by field: the five fields the commit reads. Its
    outputs ``o`` are not read and not required."""
    from bole_tune.kernels import tree_commit

    tree, x = case(device, seed=4)
    accepted = [4, 0]
    verified = tree_verify(*x.args(tree))
    res = TreeVerifyResult(None, verified.u.clone(), verified.log_decay.clone(), verified.k.clone(),
                           verified.k_scale.clone(), torch.zeros(2, dtype=torch.int32, device=x.q.device), tree)
    assert result_stamp_of(res) is None
    x_before = case(device, seed=4)[1]
    tree_commit(x.state, x.state_indices, res, torch.tensor(accepted, device=x.q.device))
    assert_close(x.state, committed_reference(tree, x_before, accepted), TOLERANCE[F32], "commit without record")


def test_a_recycled_set_written_through_torch_is_checked_again_and_used(device):
    tree, x = case(device)
    first = tree_verify(*x.args(tree))
    used, version = first.o.data_ptr(), first.o._version
    first.o.zero_()  # the caller writes into its output (the six views share one version counter)
    assert first.u._version > version
    del first
    again = tree_verify(*x.args(tree))
    assert again.o.data_ptr() == used, "a set written through torch was not recycled"
    assert checked_result(again, key_of(tree, x)) is not None, "the recycled set's record is out of date"
    assert_close(again.o.float(), verify_reference(*x.args(tree)).o, TOLERANCE[F32], "o of the recycled set")


def test_a_recycled_set_reshaped_in_place_is_never_handed_out_again(device):
    tree, x = case(device)
    first = tree_verify(*x.args(tree))
    used = first.u.data_ptr()
    first.u.squeeze_().unsqueeze_(0)  # the same memory, another shape
    del first
    for _ in range(3):
        res = tree_verify(*x.args(tree))
        assert res.u.shape == (tree.num_nodes, 2, 32) and res.u.data_ptr() != used
    assert sum(entry[1] is None for sets in RESULT_POOL._sets.values() for entry in sets) == 1


def stacked(tree, x, layers=3):
    from bole_tune.kernels import LayerResults
    from bole_tune.shapes import HeadShape

    return LayerResults.empty(layers, tree, HeadShape(hk=1, hv=2, dk=32, dv=32), F32, x.q.device)


def test_a_layer_s_result_is_kept_and_checked_by_its_record(device):
    """`LayerResults.layer` hands out one object per layer: ``out=results.layer(l)`` round after round is checked by
    its record, with the round's tree, and each layer's answers land in its own slice of the stacked buffers."""
    tree, x = case(device)
    other_tree, y = case(device, seed=1)
    results = stacked(tree, x)
    first = results.layer(1, tree)
    assert results.layer(1, tree) is first and results.layer(0, tree) is not first
    tree_verify(*x.args(tree), out=results.layer(1, tree))
    record = result_stamp_of(first)
    assert record is not None and checked_result(first, key_of(tree, x)) is record
    assert other_tree.num_nodes == tree.num_nodes  # the same sizes, other parents
    for layer, (t, z) in enumerate([(tree, x), (other_tree, y), (tree, x)]):
        z.q.normal_()
        res = tree_verify(*z.args(t), out=results.layer(layer, t))
        assert res is results.layer(layer, t) and res.tree is t
        assert_close(results.o[layer].float(), verify_reference(*z.args(t)).o, TOLERANCE[F32], f"layer {layer}'s o")
    tree_verify(*x.args(tree), out=results.layer(1, tree))
    assert result_stamp_of(first) is record, "the kept layer's record was made again although nothing changed"
    assert results.layer(1).tree is None, "layer(l) without a tree must not show an earlier call's tree"


@pytest.mark.parametrize("change", ["field", "set_", "result-field"])
def test_a_layer_s_views_follow_the_stacked_tensors(device, change):
    """A stacked tensor replaced (a field assigned, or moved to other memory by ``set_``), or a field of the kept
    result replaced by its holder: the next ``layer`` call hands out views of what the stacked tensors are now."""
    tree, x = case(device)
    results = stacked(tree, x)
    kept = results.layer(2, tree)
    if change == "field":
        results.u = torch.zeros_like(results.u)
    elif change == "set_":
        results.u.set_(torch.zeros_like(results.u))
    else:
        kept.u = torch.zeros_like(kept.u)
    res = results.layer(2, tree)
    assert res.u.data_ptr() == results.u[2].data_ptr() and res.u.shape == results.u[2].shape
    tree_verify(*x.args(tree), out=res)
    assert_close(results.o[2].float(), verify_reference(*x.args(tree)).o, TOLERANCE[F32], "o after the change")
    assert_close(results.u[2], res.u, 0.0, "u lands in the stacked tensor")


@pytest.mark.parametrize("requests", [1, 2, 3, 5])
def test_a_layer_s_result_starts_on_16_byte_boundaries(device, requests):
    """`LayerResults.empty` pads each layer's marks to 16 bytes: with head counts that are multiples of 4 (every model
    profile's) each layer's six tensors are 16-byte aligned, so its launches are keyed as aligned ones (the short
    path: `launcher.misaligned` is None) and Triton specialises them as such."""
    from bole_tune.kernels import LayerResults
    from bole_tune.kernels.launcher import misaligned
    from bole_tune.shapes import HeadShape
    from bole_tune.workloads import make_tree

    tree = make_tree([3] * requests, "random", max_depth=8, seed=requests, device=device)
    results = LayerResults.empty(3, tree, HeadShape(hk=4, hv=8, dk=32, dv=32), torch.bfloat16, device)
    for layer in range(3):
        res = results.layer(layer, tree)
        pointers = tuple(x.data_ptr() for x in (res.o, res.u, res.log_decay, res.k, res.k_scale, res.committed))
        bits = 0
        for p in pointers:
            bits |= p
        assert misaligned(pointers, bits) is None, f"layer {layer} of {requests} requests: {[p % 16 for p in pointers]}"
        assert res.committed.is_contiguous() and res.committed.shape == (requests,)
    assert torch.equal(results.committed, torch.zeros(3, requests, dtype=torch.int32, device=device))
