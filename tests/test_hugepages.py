"""Packed weights on huge pages (castspec/native/hugepages.py): the arena's copies, and native forwards that
compute the same bits whichever pages hold their weights."""
import pytest
import torch

from castspec.native import hugepages
from conftest import llama_config, make_hf
from conftest import native as native_target
from native_support import native_library

needs_madvise = pytest.mark.skipif(not hasattr(hugepages.mmap, "MADV_HUGEPAGE"),
                                   reason="this platform cannot advise huge pages")


@needs_madvise
def test_arena_copies_in_place_and_aligned():
    arena = hugepages.HugePageArena()
    small = [torch.randn(3, 5), torch.arange(7, dtype=torch.int8), torch.randn(4, 6).to(torch.bfloat16)]
    copies = [arena.copy(t) for t in small]
    for t, c in zip(small, copies):
        assert c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous() and torch.equal(c, t)
        assert c.data_ptr() % hugepages.ALIGN == 0
    # the first copy opens a mapping at a huge-page boundary; the next ones follow it in the same mapping
    assert copies[0].data_ptr() % hugepages.HUGE_PAGE == 0
    assert copies[1].data_ptr() - copies[0].data_ptr() == hugepages._round_up(15 * 4, hugepages.ALIGN)
    # a tensor larger than a mapping's room gets a mapping of its own, on a boundary too
    big = torch.ones(hugepages.CHUNK // 4 + 1)
    copy = arena.copy(big)
    assert copy.data_ptr() % hugepages.HUGE_PAGE == 0 and torch.equal(copy, big)
    del arena  # the copies keep their memory
    assert torch.equal(copies[2], small[2]) and torch.equal(copy, big)


def test_switch(monkeypatch):
    monkeypatch.setenv("CASTSPEC_HUGEPAGES", "0")
    assert not hugepages.available()
    monkeypatch.setenv("CASTSPEC_HUGEPAGES", "1")
    assert hugepages.available() == hasattr(hugepages.mmap, "MADV_HUGEPAGE")


@needs_madvise
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_forward_same_bits_on_either_pages(monkeypatch, dtype):
    """The packed weights' pages change where they live, not a bit of what a forward computes."""
    for _ in native_library(monkeypatch):
        cfg = llama_config()
        out = {}
        for flag in ("0", "1"):
            monkeypatch.setenv("CASTSPEC_HUGEPAGES", flag)
            target = native_target(make_hf(cfg, seed=3), dtype)
            ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
            cache = target.new_cache(32)
            with torch.inference_mode():
                logits, _ = target(ids, torch.arange(12).view(1, -1), cache, 0, causal=True)
            out[flag] = logits
            code = target.backend._code  # the native forward ran, its packed weights in an arena where asked
            assert code is not None and (code._kept._arena is not None) == (flag == "1")
        assert torch.equal(out["0"], out["1"])
