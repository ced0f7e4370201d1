"""Runtime choice of the verifier's tile configuration (the tuning database plugs in here)."""

from __future__ import annotations

import torch

from bole_tune.config import KernelConfig, default_config


def config_for(shape, dtype: torch.dtype, tree, device: torch.device) -> KernelConfig:
    """The configuration `tree_verify(config=None)` launches with for this shape and device."""
    return default_config(shape.dk, shape.dv)
