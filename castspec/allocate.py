"""Who gets how many tree nodes this round: allocation policies over B requests' candidate universes.

Every policy maps the drafted marginals of the requests that draft this round to one best-first tree each.
With one request, `fixed` and `cost` are the paper's fixed width N and the per-round cost-aware width; under
load `shared` spends one global budget M on the highest-scoring candidates wherever they are (Proposition 2),
and `cost` also picks M from the measured cost of the whole batched verify (Proposition 3).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .cost import RoundWidth
from .tree import Tree, build_forest, build_tree, universe_size

POLICIES = ("chain", "fixed", "uniform", "shared", "cost")


class Policy:
    name = "base"

    def max_nodes(self, depth: int) -> int:
        """The most nodes one request's tree can get (sizes its KV cache)."""
        raise NotImplementedError

    def allocate(self, logprobs: list[torch.Tensor], prefixes: list[int]) -> list[Tree]:
        raise NotImplementedError

    def should_draft(self) -> bool:
        """Whether this round drafts at all (a round without a draft is a plain autoregressive step)."""
        return True

    def update(self, committed: int, round_ms: float, drafted: bool = True) -> None:
        """Feedback after each round: tokens committed by the whole batch and the round's wall time."""

    def observe(self, tree: Tree, path: list[int]) -> None:
        """Feedback per verified request: its tree and the accepted pack rows (for calibrating masses)."""


class Chain(Policy):
    """Standard DFlash: the top-1 token at every drafted position."""

    name = "chain"

    def max_nodes(self, depth: int) -> int:
        return depth

    def allocate(self, logprobs, prefixes):
        return [build_tree(lp, lp.shape[0], 1) for lp in logprobs]


@dataclass
class FixedWidth(Policy):
    """Every request gets its own top-`width` tree."""

    width: int
    top_k: int = 8
    name = "fixed"

    def max_nodes(self, depth: int) -> int:
        return min(self.width, universe_size(depth, self.top_k))

    def allocate(self, logprobs, prefixes):
        return [build_tree(lp, self.width, self.top_k) for lp in logprobs]


@dataclass
class UniformSplit(Policy):
    """One budget of `budget` nodes split evenly across the requests (the static baseline of Prop. 2)."""

    budget: int
    top_k: int = 8
    name = "uniform"

    def max_nodes(self, depth: int) -> int:
        return min(self.budget, universe_size(depth, self.top_k))

    def allocate(self, logprobs, prefixes):
        share, extra = divmod(self.budget, max(len(logprobs), 1))
        return [build_tree(lp, share + (i < extra), self.top_k) for i, lp in enumerate(logprobs)]


@dataclass
class SharedBudget(Policy):
    """Global best-first over one shared budget: the `budget` highest-scoring candidates of all requests."""

    budget: int
    top_k: int = 8
    name = "shared"

    def max_nodes(self, depth: int) -> int:
        return min(self.budget, universe_size(depth, self.top_k))

    def allocate(self, logprobs, prefixes):
        return build_forest(logprobs, self.budget, self.top_k)


class CostAware(Policy):
    """Global best-first with the budget chosen from measured costs: keep adding the best remaining candidate
    of any request while its mass pays for the extra packed token at the running throughput (RoundWidth).

    Drafting itself is a cost too: when drafted rounds have been committing fewer tokens per ms than plain
    autoregressive rounds, the policy stops drafting and re-tries a drafted round after `explore_every`
    plain rounds, doubling that gap after every try that still loses (up to `max_explore_every`) and resetting
    it when drafting wins again, so a prompt on which the drafter does well gets it back while a deployment
    where drafting never pays loses little to the tries (Theorem 2's N = 0 with the draft unpaid).

    Two things keep one unlucky round from switching a good drafter off for the rest of a request: the first
    drafted round does not enter the throughput estimate (its drafter pass also reads the whole prompt's
    features: up to twice a later pass, measured), and a try after plain rounds weighs half of the estimate
    (it is the only recent evidence; with the usual 0.2 weight a low estimate needed many winning tries, each
    one a back-off apart).
    """

    name = "cost"

    def __init__(self, rule: RoundWidth, top_k: int = 8, explore_every: int = 8, momentum: float = 0.8,
                 max_explore_every: int = 64):
        self.rule, self.top_k = rule, top_k
        self.explore_every, self.momentum = explore_every, momentum
        self.min_explore, self.max_explore = explore_every, max_explore_every
        self.plain_rate: float | None = None  # committed tokens per ms of rounds without a draft
        self.skipped = 0
        self.batch = 1  # requests in the last drafted round
        self.warmed_up = False  # the first drafted round has run (and was left out of the estimate)

    def _plain_rate(self) -> float:
        """Measured once plain rounds have run; before that, the profile's price of a verify of B roots."""
        if self.plain_rate is not None:
            return self.plain_rate
        prof = self.rule.profile
        return self.batch / max(prof.batch_verify_at(self.batch, self.batch, prof.prefix_lens[0]) + prof.host_at(0), 1e-6)

    def max_nodes(self, depth: int) -> int:
        return min(self.rule.max_width, universe_size(depth, self.top_k))

    def should_draft(self) -> bool:
        if self.rule.lam is None:
            return True
        if self.plain_rate is None:
            # measure one plain round as soon as one drafted round has: until then the plain rate is the
            # profile's guess, and a profile probed on a busy machine would otherwise keep a losing draft forever
            return False
        if self.rule.lam >= self._plain_rate():
            return True
        return self.skipped + 1 >= self.explore_every

    def allocate(self, logprobs, prefixes):
        cap = self.max_nodes(logprobs[0].shape[0]) if logprobs else 0
        self.batch = max(len(logprobs), 1)
        trees = build_forest(logprobs, cap * len(logprobs), self.top_k, [cap] * len(logprobs))
        counts = self.rule.allocate([t.scores for t in trees], [t.depths for t in trees], prefixes)
        return [t.head(c) for t, c in zip(trees, counts)]

    def observe(self, tree: Tree, path: list[int]) -> None:
        self.rule.observe(tree, path)

    def update(self, committed: int, round_ms: float, drafted: bool = True) -> None:
        if drafted:
            was_skipping = self.skipped > 0
            self.skipped = 0
            if not self.warmed_up:
                self.warmed_up = True
                return
            self.rule.update(committed, round_ms, weight=0.5 if was_skipping else None)
            rate = committed / max(round_ms, 1e-6)
            if self.rule.lam >= self._plain_rate():
                self.explore_every = self.min_explore
            elif was_skipping and rate < self._plain_rate():  # a try that lost: wait longer before the next
                self.explore_every = min(2 * self.explore_every, self.max_explore)
            return
        self.skipped += 1
        rate = committed / max(round_ms, 1e-6)
        self.plain_rate = rate if self.plain_rate is None else self.momentum * self.plain_rate + (1 - self.momentum) * rate


def make_policy(name: str, width: int = 15, top_k: int = 8, rule: RoundWidth | None = None) -> Policy:
    """`width` is the per-request width for `fixed` and the whole batch's budget for `uniform`/`shared`."""
    if name == "chain":
        return Chain()
    if name == "fixed":
        return FixedWidth(width, top_k)
    if name == "uniform":
        return UniformSplit(width, top_k)
    if name == "shared":
        return SharedBudget(width, top_k)
    if name == "cost":
        if rule is None:
            raise ValueError("the cost-aware policy needs a measured cost profile")
        return CostAware(rule, top_k)
    raise ValueError(f"unknown allocation policy {name!r}; choose one of {', '.join(POLICIES)}")
