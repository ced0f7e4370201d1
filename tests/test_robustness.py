"""Numerical robustness: long chains, extreme decays, large-norm queries and keys without L2 norm."""

import pytest
import torch

from bole_tune import TreeBatch
from bole_tune.kernels import tree_commit, tree_verify
from bole_tune.kernels.reference import verify_reference
from bole_tune.workloads import make_inputs, tree_parents
from helpers import TOLERANCE, assert_close, poisoned_out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chain_of_256_with_decays_down_to_minus_50(device, dtype):
    tree = TreeBatch.from_parents([tree_parents(256, "chain"), tree_parents(40, "random")], device=device)
    x = make_inputs(tree, 1, 2, 32, 32, dtype, device, g_range=(-50.0, 0.0), seed=11)
    x.g[::7] = 0.0
    x.g[3::11] = -50.0
    ref = verify_reference(*x.args(tree))
    res = tree_verify(*x.args(tree), out=poisoned_out(x, tree))
    assert_close(res.o, ref.o, TOLERANCE[dtype], "o")
    accepted = torch.tensor([255, 39], device=device)
    before = x.state.clone()
    tree_commit(x.state, x.state_indices, res, accepted)
    assert_close(x.state, ref.committed(before, x.state_indices, tree, accepted), TOLERANCE[dtype], "committed")


def test_large_norm_queries_and_keys_without_l2_norm(device):
    """q scaled 50x, keys of norm up to 1.4 (beta |k|^2 <= 2 keeps the delta rule itself stable)."""
    tree = TreeBatch.from_parents([tree_parents(256, "chain"), tree_parents(64, "random")], device=device)
    x = make_inputs(tree, 2, 4, 32, 32, torch.float32, device, g_range=(-1.0, 0.0), seed=12)
    x.q.mul_(50.0)
    x.k.div_(x.k.norm(dim=-1, keepdim=True)).mul_(1.4)
    ref = verify_reference(*x.args(tree), use_qk_l2norm=False, scale=1.0)
    res = tree_verify(*x.args(tree), use_qk_l2norm=False, scale=1.0, out=poisoned_out(x, tree))
    assert torch.isfinite(ref.o).all()
    assert_close(res.o, ref.o, 2e-3, "o")
