"""The round loop shared by `ar`, `chain` and `cast`.

Round contract (paper, Appendix C): the target cache holds the prefix x (length P); the pending root b is known
but not cached. A round drafts from the features of x and b, packs [b, tree], runs one target forward, walks
the tree, commits b + the accepted path to both caches and makes the target's next token the new root.
`ar` is the same round with an empty tree; `chain` is the tree of top-1 tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F

from .config import DecodeConfig
from .models.decoder import Decoder
from .models.dflash import DFlashDrafter
from .pack import pack_tree
from .tree import Tree, build_tree, universe_size
from .sampling import LogitProcessor, Sampler
from .verify import greedy_walk, sampled_walk


class ContextLengthError(ValueError):
    """Prompt plus requested output would not fit the model's context."""


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


class DraftState:
    """The drafter's side of one sequence: its context-only KV cache and the features not yet in it."""

    def __init__(self, drafter: DFlashDrafter, target: Decoder, capacity: int):
        self.drafter, self.target = drafter, target
        self.cache = drafter.new_cache(capacity)
        self.pending: torch.Tensor | None = None  # [1, C, taps*H] features of positions [cache.length, +C)
        self.mask_id = drafter.cfg.mask_token_id

    def add_context(self, features: torch.Tensor) -> None:
        self.pending = features if self.pending is None else torch.cat([self.pending, features], dim=1)

    def propose(self, root: int, depth: int) -> torch.Tensor:
        """Log-probabilities [depth, V] of the next `depth` tokens after `root` (at position = context end)."""
        device = self.target.device
        start = self.cache.length
        ctx_len = self.pending.shape[1]
        root_pos = start + ctx_len
        L = self.drafter.cfg.num_draft_positions
        block = torch.full((1, L + 1), self.mask_id, dtype=torch.long, device=device)
        block[0, 0] = root
        positions = torch.arange(root_pos - ctx_len, root_pos + L + 1, device=device).view(1, -1)
        # near the end of the context the block's trailing rows (never used: depth is capped) would sit past the
        # last position; pin them to it rather than shrink the block, which would change the rows we do use
        positions = positions.clamp(max=self.drafter.cfg.max_positions - 1)
        hidden = self.drafter(self.target.embed(block), positions[:, ctx_len:], self.pending,
                              positions[:, :ctx_len], self.cache, start)
        self.pending = None
        logits = F.linear(hidden[0, 1:depth + 1], self.target.head_weight).float()
        return torch.log_softmax(logits, dim=-1)


class Sequence:
    """One request's decoding state: target cache, optional draft state, the pending root."""

    def __init__(self, target: Decoder, drafter: DFlashDrafter | None, prompt: list[int], max_new_tokens: int,
                 max_nodes: int = 0, sampler: Sampler | None = None, direct_walk: bool = False):
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        ctx = target.cfg.max_positions
        if len(prompt) + max_new_tokens > ctx:
            raise ContextLengthError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                                     f"the model's context of {ctx} tokens")
        self.target, self.drafter = target, drafter
        L = drafter.cfg.num_draft_positions if drafter else 0
        self.capacity = len(prompt) + max_new_tokens + 1
        # a verify pack writes root + up to max_nodes tree nodes past the prefix before compaction
        self.cache = target.new_cache(self.capacity + max_nodes + 1)
        self.taps = tuple(drafter.cfg.target_layer_ids) if drafter else ()
        self.draft = DraftState(drafter, target, self.capacity + L + 1) if drafter else None
        self.prompt = prompt
        self.root: int | None = None
        self.sampler, self.direct_walk = sampler, direct_walk  # no sampler = greedy

    @property
    def prefix_len(self) -> int:
        return self.cache.length

    def prefill(self) -> int:
        device = self.target.device
        ids = torch.tensor([self.prompt], dtype=torch.long, device=device)
        pos = torch.arange(len(self.prompt), device=device).view(1, -1)
        logits, feats = self.target(ids, pos, self.cache, 0, causal=True, logit_rows=slice(-1, None), taps=self.taps)
        self.cache.length = len(self.prompt)
        if self.draft is not None:
            self.draft.add_context(feats)
        last = logits[0, -1]
        self.root = self.sampler.token(last) if self.sampler else int(last.argmax())
        return self.root

    def verify(self, tree: Tree, draft_logprobs: torch.Tensor | None = None) -> tuple[list[int], list[int], float]:
        """One target pass over [root, tree]; commit. Returns (emitted tokens, accepted pack rows, forward ms)."""
        device = self.target.device
        P = self.prefix_len
        pack = pack_tree(tree, self.root, P, device)
        t = time.perf_counter()
        logits, feats = self.target(pack.ids, pack.positions, self.cache, P, mask=pack.mask, taps=self.taps)
        if self.sampler is None:
            greedy = logits[0].argmax(dim=-1).tolist()  # the one host sync of the verify step
            forward_ms = (time.perf_counter() - t) * 1e3
            path, nxt = greedy_walk(tree, greedy)
        else:
            rows = logits[0].cpu()
            forward_ms = (time.perf_counter() - t) * 1e3
            path, nxt = sampled_walk(tree, rows, draft_logprobs, self.sampler, self.direct_walk)
        keep = [0, *path]
        if keep[-1] != len(keep) - 1:  # accepted rows are not already contiguous after the root: gather
            self.cache.compact(torch.tensor(keep, device=device) + P, P)
        self.cache.length = P + len(keep)
        if self.draft is not None:
            self.draft.add_context(feats[:, keep] if len(keep) < feats.shape[1] else feats)
        emitted = [tree.tokens[r - 1] for r in path] + [nxt]
        self.root = nxt
        return emitted, path, forward_ms


