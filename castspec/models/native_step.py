"""Forwards of a few rows (decode steps, packed trees) in one native call (castspec/csrc/step.c) on AVX-512
CPUs.

Why: such a forward streams ~270 MB of bf16 weights (8 ms at this machine's read rate) but eager torch adds
~50 small ops per layer whose dispatch costs more than that on 2 cores. step.c runs the same layers
(products on castspec's own kernels, the rest in plain C) with the model's rounding at the same places.

`NativeStep.for_decoder` returns None where it does not apply (no native library, another device,
unsupported shapes); the first native forward of each model is cross-checked against the torch forward, and
a disagreement turns the native path off for that model with a warning.
"""
from __future__ import annotations

import ctypes
import logging
import os

import torch

from .. import native

log = logging.getLogger("castspec")

_LAYER_FIELDS = ("attn_norm", "qkv_w", "qkv_b", "o_w", "o_b", "q_norm", "k_norm", "mlp_norm", "gate_up_w",
                 "gate_up_b", "down_w", "down_b")


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in _LAYER_FIELDS]


class _Model(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_int32) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "inter",
                                                       "vocab", "bf16")),
                ("eps", ctypes.c_float),
                *((name, ctypes.c_void_p) for name in ("embed", "final_norm", "head", "cos", "sin")),
                ("layer", ctypes.POINTER(_Layer))]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeStep:
    """The pointers step.c reads for one Decoder. It keeps its tensors alive; the decoder drops it when its
    weights move (`Decoder._apply`), since the pointers would then be stale."""

    def __init__(self, decoder, lib):
        cfg = decoder.cfg
        self._fn = lib.forward_rows
        self._tensors = []  # every tensor whose pointer step.c holds

        def keep(t):
            if t is not None:
                self._tensors.append(t)
            return _ptr(t)

        layers = (_Layer * cfg.num_layers)()
        for i, layer in enumerate(decoder.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv_w, qkv_b = attn.qkv()
            values = (layer.input_layernorm.weight, qkv_w, qkv_b, attn.o_proj.weight, attn.o_proj.bias,
                      None if attn.q_norm is None else attn.q_norm.weight,
                      None if attn.k_norm is None else attn.k_norm.weight, layer.post_attention_layernorm.weight,
                      mlp.gate_up_weight, mlp.gate_up_bias, mlp.down_proj.weight, mlp.down_proj.bias)
            for name, t in zip(_LAYER_FIELDS, values):
                setattr(layers[i], name, keep(t))
        self._layers = layers
        self._model = _Model(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                             cfg.intermediate_size, cfg.vocab_size, decoder.dtype == torch.bfloat16,
                             cfg.rms_norm_eps, keep(decoder.model.embed_tokens.weight), keep(decoder.model.norm.weight),
                             keep(decoder.head_weight), keep(decoder.rope.cos), keep(decoder.rope.sin),
                             ctypes.cast(layers, ctypes.POINTER(_Layer)))
        self._dtype = decoder.dtype
        self._tap_cache: dict[tuple[int, ...], torch.Tensor] = {}
        self.checked = False  # whether a step was compared with the torch forward (Decoder._single_token)

    @staticmethod
    def for_decoder(decoder) -> "NativeStep | None":
        lib = native.library()
        if lib is None or decoder.device.type != "cpu" or decoder.dtype not in (torch.float32, torch.bfloat16):
            return None
        cfg = decoder.cfg
        if cfg.head_dim % 16 or cfg.head_dim > 512:
            return None
        tensors = [*decoder.parameters(), decoder.rope.cos, decoder.rope.sin, *_matrices(decoder)]
        if not all(t.is_contiguous() for t in tensors):
            return None
        return NativeStep(decoder, lib)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache, start: int, mask: torch.Tensor | None,
                 logit_rows: torch.Tensor, taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward of the M rows ids/positions [M] written to cache slots [start, start + M).

        mask: bool [M, start + M] (True = may attend) or None for the causal triangle (one row: everything).
        Returns (logits [R, V] fp32 of the rows in `logit_rows` [R], hidden states after the layers in `taps`
        [M, len(taps) * H] in the model's dtype, None without taps)."""
        M = ids.numel()
        if start + M > cache.capacity:
            raise ValueError(f"KV cache overflow: {start + M} slots needed, capacity {cache.capacity}")
        logits = torch.empty(logit_rows.numel(), self._model.vocab, dtype=torch.float32)
        features = tap_slot = None
        if taps:
            features = torch.empty(M, len(taps) * self._model.hidden, dtype=self._dtype)
            tap_slot = self._tap_slots(taps)
        rc = self._fn(ctypes.byref(self._model), M, ids.data_ptr(), positions.data_ptr(), start,
                      None if mask is None else mask.data_ptr(), cache.k.data_ptr(), cache.v.data_ptr(),
                      cache.capacity, logit_rows.numel(), logit_rows.data_ptr(), logits.data_ptr(),
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


def _matrices(decoder) -> list[torch.Tensor]:
    out = [decoder.model.embed_tokens.weight, decoder.head_weight]
    for layer in decoder.model.layers:
        out += [layer.self_attn.qkv()[0], layer.self_attn.o_proj.weight, layer.mlp.gate_up_weight,
                layer.mlp.down_proj.weight]
    return out


# Above this many rows oneDNN's blocked products (and the torch forward around them) win on the machine this
# was tuned on; CASTSPEC_NATIVE_ROWS sets another limit (0 keeps every forward on torch).
MAX_ROWS = int(os.environ.get("CASTSPEC_NATIVE_ROWS", "12"))


def applies(cache) -> bool:
    """The cache layout step.c writes: fp32, one sequence, contiguous, on the CPU."""
    return (cache.k.dtype == torch.float32 and cache.k.shape[1] == 1 and cache.k.is_contiguous()
            and cache.v.is_contiguous() and cache.k.device.type == "cpu")
