"""The Bole verifier behind SGLang 0.5.23's GDN tree-verify interface (importable without SGLang).

SGLang verifies EAGLE trees through Gated DeltaNet layers with a serial kernel
(``fused_sigmoid_gating_delta_rule_update`` with ``retrieve_parent_token``), selected by
``GDNKernelDispatcher.tree_verify_kernel``; it writes every node's fp32 state into a snapshot buffer
(``intermediate_ssm``, ``[L, rows, T, Hv, dv, dk]``), and ``update_mamba_state_after_mtp_verify`` copies the
accepted node's snapshot into the pool (``temporal``, ``[L, slots, Hv, dv, dk]``). This module puts
`tree_verify` and the all-layer `tree_commit_layers` there:

- `SGLangTreeVerifyKernel`: ``target_verify(A_log, dt_bias, q, k, v, a, b, *, ssm_states, cache_indices,
  query_start_loc, intermediate_states_buffer, intermediate_state_indices, cache_steps, retrieve_parent_token,
  **kwargs)`` as SGLang's ``TritonGDNKernel`` takes it; never writes the snapshot buffer, keeps each layer's
  factors (`LayerResults`) for the commit.
- `SGLangTreeVerifyKernel.commit`: the state SGLang would have copied from its snapshot of the accepted step.
- `install(backend)`: both into a running SGLang backend; refuses modes it does not cover.

SGLang's conventions (read from its 0.5.23 code):

- Tokens of request ``r`` are rows ``query_start_loc[r] .. query_start_loc[r+1]`` of q ``[1, N, Hk, dk]``,
  k, v ``[1, N, Hv, dv]``, a, b ``[N, Hv]``; in target verify every request has ``draft_token_num`` tokens
  (``query_start_loc`` steps by it). Node 0 of a request is the last verified token (the root; its parent
  entry is not read); node ``i >= 1`` hangs off ``retrieve_parent_token[r, i]``, a local index ``< i``.
  SGLang's conv kernel writes ``retrieve_parent_token`` on the device during the round's first GDN layer
  (from ``retrieve_next_token`` / ``retrieve_next_sibling``), so the host never sees the tree.
- Gates: ``g = -exp(A_log) * softplus(a + dt_bias)`` with softplus beta 1, threshold 20 (linear above it),
  ``beta = sigmoid(b)``, L2-normalised q and k (eps 1e-6), scale ``dk ** -0.5``: `gdn_gates` and
  `tree_verify`'s defaults are the same.
- Output: ``[1, N, Hv, dv]`` in q's dtype.
- Commit: ``last_correct_step_indices[r]`` is the local index (0 = root) of request r's last accepted node
  (``accept_index[r, accept_len - 1] - r * draft_token_num``); a negative step, a slot index < 0 or a step
  ``>= draft_token_num`` skips the request. ``mamba_track_indices`` / ``mamba_steps_to_track`` (prefix-cache
  tracking) copy another node's state into a second slot the same way.

The tree is converted on the device (`sglang_tree`: one Triton launch, `kernels/tree_build.py`; no host copy),
once per round at the round's first GDN layer, so a round can be captured in a CUDA graph as SGLang does.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from bole_tune.kernels import LayerResults, gdn_gates, tree_commit, tree_commit_layers, tree_verify
from bole_tune.shapes import HeadShape
from bole_tune.tree import TreeBatch

SGLANG_VERSION = "0.5.23"


# --- the tree ------------------------------------------------------------------------------------------

def sglang_parents(parents: list[int]) -> list[int]:
    """bole-tune's local parents of one request (node 0 the root, -1) as SGLang's ``retrieve_parent_token``
    row (node 0's entry unused: 0)."""
    if not parents or parents[0] != -1 or any(p < 0 for p in parents[1:]):
        raise ValueError("SGLang's trees have exactly one root, node 0")
    return [0] + list(parents[1:])


def sglang_tree(retrieve_parent_token: torch.Tensor, max_depth: int | None = None) -> TreeBatch:
    """A `TreeBatch` from SGLang's ``retrieve_parent_token`` ``[B, T]`` (device work only, graph-safe).

    One Triton launch (`bole_tune.kernels.tree_build.build_tree_tables`, one program per request) builds the
    ancestor matrix ``A = (I + P)`` squared ceil(log2 T) times in registers and reads everything from it:
    ``depth_i = sum_j A_ij - 1``, subtree sizes ``sum_i A_ij``, ``enter_i = depth_i + sum_(a <= i) off_a`` with
    ``off_a`` the sizes of a's earlier siblings, ``exit_i = enter_i + size_i - 1``, and the per-block sweep
    counts (`TreeBatch.block_depths` for blocks of 16, 32 and 64 nodes). A parent entry is taken into
    ``[0, i - 1]``; node 0's is not read. Trees of more than 128 nodes, and CPU tensors without
    ``TRITON_INTERPRET=1``, run the same algorithm as batched torch ops. The host side holds bounds only:
    every request has T nodes, and the depth is at most ``max_depth`` (default T - 1; SGLang's trees are
    ``speculative_num_steps`` deep). Extra substitution sweeps are no-ops, so a bound above the true depth is
    exact.
    """
    from bole_tune.kernels.tree_build import build_tree_tables

    if retrieve_parent_token.dim() != 2:
        raise ValueError(f"retrieve_parent_token: expected [B, T], got {tuple(retrieve_parent_token.shape)}")
    b, t = retrieve_parent_token.shape
    tables = build_tree_tables(retrieve_parent_token)
    tree = TreeBatch(
        offsets=tables.offsets, parents=tables.parents, node_depth=tables.node_depth,
        dfs_enter=tables.dfs_enter, dfs_exit=tables.dfs_exit,
        sizes=(t,) * b, depth=min(t - 1, t - 1 if max_depth is None else int(max_depth)),
        _host_parents=(), _host_depths=())
    tree._cache.update(tables.block_depths)
    return tree


# --- the kernel object ---------------------------------------------------------------------------------

@dataclass
class _Round:
    """One verified batch shape: its tree, slots and factor views (kept while a CUDA graph may replay it)."""

    key: tuple
    tree: TreeBatch
    slots: torch.Tensor
    results: LayerResults
    layers: set = field(default_factory=set)
    captured: bool = False
    gates: tuple | None = None  # (g, beta) [N, Hv] float32, written by each layer's gates (`_gates_out`)


class SGLangTreeVerifyKernel:
    """SGLang 0.5.23's linear-attention kernel interface for tree target verify, on the Bole verifier.

    Args:
        pools: SGLang's all-layer pool ``mamba_cache.temporal`` ``[L, slots, Hv, dv, dk]`` float32, or None.
            With it, a call's layer is found from where ``ssm_states`` lies in it and the commit is one launch
            for all layers; without it, layers are numbered by ``kwargs["layer_id"]`` or in order of first use.
        max_depth: the deepest tree SGLang proposes (``speculative_num_steps``); None: T - 1 (always exact,
            plans as if chains).
        validate: passed to `tree_verify` / the commits (value checks; None follows BOLE_TUNE_VALIDATE).

    One `LayerResults` (``u``, ``logP``, keys and norms per node and layer) is allocated for the largest round
    seen and shared by later rounds as views; nothing per node is ``dk x dv``.
    """

    supports_strided_target_verify_qkv = True  # q, k, v views of the packed projection are read in place

    def __init__(self, pools: torch.Tensor | None = None, max_depth: int | None = None,
                 validate: bool | None = None):
        self.pools = pools
        self.max_depth = max_depth
        self.validate = validate
        self._storage: LayerResults | None = None
        self._retired: list[LayerResults] = []
        self._rounds: dict[tuple, _Round] = {}
        self._current: _Round | None = None
        self._layer_ids: dict = {}
        self._views: dict = {}  # (layers, nodes, requests) -> (storage, its LayerResults views)
        self._heads: dict = {}  # (hk, hv, dk, dv) -> HeadShape (checked once)

    # the layer of a call
    def _layer_of(self, ssm_states: torch.Tensor, kwargs) -> int:
        pools = self.pools
        if pools is not None:
            offset = ssm_states.data_ptr() - pools.data_ptr()
            step = pools.stride(0) * pools.element_size()
            if offset < 0 or offset % step or offset // step >= pools.shape[0]:
                raise ValueError("ssm_states: not a layer of the pool this kernel was installed with")
            return offset // step
        key = kwargs.get("layer_id", ssm_states.data_ptr())
        return self._layer_ids.setdefault(key, len(self._layer_ids))

    def _num_layers(self, layer: int) -> int:
        if self.pools is not None:
            return self.pools.shape[0]
        return max(len(self._layer_ids), layer + 1)

    def _buffers(self, layers: int, tree: TreeBatch, heads: HeadShape, dtype, device) -> LayerResults:
        """Views of the shared factor storage for this round (grown, never shrunk; old storage stays alive
        with the rounds that reference it, as a captured CUDA graph may still write it)."""
        n, b = tree.num_nodes, tree.num_requests
        s = self._storage
        if (s is None or s.num_layers < layers or s.u.shape[1] < n or s.committed.shape[1] < b
                or s.o.dtype != dtype or s.u.shape[2:] != (heads.hv, heads.dv) or s.k.shape[2:] != (heads.hk, heads.dk)
                or s.u.device != torch.device(device)):
            fits = s is not None and s.o.dtype == dtype and s.u.device == torch.device(device)
            rows = max(n, s.u.shape[1] if fits else 0)
            requests = max(b, s.committed.shape[1] if fits else 0)
            if s is not None:
                self._retired.append(s)  # a captured CUDA graph may still write it
            grown = LayerResults.empty(max(layers, s.num_layers if fits else 0), _Sized(rows, requests), heads,
                                       dtype, device)
            if fits:  # layers verified earlier in this round keep their factors
                for name in ("o", "u", "log_decay", "k", "k_scale", "committed"):
                    old = getattr(s, name)
                    getattr(grown, name)[:old.shape[0], :old.shape[1]].copy_(old)
            s = self._storage = grown
        key = (layers, n, b)
        views = self._views.get(key)
        if views is None or views[0] is not s:
            if len(self._views) >= 64:  # rounds of ever-new sizes keep a bounded table
                self._views.clear()
            results = LayerResults(o=s.o[:layers, :n], u=s.u[:layers, :n], log_decay=s.log_decay[:layers, :n],
                                   k=s.k[:layers, :n], k_scale=s.k_scale[:layers, :n], committed=s.committed[:layers, :b])
            views = self._views[key] = (s, results)
        return views[1]

    def _gates_out(self, rnd: _Round, n: int, hv: int, device) -> tuple:
        """The round's ``(g, beta)`` buffers, shared by its layers: each layer's gates are written and read by its
        verify before the next layer's are written (one stream), so one pair serves the round, and a captured
        round keeps its own."""
        gates = rnd.gates
        if gates is None:
            g = torch.empty(2, n, hv, dtype=torch.float32, device=device)
            gates = rnd.gates = (g[0], g[1])
        return gates

    def reserve(self, num_requests: int, tree_size: int, heads: HeadShape, dtype, device, num_layers=None):
        """Allocate the factor storage up front (before CUDA-graph capture) for rounds up to this size."""
        layers = num_layers or (self.pools.shape[0] if self.pools is not None else 1)
        self._buffers(layers, _Sized(num_requests * tree_size, num_requests), heads, dtype, torch.device(device))

    def _round(self, retrieve_parent_token, cache_indices, layer, heads, dtype, device) -> _Round:
        b, t = retrieve_parent_token.shape
        key = (retrieve_parent_token.data_ptr(), b, t, dtype)
        cur = self._current
        if cur is not None and cur.key == key and layer not in cur.layers:
            return cur  # a later layer of the same round: the tree is shared
        # a new round (first layer, or a layer seen again): convert the tree once, on the device
        tree = sglang_tree(retrieve_parent_token, self.max_depth)
        slots = cache_indices[:b].to(torch.int32).clamp(min=0)  # padding rows (-1) read slot 0; never committed
        results = self._buffers(self._num_layers(layer), tree, heads, dtype, device)
        cur = _Round(key, tree, slots, results)
        captured = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not captured:  # eager rounds: keep the last few (captured rounds stay: their graphs write them)
            eager = [k for k, r in self._rounds.items() if not r.captured]
            for old in eager[:max(0, len(eager) - 15)]:
                del self._rounds[old]
        cur.captured = captured
        self._rounds[key[:3]] = cur
        self._current = cur
        return cur

    def target_verify(self, A_log, dt_bias, q, k, v, a, b, *, ssm_states, cache_indices, query_start_loc,
                      intermediate_states_buffer=None, intermediate_state_indices=None, cache_steps=None,
                      retrieve_parent_token=None, **kwargs) -> torch.Tensor:
        """SGLang's tree target verify: the core output ``[1, N, Hv, dv]`` in q's dtype; ``ssm_states`` and the
        snapshot buffer are not written (the commit writes the pool)."""
        if retrieve_parent_token is None:
            raise ValueError("retrieve_parent_token: None; this kernel verifies trees (SGLang routes chains "
                             "to its verify_kernel)")
        if q.dim() != 4 or q.shape[0] != 1 or v.dim() != 4:
            raise ValueError(f"q: expected [1, N, Hk, dk] and v [1, N, Hv, dv], got {tuple(q.shape)}, "
                             f"{tuple(v.shape)}")
        n, hk, dk = q.shape[1:]
        hv, dv = v.shape[2:]
        bsz, t = retrieve_parent_token.shape
        if query_start_loc.shape[0] - 1 != bsz or n != bsz * t:
            raise ValueError(f"tokens: {n} rows for {query_start_loc.shape[0] - 1} requests with "
                             f"retrieve_parent_token {tuple(retrieve_parent_token.shape)}; only SGLang's uniform "
                             "layout (draft_token_num tokens per request) is supported, not ragged verify")
        if ssm_states.dtype != torch.float32:
            raise TypeError(f"ssm_states: dtype {ssm_states.dtype}; bole-tune needs --mamba-ssm-dtype float32")
        layer = self._layer_of(ssm_states, kwargs)
        heads = self._heads.get((hk, hv, dk, dv))
        if heads is None:
            heads = self._heads[(hk, hv, dk, dv)] = HeadShape(hk=hk, hv=hv, dk=dk, dv=dv)
        rnd = self._round(retrieve_parent_token, cache_indices, layer, heads, q.dtype, q.device)
        if layer >= rnd.results.num_layers:  # no pool given: a layer not seen before
            rnd.results = self._buffers(layer + 1, rnd.tree, heads, q.dtype, q.device)
        if a.shape != (n, hv):
            a = a.reshape(n, hv)
        if b.shape != (n, hv):
            b = b.reshape(n, hv)
        g, beta = gdn_gates(a, b, A_log, dt_bias, validate=False, out=self._gates_out(rnd, n, hv, q.device))
        res = tree_verify(q[0], k[0], v[0], g, beta, ssm_states, rnd.slots, rnd.tree, config=None,
                          validate=self.validate, out=rnd.results.layer(layer, rnd.tree))
        rnd.layers.add(layer)
        return res.o.unsqueeze(0)

    # the commit
    def round_for(self, retrieve_parent_token: torch.Tensor | None = None) -> _Round:
        """The round verified with this ``retrieve_parent_token`` buffer (SGLang's forward metadata of the
        replayed graph or eager round), else the last one."""
        if retrieve_parent_token is not None:
            key = (retrieve_parent_token.data_ptr(), *retrieve_parent_token.shape)
            if key in self._rounds:
                return self._rounds[key]
        if self._current is None:
            raise RuntimeError("commit: nothing was verified")
        return self._current

    def commit(self, accepted_steps, state_indices, pools=None, retrieve_parent_token=None,
               track_indices=None, track_steps=None) -> None:
        """Write into the pool the state SGLang would copy from its snapshot of each request's accepted step.

        Args:
            accepted_steps: ``[n]`` SGLang's ``last_correct_step_indices`` (n <= the verified batch; rows past n
                are padding and keep their slots).
            state_indices: ``[n]`` the requests' slots (``forward_metadata.mamba_cache_indices[:n]``).
            pools: ``[L, slots, Hv, dv, dk]`` (one launch for all layers), a list of per-layer pools, or None
                for the installed ``pools``.
            track_indices, track_steps: SGLang's ``mamba_track_indices`` / ``mamba_steps_to_track``: also write
                the state of node ``track_steps[r]`` (>= 0) into slot ``track_indices[r]``.
        """
        rnd = self.round_for(retrieve_parent_token)
        pools = self.pools if pools is None else pools
        if pools is None:
            raise ValueError("pools: give the layers' pools (no pool was installed)")
        tree, b = rnd.tree, rnd.tree.num_requests
        t = tree.max_tree_size
        device = rnd.slots.device
        steps = torch.as_tensor(accepted_steps, device=device).reshape(-1)
        dst = torch.as_tensor(state_indices, device=device).reshape(-1)
        n = steps.shape[0]
        if n > b or dst.shape[0] != n:
            raise ValueError(f"accepted_steps: {n} requests, state_indices {dst.shape[0]}, verified {b}")

        def padded(node, slot):
            ok = (node >= 0) & (node < t) & (slot >= 0)
            if n == b:  # no padding rows: the same, in fewer launches
                return torch.where(ok, node, -1).to(torch.int32), slot.to(torch.int32).clamp(min=0)
            acc = torch.full((b,), -1, dtype=torch.int32, device=device)
            acc[:n] = torch.where(ok, node, -1).to(torch.int32)
            slots = rnd.slots.clone()
            slots[:n] = slot.to(torch.int32).clamp(min=0)
            return acc, slots

        layers = sorted(rnd.layers)
        if isinstance(pools, torch.Tensor) and pools.dim() == 5 and len(layers) != pools.shape[0]:
            # SGLang verifies every GDN layer of the pool each round with one retrieve_parent_token buffer; a layer
            # missing here was verified under another buffer (another round) and would silently keep its old state
            raise RuntimeError(f"commit: this round verified layers {layers} of the pool's {pools.shape[0]}; the others "
                               "were verified with another retrieve_parent_token buffer (every layer of a round must "
                               "get the same one) or not at all")
        if track_indices is not None and track_steps is not None:
            # the track slots receive node track_steps[r]'s state, built from S_pre in the request's slot before
            # the main commit overwrites it: commit into a gathered copy, scatter the rows that track
            track = torch.as_tensor(track_indices, device=device).reshape(-1)[:n]
            tsteps = torch.as_tensor(track_steps, device=device).reshape(-1)[:n]
            acc, _ = padded(tsteps, track)
            own = rnd.slots.clone()
            own[:n] = dst.to(torch.int32).clamp(min=0)
            dest = own.clone()
            dest[:n] = torch.where(acc[:n] >= 0, track.to(torch.int32), own[:n])
            ident = torch.arange(b, dtype=torch.int32, device=device)
            self._commit_all(pools, layers, rnd, ident, acc, gather=own, scatter=dest)
            rnd.results.committed.zero_()  # the main commit of the same factors follows
        acc, slots = padded(steps, dst)
        self._commit_all(pools, layers, rnd, slots, acc)

    def _commit_all(self, pools, layers, rnd, slots, acc, gather=None, scatter=None):
        tree, results = rnd.tree, rnd.results
        if isinstance(pools, torch.Tensor) and pools.dim() == 5:
            if gather is not None:
                tmp = pools[:, gather.long()]
                self._commit_all(tmp, layers, rnd, slots, acc)
                pools[:, scatter.long()] = tmp
                return
            if layers == list(range(pools.shape[0])) and results.num_layers == pools.shape[0]:
                tree_commit_layers(pools, slots, results, tree, acc, validate=self.validate)
                return
            pools = [pools[l] for l in range(pools.shape[0])]
        for l in layers:
            pool = pools[l]
            if gather is not None:
                tmp = pool[gather.long()]
                tree_commit(tmp, slots, results.layer(l, tree), acc, validate=self.validate)
                pool[scatter.long()] = tmp
            else:
                tree_commit(pool, slots, results.layer(l, tree), acc, validate=self.validate)

    @staticmethod
    def transient_bytes_per_request_layer(tree_size: int, heads: HeadShape, dtype=torch.bfloat16) -> int:
        """What the adapter keeps per request and layer until the commit: u, logP, the keys and their norms per
        node, a commit mark per request (the core output, which SGLang's kernel writes too, not counted)."""
        item = torch.empty((), dtype=dtype).element_size()
        h = heads
        return tree_size * (h.hv * h.dv * 4 + h.hv * 4 + h.hk * (h.dk * item + 4)) + 4


@dataclass
class _Sized:
    """Just what `LayerResults.empty` reads of a tree: its node and request counts."""

    num_nodes: int
    num_requests: int


# --- installing into SGLang ----------------------------------------------------------------------------

def _installed_version() -> str | None:
    import importlib
    import importlib.metadata
    try:
        version = getattr(importlib.import_module("sglang"), "__version__", None)
    except Exception:
        return None
    if version is None:
        try:
            version = importlib.metadata.version("sglang")
        except Exception:
            return None
    return str(version)


def _hybrid_backends(obj, seen=None) -> list:
    """The HybridLinearAttnBackend instances reachable from a model runner, a HybridAttnBackend (decode /
    prefill split) or the backend itself."""
    seen = set() if seen is None else seen
    if obj is None or id(obj) in seen:
        return []
    seen.add(id(obj))
    if hasattr(obj, "linear_attn_backend") and hasattr(obj, "update_mamba_state_after_mtp_verify"):
        return [obj]
    found = []
    for name in ("attn_backend", "decode_backend", "prefill_backend"):
        found += _hybrid_backends(getattr(obj, name, None), seen)
    return found


def _pp_spec_enabled() -> bool:
    try:
        from sglang.srt.layers.attention.linear.utils import pp_spec_stable_rows_enabled
        return bool(pp_spec_stable_rows_enabled())
    except Exception:
        return os.environ.get("SGLANG_ENABLE_PP_SPEC", "").lower() in ("1", "true", "yes")


def _check_backend(hybrid) -> tuple:
    linear = hybrid.linear_attn_backend
    names = [cls.__name__ for cls in type(linear).__mro__]
    if any("KDA" in name for name in names) or getattr(linear, "accept_lens_pool", None) is not None:
        raise ValueError(f"install: the linear-attention backend is {type(linear).__name__} (KDA); bole-tune "
                         "verifies Gated DeltaNet only")
    dispatcher = getattr(linear, "kernel_dispatcher", None)
    if dispatcher is None or not hasattr(dispatcher, "tree_verify_kernel"):
        raise ValueError(f"install: {type(linear).__name__} has no kernel_dispatcher.tree_verify_kernel "
                         "(not SGLang 0.5.23's GDNAttnBackend)")
    pool = linear.req_to_token_pool.mamba_pool
    cache = pool.mamba_cache
    if (getattr(cache, "replayssm_d", None) is not None or getattr(cache, "replayssm_rawv", None) is not None
            or getattr(pool, "replayssm_spec_fold", False) or getattr(pool, "replayssm_cache_base", None) is not None
            or getattr(pool, "replayssm_is_kda", False)):
        raise ValueError("install: ReplaySSM is on (--enable-linear-replayssm*); its ring owns the state "
                         "rollback, the Bole commit would fight it. Launch without it.")
    if getattr(cache, "intermediate_ssm", None) is None:
        raise ValueError("install: the pool has no intermediate_ssm (ReplaySSM spec mode); not supported")
    temporal = cache.temporal
    if temporal.dim() != 5 or temporal.stride(-1) != 1 or temporal.stride(-2) != temporal.shape[-1]:
        raise ValueError(f"install: the SSM pool layout (shape {tuple(temporal.shape)}, strides "
                         f"{temporal.stride()}) is not SGLang's [layers, slots, Hv, dv, dk] with contiguous [dv, dk] tiles")
    if temporal.dtype != torch.float32:
        raise ValueError(f"install: the SSM pool is {temporal.dtype}; bole-tune commits fp32 states "
                         "(launch with --mamba-ssm-dtype float32)")
    if _pp_spec_enabled():
        raise ValueError("install: SGLANG_ENABLE_PP_SPEC (pipeline-parallel stable rows) is on; its delayed "
                         "commits need one factor buffer per micro-batch, not supported")
    return linear, dispatcher, pool, cache


def install(backend, *, max_depth: int | None = None, sglang_version: str | None = None,
            validate: bool | None = None) -> SGLangTreeVerifyKernel:
    """Put the Bole verifier and commit into a running SGLang 0.5.23 GDN backend.

    ``backend``: the model runner's ``attn_backend`` (a ``HybridLinearAttnBackend``, or a
    ``HybridAttnBackend`` wrapping some), or the model runner. Sets each GDN dispatcher's
    ``tree_verify_kernel`` to one `SGLangTreeVerifyKernel` and the hybrid backend's
    ``update_mamba_state_after_mtp_verify`` to a commit that writes the SSM states with `tree_commit_layers`
    (trees, ``retrieve_parent_token`` set) and leaves the conv windows and side states to SGLang's own
    scatter. Chains (topk 1) keep SGLang's verify kernel and commit.
    Raises RuntimeError (SGLang version) or ValueError (a mode not covered), naming it.
    """
    version = sglang_version if sglang_version is not None else _installed_version()
    if version != SGLANG_VERSION:
        raise RuntimeError(f"install: SGLang {version or 'not importable'}; this adapter is written against "
                           f"SGLang {SGLANG_VERSION}'s GDN interface")
    hybrids = _hybrid_backends(backend)
    if not hybrids:
        raise ValueError(f"install: no hybrid linear-attention backend in {type(backend).__name__} "
                         "(expected the model runner's attn_backend for a Qwen3.5 / Qwen3-Next model)")
    if max_depth is None:
        try:
            from sglang.srt.runtime_context import get_spec
            max_depth = int(get_spec().speculative_num_steps)
        except Exception:
            max_depth = None
    checked = [(hybrid, *_check_backend(hybrid)) for hybrid in hybrids]
    kernels = {}
    for hybrid, linear, dispatcher, pool, cache in checked:
        key = id(cache.temporal)
        if key not in kernels:
            kernels[key] = SGLangTreeVerifyKernel(pools=cache.temporal, max_depth=max_depth, validate=validate)
        kernel = kernels[key]
        dispatcher.tree_verify_kernel = kernel
        hybrid.update_mamba_state_after_mtp_verify = _commit_hook(hybrid, kernel,
                                                                  hybrid.update_mamba_state_after_mtp_verify)
        hybrid.bole_tune_kernel = kernel
    return next(iter(kernels.values()))


def sglang_plugin() -> None:
    """SGLang's general plugin hook (entry point group ``sglang.srt.plugins``, loaded by every SGLang process):
    with ``BOLE_TUNE_SGLANG=1`` in the server's environment, `install` runs on each target model runner right
    after SGLang builds its attention backends (before CUDA-graph capture). Models without GDN layers and
    draft workers are left alone; a mode the adapter does not cover stops the launch with install's error."""
    if os.environ.get("BOLE_TUNE_SGLANG", "0").lower() not in ("1", "true", "yes"):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def after_init_attention_backends(result, runner, *args, **kwargs):
        if not getattr(runner, "is_draft_worker", False) and _hybrid_backends(getattr(runner, "attn_backend", None)):
            install(runner.attn_backend)

    HookRegistry.register("sglang.srt.model_executor.model_runner.ModelRunner.init_attention_backends",
                          after_init_attention_backends, HookType.AFTER)


def _commit_hook(hybrid, kernel: SGLangTreeVerifyKernel, original):
    """SGLang's ``update_mamba_state_after_mtp_verify`` with the SSM snapshot copy replaced by the Bole commit."""

    def update_mamba_state_after_mtp_verify(last_correct_step_indices, mamba_track_indices, mamba_steps_to_track,
                                            model, req_pool_indices=None):
        linear = hybrid.linear_attn_backend
        metadata = linear.forward_metadata
        parents = getattr(metadata, "retrieve_parent_token", None)
        if parents is None or kernel._current is None:  # a chain: SGLang's verify kernel wrote the snapshots
            return original(last_correct_step_indices, mamba_track_indices, mamba_steps_to_track, model,
                            req_pool_indices)
        if _pp_spec_enabled():
            raise RuntimeError("bole-tune: SGLANG_ENABLE_PP_SPEC turned on after install; not supported")
        n = last_correct_step_indices.shape[0]
        if mamba_track_indices is not None:
            mamba_track_indices = linear._translate_mamba_indices(mamba_track_indices)
        state_indices = metadata.mamba_cache_indices[:n]
        caches = linear.req_to_token_pool.get_speculative_mamba2_params_all_layers()
        kernel.commit(last_correct_step_indices, state_indices, pools=caches.temporal, retrieve_parent_token=parents,
                      track_indices=mamba_track_indices, track_steps=mamba_steps_to_track)
        # conv windows (and tracking copies of them): SGLang's own scatter, with the SSM part left out
        from sglang.kernels.ops.mamba.mamba_state_scatter_triton import scatter_mamba_states_after_mtp_verify
        conv_only = SimpleNamespace(temporal=caches.temporal.new_empty(0), intermediate_ssm=None,
                                    conv=caches.conv, intermediate_conv_window=caches.intermediate_conv_window)
        scatter_mamba_states_after_mtp_verify(conv_only, state_indices, last_correct_step_indices,
                                              mamba_track_indices, mamba_steps_to_track)
        side = getattr(hybrid, "_update_ple_state_after_mtp_verify", None)
        if side is not None:
            side(state_indices, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track, None)

    update_mamba_state_after_mtp_verify.bole_tune_original = original
    return update_mamba_state_after_mtp_verify


# --- measuring it against SGLang's kernel (GPU) ----------------------------------------------------------

BENCH_SHAPES = ((3, 1, 4), (5, 4, 8), (5, 4, 16), (8, 4, 32), (8, 8, 64))


def import_sglang_kernels(packages=None):
    """SGLang 0.5.23's tree-verify kernel and snapshot scatter, imported into this process from the engine
    packages folder (scripts/engine_packages.py; ``$BOLE_TUNE_ENGINE_PACKAGES``). Meant for a process of its
    own (the benchmark): SGLang's folder is appended to sys.path, after this environment's packages."""
    import sys

    from bole_tune.engines.engine_check import EngineUnavailable, sglang_kernel_site

    packages = packages or os.environ.get("BOLE_TUNE_ENGINE_PACKAGES",
                                          os.path.expanduser("~/.cache/bole-tune/engine-packages"))
    site = str(sglang_kernel_site(packages))
    if site not in sys.path:
        sys.path.append(site)
    try:
        from sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent import (
            fused_sigmoid_gating_delta_rule_update,
        )
        from sglang.kernels.ops.mamba.mamba_state_scatter_triton import fused_mamba_state_scatter_with_mask
    except Exception as error:
        raise EngineUnavailable(f"SGLang's kernels do not import from {site}: {type(error).__name__}: {error}")
    return fused_sigmoid_gating_delta_rule_update, fused_mamba_state_scatter_with_mask


def bench_layers(batch: int, draft_tokens: int, heads: HeadShape, budget_bytes: int = 16 << 30, most: int = 24) -> int:
    """GDN layers per timed round: SGLang's snapshot buffer of every layer (``batch * draft_tokens`` fp32 states
    each) within ``budget_bytes``, at most ``most`` (Qwen3.5-9B has 24 GDN layers), at least 1."""
    per_layer = batch * draft_tokens * heads.hv * heads.dv * heads.dk * 4
    return max(1, min(most, budget_bytes // per_layer))


def benchmark(batches=(1, 4, 16, 32), shapes=BENCH_SHAPES, heads: HeadShape | None = None, packages=None,
              acceptance: str = "qwen3.5-mtp-mbpp", repeats: int = 50, device="cuda", progress=None,
              eager_turns: int = 3) -> list[dict]:
    """Per GDN layer and round (verify plus commit), SGLang 0.5.23's serial kernel with its snapshot buffer and
    its all-layer snapshot scatter against the adapter as SGLang would call it (`SGLangTreeVerifyKernel`:
    ``target_verify`` per layer, gates, the tree converted once per round, `tree_verify` with the tuning
    database; then ``commit``, one launch for all layers), side by side in one process, both in CUDA graphs
    over rotating input sets (`bole_tune.timing.time_launches`). A round covers `bench_layers` layers (all 24
    of the 9B where SGLang's snapshot buffers fit in 16 GiB); the figures are per layer.

    ``shapes``: SGLang's ``(speculative_num_steps, speculative_eagle_topk, speculative_num_draft_tokens)``, trees
    built as SGLang builds them (`bole_tune.draft_trees.SGLangBeam`). Each request accepts the deepest node of
    its tree. Returns one row per (batch, shape) with p20/p50/p80 microseconds of both, the tree conversion
    (`sglang_tree`, once per round for all layers) and the transient bytes per request and layer (SGLang: its
    fp32 snapshot of every node; the adapter: its factors).

    ``eager_turns`` > 0 (on a GPU): the same rounds also issued eagerly from Python, as an engine without CUDA graphs
    runs them (``sglang_eager_us``, ``adapter_eager_us``: wall time per layer and round over the input sets, device
    drained at the end; `bole_tune.timing.time_eager_host`), the two alternating over that many turns and the
    median of each kept: the host's speed drifts between spells, and a spell lands on both.
    """
    from bole_tune.acceptance import load_acceptance
    from bole_tune.draft_trees import SGLangBeam
    from bole_tune.timing import l2_cache_bytes, rotation_count, time_eager_host, time_launches

    fused, scatter = import_sglang_kernels(packages)
    h = heads or HeadShape(hk=16, hv=32, dk=128, dv=128)
    model = load_acceptance(acceptance)
    dtype = torch.bfloat16
    rows = []
    for steps, topk, draft in shapes:
        tree_parents = SGLangBeam(model, steps, topk).tree(draft).parents
        local = [-1] + [p + 1 for p in tree_parents]
        depth_of = [0] * len(local)
        for i, p in enumerate(local[1:], 1):
            depth_of[i] = depth_of[p] + 1
        deepest = max(range(len(local)), key=lambda i: depth_of[i])
        for b in batches:
            t, n = draft, b * draft
            layers = bench_layers(b, t, h)
            gen = torch.Generator(device=device).manual_seed(b * 1000 + draft)
            state_bytes = layers * b * h.hv * h.dv * h.dk * 4
            sets = rotation_count(state_bytes + layers * n * (2 * h.hk * h.dk + h.hv * h.dv) * 2,
                                  l2_cache_bytes(device), 8)

            def rand(*size, scale=1.0, dt=dtype):
                return (torch.randn(*size, generator=gen, device=device) * scale).to(dt)

            inputs = [dict(q=rand(layers, 1, n, h.hk, h.dk), k=rand(layers, 1, n, h.hk, h.dk),
                           v=rand(layers, 1, n, h.hv, h.dv), a=rand(layers, n, h.hv), b=rand(layers, n, h.hv),
                           pools=rand(layers, b, h.hv, h.dv, h.dk, scale=0.1, dt=torch.float32))
                      for _ in range(sets)]
            a_log, dt_bias = rand(h.hv, scale=0.5, dt=torch.float32), rand(h.hv, dt=torch.float32)
            slots = torch.arange(b, dtype=torch.int32, device=device)
            parents = torch.tensor([sglang_parents(local)] * b, dtype=torch.int32, device=device)
            qsl = torch.arange(0, n + 1, t, dtype=torch.int32, device=device)
            steps_acc = torch.full((b,), deepest, dtype=torch.int64, device=device)
            # SGLang's intermediate_ssm: [layers, rows (+1 spare), T, Hv, dv, dk]
            snapshots = torch.empty(layers, b + 1, t, h.hv, h.dv, h.dk, dtype=torch.float32, device=device)
            rows_idx = torch.arange(b, dtype=torch.int32, device=device)

            def sglang_round(i):
                x = inputs[i]
                for l in range(layers):
                    fused(A_log=a_log, dt_bias=dt_bias, q=x["q"][l], k=x["k"][l], v=x["v"][l], a=x["a"][l],
                          b=x["b"][l], initial_state_source=x["pools"][l], initial_state_indices=slots,
                          cu_seqlens=qsl, use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0,
                          is_kda=False, disable_state_update=True, intermediate_states_buffer=snapshots[l],
                          intermediate_state_indices=rows_idx, cache_steps=t, retrieve_parent_token=parents)
                if snapshots.is_cuda:
                    scatter(x["pools"], snapshots, slots, steps_acc)
                else:  # CPU smoke runs: SGLang's scatter is CUDA-only; the same gather
                    x["pools"][:, slots.long()] = snapshots[:, rows_idx.long(), steps_acc]

            kernels = [SGLangTreeVerifyKernel(pools=x["pools"], max_depth=steps) for x in inputs]
            for kernel in kernels:
                kernel.reserve(b, t, h, dtype, device)

            def adapter_round(i):
                x, kernel = inputs[i], kernels[i]
                for l in range(layers):
                    kernel.target_verify(a_log, dt_bias, x["q"][l], x["k"][l], x["v"][l], x["a"][l], x["b"][l],
                                         ssm_states=x["pools"][l], cache_indices=slots, query_start_loc=qsl,
                                         cache_steps=t, retrieve_parent_token=parents)
                kernel.commit(steps_acc, slots)

            sglang_t = time_launches(sglang_round, sets, device, repeats=repeats)
            adapter_t = time_launches(adapter_round, sets, device, repeats=repeats)
            convert_t = time_launches(lambda i: sglang_tree(parents, max_depth=steps), 1, device, repeats=repeats)
            eager = {}
            if eager_turns > 0 and torch.device(device).type == "cuda":
                turns = {"sglang": [], "adapter": []}
                for _ in range(eager_turns):
                    turns["sglang"].append(time_eager_host(sglang_round, sets, device, repeats=10) / layers)
                    turns["adapter"].append(time_eager_host(adapter_round, sets, device, repeats=10) / layers)
                eager = {f"{name}_eager_us": round(statistics.median(values), 2) for name, values in turns.items()}
                eager["eager_speedup"] = eager["sglang_eager_us"] / eager["adapter_eager_us"]
            adapter_bytes = SGLangTreeVerifyKernel.transient_bytes_per_request_layer(t, h, dtype)
            per_layer = {name: v / layers if name.endswith("_us") else v for name, v in sglang_t.as_dict().items()}
            ours = {name: v / layers if name.endswith("_us") else v for name, v in adapter_t.as_dict().items()}
            rows.append({
                "batch": b, "steps": steps, "topk": topk, "draft_tokens": draft, "depth": max(depth_of),
                "layers_per_round": layers, "sglang_us": per_layer, "adapter_us": ours,
                "speedup_p50": sglang_t.p50_us / adapter_t.p50_us, "tree_conversion_us_per_round": convert_t.p50_us,
                "sglang_bytes_per_request_layer": t * h.hv * h.dv * h.dk * 4,
                "adapter_bytes_per_request_layer": adapter_bytes, "input_sets": sets, **eager,
            })
            del inputs, kernels, snapshots
            if progress:
                progress(rows[-1])
    return rows


def _main(argv=None) -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description="SGLang 0.5.23's GDN tree verify + commit against bole-tune's "
                                                 "adapter, per layer and round, on this GPU")
    parser.add_argument("--batches", default="1,4,16,32")
    parser.add_argument("--out", default=None, help="write the rows as JSON here (default: stdout)")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)

    def show(r):
        print(f"B={r['batch']:>2} ({r['steps']},{r['topk']},{r['draft_tokens']:>2}): SGLang "
              f"{r['sglang_us']['p50_us']:8.1f} us  adapter {r['adapter_us']['p50_us']:7.1f} us  "
              f"x{r['speedup_p50']:5.1f}  tree {r['tree_conversion_us_per_round']:5.1f} us/round  "
              f"bytes/req/layer {r['sglang_bytes_per_request_layer'] / 2**20:6.2f} MiB vs "
              f"{r['adapter_bytes_per_request_layer'] / 2**10:6.1f} KiB  ({r['layers_per_round']} layers/round, "
              f"{r['sglang_us']['method']})"
              + (f"; eager (wall time per layer and round): SGLang {r['sglang_eager_us']:.1f} us, adapter "
                 f"{r['adapter_eager_us']:.1f} us" if "sglang_eager_us" in r else ""), flush=True)

    rows = benchmark(batches=tuple(int(x) for x in args.batches.split(",")), repeats=args.repeats, progress=show)
    text = json.dumps(rows, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    _main()
