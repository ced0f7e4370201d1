"""Test setup: kernels run on the GPU where there is one, else under Triton's CPU interpreter.

TRITON_INTERPRET must be set before triton is imported, so it is set here, first.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
requires_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (full production shapes run on the H200)")


@pytest.fixture
def device():
    """The device the kernels run on in this session: cuda, or cpu through the interpreter."""
    return DEVICE


def pytest_report_header(config):
    if HAS_CUDA:
        return f"bole-tune: kernels on {torch.cuda.get_device_name()}"
    return "bole-tune: no GPU, kernels run under TRITON_INTERPRET=1 (GPU tests are skipped)"
