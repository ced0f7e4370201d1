"""The commit folded into the next verify: over several rounds, with requests joining and leaving, every
output and the final pool equal the float64 node-by-node recurrence run round after round."""

import dataclasses
import random

import pytest
import torch

from bole_tune.config import KernelConfig
from bole_tune.kernels import PendingCommit, PendingPaths, tree_commit, tree_verify
from bole_tune.kernels.reference import verify_reference
from bole_tune.workloads import make_inputs, make_tree
from helpers import TOLERANCE, assert_close

F32, BF16 = torch.float32, torch.bfloat16
NUM_SLOTS = 7

# id -> (variant, dtype, tree sizes per round (one list per round, one size per request), tree kind[, config])
CASES = {
    "fused-fp32-trees": ("fused", F32, [[5, 9, 1], [12, 3, 7, 2], [6, 6], [10, 1, 4]], "random"),
    "resident-bf16-trees": ("resident", BF16, [[9, 20], [17, 5, 3], [30, 2, 8], [4, 4]], "random"),
    "fused-fp32-multi-block-chains": ("fused", F32, [[70, 3], [66, 12], [5, 80]], "chain"),
    "resident-fp32-chains": ("resident", F32, [[4, 4, 4], [8, 3], [4, 6, 2]], "chain"),
    # the resident kernel streaming its one value tile first: in one step of whole key rows (the default tiles here,
    # b_k = dk = 32), and in key steps of 16 over two programs per head
    "stream-bf16-trees": ("stream", BF16, [[9, 20], [17, 5, 3], [4, 4]], "random"),
    "stream-key-steps-bf16-trees": ("stream", BF16, [[9, 20], [17, 5, 3], [4, 4]], "random", KernelConfig(16, 16, 4, 1)),
    # trees of at most 8 nodes: the stream launch on stacked rows (q and k in one 16-row tile)
    "stream-stacked-bf16-trees": ("stream", BF16, [[8, 3], [5, 2, 7], [4, 4], [1, 6]], "random"),
    "stream-stacked-key-steps-fp32-chains": ("stream", F32, [[8, 3, 1], [4, 8], [2, 6]], "chain",
                                             KernelConfig(16, 16, 4, 1)),
}


def accepted_of(rng, tree, r) -> int:
    """-1 (nothing), a root, the deepest node, or a random node: every length of path."""
    size = tree.sizes[r]
    depths = tree.node_depth[tree.offsets[r]:tree.offsets[r + 1]].tolist()
    choice = rng.choice(["none", "root", "deepest", "any"])
    if choice == "none":
        return -1
    if choice == "root":
        return 0
    if choice == "deepest":
        return max(range(size), key=depths.__getitem__)
    return rng.randrange(size)


@pytest.mark.parametrize("case", [*CASES, "fallback"], ids=[*CASES, "pytorch-fallback"])
def test_folded_commit_over_rounds_matches_the_recurrence(device, case, monkeypatch):
    if case == "fallback":  # off a GPU without the interpreter: the PyTorch closed form does the same
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        device, case = "cpu", "fused-fp32-trees"
    variant, dtype, rounds, kind, *config = CASES[case]
    rng = random.Random(7)
    pool = make_inputs(make_tree([1], device=device), 2, 4, 32, 32, dtype, device, num_slots=NUM_SLOTS).state
    truth = pool.clone()  # the reference pool, committed round by round (float64 inside each round)
    pending, pending_slots = None, None
    for index, sizes in enumerate(rounds):
        slots = torch.tensor(rng.sample(range(NUM_SLOTS), len(sizes)), dtype=torch.int32, device=device)
        tree = make_tree(sizes, kind, max_depth=8, seed=index, device=device)
        x = make_inputs(tree, 2, 4, 32, 32, dtype, device, seed=10 + index)
        if pending is not None:
            # requests whose slot is not in this round left: flush their pending path with tree_commit
            leaving = torch.tensor([s not in slots.tolist() for s in pending_slots.tolist()], device=device)
            tree_commit(pool, pending_slots, pending.result, torch.where(leaving, pending.paths.accepted, -1))
            pending = PendingCommit(PendingPaths.between_rounds(pending.paths.tree, pending.paths.accepted,
                                                                pending_slots, slots, NUM_SLOTS), pending.result)
        res = tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots, tree, variant=variant, pending=pending,
                          config=config[0] if config else None)
        ref = verify_reference(x.q, x.k, x.v, x.g, x.beta, truth, slots, tree)
        assert_close(res.o, ref.o, TOLERANCE[dtype], f"round {index} outputs")
        # the folded slots now hold the committed state of the previous round (the others are untouched)
        assert_close(pool[slots.long()], truth[slots.long()], TOLERANCE[F32], f"round {index} slots read")
        accepted = torch.tensor([accepted_of(rng, tree, r) for r in range(len(sizes))], device=device)
        truth = ref.committed(truth, slots, tree, accepted).float()
        pending = PendingCommit(PendingPaths(tree, accepted, torch.empty(0)), res)
        pending_slots = slots
    tree_commit(pool, pending_slots, pending.result, pending.paths.accepted)  # the final flush
    assert_close(pool, truth, TOLERANCE[F32], "pool after the final flush")


