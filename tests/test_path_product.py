"""The path update's product on tensor cores in exact tf32 pieces (`blocks.path_product`) and the commit launches
built on it (`tree_commit.COMMIT_PRODUCT`), against float64 and the closed form."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from bole_tune.config import CommitConfig
from bole_tune.kernels import LayerResults, tree_commit, tree_commit_layers, tree_verify
from bole_tune.kernels.common import path_precision
from bole_tune.kernels.reference import commit_closed_form, verify_reference
from bole_tune.kernels.verify import tree_commit as tc
from bole_tune.kernels.verify.blocks import path_product, tf32_head
from bole_tune.shapes import HeadShape
from bole_tune.workloads import make_inputs, make_tree
from helpers import TOLERANCE, assert_close, relative_error

BF16 = torch.bfloat16


@triton.jit
def _product_kernel(acc_ptr, a_ptr, b_ptr, out_ptr, head_ptr, M: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                    PRODUCT: tl.constexpr):
    o_m, o_p, o_n = tl.arange(0, M), tl.arange(0, P), tl.arange(0, N)
    a = tl.load(a_ptr + o_m[:, None] * P + o_p[None, :])
    b = tl.load(b_ptr + o_p[:, None] * N + o_n[None, :]).to(tl.float32)
    acc = tl.load(acc_ptr + o_m[:, None] * N + o_n[None, :])
    tl.store(out_ptr + o_m[:, None] * N + o_n[None, :], path_product(acc, a, b, PRODUCT))
    tl.store(head_ptr + o_m[:, None] * P + o_p[None, :], tf32_head(a))


def _product(device, product, a, b, acc):
    out, head = torch.empty_like(acc), torch.empty_like(a)
    _product_kernel[(1,)](acc, a, b, out, head, M=a.shape[0], P=a.shape[1], N=b.shape[1], PRODUCT=product)
    return out, head


def test_tf32_head_is_a_tf32_value_and_leaves_an_exact_remainder(device):
    """The head keeps the sign, exponent and 10 mantissa bits (the 13 low bits cleared), so the tensor cores take
    it as it is; the remainder ``a - head`` is exact in fp32, and at most 2^-10 of ``a``."""
    g = torch.Generator().manual_seed(3)
    a = (torch.randn(16, 16, generator=g) * torch.logspace(-20, 20, 16)[:, None]).to(device)
    a[0, :4] = torch.tensor([1.0, -0.0, 2.0 ** -126, 3.0000002])
    _, head = _product(device, "split3", a, torch.zeros(16, 16, dtype=BF16, device=device),
                       torch.zeros(16, 16, device=device))
    bits = head.view(torch.int32)
    assert not bool((bits & 8191).any())
    rest = a.double() - head.double()
    assert bool((rest.float().double() == rest).all())  # the remainder is an fp32 number: a - head is exact
    assert bool((rest.abs() <= a.double().abs() * 2.0 ** -10).all())
    assert head[0, 0] == 1.0 and head[0, 3] == 3.0 and torch.equal(head[0, 3] + rest[0, 3].float(), a[0, 3])


@pytest.mark.parametrize("product", ["ieee", "split3", "split2"])
def test_path_product_matches_float64(device, product):
    """``acc + a @ b`` for fp32 weighted values and bf16 keys (each a tf32 value), with values over 40 orders of
    magnitude: within fp32's rounding of the float64 product (the interpreter multiplies in fp32: there the
    pieces must add back to ``a``; on a GPU the tensor cores' products of exact pieces are exact)."""
    g = torch.Generator().manual_seed(5)
    a = (torch.randn(32, 16, generator=g) * torch.logspace(-20, 20, 16)).to(device)
    b = torch.randn(16, 64, generator=g).to(BF16).to(device)
    acc = torch.randn(32, 64, generator=g).to(device)
    out, _ = _product(device, product, a, b, acc)
    want = acc.double() + a.double() @ b.double()
    scale = acc.double().abs() + a.double().abs() @ b.double().abs()  # the terms' magnitude, per element
    bound = {"ieee": 2.0 ** -21, "split3": 2.0 ** -21, "split2": 2.0 ** -19}[product]
    assert bool(((out.double() - want).abs() <= bound * 16 * scale).all())


