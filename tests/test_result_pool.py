"""The default call's recycled result buffers (`result.ResultPool`): a set comes back only when nothing holds it,
and a recycled set never shows an earlier call's values.

CPU cases run the kernels under TRITON_INTERPRET=1 (tiny shapes); the same tests run on the GPU, where the pool also
keys sets by stream and stays out of CUDA-graph capture (the GPU-only cases are skipped visibly without one).
"""

import gc

import pytest
import torch

from bole_tune.kernels import PendingCommit, PendingPaths, tree_commit, tree_verify
from bole_tune.kernels.reference import verify_reference
from bole_tune.kernels.verify.result import (RESULT_POOL, ResultPool, VerifyShape, pool_bytes_of_environment)
from bole_tune.shapes import HeadShape
from conftest import requires_gpu
from helpers import TOLERANCE, assert_close, empty_pool, small_case  # noqa: F401 (empty_pool: a fixture)

F32 = torch.float32


case = small_case
pytestmark = pytest.mark.usefixtures("empty_pool")


def pointers(res):
    return {res.o.data_ptr(), res.u.data_ptr(), res.log_decay.data_ptr(), res.k.data_ptr(), res.k_scale.data_ptr(),
            res.committed.data_ptr()}


def test_a_dropped_result_is_recycled_and_written_whole(device):
    tree, x = case(device, 0)
    first = tree_verify(*x.args(tree))
    used = pointers(first)
    for name in ("o", "u", "log_decay", "k", "k_scale"):  # what an earlier call left, poisoned
        getattr(first, name).fill_(float("nan"))
    first.committed.fill_(7)
    del first
    again = tree_verify(*x.args(tree))
    assert pointers(again) == used, "a result nothing holds was not recycled"
    ref = verify_reference(*x.args(tree))
    assert_close(again.o.float(), ref.o, TOLERANCE[F32], "recycled o")
    assert torch.isfinite(again.u).all() and torch.isfinite(again.log_decay).all()
    assert torch.isfinite(again.k_scale).all() and torch.equal(again.k, x.k)
    assert int(again.committed.abs().sum()) == 0, "a recycled result still marked as committed"


@pytest.mark.parametrize("hold", ["result", "tensor", "view", "pending"])
def test_a_held_result_is_never_overwritten(device, hold):
    tree, x = case(device, 1)
    first = tree_verify(*x.args(tree))
    kept = {"result": lambda r: r, "tensor": lambda r: r.o, "view": lambda r: r.o[1:3],
            "pending": lambda r: PendingCommit(PendingPaths(tree, torch.zeros(2, dtype=torch.int32, device=device),
                                                            torch.arange(2, dtype=torch.int32, device=device)), r)
            }[hold](first)
    before = first.o.clone()
    used = pointers(first)
    del first
    _, y = case(device, 2)  # other inputs on the same tree: a reuse would change the kept values
    second = tree_verify(*y.args(tree))
    assert not pointers(second) & used, f"a result still held through its {hold} was handed out again"
    held = {"result": lambda: kept.o, "tensor": lambda: kept, "view": lambda: kept,
            "pending": lambda: kept.result.o}[hold]()
    expected = before if hold != "view" else before[1:3]
    assert torch.equal(held, expected), f"the held {hold} changed"


def test_a_folded_default_call_never_writes_into_its_pending_result(device):
    """The default folded call (no ``out``): the pending result is held, so the call gets another set, and the
    folded round matches the reference through two rounds."""
    tree, x = case(device, 3)
    state0 = x.state.clone()
    res = tree_verify(*x.args(tree))
    accepted = torch.tensor([2, 4], dtype=torch.int32, device=device)
    paths = PendingPaths(tree, accepted, torch.arange(2, dtype=torch.int32, device=device))
    folded = tree_verify(*x.args(tree), pending=PendingCommit(paths, res))
    assert not pointers(folded) & pointers(res)
    q, k, v, g, beta, _, slots, _ = x.args(tree)
    committed = verify_reference(q, k, v, g, beta, state0, slots, tree).committed(state0, slots, tree, accepted).float()
    ref = verify_reference(q, k, v, g, beta, committed, slots, tree)
    assert_close(folded.o.float(), ref.o, TOLERANCE[F32], "folded o")
    assert_close(x.state[x.state_indices.long()], committed[x.state_indices.long()], 1e-4, "folded state")


