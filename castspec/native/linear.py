"""Linear layers for inference on CPU: castspec's own kernels for a few rows (native/build.py, on AVX-512
CPUs), otherwise weights packed once into oneDNN's blocked layout.

Decode steps, tree verification and drafting multiply 1-64 rows by every weight matrix, so they are bound
by how fast weights stream from memory. torch's plain bf16 F.linear repacks the weight on every call, far
below the machine's read rate at these shapes; the same oneDNN kernel on a weight packed once
(torch.ops.mkldnn, what inductor's CPU freezing path uses) is much faster at 1-16 rows and gives the same bf16
results (docs/performance.md). Packs are remade when a weight changes in place (its version counter moves).
Where oneDNN is missing, single rows use an inductor-compiled reduction and the rest plain F.linear.
CASTSPEC_PACK=0 / CASTSPEC_COMPILE=0 (castspec.env) turn the two paths off.

Dtypes (issue 16): a bf16 model has bf16 weights, not bf16 arithmetic. Activations stay in fp32 and only the
input of a product is rounded to the weight's dtype as it enters it (as llama.cpp does); `linear` returns the
product in the activations' dtype.
"""
from __future__ import annotations

import ctypes
import functools
import logging

import torch
import torch.nn.functional as F

from .. import env
from . import build as native
from .build import skinny_linear
from .pack import pack_panels, packable

log = logging.getLogger("castspec")


def _rowdot(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (w.float() * x.float()).sum(-1)  # fp32 sums, returned unrounded


@functools.lru_cache(maxsize=None)
def compiled_rowdot():
    """The single-row product x [1, I] . w [O, I]^T compiled by inductor (fp32 sums, returned in fp32 whatever
    the inputs' dtype), or None where that is off or unavailable."""
    if not env.compile_enabled():
        return None
    try:
        fn = torch.compile(_rowdot, dynamic=True)
        fn(torch.ones(1, 8), torch.ones(4, 8))  # compile now; fail here rather than mid-decode
        fn(torch.ones(1, 8, dtype=torch.bfloat16), torch.ones(4, 8, dtype=torch.bfloat16))
        return fn
    except Exception as e:  # no C++ compiler, unsupported platform, ...
        log.warning("castspec: compiled GEMV unavailable (%s); using F.linear", type(e).__name__)
        return None


@functools.lru_cache(maxsize=None)
def packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN packs and multiplies weights of this dtype here (its bf16 path needs AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT; on other x86 CPUs it raises)."""
    if not env.packing_enabled() or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(4, 8, dtype=dtype)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype),
                                                 torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], "")
        return bool(torch.equal(out.float(), torch.full((2, 4), 8.0)))
    except Exception as e:  # noqa: BLE001 - a torch build or CPU without these ops
        # expected on CPUs without AVX-512 (bf16), so not a warning: the native forwards do not use it
        log.info("castspec: packed oneDNN linear unavailable for %s (%s); using F.linear", dtype,
                 type(e).__name__)
        return False


def weight_key(weight: torch.Tensor) -> tuple:
    """What a packed copy of `weight` depends on: a pack made for another key is stale. Views share their base's
    version counter, so an in-place update through any alias moves it (inference tensors have none, and cannot be
    changed outside inference mode anyway)."""
    version = None if weight.is_inference() else weight._version
    return weight.data_ptr(), version, weight.dtype, tuple(weight.shape), tuple(weight.stride())


class WeightPack:
    """The packed copy of one weight, owned by the module that uses it (remade if the weight changes)."""

    def __init__(self):
        self._key = None
        self._packed: torch.Tensor | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16) \
                or not packing_available(weight.dtype):
            return None
        key = weight_key(weight)
        if key != self._key:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
            self._key = key
        return self._packed


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  pack: WeightPack) -> torch.Tensor | None:
    """oneDNN's kernel on the packed weight, or None where packing does not apply."""
    if x.dtype != weight.dtype:
        return None
    packed = pack.get(weight)
    return None if packed is None else torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           pack: WeightPack | None = None) -> torch.Tensor:
    """x [..., I] @ weight [O, I]^T (+ bias), returned in x's dtype.

    x may be in any float dtype: it is rounded to weight's dtype as it enters the product (fp32 activations
    times bf16 weights: bf16 inputs), and a bias is then added in x's dtype. The compiled single-row reduction
    and castspec's row kernel (native/build.py) return their fp32 sums unrounded; oneDNN's packed path and
    F.linear return bf16 for bf16 inputs, converted to x's dtype after. So this torch fallback rounds the output
    of a bf16 product of several rows where castspec's kernels are unavailable, and the native forwards
    (native/forward.py), which keep the fp32 sums, never do."""
    if x.dtype == weight.dtype:
        out = _product(x, weight, bias, pack)
        return out if out.dtype == x.dtype else out.to(x.dtype)
    out = _product(x.to(weight.dtype), weight, None, pack, out_dtype=x.dtype).to(x.dtype)
    return out if bias is None else out + bias


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             pack: WeightPack | None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias) for x in weight's dtype: in that dtype, or fp32 sums (the compiled reduction,
    without a bias; castspec's row kernel when `out_dtype` is fp32)."""
    if torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    out = skinny_linear(x, weight, out_dtype)  # a few rows on AVX-512 CPUs (native/build.py)
    if out is not None:
        return out if bias is None else out + bias
    out = packed_linear(x, weight, bias, pack) if pack is not None else None
    if out is not None:
        return out
    if x.device.type == "cpu" and x.numel() == x.shape[-1]:
        fn = compiled_rowdot()
        if fn is not None:
            # plain tensors (not Parameters) so one compiled graph per dtype serves every weight
            out = fn(x.reshape(1, -1).detach(), weight.detach()).view(*x.shape[:-1], weight.shape[0])
            return out if bias is None else out.to(x.dtype) + bias
    return F.linear(x, weight, bias)


