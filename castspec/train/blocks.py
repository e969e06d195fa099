"""The DFlash training layout: anchors, block inputs, labels, loss weights and the block attention mask."""
from __future__ import annotations

import torch


def sample_anchors(first: int, last: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """Up to `count` distinct anchor positions in [first, last], sorted (an anchor is a block's root)."""
    n = last - first + 1
    if n <= 0:
        return torch.empty(0, dtype=torch.long)
    pick = torch.randperm(n, generator=generator)[:count]
    return (pick + first).sort().values


def block_mask(anchors: torch.Tensor, context_len: int, block_size: int, window: int = 0) -> torch.Tensor:
    """bool [Q, context_len + Q] for Q = len(anchors) * block_size query rows (True = may attend).

    Block i sees context positions strictly before its anchor and all rows of its own block, never other blocks.
    `window` > 0 keeps only the last `window` context positions before each anchor (a training curriculum;
    decoding always shows the whole context).
    """
    nb = anchors.numel()
    q = nb * block_size
    block_of_row = torch.arange(q) // block_size
    anchor_of_row = anchors[block_of_row].view(-1, 1)
    pos = torch.arange(context_len).view(1, -1)
    ctx = pos < anchor_of_row
    if window > 0:
        ctx &= pos >= anchor_of_row - window
    own = block_of_row.view(-1, 1) == block_of_row.view(1, -1)
    return torch.cat([ctx, own], dim=1)


def block_inputs(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_id: int,
                 loss_mask: torch.Tensor):
    """Block ids [nb, bs] = [x_a, MASK...], positions [nb, bs], labels [nb, bs-1] (-100 = ignored)."""
    offs = torch.arange(block_size)
    pos = anchors.view(-1, 1) + offs.view(1, -1)  # [nb, bs]
    ids = torch.full_like(pos, mask_id)
    ids[:, 0] = tokens[anchors]
    T = tokens.numel()
    tgt_pos = pos[:, 1:]
    inside = tgt_pos < T
    safe = tgt_pos.clamp(max=T - 1)
    labels = torch.where(inside & loss_mask[safe], tokens[safe], torch.full_like(safe, -100))
    return ids, pos, labels


def teacher_rows(anchors: torch.Tensor, block_size: int, context_len: int) -> torch.Tensor:
    """[nb, bs-1]: the sequence row whose next-token distribution the target gives for each label of
    block_inputs (the label at position a + j is predicted from row a + j - 1), clamped inside the sequence
    (positions past it carry no label)."""
    return (anchors.view(-1, 1) + torch.arange(block_size - 1).view(1, -1)).clamp(max=context_len - 1)


def decay_weights(num_positions: int, gamma: float) -> torch.Tensor:
    """exp(-(k-1)/gamma) for block positions k = 1..L: early positions decide acceptance, so they weigh more."""
    k = torch.arange(1, num_positions + 1, dtype=torch.float)
    return torch.exp(-(k - 1) / gamma)


def chain_acceptance(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per block: 1 + the number of leading positions where the top-1 prediction equals the label."""
    hit = (pred == labels) & (labels >= 0)
    return 1 + hit.long().cumprod(dim=1).sum(dim=1)


def parse_window_schedule(text: str) -> list[tuple[int, int]]:
    """"8:200,64:400" -> [(8, 200), (64, 400)]: context window 8 before step 200, 64 before 400, then all."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            window, until = (int(v) for v in part.split(":"))
        except ValueError:
            raise ValueError(f"bad context-window schedule entry {part!r}: expected WINDOW:UNTIL_STEP") from None
        if window <= 0 or until <= 0 or (out and until <= out[-1][1]):
            raise ValueError(f"bad context-window schedule {text!r}: windows and steps must be positive, "
                             "steps increasing")
        out.append((window, until))
    return out


def window_at(schedule: list[tuple[int, int]], step: int) -> int:
    """The context window in force at `step` (0 = the whole context)."""
    for window, until in schedule:
        if step < until:
            return window
    return 0
