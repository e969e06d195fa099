"""Where castspec keeps files, and the environment switches it reads. A leaf: imports nothing of castspec.

Every switch is read when asked for (tests and callers may change the environment between calls):
  CASTSPEC_CACHE        the cache directory (profiles, native builds, dequantized GGUFs); ~/.cache/castspec
  CASTSPEC_NATIVE       0: torch's kernels only; avx2: the native code's AVX2 build (castspec/native/build.py);
                        emulate: its emulated AVX-512 build on simde, for tests; anything else: the best build
                        this CPU runs (AVX-512, else AVX2)
  CASTSPEC_NATIVE_ROWS  the most rows a whole native forward takes (0: torch only); default per dtype
  CASTSPEC_AMX          0: the native bf16 products use AVX-512 only, also where the CPU has AMX
  CASTSPEC_DRAFT_INT8   0: a bf16 drafter's native pass keeps bf16 weights, also where the CPU has AMX-INT8
  CASTSPEC_PACK         0: no oneDNN weight packing (castspec/native/linear.py)
  CASTSPEC_COMPILE      0: no inductor-compiled single-row product (castspec/native/linear.py)
  CASTSPEC_HUGEPAGES    0: the native forwards' packed weights stay on ordinary pages (castspec/native/hugepages.py)
  CASTSPEC_SECTIONS     1: the native library times its forwards section by section (castspec/native/sections.py)
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("CASTSPEC_CACHE", Path.home() / ".cache" / "castspec"))


def native_mode() -> str:
    """'off', 'avx2', 'emulate' or 'on' (CASTSPEC_NATIVE)."""
    value = os.environ.get("CASTSPEC_NATIVE", "1")
    return "off" if value == "0" else value if value in ("avx2", "emulate") else "on"


def native_rows() -> int | None:
    """CASTSPEC_NATIVE_ROWS as an integer, None when unset."""
    value = os.environ.get("CASTSPEC_NATIVE_ROWS")
    return int(value) if value else None


def amx_enabled() -> bool:
    return os.environ.get("CASTSPEC_AMX", "1") != "0"


def draft_int8_enabled() -> bool:
    return os.environ.get("CASTSPEC_DRAFT_INT8", "1") != "0"


def packing_enabled() -> bool:
    return os.environ.get("CASTSPEC_PACK", "1") != "0"


def compile_enabled() -> bool:
    return os.environ.get("CASTSPEC_COMPILE", "1") != "0"


def hugepages_enabled() -> bool:
    return os.environ.get("CASTSPEC_HUGEPAGES", "1") != "0"


def sections_enabled() -> bool:
    return os.environ.get("CASTSPEC_SECTIONS", "0") == "1"
