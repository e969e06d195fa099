"""Continuous batching: admit requests between rounds, run one batched round for all active ones, retire.

Policy (documented in docs/serving.md):
- at most `max_batch` requests decode together; up to `max_queue` more wait (FIFO); beyond that, submit()
  raises QueueFull (the server answers 429);
- newcomers are admitted at round boundaries and their prompts are prefilled INSIDE the next rounds' forward,
  in chunks of at most `prefill_budget` prompt tokens per round in all, so running requests keep committing
  tokens every round while a long prompt is read (chunked prefill, no stall);
- a newcomer whose prompt starts like an earlier request's context (its prompt, or prompt and answer) copies
  that prefix's caches instead of reading it again (castspec.prefix_cache; `prefix_cache_mb` bounds what is
  kept, 0 turns it off);
- a newcomer whose prompt starts like one a running request is still reading (by at least
  `wait_for_shared_prompt` tokens more than a kept prefix gives) waits until that prompt is read and kept, then
  copies it: requests that arrive together read a shared system turn once, not once each (SGLang's scheduler
  holds such requests back too), for a round or a few of waiting;
- finished, cancelled and failed requests leave at the next round boundary and free their caches;
- if a round raises, the batch is rolled back and every request is retried alone, so only the request that
  fails on its own gets the error.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..allocate import PolicySpec, make_policy
from ..config import DecodeConfig
from ..cost import CostProfile
from ..native.threads import release_workers
from ..prefix_cache import PrefixCache, common_prefix
from ..round import RoundOutput, run_round, warm_up
from ..sequence import Sequence, check_request, request_taps

log = logging.getLogger("castspec.scheduler")


class QueueFull(RuntimeError):
    """The waiting queue is at capacity."""


class ShuttingDown(RuntimeError):
    """The scheduler no longer accepts requests."""


@dataclass
class SchedulerConfig:
    max_batch: int = 8
    max_queue: int = 64
    prefill_budget: int = 512  # prompt tokens prefilled per round, over all newcomers
    policy: str = "cost"  # chain | fixed | uniform | shared | cost (see castspec.allocate.PolicySpec)
    width: int | str = 15  # fixed: per request; uniform/shared: the whole batch's budget; "auto": the cost rule
    top_k_per_position: int = 8  # the trees' candidates at each drafted position
    prefix_cache_mb: float = 256.0  # kept prompt prefixes (castspec.prefix_cache); 0: every prompt read whole
    wait_for_shared_prompt: int = 16  # prompt tokens shared with one being read that make a newcomer wait; 0: never

    def __post_init__(self):
        for name, least in (("max_batch", 1), ("prefill_budget", 1), ("max_queue", 0), ("prefix_cache_mb", 0),
                            ("wait_for_shared_prompt", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")
        self.policy_spec("cast")  # the policy, width and top_k_per_position checks

    def policy_spec(self, method: str) -> PolicySpec:
        """The allocation this configuration asks for, for requests decoded with `method`."""
        return PolicySpec(method, self.policy, self.width, self.top_k_per_position)


@dataclass
class Request:
    """One submitted request. `on_tokens(tokens)` gets every committed chunk, `on_done(reason, error)` once
    (reason: "stop" | "length" | "cancelled" | "error"); with cfg.logprobs set, `on_logprobs` gets each chunk's
    sampling.TokenLogprob list just before its tokens. All run on the scheduler thread: keep them short.

    `fork_of`: another request for the same prompt (n > 1 continuations): this one starts from a copy of that
    request's prefilled caches instead of reading the prompt again, when it can be admitted right after that
    prefill (otherwise it reads the prompt itself; the tokens are the same either way)."""

    prompt: list[int]
    cfg: DecodeConfig
    on_tokens: Callable[[list[int]], None]
    on_done: Callable[[str, str | None], None]
    on_logprobs: Callable[[list], None] | None = None
    fork_of: "Request | None" = None
    id: int = 0
    seq: Sequence | None = None
    cancelled: bool = False
    stop_reason: str | None = None  # set by finish(): why the client ended it early
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    cached_tokens: int = 0  # prompt tokens copied from a kept prefix instead of read (castspec.prefix_cache)
    tokens: int = 0
    rounds: int = 0
    finish_reason: str | None = None

    def cancel(self) -> None:
        """Safe from any thread: the request leaves at the next round boundary."""
        self.cancelled = True

    def finish(self, reason: str = "stop") -> None:
        """End early for a reason of the client's (e.g. a stop string matched): counted as `reason`."""
        self.stop_reason = reason
        self.cancelled = True


