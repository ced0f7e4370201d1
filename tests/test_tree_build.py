"""The device tree builder (`kernels/tree_build.py`) and `sglang_tree` on it, against the host-built TreeBatch.

On a CPU the kernel runs under TRITON_INTERPRET=1 (conftest.py); every check is exact (int32 equality).
"""

import random

import pytest
import torch

from conftest import HAS_CUDA, requires_gpu

import bole_tune.kernels.tree_build as tree_build
from bole_tune import TreeBatch
from bole_tune.acceptance import load_acceptance
from bole_tune.draft_trees import SGLangBeam
from bole_tune.engines.sglang import sglang_parents, sglang_tree
from bole_tune.kernels.tree_build import BLOCK_SIZES, MAX_KERNEL_TREE, build_tree_tables, tree_tables_torch

SIZES = (1, 2, 3, 4, 8, 16, 17, 33, 64, 100, 128)
FIELDS = ("offsets", "parents", "node_depth", "dfs_enter", "dfs_exit")


# --- trees (bole-tune convention: node 0 the root, -1; the others a local parent before them) -------------

def random_tree(size, rng):
    return [-1] + [rng.randrange(i) for i in range(1, size)]


def bushy_tree(size, rng):
    """Parents among the last few nodes: deep, with many siblings whose subtrees interleave in index order."""
    return [-1] + [max(0, i - 1 - rng.randrange(3)) for i in range(1, size)]


def chain(size, rng=None):
    return list(range(-1, size - 1))


def star(size, rng=None):
    return [-1] + [0] * (size - 1)


_BEAM = {}


def beam_tree(size, rng=None):
    """SGLang's verified tree of ``size`` draft tokens (5 steps of top-4 beam search; a chain below 2)."""
    if size < 2:
        return [-1]
    if "model" not in _BEAM:
        _BEAM["model"] = load_acceptance("qwen3.5-mtp-mbpp")
    steps, topk = (5, 4) if size <= 69 else (8, 8)
    tree = SGLangBeam(_BEAM["model"], steps, topk).tree(size)
    return [-1] + [p + 1 for p in tree.parents]


KINDS = (random_tree, bushy_tree, chain, star, beam_tree)


def mixed_batch(size, rng, count=None):
    """One tree of every kind (plus extra random ones), shuffled: every request of a batch has ``size`` nodes."""
    trees = [kind(size, rng) for kind in KINDS] + [random_tree(size, rng) for _ in range(count or 0)]
    rng.shuffle(trees)
    return trees


def parent_table(trees, device, dtype=torch.int32, root_entry=99):
    table = torch.tensor([sglang_parents(p) for p in trees], dtype=dtype)
    table[:, 0] = root_entry  # node 0's entry is never read
    return table.to(device)


def assert_tables_equal(got, trees, what=""):
    want = TreeBatch.from_parents(trees)
    for name in FIELDS:
        actual = getattr(got, name)
        assert actual.dtype == torch.int32, f"{what}{name}: dtype {actual.dtype}"
        assert torch.equal(actual.cpu(), getattr(want, name)), f"{what}{name}: {actual.tolist()}"
    blocks = got.block_depths if isinstance(got, tree_build.TreeTables) else {b: got.block_depths(b) for b in
                                                                                   BLOCK_SIZES}
    for block in BLOCK_SIZES:
        table, count = blocks[block]
        want_table, want_count = want.block_depths(block)
        assert count == want_count, f"{what}block {block}: {count} blocks, want {want_count}"
        assert table.dtype == torch.int32 and table.shape == want_table.shape, f"{what}block {block}"
        assert torch.equal(table.cpu(), want_table), f"{what}block {block}: {table.tolist()} != {want_table.tolist()}"


@pytest.fixture
def kernel_only(monkeypatch, device):
    """Fail if the torch fallback runs: the test checks the kernel itself."""
    def refuse(table):
        raise AssertionError("tree_tables_torch ran where the kernel should have")
    monkeypatch.setattr(tree_build, "tree_tables_torch", refuse)
    return device


# --- the kernel ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", SIZES)
def test_kernel_matches_host_tree(size, kernel_only):
    rng = random.Random(size)
    trees = mixed_batch(size, rng, count=2)
    got = build_tree_tables(parent_table(trees, kernel_only))
    assert_tables_equal(got, trees, f"T={size}: ")


def test_kernel_one_request_and_int64_table(kernel_only):
    rng = random.Random(11)
    for size in (1, 5, 64):
        trees = [bushy_tree(size, rng)]
        got = build_tree_tables(parent_table(trees, kernel_only, dtype=torch.int64))
        assert_tables_equal(got, trees, f"int64 T={size}: ")