class PanelPack:
    """The copy of one weight packed once into gemm.c's panels (native/pack.py), remade if the weight changes."""

    def __init__(self):
        self._key = None
        self._packed: torch.Tensor | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight_key(weight), native.panel_group())
        if key != self._key:
            self._packed, self._key = pack_panels(weight.detach(), key[1]), key
        return self._packed


def _panel_library(x: torch.Tensor, weight: torch.Tensor):
    """The C library where gemm.c multiplies x by a packed `weight` (both on the CPU, gradients off, a weight it
    packs), else None."""
    lib = native.library()
    if (lib is None or torch.is_grad_enabled() or x.device.type != "cpu"
            or weight.device.type != "cpu" or not packable(weight)):
        return None
    return lib


def panel_linear(x: torch.Tensor, weight: torch.Tensor, pack: PanelPack) -> torch.Tensor | None:
    """x [..., I] @ weight [O, I]^T through gemm.c's products for any number of rows: fp32 sums, x rounded to
    weight's dtype as it enters; None where they do not apply (no native library; not on the CPU; gradients on;
    a weight gemm.c cannot multiply). The torch forward's oneDNN kernels stream weights far below the read rate
    at these shapes on some CPUs (docs/performance.md), which made the drafter's head a third of its pass there."""
    lib = _panel_library(x, weight)
    if lib is None:
        return None
    O, I = weight.shape
    rows = x.numel() // I
    xs = torch.zeros(-(-rows // 16) * 16, I, dtype=weight.dtype)  # whole groups of 16 rows (AMX tiles read them)
    xs[:rows] = x.reshape(rows, I)
    out = torch.empty(rows, O, dtype=torch.float32)
    entry = lib.gemm_bf16_f32 if weight.dtype == torch.bfloat16 else lib.gemm_f32
    entry(pack.get(weight).data_ptr(), xs.data_ptr(), out.data_ptr(), rows, O, I, I, O)
    return out.view(*x.shape[:-1], O)


def panel_logprobs(hidden: torch.Tensor, rows: list[int], weight: torch.Tensor, pack: PanelPack) -> torch.Tensor | None:
    """log_softmax(hidden[rows] @ weight^T) [len(rows), O] in one native call (the product as panel_linear's, the
    normalization beside it), for fp32 rows hidden [*, I]; None where panel_linear would not apply. What a drafter
    pass hands its trees: the block rows that draft, through the draft vocabulary's head, as log-probabilities."""
    lib = _panel_library(hidden, weight)
    if lib is None:
        return None
    return head_logprobs(lib, weight.dtype == torch.bfloat16, False, pack.get(weight).data_ptr(), weight.shape,
                         hidden, rows)


def head_logprobs(lib, bf16: bool, int8: bool, head: int, shape: tuple[int, int], hidden: torch.Tensor,
                  rows: list[int]) -> torch.Tensor | None:
    """draft.c's draft_logprobs: rows `rows` of hidden [*, I] through a head of shape [O, I] at address `head`
    (gemm.c's panels, bf16 or fp32, or an int8 weight), log-softmaxed: [len(rows), O] fp32; None where the rows
    are not what it reads (fp32, 2-D, contiguous) or there are none."""
    if hidden.dtype != torch.float32 or hidden.dim() != 2 or not hidden.is_contiguous() or not rows:
        return None
    O, I = shape
    if hidden.shape[1] != I or not 0 <= min(rows) <= max(rows) < hidden.shape[0]:
        raise ValueError(f"rows {min(rows)}..{max(rows)} of hidden {tuple(hidden.shape)} for a head of {I} inputs")
    out = torch.empty(len(rows), O, dtype=torch.float32)
    if lib.draft_logprobs(int(bf16), int(int8), head, O, I, hidden.data_ptr(), (ctypes.c_int64 * len(rows))(*rows),
                          len(rows), out.data_ptr()):
        raise MemoryError("native drafter head: out of memory")
    return out
