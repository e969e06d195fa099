"""castspec's native code for x86 CPUs, compiled at first use: csrc/skinny.c (matrix products of a few rows),
csrc/gemm.c (the products of whole forwards, any rows), and built on them csrc/step.c (whole target forwards)
and csrc/draft.c (the drafter's block pass), both from the layer pieces in csrc/layer.h; their Python side is
native/forward.py, the shared structs and signatures native/abi.py.

Why: a decode step multiplies one row by every weight matrix (a verify or a drafter pass, a few more), so
its time is the time to stream the weights, and torch's kernels at these shapes stream bf16 weights well below
the machine's read rate (`python -m castspec.bench.engine` times them side by side, `gemv_ms`; measurements in
docs/performance.md). The code is plain C with AVX-512 intrinsics (no torch headers), so it builds with the
system C compiler, and is cached under <cache>/native keyed by its sources, flags, build and compiler (path and
`--version`). Where no build fits the CPU, no compiler is found, the build fails, the library's structs differ
from native/abi.py's or its self-check disagrees with torch, castspec uses torch's kernels (logged once). A
cached library that fails to load or to pass its checks is rebuilt once first.

The builds (BUILD_FLAGS):
  avx512   the CPU's own AVX-512 F/BW/VL/BF16 instructions (and AMX tiles where the CPU has them);
  avx2     for CPUs with AVX2 and FMA but no AVX-512 BF16: the same sources on csrc/avx2.h, which runs each
           512-bit operation as two 256-bit ones and each bf16 pair product as two fused multiply-adds of the
           widened values (each addition rounded once, as VDPBF16PS rounds it);
  emulate  the same sources on SIMD Everywhere (simde, header-only; Debian's libsimde-dev) with
           -DCASTSPEC_EMULATE (csrc/simd.h), for any CPU: much slower, never a default. It exists so that
           tests run the AVX-512 code paths on machines without AVX-512.

CASTSPEC_NATIVE (read through castspec.env): 0 turns the native code off; `avx2` and `emulate` ask for that
build (avx2 runs on AVX-512 CPUs too); anything else picks avx512 where the CPU has it, else avx2 where it has
AVX2 and FMA, else none.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import _ctypes
import torch

from .. import env
from . import abi
from .pack import int8_product, pack_int8, quantize

log = logging.getLogger("castspec")

CSRC = Path(__file__).parent / "csrc"  # every .c there is built into one library, .h files are included
SIMDE_INCLUDE = Path("/usr/include")  # where libsimde-dev puts simde/
COMMON_FLAGS = ("-fopenmp", "-shared", "-fPIC")
BUILD_FLAGS = {"avx512": ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"),
               "avx2": ("-O3", "-mavx2", "-mfma", "-mf16c", "-DCASTSPEC_AVX2"),
               # -O2: emulated intrinsics are inlined everywhere, and -O3 makes that build much slower for tests
               "emulate": ("-O2", "-DCASTSPEC_EMULATE", f"-I{SIMDE_INCLUDE}")}
CPU_FLAGS = {"avx512": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"), "avx2": ("avx2", "fma", "f16c")}
AMX_FLAGS = ("amx_tile", "amx_bf16")
AMX_INT8_FLAG, VNNI_FLAG = "amx_int8", "avx512_vnni"
# The most rows castspec's products take for the torch forward (native/linear.py); above it oneDNN's blocked
# GEMM was faster where this was tuned (docs/performance.md). Whole native forwards (native/forward.py) use the
# kernels at any count.
MAX_ROWS = {torch.bfloat16: 8, torch.float32: 4}
_ENTRY = {torch.bfloat16: "skinny_bf16", torch.float32: "skinny_f32"}


@functools.lru_cache(maxsize=None)
def _cpuinfo() -> str:
    """/proc/cpuinfo, read once ('' where there is none: not Linux)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _cpu_flags() -> set[str]:
    return set(_cpuinfo().split())


def _cpu_model() -> tuple[str, int] | None:
    """(vendor_id, cpu family) of the first CPU in /proc/cpuinfo, None where it does not say."""
    lines = _cpuinfo().splitlines()[:8]
    fields = {key.strip(): value.strip() for key, value in (line.split(":", 1) for line in lines if ":" in line)}
    try:
        return fields["vendor_id"], int(fields["cpu family"])
    except (KeyError, ValueError):
        return None


