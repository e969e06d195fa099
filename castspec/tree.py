"""Best-first candidate trees from per-position marginals (pure functions, no model state).

A node is a drafted string z_1..z_d; its score is sum_j log q_j(z_j) over the ORIGINAL (full-vocabulary)
marginals. Only the top-K tokens of each position are candidates; equal log-probabilities at one position rank the
smaller token id first. A drafter with a draft vocabulary gives every other token probability 0, so its top K are
found among the draft vocabulary's columns alone (`Marginals.on_support` with its `support`): the same trees as
from the full-vocabulary tensor, at a fraction of the top-K work. Because the scores along a path only fall,
popping the best frontier node and pushing (a) its first child and (b) its next sibling enumerates strings in
exactly non-increasing score order: N pops and at most 2N pushes, which keeps tree building off the critical
path even at N = 127.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable

import torch

from .native import build as native


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


@dataclass
class Marginals:
    """A drafted block's per-position log-probabilities, as a round passes them on.

    `on_support` [L, S] holds the log-probabilities of the token ids `support` [S], in that order; every other
    token of the `vocab_size` has log-probability -inf. Without a draft vocabulary `support` is None and
    `on_support` covers the whole vocabulary. Trees are built from (`on_support`, `support`); `full` [L, V], the
    whole-vocabulary tensor that sampling reads, is made on first use only: a greedy round never needs it, and for
    a batch of requests it is tens of megabytes to fill.
    """

    on_support: torch.Tensor
    support: torch.Tensor | None = None
    vocab_size: int | None = None
    _full: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def dense(cls, full: torch.Tensor) -> "Marginals":
        """Marginals that may give any token a positive probability."""
        return cls(full, None, full.shape[-1], full)

    @property
    def full(self) -> torch.Tensor:
        if self._full is None:
            out = torch.full((*self.on_support.shape[:-1], self.vocab_size), float("-inf"),
                             device=self.on_support.device)
            self._full = out.index_copy_(-1, self.support.to(out.device), self.on_support)
        return self._full

    def split(self, depths: list[int]) -> list["Marginals"]:
        """Per-request marginals of a batched pass whose rows are the requests' blocks one after the other."""
        if len(depths) == 1 and depths[0] == self.on_support.shape[0]:
            return [self]  # a pass of one request: every round of a lone request
        if self.support is None:
            return [Marginals.dense(f) for f in self.on_support.split(depths)]
        return [Marginals(s, self.support, self.vocab_size) for s in self.on_support.split(depths)]


def _topk_lists(logprobs: torch.Tensor, k: int,
                support: torch.Tensor | None = None) -> tuple[list[list[float]], list[list[int]]]:
    """The top k log-probabilities of every row, descending, and their token ids (column c is token
    `support[c]`, or c without a support); equal values in token-id order."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [L, V], got shape {tuple(logprobs.shape)}")
    if support is not None and tuple(support.shape) != (logprobs.shape[1],):
        raise ValueError(f"support must hold one token id per column of logprobs ({logprobs.shape[1]}), got "
                         f"shape {tuple(support.shape)}")
    n = logprobs.shape[1]
    k = min(k, n)
    lp = logprobs.float()
    ranked = native.topk_rows(lp, k, support)  # ties already by token id
    if ranked is not None:
        return ranked[0].tolist(), ranked[1].tolist()  # one host transfer for the whole block
    # one more than k: a value tied across the k-th place shows up as two equal neighbours
    vals, cols = lp.topk(min(k + 1, n), dim=-1)  # sorted descending
    ids = cols if support is None else support.to(cols.device)[cols]
    vals, ids = vals.tolist(), ids.tolist()
    for r, v in enumerate(vals):
        if len(set(v)) < len(v):  # topk leaves the order of equal values unspecified: settle it by token id
            vals[r], ids[r] = _ties_by_token_id(lp[r], support, v, ids[r], k)
    return [v[:k] for v in vals], [t[:k] for t in ids]


def _ties_by_token_id(row: torch.Tensor, support: torch.Tensor | None, vals: list[float], ids: list[int],
                      k: int) -> tuple[list[float], list[int]]:
    """The top k of one row (given its top k+1 in some order) with equal values ranked by token id, smaller
    first; a value tied at the k-th place is looked up over the whole row, so the tokens kept do not depend on
    which columns the row has (full vocabulary or a support)."""
    kth = vals[k - 1]
    if len(vals) == k or vals[k] < kth:
        # no token outside the list holds the k-th value (it would rank above the (k+1)-th): the list decides,
        # without a look over the row (ties are common: the drafter's logits come from bf16 products)
        ranked = sorted((-v, t) for v, t in zip(vals, ids))[:k]
        return [-v for v, _ in ranked], [t for _, t in ranked]
    ranked = sorted((-v, t) for v, t in zip(vals, ids) if v > kth)
    if kth == float("-inf"):
        # probability-0 candidates are never taken, so which of them fill the list does not matter
        tied = sorted(t for v, t in zip(vals[:k], ids[:k]) if v == kth)
    else:
        cols = (row == kth).nonzero().flatten()
        tied = sorted((cols if support is None else support.to(cols.device)[cols]).tolist())
    ranked += [(-kth, t) for t in tied[:k - len(ranked)]]
    return [-v for v, _ in ranked], [t for _, t in ranked]


def _joined(rows: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat of 2-d tensors, without the copy when they already lie one after the other in one storage (the
    per-request parts of a batched pass, Marginals.split)."""
    first = rows[0]
    end = first.storage_offset()
    for t in rows:
        if (not t.is_contiguous() or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.storage_offset() != end or t.shape[1:] != first.shape[1:]):
            return torch.cat(rows)
        end += t.numel()
    return first.as_strided((sum(t.shape[0] for t in rows), *first.shape[1:]), first.stride())


