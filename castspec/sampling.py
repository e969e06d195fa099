"""Logit processing, seeded sampling and log-probabilities shared by every method (ar, chain, cast).

At every visited node the target's logits go through the same steps, in vLLM's order: logit bias, the
min_tokens mask on stop tokens, repetition / frequency / presence penalties (which read the tokens before that
node: the prompt, the output so far and the node's ancestors), then temperature, top-k and top-p. Greedy
decoding takes the argmax after the penalties.

Sampling is coupled to output positions: the token at output index t is the inverse-CDF draw of p at one
uniform u_t made from the request's seed and t alone (a hash, no generator state). That is an exact draw from p,
and since u_t does not depend on the tree, the batch or the method, `ar`, `chain` and `cast` commit the same
tokens for the same seed: a verifier accepts a drafted token exactly when it equals that draw. Everything runs
on the CPU in float64, so CPU and CUDA runs draw the same coins. One uniform per draw, not a noise vector over
the whole vocabulary: generating that vector cost several times the rest of the draw.
The proposal-aware recursive rejection sampler (`verifier="rrs"`) and the direct walk (`"direct"`) keep one
sequential stream per request instead: exact in law, but their draws depend on the tree.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class LogitProcessor:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    presence_penalty: float = 0.0  # subtracted once from tokens already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # logits of tokens in the prompt or output: / r if positive, * r if not
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias) added to the logits
    min_tokens: int = 0  # stop tokens are masked until this many tokens are out
    stop_ids: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, cfg) -> "LogitProcessor":
        return cls(cfg.temperature, cfg.top_k, cfg.top_p, cfg.presence_penalty, cfg.frequency_penalty,
                   cfg.repetition_penalty, tuple(sorted(cfg.logit_bias.items())), cfg.min_tokens,
                   tuple(cfg.stop_token_ids))

    @property
    def adjusts(self) -> bool:
        """Whether anything changes the raw logits before temperature (else greedy is the plain argmax)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or (self.min_tokens and self.stop_ids))

    def adjusted(self, logits: torch.Tensor, history: "History | None" = None) -> torch.Tensor:
        """float64 CPU logits after bias, the min_tokens mask and the penalties (the tokens before this node
        are `history`'s)."""
        x = logits.detach().to("cpu", torch.float64, copy=True)  # one copy, whatever the input's dtype
        if not self.adjusts:
            return x
        if self.logit_bias:
            ids, bias = zip(*self.logit_bias)
            x[list(ids)] += torch.tensor(bias, dtype=torch.float64)
        if history is not None and history.length < self.min_tokens and self.stop_ids:
            x[list(self.stop_ids)] = float("-inf")
        if history is not None and self.repetition_penalty != 1.0:
            seen = history.seen()
            v = x[seen]
            x[seen] = torch.where(v > 0, v / self.repetition_penalty, v * self.repetition_penalty)
        if history is not None and (self.presence_penalty or self.frequency_penalty):
            ids, counts = history.output_counts()
            x[ids] -= self.frequency_penalty * counts + self.presence_penalty
        return x

    def greedy(self, logits: torch.Tensor, history: "History | None" = None) -> int:
        return int(torch.argmax(self.adjusted(logits, history)))

    def probs(self, logits: torch.Tensor, history: "History | None" = None) -> np.ndarray:
        """Processed distribution over the vocabulary (float64, sums to 1) from one row of logits. The softmax
        runs in numpy: on one row torch's per-op overhead cost about as much as the arithmetic."""
        x = self.adjusted(logits, history).numpy()  # a float64 copy of its own
        x /= self.temperature
        if 0 < self.top_k < x.size:
            x[x < np.partition(x, x.size - self.top_k)[x.size - self.top_k]] = -np.inf
        p = np.exp(x - x.max(), out=x)
        p /= p.sum()
        if self.top_p < 1.0:
            # keep the smallest set of most likely tokens whose mass reaches top_p (the first token always stays)
            sorted_p, order = torch.sort(torch.from_numpy(p), descending=True)
            before = torch.cumsum(sorted_p, 0) - sorted_p
            p[order[before >= self.top_p].numpy()] = 0.0
            p /= p.sum()
        return p

    def logprobs(self, logits: torch.Tensor, history: "History | None", processed: bool) -> torch.Tensor:
        """Log-probabilities over the vocabulary: of the raw logits, or (processed) of the law tokens are
        drawn from (after penalties, temperature, top-k, top-p; greedy: after penalties)."""
        if not processed:
            return torch.log_softmax(logits.detach().to("cpu", torch.float64), dim=-1)
        if self.temperature == 0:
            return torch.log_softmax(self.adjusted(logits, history), dim=-1)
        return torch.from_numpy(self.probs(logits, history)).log()