def test_commit_of_a_recycled_result(device):
    """A recycled set's ``committed`` marks start at 0: its commit writes the state (an earlier call's marks would
    make the commit skip the requests)."""
    tree, x = case(device, 4)
    accepted = torch.tensor([4, 8], dtype=torch.int32, device=device)
    first = tree_verify(*x.args(tree))
    tree_commit(x.state.clone(), x.state_indices, first, accepted)  # marks ``committed`` with its epoch
    assert int(first.committed.abs().sum()) > 0
    del first
    state0 = x.state.clone()
    res = tree_verify(*x.args(tree))
    tree_commit(x.state, x.state_indices, res, accepted)
    q, k, v, g, beta, _, slots, _ = x.args(tree)
    expected = verify_reference(q, k, v, g, beta, state0, slots, tree).committed(state0, slots, tree, accepted).float()
    assert_close(x.state, expected, 1e-4, "state committed from a recycled result")


def heads_shape(n=6, b=2):
    return VerifyShape(HeadShape(hk=1, hv=2, dk=32, dv=32), n, b, 4, 1.0)


def test_limits_of_the_pool():
    shape = heads_shape()
    off = ResultPool(max_bytes=0)
    a = off.take(shape, F32, torch.device("cpu"))
    assert off.bytes == 0 and not off._sets, "a pool of 0 bytes kept a set"
    assert [tuple(t.shape) for t in a] == [(6, 2, 32), (6, 2, 32), (6, 2), (6, 1, 32), (6, 1), (2,)]
    few = ResultPool(max_bytes=2 ** 30, max_sets=2)
    held = [few.take(shape, F32, torch.device("cpu")) for _ in range(3)]
    assert len(few._sets[next(iter(few._sets))]) == 2, "more sets than max_sets"
    assert few.bytes > 0
    del held
    gc.collect()
    again = few.take(shape, F32, torch.device("cpu"))
    assert any(again[0].data_ptr() == s[0][0].data_ptr() for s in few._sets[next(iter(few._sets))])
    del again
    few.release()
    assert few.bytes == 0 and not few._sets


@pytest.mark.parametrize("text,expected", [("256", 256 * 2 ** 20), ("0", 0), ("0.5", 2 ** 19), ("-1", None),
                                           ("lots", None), ("nan", None), ("inf", None)])
def test_the_pool_size_of_the_environment(monkeypatch, text, expected):
    monkeypatch.setenv("BOLE_TUNE_RESULT_POOL_MB", text)
    if expected is None:
        with pytest.raises(ValueError, match="BOLE_TUNE_RESULT_POOL_MB"):
            pool_bytes_of_environment()
    else:
        assert pool_bytes_of_environment() == expected


def test_sets_are_aligned_and_do_not_overlap():
    pool = ResultPool(max_bytes=2 ** 30)
    bufs = pool.take(heads_shape(n=7, b=3), torch.bfloat16, torch.device("cpu"))
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in bufs)
    assert all(start % 256 == spans[0][0] % 256 for start, _ in spans), "a buffer off the 256-byte grid"
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:])), "two buffers of a set overlap"
    assert [t.dtype for t in bufs] == [torch.bfloat16, F32, F32, torch.bfloat16, F32, torch.int32]
    assert all(t.is_contiguous() for t in bufs)


