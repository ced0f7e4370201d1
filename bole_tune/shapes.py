"""The vocabulary every layer shares: head shapes, dtype names and the shape buckets.

One `HeadShape` names the recurrent core of a GDN layer wherever one is meant (kernels, database
keys, model profiles, benchmarks); one table maps dtype names to torch dtypes; one bucket
definition decides which tuned entry a batch and a tree size fall into.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
"""Key and value head sizes the kernels accept: powers of two that `tl.dot` tiles (>= 16)."""

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""Input dtypes by the name the database, the profiles and the command line use."""

TREE_BUCKETS = (8, 16, 32, 64, 128, 256)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)


def _positive_int(owner: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}.{name}: expected a positive int, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True, order=True)
class HeadShape:
    """The recurrent core of one GDN layer, per tensor-parallel rank.

    hk, hv: key and value heads (value head ``h`` reads key head ``h // (hv // hk)``);
    dk, dv: key and value head sizes.
    """

    hk: int
    hv: int
    dk: int
    dv: int

    def __post_init__(self):
        for name in ("hk", "hv", "dk", "dv"):
            _positive_int("HeadShape", name, getattr(self, name))
        if self.hv % self.hk:
            raise ValueError(f"HeadShape.hv: {self.hv} value heads are not a multiple of hk={self.hk} key heads")

    @property
    def label(self) -> str:
        return f"Hk{self.hk}-Hv{self.hv}-dk{self.dk}-dv{self.dv}"

    @property
    def group(self) -> int:
        """Value heads per key head."""
        return self.hv // self.hk

    def per_rank(self, tp: int) -> "HeadShape":
        """The heads one of ``tp`` tensor-parallel ranks holds (heads split evenly)."""
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or self.hk % tp or self.hv % tp:
            raise ValueError(f"tp: {self.hk} key and {self.hv} value heads cannot be split evenly over tp={tp!r} ranks")
        return HeadShape(hk=self.hk // tp, hv=self.hv // tp, dk=self.dk, dv=self.dv)

    def as_dict(self) -> dict:
        return {"hk": self.hk, "hv": self.hv, "dk": self.dk, "dv": self.dv}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"``; a dtype the kernels do not take is a ValueError."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype: {dtype} is not supported (use {', '.join(map(str, DTYPES.values()))})")


def torch_dtype(name: str) -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16``; an unknown name is a ValueError."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {name!r}") from None


def bucket(value: int, buckets) -> int:
    """The smallest bucket that holds ``value`` (the largest bucket for anything bigger)."""
    for b in buckets:
        if value <= b:
            return b
    return buckets[-1]


def tree_bucket(tree_size: int) -> int:
    return bucket(tree_size, TREE_BUCKETS)


def batch_bucket(batch: int) -> int:
    return bucket(batch, BATCH_BUCKETS)
