"""bole-tune: fast, exact tree speculative decoding on hybrid-attention LLMs."""

from bole_tune.config import KernelConfig
from bole_tune.tree import TreeBatch

__version__ = "0.1.0"

__all__ = ["KernelConfig", "TreeBatch", "__version__"]
