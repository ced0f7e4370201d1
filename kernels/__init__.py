"""Triton kernels of bole-tune (installed as ``bole_tune.kernels``)."""

from .common import TreeVerifyResult
from .serial_verify import serial_verify
from .tree_commit import tree_commit
from .tree_verify import tree_verify

__all__ = ["TreeVerifyResult", "serial_verify", "tree_commit", "tree_verify"]
