"""Logit processing and seeded sampling shared by every method (ar, chain, cast) at temperature > 0.

The processed target law p = top_p(top_k(softmax(logits / T))) is computed the same way at every visited node;
all sampling runs on the CPU in float64 with one seeded torch.Generator, so a seed reproduces a run exactly and
CPU and CUDA runs draw the same coins.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class LogitProcessor:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def probs(self, logits: torch.Tensor) -> np.ndarray:
        """Processed distribution over the vocabulary (float64, sums to 1) from one row of logits."""
        x = logits.detach().to("cpu", torch.float64) / self.temperature
        if 0 < self.top_k < x.numel():
            kth = torch.topk(x, self.top_k).values[-1]
            x = torch.where(x < kth, torch.full_like(x, float("-inf")), x)
        p = torch.softmax(x, dim=-1)
        if self.top_p < 1.0:
            # keep the smallest set of most likely tokens whose mass reaches top_p (the first token always stays)
            sorted_p, order = torch.sort(p, descending=True)
            before = torch.cumsum(sorted_p, 0) - sorted_p
            drop = order[before >= self.top_p]
            p[drop] = 0.0
            p = p / p.sum()
        return p.numpy()


class Sampler:
    """Seeded draws for one request."""

    def __init__(self, processor: LogitProcessor, seed: int | None):
        self.processor = processor
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def uniform(self) -> float:
        return float(torch.rand((), dtype=torch.float64, generator=self.generator))

    def choice(self, weights: np.ndarray) -> int:
        """Index drawn with probability proportional to non-negative `weights` (inverse CDF, one uniform)."""
        cdf = np.cumsum(weights)
        u = self.uniform() * cdf[-1]
        return int(min(np.searchsorted(cdf, u, side="right"), len(weights) - 1))

    def token(self, logits: torch.Tensor) -> int:
        return self.choice(self.processor.probs(logits))


def draft_proposal(draft_logprobs: torch.Tensor, temperature: float) -> np.ndarray:
    """The verifier's proposal q at one depth: the drafter's marginal at the target's temperature (no top-k/p,
    so that no retained child loses its mass to a cut the drafter did not make)."""
    return torch.softmax(draft_logprobs.detach().to("cpu", torch.float64) / temperature, dim=-1).numpy()
