"""The direct launch path (kernels/launch.py): its key distinguishes what Triton specialises on, and on the
GPU the launches it makes give bit for bit the results of Triton's own path, misaligned inputs included."""

import pytest
import torch

from conftest import requires_gpu
from helpers import relative_error

from bole_tune.kernels import gdn_gates, tree_verify
from bole_tune.kernels.launch import _spec
from bole_tune.kernels.verify.run import LAUNCHERS
from bole_tune.workloads import make_inputs, make_tree


def test_key_separates_what_triton_specialises_on():
    base = torch.zeros(64)
    assert _spec(base) != _spec(base[1:])  # 16-byte aligned or not
    assert _spec(base) == _spec(torch.zeros(8))
    assert _spec(base) != _spec(base.to(torch.float16))
    assert _spec(1) != _spec(2) and _spec(16) != _spec(17) and _spec(32) == _spec(48)
    assert _spec(2 ** 31) != _spec(2 ** 31 - 16)  # 64-bit integers specialise apart
    assert _spec(True) != _spec(1)
    assert _spec(0.5) == _spec(2.0)


@requires_gpu
@pytest.mark.parametrize("batch,size", [(1, 4), (16, 64)])  # the fused and the resident kernel
def test_direct_launch_equals_triton_launch(monkeypatch, batch, size):
    tree = make_tree([size] * batch, "random", device="cuda", seed=3)
    x = make_inputs(tree, 16, 32, 128, 128, torch.bfloat16, "cuda", seed=3)
    monkeypatch.setenv("BOLE_TUNE_FAST_LAUNCH", "0")
    through_triton = tree_verify(*x.args(tree))
    monkeypatch.setenv("BOLE_TUNE_FAST_LAUNCH", "1")
    before = sum(launcher.direct for launcher in LAUNCHERS.values())
    for _ in range(3):
        direct = tree_verify(*x.args(tree))
    assert sum(launcher.direct for launcher in LAUNCHERS.values()) > before  # the path under test ran
    for name in ("o", "u", "log_decay", "k", "k_scale"):
        assert torch.equal(getattr(direct, name), getattr(through_triton, name)), name
    # a misaligned view of q (one element in) is another specialisation: still the same numbers
    q = torch.empty(x.q.numel() + 1, dtype=x.q.dtype, device="cuda")[1:].view_as(x.q)
    q.copy_(x.q)
    moved = tree_verify(q, *x.args(tree)[1:])
    assert relative_error(moved.o, through_triton.o) < 1e-6
    gates = (x.g.bfloat16(), x.beta.bfloat16(), torch.randn(32, device="cuda"), torch.randn(32, device="cuda"))
    monkeypatch.setenv("BOLE_TUNE_FAST_LAUNCH", "0")
    g, beta = gdn_gates(*gates)
    monkeypatch.setenv("BOLE_TUNE_FAST_LAUNCH", "1")
    for _ in range(2):
        g2, beta2 = gdn_gates(*gates)
    assert torch.equal(g, g2) and torch.equal(beta, beta2)
