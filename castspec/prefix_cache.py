"""Prompt prefixes read once: a request whose prompt starts like an earlier one's copies that part of its caches
instead of reading it again (what vLLM calls automatic prefix caching and SGLang a radix cache).

Why: reading a prompt is compute-bound (every prompt token is a row of every product), and under load it is a
large share of a server's work: chat requests share the chat template's system turn, and clients resend the same
conversation with one more turn. A request admitted here takes the longest prefix it shares with a kept prompt.

Exactness: a prompt row's keys, values and tapped features depend only on the tokens up to it. The native
forwards compute every row's bits the same whatever else is in the forward (csrc/layer.h), so a prefix copied
from another request's prompt is bit for bit the prefix this request would have read, and its outputs are the
same; on torch's kernels the copy differs from a fresh read no more than reading the prompt in other chunks does.

What is kept: per prompt, the target cache's slots of the prompt and, where the request drafts, the target
features the drafter reads as its context (a drafter fuses a prompt's context only after the prompt is read, so
these are all of its state). The oldest entries go first once the kept bytes pass `max_bytes`.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from .sequence import Sequence


@dataclass
class _Entry:
    tokens: np.ndarray  # int64 [n]
    k: torch.Tensor  # [layers, 1, kv_heads, n, head_dim]
    v: torch.Tensor
    features: torch.Tensor | None  # [1, n, taps * hidden]: the drafter's context rows; None if it did not draft
    taps: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        f = self.features
        return (self.k.numel() * self.k.element_size() * 2
                + (0 if f is None else f.numel() * f.element_size()) + self.tokens.nbytes)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class PrefixCache:
    """Kept prompt prefixes of one scheduler's requests (its thread only)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # oldest use first
        self._ids = 0
        self.bytes = 0
        self.hits = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def restore(self, seq: Sequence) -> int:
        """Before `seq` reads its prompt: copy the longest kept prefix it shares (never the whole prompt: its
        last token is read, its logits give the first output token). Returns the prompt tokens taken."""
        if seq.prefilled or not self._entries:
            return 0
        prompt = np.asarray(seq.prompt, dtype=np.int64)
        best, best_n = None, 0
        for key, e in self._entries.items():
            if e.taps != seq.taps or (seq.draft is not None and e.features is None):
                continue
            n = _common_prefix(prompt, e.tokens)
            if n > best_n:
                best, best_n = key, n
        n = min(best_n, len(prompt) - 1)
        if n <= 0:
            return 0
        e = self._entries[best]
        self._entries.move_to_end(best)
        seq.cache.k[:, :, :, :n] = e.k[:, :, :, :n]
        seq.cache.v[:, :, :, :n] = e.v[:, :, :, :n]
        seq.cache.length = seq.prefilled = n
        if seq.draft is not None:
            seq.draft.add_context(e.features[:, :n])
        self.hits += 1
        self.hit_tokens += n
        return n

    def store(self, seq: Sequence) -> None:
        """After `seq` has read its whole prompt (before any drafter pass): keep its prompt's caches, unless a
        kept prompt already starts with it; kept prompts it extends are dropped."""
        if self.max_bytes <= 0 or seq.reading_prompt or seq.prompt_logits is None:
            return
        n = len(seq.prompt)
        features = None
        if seq.draft is not None:
            pending = seq.draft.pending
            if seq.draft.cache.length or pending is None or pending.shape[1] < n:
                return  # the drafter has already fused some of the prompt: its context is not all here
            features = pending[:, :n].clone()
        tokens = np.asarray(seq.prompt, dtype=np.int64)
        for key, e in list(self._entries.items()):
            if e.taps != seq.taps:
                continue
            shared = _common_prefix(tokens, e.tokens)
            if shared == n and (features is None or e.features is not None):
                self._entries.move_to_end(key)
                return  # already kept, as part of a longer prompt or alone
            if shared == len(e.tokens) and (e.features is None or features is not None):
                self._drop(key)
        entry = _Entry(tokens, seq.cache.k[:, :, :, :n].clone(), seq.cache.v[:, :, :, :n].clone(), features,
                       seq.taps)
        if entry.nbytes > self.max_bytes:
            return
        self._ids += 1
        self._entries[self._ids] = entry
        self.bytes += entry.nbytes
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: int) -> None:
        self.bytes -= self._entries.pop(key).nbytes
