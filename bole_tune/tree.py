"""Proposal trees of a batch of requests, packed the way engines pack tokens.

A `TreeBatch` is built once per speculative round (the seed's "topology step") and shared by every
GDN layer of that round. Besides the packed parent array it holds what the kernels need to test
ancestry in O(1): a depth-first numbering per request, so that node ``j`` is an ancestor of node
``i`` (or ``i`` itself) exactly when ``dfs_enter[j] <= dfs_enter[i] <= dfs_exit[j]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass(frozen=True, eq=False)
class TreeBatch:
    """The proposal trees of ``num_requests`` requests, nodes packed request after request.

    Node ``n`` of request ``r`` is packed row ``offsets[r] + n``. All tensors live on ``device``.

    Attributes:
        offsets: ``[B + 1]`` int32, start of each request's nodes in the packed axis.
        parents: ``[N]`` int32, local parent index of each node, -1 for a root.
        node_depth: ``[N]`` int32, edges from the request's committed state's child (roots are 0).
        dfs_enter: ``[N]`` int32, local pre-order number of each node.
        dfs_exit: ``[N]`` int32, largest pre-order number in the node's subtree.
        sizes: tree size of each request (host list).
        depth: longest root-to-node path in edges, over the whole batch.
    """

    offsets: torch.Tensor
    parents: torch.Tensor
    node_depth: torch.Tensor
    dfs_enter: torch.Tensor
    dfs_exit: torch.Tensor
    sizes: tuple[int, ...]
    depth: int
    _host_parents: tuple[tuple[int, ...], ...] = field(repr=False)
    _host_depths: tuple[tuple[int, ...], ...] = field(repr=False)
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        # the kernels read these as int32 rows (and a launch is keyed on it): anything else is refused here
        for name in ("offsets", "parents", "node_depth", "dfs_enter", "dfs_exit"):
            x = getattr(self, name)
            if not isinstance(x, torch.Tensor) or x.dtype != torch.int32 or not x.is_contiguous():
                raise TypeError(f"TreeBatch.{name}: expected a contiguous int32 tensor (build trees with "
                                "TreeBatch.from_parents)")
            if x.device != self.offsets.device:
                raise ValueError(f"TreeBatch.{name}: on {x.device} but offsets are on {self.offsets.device}")
        # sizes asked on every call of the verify, worked out once
        self._cache["facts"] = (sum(self.sizes), max(self.sizes) if self.sizes else 0)

    @property
    def num_requests(self) -> int:
        return len(self.sizes)

    @property
    def num_nodes(self) -> int:
        return self._cache["facts"][0]

    @property
    def max_tree_size(self) -> int:
        return self._cache["facts"][1]

    @property
    def device(self) -> torch.device:
        return self.offsets.device

    @classmethod
    def from_parents(cls, parents_per_request: Sequence[Sequence[int]], device=None) -> "TreeBatch":
        """Build a batch from one list of local parent indices per request.

        ``-1`` marks a root (a node that hangs off the request's committed state; several roots are
        allowed). Every parent must precede its child. 1-D integer tensors and NumPy arrays are accepted in place
        of lists.
        """
        if isinstance(parents_per_request, torch.Tensor) or not isinstance(parents_per_request, Sequence):
            raise TypeError(
                "parents_per_request: expected a list with one list of parent indices per request, "
                f"got {type(parents_per_request).__name__}"
            )
        if len(parents_per_request) == 0:
            raise ValueError("parents_per_request: the batch is empty (need at least one request)")
        host_parents, host_depths, enters, exits = [], [], [], []
        for r, request in enumerate(parents_per_request):
            parents = _as_int_list(request, r)
            depths, enter, exit_ = _topology(parents, r)
            host_parents.append(tuple(parents))
            host_depths.append(tuple(depths))
            enters.extend(enter)
            exits.extend(exit_)
        sizes = tuple(len(p) for p in host_parents)
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + size)
        flat_parents = [p for request in host_parents for p in request]
        flat_depths = [d for request in host_depths for d in request]

        def tensor(values):
            return torch.tensor(values, dtype=torch.int32, device=device)

        return cls(
            offsets=tensor(offsets),
            parents=tensor(flat_parents),
            node_depth=tensor(flat_depths),
            dfs_enter=tensor(enters),
            dfs_exit=tensor(exits),
            sizes=sizes,
            depth=max(max(d) for d in host_depths),
            _host_parents=tuple(host_parents),
            _host_depths=tuple(host_depths),
        )

    def to(self, device) -> "TreeBatch":
        """The same trees with their tensors on ``device``."""
        return TreeBatch(
            offsets=self.offsets.to(device),
            parents=self.parents.to(device),
            node_depth=self.node_depth.to(device),
            dfs_enter=self.dfs_enter.to(device),
            dfs_exit=self.dfs_exit.to(device),
            sizes=self.sizes,
            depth=self.depth,
            _host_parents=self._host_parents,
            _host_depths=self._host_depths,
        )

    def parents_of(self, request: int) -> tuple[int, ...]:
        """Local parent indices of one request (host copy)."""
        return self._host_parents[request]

    def path_to(self, request: int, node: int) -> list[int]:
        """Local indices from the root down to ``node`` (inclusive)."""
        path = []
        parents = self._host_parents[request]
        while node >= 0:
            path.append(node)
            node = parents[node]
        return path[::-1]

    def ancestor_mask(self, request: int, device=None) -> torch.Tensor:
        """``[T, T]`` bool over one request's local nodes: ``mask[i, j]`` when node j is node i or one of
        its ancestors (i's pre-order number lies in j's depth-first interval)."""
        lo, hi = int(self.offsets[request]), int(self.offsets[request + 1])
        enter = self.dfs_enter[lo:hi].to(device or "cpu").long()
        exit_ = self.dfs_exit[lo:hi].to(device or "cpu").long()
        return (enter[None, :] <= enter[:, None]) & (enter[:, None] <= exit_[None, :])

    def ancestor_table(self, width: int) -> torch.Tensor:
        """``[N, width]`` int32: for each node, its ancestor at distance 1..width.

        An ancestor inside the tree is its packed row (>= 0). Past a root the window continues into
        the request's committed inputs: ``-m`` is the m-th most recent committed input (-1 the last).
        This is what the tree-parallel causal convolution reads (width = conv width - 1). Cached.
        """
        key = ("ancestors", width)
        if key not in self._cache:
            rows = []
            for r, parents in enumerate(self._host_parents):
                base = sum(self.sizes[:r])
                depths = self._host_depths[r]
                for n in range(len(parents)):
                    row, node = [], n
                    for m in range(1, width + 1):
                        if m <= depths[n]:
                            node = parents[node]
                            row.append(base + node)
                        else:
                            row.append(-(m - depths[n]))
                    rows.append(row)
            self._cache[key] = torch.tensor(rows, dtype=torch.int32, device=self.device).reshape(-1, width)
        return self._cache[key]

    def request_of_node(self) -> torch.Tensor:
        """``[N]`` int32: the request each packed node belongs to. Cached."""
        key = "request_of_node"
        if key not in self._cache:
            ids = [r for r, size in enumerate(self.sizes) for _ in range(size)]
            self._cache[key] = torch.tensor(ids, dtype=torch.int32, device=self.device)
        return self._cache[key]

    def block_depths(self, block: int) -> tuple[torch.Tensor, int]:
        """Per request and node block of ``block`` rows, the depth of the forest the block induces.

        Inside a block the verifier solves ``(I + G_bb) U_b = rhs`` by as many substitution sweeps as
        that forest is deep (a node whose parent lies in an earlier block is a root there), so a
        64-node tree of depth 8 costs 8 sweeps, not 63. Returns ``([B, max_blocks] int32,
        max_blocks)``, cached per block size.
        """
        if block not in self._cache:
            max_blocks = -(-self.max_tree_size // block)
            table = []
            for parents in self._host_parents:
                local = [0] * len(parents)
                row = [0] * max_blocks
                for n, p in enumerate(parents):
                    if p >= 0 and p // block == n // block:
                        local[n] = local[p] + 1
                    row[n // block] = max(row[n // block], local[n])
                table.append(row)
            tensor = torch.tensor(table, dtype=torch.int32, device=self.device)
            self._cache[block] = (tensor, max_blocks)
        return self._cache[block]


def _as_int_list(request, r: int) -> list[int]:
    if isinstance(request, torch.Tensor):
        if request.dim() != 1 or request.dtype.is_floating_point or request.dtype == torch.bool:
            raise TypeError(
                f"parents_per_request[{r}]: expected a 1-D integer tensor, "
                f"got dtype {request.dtype} with shape {tuple(request.shape)}"
            )
        return [int(x) for x in request.tolist()]
    kind = getattr(getattr(request, "dtype", None), "kind", None)  # a NumPy array: its dtype's kind ("i", "u", ...)
    if kind is not None and hasattr(request, "ndim") and hasattr(request, "tolist"):
        if request.ndim != 1 or kind not in "iu":
            raise TypeError(f"parents_per_request[{r}]: expected a 1-D integer array, "
                            f"got dtype {request.dtype} with shape {tuple(request.shape)}")
        return [int(x) for x in request.tolist()]
    if isinstance(request, (str, bytes)) or not isinstance(request, Sequence):
        raise TypeError(f"parents_per_request[{r}]: expected a list of ints, got {type(request).__name__}")
    values = []
    for n, p in enumerate(request):
        if isinstance(p, bool) or not isinstance(p, int):
            if isinstance(p, torch.Tensor) and p.dim() == 0 and not p.dtype.is_floating_point and p.dtype != torch.bool:
                p = int(p)
            elif getattr(getattr(p, "dtype", None), "kind", None) in ("i", "u") and getattr(p, "ndim", None) == 0:
                p = int(p)  # a NumPy integer scalar
            else:
                raise TypeError(f"parents_per_request[{r}][{n}]: expected an int, got {p!r}")
        values.append(p)
    return values


def _topology(parents: list[int], r: int) -> tuple[list[int], list[int], list[int]]:
    """Validate one request's parents; return node depths and the pre-order enter/exit numbers."""
    size = len(parents)
    if size == 0:
        raise ValueError(f"parents_per_request[{r}]: request {r} has no nodes (every tree needs a root)")
    children: list[list[int]] = [[] for _ in range(size)]
    roots = []
    depths = [0] * size
    for n, p in enumerate(parents):
        if p < -1:
            raise ValueError(
                f"parents_per_request[{r}][{n}]: parent {p} is out of range (-1 for a root, else 0..{n - 1})"
            )
        if p >= n:
            raise ValueError(
                f"parents_per_request[{r}][{n}]: parent {p} does not precede its child {n} "
                "(nodes must be numbered parent before child)"
            )
        if p == -1:
            roots.append(n)
        else:
            children[p].append(n)
            depths[n] = depths[p] + 1
    enter = [0] * size
    exit_ = [0] * size
    counter = 0
    stack = [(root, False) for root in reversed(roots)]
    while stack:
        node, done = stack.pop()
        if done:
            exit_[node] = counter - 1
            continue
        enter[node] = counter
        counter += 1
        stack.append((node, True))
        stack.extend((child, False) for child in reversed(children[node]))
    return depths, enter, exit_
