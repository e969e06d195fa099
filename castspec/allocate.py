"""Who gets how many tree nodes this round: allocation policies over B requests' candidate universes, and
the one factory (`PolicySpec` -> `make_policy`) that every front door uses to turn user settings into a policy.

Every policy maps the drafted marginals of the requests that draft this round to one best-first tree each. A
request's marginals come as [L, V] log-probabilities, or [L, S] over a draft vocabulary with its token ids (its
support: `supports`, None per request for the whole vocabulary); the trees are the same either way.
With one request, `fixed` and `cost` are the paper's fixed width N and the per-round cost-aware width; under
load `shared` spends one global budget M on the highest-scoring candidates wherever they are (Proposition 2),
and `cost` also picks M from the profiled cost of the whole batched verify (Proposition 3).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import METHODS, DecodeConfig
from .cost import BATCH_DRAFT_DEPTH, Calibration, CostProfile, RoundWidth
from .tree import Tree, build_forest, build_tree, universe_size

POLICIES = ("chain", "fixed", "uniform", "shared", "cost")


class Policy:
    name = "base"

    def max_nodes(self, depth: int) -> int:
        """The most nodes one request's tree can get (sizes its KV cache)."""
        raise NotImplementedError

    def draft_depth(self, batch: int, depth: int) -> int:
        """How many of the block's `depth` positions a drafted round of `batch` > 1 requests reads: its trees are
        no deeper, and the drafter pass finishes (last layer, head) only those rows of each block, which under load
        is a pass's larger part. (One request's rounds read the whole block, whose pass rides on the weight read:
        its marginals are then whole for whoever observes them.)"""
        return depth

    def allocate(self, logprobs: list[torch.Tensor], prefixes: list[int],
                 supports: list[torch.Tensor | None] | None = None) -> list[Tree]:
        raise NotImplementedError

    def should_draft(self, batch: int = 1, context_rows: int = 0, prefilling: bool = False,
                     horizon: int | None = None) -> bool:
        """Whether this round, of `batch` requests that could draft, drafts at all (a round without a draft is a
        plain autoregressive step); `context_rows`: the rows their drafter pass would also fuse (what they
        committed since they last drafted, or their prompts); `prefilling`: the round also reads a prompt;
        `horizon`: the most tokens those requests may still commit (None: no bound known)."""
        return True

    def update(self, committed: int, round_ms: float, drafted: bool = True, requests: int | None = None) -> None:
        """Feedback after each round: tokens committed by the whole batch and the round's wall time; `requests`:
        the requests it verified, drafting or not (None: unknown)."""

    def observe(self, tree: Tree, path: list[int]) -> None:
        """Feedback per verified request: its tree and the accepted pack rows (for calibrating masses)."""