class History:
    """The tokens before a node, as the penalties read them: the prompt, the output so far, and (at a tree node)
    the node's ancestors (`at(path)`)."""

    def __init__(self, prompt: list[int], output: Counter | None = None, length: int = 0):
        self.prompt = prompt
        self.output = output if output is not None else Counter()
        self.length = length  # output tokens so far
        self._prompt_ids: torch.Tensor | None = None

    def extend(self, tokens: list[int]) -> None:
        self.output.update(tokens)
        self.length += len(tokens)

    def at(self, path: list[int]) -> "History":
        if not path:
            return self
        h = History(self.prompt, self.output + Counter(path), self.length + len(path))
        h._prompt_ids = self._prompt_ids
        return h

    def seen(self) -> torch.Tensor:
        if self._prompt_ids is None:
            self._prompt_ids = torch.tensor(sorted(set(self.prompt)), dtype=torch.long)
        out = torch.tensor(list(self.output), dtype=torch.long)
        return torch.unique(torch.cat([self._prompt_ids, out]))

    def output_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(list(self.output), dtype=torch.long)
        counts = torch.tensor([self.output[t] for t in ids.tolist()], dtype=torch.float64)
        return ids, counts


def mix_seed(seed: int, index: int) -> int:
    """A 64-bit seed for stream `index` of `seed` (SplitMix64's finalizer over both): nearby seeds and indices
    give unrelated streams."""
    z = ((seed & MASK64) * 0x9E3779B97F4A7C15 + (index & MASK64) + 0x632BE59BD9B4E019) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)  # torch seeds are signed 64-bit


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of continuation `index` of a request with `seed` (n > 1): the first keeps the request's seed,
    so n = 1 and the first of n draw the same tokens."""
    return seed if seed is None or index == 0 else mix_seed(seed, index)


CDF_BLOCK = 256  # inverse_cdf's two levels: numpy's cumulative sum is sequential, its block sums vectorize


def _first_past(weights: np.ndarray, target: float) -> int:
    """The index whose cumulative weight first exceeds `target`; past the end (rounding), the last of weight > 0."""
    cdf = np.cumsum(weights)
    i = int(np.searchsorted(cdf, target, side="right"))
    return i if i < len(cdf) else int(np.flatnonzero(weights)[-1])


def inverse_cdf(weights: np.ndarray, u: float) -> int:
    """The index whose cumulative weight first exceeds u x the total (u uniform in [0, 1)): never one of weight 0,
    whose cumulative weight equals its predecessor's, even where u x total rounds up to the total.

    Over a vocabulary, in two levels: the block of CDF_BLOCK weights where the cumulative sum passes u x total
    (from the blocks' sums), then the index inside it. The same law (up to float rounding at the boundaries)
    at a fraction of a full cumulative sum's cost."""
    n = len(weights)
    if n < 4 * CDF_BLOCK:
        return _first_past(weights, u * float(np.sum(weights)))
    full = n // CDF_BLOCK * CDF_BLOCK
    sums = weights[:full].reshape(-1, CDF_BLOCK).sum(axis=1)
    if full < n:
        sums = np.append(sums, weights[full:].sum())
    cum = np.cumsum(sums)
    target = u * cum[-1]
    b = int(np.searchsorted(cum, target, side="right"))
    b = b if b < len(cum) else int(np.flatnonzero(sums)[-1])  # u x total rounded up to the total
    start = b * CDF_BLOCK
    return start + _first_past(weights[start:start + CDF_BLOCK], target - (cum[b - 1] if b else 0.0))


class Sampler:
    """Seeded draws for one request: `draw(logits, t, history)` for output index t (coupled, see the module
    docstring), and one sequential stream (`uniform`, `choice`) for the rrs and direct verifiers."""

    def __init__(self, processor: LogitProcessor, seed: int | None):
        self.processor = processor
        self.seed = int.from_bytes(os.urandom(8), "little") if seed is None else int(seed)
        self.generator = torch.Generator().manual_seed(mix_seed(self.seed, -1))

    def coin(self, t: int) -> float:
        """The uniform in [0, 1) of output index t: 53 bits of the (seed, t) hash."""
        return (mix_seed(self.seed, t) >> 10) * 2.0 ** -53

    def draw(self, logits: torch.Tensor, t: int, history: History | None = None) -> int:
        return inverse_cdf(self.processor.probs(logits, history), self.coin(t))

    def uniform(self) -> float:
        return float(torch.rand((), dtype=torch.float64, generator=self.generator))

    def choice(self, weights: np.ndarray) -> int:
        """Index drawn with probability proportional to non-negative `weights` (inverse CDF, one uniform)."""
        return inverse_cdf(weights, self.uniform())


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens at that position, best first


def token_logprob(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The chosen token's log-probability and the `top` best alternatives from one row of log-probabilities."""
    best = []
    if top > 0:
        values, ids = torch.topk(logprobs, min(top, logprobs.numel()))
        best = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(logprobs[token]), tuple(best))


def draft_proposal(draft_logprobs: torch.Tensor, temperature: float) -> np.ndarray:
    """The verifier's proposal q at one depth: the drafter's marginal at the target's temperature (no top-k/p,
    so that no retained child loses its mass to a cut the drafter did not make)."""
    return torch.softmax(draft_logprobs.detach().to("cpu", torch.float64) / temperature, dim=-1).numpy()
