"""Forwards of a few rows (decode steps, packed trees; csrc/step.c) and the drafter's block pass (csrc/draft.c)
in one native call each, on AVX-512 CPUs.

Why: such a forward streams ~270 MB of bf16 weights (8 ms at this machine's read rate) but eager torch adds
~50 small ops per layer whose dispatch costs more than that on 2 cores. step.c runs the same layers
(products on castspec's own kernels, the rest in plain C) with the model's rounding at the same places.

`NativeStep.for_decoder` and `NativeDraft.for_drafter` return None where they do not apply (no native library,
another device, unsupported shapes); the first native forward of each model is cross-checked against the torch
forward (`agrees`), and a disagreement turns the native path off for that model with a warning.
"""
from __future__ import annotations

import ctypes
import logging
import os

import torch

from . import build as native

log = logging.getLogger("castspec")

_LAYER_FIELDS = ("attn_norm", "qkv_w", "qkv_b", "o_w", "o_b", "q_norm", "k_norm", "mlp_norm", "gate_up_w",
                 "gate_up_b", "down_w", "down_b")


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in _LAYER_FIELDS]


class _Segment(ctypes.Structure):  # step.c's Segment
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("capacity", ctypes.c_int64),
                ("start", ctypes.c_int64), ("rows", ctypes.c_int32), ("mask", ctypes.c_void_p)]


class _Model(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_int32) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "inter",
                                                       "vocab", "bf16")),
                ("eps", ctypes.c_float),
                *((name, ctypes.c_void_p) for name in ("embed", "final_norm", "head", "cos", "sin")),
                ("layer", ctypes.POINTER(_Layer))]


class _Kept:
    """Tensors whose storage native code reads: kept alive here, their addresses handed out."""

    def __init__(self):
        self.tensors: list[torch.Tensor] = []

    def __call__(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        self.tensors.append(t)
        return t.data_ptr()


def _layer_array(layers, keep: _Kept):
    """layer.h's Layer structs for decoder or drafter layers (both have the HF layer's submodules)."""
    out = (_Layer * len(layers))()
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv_w, qkv_b = attn.qkv()
        values = (layer.input_layernorm.weight, qkv_w, qkv_b, attn.o_proj.weight, attn.o_proj.bias,
                  None if attn.q_norm is None else attn.q_norm.weight,
                  None if attn.k_norm is None else attn.k_norm.weight, layer.post_attention_layernorm.weight,
                  mlp.gate_up_weight, mlp.gate_up_bias, mlp.down_proj.weight, mlp.down_proj.bias)
        for name, t in zip(_LAYER_FIELDS, values):
            setattr(out[i], name, keep(t))
    return out


def _usable(dtype: torch.dtype, head_dim: int, tensors) -> bool:
    """What step.c and draft.c need: CPU, fp32 or bf16, head_dim a multiple of 16 up to 512, contiguous
    weights."""
    return (dtype in (torch.float32, torch.bfloat16) and not head_dim % 16 and head_dim <= 512
            and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors))


