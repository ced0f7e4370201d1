"""Plain PyTorch implementations: the float64 ground truth and the dense closed form.

`verify_reference` runs the recurrence node by node in float64 (docs/math.md §1) and keeps every
node's state: it is the ground truth of the tests, of the tuner's correctness gate and of the resident
kernel's self-check. `verify_closed_form` / `commit_closed_form` evaluate the closed form (docs/math.md
§2, §4) with dense tensors and a triangular solve: the CPU fallback of `tree_verify` / `tree_commit`,
and an independent check that the closed form equals the recurrence. `tree_conv_reference` and
`tree_conv_commit_reference` do the same for the short convolution (docs/math.md §5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bole_tune.tree import TreeBatch

from .common import L2_EPS, LOG_DECAY_FLOOR
from .verify.checks import check_commit_inputs, check_verify_inputs
from .verify.result import TreeVerifyResult, commit_epoch, result_buffers


@dataclass
class ReferenceResult:
    """o: ``[N, Hv, dv]`` float64. states: ``[N, Hv, dv, dk]`` float64, each node's state (slot layout)."""

    o: torch.Tensor
    states: torch.Tensor

    def committed(self, state: torch.Tensor, state_indices, tree: TreeBatch, accepted) -> torch.Tensor:
        """The state pool (float64) that committing ``accepted`` must produce."""
        pool = state.detach().to(self.states.device, torch.float64).clone()
        offsets = tree.offsets.tolist()
        for r, (slot, node) in enumerate(zip(_ints(state_indices), _ints(accepted))):
            if node >= 0:
                pool[slot] = self.states[offsets[r] + node]
        return pool


def _ints(x) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else [int(v) for v in x]


def prepare_qk(q, k, hv, scale, use_qk_l2norm, dtype):
    """Normalised, scaled q and k with key heads repeated to the value heads: ``[N, Hv, d]``."""
    q = q.to(dtype)
    k = k.to(dtype)
    if use_qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + L2_EPS)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    q = q * scale
    group = hv // q.shape[1]
    return q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)


def verify_reference(q, k, v, g, beta, state, state_indices, tree: TreeBatch, scale=None,
                     use_qk_l2norm=True, keep_states: bool = True) -> ReferenceResult:
    """The recurrence, node by node, in float64 on the inputs' device. Same arguments as `tree_verify`.

    ``keep_states=False`` frees each node's state once its children are done (``states`` is then
    None): enough to check outputs of large batches without holding a state per node.
    """
    shape = check_verify_inputs(q, k, v, g, beta, state, state_indices, tree, scale, validate=False)
    f64, device = torch.float64, q.device
    qn, kn = prepare_qk(q.detach(), k.detach(), shape.heads.hv, shape.scale, use_qk_l2norm, f64)
    v64 = v.detach().to(f64)
    gamma = torch.exp(g.detach().to(f64))
    beta64 = beta.detach().to(f64)
    pool = state.detach()
    states = torch.empty(shape.num_nodes, shape.heads.hv, shape.heads.dv, shape.heads.dk, dtype=f64, device=device) if keep_states else None
    o = torch.empty(shape.num_nodes, shape.heads.hv, shape.heads.dv, dtype=f64, device=device)
    offsets = tree.offsets.tolist()
    for r, slot in enumerate(_ints(state_indices)):
        s_pre = pool[slot].to(f64)
        parents = tree.parents_of(r)
        pending = [0] * len(parents)  # children not yet computed, per node
        for p in parents:
            if p >= 0:
                pending[p] += 1
        live = {}
        for n, p in enumerate(parents):
            i = offsets[r] + n
            s_parent = s_pre if p < 0 else live[p]
            # slot layout: s[h, value, key]; S^T k is s @ k.
            predicted = torch.einsum("hvk,hk->hv", s_parent, kn[i])
            u = beta64[i, :, None] * (v64[i] - gamma[i, :, None] * predicted)
            s_node = gamma[i, :, None, None] * s_parent + u[:, :, None] * kn[i][:, None, :]
            o[i] = torch.einsum("hvk,hk->hv", s_node, qn[i])
            if keep_states:
                states[i] = s_node
            if pending[n]:
                live[n] = s_node
            if p >= 0:
                pending[p] -= 1
                if not pending[p]:
                    del live[p]
    return ReferenceResult(o=o, states=states)