def _topk_tables(logprobs: list[torch.Tensor], k: int, supports: list[torch.Tensor | None]):
    """_topk_lists of every request, with one top-k over all requests that share a support (a batched drafter
    pass gives them all the same one): under load, one call for 16 requests' blocks instead of 16."""
    tables: list = [None] * len(logprobs)
    groups: dict[tuple, list[int]] = {}
    for r, (lp, sup) in enumerate(zip(logprobs, supports)):
        key = (id(sup), lp.shape[-1], lp.dtype, lp.device) if lp.dim() == 2 else ("alone", r)
        groups.setdefault(key, []).append(r)
    for members in groups.values():
        if len(members) == 1:
            r = members[0]
            tables[r] = _topk_lists(logprobs[r], k, supports[r])
            continue
        vals, ids = _topk_lists(_joined([logprobs[r] for r in members]), k, supports[members[0]])
        start = 0
        for r in members:
            end = start + logprobs[r].shape[0]
            tables[r] = (vals[start:end], ids[start:end])
            start = end
    return tables


def universe_size(depth: int, top_k_per_position: int) -> int:
    """Number of strings in the top-K universe of a depth-L block: K + K^2 + ... + K^L."""
    return sum(top_k_per_position ** d for d in range(1, depth + 1))


def build_tree(logprobs: torch.Tensor, width: int, top_k_per_position: int | None = None, *,
               top_k: int | None = None, support: torch.Tensor | None = None) -> Tree:
    """The `width` highest-scoring strings of the universe of the top `top_k_per_position` tokens at each
    position, as a prefix-closed tree (`top_k`: the parameter's earlier name, still accepted).

    `logprobs` is [L, V] over the whole vocabulary, or with `support` (token ids [S]) [L, S] over those tokens
    only, every other token having probability 0: the tree is the same either way. Widths beyond the universe
    are clamped to it. Ties go to the shallower node (a prefix never loses to its extension), then to the
    earlier-found node.
    """
    if (top_k is None) == (top_k_per_position is None):
        raise TypeError("build_tree() takes top_k_per_position (or its earlier name top_k), exactly once")
    return build_forest([logprobs], width, top_k if top_k is not None else top_k_per_position,
                        supports=[support])[0]


def build_forest(logprobs: list[torch.Tensor], budget: int, top_k_per_position: int,
                 max_width: list[int] | None = None,
                 supports: list[torch.Tensor | None] | None = None,
                 stop: Callable[[int, float], bool] | None = None) -> list[Tree]:
    """Global best-first selection over several requests sharing one budget of `budget` nodes in total.

    Every request's candidates compete in one heap, so the shared budget goes to the highest-scoring strings
    wherever they are (unequal widths). `max_width` optionally caps each request. `supports` optionally gives
    each request's column token ids (None: its columns are the whole vocabulary), as in `build_tree`. Strings
    of probability 0 (log-probability -inf) are never taken. `stop(taken, score)`, asked before each node with
    the number taken so far and the best remaining score, ends the selection when it says so (the cost rule's
    proof that no further node can pay: RoundWidth.stop_rule).
    """
    if budget < 0 or top_k_per_position < 1:
        raise ValueError(f"width must be >= 0 and top_k_per_position >= 1 (got {budget}, {top_k_per_position})")
    supports = supports or [None] * len(logprobs)
    if len(supports) != len(logprobs):
        raise ValueError(f"one support per request: {len(supports)} supports for {len(logprobs)} requests")
    tables = _topk_tables(logprobs, top_k_per_position, supports)
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
        if stop is not None and stop(taken, -heap[0][0]):
            break
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


def chain(logprobs: torch.Tensor, support: torch.Tensor | None = None) -> Tree:
    """The standard DFlash chain: the top-1 token at every position."""
    return build_tree(logprobs, logprobs.shape[0], 1, support=support)
