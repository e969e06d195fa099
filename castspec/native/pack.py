"""Weights in the layout csrc/gemm.c reads: panels of 16 output columns, packed once when the native forwards are
built (native/forward.py), beside the model's own weights (which the torch forward keeps using).

bf16 [O, I] -> [ceil(O/16/G), I/2, G, 16, 2]: per group of G panels and pair of inputs, each panel's 16 columns'
two weights side by side, as VDPBF16PS multiplies them, the group's panels one after another (so that a tile of G
panels reads one stream of lines); G is the library's `gemm_panel_group()` (1 where it uses AMX tiles). fp32
[O, I] -> [ceil(O/16), I, 16]. Missing columns of the last panel (and grouped panels of the last group) are zeros.

int8 (a drafter's weights where the CPU has AMX-INT8 or AVX-512 VNNI, native/forward.py): each output column
scaled by max |w| / 127 and rounded, [ceil(O/16/G), I/4, G, 16, 4] (the quads of inputs TDPBSSD and VPDPBUSD
multiply, 16 columns' quads a 64-byte line, grouped as bf16 panels are), I a multiple of 64.
"""
from __future__ import annotations

import torch

PANEL = 16


def packable(w: torch.Tensor) -> bool:
    """Whether gemm.c multiplies by this weight: 2-D fp32 or bf16 (bf16 with an even input width)."""
    return w.dim() == 2 and (w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and w.shape[1] % 2 == 0))


def pack_panels(w: torch.Tensor, group: int = 1) -> torch.Tensor:
    """The packed copy of w [O, I] (a new contiguous tensor; w is not changed), bf16 panels in groups of `group`
    (the library's gemm_panel_group(); fp32 panels are never grouped)."""
    if not packable(w):
        raise ValueError(f"cannot pack a {w.dtype} weight of shape {tuple(w.shape)}")
    O, I = w.shape
    if w.dtype == torch.float32:
        group = 1
    groups = -(-O // (PANEL * group))
    with torch.no_grad():
        padded = torch.zeros(groups * group * PANEL, I, dtype=w.dtype)
        padded[:O] = w
        if w.dtype == torch.bfloat16:
            return padded.view(groups, group, PANEL, I // 2, 2).permute(0, 3, 1, 2, 4).contiguous()
        return padded.view(groups, PANEL, I).permute(0, 2, 1).contiguous()


INT8_INPUTS = 64  # an int8 product's input width is a multiple of this (one AMX tile row of int8)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., I] -> (int8 [..., I], fp32 scales [...]): each row rounded (to nearest even) to a multiple of
    max |row| / 127; a zero row gives zeros and scale 0. What csrc/layer.h's quantize_row computes for a product's
    input rows, and what pack_int8 does to each output column of a weight."""
    x = x.float()
    scale = x.abs().amax(-1) / 127
    q = torch.round(x / scale.unsqueeze(-1)).nan_to_num(0.0).clamp(-127, 127)
    return q.to(torch.int8), scale


def int8_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, I] . w [O, I]^T as csrc/gemm.c's int8 products compute it: both quantized per row, exact integer
    sums, then times the input row's scale and the weight row's (fp32 [M, O])."""
    qx, sx = quantize(x)
    qw, sw = quantize(w)
    return (qx.long() @ qw.long().T).float() * sx[:, None] * sw[None, :]


def pack_int8(w: torch.Tensor, group: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [O, I] (I a multiple of INT8_INPUTS) quantized per output column and packed in groups of `group` panels
    (the library's gemm_panel_group()): (panels, scales [O], sums [O] of each column's int8 weights, int32)."""
    O, I = w.shape
    if I % INT8_INPUTS:
        raise ValueError(f"an int8 weight needs inputs in multiples of {INT8_INPUTS}, not {I}")
    groups = -(-O // (PANEL * group))
    with torch.no_grad():
        q, scale = quantize(w.detach())
        padded = torch.zeros(groups * group * PANEL, I, dtype=torch.int8)
        padded[:O] = q
        packed = padded.view(groups, group, PANEL, I // 4, 4).permute(0, 3, 1, 2, 4).contiguous()
        return packed, scale.contiguous(), q.sum(1, dtype=torch.int32)