@dataclass
class Metrics:
    """Counters for /metrics. Written by the scheduler thread only; readers take a snapshot()."""

    requests: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "cancelled": 0, "error": 0})
    rejected: int = 0
    tokens: int = 0
    goodput_tokens: int = 0  # tokens of requests that finished normally (stop/length)
    rounds: int = 0
    verified: int = 0  # request-rounds that verified a pack (each commits accepted + 1)
    committed: int = 0  # tokens committed by those request-rounds
    acceptance: dict[int, int] = field(default_factory=dict)  # accepted drafted tokens per request-round
    batch_sizes: dict[int, int] = field(default_factory=dict)
    prefill_tokens: int = 0
    prefix_hits: int = 0  # requests that took a kept prompt prefix
    prefix_hit_tokens: int = 0  # prompt tokens those requests did not read
    busy_ms: float = 0.0
    started: float = field(default_factory=time.time)

    def snapshot(self) -> dict:
        up = max(time.time() - self.started, 1e-9)
        return {
            "requests": self.requests.copy(), "rejected": self.rejected, "tokens": self.tokens,
            "goodput_tokens": self.goodput_tokens, "goodput_tokens_per_s": self.goodput_tokens / up,
            "rounds": self.rounds, "mean_committed_per_round": self.committed / max(self.verified, 1),
            # .copy() is atomic under the GIL: the scheduler thread may be adding a key right now
            "acceptance_histogram": dict(sorted(self.acceptance.copy().items())),
            "batch_size_histogram": dict(sorted(self.batch_sizes.copy().items())),
            "prefill_tokens": self.prefill_tokens, "prefix_hits": self.prefix_hits,
            "prefix_hit_tokens": self.prefix_hit_tokens, "busy_s": self.busy_ms / 1e3, "uptime_s": up,
        }


