"""Triton kernels of bole-tune (installed as ``bole_tune.kernels``).

A leaf of the package: it imports torch, triton and the tree, shape and config types, nothing of the
tuning, database or measurement layers. The verify op lives in `verify/` (docs/math.md has its math);
the short convolution in `conv.py`, the gates in `gates.py`; the float64 references in `reference.py`.
"""

from .conv import tree_conv, tree_conv_commit
from .gates import gdn_gates
from .verify.planner import Launch, LaunchPolicy, Planner
from .verify.result import PendingCommit, PendingPaths, TreeVerifyResult, release_result_pool
from .verify.ring import PendingRing, RingRead, RingResults, RingRound
from .verify.serial_verify import serial_verify
from .verify.tree_commit import LayerResults, tree_commit, tree_commit_layers
from .verify.tree_verify import PLANNER, plan_launch, tree_verify

__all__ = ["LayerResults", "Launch", "LaunchPolicy", "PLANNER", "PendingCommit", "PendingPaths", "PendingRing", "Planner",
           "RingRead", "RingResults", "RingRound",
           "TreeVerifyResult", "gdn_gates", "plan_launch",
           "release_result_pool", "serial_verify", "tree_commit", "tree_commit_layers", "tree_conv", "tree_conv_commit", "tree_verify"]
