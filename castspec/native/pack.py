"""Weights in the layout csrc/gemm.c reads: panels of 16 output columns, packed once when the native forwards are
built (native/forward.py), beside the model's own weights (which the torch forward keeps using).

bf16 [O, I] -> [ceil(O/16), I/2, 16, 2]: per panel and pair of inputs, the 16 columns' two weights side by side,
as VDPBF16PS multiplies them. fp32 [O, I] -> [ceil(O/16), I, 16]. Missing columns of the last panel are zeros.
A slice of whole panels of the packed tensor is the packed slice of the weight (draft.c takes the k|v rows of a
fused q|k|v matrix that way): rows [16a, 16b) of W start at element 16a * I of either layout.
"""
from __future__ import annotations

import torch

PANEL = 16


def packable(w: torch.Tensor) -> bool:
    """Whether gemm.c multiplies by this weight: 2-D fp32 or bf16 (bf16 with an even input width)."""
    return w.dim() == 2 and (w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and w.shape[1] % 2 == 0))


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """The packed copy of w [O, I] (a new contiguous tensor; w is not changed)."""
    if not packable(w):
        raise ValueError(f"cannot pack a {w.dtype} weight of shape {tuple(w.shape)}")
    O, I = w.shape
    panels = -(-O // PANEL)
    with torch.no_grad():
        padded = torch.zeros(panels * PANEL, I, dtype=w.dtype)
        padded[:O] = w
        if w.dtype == torch.bfloat16:
            return padded.view(panels, PANEL, I // 2, 2).permute(0, 2, 1, 3).contiguous()
        return padded.view(panels, PANEL, I).permute(0, 2, 1).contiguous()
