"""Single-request decoding for `ar`, `chain` and `cast`: a generator over `castspec.round.run_round` with one
sequence (the same round the scheduler runs for many), plus the per-round statistics.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .allocate import PolicySpec, make_policy
from .config import DecodeConfig
from .cost import Calibration, CostProfile
from .models.decoder import Decoder
from .models.dflash import DFlashDrafter
from .round import SequenceOutput, run_round, synchronize
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


def decode(target: Decoder, drafter: DFlashDrafter | None, prompt: list[int], cfg: DecodeConfig,
           stats: DecodeStats | None = None, profile: CostProfile | None = None,
           calibration: Calibration | None = None, on_round=None, logprobs: list | None = None) -> Iterator[list[int]]:
    """Yield the new tokens round by round (after stop handling); fill `stats` as it goes, and `logprobs` with
    one sampling.TokenLogprob per yielded token when cfg.logprobs is set.

    The policy is `allocate.make_policy` of the config: width="auto" is the cost rule, which reads `profile`
    (this deployment's measured costs; Engine passes its own) and, when given, `calibration`; without a profile
    "auto" is an error, an integer width is not. on_round(logprobs, tree, accepted_rows, emitted) observes every
    drafted round (round logs for the width analyses); it must not modify its arguments.
    """
    if cfg.method != "ar" and drafter is None:
        raise ValueError(f"method {cfg.method!r} needs a drafter")
    stats = stats if stats is not None else DecodeStats()
    if cfg.max_new_tokens == 0:
        return
    drafter = drafter if cfg.method != "ar" else None
    L = drafter.cfg.num_draft_positions if drafter is not None else 0
    policy = make_policy(PolicySpec.for_request(cfg), L, profile, calibration)
    seq = Sequence(target, drafter, prompt, cfg, policy.max_nodes(L) if policy is not None else 0)
    clock = time.perf_counter
    t0 = clock()
    with torch.inference_mode():
        (first,) = run_round(target, drafter, [seq], policy, prefill_budget=len(prompt)).sequences
        raise_error(first)
        synchronize(target.device)
        stats.prefill_ms = (clock() - t0) * 1e3
        stats.new_tokens = seq.emitted
        if logprobs is not None:
            logprobs.extend(first.token_logprobs)
        yield first.emitted
        t_decode = clock()
        while not seq.done:
            out = run_round(target, drafter, [seq], policy)
            (one,) = out.sequences
            raise_error(one)
            if not stats.rounds:
                # the decode-only timer opens after prefill and the first draft (Appendix D)
                stats.first_draft_ms = out.draft_ms
            stats.rounds.append(RoundStats(one.accepted, out.packed, out.draft_ms, out.verify_ms, out.host_ms))
            stats.decode_ms = (clock() - t_decode) * 1e3 - stats.first_draft_ms
            if on_round is not None and one.draft_logprobs is not None:
                on_round(one.draft_logprobs, one.tree, one.path, one.emitted)
            stats.new_tokens = seq.emitted
            if logprobs is not None:
                logprobs.extend(one.token_logprobs)
            yield one.emitted


def raise_error(out: SequenceOutput) -> None:
    if out.error is not None:
        raise out.error