class Scheduler:
    def __init__(self, target, drafter, cfg: SchedulerConfig | None = None, method: str = "cast",
                 profile: CostProfile | None = None):
        """`profile`: the measured costs the cost rule reads (the cost policy, or width "auto")."""
        self.target, self.cfg = target, cfg or SchedulerConfig()
        self.method = method
        self.drafter = drafter if method != "ar" else None
        if method != "ar" and drafter is None:
            raise ValueError(f"method {method!r} needs a drafter")
        L = self.drafter.cfg.num_draft_positions if self.drafter is not None else 0
        self.policy = make_policy(self.cfg.policy_spec(method), L, profile)
        self.max_nodes = self.policy.max_nodes(L) if self.policy is not None else 0
        self.metrics = Metrics()
        self.prefix_cache = PrefixCache(int(self.cfg.prefix_cache_mb * 2**20))
        self.on_round: Callable[[RoundOutput], None] | None = None  # sees every round (castspec.bench.load_rounds)
        # run on this thread after each step's callbacks and after close(): a consumer that only collects in its
        # callbacks hands everything on once here (the HTTP server wakes its event loop once per round, not
        # once per request: each wakeup is a system call that lets the loop's thread take the GIL mid-round)
        self.after_callbacks: list[Callable[[], None]] = []
        self._waiting: deque[Request] = deque()
        self._active: list[Request] = []
        self._lock = threading.Condition()
        self._ids = itertools.count(1)
        self._closed = False
        self._thread: threading.Thread | None = None

    # -- submission (any thread) -------------------------------------------------------------------------
    def submit(self, request: Request) -> Request:
        # fail now, in the caller's thread, rather than at admission (the Sequence repeats the check)
        check_request(request.prompt, request.cfg.max_new_tokens, self.target.cfg.max_positions, "max_tokens")
        with self._lock:
            if self._closed:
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) >= self.cfg.max_queue:
                self.metrics.rejected += 1
                raise QueueFull(f"the queue is full ({self.cfg.max_queue} waiting)")
            request.id = next(self._ids)
            self._waiting.append(request)
            self._lock.notify()
        return request

    @property
    def queue_length(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        return len(self._active)

    # -- the loop ----------------------------------------------------------------------------------------
    def step(self) -> bool:
        """Retire, admit, run one round. Returns False when there was nothing to do."""
        try:
            return self._step()
        finally:
            self._after_callbacks()

    def _after_callbacks(self) -> None:
        for hook in self.after_callbacks:
            try:
                hook()
            except Exception:  # noqa: BLE001 - a consumer's failure must not stop the rounds of the others
                log.exception("castspec: after-callbacks hook failed")

    def _step(self) -> bool:
        self._retire()
        self._admit()
        if not self._active:
            return False
        batch = [r for r in self._active if not r.cancelled]
        t = time.perf_counter()
        try:
            self._round(batch)
        except Exception:  # roll back and isolate: each request alone, so only a failing one fails
            log.exception("castspec: batched round failed; retrying requests one by one")
            for r in batch:
                try:
                    self._round([r])
                except Exception as e:  # noqa: BLE001 - reported to that request's client
                    self._finish(r, "error", f"{type(e).__name__}: {e}")
        self.metrics.busy_ms += (time.perf_counter() - t) * 1e3
        return True

    def _round(self, batch: list[Request]) -> None:
        seqs = [r.seq for r in batch]
        snapshot = [s.draft.snapshot() if s.draft is not None else None for s in seqs]
        try:
            with torch.inference_mode():
                out = run_round(self.target, self.drafter, seqs, self.policy, self.cfg.prefill_budget)
        except Exception:
            for s, snap in zip(seqs, snapshot):  # nothing was committed: restore the drafter's view
                if snap is not None:
                    s.draft.restore(snap)
            raise
        if self.on_round is not None:
            self.on_round(out)
        m = self.metrics
        m.rounds += 1
        decoding = sum(1 for o in out.sequences if o.verified)
        if decoding:
            m.batch_sizes[decoding] = m.batch_sizes.get(decoding, 0) + 1
        m.prefill_tokens += out.prefill_tokens
        now = time.perf_counter()
        for r, o in zip(batch, out.sequences):
            if not o.verified and o.emitted and r.tokens == 0:  # its prompt was read up to its end this round
                self._keep_context(r)
            if o.verified:
                m.verified += 1
                m.committed += o.accepted + 1
                m.acceptance[o.accepted] = m.acceptance.get(o.accepted, 0) + 1
                r.rounds += 1
            self._deliver(r, o.emitted, o.token_logprobs, now)
            if o.error is not None:
                self._finish(r, "error", f"{type(o.error).__name__}: {o.error}")
            else:
                self._finish_if_done(r)

    def _keep_context(self, r: Request) -> None:
        try:
            self.prefix_cache.store(r.seq)
        except Exception:  # noqa: BLE001 - e.g. out of memory for the copy: the request itself is unharmed
            log.exception("castspec: keeping the context of request %d failed", r.id)

    def _deliver(self, r: Request, tokens: list[int], logprobs: list, now: float | None = None) -> None:
        """Hand a request its new tokens and, when it asked for them, their log-probabilities."""
        if not tokens:
            return
        r.first_token = r.first_token or now or time.perf_counter()
        r.tokens += len(tokens)
        self.metrics.tokens += len(tokens)
        try:
            if r.on_logprobs is not None and logprobs:
                r.on_logprobs(logprobs)
            r.on_tokens(tokens)
        except Exception:  # noqa: BLE001 - a broken consumer cancels only its own request
            log.exception("castspec: token callback failed; cancelling request %d", r.id)
            r.cancel()

    def _finish_if_done(self, r: Request) -> None:
        if r.seq.done and not r.cancelled:
            self._finish(r, r.seq.finish_reason or "stop")

    def _finish(self, r: Request, reason: str, error: str | None = None) -> None:
        if r.seq is not None:
            r.seq.done = True
        r.cancelled = r.cancelled or reason in ("cancelled", "error")
        r.finish_reason = reason
        self.metrics.requests[reason] = self.metrics.requests.get(reason, 0) + 1
        if reason in ("stop", "length"):
            self.metrics.goodput_tokens += r.tokens
        try:
            r.on_done(reason, error)
        except Exception:  # noqa: BLE001
            log.exception("castspec: done callback failed for request %d", r.id)
        r.on_done = lambda *_: None  # exactly once

    def _retire(self) -> None:
        keep = []
        for r in self._active:
            if r.cancelled and not r.seq.done:
                self._finish(r, r.stop_reason or "cancelled")
            if not r.seq.done:
                keep.append(r)
            elif r.finish_reason in ("stop", "length"):  # its prompt and answer: what a next turn starts with
                self._keep_context(r)
        self._active = keep

    def _admit(self) -> None:
        forked = []  # (request, first tokens): delivered outside the lock
        with self._lock:
            later: list[Request] = []  # forks whose source is still reading the prompt
            while self._waiting and len(self._active) < self.cfg.max_batch:
                r = self._waiting.popleft()
                if r.cancelled:
                    self._finish(r, "cancelled")
                    continue
                source = r.fork_of
                prefilled = source is not None and source.seq is not None and source.seq.prompt_logits is not None
                if source is not None and source.finish_reason is None and not prefilled:
                    later.append(r)
                    continue
                if source is None and self._waits_for_shared_prompt(r):
                    later.append(r)
                    continue
                try:
                    if prefilled and source.seq.emitted == 1:
                        r.seq, first = source.seq.fork(r.cfg, self.max_nodes)
                        forked.append((r, first))
                    else:
                        r.seq = Sequence(self.target, self.drafter, r.prompt, r.cfg, self.max_nodes)
                        taken = r.cached_tokens = self.prefix_cache.restore(r.seq)
                        if taken:
                            self.metrics.prefix_hits += 1
                            self.metrics.prefix_hit_tokens += taken
                except Exception as e:  # noqa: BLE001 - e.g. out of memory for its caches
                    self._finish(r, "error", f"{type(e).__name__}: {e}")
                    continue
                self._active.append(r)
            self._waiting.extendleft(reversed(later))
        for r, first in forked:
            self._deliver(r, first, r.seq.new_logprobs)
            self._finish_if_done(r)

    def _waits_for_shared_prompt(self, r: Request) -> bool:
        """Whether newcomer `r` shares, with a prompt a running request is still reading, at least
        `wait_for_shared_prompt` tokens more than the prefix cache gives it now: once that prompt is read and
        kept, `r` copies them instead of reading them too."""
        least = self.cfg.wait_for_shared_prompt
        if least <= 0 or self.prefix_cache.max_bytes <= 0:
            return False
        reading = [a.seq for a in self._active if a.seq.reading_prompt]
        if not reading:
            return False
        taps = request_taps(self.drafter, r.cfg)
        prompt = np.asarray(r.prompt, dtype=np.int64)
        # a prompt read with other taps keeps nothing r can take
        shared = max((common_prefix(prompt, np.asarray(seq.prompt, dtype=np.int64)) for seq in reading
                      if seq.taps == taps), default=0)
        shared = min(shared, len(prompt) - 1)
        # the kept prefixes are looked through only for a request that could wait
        return shared >= least and shared - self.prefix_cache.shared(prompt, taps) >= least

    def run(self, stop: threading.Event) -> None:
        """Serve until `stop` is set; sleeps while idle, its OpenMP workers handed back (native/threads.py: the
        pool of a thread that is not computing would slow down the thread that is)."""
        try:  # this thread's one-time costs, before the first request pays them
            warm_up(self.target, self.drafter)
        except Exception:  # noqa: BLE001 - a request would meet the same failure and report it to its client
            log.exception("castspec: warm-up failed; serving anyway")
        idle = False
        while not stop.is_set():
            if self.step():
                idle = False
                continue
            if not idle:
                release_workers()
                idle = True
            with self._lock:
                if not self._waiting:
                    self._lock.wait(timeout=0.05)

    def start(self) -> threading.Event:
        """Serve on a thread of its own. The calling thread (which loaded and probed the models) hands its
        OpenMP workers back first, so that the scheduler's thread is the one whose workers spin."""
        release_workers()
        stop = threading.Event()
        self._thread = threading.Thread(target=self.run, args=(stop,), name="castspec-scheduler", daemon=True)
        self._thread.start()
        return stop

    def close(self, stop: threading.Event) -> None:
        """Stop accepting, cancel what is queued or running, stop the thread."""
        with self._lock:
            self._closed = True
            pending = list(self._waiting)
            self._waiting.clear()
            self._lock.notify()
        stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for r in pending + self._active:
            if r.seq is None or not r.seq.done:
                self._finish(r, "cancelled")
        self._active = []
        self._after_callbacks()
