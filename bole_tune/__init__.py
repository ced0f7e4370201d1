"""bole-tune: fast, exact tree speculative decoding on hybrid-attention LLMs."""

from bole_tune.config import KernelConfig
from bole_tune.tree import TreeBatch

__version__ = "0.1.0"

__all__ = ["KernelConfig", "TreeBatch", "__version__", "get_budget", "budget_lookup_cost_ns"]

_LAZY = {"get_budget", "budget_lookup_cost_ns"}


def __getattr__(name: str):
    """`get_budget` and `budget_lookup_cost_ns` from `bole_tune.budget`, imported on first use so that
    ``import bole_tune.kernels`` never loads the database layer."""
    if name in _LAZY:
        from bole_tune import budget

        return getattr(budget, name)
    raise AttributeError(f"module 'bole_tune' has no attribute {name!r}")
