"""The repository's top-level kernels/ folder (installed as bole_tune.kernels) must not be importable as `kernels` in
the test process: it would shadow Hugging Face's `kernels` package, which transformers >= 5.25 imports. conftest.py
takes the checkout's root off sys.path, whichever way pytest was started (`python -m pytest` puts it there)."""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_checkout_root_is_not_on_sys_path():
    assert all(Path(p or ".").resolve() != REPO for p in sys.path)


def test_kernels_is_not_the_repositorys_folder():
    spec = importlib.util.find_spec("kernels")
    origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    assert origin is None or not origin.is_relative_to(REPO / "kernels"), origin
