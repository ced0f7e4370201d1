"""A GDN layer's whole tree step, from its input projections to its core output, and its commit.

The seed's per-layer pipeline (§IV-C): tree-parallel convolution (`tree_conv`) and gate preparation
(`gdn_gates`), then the Bole verifier (`tree_verify`: factor construction, solve and readout). The
commit writes the accepted path into both the recurrent state and the conv state.

Layouts follow transformers' ``Qwen3_5GatedDeltaNet``: the convolution runs over the concatenated
q/k/v projections ``[N, 2 * Hk * dk + Hv * dv]``; gates come from ``a``, ``b`` ``[N, Hv]`` with the
layer's ``A_log`` and ``dt_bias``. State pools: recurrent ``[slots, Hv, dv, dk]`` float32, conv
``[slots, channels, width - 1]`` (the last inputs, oldest first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bole_tune.config import KernelConfig
from bole_tune.kernels import (PendingCommit, TreeVerifyResult, gdn_gates, tree_commit, tree_conv, tree_conv_commit,
                               tree_verify)
from bole_tune.shapes import HeadShape
from bole_tune.tree import TreeBatch


@dataclass(frozen=True)
class GDNLayerParams:
    """What the tree step needs of one GDN layer's weights (beyond its linear projections)."""

    conv_weight: torch.Tensor  # [channels, width]
    a_log: torch.Tensor  # [Hv]
    dt_bias: torch.Tensor  # [Hv]
    heads: HeadShape

    @classmethod
    def from_transformers(cls, module) -> "GDNLayerParams":
        """From a transformers ``Qwen3_5GatedDeltaNet`` (or Qwen3-Next's) module."""
        return cls(conv_weight=module.conv1d.weight.detach().squeeze(1), a_log=module.A_log.detach(),
                   dt_bias=module.dt_bias.detach(),
                   heads=HeadShape(hk=module.num_k_heads, hv=module.num_v_heads, dk=module.head_k_dim,
                                   dv=module.head_v_dim))

    @property
    def channels(self) -> int:
        h = self.heads
        return 2 * h.hk * h.dk + h.hv * h.dv


@dataclass
class GDNStepResult:
    o: torch.Tensor  # [N, Hv, dv] core output, before the gated norm and output projection
    verify: TreeVerifyResult
    conv_inputs: torch.Tensor  # [N, channels], kept for the conv commit


def gdn_tree_step(mixed_qkv, a, b, params: GDNLayerParams, state, conv_state, state_indices, tree: TreeBatch,
                  config: KernelConfig | None = None, validate: bool | None = None, out: TreeVerifyResult | None = None,
                  pending: PendingCommit | None = None, ring=None) -> GDNStepResult:
    """Convolution, gates and verification of every tree node of one GDN layer.

    Args:
        mixed_qkv: ``[N, 2*Hk*dk + Hv*dv]`` the layer's ``in_proj_qkv`` output for every node.
        a, b: ``[N, Hv]`` its ``in_proj_a`` and ``in_proj_b`` outputs.
        state, conv_state: the recurrent and conv state pools (the conv pool is never written here; the
            recurrent one only with ``pending``).
        out, pending: passed to `tree_verify`: result buffers to write into, and the previous round's accepted
            paths of this layer, committed into the recurrent state in the verify's launch (then commit the
            conv state alone, `tree_conv_commit`, not `gdn_tree_commit`).
        ring: instead of ``pending``, a `PendingRing` round with this layer's arena (`tree_verify`'s ``ring``): the
            recurrent state is read through the ring's pending tokens (written every ``R``-th round); commit the
            conv state alone, and call the ring's ``end`` once per round for all layers.
    """
    if not isinstance(params, GDNLayerParams):
        raise TypeError(f"params: expected GDNLayerParams, got {type(params).__name__}")
    if not isinstance(mixed_qkv, torch.Tensor) or mixed_qkv.dim() != 2 or mixed_qkv.shape[1] != params.channels:
        shape = tuple(mixed_qkv.shape) if isinstance(mixed_qkv, torch.Tensor) else type(mixed_qkv).__name__
        raise ValueError(f"mixed_qkv: expected shape [N, {params.channels}] (2*Hk*dk + Hv*dv), got {shape}")
    n = mixed_qkv.shape[0]
    activated = tree_conv(mixed_qkv, conv_state, params.conv_weight, state_indices, tree, "silu", validate)
    h = params.heads
    key_width = h.hk * h.dk
    q = activated[:, :key_width].view(n, h.hk, h.dk)
    k = activated[:, key_width: 2 * key_width].view(n, h.hk, h.dk)
    v = activated[:, 2 * key_width:].view(n, h.hv, h.dv)
    g, beta = gdn_gates(a, b, params.a_log, params.dt_bias, validate)
    res = tree_verify(q, k, v, g, beta, state, state_indices, tree, scale=h.dk ** -0.5, use_qk_l2norm=True,
                      config=config, validate=validate, out=out, pending=pending, ring=ring)
    return GDNStepResult(o=res.o, verify=res, conv_inputs=mixed_qkv.detach().clone())


def gdn_tree_commit(state, conv_state, state_indices, step: GDNStepResult, accepted,
                    validate: bool | None = None) -> None:
    """Commit each request's accepted path into its recurrent state and its conv state, in place."""
    if not isinstance(step, GDNStepResult):
        raise TypeError(f"step: expected the GDNStepResult of gdn_tree_step, got {type(step).__name__}")
    tree_commit(state, state_indices, step.verify, accepted, validate=validate)
    tree_conv_commit(conv_state, state_indices, step.conv_inputs, step.verify.tree, accepted, validate=validate)
