"""Packed weights on transparent huge pages.

Every forward streams the packed weights from memory (a decode step is bound by that read), and on 4 KiB pages
that stream crosses a page every 4 KiB: a TLB miss and a page walk each time (the model's 269 MB of bf16 weights
are ~66,000 pages, far more than the TLB holds), and the hardware prefetchers stop at every page's end. On 2 MiB
pages the same stream meets a boundary 512x less often. Linux backs an anonymous mapping with huge pages where
the mapping is advised so (MADV_HUGEPAGE) and transparent huge pages are not off; the packed weights are
copied into such mappings once, at load. Where that is not available (no MADV_HUGEPAGE on this platform, or the
switch off) the copies stay ordinary tensors; the bits are the same either way.
"""
from __future__ import annotations

import ctypes
import mmap

import torch

from .. import env

HUGE_PAGE = 2 << 20
CHUNK = 64 << 20  # one mapping's size (more for a larger tensor): its untouched tail costs no memory
ALIGN = 64


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def available() -> bool:
    """Whether weights go to huge pages here: the platform can advise them and CASTSPEC_HUGEPAGES is not 0."""
    return hasattr(mmap, "MADV_HUGEPAGE") and env.hugepages_enabled()


class HugePageArena:
    """Copies of tensors, placed one after another (cache-line aligned) in anonymous mappings that start on a
    huge-page boundary and are advised for huge pages. The copies live as long as the arena (and any tensor
    made from them)."""

    def __init__(self):
        self._current: memoryview | None = None
        self._used = self._size = 0

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of `t` in the arena."""
        nbytes = t.numel() * t.element_size()
        if self._current is None or self._used + nbytes > self._size:
            self._open(max(CHUNK, _round_up(nbytes, HUGE_PAGE)))
        out = torch.frombuffer(self._current, dtype=t.dtype, count=t.numel(), offset=self._used).view(t.shape)
        out.copy_(t)
        self._used = _round_up(self._used + nbytes, ALIGN)
        return out

    def _open(self, size: int) -> None:
        self._current, self._used, self._size = _mapping(size), 0, size


def _mapping(size: int) -> memoryview:
    """`size` bytes (a multiple of HUGE_PAGE) of a fresh anonymous mapping advised for huge pages, starting on a
    huge-page boundary; the mapping lives as long as the view (and anything made from it). A private mapping: a
    shared one is shmem, whose huge pages are another switch. It is one huge page longer than needed, used from
    its first boundary on."""
    m = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(m)) % HUGE_PAGE
    m.madvise(mmap.MADV_HUGEPAGE, start, size)
    return memoryview(m)[start:start + size]