def test_kernel_reads_a_strided_table(kernel_only):
    """A column slice of a wider buffer (row stride != T) and a transposed view (column stride != 1)."""
    rng = random.Random(5)
    trees = mixed_batch(20, rng)
    wide = torch.full((len(trees), 31), 77, dtype=torch.int32)
    wide[:, 3:23] = parent_table(trees, "cpu")
    got = build_tree_tables(wide[:, 3:23].to(kernel_only))
    assert_tables_equal(got, trees, "row-strided: ")
    transposed = parent_table(trees, "cpu").t().contiguous().to(kernel_only).t()
    assert transposed.stride(1) != 1
    assert_tables_equal(build_tree_tables(transposed), trees, "transposed: ")


def test_invalid_parents_are_clamped_as_before(kernel_only):
    """A parent >= i reads as i - 1, a negative one as 0 (the torch code's defensive clamp), node 0's entry is
    not read: equal to the torch path and to the host tree of the clamped parents."""
    size = 20
    rng = random.Random(9)
    raw = torch.tensor([[rng.randrange(-5, 40) for _ in range(size)] for _ in range(4)], dtype=torch.int64)
    raw[0, 5] = 2 ** 40  # far beyond int32
    raw[1, 7] = -(2 ** 40)
    clamped = [[-1] + [min(max(int(raw[r, i]), 0), i - 1) for i in range(1, size)] for r in range(raw.shape[0])]
    got = build_tree_tables(raw.to(kernel_only))
    assert_tables_equal(got, clamped, "clamped: ")
    for dtype in (torch.int64, torch.int32):
        small = raw.clamp(-5, 40).to(dtype)
        clamped_small = [[-1] + [min(max(int(small[r, i]), 0), i - 1) for i in range(1, size)]
                         for r in range(small.shape[0])]
        assert_tables_equal(build_tree_tables(small.to(kernel_only)), clamped_small, f"{dtype}: ")


def test_torch_path_matches_host_tree(device):
    """The fallback (trees above MAX_KERNEL_TREE, CPU without the interpreter): the same tables."""
    rng = random.Random(4)
    for size in (1, 3, 17, 33, MAX_KERNEL_TREE + 2):
        trees = mixed_batch(size, rng)
        assert_tables_equal(tree_tables_torch(parent_table(trees, device)), trees, f"torch T={size}: ")
    big = mixed_batch(MAX_KERNEL_TREE + 2, rng)
    assert_tables_equal(build_tree_tables(parent_table(big, device)), big, "over the kernel's limit: ")


@pytest.mark.skipif(HAS_CUDA, reason="the CPU without the interpreter")
def test_cpu_without_interpreter_falls_back(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    called = []
    original = tree_build.tree_tables_torch
    monkeypatch.setattr(tree_build, "tree_tables_torch", lambda table: called.append(1) or original(table))
    trees = mixed_batch(9, random.Random(2))
    assert_tables_equal(build_tree_tables(parent_table(trees, "cpu")), trees, "fallback: ")
    assert called


def test_bad_tables_refused(device):
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        build_tree_tables(torch.zeros(4, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="T = 0"):
        build_tree_tables(torch.zeros(2, 0, dtype=torch.int32, device=device))
    with pytest.raises(TypeError):
        build_tree_tables([[0, 0]])


# --- sglang_tree on it -----------------------------------------------------------------------------------

@pytest.mark.parametrize("size", (1, 4, 33, 64))
def test_sglang_tree_on_the_kernel(size, kernel_only):
    rng = random.Random(100 + size)
    trees = mixed_batch(size, rng)
    tree = sglang_tree(parent_table(trees, kernel_only))
    assert tree.sizes == (size,) * len(trees) and tree.depth == size - 1
    assert tree.device.type == torch.device(kernel_only).type
    assert_tables_equal(tree, trees, f"sglang_tree T={size}: ")
    assert sglang_tree(parent_table(trees, kernel_only), max_depth=2).depth == min(2, size - 1)


@requires_gpu
def test_sglang_tree_in_a_cuda_graph():
    """Captured once, replayed on new parents written into the same buffer: no host sync, right trees."""
    rng = random.Random(21)
    size = 64
    first = mixed_batch(size, rng, count=3)
    table = parent_table(first, "cuda")
    sglang_tree(table)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tree = sglang_tree(table)
    for _ in range(3):
        trees = mixed_batch(size, rng, count=3)
        table.copy_(parent_table(trees, "cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert_tables_equal(tree, trees, "graph replay: ")
