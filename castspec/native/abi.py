"""The C library's interface as Python sees it: the structs shared with csrc/ (ctypes mirrors of model.h's Layer,
Int8Weight and StepModel, step.c's Segment, draft.c's DraftModel and DraftSegment) and the exported functions'
signatures.

The library exports each shared struct's sizeof (castspec_sizeof_<name>); `size_mismatches` compares them with
the mirrors here, so a field added on one side only disables the native code instead of corrupting memory.
"""
from __future__ import annotations

import ctypes

LAYER_FIELDS = ("attn_norm", "qkv_w", "qkv_b", "o_w", "o_b", "q_norm", "k_norm", "mlp_norm", "gate_up_w",
                "gate_up_b", "down_w", "down_b")


class Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in LAYER_FIELDS]


class StepModel(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_int32) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "inter",
                                                       "vocab", "bf16", "i8")),
                ("eps", ctypes.c_float),
                *((name, ctypes.c_void_p) for name in ("embed", "final_norm", "head", "cos", "sin")),
                ("layer", ctypes.POINTER(Layer))]


class Int8Weight(ctypes.Structure):
    _fields_ = [("panels", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("sums", ctypes.c_void_p)]


class Segment(ctypes.Structure):
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("capacity", ctypes.c_int64),
                ("start", ctypes.c_int64), ("rows", ctypes.c_int32), ("mask", ctypes.c_void_p)]


class DraftModel(ctypes.Structure):
    _fields_ = [("base", StepModel), ("fc", ctypes.c_void_p), ("hidden_norm", ctypes.c_void_p),
                ("fc_in", ctypes.c_int32)]


class DraftSegment(ctypes.Structure):
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("capacity", ctypes.c_int64),
                ("start", ctypes.c_int64), ("ctx_rows", ctypes.c_int32), ("block_rows", ctypes.c_int32)]


SHARED = {cls.__name__: cls for cls in (Layer, StepModel, Int8Weight, Segment, DraftModel, DraftSegment)}

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
SIGNATURES = {  # name: (argument types, result type)
    "skinny_bf16": ([_P] * 3 + [_I] * 5, None),
    "skinny_bf16_f32": ([_P] * 3 + [_I] * 5, None),
    "skinny_f32": ([_P] * 3 + [_I] * 5, None),
    "gemm_bf16_f32": ([_P] * 3 + [_I] * 5, None),
    "gemm_f32": ([_P] * 3 + [_I] * 5, None),
    "gemm_use_amx": ([_I], _I),
    "gemm_amx_on": ([], _I),
    "gemm_panel_group": ([], _I),
    "gemm_i8_f32": ([_P] * 6 + [_I] * 5, None),
    "forward_rows": ([_P, _I, _P, _P, _I, _P, _I, _P, _P, _P, _I, _P], _I),
    "draft_block": ([_P, _I, _P, _I, _P, _P, _I, _P, _P, _P, _I, _P], _I),
    "argmax_rows": ([_P, _I, _I, _P], None),
    "topk_rows": ([_P, _I, _I, _I, _P, _P, _P], _I),
    "keep_slots": ([_P, _P, _L, _L, _L, _P, _L, _I], None),
    "draft_logprobs": ([_I, _I, _P, _I, _I, _P, _P, _I, _P], _I),
    "draft_pass": ([_P, _I, _P, _I, _P, _P, _I, _P, _P, _P, _P, _I, _P, _I, _P], _I),
}


def declare(lib) -> None:
    """Sets the exported functions' signatures on a loaded library (AttributeError if one is missing)."""
    for name, (args, result) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result


def size_mismatches(lib) -> list[str]:
    """The shared structs whose C sizeof differs from their mirror's here ('Name: C n, Python m')."""
    out = []
    for name, cls in SHARED.items():
        c_size = ctypes.c_int64.in_dll(lib, f"castspec_sizeof_{name}").value
        if c_size != ctypes.sizeof(cls):
            out.append(f"{name}: C {c_size}, Python {ctypes.sizeof(cls)}")
    return out