def verify_closed_form(q, k, v, g, beta, state, state_indices, tree: TreeBatch, scale=None,
                       use_qk_l2norm=True, validate=None, dtype=torch.float32,
                       out: TreeVerifyResult | None = None) -> TreeVerifyResult:
    """Theorem 1 with dense per-request tensors and a unit-triangular solve, in ``dtype``."""
    shape = check_verify_inputs(q, k, v, g, beta, state, state_indices, tree, scale, validate)
    qn, kn = prepare_qk(q, k, shape.heads.hv, shape.scale, use_qk_l2norm, dtype)
    res = result_buffers(shape, q.dtype, q.device, tree, out)
    offsets = tree.offsets.tolist()
    for r, slot in enumerate(_ints(state_indices)):
        lo, hi = offsets[r], offsets[r + 1]
        mask = tree.ancestor_mask(r, v.device)
        strict = mask & ~torch.eye(hi - lo, dtype=torch.bool, device=v.device)
        logp = mask.to(dtype) @ g[lo:hi].to(dtype).clamp(min=LOG_DECAY_FLOOR)  # [T, Hv], LOG_DECAY_FLOOR says why
        # exp(logP_i - logP_j) on the mask only: it is <= 1 there, and may overflow elsewhere.
        diff = logp.T[:, :, None] - logp.T[:, None, :]  # [Hv, T, T]
        decay = torch.where(mask, diff, torch.full_like(diff, -torch.inf)).exp()
        q_h, k_h = qn[lo:hi].transpose(0, 1), kn[lo:hi].transpose(0, 1)  # [Hv, T, d]
        s_pre = state[slot].to(dtype)  # [Hv, dv, dk]
        beta_h = beta[lo:hi].to(dtype).T[:, :, None]  # [Hv, T, 1]
        p_h = logp.T.exp()[:, :, None]
        rhs = beta_h * (v[lo:hi].to(dtype).transpose(0, 1) - p_h * (k_h @ s_pre.transpose(1, 2)))
        gram = beta_h * decay * (k_h @ k_h.transpose(1, 2)) * strict
        eye = torch.eye(hi - lo, dtype=dtype, device=v.device)
        u_h = torch.linalg.solve_triangular(eye + gram, rhs, upper=False, unitriangular=True)
        readout = decay * (q_h @ k_h.transpose(1, 2))
        o_h = p_h * (q_h @ s_pre.transpose(1, 2)) + readout @ u_h
        res.u[lo:hi] = u_h.transpose(0, 1).float()
        res.o[lo:hi] = o_h.transpose(0, 1).to(res.o.dtype)
        res.log_decay[lo:hi] = logp.float()
    res.k.copy_(k)
    res.committed.zero_()
    if use_qk_l2norm:
        res.k_scale.copy_(torch.rsqrt((k.float() ** 2).sum(-1) + L2_EPS))
    else:
        res.k_scale.fill_(1.0)
    return res


def commit_closed_form(state, state_indices, res: TreeVerifyResult, accepted, validate=None) -> None:
    """``S_new = P_a S_pre + sum_{j <= a} exp(logP_a - logP_j) u_j k_j^T`` in place, float32."""
    check_commit_inputs(state, state_indices, res, accepted, validate)
    tree = res.tree
    group = res.u.shape[1] // res.k.shape[1]
    keys = (res.k.float() * res.k_scale[:, :, None]).repeat_interleave(group, dim=1)  # [N, Hv, dk]
    offsets, marks, epoch = tree.offsets.tolist(), _ints(res.committed), commit_epoch()
    for r, (slot, node) in enumerate(zip(_ints(state_indices), _ints(accepted))):
        # -1 keeps the slot, and so does a node out of range or a path already committed (a no-op twice)
        if not 0 <= node < tree.sizes[r] or marks[r] != 0:
            continue
        res.committed[r] = epoch
        rows = [offsets[r] + j for j in tree.path_to(r, node)]
        a = rows[-1]
        weight = torch.exp(res.log_decay[a][None, :] - res.log_decay[rows])  # [L, Hv]
        update = torch.einsum("lh,lhv,lhk->hvk", weight, res.u[rows], keys[rows])
        state[slot] = torch.exp(res.log_decay[a])[:, None, None] * state[slot] + update


def commit_pending_closed_form(state, state_indices, pending) -> None:
    """`tree_verify`'s ``pending`` applied on its own: each request's slot gets the previous round's accepted
    path of that slot (the requests' ``pending.paths.request_map``), as `commit_closed_form` does."""
    paths, prev = pending.paths, pending.result
    slots, accepted = [0] * paths.tree.num_requests, [-1] * paths.tree.num_requests
    previous_accepted = _ints(paths.accepted)
    for slot, previous in zip(_ints(state_indices), _ints(paths.request_map)):
        if 0 <= previous < len(slots):
            slots[previous], accepted[previous] = slot, previous_accepted[previous]
    result = TreeVerifyResult(prev.o, prev.u, prev.log_decay, prev.k, prev.k_scale, prev.committed, paths.tree)
    commit_closed_form(state, torch.tensor(slots, device=state.device), result,
                       torch.tensor(accepted, device=state.device), validate=False)


def _window(x, conv_state, slot: int, path_rows: list[int], width: int) -> torch.Tensor:
    """The last ``width`` inputs ending at the end of ``path_rows`` (oldest first), float64, [C, width]."""
    columns = [x[row].double() for row in path_rows[-width:]]
    missing = width - len(columns)
    if missing > 0:
        committed = conv_state[slot].double()  # [C, width - 1], oldest first
        columns = [committed[:, committed.shape[1] - missing + j] for j in range(missing)] + columns
    return torch.stack(columns, dim=1)


def tree_conv_reference(x, conv_state, weight, state_indices, tree: TreeBatch, activation="silu") -> torch.Tensor:
    """The causal depthwise convolution run node by node along each node's root path (float64 inside)."""
    width = weight.shape[1]
    out = torch.empty(x.shape, dtype=torch.float64, device=x.device)
    offsets = tree.offsets.tolist()
    for r, slot in enumerate(_ints(state_indices)):
        for n in range(tree.sizes[r]):
            rows = [offsets[r] + j for j in tree.path_to(r, n)]
            window = _window(x, conv_state, slot, rows, width)
            out[offsets[r] + n] = (window * weight.double()).sum(dim=1)
    if activation == "silu":
        out = out * torch.sigmoid(out)
    return out.to(x.dtype)


def tree_conv_commit_reference(conv_state, state_indices, x, tree: TreeBatch, accepted) -> None:
    """The conv state after the accepted path: its last width - 1 inputs, into the slot in place."""
    width = conv_state.shape[2] + 1
    offsets = tree.offsets.tolist()
    for r, (slot, node) in enumerate(zip(_ints(state_indices), _ints(accepted))):
        if not 0 <= node < tree.sizes[r]:  # -1 keeps the slot, and so does a node out of range
            continue
        rows = [offsets[r] + j for j in tree.path_to(r, node)]
        conv_state[slot] = _window(x, conv_state, slot, rows, width - 1).to(conv_state.dtype)
