"""Replay estimate of R on held-out target responses (cheap enough to track during training).

For anchors along a held-out response, the drafter sees exactly what decoding would show it at that point
(the target's features of everything before the anchor, the anchor token as root); the block's marginals give
the chain and best-first trees, and walking them along the target's actual greedy continuation gives the tokens a
real round would commit there. Real decoding (`eval-drafter`) measures the same thing round by round.
"""
from __future__ import annotations

from collections import defaultdict
from functools import cache

import torch

from ..analysis import replay_commit
from ..models.decoder import Decoder
from ..models.dflash import DFlashDrafter
from .blocks import block_inputs, block_mask
from .trainer import target_features


def committed_per_round(logprobs: torch.Tensor, truth: list[int], width: int | None, top_k: int) -> int:
    """Tokens a greedy round commits when the target's continuation is `truth` (width None = chain)."""
    vals, ids = logprobs.float().topk(min(top_k, logprobs.shape[-1]), dim=-1)
    return _commit(vals, ids, truth, width, top_k)


def _commit(vals: torch.Tensor, ids: torch.Tensor, truth: list[int], width: int | None, top_k: int) -> int:
    log = {"top_logprobs": vals.numpy(), "top_ids": ids.numpy(), "continuation": truth}
    return replay_commit(log, width, top_k)


def walk(commit, start: int, end: int) -> tuple[int, int]:
    """(tokens, rounds) of decoding positions [start, end) round after round, each round rooted where the last
    one ended and committing commit(root) tokens (never past `end`)."""
    root, rounds = start, 0
    while root < end:
        root += commit(root)
        rounds += 1
    return root - start, rounds


@torch.no_grad()
def _block_top_k(target: Decoder, drafter: DFlashDrafter, tokens: torch.Tensor, feats: torch.Tensor,
                 anchors: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The drafter's top-k log-probabilities and ids [A, L, k] and top-1 [A, L] for blocks rooted at `anchors`,
    each seeing the target's features of everything before its root (as decoding shows them)."""
    bs, T = drafter.cfg.block_size, tokens.numel()
    ids, pos, _ = block_inputs(tokens, anchors, bs, drafter.cfg.mask_token_id, torch.ones(T, dtype=torch.bool))
    mask = block_mask(anchors, T, bs).view(1, 1, -1, T + ids.numel())
    hidden = drafter(target.embed(ids.view(1, -1)), pos.view(1, -1), feats, torch.arange(T).view(1, -1),
                     mask=mask).view(anchors.numel(), bs, -1)[:, 1:]
    logprobs = drafter.draft_logprobs(hidden, target).float()
    vals, top = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
    return vals, top, top[..., 0]


@torch.no_grad()
def replay_r(target: Decoder, drafter: DFlashDrafter, records: list[dict], widths=(15, 63), top_k: int = 8,
             stride: int = 8, chunk: int = 128) -> dict:
    """Committed tokens per round by domain for chain and cast@width, two ways:

    - `chain`, `cast@N`: the mean over rounds rooted every `stride` tokens of the response (each position
      weighs the same);
    - `walk/chain`, `walk/cast@N`: rounds one after another from the response's start, each rooted where the
      last one ended, and tokens / rounds over the domain's responses: what `eval-drafter` measures in real
      decoding. It is lower than the uniform mean, because a walk spends more rounds where few tokens are
      accepted (one round per token there) than where many are.
    """
    L = drafter.cfg.num_draft_positions
    keys = {"chain": None, **{f"cast@{w}": w for w in widths}}
    sums = defaultdict(lambda: defaultdict(float))
    counts = defaultdict(int)
    walked = defaultdict(lambda: defaultdict(lambda: [0, 0]))  # key -> domain -> [tokens, rounds]
    # top-1 accuracy per block position (teacher forced), per domain
    hits, seen = defaultdict(lambda: torch.zeros(L)), defaultdict(lambda: torch.zeros(L))
    for rec in records:
        prompt, resp = rec["prompt_ids"], rec["response_ids"]
        tokens = torch.tensor(prompt + resp)
        T, P = tokens.numel(), len(prompt)
        if T - 1 <= P:
            continue
        feats = target_features(target, tokens, drafter.cfg.target_layer_ids)
        parts = [_block_top_k(target, drafter, tokens, feats, a, top_k) for a in torch.arange(P, T - 1).split(chunk)]
        vals, ids, pred = (torch.cat(x) for x in zip(*parts))  # row i: the round rooted at P + i
        dom = rec.get("domain", "all")

        @cache  # the walk's roots are partly the stride's
        def commit(a: int, width: int | None) -> int:
            truth = tokens[a + 1:a + 1 + L + 1].tolist()
            depth = min(L, len(truth) - 1)
            return _commit(vals[a - P, :depth], ids[a - P, :depth], truth, width, top_k)

        for a in range(P, T - 1, stride):
            labels = tokens[a + 1:a + 1 + L]
            hits[dom][:labels.numel()] += (pred[a - P, :labels.numel()] == labels).float()
            seen[dom][:labels.numel()] += 1
            if T - a - 1 < 2:  # no drafted position to check
                continue
            counts[dom] += 1
            for key, w in keys.items():
                sums[key][dom] += commit(a, w)
        for key, w in keys.items():
            tokens_, rounds = walk(lambda a: commit(a, w), P, T - 1)
            walked[key][dom][0] += tokens_
            walked[key][dom][1] += rounds
    out = {}
    for key, per in sums.items():
        by_domain = {d: per[d] / counts[d] for d in per}
        by_domain["mean_of_domains"] = sum(by_domain.values()) / len(by_domain)
        out[key] = by_domain
    for key, per in walked.items():
        by_domain = {d: tok / rounds for d, (tok, rounds) in per.items()}
        by_domain["mean_of_domains"] = sum(by_domain.values()) / len(by_domain)
        out[f"walk/{key}"] = by_domain
    # where a drafter stands before any tree: position 1 should be far above the unigram rate, and above the
    # data's bigram rate (~0.3 on SmolLM2's greedy responses), which the anchor token alone would give
    all_hits, all_seen = sum(hits.values(), torch.zeros(L)), sum(seen.values(), torch.zeros(L))
    out["top1_accuracy_by_position"] = (all_hits / all_seen.clamp_min(1)).tolist()
    out["top1_accuracy_by_position_by_domain"] = {d: (hits[d] / seen[d].clamp_min(1)).tolist() for d in hits}
    return out
