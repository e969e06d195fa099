"""Best-first candidate trees from per-position marginals (pure functions, no model state).

A node is a drafted string z_1..z_d; its score is sum_j log q_j(z_j) over the ORIGINAL (full-vocabulary)
marginals. Only the top-K tokens of each position are candidates. Because the scores along a path only fall,
popping the best frontier node and pushing (a) its first child and (b) its next sibling enumerates strings in
exactly non-increasing score order: N pops and at most 2N pushes, which keeps tree building off the critical
path even at N = 127.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tree:
    """Nodes in selection order; parents always precede children. Depths are 1-based (the root is depth 0)."""

    tokens: list[int]
    parents: list[int]  # index of the parent node, -1 for children of the root
    depths: list[int]
    scores: list[float]  # summed log-probabilities

    def __len__(self) -> int:
        return len(self.tokens)

    def head(self, n: int) -> "Tree":
        """The first n nodes: best-first order makes every prefix of the node list a prefix-closed tree."""
        return Tree(self.tokens[:n], self.parents[:n], self.depths[:n], self.scores[:n])

    @staticmethod
    def empty() -> "Tree":
        return Tree([], [], [], [])


def _topk_lists(logprobs: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [L, V], got shape {tuple(logprobs.shape)}")
    k = min(k, logprobs.shape[1])
    vals, ids = logprobs.float().topk(k, dim=-1)  # sorted descending
    return vals.tolist(), ids.tolist()  # one host transfer for the whole block


def universe_size(depth: int, top_k_per_position: int) -> int:
    """Number of strings in the top-K universe of a depth-L block: K + K^2 + ... + K^L."""
    return sum(top_k_per_position ** d for d in range(1, depth + 1))


def build_tree(logprobs: torch.Tensor, width: int, top_k_per_position: int | None = None, *,
               top_k: int | None = None) -> Tree:
    """The `width` highest-scoring strings of the universe of the top `top_k_per_position` tokens at each
    position, as a prefix-closed tree (`top_k`: the parameter's earlier name, still accepted).

    Widths beyond the universe are clamped to it. Ties go to the shallower node (a prefix never loses to its
    extension), then to the earlier-found node.
    """
    if (top_k is None) == (top_k_per_position is None):
        raise TypeError("build_tree() takes top_k_per_position (or its earlier name top_k), exactly once")
    return build_forest([logprobs], width, top_k if top_k is not None else top_k_per_position)[0]


def build_forest(logprobs: list[torch.Tensor], budget: int, top_k_per_position: int,
                 max_width: list[int] | None = None) -> list[Tree]:
    """Global best-first selection over several requests sharing one budget of `budget` nodes in total.

    Every request's candidates compete in one heap, so the shared budget goes to the highest-scoring strings
    wherever they are (unequal widths). `max_width` optionally caps each request. Strings of probability 0
    (log-probability -inf) are never taken.
    """
    if budget < 0 or top_k_per_position < 1:
        raise ValueError(f"width must be >= 0 and top_k_per_position >= 1 (got {budget}, {top_k_per_position})")
    tables = [_topk_lists(lp, top_k_per_position) for lp in logprobs]
    out = [([], [], [], []) for _ in logprobs]
    caps = max_width or [budget] * len(logprobs)
    # entries: (-score, depth, tiebreak, request, parent_node, position_rank)
    heap: list[tuple] = []
    counter = 0
    for r, (vals, _) in enumerate(tables):
        if vals and caps[r] > 0:
            heap.append((-vals[0][0], 1, counter, r, -1, 0))
            counter += 1
    heapq.heapify(heap)
    taken = 0
    while heap and taken < budget:
        neg, depth, _, r, parent, rank = heapq.heappop(heap)
        if neg == float("inf"):  # only zero-probability strings are left (outside a draft vocabulary)
            break
        vals, ids = tables[r]
        tokens, parents, depths, scores = out[r]
        if len(tokens) >= caps[r]:
            continue
        node = len(tokens)
        tokens.append(ids[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        scores.append(-neg)
        taken += 1
        base = -neg - vals[depth - 1][rank]  # the parent's score
        if rank + 1 < len(vals[depth - 1]):
            heapq.heappush(heap, (-(base + vals[depth - 1][rank + 1]), depth, counter, r, parent, rank + 1))
            counter += 1
        if depth < len(vals):
            heapq.heappush(heap, (-(-neg + vals[depth][0]), depth + 1, counter, r, node, 0))
            counter += 1
    return [Tree(*lists) for lists in out]


def chain(logprobs: torch.Tensor) -> Tree:
    """The standard DFlash chain: the top-1 token at every position."""
    return build_tree(logprobs, logprobs.shape[0], 1)
