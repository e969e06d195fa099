"""Matrix-vector products for single-row forwards on CPU.

A decode step multiplies ONE row by every weight matrix, so it is bound by how fast weights stream from
memory. torch's CPU GEMV kernels reach ~9 GB/s here in bf16 (the machine reads ~30 GB/s); an inductor-generated
reduction (fp32 accumulation) reaches ~15-17 GB/s. Multi-row inputs (prefill, tree verification, drafting)
keep using F.linear, whose GEMM kernels are fast. Set CASTSPEC_COMPILE=0 to turn the compiled path off.
"""
from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

log = logging.getLogger("castspec")


def _rowdot(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (w.float() * x.float()).sum(-1).to(x.dtype)


@functools.lru_cache(maxsize=None)
def _compiled_rowdot():
    if os.environ.get("CASTSPEC_COMPILE", "1") == "0":
        return None
    try:
        fn = torch.compile(_rowdot, dynamic=True)
        fn(torch.ones(1, 8), torch.ones(4, 8))  # compile now; fail here rather than mid-decode
        fn(torch.ones(1, 8, dtype=torch.bfloat16), torch.ones(4, 8, dtype=torch.bfloat16))
        return fn
    except Exception as e:  # no C++ compiler, unsupported platform, ...
        log.warning("castspec: compiled GEMV unavailable (%s); using F.linear", type(e).__name__)
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.device.type == "cpu" and x.numel() == x.shape[-1] and not torch.is_grad_enabled():
        fn = _compiled_rowdot()
        if fn is not None:
            # plain tensors (not Parameters) so one compiled graph per dtype serves every weight
            out = fn(x.reshape(1, -1).detach(), weight.detach()).view(*x.shape[:-1], weight.shape[0])
            return out if bias is None else out + bias
    return F.linear(x, weight, bias)
