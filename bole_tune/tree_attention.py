"""Full attention of a proposal tree, as engines run it: every tree token over the cached prefix, and over
its own ancestors in the tree.

A verification step's full-attention layers see, for each request, ``T`` tree tokens whose queries attend
to the whole cached prefix (``context`` tokens) and to the tree tokens on their own root path. PyTorch's
``scaled_dot_product_attention`` with a boolean mask of that shape runs no flash kernel (on the H200 at 9B
attention shapes it took 245 us for 4 tree tokens against 24.9 us for one plain decode token), so timing
it that way charges an artifact to every speculated token. Engines do one of:

- ``"split"`` (SGLang's FA3 backend): a flash-attention pass of all tree tokens over the prefix that also
  returns each row's log-sum-exp, a small masked attention over the tree's own keys, and the two merged
  by their log-sum-exps. Exact: softmax over the union of two disjoint key sets.
- ``"flex"``: FlexAttention with a block mask (prefix all visible, the tree part the ancestor mask),
  compiled by ``torch.compile``.

`tree_attention` computes either (queries grouped per KV head, GQA), and `reference_tree_attention` is the
float64 masked softmax the tests hold them to. Shapes: q ``[B, Hq, T, hd]``, caches ``[B, Hkv, context,
hd]``, tree keys/values ``[B, Hkv, T, hd]``, ``tree_mask`` ``[B, T, T]`` bool (``[b, i, j]``: tree node j is
i or an ancestor of i).
"""

from __future__ import annotations

import functools

import torch

METHODS = ("split", "flex")


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, Hq, T, hd]`` -> ``[B, Hkv, group * T, hd]``: a KV head's query heads become extra rows."""
    b, hq, t, hd = q.shape
    return q.reshape(b, kv_heads, hq // kv_heads * t, hd)


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of ``q`` ``[B, H, L, hd]`` over ``k``, ``v`` ``[B, H, S, hd]`` and each row's
    log-sum-exp ``[B, H, L]`` float32, by PyTorch's flash-attention kernel (16-bit inputs on a GPU), its
    memory-efficient kernel (fp32 on a GPU; its log-sum-exp rows may be padded) or its CPU flash kernel."""
    if q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
    elif q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, scale=scale)[:2]
        lse = lse[..., :q.shape[2]]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)[:2]
    return out, lse


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` ``[B, H, L, hd]`` over a few keys ``[B, H, S, hd]`` under ``mask`` (broadcast to
    ``[B, H, L, S]``, every row with at least one key), in float32, with each row's log-sum-exp."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), v.float())
    return out, lse


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from the attention over each and its log-sum-exp."""
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a.float() * torch.exp(lse_a - lse)[..., None] + out_b.float() * torch.exp(lse_b - lse)[..., None]


def tree_attention(q, k_cache, v_cache, k_tree, v_tree, tree_mask, scale: float | None = None,
                   method: str = "split", block_mask=None) -> torch.Tensor:
    """Every tree token's attention over the cached prefix and its own tree ancestors; ``[B, Hq, T, hd]``
    in q's dtype (module docstring for shapes and methods). ``block_mask``: "flex" only, the tree's
    `flex_block_mask` when the caller keeps it across layers."""
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    b, hq, t, hd = q.shape
    kv_heads = k_cache.shape[1]
    if hq % kv_heads or k_tree.shape != (b, kv_heads, t, hd) or tuple(tree_mask.shape) != (b, t, t):
        raise ValueError(f"tree_attention: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, k_tree "
                         f"{tuple(k_tree.shape)}, tree_mask {tuple(tree_mask.shape)} do not fit together")
    scale = hd ** -0.5 if scale is None else scale
    if method == "flex":
        return _flex(q, k_cache, v_cache, k_tree, v_tree, tree_mask, scale, block_mask)
    group = hq // kv_heads
    qg = _grouped(q, kv_heads)
    out_p, lse_p = prefix_attention(qg, k_cache, v_cache, scale)
    mask = tree_mask[:, None, None].expand(b, 1, group, t, t).reshape(b, 1, group * t, t)
    out_t, lse_t = masked_attention(qg, k_tree, v_tree, mask, scale)
    return merge(out_p, lse_p, out_t, lse_t).to(q.dtype).reshape(b, hq, t, hd)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if torch.cuda.is_available() else flex_attention


def flex_block_mask(tree_mask: torch.Tensor, context: int, heads: int):
    """The FlexAttention block mask of a tree step: the prefix visible to every query, the tree part by
    ``tree_mask`` ``[B, T, T]``. Built once per tree (it is the round's topology, shared by every layer)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, t, _ = tree_mask.shape

    def visible(batch, head, query, key):
        tree_key = (key - context).clamp(min=0)
        return (key < context) | tree_mask[batch, query, tree_key]

    return create_block_mask(visible, B=b, H=None, Q_LEN=t, KV_LEN=context + t, device=tree_mask.device)


def _flex(q, k_cache, v_cache, k_tree, v_tree, tree_mask, scale, block_mask=None):
    keys = torch.cat([k_cache, k_tree], dim=2)
    values = torch.cat([v_cache, v_tree], dim=2)
    block_mask = block_mask or flex_block_mask(tree_mask, k_cache.shape[2], q.shape[1])
    return _compiled_flex()(q, keys, values, block_mask=block_mask, scale=scale, enable_gqa=True)


def reference_tree_attention(q, k_cache, v_cache, k_tree, v_tree, tree_mask, scale: float | None = None) -> torch.Tensor:
    """The float64 masked softmax over ``[prefix, tree]`` keys, node by node of the mask: the ground truth."""
    b, hq, t, hd = q.shape
    group = hq // k_cache.shape[1]
    scale = hd ** -0.5 if scale is None else scale
    keys = torch.cat([k_cache, k_tree], dim=2).double().repeat_interleave(group, dim=1)
    values = torch.cat([v_cache, v_tree], dim=2).double().repeat_interleave(group, dim=1)
    visible = torch.cat([torch.ones(b, t, k_cache.shape[2], dtype=torch.bool, device=q.device), tree_mask], dim=2)
    scores = (q.double() @ keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ values
