"""Shared helpers of the tests: poisoned outputs, the reference comparison, and the result pool's small case."""

import pytest
import torch

from bole_tune.kernels import TreeVerifyResult
from bole_tune.kernels.verify.result import VerifyShape, release_result_pool, result_buffers
from bole_tune.shapes import HeadShape
from bole_tune.workloads import make_inputs, make_tree, relative_error

TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def poisoned_out(x, tree) -> TreeVerifyResult:
    """Output buffers filled with NaN, so a test sees any element the kernel did not write."""
    n, hk, dk = x.q.shape
    hv, dv = x.v.shape[1:]
    shape = VerifyShape(heads=HeadShape(hk=hk, hv=hv, dk=dk, dv=dv), num_nodes=n, num_requests=tree.num_requests,
                        num_slots=x.state.shape[0], scale=1.0)
    out = result_buffers(shape, x.q.dtype, x.q.device, tree, None)
    for name in ("o", "u", "log_decay", "k", "k_scale"):
        getattr(out, name).fill_(float("nan"))
    return out


def assert_close(actual, expected, tolerance, what):
    assert torch.isfinite(actual).all(), f"{what}: has NaN or inf (an element was not written?)"
    error = relative_error(actual, expected)
    assert error <= tolerance, f"{what}: relative error {error:.3e} > {tolerance:.0e}"
    return error


def small_case(device, seed, sizes=(5, 9)):
    """Random trees of at most depth 8 and fp32 inputs of one key head, two value heads, dk = dv = 32."""
    tree = make_tree(list(sizes), "random", max_depth=8, seed=seed, device=device)
    return tree, make_inputs(tree, 1, 2, 32, 32, torch.float32, device, seed=seed)


@pytest.fixture
def empty_pool():
    """The process's result pool emptied before and after a test (use it with ``pytestmark``)."""
    release_result_pool()
    yield
    release_result_pool()
