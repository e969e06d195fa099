"""Statistics for the benchmark: paired prompt-level bootstrap of speed ratios."""
from __future__ import annotations

import numpy as np


def ratio_of_rates(base_ms: np.ndarray, base_tok: np.ndarray, ms: np.ndarray, tok: np.ndarray) -> float:
    """How much faster per token `ms/tok` is than `base` over the same prompts (pooled, not per-prompt means)."""
    return float((base_ms.sum() / base_tok.sum()) / (ms.sum() / tok.sum()))


def paired_bootstrap(base_ms, base_tok, ms, tok, resamples: int = 10_000, seed: int = 0,
                     level: float = 0.95) -> tuple[float, float, float]:
    """Gain (ratio - 1) of a method over a baseline on the same prompts, with a paired bootstrap CI:
    prompts are resampled with replacement and both methods keep their own numbers for each drawn prompt."""
    base_ms, base_tok, ms, tok = (np.asarray(a, dtype=float) for a in (base_ms, base_tok, ms, tok))
    n = len(ms)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(resamples, n))
    gains = (base_ms[idx].sum(1) / base_tok[idx].sum(1)) / (ms[idx].sum(1) / tok[idx].sum(1)) - 1.0
    alpha = (1 - level) / 2
    point = ratio_of_rates(base_ms, base_tok, ms, tok) - 1.0
    return point, float(np.quantile(gains, alpha)), float(np.quantile(gains, 1 - alpha))
