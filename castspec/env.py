"""Where castspec keeps files, and the environment switches it reads. A leaf: imports nothing of castspec.

Every switch is read when asked for (tests and callers may change the environment between calls):
  CASTSPEC_CACHE        the cache directory (profiles, native builds, dequantized GGUFs); ~/.cache/castspec
  CASTSPEC_NATIVE       0: torch's kernels only; emulate: build the native code on simde, for tests on CPUs
                        without AVX-512 (castspec/native/build.py); portable: the same on simde built for this
                        CPU's own vector instructions, single-row forwards only (an opt-in for CPUs without
                        AVX-512); anything else: native code where the CPU has it
  CASTSPEC_NATIVE_ROWS  the most rows a whole native forward takes (0: torch only); default per dtype
  CASTSPEC_AMX          0: the native bf16 products use AVX-512 only, also where the CPU has AMX
  CASTSPEC_PACK         0: no oneDNN weight packing (castspec/native/linear.py)
  CASTSPEC_COMPILE      0: no inductor-compiled single-row product (castspec/native/linear.py)
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("CASTSPEC_CACHE", Path.home() / ".cache" / "castspec"))


def native_mode() -> str:
    """'off', 'emulate', 'portable' or 'on' (CASTSPEC_NATIVE)."""
    value = os.environ.get("CASTSPEC_NATIVE", "1")
    return "off" if value == "0" else value if value in ("emulate", "portable") else "on"


def native_rows() -> int | None:
    """CASTSPEC_NATIVE_ROWS as an integer, None when unset."""
    value = os.environ.get("CASTSPEC_NATIVE_ROWS")
    return int(value) if value else None


def amx_enabled() -> bool:
    return os.environ.get("CASTSPEC_AMX", "1") != "0"


def packing_enabled() -> bool:
    return os.environ.get("CASTSPEC_PACK", "1") != "0"


def compile_enabled() -> bool:
    return os.environ.get("CASTSPEC_COMPILE", "1") != "0"