class NativeStep:
    """The pointers step.c reads for one Decoder. It keeps its tensors alive; the decoder drops it when its
    weights move (`Decoder._apply`), since the pointers would then be stale."""

    def __init__(self, decoder, lib):
        cfg = decoder.cfg
        self._fn = lib.forward_rows
        keep = self._kept = _Kept()
        self._layers = _layer_array(decoder.model.layers, keep)
        self._model = _Model(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                             cfg.intermediate_size, cfg.vocab_size, decoder.dtype == torch.bfloat16,
                             cfg.rms_norm_eps, keep(decoder.model.embed_tokens.weight), keep(decoder.model.norm.weight),
                             keep(decoder.head_weight), keep(decoder.rope.cos), keep(decoder.rope.sin),
                             ctypes.cast(self._layers, ctypes.POINTER(_Layer)))
        self._dtype = decoder.dtype
        self._tap_cache: dict[tuple[int, ...], torch.Tensor] = {}
        self.checked = False  # whether a forward was compared with the torch forward (Decoder._native_forward)

    @staticmethod
    def for_decoder(decoder) -> "NativeStep | None":
        lib = native.library()
        tensors = [*decoder.parameters(), decoder.rope.cos, decoder.rope.sin, *_matrices(decoder.model.layers),
                   decoder.head_weight]
        if lib is None or not _usable(decoder.dtype, decoder.cfg.head_dim, tensors):
            return None
        return NativeStep(decoder, lib)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, segments, logit_rows: torch.Tensor,
                 taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward of the M rows ids/positions [M], split in order into `segments` (cache.Segment: one cache,
        its slots, a bool mask [1, 1, rows, start + rows] or none for the causal triangle).

        Returns (logits [R, V] fp32 of the rows in `logit_rows` [R], hidden states after the layers in `taps`
        [M, len(taps) * H] in the model's dtype, None without taps)."""
        M = ids.numel()
        segs = (_Segment * len(segments))()
        masks = []  # kept alive for the call
        for i, seg in enumerate(segments):
            if seg.start + seg.length > seg.cache.capacity:
                raise ValueError(f"KV cache overflow: {seg.start + seg.length} slots needed, "
                                 f"capacity {seg.cache.capacity}")
            mask = None if seg.mask is None else seg.mask.reshape(seg.length, seg.start + seg.length).contiguous()
            masks.append(mask)
            segs[i] = _Segment(seg.cache.k.data_ptr(), seg.cache.v.data_ptr(), seg.cache.capacity, seg.start,
                               seg.length, None if mask is None else mask.data_ptr())
        logits = torch.empty(logit_rows.numel(), self._model.vocab, dtype=torch.float32)
        features = tap_slot = None
        if taps:
            features = torch.empty(M, len(taps) * self._model.hidden, dtype=self._dtype)
            tap_slot = self._tap_slots(taps)
        rc = self._fn(ctypes.byref(self._model), M, ids.data_ptr(), positions.data_ptr(), len(segments), segs,
                      logit_rows.numel(), logit_rows.data_ptr(), logits.data_ptr(),
                      None if tap_slot is None else tap_slot.data_ptr(), len(taps),
                      None if features is None else features.data_ptr())
        if rc != 0:
            raise MemoryError("native forward: out of memory")
        return logits, features

    def _tap_slots(self, taps: tuple[int, ...]) -> torch.Tensor:
        """Per layer, the tap it fills, or -1 (cached: a drafter's taps never change)."""
        slots = self._tap_cache.get(taps)
        if slots is None:
            slots = torch.full((self._model.layers,), -1, dtype=torch.int32)
            for j, layer in enumerate(taps):
                slots[layer] = j
            self._tap_cache[taps] = slots
        return slots


def _matrices(layers) -> list[torch.Tensor]:
    """The fused matrices (plain tensors, not Parameters) the native code reads besides the Parameters."""
    return [t for layer in layers for t in (layer.self_attn.qkv()[0], layer.mlp.gate_up_weight)]


class _DraftSegment(ctypes.Structure):  # draft.c's DraftSegment
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("capacity", ctypes.c_int64),
                ("start", ctypes.c_int64), ("ctx_rows", ctypes.c_int32), ("block_rows", ctypes.c_int32)]


class _DraftModel(ctypes.Structure):
    _fields_ = [("base", _Model), ("fc", ctypes.c_void_p), ("hidden_norm", ctypes.c_void_p), ("fc_in", ctypes.c_int32)]