def test_split_products_need_16_bit_keys():
    """fp32 keys are not tf32 values: a split product falls back for them; 16-bit keys keep it."""
    assert path_precision("split2", torch.float32, "ieee") == "ieee"
    assert path_precision("split3", torch.float32, "tf32x3") == "tf32x3"
    assert path_precision("split2", BF16, "ieee") == "split2"
    assert path_precision("split3", torch.float16, "ieee") == "split3"
    assert path_precision("tf32x3", torch.float32, "ieee") == "tf32x3"


@pytest.mark.parametrize("product,dtype", [("split2", BF16), ("split3", BF16), ("ieee", BF16),
                                           ("split2", torch.float16)], ids=["split2", "split3", "ieee", "split2-fp16"])
def test_commit_products_match_the_closed_form_and_the_reference(device, monkeypatch, product, dtype):
    """16-bit inputs (the split products run; fp16 keys, like bf16 ones, are tf32 values): one layer and three layers in one launch, programs of several tiles
    (v_span > b_v) and of one, a chain deeper than the 16 path nodes a pass gathers, a random tree, and a request
    that keeps its slot; against the closed form of the same factors (tight: the commit's own arithmetic), and for
    both trees against the float64 recurrence too (its reference taken from the slots before the commit writes
    them)."""
    monkeypatch.setattr(tc, "COMMIT_PRODUCT", product)
    tree = make_tree([20, 9, 6], "chain", seed=3, device=device)
    mixed = make_tree([7, 12, 5], "random", max_depth=8, seed=4, device=device)
    heads = HeadShape(hk=1, hv=2, dk=32, dv=32)
    for t, accepted in ((tree, [19, -1, 3]), (mixed, [6, 11, -1])):
        accepted = torch.tensor(accepted, device=device)
        for config in (CommitConfig(32, 16, 32, 2, 2), CommitConfig(16, 16, 16, 1, 1)):
            x = make_inputs(t, 1, 2, 32, 32, dtype, device, seed=9)
            res = tree_verify(*x.args(t), validate=False)
            want = verify_reference(*x.args(t)).committed(x.state, x.state_indices, t, accepted)
            closed = x.state.clone()
            commit_closed_form(closed, x.state_indices, res, accepted, validate=False)
            res.committed.zero_()
            tree_commit(x.state, x.state_indices, res, accepted, config=config)
            assert relative_error(x.state, closed) <= 1e-5, (config, relative_error(x.state, closed))
            assert_close(x.state, want, TOLERANCE[dtype] / 2, "committed")  # GPU: 4e-4..1e-3 (resident, bf16)
        # three layers in one launch
        results = LayerResults.empty(3, t, heads, dtype, device)
        pools, closed = [], []
        for layer in range(3):
            x = make_inputs(t, 1, 2, 32, 32, dtype, device, seed=20 + layer)
            if layer:
                x.state_indices.copy_(pools[0][1])
            tree_verify(*x.args(t), out=results.layer(layer), validate=False)
            want = x.state.clone()
            commit_closed_form(want, x.state_indices, results.layer(layer, t), accepted, validate=False)
            closed.append(want)
            pools.append((x.state, x.state_indices))
        results.committed.zero_()
        states = torch.stack([p for p, _ in pools])
        tree_commit_layers(states, pools[0][1], results, t, accepted, config=CommitConfig(32, 16, 32, 2, 2))
        for layer in range(3):
            assert relative_error(states[layer], closed[layer]) <= 1e-5, layer


def test_a_kept_slot_is_never_read_whatever_its_index(device):
    """The commit requests its first state tile before the path's loads, but only for requests that commit: a
    request that keeps its slot (-1) may carry any slot index (an engine's padding: -1 or past the pool) and is
    neither read nor written; the others commit as the closed form does."""
    tree = make_tree([6, 5, 4], "random", max_depth=8, seed=2, device=device)
    x = make_inputs(tree, 1, 2, 32, 32, BF16, device, seed=3)
    res = tree_verify(*x.args(tree), validate=False)
    accepted = torch.tensor([5, -1, 2], device=device)
    want = x.state.clone()
    commit_closed_form(want, x.state_indices, res, accepted, validate=False)
    res.committed.zero_()
    for bad in (-1, 1 << 30):
        pool = x.state.clone()
        slots = x.state_indices.clone()
        slots[1] = bad
        tree_commit(pool, slots, res, accepted, validate=False, config=CommitConfig(32, 16, 32, 2, 1))
        res.committed.zero_()
        assert relative_error(pool, want) <= 1e-5, bad
        kept = int(x.state_indices[1])
        assert torch.equal(pool[kept], x.state[kept])
