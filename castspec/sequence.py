"""One request's decoding state (target cache, drafter state, pending root) and the batched drafter pass.

Round contract (paper, Appendix C): the target cache holds the prefix x (length P); the pending root b is known
but not cached. A round drafts from the features of x and b, packs [b, tree], runs one target forward, walks
the tree, commits b + the accepted path to both caches and makes the target's next token the new root.
A Sequence only says which rows it contributes to a forward (a `Segment`) and what to do with their outputs;
`castspec.round.run_round` puts the rows of every active Sequence into one forward.
"""
from __future__ import annotations

import torch

from .config import DecodeConfig
from .models.decoder import Decoder
from .models.dflash import DFlashDrafter, DraftSegment
from .models.kvcache import Segment
from .pack import Pack, pack_tree
from .sampling import History, LogitProcessor, Sampler, TokenLogprob, token_logprob
from .tree import Marginals, Tree
from .verify import sampled_walk, walk


class ContextLengthError(ValueError):
    """Prompt plus requested output would not fit the model's context."""


def check_request(prompt: list[int], max_new_tokens: int, max_positions: int,
                  limit_name: str = "max_new_tokens") -> None:
    """A request must have a prompt, and prompt + output must fit the context (`limit_name` is the caller's
    name for the output limit, so the message names the field the user set)."""
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    if len(prompt) + max_new_tokens > max_positions:
        raise ContextLengthError(f"prompt ({len(prompt)} tokens) + {limit_name} ({max_new_tokens}) exceeds the "
                                 f"model's context of {max_positions} tokens")


class DraftState:
    """The drafter's side of one sequence: its context-only KV cache and the features not yet in it."""

    def __init__(self, drafter: DFlashDrafter, capacity: int):
        self.drafter = drafter
        self.cache = drafter.new_cache(capacity)
        self._chunks: list[torch.Tensor] = []  # the pending features, in the order the rounds added them
        self._rows = 0  # their rows in all

    @property
    def pending(self) -> torch.Tensor | None:
        """[1, C, taps*H] features of positions [cache.length, +C) (None when there are none), joined when read:
        a sequence that does not draft for many rounds (under load) only appends, instead of copying all it has
        pending every round."""
        if len(self._chunks) > 1:
            self._chunks = [torch.cat(self._chunks, dim=1)]
        return self._chunks[0] if self._chunks else None

    @pending.setter
    def pending(self, features: torch.Tensor | None) -> None:
        self._chunks = [] if features is None else [features]
        self._rows = 0 if features is None else features.shape[1]

    @property
    def pending_rows(self) -> int:
        """How many context rows the next pass fuses (asked every round under load: kept, not summed)."""
        return self._rows

    def add_context(self, features: torch.Tensor) -> None:
        self._chunks.append(features)
        self._rows += features.shape[1]

    def snapshot(self) -> tuple[int, list[torch.Tensor]]:
        """What `restore` needs to undo a round: the cache length and the pending chunks as they are (not joined:
        a request that does not draft for many rounds would otherwise copy all it has pending every round)."""
        return self.cache.length, list(self._chunks)

    def restore(self, snap: tuple[int, list[torch.Tensor]]) -> None:
        self.cache.length, self._chunks = snap[0], list(snap[1])
        self._rows = sum(c.shape[1] for c in self._chunks)

    def propose(self, target: Decoder, root: int, depth: int) -> Marginals:
        """Log-probabilities [depth, V] of the next `depth` tokens after `root` (at position = context end), with
        their support."""
        return propose_batch(target, self.drafter, [self], [root], [depth])[0]


def propose_batch(target: Decoder, drafter: DFlashDrafter, states: list[DraftState], roots: list[int],
                  depths: list[int]) -> list[Marginals]:
    """One drafter pass for several sequences: their new context rows and their blocks [root, MASK x L] are
    concatenated (ragged, no padding), each block attending to its own cache only. Returns per-sequence
    log-probabilities [depth_i, V] with their support (`Marginals`)."""
    device = target.device
    # a batched pass whose trees read only a block's first positions runs its blocks cut, where the drafter was
    # trained so (one request's pass keeps its whole block: its trees read it, and CUDA graphs hold its shape)
    L = (drafter.cfg.block_rows(max(depths)) if len(states) > 1 else drafter.cfg.block_size) - 1
    max_pos = drafter.cfg.max_positions - 1
    masks = [drafter.cfg.mask_token_id] * L
    feats, segments = [], []
    block_ids, block_pos, ctx_pos = [], [], []  # lists, made one tensor once: a pass runs every round
    for st, root in zip(states, roots):
        pending = st.pending
        start, ctx_len = st.cache.length, pending.shape[1]
        root_pos = start + ctx_len
        feats.append(pending)
        ctx_pos.extend(range(start, root_pos))
        block_ids.append(root)
        block_ids.extend(masks)
        end = root_pos + L + 1
        # near the end of the context the block's trailing rows (never used: depth is capped) would sit past the
        # last position; pin them to it rather than shrink the block, which would change the rows we do use
        block_pos.extend(range(root_pos, end) if end <= max_pos + 1 else
                         (min(p, max_pos) for p in range(root_pos, end)))
        segments.append(DraftSegment(st.cache, start, ctx_len, L + 1))
        st.pending = None
    T = len(block_ids)
    flat = torch.tensor(block_ids + block_pos + ctx_pos, device=device)  # one tensor made, not three
    return drafter.propose_segments(  # one head product for all blocks
        target, flat[:T].view(1, T), flat[T:2 * T].view(1, T),
        feats[0] if len(feats) == 1 else torch.cat(feats, dim=1), flat[2 * T:].view(1, -1), segments, depths)


