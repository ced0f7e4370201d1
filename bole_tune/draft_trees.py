"""Draft trees each engine can build, scored by an acceptance model.

- ``bole``: any tree (bole-tune's own verifier takes arbitrary parents); `best_first_tree` is the tree of
  largest expected accepted length for a node count.
- ``sglang``: EAGLE beam trees of (``speculative_num_steps``, ``speculative_eagle_topk``,
  ``speculative_num_draft_tokens``), built as SGLang 0.5.23 builds them (`SGLangBeam`).
- ``vllm``: chains of K (`chain_tree`).

A node's score is its path probability under the acceptance model (the chance the target accepts it and
every node above it); the expected accepted length of a tree is the sum of its nodes' scores, since the
siblings of one parent exclude each other.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property

from bole_tune.acceptance import AcceptanceModel

MAX_DEPTH = 8  # the deepest draft the published acceptance data covers, and the verifier's tested depth


@dataclass(frozen=True)
class DraftTree:
    parents: tuple[int, ...]  # draft nodes only, parent before child; -1: hangs off the committed token
    ranks: tuple[int, ...]  # rank among the siblings, 1 = the drafter's top choice
    probabilities: tuple[float, ...]  # P(node accepted), the product along its path

    @property
    def expected_accepted(self) -> float:
        return sum(self.probabilities)

    @cached_property
    def depths(self) -> list[int]:
        return tree_depths(self.parents)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def width(self) -> int:
        """The most nodes at one depth."""
        return max((self.depths.count(d) for d in set(self.depths)), default=0)

    def expanded_per_level(self) -> list[int]:
        """Per depth d = 1..depth, the nodes at depth d - 1 with children (the root counts as 1): the
        tokens per request a drafter runs to propose depth d."""
        out = []
        for d in range(1, self.depth + 1):
            out.append(len({p for p, dp in zip(self.parents, self.depths) if dp == d}))
        return out


def tree_depths(parents) -> list[int]:
    depths = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def off_main_line(parents, ranks) -> list[bool]:
    """Per node: whether an alternative (rank >= 2) lies strictly above it."""
    off = []
    for p in parents:
        off.append(p >= 0 and (off[p] or ranks[p] > 1))
    return off


def path_probabilities(model: AcceptanceModel, parents, ranks) -> tuple[float, ...]:
    """P(node accepted) of each node of an arbitrary tree."""
    depths, off, probs = tree_depths(parents), off_main_line(parents, ranks), []
    for p, r, d, o in zip(parents, ranks, depths, off):
        probs.append((1.0 if p < 0 else probs[p]) * model.child_probability(d, r, o))
    return tuple(probs)


def best_first_tree(model: AcceptanceModel, nodes: int, chain: bool = False, max_depth: int = MAX_DEPTH) -> DraftTree:
    """The ``nodes``-node draft tree of depth <= ``max_depth`` of largest expected accepted length
    (``chain``: top-1 only). Greedy is optimal: a child is never likelier than its parent nor a sibling
    than the one ranked above it, so the best n-node tree extends the best (n - 1)-node tree."""
    parents, ranks, probs, off = [], [], [], []
    heap = [(-model.child_probability(1, 1), 0, -1, 1, 1, False)]  # (-p, order, parent, rank, depth, off line)
    counter = 1
    while heap and len(parents) < nodes:
        neg_p, _, parent, rank, depth, below_alternative = heapq.heappop(heap)
        if neg_p >= 0.0:
            break
        index = len(parents)
        parents.append(parent)
        ranks.append(rank)
        probs.append(-neg_p)
        off.append(below_alternative)
        base = 1.0 if parent < 0 else probs[parent]
        if not chain and rank < model.max_rank:  # the next sibling
            p = base * model.child_probability(depth, rank + 1, below_alternative)
            heapq.heappush(heap, (-p, counter, parent, rank + 1, depth, below_alternative))
            counter += 1
        if depth < max_depth:
            child_off = below_alternative or rank > 1
            heapq.heappush(heap, (neg_p * model.child_probability(depth + 1, 1, child_off), counter, index, 1,
                                  depth + 1, child_off))
            counter += 1
    return DraftTree(tuple(parents), tuple(ranks), tuple(probs))


def chain_tree(model: AcceptanceModel, length: int) -> DraftTree:
    """K top-ranked draft tokens in a row (a vLLM MTP chain, an SGLang topk-1 draft)."""
    parents = tuple(range(-1, length - 1))
    ranks = (1,) * length
    return DraftTree(parents, ranks, path_probabilities(model, parents, ranks))


def check_sglang_shape(steps, topk, draft_tokens) -> None:
    """Raise ValueError naming the flag when SGLang cannot run (steps, topk, num_draft_tokens)."""
    for flag, value in (("speculative_num_steps", steps), ("speculative_eagle_topk", topk),
                        ("speculative_num_draft_tokens", draft_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag}: expected a positive int, got {value!r}")
    if topk == 1 and draft_tokens != steps + 1:
        raise ValueError(f"speculative_num_draft_tokens: {draft_tokens} with speculative_eagle_topk 1; SGLang sets "
                         f"it to speculative_num_steps + 1 = {steps + 1} (a chain)")
    candidates = topk + (steps - 1) * topk * topk
    if not 2 <= draft_tokens <= candidates + 1:
        raise ValueError(f"speculative_num_draft_tokens: {draft_tokens} is outside 2..{candidates + 1} (the root plus "
                         f"the {candidates} nodes {steps} steps of top-{topk} beam search propose)")


class SGLangBeam:
    """The draft nodes SGLang 0.5.23 proposes with ``steps`` steps of top-``topk`` beam search, and the
    tree it verifies for each ``num_draft_tokens``.

    As in ``sglang/srt/speculative/spec_utils.py`` (``select_top_k_tokens``) and ``eagle_utils.py``
    (``organize_draft_results``): step 1 expands the root into its top-``topk`` children, which are the
    first beam; each later step expands every beam node into its top-``topk`` children (``topk^2``
    candidates, scored by cumulative probability) and keeps the best ``topk`` as the next beam. Every
    candidate of every step is kept in one list; the verified tree is the best ``num_draft_tokens - 1``
    of them by score, in list order, plus the root. A child's score never exceeds its parent's and a
    parent precedes its children in the list, so with ties going to the earlier candidate (as here) the
    kept set is ancestor-closed.
    """

    def __init__(self, model: AcceptanceModel, steps: int, topk: int):
        check_sglang_shape(steps, topk, steps + 1 if topk == 1 else 2)
        self.steps, self.topk = steps, topk
        # candidates in SGLang's list order: (parent candidate index or -1, rank, score, off main line)
        cands = [(-1, r, model.child_probability(1, r), False) for r in range(1, topk + 1)]
        beam = list(range(topk))
        for depth in range(2, steps + 1):
            start = len(cands)
            for b in beam:
                _, rank, score, off = cands[b]
                child_off = off or rank > 1
                cands += [(b, r, score * model.child_probability(depth, r, child_off), child_off)
                          for r in range(1, topk + 1)]
            level = range(start, len(cands))
            beam = sorted(level, key=lambda i: (-cands[i][2], i))[:topk]
        self.candidates = cands
        self.order = sorted(range(len(cands)), key=lambda i: (-cands[i][2], i))  # best first, ties: earlier
        self.prefix = [0.0]
        for i in self.order:
            self.prefix.append(self.prefix[-1] + cands[i][2])

    @property
    def max_draft_tokens(self) -> int:
        return self.steps + 1 if self.topk == 1 else len(self.candidates) + 1

    def expected_accepted(self, draft_tokens: int) -> float:
        return self.prefix[draft_tokens - 1]

    def tree(self, draft_tokens: int) -> DraftTree:
        check_sglang_shape(self.steps, self.topk, draft_tokens)
        kept = sorted(self.order[: draft_tokens - 1])
        local = {c: n for n, c in enumerate(kept)}
        parents = []
        for c in kept:
            parent = self.candidates[c][0]
            if parent >= 0 and parent not in local:
                raise AssertionError(f"SGLang beam tree not ancestor-closed at candidate {c}")
            parents.append(local[parent] if parent >= 0 else -1)
        return DraftTree(tuple(parents), tuple(self.candidates[c][1] for c in kept),
                         tuple(self.candidates[c][2] for c in kept))

    def drafter_tokens(self) -> list[int]:
        """Tokens per request the drafter runs at each step: the root, then the ``topk`` beam nodes."""
        return [1] + [self.topk] * (self.steps - 1)
