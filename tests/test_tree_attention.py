"""Tree attention as the step model runs it (prefix/tree split merged by log-sum-exp; FlexAttention)
against the float64 masked softmax over the prefix and each node's ancestors."""

import pytest
import torch

from bole_tune.tree_attention import masked_attention, merge, prefix_attention, reference_tree_attention, tree_attention
from bole_tune.workloads import make_tree
from conftest import requires_gpu
from helpers import assert_close

F32, BF16 = torch.float32, torch.bfloat16

# id -> (tree sizes, kind, query heads, kv heads, head dim, context, dtype, tolerance)
CASES = {
    "B2-T7-random-G2-hd32-ctx24-fp32": ([7, 7], "random", 4, 2, 32, 24, F32, 1e-5),
    "B1-T1-G4-hd64-ctx40-bf16": ([1], "random", 8, 2, 64, 40, BF16, 1e-2),
    "B3-T12-chain-G1-hd16-ctx5-fp32": ([12] * 3, "chain", 2, 2, 16, 5, F32, 1e-5),
    "B2-T9-star-G8-hd32-ctx64-bf16": ([9, 9], "star", 8, 1, 32, 64, BF16, 1e-2),
}


def instance(device, sizes, kind, hq, hkv, hd, context, dtype, seed=0):
    tree = make_tree(sizes, kind, max_depth=8, seed=seed, device=device)
    mask = torch.stack([tree.ancestor_mask(r, device) for r in range(tree.num_requests)])
    g = torch.Generator(device=device).manual_seed(seed)
    b, t = len(sizes), sizes[0]

    def randn(*shape):
        return (torch.randn(*shape, generator=g, device=device) * 2).to(dtype)  # scores of a few units

    return (randn(b, hq, t, hd), randn(b, hkv, context, hd), randn(b, hkv, context, hd), randn(b, hkv, t, hd),
            randn(b, hkv, t, hd), mask)


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_split_matches_the_masked_softmax(device, case):
    *shape, tolerance = CASES[case]
    args = instance(device, *shape)
    out = tree_attention(*args, method="split")
    assert out.dtype == args[0].dtype and out.shape == args[0].shape
    assert_close(out, reference_tree_attention(*args), tolerance, "tree attention (split)")


def test_flex_matches_the_masked_softmax(device):
    *shape, tolerance = CASES["B2-T7-random-G2-hd32-ctx24-fp32"]
    args = instance(device, *shape, seed=3)
    assert_close(tree_attention(*args, method="flex"), reference_tree_attention(*args), tolerance, "flex")


def test_the_tree_part_sees_ancestors_only(device):
    """Changing the key of a node that is not an ancestor (a sibling, a descendant) changes nothing."""
    q, kc, vc, kt, vt, mask = instance(device, [3], "star", 2, 1, 16, 4, F32)  # nodes 1, 2 children of 0
    before = tree_attention(q, kc, vc, kt, vt, mask)
    kt[:, :, 2] += 5.0
    vt[:, :, 2] -= 3.0
    after = tree_attention(q, kc, vc, kt, vt, mask)
    assert torch.equal(before[:, :, :2], after[:, :, :2])
    assert not torch.allclose(before[:, :, 2], after[:, :, 2])


def test_merge_is_the_softmax_of_the_union(device):
    g = torch.Generator(device=device).manual_seed(5)
    q, k, v = (torch.randn(1, 2, 3, 8, generator=g, device=device) for _ in range(3))
    k2, v2 = (torch.randn(1, 2, 5, 8, generator=g, device=device) for _ in range(2))
    out_a, lse_a = prefix_attention(q, k, v, 0.5)
    out_b, lse_b = masked_attention(q, k2, v2, torch.ones(1, 1, 3, 5, dtype=torch.bool, device=device), 0.5)
    whole = torch.softmax(q @ torch.cat([k, k2], 2).transpose(-1, -2) * 0.5, -1) @ torch.cat([v, v2], 2)
    assert_close(merge(out_a, lse_a, out_b, lse_b), whole, 1e-5, "merged")


def test_bad_shapes_and_methods_are_refused():
    args = instance("cpu", [4], "random", 4, 2, 16, 8, F32)
    with pytest.raises(ValueError, match="method: expected one of"):
        tree_attention(*args, method="sdpa")
    with pytest.raises(ValueError, match="do not fit together"):
        tree_attention(args[0][:, :3], *args[1:])


@requires_gpu
@pytest.mark.parametrize("method", ["split", "flex"])
def test_production_shapes_on_the_gpu(method):
    """Qwen3.5-9B attention: 16 query / 4 KV heads, head dim 256, a 4096-token prefix, trees of 16 nodes."""
    args = instance("cuda", [16] * 2, "random", 16, 4, 256, 4096, BF16, seed=7)
    assert_close(tree_attention(*args, method=method), reference_tree_attention(*args), 1e-2, method)