def test_two_threads_never_take_one_set(monkeypatch):
    """Two threads taking a set on one stream at once get two sets: each finding the same set free before either
    holds it (a pause forced between the look and the hand-out) would have them write one set of buffers."""
    import threading
    import time

    from bole_tune.kernels.verify import result

    pool = ResultPool(max_bytes=2 ** 30)
    shape, cpu = heads_shape(n=7, b=3), torch.device("cpu")
    pool.take(shape, torch.float32, cpu)  # one set, dropped: free again
    looked = result._free

    def slow_free(buffers, baseline):
        free = looked(buffers, baseline)
        time.sleep(0.05)  # the other thread looks meanwhile
        return free

    monkeypatch.setattr(result, "_free", slow_free)
    taken = []

    def take():
        taken.append(pool.take(shape, torch.float32, cpu))

    threads = [threading.Thread(target=take) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(taken) == 2 and taken[0][0].data_ptr() != taken[1][0].data_ptr(), "two threads got one set"
    assert len(next(iter(pool._sets.values()))) == 2, "the free set was not reused by one of them"


def test_a_different_shape_gets_its_own_set(device):
    tree, x = case(device, 5)
    first = tree_verify(*x.args(tree))
    used = pointers(first)
    del first
    other, y = case(device, 5, sizes=(3, 4))
    res = tree_verify(*y.args(other))
    assert not pointers(res) & used and res.o.shape[0] == 7
    assert_close(res.o.float(), verify_reference(*y.args(other)).o, TOLERANCE[F32], "o")


@requires_gpu
def test_a_device_without_its_number_is_the_current_one():
    pool = ResultPool(max_bytes=2 ** 30)
    first = pool.take(heads_shape(), F32, torch.device("cuda"))
    assert first[0].device == torch.device("cuda", torch.cuda.current_device())
    used = first[0].data_ptr()
    del first
    assert pool.take(heads_shape(), F32, torch.device("cuda", torch.cuda.current_device()))[0].data_ptr() == used


@requires_gpu
def test_sets_stay_on_their_stream_and_out_of_graph_capture():
    tree, x = case("cuda", 6)
    first = tree_verify(*x.args(tree))
    used = pointers(first)
    del first
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        other = tree_verify(*x.args(tree))
    assert not pointers(other) & used, "a set made on one stream was handed out on another"
    torch.cuda.current_stream().wait_stream(side)
    del other
    graph = torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture):
        tree_verify(*x.args(tree))  # warm-up outside capture, on the capture stream
        sets_before = RESULT_POOL.bytes
        with torch.cuda.graph(graph, stream=capture):
            captured = tree_verify(*x.args(tree), validate=False)
    torch.cuda.current_stream().wait_stream(capture)
    assert RESULT_POOL.bytes == sets_before, "a set was made for a captured call"
    assert not any(captured.o.data_ptr() == s[0][0].data_ptr() for sets in RESULT_POOL._sets.values() for s in sets)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(captured.o.float(), verify_reference(*x.args(tree)).o, TOLERANCE[F32], "captured o")


def test_a_new_shape_makes_the_pool_forget_the_least_recently_used():
    one = ResultPool(max_bytes=2 ** 30)
    one.take(heads_shape(n=6), F32, torch.device("cpu"))
    nbytes = one.bytes  # one set of this size
    pool = ResultPool(max_bytes=2 * nbytes)  # room for two sets of this size
    cpu = torch.device("cpu")
    pool.take(heads_shape(n=6), F32, cpu)  # shape A
    pool.take(heads_shape(n=6, b=3), F32, cpu)  # shape B (same bytes but for committed's padding)
    pool.take(heads_shape(n=6), F32, cpu)  # A again (free, recycled): B is now the least recently used
    assert pool.bytes <= pool.max_bytes and len(pool._sets) == 2
    pool.take(heads_shape(n=6, b=4), F32, cpu)  # shape C: B is forgotten, A kept
    assert {key[:2] for key in pool._sets} == {(6, 2), (6, 4)}
    assert pool.bytes <= pool.max_bytes
    assert pool.bytes == sum(sets.nbytes for sets in pool._sets.values())
    too_big = pool.take(heads_shape(n=4000), F32, cpu)  # larger than the whole pool: fresh, nothing forgotten
    assert too_big[0].shape[0] == 4000 and {key[:2] for key in pool._sets} == {(6, 2), (6, 4)}


def test_a_free_set_among_many_held_is_found_before_a_new_one_is_made(device):
    """An engine keeps each layer's result for a round (24 held sets); the one set freed, wherever it lies, is
    recycled, and a loop that drops each result keeps reusing one set: the pool does not grow to its limit."""
    tree, x = case(device, 4)
    held = [tree_verify(*x.args(tree)) for _ in range(24)]
    key = next(iter(RESULT_POOL._sets))
    assert len(RESULT_POOL._sets[key]) == 24
    for layer in (17, 3, 23, 0, 11):  # each layer's result replaced in turn, in no particular order
        freed = pointers(held[layer])
        held[layer] = None
        held[layer] = tree_verify(*x.args(tree))
        assert pointers(held[layer]) == freed, f"layer {layer}: the one free set was not recycled"
    for _ in range(10):  # results dropped at once
        tree_verify(*x.args(tree))
    assert len(RESULT_POOL._sets[key]) == 25, "the pool made sets while one was free"
