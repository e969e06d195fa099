"""OpenMP workers handed back by a thread that stops computing (castspec/native/threads.py)."""
import os
import threading

import pytest
import torch

from castspec.native.threads import release_workers


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_a_thread_hands_its_openmp_workers_back():
    torch.set_num_threads(2)
    x = torch.randn(512, 512)
    expected = x @ x
    seen = {}

    def compute_then_release():
        y = x @ x  # a parallel region on this thread: it gets a pool with a worker of its own
        seen["during"] = os_threads()
        seen["released"] = release_workers()
        seen["after"] = os_threads()
        seen["again"] = torch.equal(x @ x, y)  # the next region makes a new pool and computes the same

    t = threading.Thread(target=compute_then_release)
    t.start()
    t.join()
    assert seen["released"] and seen["after"] < seen["during"] and seen["again"]
    assert torch.equal(x @ x, expected)
