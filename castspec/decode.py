"""Single-request decoding for `ar`, `chain` and `cast`: a generator over `castspec.batch.run_round` with one
sequence (the same round the scheduler runs for many), plus the per-round statistics.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .allocate import Chain, CostAware, FixedWidth, Policy
from .config import DecodeConfig
from .models.decoder import Decoder
from .models.dflash import DFlashDrafter
from .round import run_round, synchronize
from .sequence import ContextLengthError, Sequence  # noqa: F401  (re-exported: the public error type)


@dataclass(slots=True)
class RoundStats:
    accepted: int  # drafted tokens accepted (R = accepted + 1 with the target's own token)
    packed: int  # tokens in the verify forward (tree nodes + root)
    draft_ms: float
    verify_ms: float
    host_ms: float  # tree build, packing, walk, cache compaction


@dataclass
class DecodeStats:
    prefill_ms: float = 0.0
    first_draft_ms: float = 0.0
    rounds: list[RoundStats] = field(default_factory=list)
    new_tokens: int = 0
    decode_ms: float = 0.0  # after prefill and the first draft, until the last token (Appendix D timer)

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)

    @property
    def mean_accepted(self) -> float:
        """R: mean tokens committed per round, the target's own token included."""
        return sum(r.accepted + 1 for r in self.rounds) / max(len(self.rounds), 1)

    @property
    def decode_ms_per_token(self) -> float:
        return self.decode_ms / max(self.new_tokens - 1, 1)

    def to_dict(self) -> dict:
        n = max(len(self.rounds), 1)
        return {
            "rounds": len(self.rounds),
            "new_tokens": self.new_tokens,
            "mean_accepted": self.mean_accepted,
            "mean_packed": sum(r.packed for r in self.rounds) / n,
            "prefill_ms": self.prefill_ms,
            "decode_ms": self.decode_ms,
            "decode_ms_per_token": self.decode_ms_per_token,
            "draft_ms_per_round": sum(r.draft_ms for r in self.rounds) / n,
            "verify_ms_per_round": sum(r.verify_ms for r in self.rounds) / n,
            "host_ms_per_round": sum(r.host_ms for r in self.rounds) / n,
        }


def policy_for(cfg: DecodeConfig, drafter: DFlashDrafter | None, width_rule=None) -> Policy | None:
    """The allocation policy a single request's config asks for (None for `ar`)."""
    if cfg.method == "ar" or drafter is None:
        return None
    if cfg.method == "chain":
        return Chain()
    if cfg.width == "auto" and width_rule is not None:
        return CostAware(width_rule, cfg.top_k_per_position)
    return FixedWidth(cfg.resolved_width, cfg.top_k_per_position)


def decode(target: Decoder, drafter: DFlashDrafter | None, prompt: list[int], cfg: DecodeConfig,
           stats: DecodeStats | None = None, width_rule=None, on_round=None,
           logprobs: list | None = None) -> Iterator[list[int]]:
    """Yield the new tokens round by round (after stop handling); fill `stats` as it goes, and `logprobs` with
    one sampling.TokenLogprob per yielded token when cfg.logprobs is set.

    width_rule (a cost.RoundWidth) picks each round's width for method "cast" with width "auto"; without one,
    "auto" means the fixed DEFAULT_WIDTH. on_round(logprobs, tree, accepted_rows, emitted) observes every
    drafted round (round logs for the width analyses); it must not modify its arguments.
    """
    if cfg.method != "ar" and drafter is None:
        raise ValueError(f"method {cfg.method!r} needs a drafter")
    stats = stats if stats is not None else DecodeStats()
    if cfg.max_new_tokens == 0:
        return
    if cfg.method != "cast" or cfg.width != "auto":
        width_rule = None
    drafter = drafter if cfg.method != "ar" else None
    policy = policy_for(cfg, drafter, width_rule)
    L = drafter.cfg.num_draft_positions if drafter is not None else 0
    seq = Sequence(target, drafter, prompt, cfg, policy.max_nodes(L) if policy is not None else 0)
    key = id(seq)
    clock = time.perf_counter
    t0 = clock()
    with torch.inference_mode():
        first = run_round(target, drafter, [seq], policy, prefill_budget=len(prompt))
        raise_errors(first)
        synchronize(target.device)
        stats.prefill_ms = (clock() - t0) * 1e3
        stats.new_tokens = seq.emitted
        if logprobs is not None:
            logprobs.extend(first.token_logprobs.get(key, []))
        yield first.emitted[key]
        t_decode = clock()
        while not seq.done:
            out = run_round(target, drafter, [seq], policy)
            raise_errors(out)
            if not stats.rounds:
                # the decode-only timer opens after prefill and the first draft (Appendix D)
                stats.first_draft_ms = out.draft_ms
            stats.rounds.append(RoundStats(out.accepted[key], out.packed, out.draft_ms, out.verify_ms,
                                           out.host_ms))
            stats.decode_ms = (clock() - t_decode) * 1e3 - stats.first_draft_ms
            if on_round is not None and key in out.logprobs:
                on_round(out.logprobs[key], out.trees[key], out.paths[key], out.emitted[key])
            stats.new_tokens = seq.emitted
            if logprobs is not None:
                logprobs.extend(out.token_logprobs.get(key, []))
            yield out.emitted[key]


def raise_errors(out) -> None:
    for err in out.errors.values():
        raise err