@pytest.mark.parametrize("case", ["stream-bf16-trees", "stream-key-steps-bf16-trees", "stream-stacked-bf16-trees"])
@pytest.mark.parametrize("verify_rows_first,fold_rows_first", [(True, False), (False, False)])
def test_stream_orders_over_rounds_match_the_recurrence(device, case, verify_rows_first, fold_rows_first, monkeypatch):
    """The stream launch's state products in either order (`run.ROWS_FIRST`; the shipped choice, the verify's
    ``Q S^T`` and the fold's ``S Q^T``, runs in the test above): the same rounds, the same recurrence."""
    from bole_tune.kernels.verify import run as run_module

    monkeypatch.setattr(run_module, "ROWS_FIRST", {"verify": verify_rows_first, "fold": fold_rows_first})
    test_folded_commit_over_rounds_matches_the_recurrence(device, case, monkeypatch)


def test_pending_mistakes_are_refused(device):
    tree = make_tree([5, 3], device=device)
    x = make_inputs(tree, 2, 4, 32, 32, F32, device)
    res = tree_verify(*x.args(tree))
    paths = PendingPaths.between_rounds(tree, torch.tensor([4, -1], device=device), x.state_indices,
                                        x.state_indices, x.state.shape[0])
    with pytest.raises(ValueError, match="out: shares memory with pending.result"):
        tree_verify(*x.args(tree), pending=PendingCommit(paths, res), out=res)
    with pytest.raises(TypeError, match="pending: expected a PendingCommit"):
        tree_verify(*x.args(tree), pending=(paths, res))
    short = PendingPaths(tree, paths.accepted, paths.request_map[:1])
    with pytest.raises(ValueError, match="pending.paths.request_map: expected shape"):
        tree_verify(*x.args(tree), pending=PendingCommit(short, res))
    bad = PendingPaths(tree, torch.tensor([9, 0], device=device), paths.request_map)
    with pytest.raises(ValueError, match="pending.paths.accepted: has an entry out of range"):
        tree_verify(*x.args(tree), pending=PendingCommit(bad, res), validate=True)
    narrow = PendingPaths(tree, paths.accepted, paths.request_map, paths.path_rows[:, :8])
    with pytest.raises(ValueError, match="pending.paths.path_rows: expected shape"):
        tree_verify(*x.args(tree), pending=PendingCommit(narrow, res))
    wide = PendingPaths(tree, paths.accepted, paths.request_map, paths.path_rows.long())
    with pytest.raises(TypeError, match="pending.paths.path_rows: expected a contiguous int32"):
        tree_verify(*x.args(tree), pending=PendingCommit(wide, res))
    # every field a fold reads is checked (the launch passes the tensors to the GPU as bare addresses)
    with pytest.raises(TypeError, match="pending.result.log_decay: dtype torch.float64"):
        tree_verify(*x.args(tree), pending=PendingCommit(paths, dataclasses.replace(res, log_decay=res.log_decay.double())))
    with pytest.raises(ValueError, match="pending.result.k: on device meta"):
        tree_verify(*x.args(tree), pending=PendingCommit(paths, dataclasses.replace(res, k=res.k.to("meta"))))
    strided = PendingPaths(tree, paths.accepted, torch.stack([paths.request_map, paths.request_map], 1)[:, 0],
                           paths.path_rows)
    with pytest.raises(ValueError, match="pending.paths.request_map: must be contiguous"):
        tree_verify(*x.args(tree), pending=PendingCommit(strided, res))


