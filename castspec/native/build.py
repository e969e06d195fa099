"""castspec's native code for AVX-512 CPUs, compiled at first use: csrc/skinny.c (matrix products of a few rows),
and built on them csrc/step.c (whole target forwards of a few rows) and csrc/draft.c (the drafter's block pass),
both from the layer pieces in csrc/layer.h; their Python side is models/native_step.py.

Why: a decode step multiplies one row by every weight matrix (a verify or a drafter pass, a few more), so
its time is the time to stream the weights. At these shapes torch's kernels here (oneDNN on a pre-packed weight,
an inductor-compiled reduction) stream bf16 weights at about half the machine's read rate;
`python -m castspec.bench.engine` times them side by side (`gemv_ms`). The code is plain C with AVX-512
intrinsics (no torch headers), so it builds in about a second with the system C compiler, and is cached under
~/.cache/castspec/native keyed by its source and flags. Where the CPU lacks AVX-512 BF16, no compiler is found,
the build fails or its self-check disagrees with torch, castspec uses torch's kernels (logged once).
CASTSPEC_NATIVE=0 turns it off.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
from pathlib import Path

import torch

log = logging.getLogger("castspec")

CSRC = Path(__file__).parent / "csrc"  # every .c there is built into one library, .h files are included
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC")
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
# Above this many rows oneDNN's blocked GEMM is faster on the machine this was tuned on (the step's products
# alone, over all 121 matrices: bf16 8 rows 15.1 vs 16.1 ms, 16 rows 29.5 vs 22.1; fp32 4 rows 24.2 vs 26.4,
# 8 rows 32.0 vs 28.8). Whole native forwards (models/native_step.py) use the kernels at any row count.
MAX_ROWS = {torch.bfloat16: 8, torch.float32: 4}
_ENTRY = {torch.bfloat16: "skinny_bf16", torch.float32: "skinny_f32"}


def cpu_supported() -> bool:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:  # not Linux
        return False
    return all(f in flags for f in CPU_FLAGS)


def _build(out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    sources = sorted(map(str, CSRC.glob("*.c")))
    subprocess.run([os.environ.get("CC", "cc"), *FLAGS, *sources, "-o", str(tmp), "-lm"], check=True,
                   capture_output=True, timeout=120)
    os.replace(tmp, out)  # atomic, so processes building at once never load a half-written library


def _self_check(lib) -> bool:
    """The built kernels against torch on shapes with tails and several row groups."""
    g = torch.Generator().manual_seed(0)
    for dtype in _ENTRY:
        w = torch.randn(37, 83, generator=g).to(dtype)
        x = torch.randn(19, 83, generator=g).to(dtype)
        got = _call(lib, x, w)
        ref = (x.double() @ w.double().T).to(dtype)
        if not torch.allclose(got.float(), ref.float(), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4):
            return False
    return True


@functools.lru_cache(maxsize=None)
def library():
    """The loaded kernels, or None where they are unavailable (see the module docstring)."""
    if os.environ.get("CASTSPEC_NATIVE", "1") == "0" or not cpu_supported():
        return None
    from ..env import cache_dir

    files = sorted(CSRC.glob("*.[ch]"))  # the header too: a change there must rebuild
    key = hashlib.sha256(b"".join(p.read_bytes() for p in files) + " ".join(FLAGS).encode()).hexdigest()[:16]
    path = cache_dir() / "native" / f"castspec-{key}.so"
    try:
        if not path.exists():
            _build(path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.warning("castspec: native kernels unavailable (%s %s); using torch's", type(e).__name__,
                    detail.decode(errors="replace").strip().splitlines()[-1:] or "")
        return None
    for name in _ENTRY.values():
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 5
        fn.restype = None
    rows = lib.forward_rows  # step.c; its Python side is models/native_step.py
    rows.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                     ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    rows.restype = ctypes.c_int
    draft = lib.draft_block
    draft.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                      ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    draft.restype = ctypes.c_int
    if not _self_check(lib):
        log.warning("castspec: native kernels disagree with torch on this machine; using torch's")
        return None
    return lib


def _call(lib, x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    M, I = x2.shape
    out = torch.empty(M, w.shape[0], dtype=x2.dtype)
    getattr(lib, _ENTRY[x2.dtype])(w.data_ptr(), x2.data_ptr(), out.data_ptr(), M, w.shape[0], I, x2.stride(0),
                                   out.stride(0))
    return out


def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x [..., I] @ weight[O, I]^T for at most MAX_ROWS[dtype] rows on CPU, or None when the kernels do not
    apply."""
    if x.device.type != "cpu" or x.dtype != weight.dtype or x.dtype not in _ENTRY or not weight.is_contiguous():
        return None
    rows = x.numel() // max(x.shape[-1], 1)
    if not 0 < rows <= MAX_ROWS[x.dtype]:
        return None
    lib = library()
    if lib is None:
        return None
    x2 = x.reshape(rows, x.shape[-1]).contiguous()
    return _call(lib, x2, weight).view(*x.shape[:-1], weight.shape[0])
