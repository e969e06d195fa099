"""Replay estimate of R on held-out target responses (cheap enough to track during training).

For anchors along a held-out response, the drafter sees exactly what decoding would show it at that point
(the target's features of everything before the anchor, the anchor token as root); the block's marginals give
the chain and best-first trees, and walking them along the target's actual greedy continuation gives the tokens a
real round would commit there. Real decoding (`eval-drafter`) measures the same thing round by round.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from ..analysis import replay_commit
from ..models.decoder import Decoder
from ..models.dflash import DFlashDrafter
from .blocks import block_inputs, block_mask
from .trainer import target_features


def committed_per_round(logprobs: torch.Tensor, truth: list[int], width: int | None, top_k: int) -> int:
    """Tokens a greedy round commits when the target's continuation is `truth` (width None = chain)."""
    vals, ids = logprobs.float().topk(min(top_k, logprobs.shape[-1]), dim=-1)
    log = {"top_logprobs": vals.numpy(), "top_ids": ids.numpy(), "continuation": truth}
    return replay_commit(log, width, top_k)


@torch.no_grad()
def replay_r(target: Decoder, drafter: DFlashDrafter, records: list[dict], widths=(15, 63), top_k: int = 8,
             stride: int = 8) -> dict:
    """Mean committed tokens per round by domain for chain and cast@width, anchors every `stride` tokens."""
    L = drafter.cfg.num_draft_positions
    bs = drafter.cfg.block_size
    sums = defaultdict(lambda: defaultdict(float))
    counts = defaultdict(int)
    hits, seen = torch.zeros(L), torch.zeros(L)  # top-1 accuracy per block position (teacher forced)
    for rec in records:
        prompt, resp = rec["prompt_ids"], rec["response_ids"]
        tokens = torch.tensor(prompt + resp)
        T, P = tokens.numel(), len(prompt)
        anchors = torch.arange(P, T - 1, stride)
        if anchors.numel() == 0:
            continue
        feats = target_features(target, tokens, drafter.cfg.target_layer_ids)
        ids, pos, _ = block_inputs(tokens, anchors, bs, drafter.cfg.mask_token_id, torch.ones(T, dtype=torch.bool))
        mask = block_mask(anchors, T, bs).view(1, 1, -1, T + ids.numel())
        hidden = drafter(target.embed(ids.view(1, -1)), pos.view(1, -1), feats, torch.arange(T).view(1, -1),
                         mask=mask).view(anchors.numel(), bs, -1)[:, 1:]
        logprobs = drafter.draft_logprobs(hidden, target)
        pred = logprobs.argmax(-1)
        for b, a in enumerate(anchors.tolist()):
            labels = tokens[a + 1:a + 1 + L]
            hits[:labels.numel()] += (pred[b, :labels.numel()] == labels).float()
            seen[:labels.numel()] += 1
            truth = tokens[a + 1:a + 1 + L + 1].tolist()
            if len(truth) < 2:
                continue
            depth = min(L, len(truth) - 1)
            lp = logprobs[b, :depth]
            dom = rec.get("domain", "all")
            counts[dom] += 1
            sums["chain"][dom] += committed_per_round(lp, truth, None, top_k)
            for w in widths:
                sums[f"cast@{w}"][dom] += committed_per_round(lp, truth, w, top_k)
    out = {}
    for key, per in sums.items():
        vals = {d: per[d] / counts[d] for d in per}
        vals["mean_of_domains"] = sum(vals.values()) / len(vals)
        out[key] = vals
    # where a drafter stands before any tree: position 1 should be far above the unigram rate, and above the
    # data's bigram rate (~0.3 on SmolLM2's greedy responses), which the anchor token alone would give
    out["top1_accuracy_by_position"] = (hits / seen.clamp_min(1)).tolist()
    return out
