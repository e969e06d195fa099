"""Where the native forwards spend their time, section by section.

A library built with CASTSPEC_SECTIONS=1 (native/build.py builds it as a library of its own) adds the wall time of
each section of a forward to one table for target forwards and one for drafter passes (csrc/sections.h); these
read and clear the tables. `scripts/forward_sections.py` prints them per shape, each product beside the rate at
which it read its weights and computed, to set against the floors of `castspec probe`. The other libraries have
no tables: `available` is False there, and the forwards carry no timers.
"""
from __future__ import annotations

import ctypes

# csrc/sections.h's sections, in its order
SECTIONS = ("other", "fc", "qkv", "rope_kv", "attention", "o", "gate_up", "silu", "down", "head")
PRODUCTS = ("fc", "qkv", "o", "gate_up", "down", "head")  # the sections that are one product each
KINDS = ("target", "drafter")


def _table(lib) -> ctypes.Array | None:
    """The library's tables as one flat array [kind][section], or None in a library without them."""
    try:
        count = ctypes.c_int.in_dll(lib, "castspec_section_count").value
    except ValueError:  # the symbol is missing: a library built without CASTSPEC_SECTIONS
        return None
    if count != len(SECTIONS):
        raise RuntimeError(f"the library times {count} sections, castspec/native/sections.py names {len(SECTIONS)}")
    return (ctypes.c_double * (len(KINDS) * count)).in_dll(lib, "castspec_sections")


def available(lib) -> bool:
    return lib is not None and _table(lib) is not None


def read(lib) -> dict[str, dict[str, float]]:
    """Seconds spent so far per kind of forward and section."""
    table = _table(lib)
    return {kind: {name: table[k * len(SECTIONS) + i] for i, name in enumerate(SECTIONS)}
            for k, kind in enumerate(KINDS)}


def clear(lib) -> None:
    table = _table(lib)
    for i in range(len(table)):
        table[i] = 0.0


def product_weights(target, drafter=None, drafter_int8: bool = False) -> dict[str, dict[str, tuple[int, int]]]:
    """(bytes read, weights) of every product section's matrices over all layers, per kind of forward: what a
    section's time divides into a read rate (bytes) and, times 2 per row, a compute rate. The target's head is its
    lm_head; the drafter's is its draft vocabulary's rows of it, and its matrices are one byte a weight where its
    pass multiplies int8 weights."""

    def sizes(layers, width: int) -> dict[str, tuple[int, int]]:
        weights = {"qkv": sum(layer.self_attn.qkv()[0].numel() for layer in layers),
                   "o": sum(layer.self_attn.o_proj.weight.numel() for layer in layers),
                   "gate_up": sum(layer.mlp.gate_up_weight.numel() for layer in layers),
                   "down": sum(layer.mlp.down_proj.weight.numel() for layer in layers)}
        return {name: (n * width, n) for name, n in weights.items()}

    head = target.head_weight
    out = {"target": {**sizes(target.model.layers, head.element_size()),
                      "head": (head.numel() * head.element_size(), head.numel())}}
    if drafter is not None:
        width = 1 if drafter_int8 else drafter.fc.weight.element_size()
        rows = head.shape[0] if drafter.draft_vocab is None else len(drafter.draft_vocab)
        fc = drafter.fc.weight
        out["drafter"] = {**sizes(drafter.layers, width), "fc": (fc.numel() * width, fc.numel()),
                          "head": (rows * head.shape[1] * width, rows * head.shape[1])}
    return out