class NativeDraft:
    """The pointers draft.c reads for one DFlash drafter (dropped by `DFlashDrafter._apply`, as above)."""

    def __init__(self, drafter, lib):
        cfg = drafter.cfg
        self._fn = lib.draft_block
        keep = self._kept = _Kept()
        self._layers = _layer_array(drafter.layers, keep)
        base = _Model(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                      cfg.intermediate_size, 0, drafter.dtype == torch.bfloat16, cfg.rms_norm_eps, None,
                      keep(drafter.norm.weight), None, keep(drafter.rope.cos), keep(drafter.rope.sin),
                      ctypes.cast(self._layers, ctypes.POINTER(_Layer)))
        self._model = _DraftModel(base, keep(drafter.fc.weight), keep(drafter.hidden_norm.weight),
                                  drafter.fc.weight.shape[1])
        self._dtype, self._hidden = drafter.dtype, cfg.hidden_size
        self.checked = False  # whether a pass was compared with the torch forward (DFlashDrafter._native_block)

    @staticmethod
    def for_drafter(drafter) -> "NativeDraft | None":
        lib = native.library()
        tensors = [*drafter.parameters(), drafter.rope.cos, drafter.rope.sin, *_matrices(drafter.layers)]
        if lib is None or not _usable(drafter.dtype, drafter.cfg.head_dim, tensors):
            return None
        return NativeDraft(drafter, lib)

    def __call__(self, block_emb: torch.Tensor, block_pos: torch.Tensor, features: torch.Tensor,
                 ctx_pos: torch.Tensor, segments) -> torch.Tensor:
        """Final-normed block rows [T, H] for block_emb [T, H] at block_pos [T], after writing the context rows
        (features [C, taps * H] at ctx_pos [C]) to their caches; rows of both are split in order into
        `segments` (dflash.DraftSegment, one request each)."""
        T, C = block_emb.shape[0], features.shape[0]
        segs = (_DraftSegment * len(segments))()
        for i, seg in enumerate(segments):
            need = seg.start + seg.ctx_length + seg.block_length  # the block's keys need scratch slots too
            if need > seg.cache.capacity:
                raise ValueError(f"drafter cache overflow: {need} slots needed, capacity {seg.cache.capacity}")
            segs[i] = _DraftSegment(seg.cache.k.data_ptr(), seg.cache.v.data_ptr(), seg.cache.capacity, seg.start,
                                    seg.ctx_length, seg.block_length)
        out = torch.empty(T, self._hidden, dtype=self._dtype)
        rc = self._fn(ctypes.byref(self._model), len(segments), segs, C, features.data_ptr(), ctx_pos.data_ptr(), T,
                      block_emb.data_ptr(), block_pos.data_ptr(), out.data_ptr())
        if rc != 0:
            raise MemoryError("native drafter pass: out of memory")
        return out


# Above this many rows oneDNN's blocked products (and the torch forward around them) win on the machine this
# was tuned on (a verify after a 128-token prefix, bf16: 16 rows 32.8 vs 36.3 ms, 24 rows 48.1 vs 48.0; fp32:
# 12 rows 47.0 vs 47.2, 16 rows 60.0 vs 56.5). CASTSPEC_NATIVE_ROWS sets another limit (0: torch only).
MAX_ROWS = {torch.bfloat16: 16, torch.float32: 12}


def max_rows(dtype: torch.dtype) -> int:
    override = os.environ.get("CASTSPEC_NATIVE_ROWS")
    return int(override) if override else MAX_ROWS.get(dtype, 0)


def applies(cache) -> bool:
    """The cache layout step.c writes: fp32, one sequence, contiguous, on the CPU."""
    return (cache.k.dtype == torch.float32 and cache.k.shape[1] == 1 and cache.k.is_contiguous()
            and cache.v.is_contiguous() and cache.k.device.type == "cpu")


def agrees(native_out: tuple, torch_out: tuple, dtype: torch.dtype) -> bool:
    """A native forward's outputs equal the torch forward's up to rounding (relative to the largest value:
    logits and hidden states have no fixed scale)."""
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    return all(torch.allclose(a.float(), b.float(), rtol=0, atol=tol * max(b.abs().max().item(), 1.0))
               for a, b in zip(native_out, torch_out) if b is not None)


def first_use(native_code: "NativeStep | NativeDraft", out: tuple, torch_forward, dtype: torch.dtype,
              what: str) -> tuple[tuple, bool]:
    """The first native forward of a model is also run through torch (`torch_forward()`, writing the same cache
    slots again) and the two compared: a disagreement, which only a platform or shape the C code mishandles can
    cause, is logged. Returns (the outputs to use, whether the native path may stay on)."""
    if native_code.checked:
        return out, True
    ref = torch_forward()
    if not agrees(out, ref, dtype):
        log.warning("castspec: the native %s disagrees with the torch forward on this model; using torch's", what)
        return ref, False
    native_code.checked = True
    return out, True