# Build-time settings of csrc/gemm.c's weight prefetch chosen per CPU where they measured faster than its defaults
# (docs/performance.md, "On a Zen 4 EPYC" and "Weights streamed past the L3"): AMD family 25 with AVX-512 is Zen 4,
# which runs each 512-bit operation on 256-bit units; there products of 2 rows and more fetch their weight lines
# ahead into L2 rather than L1. Family 26 is Zen 5, whose L3 takes what L2 evicts: there every product fetches its
# weight lines ahead as non-temporal, so that the target's stream does not evict the L3's other contents (the
# drafter's weights, read right after a verify; the caches), one row included, products of 4-8 rows fetch half as
# far again ahead and of 9-16 rows twice as far, and products of more rows pass over blocks of half the default
# size.
TUNING = {("avx512", ("AuthenticAMD", 25)): ("-DPREFETCH_HINT=_MM_HINT_T1", "-DPREFETCH_MIN_ROWS=2"),
          ("avx512", ("AuthenticAMD", 26)): ("-DPREFETCH_HINT=_MM_HINT_NTA", "-DPREFETCH_MIN_ROWS=1",
                                             "-DPREFETCH_WIDE_ROWS=4", "-DPREFETCH_LINES_WIDE=48",
                                             "-DPREFETCH_LINES_PAIRS=64", "-DBLOCK_BYTES=98304")}


def cpu_supported(build: str = "avx512") -> bool:
    """Whether this CPU runs `build` (avx512 or avx2) natively."""
    return all(f in _cpu_flags() for f in CPU_FLAGS[build])


def cpu_supported_amx() -> bool:
    return all(f in _cpu_flags() for f in AMX_FLAGS)


def build_for(mode: str) -> str | None:
    """The build CASTSPEC_NATIVE=`mode` runs here (a BUILD_FLAGS key), None where none can."""
    if mode == "off":
        return None
    if mode in ("avx2", "emulate"):
        return mode if mode == "emulate" or cpu_supported("avx2") else None
    return "avx512" if cpu_supported("avx512") else "avx2" if cpu_supported("avx2") else None


def amx_wanted(build: str | None) -> bool:
    """Whether the bf16 products should use AMX tiles (csrc/gemm.c): the avx512 build on a CPU with AMX BF16,
    unless CASTSPEC_AMX=0. The library still asks Linux for the tile state and keeps AVX-512 where it is refused."""
    return build == "avx512" and env.amx_enabled() and cpu_supported_amx()


def int8_products() -> bool:
    """Whether a bf16 drafter's native pass multiplies by int8 weights (csrc/gemm.c's gemm_i8_f32): in the avx512
    build, on AMX tiles where the library's products use them and the CPU has AMX-INT8, else on AVX-512 VNNI where
    the CPU has it; unless CASTSPEC_DRAFT_INT8=0. Its proposals then differ from a bf16 pass's by the rounding of
    weights and inputs to int8; decoded tokens do not (they are the target's)."""
    lib = library()
    return env.draft_int8_enabled() and lib is not None and _int8_checked(lib)


@functools.lru_cache(maxsize=None)
def _int8_checked(lib) -> bool:
    """Whether a loaded library's int8 products run here (the avx512 build; AMX-INT8 where its products use AMX,
    else AVX-512 VNNI) and give, on a product of 17 rows, exactly what the integer reference gives (checked once
    per library)."""
    unit = AMX_INT8_FLAG if lib.gemm_amx_on() else VNNI_FLAG
    if loaded_build() != "avx512" or unit not in _cpu_flags():
        return False
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(17, 128, generator=g), torch.randn(40, 128, generator=g)
    qx, sx = quantize(x)
    panels, scales, sums = pack_int8(w, lib.gemm_panel_group())
    rows = torch.zeros(32, 128, dtype=torch.int8)  # whole groups of 16 rows, as AMX tiles read them
    rows[:17] = qx
    got = torch.empty(17, 40)
    lib.gemm_i8_f32(panels.data_ptr(), scales.data_ptr(), sums.data_ptr(), rows.data_ptr(), sx.data_ptr(),
                    got.data_ptr(), 17, 40, 128, 128, 40)
    if not torch.equal(got, int8_product(x, w)):
        log.warning("castspec: the native int8 products disagree with their reference here; drafters keep bf16")
        return False
    return True