@pytest.mark.parametrize("how", ["kernel", "torch"])
@pytest.mark.parametrize("kind", ["random", "chain", "star", "forest"])
def test_path_rows_are_the_accepted_paths(device, kind, how, monkeypatch):
    """`PendingPaths.path_rows`, worked out on the device (one Triton launch, or torch operations without
    Triton), is each slot's root-to-accepted path as the tree's own parent walk gives it, by depth, -1 past it;
    nothing for a request that joined, accepted -1 or out of range. Trees up to 150 nodes: several search steps."""
    if how == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        device = "cpu"
    rng = random.Random(3)
    sizes = [rng.randrange(1, 30) for _ in range(5)] + [150]
    tree = make_tree(sizes, kind, max_depth=9, seed=5, device=device)
    accepted = [rng.randrange(size) for size in sizes]
    accepted[1], accepted[4] = -1, sizes[4]  # nothing accepted; out of range (refused only under validate)
    request_map = [3, -1, 0, 5, 1, 4, 2, 9]  # next round's requests: one joined, one mapped out of range
    paths = PendingPaths(tree, torch.tensor(accepted, device=device), torch.tensor(request_map, device=device))
    width = paths.path_rows.shape[1]
    assert width >= 16 and width & (width - 1) == 0 and width > tree.depth
    for r, prev in enumerate(request_map):
        expected = [-1] * width
        if 0 <= prev < len(sizes) and 0 <= accepted[prev] < sizes[prev]:
            path = tree.path_to(prev, accepted[prev])
            expected[:len(path)] = [int(tree.offsets[prev]) + node for node in path]
        assert paths.path_rows[r].tolist() == expected, f"request {r} (previous request {prev})"


def strided(values, pad, device):
    """``values`` as every other element of a larger int32 tensor (``pad`` between them): a strided 1-D view, as a
    column of an engine's table would be."""
    return torch.tensor([v for x in values for v in (x, pad)], dtype=torch.int32, device=device)[::2]


@pytest.mark.parametrize("how", ["kernel", "torch"])
def test_path_rows_of_strided_indices_are_those_of_their_values(device, how, monkeypatch):
    """``accepted``, ``request_map`` and `between_rounds`' slots given as strided views give the paths of their
    values (the kernel reads them by index: they are copied first; before, it read the storage's neighbours)."""
    if how == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        device = "cpu"
    tree = make_tree([6, 9, 4], "random", max_depth=5, seed=2, device=device)
    accepted, request_map = [3, 8, 0], [2, 0, -1, 1]
    plain = PendingPaths(tree, torch.tensor(accepted, device=device), torch.tensor(request_map, device=device))
    views = PendingPaths(tree, strided(accepted, 0, device), strided(request_map, 1, device))
    assert torch.equal(views.path_rows, plain.path_rows)
    assert (plain.path_rows[1] >= 0).sum() == len(tree.path_to(0, 3))  # a real path, not an empty table
    slots, following = [4, 1, 6], [6, 2, 4, 1]
    plain = PendingPaths.between_rounds(tree, torch.tensor(accepted, device=device), torch.tensor(slots, device=device),
                                        torch.tensor(following, device=device), 8)
    views = PendingPaths.between_rounds(tree, strided(accepted, 0, device), strided(slots, 7, device),
                                        strided(following, 7, device), 8)
    assert torch.equal(views.request_map, plain.request_map) and torch.equal(views.path_rows, plain.path_rows)
    assert plain.request_map.tolist() == [2, -1, 0, 1]


@pytest.mark.parametrize("path", ["kernel", "fallback"])
def test_committing_twice_is_a_no_op(device, path, monkeypatch):
    """A second tree_commit of the same result, or a fold of a path a flush already committed, changes nothing:
    each request's mark in the result says its path is in the pool."""
    if path == "fallback":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        device = "cpu"
    tree = make_tree([6, 4], device=device)
    x = make_inputs(tree, 2, 4, 32, 32, F32, device)
    res = tree_verify(*x.args(tree))
    assert res.committed.tolist() == [0, 0]
    accepted = torch.tensor([5, -1], device=device)
    tree_commit(x.state, x.state_indices, res, accepted)
    once = x.state.clone()
    tree_commit(x.state, x.state_indices, res, accepted)
    assert torch.equal(x.state, once)
    tree_commit(x.state, x.state_indices, res, torch.tensor([5, 2], device=device))  # request 1 not yet: commits
    assert not torch.equal(x.state, once) and res.committed.tolist()[0] != 0 and res.committed.tolist()[1] != 0
    twice = x.state.clone()
    paths = PendingPaths.between_rounds(tree, torch.tensor([5, 2], device=device), x.state_indices,
                                        x.state_indices, x.state.shape[0])
    tree_verify(*x.args(tree), pending=PendingCommit(paths, res))  # both paths already committed: no fold
    assert torch.equal(x.state, twice)