def request_taps(drafter: DFlashDrafter | None, cfg: DecodeConfig) -> tuple[int, ...]:
    """The target layers whose features a request decoded with `cfg` keeps for the drafter (none if it does not
    draft)."""
    return tuple(drafter.cfg.target_layer_ids) if drafter is not None and cfg.method != "ar" else ()


class Sequence:
    """One request: its caches, prompt progress, pending root, output and stop handling."""

    def __init__(self, target: Decoder, drafter: DFlashDrafter | None, prompt: list[int], cfg: DecodeConfig,
                 max_nodes: int = 0):
        check_request(prompt, cfg.max_new_tokens, target.cfg.max_positions)
        self.target, self.cfg = target, cfg
        self.drafter = drafter if cfg.method != "ar" else None
        L = self.drafter.cfg.num_draft_positions if self.drafter else 0
        self.capacity = len(prompt) + cfg.max_new_tokens + 1
        # a verify pack writes root + up to max_nodes tree nodes past the prefix before compaction
        self.cache = target.new_cache(self.capacity + max_nodes + 1)
        self.taps = request_taps(drafter, cfg)
        self.draft = DraftState(self.drafter, self.capacity + L + 1) if self.drafter else None
        self.prompt = prompt
        self.prefilled = 0  # prompt tokens already in the cache
        self.prompt_logits: torch.Tensor | None = None  # the target's logits after the prompt (for forks)
        self.root: int | None = None
        bad = [t for t in [*cfg.logit_bias, *cfg.stop_token_ids] if t >= target.cfg.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (size {target.cfg.vocab_size})")
        self.proc = LogitProcessor.from_config(cfg)
        self.history = History(prompt)  # what the penalties read: prompt and output
        self.sampler = Sampler(self.proc, cfg.seed) if cfg.temperature > 0 else None  # None = greedy
        self.stop = set(cfg.stop_token_ids)
        self.new_logprobs: list[TokenLogprob] = []  # of the tokens the last round emitted (cfg.logprobs)
        self.output: list[int] = []  # the tokens emitted so far
        self.done = cfg.max_new_tokens == 0
        self.finish_reason: str | None = "length" if self.done else None  # "stop" | "length" once done

    @property
    def prefix_len(self) -> int:
        return self.cache.length

    @property
    def decoding(self) -> bool:
        return self.root is not None and not self.done

    @property
    def reading_prompt(self) -> bool:
        """Still prefilling: its next rows are a prompt chunk (the root comes with the prompt's last one)."""
        return self.root is None and not self.done

    @property
    def emitted(self) -> int:
        return len(self.output)

    @property
    def remaining(self) -> int:
        return self.cfg.max_new_tokens - self.emitted

    def wants_draft(self) -> bool:
        """A draft is useful when at least two more tokens may be emitted (the root's successor is free)."""
        return self.draft is not None and self.decoding and self.remaining > 1

    # -- prefill -----------------------------------------------------------------------------------------
    def prefill_segment(self, budget: int) -> tuple[list[int], list[int], Segment]:
        """The next chunk of at most `budget` prompt tokens: (ids, positions, segment)."""
        a = self.prefilled
        b = min(len(self.prompt), a + budget)
        n = b - a
        mask = None
        if a > 0:  # a later chunk sees the cached prompt and itself causally
            vis = torch.ones(n, a + n, dtype=torch.bool)
            vis[:, a:] = torch.tril(vis[:, a:])
            mask = vis.view(1, 1, n, a + n).to(self.target.device)
        return self.prompt[a:b], list(range(a, b)), Segment(self.cache, a, n, mask, causal=a == 0)

    def finish_prefill_chunk(self, n: int, last_logits: torch.Tensor | None, greedy: int | None,
                             feats: torch.Tensor | None) -> list[int]:
        """Account a prefilled chunk; after the last one the target's next token becomes the root and the
        first output token. Returns the emitted tokens (empty until the prompt is complete)."""
        self.new_logprobs = []
        self.prefilled += n
        self.cache.length = self.prefilled
        if self.draft is not None:
            self.draft.add_context(feats)
        if self.prefilled < len(self.prompt):
            return []
        rows = self.prompt_logits = last_logits.view(1, -1)
        self.root = self._picker(rows, [greedy])(0, [])
        return self._emit([self.root], rows, [0])

    def fork(self, cfg: DecodeConfig, max_nodes: int = 0) -> tuple["Sequence", list[int]]:
        """Another continuation of this sequence's prompt with its own config (seed): the prompt's caches are
        copied, not prefilled again, and its first token is drawn from the same prompt logits. Only after this
        sequence's prefill. Returns (the new sequence, its first emitted tokens)."""
        if self.prompt_logits is None or self.emitted != 1:
            raise RuntimeError("a sequence forks between its prefill and its first round only")
        child = Sequence(self.target, self.drafter, self.prompt, cfg, max_nodes)
        n = child.prefilled = len(self.prompt)
        child.cache.copy_prefix(self.cache, n)
        if child.draft is not None:  # the drafter has seen what this sequence has of the prompt: the same
            child.draft.cache.copy_prefix(self.draft.cache, self.draft.cache.length)
            pending = self.draft.pending
            if pending is not None and self.draft.cache.length + pending.shape[1] > n:  # rows past the prompt
                pending = pending[:, :n - self.draft.cache.length]
            child.draft.pending = pending
        rows = child.prompt_logits = self.prompt_logits
        child.root = child._picker(rows, [int(rows[0].argmax())])(0, [])
        return child, child._emit([child.root], rows, [0])

    # -- verify ------------------------------------------------------------------------------------------
    def verify_segment(self, tree: Tree) -> tuple[Pack, Segment]:
        P = self.prefix_len
        pack = pack_tree(tree, self.root, P, self.target.device)
        return pack, Segment(self.cache, P, len(tree) + 1, pack.mask)

    def commit(self, tree: Tree, logits: torch.Tensor, greedy: list[int] | None, feats: torch.Tensor | None,
               draft: Marginals | None) -> tuple[list[int], list[int]]:
        """Walk the verified tree, keep root + accepted path in the caches, set the next root.

        logits [N+1, V] are this pack's rows (greedy: their argmaxes); `draft` the drafter's marginals (read by
        rejection sampling only). Returns (emitted tokens after stop handling, accepted pack rows)."""
        self.new_logprobs = []
        if self.sampler is None or self.cfg.verifier == "coupled":
            path, nxt = walk(tree, self._picker(logits, greedy))
        else:
            path, nxt = sampled_walk(tree, logits.cpu(), None if draft is None else draft.full, self.sampler,
                                     self.cfg.verifier == "direct", self.history)
        keep = [0, *path]
        self.cache.keep_rows(self.prefix_len, keep)
        if self.draft is not None:  # the kept rows' features, a slice where they are the pack's first rows
            self.draft.add_context(feats[:, :len(keep)] if keep[-1] == len(keep) - 1 else
                                   feats.index_select(1, torch.tensor(keep, device=feats.device)))
        self.root = nxt
        return self._emit([tree.tokens[r - 1] for r in path] + [nxt], logits, [0, *path]), path

    def _picker(self, logits: torch.Tensor, greedy: list[int]):
        """pick(row, path_tokens) for `walk`: the target's token at pack row `row` of `logits`, reached through
        the drafted `path_tokens` (their output index and their place in the penalties' history)."""
        t0, proc, history, sampler = self.emitted, self.proc, self.history, self.sampler
        if sampler is not None:
            return lambda row, path: sampler.draw(logits[row], t0 + len(path), history.at(path))
        if proc.adjusts:
            return lambda row, path: proc.greedy(logits[row], history.at(path))
        return lambda row, path: greedy[row]

    def _emit(self, new: list[int], logits: torch.Tensor, rows: list[int]) -> list[int]:
        """Cut at the first stop token (kept) and at max_new_tokens; mark the sequence done accordingly.
        new[j] was chosen at pack row rows[j] of `logits` (for log-probabilities)."""
        for i, tok in enumerate(new):
            if tok in self.stop:
                new, self.done, self.finish_reason = new[:i + 1], True, "stop"
                break
        if len(new) >= self.remaining:
            if len(new) > self.remaining or not self.done:
                self.finish_reason = "length"
            new, self.done = new[:self.remaining], True
        if self.cfg.logprobs is not None:
            processed = self.cfg.logprobs_mode == "processed"
            self.new_logprobs = [
                token_logprob(self.proc.logprobs(logits[rows[j]], self.history.at(new[:j]) if processed else None,
                                                 processed), tok, self.cfg.logprobs) for j, tok in enumerate(new)]
        self.history.extend(new)
        self.output.extend(new)
        return new
