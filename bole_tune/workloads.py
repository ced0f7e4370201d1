"""Random proposal trees and GDN inputs for tests, benchmarks and the tuner's correctness gate."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from bole_tune.tree import TreeBatch

TREE_KINDS = ("random", "chain", "star", "forest")

MAX_TREE_SIZE = 4096
"""The most nodes per request the command line accepts (``--tree-size``): 16x the largest tuned bucket
(256). The kernels take any size; the bound keeps a typo from allocating for hours."""

MAX_BATCH = 1024
"""The most requests per batch the command line accepts (``--batch``): 32x the largest tuned bucket."""


def tree_parents(size: int, kind: str = "random", max_depth: int = 8, rng: random.Random | None = None) -> list[int]:
    """Local parent indices of one tree, in time linear in ``size``.

    random: node n hangs off a uniformly chosen earlier node of depth < ``max_depth``;
    chain: depth ``size - 1``; star: every node a child of the root; forest: several roots, each
    with a random subtree.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size: a tree needs at least one node, got {size!r}")
    rng = rng or random.Random(0)
    if kind == "chain":
        return [n - 1 for n in range(size)]
    if kind == "star":
        return [-1] + [0] * (size - 1)
    if kind not in ("random", "forest"):
        raise ValueError(f"kind: expected one of {TREE_KINDS}, got {kind!r}")
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
        raise ValueError(f"max_depth: expected a positive int (edges from a root), got {max_depth!r}")
    parents, depths = [-1], [0]
    eligible = [0]  # the nodes of depth < max_depth, in index order: kept as nodes are added, never rescanned
    root_chance = 0.15 if kind == "forest" else 0.0
    for n in range(1, size):
        if rng.random() < root_chance:
            p = -1
        else:
            p = rng.choice(eligible)
        parents.append(p)
        depths.append(0 if p < 0 else depths[p] + 1)
        if depths[n] < max_depth:
            eligible.append(n)
    return parents


def make_tree(sizes, kind: str = "random", max_depth: int = 8, seed: int = 0, device=None) -> TreeBatch:
    """A batch with one tree of each size in ``sizes``."""
    rng = random.Random(seed)
    return TreeBatch.from_parents([tree_parents(s, kind, max_depth, rng) for s in sizes], device=device)


@dataclass
class GDNInputs:
    """Arguments of `tree_verify` for one layer (state pool included)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    state: torch.Tensor
    state_indices: torch.Tensor

    def args(self, tree: TreeBatch) -> tuple:
        return (self.q, self.k, self.v, self.g, self.beta, self.state, self.state_indices, tree)


def make_inputs(tree: TreeBatch, hk: int, hv: int, dk: int, dv: int, dtype=torch.bfloat16, device=None,
                num_slots: int | None = None, g_range=(-2.0, 0.0), seed: int = 0, gate_dtype=torch.float32,
                state_scale: float = 0.1) -> GDNInputs:
    """Random inputs with the statistics of a real layer: unit-ish q, k, v; gates in range.

    Slots are a random permutation of a pool with spare slots, so tests see slots the batch never
    names. ``g_range`` bounds the log-decay; beta is uniform in [0, 1].
    """
    device = torch.device(device or tree.device)
    gen = torch.Generator(device=device).manual_seed(seed)
    n, b = tree.num_nodes, tree.num_requests
    num_slots = num_slots or 2 * b + 1

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, device=device)

    lo, hi = g_range
    slots = torch.randperm(num_slots, generator=gen, device=device)[:b]
    return GDNInputs(
        q=randn(n, hk, dk).to(dtype),
        k=randn(n, hk, dk).to(dtype),
        v=randn(n, hv, dv).to(dtype),
        g=(lo + (hi - lo) * rand(n, hv)).to(gate_dtype),
        beta=rand(n, hv).to(gate_dtype),
        state=state_scale * randn(num_slots, hv, dv, dk),
        state_indices=slots.to(torch.int32),
    )


def predicted_values(x: GDNInputs, tree: TreeBatch, residual: float = 0.03) -> torch.Tensor:
    """Values the committed state already predicts: ``v_i = P_i S_pre^T k_i + residual * v_i``.

    The regime of a trained model, where ``R = D_beta (V - D_P K S_pre)`` is a small difference of
    large terms, so the rounding of the state products shows in ``U`` (and in the committed state).
    Returned in ``x.v``'s dtype; q/k normalised as `tree_verify` does with ``use_qk_l2norm``.
    """
    hv = x.v.shape[1]
    k = x.k.double()
    kn = (k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(hv // k.shape[1], dim=1)
    offsets = tree.offsets.tolist()
    logp = torch.cat([tree.ancestor_mask(r, x.g.device).double() @ x.g[offsets[r]:offsets[r + 1]].double()
                      for r in range(tree.num_requests)])  # path cumsum of g, [N, Hv]
    request = torch.repeat_interleave(torch.arange(tree.num_requests, device=x.v.device), tree.offsets.diff())
    state = x.state[x.state_indices.long()[request]].double()  # [N, Hv, dv, dk]
    predicted = torch.einsum("nhvk,nhk->nhv", state, kn) * logp.exp()[..., None]
    return (predicted + residual * x.v.double()).to(x.v.dtype)


def relative_error(x: torch.Tensor, reference: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in float64 on the CPU; NaN anywhere in x gives inf."""
    x = x.detach().to("cpu", torch.float64)
    reference = reference.detach().to("cpu", torch.float64)
    if not torch.isfinite(x).all():
        return float("inf")
    denominator = reference.norm().item()
    return (x - reference).norm().item() / (denominator if denominator > 0 else 1.0)