def max_tree_nodes(cfg: DecodeConfig, drafter: DFlashDrafter | None, width_rule=None) -> int:
    if cfg.method == "ar" or drafter is None:
        return 0
    L = drafter.cfg.num_draft_positions
    if cfg.method == "chain":
        return L
    width = width_rule.max_width if width_rule is not None else cfg.resolved_width
    return min(width, universe_size(L, cfg.top_k_per_position))


def choose_tree(cfg: DecodeConfig, logprobs: torch.Tensor, width_rule=None, prefix_len: int = 0) -> Tree:
    if cfg.method == "chain":
        return build_tree(logprobs, logprobs.shape[0], 1)
    if width_rule is None:
        return build_tree(logprobs, cfg.resolved_width, cfg.top_k_per_position)
    tree = build_tree(logprobs, width_rule.max_width, cfg.top_k_per_position)
    return tree.head(width_rule.choose(tree.scores, tree.depths, prefix_len))


def decode(target: Decoder, drafter: DFlashDrafter | None, prompt: list[int], cfg: DecodeConfig,
           stats: DecodeStats | None = None, width_rule=None, on_round=None) -> Iterator[list[int]]:
    """Yield the new tokens round by round (after stop handling); fill `stats` as it goes.

    width_rule (a cost.RoundWidth) picks each round's width for method "cast" with width "auto"; without one,
    "auto" means the fixed DEFAULT_WIDTH. on_round(logprobs, tree, accepted_rows, emitted) observes every
    round (round logs for the width analyses); it must not modify its arguments.
    """
    if cfg.method != "ar" and drafter is None:
        raise ValueError(f"method {cfg.method!r} needs a drafter")
    stats = stats if stats is not None else DecodeStats()
    if cfg.max_new_tokens == 0:
        return
    drafter = drafter if cfg.method != "ar" else None
    sampler = None
    if cfg.temperature > 0:
        sampler = Sampler(LogitProcessor(cfg.temperature, cfg.top_k, cfg.top_p), cfg.seed)
    if cfg.method != "cast" or cfg.width != "auto":
        width_rule = None
    seq = Sequence(target, drafter, prompt, cfg.max_new_tokens, max_tree_nodes(cfg, drafter, width_rule), sampler,
                   cfg.verifier == "direct")
    device = target.device
    stop = set(cfg.stop_token_ids)
    clock = time.perf_counter
    with torch.inference_mode():
        t0 = clock()
        first = seq.prefill()
        synchronize(device)
        stats.prefill_ms = (clock() - t0) * 1e3
        emitted = 1
        stats.new_tokens = 1
        yield [first]
        if first in stop or cfg.max_new_tokens == 1:
            return
        t_decode = clock()
        while True:
            need = cfg.max_new_tokens - emitted
            t = clock()
            tree = Tree.empty()
            logprobs = None
            draft_ms = 0.0
            if seq.draft is not None and need > 1:
                logprobs = seq.draft.propose(seq.root, min(drafter.cfg.num_draft_positions, need - 1))
                synchronize(device)
                draft_ms = (clock() - t) * 1e3
                if not stats.rounds:
                    # the decode-only timer opens after prefill and the first draft (Appendix D)
                    stats.first_draft_ms = draft_ms
                    t_decode = clock()
                th = clock()
                tree = choose_tree(cfg, logprobs, width_rule, seq.prefix_len)
                host_ms = (clock() - th) * 1e3
            else:
                host_ms = 0.0
            tv = clock()
            new, path, verify_ms = seq.verify(tree, logprobs)
            synchronize(device)
            host_ms += (clock() - tv) * 1e3 - verify_ms  # packing, walk, compaction
            stats.rounds.append(RoundStats(len(path), len(tree) + 1, draft_ms, verify_ms, host_ms))
            if width_rule is not None:
                width_rule.update(len(path) + 1, draft_ms + verify_ms + host_ms)
            if on_round is not None and logprobs is not None:
                on_round(logprobs, tree, path, new)
            done = False
            for i, tok in enumerate(new):
                if tok in stop:
                    new, done = new[:i + 1], True
                    break
            if len(new) >= need:
                new, done = new[:need], True
            emitted += len(new)
            stats.new_tokens = emitted
            stats.decode_ms = (clock() - t_decode) * 1e3
            yield new
            if done:
                return