def emulation_available() -> bool:
    """Whether simde's headers are here for CASTSPEC_NATIVE=emulate."""
    return (SIMDE_INCLUDE / "simde" / "x86" / "avx512.h").is_file()


def _compiler() -> tuple[str, str]:
    """The C compiler (CC, else cc) as a path where it resolves to one, and its `--version` output ('' when it
    does not run: the build then fails and says why)."""
    cc = os.environ.get("CC", "cc")
    path = shutil.which(cc) or cc
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    return path, version


def _flags(build: str) -> tuple[str, ...]:
    sections = ("-DCASTSPEC_SECTIONS",) if env.sections_enabled() else ()  # a library of its own (the cache key)
    return (*COMMON_FLAGS, *BUILD_FLAGS[build], *TUNING.get((build, _cpu_model()), ()), *sections)


def _library_path(build: str, compiler: str, version: str) -> Path:
    files = sorted(CSRC.glob("*.[ch]"))  # the headers too: a change there must rebuild
    key = hashlib.sha256(b"".join(p.read_bytes() for p in files)
                         + "\0".join((build, *_flags(build), compiler, version)).encode()).hexdigest()[:16]
    return env.cache_dir() / "native" / f"castspec-{build}-{key}.so"


def _build(out: Path, build: str, compiler: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    sources = sorted(map(str, CSRC.glob("*.c")))
    try:
        subprocess.run([compiler, *_flags(build), *sources, "-o", str(tmp), "-lm"], check=True, capture_output=True,
                       timeout=300)
        os.replace(tmp, out)  # atomic, so processes building at once never load a half-written library
    finally:
        tmp.unlink(missing_ok=True)


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


def _load(path: Path) -> ctypes.CDLL | str:
    """The library at `path`, declared and checked, or the reason it is unusable."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return f"it does not load ({e})"
    try:
        abi.declare(lib)
        mismatches = abi.size_mismatches(lib)
    except (AttributeError, ValueError) as e:  # a missing symbol
        mismatches = [str(e)]
    if mismatches:
        reason = "its structs differ from native/abi.py's: " + "; ".join(mismatches)
    elif not _self_check(lib):
        reason = "it disagrees with torch on this machine"
    else:
        return lib
    # unload it: dlopen would otherwise hand this library back for a rebuilt file at the same path
    _ctypes.dlclose(lib._handle)
    return reason


@functools.lru_cache(maxsize=None)
def library():
    """The loaded kernels, or None where they are unavailable (see the module docstring)."""
    build = build_for(env.native_mode())
    if build is None:
        return None
    if build == "emulate" and not emulation_available():
        log.warning("castspec: CASTSPEC_NATIVE=emulate needs simde's headers (%s/simde); using torch's kernels",
                    SIMDE_INCLUDE)
        return None
    compiler, version = _compiler()
    path = _library_path(build, compiler, version)
    lib = _load(path) if path.exists() else None
    if not isinstance(lib, ctypes.CDLL):  # none cached, or a cached one that fails: (re)build once
        try:
            _build(path, build, compiler)
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            log.warning("castspec: native kernels unavailable (%s %s); using torch's", type(e).__name__,
                        detail.decode(errors="replace").strip().splitlines()[-1:] or "")
            return None
        lib = _load(path)
    if isinstance(lib, str):
        log.warning("castspec: native kernels unusable: %s; using torch's", lib)
        return None
    # for the whole process: a row's bits differ between AMX and AVX-512 products
    lib.gemm_use_amx(int(amx_wanted(build)))
    return lib


def panel_group() -> int:
    """Panels per group of the bf16 layout the loaded library's products read (native/pack.py): 1 where none
    loads."""
    lib = library()
    return lib.gemm_panel_group() if lib is not None else 1


def library_key() -> str | None:
    """The key of the library library() loads (a hash of its sources, flags, build and compiler), None where none
    loads: what it computes changes with it, so measurements of its speed (cost profiles) keep it."""
    return Path(library()._name).stem.rsplit("-", 1)[-1] if library() is not None else None


def loaded_build() -> str | None:
    """The build library() loads here (a BUILD_FLAGS key), None where none loads."""
    return build_for(env.native_mode()) if library() is not None else None


def _call(lib, x2: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The product in x2's dtype, or with `out_dtype` fp32 for bf16 inputs, their fp32 sums unrounded."""
    M, I = x2.shape
    wide = x2.dtype == torch.bfloat16 and out_dtype == torch.float32
    out = torch.empty(M, w.shape[0], dtype=torch.float32 if wide else x2.dtype)
    entry = "skinny_bf16_f32" if wide else _ENTRY[x2.dtype]
    getattr(lib, entry)(w.data_ptr(), x2.data_ptr(), out.data_ptr(), M, w.shape[0], I, x2.stride(0), out.stride(0))
    return out


def argmax_rows(logits: torch.Tensor) -> list[int] | None:
    """The index of each row's first largest value of fp32 logits [R, V] on the CPU, as numpy's and torch's
    argmax (the first NaN where a row has one), through the C library (one vector pass a row, rows over both
    threads); None where it does not apply."""
    if (logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
            or not logits.is_contiguous() or logits.shape[1] == 0):
        return None
    lib = library()
    if lib is None:
        return None
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr())
    return out.tolist()


