"""The native library for the tests that exercise it: the AVX-512 build where the CPU has AVX-512 BF16, else the
AVX2 build where it has AVX2, else the emulated one (CASTSPEC_NATIVE=emulate, on simde's headers), so that the C
code is tested on every machine; a skip, with the reason, where none can run."""
from __future__ import annotations

import os
import shutil

import pytest

from castspec import env
from castspec.native import build as native


def mode() -> str | None:
    """The CASTSPEC_NATIVE value these tests run under here, None where none can (skip_reason says why)."""
    if env.native_mode() == "off":
        return None
    if native.cpu_supported("avx512"):
        return "1"
    if native.cpu_supported("avx2"):
        return "avx2"
    return "emulate" if native.emulation_available() else None


def skip_reason() -> str:
    if env.native_mode() == "off":
        return "CASTSPEC_NATIVE=0 for this run"
    return "no AVX-512 BF16 or AVX2 CPU, and no simde headers (libsimde-dev) to emulate one"


def native_library(monkeypatch):
    """A generator for a fixture: the loaded library with CASTSPEC_NATIVE set for it during one test, and the
    cached library() lookup cleared around it (the build itself is cached on disk, in the session's cache)."""
    chosen = mode()
    if chosen is None:
        pytest.skip(skip_reason())
    monkeypatch.setenv("CASTSPEC_NATIVE", chosen)
    library = native.library  # the cached lookup itself, even if a test replaces native.library
    library.cache_clear()
    try:
        lib = library()
        if lib is None:
            if shutil.which(os.environ.get("CC", "cc")) is None:
                pytest.skip("no C compiler to build the native library")
            pytest.fail(f"the native library (CASTSPEC_NATIVE={chosen}) did not build or load; see the warning")
        yield lib
    finally:
        library.cache_clear()

