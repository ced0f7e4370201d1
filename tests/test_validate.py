"""Exact against transformers' Qwen3.5 (its real classes, random weights) and lossless end to end."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the oldest transformers the project declares (pyproject.toml's floor): the check runs on it too
FLOOR = re.search(r'"transformers>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)

pytest.importorskip("transformers", minversion=FLOOR, reason=f"transformers >= {FLOOR} is the independent "
                    "reference here (older versions are refused by bole-tune validate with one line)")

from bole_tune import validate  # noqa: E402


def test_layer_step_equals_transformers_token_by_token(device):
    report = validate.validate_layers(validate.ModelSize(), device, trees=3, tree_size=14)
    assert report.passed, report.failures
    assert report.nodes == 42 and report.worst_output_error < 1e-4 and report.worst_state_error < 1e-4


def test_speculative_decoding_is_lossless(device):
    report = validate.validate_generation(validate.ModelSize(), device, prompts=3, new_tokens=200)
    assert report.passed, report.mismatches
    assert report.tokens == 600
    assert report.mean_accepted > 0.5, "the drafter should get some tokens accepted"


def test_a_wrong_commit_is_caught(device, monkeypatch):
    """The check must be able to fail: commit the parent instead of the accepted node."""
    from bole_tune import gdn_layer

    real = gdn_layer.gdn_tree_commit

    def off_by_one(state, conv_state, slots, step, accepted, validate=None):
        parents = step.verify.tree.parents.to(accepted.dtype)
        real(state, conv_state, slots, step, parents[accepted], validate)

    monkeypatch.setattr(validate, "gdn_tree_commit", off_by_one)
    report = validate.validate_layers(validate.ModelSize(), device, trees=1, tree_size=8)
    assert not report.passed


def test_the_oldest_declared_transformers_runs_the_check(tmp_path):
    """The layer check on the floor pyproject.toml declares (this session's transformers is the newest): a
    `pip install --no-deps --target` of exactly that version, cached, run in a subprocess."""
    target = Path(os.path.expanduser("~/.cache/bole-tune")) / f"transformers-{FLOOR}"
    if not (target / "transformers").is_dir():
        installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                                    f"transformers=={FLOOR}"], capture_output=True, text=True)
        assert installed.returncode == 0, installed.stderr[-1000:]
    code = ("import transformers; from bole_tune import validate; "
            "r = validate.validate_layers(validate.ModelSize(), 'cpu', trees=1); "
            "print(transformers.__version__, r.passed, r.worst_output_error)")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(ROOT)])}, timeout=600)
    assert ran.returncode == 0, ran.stderr[-2000:]
    version, passed, error = ran.stdout.split()[-3:]
    from packaging.version import Version

    assert Version(version) == Version(FLOOR) and passed == "True" and float(error) < 1e-4, ran.stdout


def test_a_transformers_without_the_cache_api_is_one_clear_error(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "DynamicCache", type("DynamicCache", (), {}))  # as before 5.21
    with pytest.raises(RuntimeError, match=f"transformers>={re.escape(FLOOR)}"):
        validate.validate_layers(validate.ModelSize(), "cpu", trees=1)
