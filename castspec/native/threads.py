"""OpenMP worker threads when several Python threads compute.

libgomp keeps a pool of worker threads for each thread that starts parallel work (torch's intra-op loops and
castspec's native forwards share that one runtime). Once the workers of all pools outnumber the CPUs, it stops
spinning between parallel regions: every worker sleeps after each region and is woken for the next, and a
forward's ~150 regions each pay that wake-up. On the 2-core machine of docs/performance.md, decoding ran ~3x
slower on one thread while another thread kept its pool (the server's scheduler thread beside the main thread
that loaded and probed the model). `release_workers()` hands the calling thread's pool back (OpenMP 5.0's
omp_pause_resource_all), so a thread that is done computing for a while leaves spinning to the one that computes
next; its next parallel region makes a new pool.
"""
from __future__ import annotations

import ctypes
import functools

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep the runtime


@functools.lru_cache(maxsize=1)
def _pause_all():
    """libgomp's omp_pause_resource_all, from the copy torch loaded (the same soname), or None without one."""
    try:
        fn = ctypes.CDLL("libgomp.so.1").omp_pause_resource_all
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


def release_workers() -> bool:
    """Hand the calling thread's OpenMP workers back (outside any parallel region). True if the runtime did."""
    fn = _pause_all()
    return fn is not None and fn(OMP_PAUSE_SOFT) == 0
