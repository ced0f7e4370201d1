"""Triton kernels of bole-tune (installed as ``bole_tune.kernels``)."""

from .common import TreeVerifyResult
from .gdn_gates import gdn_gates
from .serial_verify import serial_verify
from .tree_commit import tree_commit
from .tree_conv import tree_conv, tree_conv_commit
from .tree_verify import tree_verify

__all__ = ["TreeVerifyResult", "gdn_gates", "serial_verify", "tree_commit", "tree_conv", "tree_conv_commit",
           "tree_verify"]
