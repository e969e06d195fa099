"""Text out of token ids, as they arrive: incremental detokenization and stop strings, both linear in the text.

`Detokenizer` decodes only a short window of recent ids per call (the last emitted token or two plus the new
ones) instead of the whole output, and emits the window's new text once it no longer ends in an unfinished
UTF-8 sequence. `StopMatcher` is an Aho-Corasick automaton over the stop strings: each produced character is
one transition (amortized), whatever the number and length of the stop strings, and its state also says how
much of the text's tail could still become a stop string (that tail is held back until it cannot).
"""
from __future__ import annotations

from collections import deque


class Detokenizer:
    """Incremental decoding with the tokenizer's own `decode`.

    The window starts one step back (`prefix`): decoding [prefix, read) and [prefix, end) and taking the
    difference gives the new text with the same spacing rules as decoding everything (a decoder that drops a
    word's leading space at the start of a text applies that rule to both halves alike)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # the window starts here
        self.read = 0  # ids before this one have been turned into text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, tokens: list[int], final: bool = False) -> str:
        self.ids.extend(tokens)
        if self.tokenizer is None or self.read == len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""  # nothing visible yet, or an unfinished UTF-8 sequence: wait for the next token
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]


class StopMatcher:
    """Aho-Corasick automaton over stop strings, fed one character at a time."""

    def __init__(self, stops: list[str]):
        self.next: list[dict[str, int]] = [{}]
        self.depth = [0]  # length of the string a state stands for
        ends = [False]
        for s in stops:
            node = 0
            for ch in s:
                if ch not in self.next[node]:
                    self.next.append({})
                    self.depth.append(self.depth[node] + 1)
                    ends.append(False)
                    self.next[node][ch] = len(self.next) - 1
                node = self.next[node][ch]
            ends[node] = True
        self.fail = [0] * len(self.next)
        self.match = [0] * len(self.next)  # length of the longest stop string ending at this state, 0 if none
        order = deque(self.next[0].values())  # the root's children fail to the root
        while order:  # breadth first: a failure link points to a shallower state, which is done already
            node = order.popleft()
            self.match[node] = self.depth[node] if ends[node] else self.match[self.fail[node]]
            for ch, child in self.next[node].items():
                self.fail[child] = self._step(self.fail[node], ch)
                order.append(child)
        self.state = 0

    def _step(self, state: int, ch: str) -> int:
        while state and ch not in self.next[state]:
            state = self.fail[state]
        return self.next[state].get(ch, 0)

    def feed(self, text: str) -> int | None:
        """Advance over `text`. Returns the index in `text` just past the first completed stop string
        (whose start may lie in text fed before: see `matched`), or None."""
        for i, ch in enumerate(text):
            self.state = self._step(self.state, ch)
            if self.match[self.state]:
                return i + 1
        return None

    @property
    def matched(self) -> int:
        """Length of the stop string that completed at the current state (0 if none)."""
        return self.match[self.state]

    @property
    def partial(self) -> int:
        """Length of the longest tail of the text fed so far that is the start of some stop string."""
        return self.depth[self.state]


class TextStream:
    """Incremental text with stop strings: returns only text that can no longer change (an unfinished UTF-8
    sequence, or a tail that could be the start of a stop string, waits for more tokens). The text ends just
    before the first stop string to appear in full."""

    def __init__(self, tokenizer, stops: list[str]):
        self.detok = Detokenizer(tokenizer)
        self.matcher = StopMatcher([s for s in stops if s])
        self.held = ""  # decoded text not yet returned: it could still begin a stop string
        self.stopped = False

    @property
    def ids(self) -> list[int]:
        return self.detok.ids

    def add(self, tokens: list[int], final: bool = False) -> str:
        if self.stopped:
            return ""
        new = self.detok.add(tokens, final)
        text = self.held + new
        end = self.matcher.feed(new)
        if end is not None:  # the stop string ends at len(held) + end and starts `matched` characters earlier
            self.stopped, self.held = True, ""
            return text[:len(text) - len(new) + end - self.matcher.matched]
        keep = 0 if final else min(self.matcher.partial, len(text))
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep]