def _each(supports: list[torch.Tensor | None] | None, logprobs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """One support per request (None: its marginals cover the whole vocabulary)."""
    if supports is None:
        return [None] * len(logprobs)
    if len(supports) != len(logprobs):
        raise ValueError(f"one support per request: {len(supports)} supports for {len(logprobs)} requests")
    return supports


class Chain(Policy):
    """Standard DFlash: the top-1 token at every drafted position."""

    name = "chain"

    def max_nodes(self, depth: int) -> int:
        return depth

    def allocate(self, logprobs, prefixes, supports=None):
        return [build_tree(lp, lp.shape[0], 1, support=s) for lp, s in zip(logprobs, _each(supports, logprobs))]


@dataclass
class FixedWidth(Policy):
    """Every request gets its own top-`width` tree."""

    width: int
    top_k_per_position: int = 8
    name = "fixed"

    def max_nodes(self, depth: int) -> int:
        return min(self.width, universe_size(depth, self.top_k_per_position))

    def draft_depth(self, batch: int, depth: int) -> int:
        return max(min(depth, self.width), 1)  # a tree of N nodes is at most N deep

    def allocate(self, logprobs, prefixes, supports=None):
        return [build_tree(lp, self.width, self.top_k_per_position, support=s)
                for lp, s in zip(logprobs, _each(supports, logprobs))]


@dataclass
class UniformSplit(Policy):
    """One budget of `budget` nodes split evenly across the requests (the static baseline of Prop. 2)."""

    budget: int
    top_k_per_position: int = 8
    name = "uniform"

    def max_nodes(self, depth: int) -> int:
        return min(self.budget, universe_size(depth, self.top_k_per_position))

    def draft_depth(self, batch: int, depth: int) -> int:
        return max(min(depth, -(-self.budget // max(batch, 1))), 1)  # no share is deeper than it is large

    def allocate(self, logprobs, prefixes, supports=None):
        share, extra = divmod(self.budget, max(len(logprobs), 1))
        return [build_tree(lp, share + (i < extra), self.top_k_per_position, support=s)
                for i, (lp, s) in enumerate(zip(logprobs, _each(supports, logprobs)))]


@dataclass
class SharedBudget(Policy):
    """Global best-first over one shared budget: the `budget` highest-scoring candidates of all requests."""

    budget: int
    top_k_per_position: int = 8
    name = "shared"

    def max_nodes(self, depth: int) -> int:
        return min(self.budget, universe_size(depth, self.top_k_per_position))

    def draft_depth(self, batch: int, depth: int) -> int:
        return max(min(depth, self.budget), 1)

    def allocate(self, logprobs, prefixes, supports=None):
        return build_forest(logprobs, self.budget, self.top_k_per_position, supports=supports)


# Before a drafted round has been measured, batched drafting is priced as one tree node per request whose token is
# accepted this often (the tokens a request commits: 1 + PRIOR_ACCEPT). Assuming every node accepted made the
# prior a bound no round reaches, so that under load every batch size paid a catch-up and a few losing rounds to
# find out what the profile already said (docs/serving.md)
PRIOR_ACCEPT = 0.5
# plain rounds of a batch bucket measured before the profile's price of drafting at that batch is trusted
PLAIN_FIRST = 3
# drafted rounds of a batch bucket measured before their gain over plain rounds may stop drafting there: one round's
# acceptance is a noisy sample (its requests' drafts hit or miss together)
DRAFTED_FIRST = 3
# under load, a due try at a batch bucket whose drafted rounds were measured runs only where their gain over plain
# rounds came within this of 1 (a slow moment of the machine, or content drafting may yet win on); further below,
# it waits for the longest gap (max_explore_loaded plain rounds)
TRY_GAIN = 0.9
# under load, while a batch bucket drafts, the plain rounds its gain is measured against are measured again every
# REFRESH_EVERY of its drafted rounds, REFRESH_ROUNDS in a row, each weighing REFRESH_WEIGHT in the plain rate: the
# first plain rounds of a load (right after its prompts, beside a server taking requests) run slower than later
# ones, and a bucket whose drafted rounds beat that stale rate would never run a plain round again to learn better
REFRESH_EVERY = 32
REFRESH_ROUNDS = 2
REFRESH_WEIGHT = 0.5
# under load, the share of the time served that tries may lose against plain rounds (net of what drafted rounds won):
# a try that is due waits while the losses so far exceed it, so where drafting does not pay at a batch (a pass for
# 16 blocks is compute on a CPU) the policy stays within this of plain rounds however long it serves; each try's
# rounds lose a little, and its first pass also fuses all the context gathered since the last one
EXPLORE_SHARE = 0.02


def _ema(old: float | None, value: float, momentum: float) -> float:
    """The next value of an exponential moving average; the first value stands alone."""
    return value if old is None else momentum * old + (1 - momentum) * value


@dataclass
class Try:
    """A running try of drafting (CostAware): request-rounds left, and what its rounds have done so far."""

    left: int
    tokens: float = 0.0  # committed
    ms: float = 0.0
    squares: float = 0.0  # the sum of its rounds' squared rates (tokens per ms)
    rounds: int = 0


def batch_bucket(batch: int) -> int:
    """Batches measured together by the cost policy: 2, 3-4, 5-8, 9-16, ... (the next power of two)."""
    return 1 << max(batch - 1, 0).bit_length()


class CostAware(Policy):
    """Global best-first with the budget chosen from measured costs: keep adding the best remaining candidate
    of any request while its mass pays for the extra packed token at the running throughput (RoundWidth).

    Drafting itself is a cost too (Theorem 2's N = 0 with the draft unpaid): when drafted rounds have been
    committing fewer tokens per ms than plain autoregressive rounds, the policy stops drafting and, after
    `explore_every` plain rounds, tries a short burst of `try_rounds` drafted rounds; the gap doubles after
    every burst that loses (up to `max_explore_every`) and resets when drafting wins again.

    One round is weak evidence: it commits anywhere from 1 to L + 1 tokens, so a short average of a drafter
    that wins on average still dips below plain rounds in runs of bad luck, and a per-round estimate alone
    would switch drafting off for long stretches on which drafting pays. Hence: every request drafts its first
    `min_drafted` rounds; draft-or-not uses a slow estimate of drafted throughput (`decision_momentum`, about
    20 request-rounds; the width rule keeps its own faster lambda); tries are bursts whose mean weighs half of
    the estimate; and drafting goes on while the estimate plus `confidence` standard errors (from the spread of
    the rounds it averages) beats plain rounds. Without that margin a few unlucky rounds at an answer's start,
    where a drafter whose margin over plain rounds is thin (chat) commits less, switch drafting off for most of
    the answer; with it, a drafter that clearly loses still stops within a few rounds, and one that loses by
    less than the margin keeps drafting at that small loss. Under load burn-in, estimate and tries count
    request-rounds, not rounds: a round of B requests is already an average of B outcomes, and its trees cost
    far more than one request's. The first drafted round enters no
    estimate: its drafter pass also reads the whole prompt's features, so it costs more than later passes; nor
    does a round that also prefills a newcomer's prompt (`run_round` gives the policy no update for it). Widths
    read lambda no lower than the measured plain rate: a node that does not beat plain rounds does not pay.
    Under load the rates of rounds of different batch sizes do not compare, while the price of drafting does
    change with the batch (a pass for 16 blocks is compute, a plain round of 16 rows a weight read): a batched
    round drafts only where the profile, at the acceptance per request seen so far, prices it above a plain
    round of the same batch (`draft_could_pay`) until drafted rounds of about that batch have been measured;
    from then on their measured gain over plain rounds of the same batch decides (`gains`): the profile does not
    price the host work of many trees. The first drafted round after plain ones (and a newcomer's first) also
    fuses the context its requests gathered meanwhile, their prompts at first: a catch-up, paid once, which
    drafting must repay before the requests end (`draft_could_pay`, from their remaining tokens) and which says
    nothing of what drafting costs from then on, so that round enters no gain and the next one drafts to be
    measured. The prior counts only after PLAIN_FIRST plain rounds of the batch's bucket; no round that also
    reads a prompt drafts (it gives the policy no update, and drafting there sets requests apart). Tries under load
    that cannot pay run within an exploration budget (EXPLORE_SHARE of the time served, net of what drafted rounds
    won), and a bucket that drafts measures its plain rounds again now and then (REFRESH_*): the first ones of a
    load run slow, and a gain measured against them alone would keep a losing bucket drafting.
    """

    name = "cost"

    def __init__(self, rule: RoundWidth, top_k_per_position: int = 8, explore_every: int = 8, momentum: float = 0.8,
                 max_explore_every: int = 64, decision_momentum: float = 0.95, min_drafted: int = 6,
                 try_rounds: int = 3, block_rows: int | None = None, max_explore_loaded: int = 256,
                 confidence: float = 1.0, explore_share: float = EXPLORE_SHARE):
        self.rule, self.top_k_per_position = rule, top_k_per_position
        self.block_rows = block_rows  # rows of one request's drafter block: prices a batched pass (draft_could_pay)
        self.explore_every, self.momentum = explore_every, momentum
        self.min_explore, self.max_explore = explore_every, max_explore_every
        # under load a try that cannot pay waits longer: its drafter pass also fuses the context of every round
        # its requests did not draft (for 16 requests after 64 plain rounds, a pass of ~1000 context rows)
        self.max_explore_loaded = max(max_explore_loaded, max_explore_every)
        self.decision_momentum, self.min_drafted, self.try_rounds = decision_momentum, min_drafted, try_rounds
        self.draft_rate: float | None = None  # committed tokens per ms of drafted rounds (slow EMA)
        # the same average of the rounds' squared rates, and the sum of the squared weights of the rounds in it
        # (1 / that sum: how many rounds the average is worth): the estimate's standard error
        self.draft_sq: float | None = None
        self.draft_weights = 0.0
        self.confidence = confidence
        # under load: the time rounds served, and what drafted rounds of several requests lost (net) against plain
        # rounds of their batch in it; tries that are due wait while the loss is above explore_share of the time
        self.explore_share = explore_share
        self.served_ms = 0.0
        self.explore_lost_ms = 0.0
        self.plain_rate: float | None = None  # committed tokens per ms of rounds without a draft
        # evidence is counted in request-rounds (one request's outcome in one round): a round of B requests
        # averages B outcomes, so burn-in, tries and the estimate's memory shrink with the batch in rounds
        self.drafted = 0  # drafted request-rounds so far
        self.rated = 0  # drafted request-rounds in draft_rate outside tries
        self.skipped = 0  # plain rounds since the last drafted one
        self.burst: Try | None = None  # a try that is due or running
        self.batch = 1  # requests in the last drafted round
        self.nodes = 0  # tree nodes the last drafted round verified, over all its requests
        # per drafting request in a drafted round (EMA): tokens committed and tree nodes verified
        self.request_tokens: float | None = None
        self.request_nodes: float | None = None
        # under load (batch > 1), measured like with like: plain rounds' tokens per ms at each batch, and drafted
        # rounds' gain over them (EMA) per batch bucket (batch_bucket), read by draft_could_pay once measured
        self.plain_rates: dict[int, float] = {}
        self.plain_seen: dict[int, int] = {}  # plain rounds measured per batch bucket
        self.since_plain: dict[int, int] = {}  # per batch bucket: its drafted rounds since its last plain round
        self.refresh: dict[int, int] = {}  # per batch bucket: plain rounds due to measure its plain rate again
        self.gains: dict[int, float] = {}
        self.gains_seen: dict[int, int] = {}  # drafted rounds measured per batch bucket
        self.reached: dict[int, int] = {}  # per batch bucket: the deepest tree of its last drafted round
        self._pass_prices: dict[int, tuple[float | None, float]] = {}  # batch -> the profile's pass, context row
        self._gains_priced: dict[int, tuple[float, float, float]] = {}  # batch -> tokens, nodes, priced gain
        self._context_rows = 0  # the context rows of the round last decided on (should_draft)
        self._measure_next = False  # under load: the last drafted round caught up (its gain not measured)

    def _plain_rate(self) -> float:
        """Measured once plain rounds have run; before that, the profile's price of a verify of B roots."""
        return self.plain_rate if self.plain_rate is not None else self._priced_plain_rate(self.batch)

    def max_nodes(self, depth: int) -> int:
        return min(self.rule.max_width, universe_size(depth, self.top_k_per_position))

    def draft_depth(self, batch: int, depth: int) -> int:
        """One position deeper than the trees of the last drafted round of about this batch reached
        (BATCH_DRAFT_DEPTH before one has run): a batch whose trees grow deeper gets one more position a round."""
        return max(min(depth, self.reached.get(batch_bucket(batch), BATCH_DRAFT_DEPTH - 1) + 1), 1)

    def _prices(self, batch: int) -> tuple[float | None, float]:
        """The profile's batched drafter pass and its price per further context row at this batch (looked up once
        per batch: under load they are asked every round); the pass None where nothing prices it."""
        if batch not in self._pass_prices:
            prof = self.rule.profile
            prefix = prof.prefix_lens[0]
            draft = prof.batch_draft_at(batch, prefix, self.block_rows)
            self._pass_prices[batch] = draft, (0.0 if draft is None else
                                               prof.context_row_ms(prefix, batch, self.block_rows))
        return self._pass_prices[batch]

    def _steady_rows(self, batch: int) -> int:
        """The context rows a drafted round's pass fuses when its requests drafted the round before: at most what
        they committed then (a block's rows each; two where the block is not known). More is context gathered in
        rounds that did not draft (or a newcomer's prompt), fused once: a catch-up."""
        return (self.block_rows or 2) * batch

    def draft_could_pay(self, batch: int, context_rows: int = 0, horizon: int | None = None) -> bool:
        """Whether drafted rounds of `batch` requests are predicted to commit more per ms than plain ones, and the
        catch-up of this round's pass is repaid. Once drafted rounds of about this batch have been measured, their gain
        over plain rounds of the same batch decides (`gains`); before, the drafted round priced by the profile (its
        batched drafter pass and verify) at the acceptance drafted rounds have shown per request (tokens and nodes;
        before any, one node per request accepted PRIOR_ACCEPT of the time), against the plain round of this batch
        priced by the same profile. Acceptance does not depend on the batch; the cost of drafting does (a pass for 16
        requests' blocks is mostly compute). Without batched shapes in the profile, the pass is priced from the
        single-request pass (CostProfile.batch_draft_at); True where nothing prices it. The catch-up: the context rows
        beyond a drafted round's own (`_steady_rows`: a batch's first drafted round reads all its prompts), priced per
        row by the profile, are paid once and must cost no more than drafting saves over the `horizon` tokens the
        requests may still commit (a long prompt before a short answer is not worth fusing)."""
        draft, row_ms = self._prices(batch)
        gain = self.gains.get(batch_bucket(batch))
        if gain is None:
            if draft is None:
                return True
            gain = self._priced_gain(batch)
        if gain < 1.0:
            return False
        catch_up = max(context_rows - self._steady_rows(batch), 0) * row_ms
        if not catch_up or horizon is None:
            return True
        return catch_up <= horizon / self._batch_plain_rate(batch) * (1.0 - 1.0 / gain)  # ms saved over it

    def _priced_gain(self, batch: int) -> float:
        """A drafted round of `batch` requests over a plain one, both as the profile prices them (its level can be
        off, probed in another phase of a shared machine's speed; its ratios much less), at the acceptance seen so
        far; only where the profile prices the batch's pass (`_prices`, itself kept per batch). Kept per batch until
        that acceptance changes: under load it is asked every plain round, and pricing is a few interpolations of
        the profile."""
        tokens, nodes = (1 + PRIOR_ACCEPT, batch) if self.request_tokens is None else \
            (self.request_tokens, self.request_nodes * batch)
        kept = self._gains_priced.get(batch)
        if kept is not None and kept[:2] == (tokens, nodes):
            return kept[2]
        prof = self.rule.profile
        prefix = prof.prefix_lens[0]
        drafted_ms = (self._prices(batch)[0] + prof.batch_verify_at(batch, batch + nodes, prefix)
                      + prof.batch_host_at(batch, nodes))
        gain = batch * tokens / max(drafted_ms, 1e-6) / self._priced_plain_rate(batch)
        self._gains_priced[batch] = (tokens, nodes, gain)
        return gain

    def should_draft(self, batch: int = 1, context_rows: int = 0, prefilling: bool = False,
                     horizon: int | None = None) -> bool:
        if prefilling:
            # a round that also reads a prompt costs what the prompt costs, so it tells the policy nothing of
            # drafting (run_round gives it no update): drafting there would go on the prior for good, and it sets
            # the decoding requests apart, so their successors' prompts are read in more rounds
            return False
        self._context_rows = context_rows  # what the round's pass fuses, if it drafts (update reads it)
        if self.burst is not None and (batch == 1 or self.burst.ms > 0):
            return True  # a try that is due (one request), or one that has begun
        if batch > 1:
            if self._measure_next:
                return True  # the round after a catch-up: drafting's own price, measured (update)
            bucket = batch_bucket(batch)
            if self.plain_seen.get(bucket, 0) < PLAIN_FIRST and sum(self.plain_seen.values()) < PLAIN_FIRST:
                # under load, as for one request: plain rounds are measured first (they are what drafting must
                # beat, and a drafted round sets requests apart, which spreads their newcomers' prompts over many
                # rounds for good); a few, since one round is a noisy price. Those of other batches do for a
                # batch not measured yet (rescaled by the profile, `_batch_plain_rate`): as requests finish one
                # by one, every batch size in turn would otherwise pay plain rounds to be measured
                return False
            if 0 < self.gains_seen.get(bucket, 0) < DRAFTED_FIRST:
                return True  # likewise a few drafted rounds before their gain decides
            if self.refresh.get(bucket, 0) > 0:
                return False  # the plain rate this bucket's gain is measured against, measured again
            # drafted rounds of about this batch measured against plain ones (before that the profile's price),
            # and the catch-up of the context gathered meanwhile repaid before the requests end
            pays = self.draft_could_pay(batch, context_rows, horizon)
            if self.burst is not None:
                # a try that is due: where drafted rounds of this batch have been measured within TRY_GAIN of
                # plain ones it runs (its gap, explore_every, doubles after each try that loses, up to
                # max_explore_loaded: a measured gain near 1 is as likely a slow moment of the machine as a
                # loss); where they lost by more, or only the profile prices them, it waits until its round can
                # pay, or for the longest gap (the acceptance measured or assumed may be stale). A try that
                # cannot pay runs only within the exploration budget (`_may_explore`)
                near = self.gains.get(bucket, 0.0) >= TRY_GAIN
                return pays or ((near or self.skipped >= self.max_explore_loaded) and self._may_explore())
            if bucket in self.gains or not pays:
                return pays
        if self.drafted < self.min_drafted or self.draft_rate is None:
            return True
        if self.plain_rate is None:
            # measure one plain round before comparing: until then the plain rate is the profile's guess, and
            # a profile probed on a busy machine would otherwise keep a losing draft forever
            return False
        return self._drafting_pays()

    def _may_explore(self) -> bool:
        """Whether a try under load fits the exploration budget: what drafted rounds of several requests lost against
        plain rounds of the same batch so far, net, is at most `explore_share` of the time the rounds served."""
        return self.explore_lost_ms <= self.explore_share * self.served_ms

    def _drafting_pays(self) -> bool:
        """Whether drafted rounds' rate, plus `confidence` standard errors of its estimate, beats plain rounds'."""
        return self._draft_upper() >= self._plain_rate()

    def _draft_upper(self) -> float:
        """The drafted rate's estimate plus `confidence` standard errors of it."""
        spread = max(self.draft_sq - self.draft_rate ** 2, 0.0)  # set with draft_rate (_blend)
        return self.draft_rate + self.confidence * math.sqrt(spread * self.draft_weights)

    def _blend(self, rate: float, square: float, weight: float, rounds: int = 1) -> None:
        """Mix a new mean of `rounds` rounds' rates (and of their squares) into the estimate with `weight`."""
        if self.draft_rate is None:
            self.draft_rate, self.draft_sq, self.draft_weights = rate, square, 1.0 / rounds
            return
        keep = 1.0 - weight
        self.draft_rate = keep * self.draft_rate + weight * rate
        self.draft_sq = keep * self.draft_sq + weight * square
        self.draft_weights = keep * keep * self.draft_weights + weight * weight / rounds

    def allocate(self, logprobs, prefixes, supports=None):
        cap = self.max_nodes(logprobs[0].shape[0]) if logprobs else 0
        self.batch = max(len(logprobs), 1)
        # the measured rate of plain rounds bounds lambda from below: under load a plain round of B requests
        # commits far more per ms than one request's, and a tree node that does not beat it is a loss
        stop = self.rule.stop_rule(prefixes, self.plain_rate)
        trees = build_forest(logprobs, cap * len(logprobs), self.top_k_per_position, [cap] * len(logprobs),
                             supports, stop)
        counts = self.rule.allocate([t.scores for t in trees], [t.depths for t in trees], prefixes, self.plain_rate)
        self.nodes = sum(counts)
        heads = [t.head(c) for t, c in zip(trees, counts)]
        if self.batch > 1:
            self.reached[batch_bucket(self.batch)] = max((max(t.depths, default=0) for t in heads), default=0)
        return heads

    def observe(self, tree: Tree, path: list[int]) -> None:
        self.rule.observe(tree, path)

    def _priced_plain_rate(self, batch: int) -> float:
        """Tokens per ms of a plain round of `batch` requests as the profile prices it (a verify of B roots)."""
        prof = self.rule.profile
        return batch / max(prof.plain_round_ms(batch, prof.prefix_lens[0]), 1e-6)

    def _batch_plain_rate(self, batch: int) -> float:
        """Tokens per ms of a plain round of `batch` requests: measured; else the nearest measured batch (of the
        same bucket where there is one), rescaled as the profile prices the two (its level can be off, as on a
        busy machine, its shape less so); else the profile's price."""
        rate = self.plain_rates.get(batch)
        if rate is not None:
            return rate
        near = [b for b in self.plain_rates if batch_bucket(b) == batch_bucket(batch)] or list(self.plain_rates)
        if not near:
            return self._priced_plain_rate(batch)
        b = min(near, key=lambda b: abs(b - batch))
        return self.plain_rates[b] * self._priced_plain_rate(batch) / self._priced_plain_rate(b)

    def update(self, committed: int, round_ms: float, drafted: bool = True, requests: int | None = None) -> None:
        rate = committed / max(round_ms, 1e-6)
        self.served_ms += round_ms
        if not drafted:
            self.skipped += 1
            self.plain_rate = _ema(self.plain_rate, rate, self.momentum)
            # a plain round commits one token per request: `committed` is its batch. A try falls due after
            # explore_every plain rounds; under load, one that cannot pay at its batch (draft_could_pay, its
            # catch-up included) waits in should_draft for the longest gap under load (the acceptance it
            # assumes may be stale); one request's tries go by the measured rates alone
            batch = committed
            if batch > 1:
                bucket = batch_bucket(batch)
                refreshing = self.refresh.get(bucket, 0) > 0
                self.plain_rates[batch] = _ema(self.plain_rates.get(batch), rate,
                                               1.0 - REFRESH_WEIGHT if refreshing else self.momentum)
                self.plain_seen[bucket] = self.plain_seen.get(bucket, 0) + 1
                self.since_plain[bucket] = 0
                if refreshing:
                    self.refresh[bucket] -= 1
            if self.skipped >= self.explore_every and self.burst is None:
                self.burst = Try(self.try_rounds)  # due; under load should_draft may hold it back
            return
        first = self.drafted == 0
        self.drafted += self.batch
        self.skipped = 0
        # a request in its last round does not draft (nothing to gain) but is verified with the others: it
        # commits its target token alone, and the round is measured against a plain round of all of them
        requests = max(requests or self.batch, self.batch)
        tokens, nodes = (committed - (requests - self.batch)) / self.batch, self.nodes / self.batch
        self.request_tokens = _ema(self.request_tokens, tokens, self.momentum)
        self.request_nodes = _ema(self.request_nodes, nodes, self.momentum)
        if self.batch > 1:
            # what plain rounds of these requests would have taken to commit as much, against what this one took
            plain_ms = committed / self._batch_plain_rate(requests)
            self.explore_lost_ms += round_ms - plain_ms
            # a round whose pass caught up (fused a batch's prompts, or what its requests gathered in plain
            # rounds) costs more than drafting does from then on: not measured, and the next round drafts to be
            self._measure_next = self._context_rows > self._steady_rows(self.batch)
            key = batch_bucket(self.batch)
            self.since_plain[key] = self.since_plain.get(key, 0) + 1
            if self.since_plain[key] >= REFRESH_EVERY:
                self.refresh[key], self.since_plain[key] = REFRESH_ROUNDS, 0
            if not self._measure_next:
                seen = self.gains_seen.get(key, 0)
                self.gains_seen[key] = seen + 1
                # a plain mean of the first rounds, then the EMA
                self.gains[key] = _ema(self.gains.get(key), plain_ms / max(round_ms, 1e-6),
                                       min(self.momentum, seen / (seen + 1)))
                if self.gains[key] >= 1.0:
                    self.explore_every = self.min_explore
        if first:
            return
        self.rule.update(committed, round_ms)
        if self.burst is None:
            self.rated += self.batch
            # a plain mean until it holds ~20 request-rounds, then an EMA with that memory
            m = min(self.decision_momentum ** self.batch, 1 - self.batch / self.rated)
            self._blend(rate, rate * rate, 1 - m)
            if self._drafting_pays():
                self.explore_every = self.min_explore
            return
        b = self.burst
        b.left -= self.batch
        b.tokens += committed
        b.ms += round_ms
        b.squares += rate * rate
        b.rounds += 1
        if b.left > 0:
            return
        tried = b.tokens / max(b.ms, 1e-6)
        self.burst = None
        self._blend(tried, b.squares / b.rounds, 0.5, b.rounds)
        if self._drafting_pays():
            self.explore_every = self.min_explore
        elif tried < self._plain_rate():  # a try that lost on its own: wait longer before the next
            cap = self.max_explore_loaded if self.batch > 1 else self.max_explore
            self.explore_every = min(2 * self.explore_every, cap)


@dataclass(frozen=True)
class PolicySpec:
    """What a user asked for, from any front door (a DecodeConfig for one request, a SchedulerConfig for serving,
    a loadtest spec string); `make_policy` turns it into a Policy.

    method: ar (no draft, no policy) | chain (the top-1 chain) | cast (a tree allocated by `policy`).
    policy: fixed (`width` nodes per request) | uniform (a budget of `width` split evenly over the requests) |
        shared (a budget of `width` best-first over all requests) | cost (the cost rule) | chain.
    width: an integer, or "auto": the cost rule, for `fixed` and `shared` alike, since with one request the
        batched rule (Proposition 3) is the per-round width of Theorem 2. The cost policy ignores `width`.
    top_k_per_position: K, the candidates kept at each drafted position (the tree's universe).
    """

    method: str = "cast"
    policy: str = "fixed"
    width: int | str = "auto"
    top_k_per_position: int = 8

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown allocation policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.width != "auto" and (not isinstance(self.width, int) or isinstance(self.width, bool) or self.width < 0):
            raise ValueError(f"width must be a non-negative integer or 'auto', got {self.width!r}")
        if self.policy == "uniform" and self.width == "auto":
            raise ValueError("the uniform policy splits a fixed budget: give it an integer width")
        k = self.top_k_per_position
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"top_k_per_position must be an integer >= 1, got {k!r}")

    @classmethod
    def for_request(cls, cfg: DecodeConfig) -> "PolicySpec":
        """What one request's config asks for: `width` nodes of its own, or with "auto" the cost rule."""
        return cls(cfg.method, "fixed", cfg.width, cfg.top_k_per_position)

    @classmethod
    def parse(cls, spec: str) -> "PolicySpec":
        """A policy spec as the load tests write it: ar | chain | fixed:N | uniform:M | shared:M | cost."""
        name, _, arg = spec.partition(":")
        if name in ("ar", "chain", "cost"):
            # width 0: unused by these three (ar and chain have no tree, cost picks its own budget)
            return cls("cast" if name == "cost" else name, "fixed" if name == "ar" else name, 0)
        if name not in ("fixed", "uniform", "shared"):
            raise ValueError(f"unknown policy spec {spec!r}; use ar, chain, cost, fixed:N, uniform:M or shared:M")
        try:
            width = int(arg)
        except ValueError:
            raise ValueError(f"policy {spec!r} needs a width, e.g. {name}:15") from None
        try:
            return cls("cast", name, width)
        except ValueError as e:
            raise ValueError(f"policy {spec!r}: {e}") from None

    @property
    def uses_cost(self) -> bool:
        """Whether the policy is the cost rule, which reads a measured cost profile."""
        return self.method == "cast" and self.policy != "chain" and (self.policy == "cost" or self.width == "auto")


def make_policy(spec: PolicySpec, depth: int, profile: CostProfile | None = None,
                calibration: Calibration | None = None) -> Policy | None:
    """The policy `spec` asks for (None for `ar`): the one way from user settings to a policy, used by decode(),
    the Engine, the Scheduler and the load tests. `depth` is the drafter's L (it bounds the cost rule's
    universe); the cost rule needs this deployment's `profile` and, when given, reads the drafter's masses
    through `calibration`."""
    if spec.method == "ar":
        return None
    k = spec.top_k_per_position
    if spec.method == "chain" or spec.policy == "chain":
        return Chain()
    if spec.uses_cost:
        if profile is None:
            raise ValueError("width 'auto' and the cost policy choose widths from a measured cost profile: pass "
                             "one (the Engine probes it once per deployment), or give an integer width")
        return CostAware(RoundWidth(profile, min(profile.max_width, universe_size(depth, k)),
                                    calibration=calibration), k, block_rows=depth + 1)
    if spec.policy == "fixed":
        return FixedWidth(spec.width, k)
    if spec.policy == "uniform":
        return UniformSplit(spec.width, k)
    return SharedBudget(spec.width, k)
