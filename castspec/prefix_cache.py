"""Prompt prefixes read once: a request whose prompt starts like an earlier request's context (its prompt, or its
prompt and answer) copies that part of its caches instead of reading it again (what vLLM calls automatic prefix
caching and SGLang a radix cache).

Why: reading a prompt is compute-bound (every prompt token is a row of every product), and under load it is a
large share of a server's work: chat requests share the chat template's system turn, and a chat client sends
the whole conversation again with one more turn. A request admitted here takes the longest prefix it shares
with a kept context.

Exactness: a row's keys, values and tapped features depend only on the tokens up to it. The native forwards
compute every row's bits the same whatever else is in the forward (csrc/layer.h), so a prefix copied from
another request is bit for bit the prefix this request would have read, and its outputs are the same; on
torch's kernels the copy differs from a fresh read no more than reading the prompt in other chunks does.

What is kept, per request, when it has read its prompt and again when it ends: the target cache's slots of its
committed context and, where it drafts, the drafter's state for them (its context cache for the positions its
passes have fused, the target features of the rest). The oldest entries go first once the kept bytes pass
`max_bytes`.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from .sequence import Sequence


@dataclass
class _Entry:
    tokens: np.ndarray  # int64 [n]: the context whose caches are kept
    k: torch.Tensor  # [layers, 1, kv_heads, n, head_dim]
    v: torch.Tensor
    taps: tuple[int, ...]
    # a drafting request's drafter state (None for one that did not draft): its context cache's first `fused`
    # slots, and the target features of positions [fused, n) (None where its passes fused them all)
    draft_k: torch.Tensor | None = None
    draft_v: torch.Tensor | None = None
    features: torch.Tensor | None = None

    @property
    def fused(self) -> int:
        return 0 if self.draft_k is None else self.draft_k.shape[3]

    @property
    def drafts(self) -> bool:
        return self.draft_k is not None

    @property
    def nbytes(self) -> int:
        """The memory the entry holds alive: whole storages, where it shares a request's (see _kept)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (self.k, self.v, self.draft_k, self.draft_v, self.features) if t is not None}
        return sum(storages.values()) + self.tokens.nbytes


def _kept(t: torch.Tensor, n: int, owned: bool) -> torch.Tensor:
    """Slots [0, n) of a cache tensor [layers, 1, heads, capacity, d], shared where the storage is the request's
    own and mostly used: a request never writes below its committed length again (later rows, tree nodes and
    their compaction go past it), so a shared prefix stays as it was, and the storage outlives the request as
    long as the entry. Copied where the storage is lent (castspec/graphs.py: the next sequence writes it) or
    mostly unused (a request that asked for many more tokens than it wrote would pin them all)."""
    return t[:, :, :, :n] if owned and 2 * n >= t.shape[3] else t[:, :, :, :n].clone()


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
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

    def _longest(self, prompt: np.ndarray, taps: tuple[int, ...]) -> tuple[int | None, int]:
        """The kept context sharing the longest prefix with `prompt` that a request with `taps` can take (one
        that drafts needs the drafter's state, which only contexts kept with its taps have): (key, length)."""
        best, best_n = None, 0
        for key, e in self._entries.items():
            if e.taps != taps or (taps and not e.drafts):
                continue
            n = common_prefix(prompt, e.tokens)
            if n > best_n:
                best, best_n = key, n
        return best, best_n

    def shared(self, prompt: np.ndarray, taps: tuple[int, ...]) -> int:
        """How many of `prompt`'s first tokens a request with `taps` would copy now (its last token aside)."""
        return min(self._longest(prompt, taps)[1], len(prompt) - 1) if self._entries else 0

    def restore(self, seq: Sequence) -> int:
        """Before `seq` reads its prompt: copy the longest kept prefix it shares (never the whole prompt: its
        last token is read, its logits give the first output token). Returns the prompt tokens taken."""
        if seq.prefilled or not self._entries:
            return 0
        prompt = np.asarray(seq.prompt, dtype=np.int64)
        best, best_n = self._longest(prompt, seq.taps)
        n = min(best_n, len(prompt) - 1)
        if n <= 0:
            return 0
        e = self._entries[best]
        self._entries.move_to_end(best)
        seq.cache.k[:, :, :, :n] = e.k[:, :, :, :n]
        seq.cache.v[:, :, :, :n] = e.v[:, :, :, :n]
        seq.cache.length = seq.prefilled = n
        if seq.draft is not None:
            fused = min(n, e.fused)
            if fused:
                seq.draft.cache.k[:, :, :, :fused] = e.draft_k[:, :, :, :fused]
                seq.draft.cache.v[:, :, :, :fused] = e.draft_v[:, :, :, :fused]
            seq.draft.cache.length = fused
            if n > fused:
                seq.draft.add_context(e.features[:, :n - fused])
        self.hits += 1
        self.hit_tokens += n
        return n

    def store(self, seq: Sequence) -> None:
        """Keep `seq`'s committed context (after it has read its prompt: at its end, or when it finishes),
        unless a kept context already starts with it; kept contexts it extends are dropped."""
        if self.max_bytes <= 0 or seq.reading_prompt or seq.prompt_logits is None:
            return
        # the cache's slots hold the prompt and the output but its last token, and past a stop token the rest
        # of an accepted path that was cut from the output: only the slots of known tokens are kept
        tokens = (seq.prompt + seq.output)[:seq.cache.length]
        n = len(tokens)
        owned = seq.cache.owned
        entry = _Entry(np.asarray(tokens, dtype=np.int64), _kept(seq.cache.k, n, owned),
                       _kept(seq.cache.v, n, owned), seq.taps)
        if seq.draft is not None:
            fused, pending = seq.draft.cache.length, seq.draft.pending
            if fused + (0 if pending is None else pending.shape[1]) != seq.cache.length:
                return  # the drafter's state does not cover the context (not at a round's end)
            fused, owned = min(fused, n), seq.draft.cache.owned
            entry.draft_k = _kept(seq.draft.cache.k, fused, owned)
            entry.draft_v = _kept(seq.draft.cache.v, fused, owned)
            if n > fused:  # features are never written in place; a copy only where the rows sit in a larger tensor
                rows = pending[:, :n - fused]
                whole = rows.untyped_storage().nbytes() <= rows.numel() * rows.element_size()
                entry.features = rows if whole else rows.clone()
        for key, e in list(self._entries.items()):
            if e.taps != seq.taps:
                continue
            shared = common_prefix(entry.tokens, e.tokens)
            if shared == n and (e.drafts or not entry.drafts):
                self._entries.move_to_end(key)
                return  # already kept, as part of a longer context or alone
            if shared == len(e.tokens) and (entry.drafts or not e.drafts):
                self._drop(key)
        if entry.nbytes > self.max_bytes:
            return
        self._ids += 1
        self._entries[self._ids] = entry
        self.bytes += entry.nbytes
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: int) -> None:
        self.bytes -= self._entries.pop(key).nbytes
