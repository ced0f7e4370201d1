"""Test setup: kernels run on the GPU where there is one, else under Triton's CPU interpreter.

TRITON_INTERPRET must be set before triton is imported, so it is set here, first.
"""

import os
import sys
from pathlib import Path

# The repository keeps the verifier in a top-level kernels/ folder (installed as bole_tune.kernels). With the
# checkout's root on sys.path, as `python -m pytest` run there puts it, that folder shadows Hugging Face's `kernels`
# package, which transformers >= 5.25 requires and imports (`from kernels import CUDAProperties, ...`): take the root
# off before anything imports transformers. The tests import the project as the installed bole_tune.
REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO_ROOT]

import torch  # noqa: E402

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
