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

    Drafting itself is a cost too (Theorem 2's N = 0 with the draft unpaid): when drafted rounds have been
    committing fewer tokens per ms than plain autoregressive rounds, the policy stops drafting and, after
    `explore_every` plain rounds, tries a short burst of `try_rounds` drafted rounds; the gap doubles after
    every burst that loses (up to `max_explore_every`) and resets when drafting wins again.

    One round is weak evidence: it commits 1 to 4+ tokens, so short averages of a drafter that wins by a
    third on average still dip below plain rounds in runs of bad luck. In round traces on held-out prompts,
    the per-round estimate alone switched drafting off for long stretches of math and chat responses (once
    after two single-token rounds) on which a fixed width beat plain decoding. Hence: every
    request drafts its first `min_drafted` rounds; draft-or-not uses a slow estimate of drafted throughput
    (`decision_momentum`, about 20 rounds; the width rule keeps its own faster lambda); tries are bursts whose
    mean weighs half of the estimate. Under load all three count request-rounds, not rounds: a round of 16
    requests is already an average of 16 outcomes, and its trees cost far more than one request's. The first
    drafted round enters no estimate: its drafter pass also reads the whole prompt's features (up to twice a
    later pass, measured).
    """

    name = "cost"

    def __init__(self, rule: RoundWidth, top_k: int = 8, explore_every: int = 8, momentum: float = 0.8,
                 max_explore_every: int = 64, decision_momentum: float = 0.95, min_drafted: int = 6,
                 try_rounds: int = 3):
        self.rule, self.top_k = rule, top_k
        self.explore_every, self.momentum = explore_every, momentum
        self.min_explore, self.max_explore = explore_every, max_explore_every
        self.decision_momentum, self.min_drafted, self.try_rounds = decision_momentum, min_drafted, try_rounds
        self.draft_rate: float | None = None  # committed tokens per ms of drafted rounds (slow EMA)
        self.plain_rate: float | None = None  # committed tokens per ms of rounds without a draft
        # evidence is counted in request-rounds (one request's outcome in one round): a round of B requests
        # averages B outcomes, so burn-in, tries and the estimate's memory shrink with the batch in rounds
        self.drafted = 0  # drafted request-rounds so far
        self.rated = 0  # drafted request-rounds in draft_rate outside tries
        self.skipped = 0  # plain rounds since the last drafted one
        self.burst: list[float] | None = None  # [request-rounds left, committed, ms] of a running try
        self.batch = 1  # requests in the last drafted round

    def _plain_rate(self) -> float:
        """Measured once plain rounds have run; before that, the profile's price of a verify of B roots."""
        if self.plain_rate is not None:
            return self.plain_rate
        prof = self.rule.profile
        return self.batch / max(prof.batch_verify_at(self.batch, self.batch, prof.prefix_lens[0]) + prof.host_at(0), 1e-6)

    def max_nodes(self, depth: int) -> int:
        return min(self.rule.max_width, universe_size(depth, self.top_k))

    def should_draft(self) -> bool:
        if self.drafted < self.min_drafted or self.draft_rate is None or self.burst is not None:
            return True
        if self.plain_rate is None:
            # measure one plain round before comparing: until then the plain rate is the profile's guess, and
            # a profile probed on a busy machine would otherwise keep a losing draft forever
            return False
        return self.draft_rate >= self._plain_rate()

    def allocate(self, logprobs, prefixes):
        cap = self.max_nodes(logprobs[0].shape[0]) if logprobs else 0
        self.batch = max(len(logprobs), 1)
        trees = build_forest(logprobs, cap * len(logprobs), self.top_k, [cap] * len(logprobs))
        counts = self.rule.allocate([t.scores for t in trees], [t.depths for t in trees], prefixes)
        return [t.head(c) for t, c in zip(trees, counts)]

    def observe(self, tree: Tree, path: list[int]) -> None:
        self.rule.observe(tree, path)

    def update(self, committed: int, round_ms: float, drafted: bool = True) -> None:
        rate = committed / max(round_ms, 1e-6)
        if not drafted:
            self.skipped += 1
            self.plain_rate = rate if self.plain_rate is None else \
                self.momentum * self.plain_rate + (1 - self.momentum) * rate
            if self.skipped >= self.explore_every:
                self.burst = [self.try_rounds, 0.0, 0.0]
            return
        first = self.drafted == 0
        self.drafted += self.batch
        self.skipped = 0
        if first:
            return
        self.rule.update(committed, round_ms)
        if self.burst is None:
            self.rated += self.batch
            # a plain mean until it holds ~20 request-rounds, then an EMA with that memory
            m = min(self.decision_momentum ** self.batch, 1 - self.batch / self.rated)
            self.draft_rate = rate if self.draft_rate is None else m * self.draft_rate + (1 - m) * rate
            if self.draft_rate >= self._plain_rate():
                self.explore_every = self.min_explore
            return
        self.burst = [self.burst[0] - self.batch, self.burst[1] + committed, self.burst[2] + round_ms]
        if self.burst[0] > 0:
            return
        tried = self.burst[1] / max(self.burst[2], 1e-6)
        self.burst = None
        self.draft_rate = tried if self.draft_rate is None else 0.5 * self.draft_rate + 0.5 * tried
        if self.draft_rate >= self._plain_rate():
            self.explore_every = self.min_explore
        elif tried < self._plain_rate():  # a try that lost on its own: wait longer before the next
            self.explore_every = min(2 * self.explore_every, self.max_explore)


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