def topk_rows(x: torch.Tensor, k: int,
              support: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The k largest values of each row of fp32 x [R, V] on the CPU, descending, and their token ids (the column,
    or support[column] with a `support`, int64 [V]), as tensors [R, k]; equal values by token id, the smaller
    first (one total order, so the list does not depend on which columns a row has). None where it does not
    apply (another dtype or device, a strided view, k outside 1..V, a NaN in some row) or without the library:
    then torch.topk. One vector pass a row, where torch's top-k of a drafted block costs far more than reading it."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous()
            or not 0 < k <= x.shape[1]):
        return None
    if support is not None and (support.device.type != "cpu" or support.dtype != torch.int64
                                or not support.is_contiguous() or tuple(support.shape) != (x.shape[1],)):
        return None
    lib = library()
    if lib is None:
        return None
    vals = torch.empty(x.shape[0], k, dtype=torch.float32)
    toks = torch.empty(x.shape[0], k, dtype=torch.int64)
    if lib.topk_rows(x.data_ptr(), x.shape[0], x.shape[1], k, None if support is None else support.data_ptr(),
                     vals.data_ptr(), toks.data_ptr()):
        return None
    return vals, toks


def keep_slots(k: torch.Tensor, v: torch.Tensor, src: list[int], dst: int) -> bool:
    """Cache slots src[i] (ascending, each above dst + i) copied to dst + i in every layer and head of the keys k and
    values v [layers, B, heads, capacity, d] in one call; False where it does not apply (not the CPU, not
    contiguous, k and v unlike) or without the library: then torch's indexed copies."""
    if (k.device.type != "cpu" or not k.is_contiguous() or not v.is_contiguous() or k.shape != v.shape
            or k.dtype != v.dtype or k.dim() != 5):
        return False
    lib = library()
    if lib is None:
        return False
    capacity, d = k.shape[3], k.shape[4]
    lib.keep_slots(k.data_ptr(), v.data_ptr(), k.numel() // (capacity * d), capacity, d * k.element_size(),
                   (ctypes.c_int64 * len(src))(*src), dst, len(src))
    return True


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """x [..., I] @ weight[O, I]^T for at most MAX_ROWS[dtype] rows on CPU, or None when the kernels do not
    apply; in x's dtype, or fp32 sums for bf16 inputs with out_dtype=torch.float32."""
    if x.device.type != "cpu" or x.dtype != weight.dtype or x.dtype not in _ENTRY or not weight.is_contiguous():
        return None
    rows = x.numel() // max(x.shape[-1], 1)
    if not 0 < rows <= MAX_ROWS[x.dtype]:
        return None
    lib = library()
    if lib is None:
        return None
    x2 = x.reshape(rows, x.shape[-1]).contiguous()
    return _call(lib, x2, weight, out_dtype).view(*x.shape[:-1], weight.shape[0])
