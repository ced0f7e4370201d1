"""Exact against transformers' Qwen3.5 (its real classes, random weights) and lossless end to end."""

import pytest

pytest.importorskip("transformers", minversion="5.0", reason="transformers is the independent reference here")

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
