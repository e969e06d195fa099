"""Kept prompt prefixes (castspec.prefix_cache): what is kept, what a newcomer takes, the byte bound, and the
bits: a prefix copied from another request's prompt leaves the caches exactly as a full read of the prompt does."""
import pytest
import torch

from castspec.config import DecodeConfig
from castspec.models.load import build_target
from castspec.prefix_cache import PrefixCache
from castspec.round import run_round
from castspec.sequence import Sequence
from castspec.serving.scheduler import SchedulerConfig
from conftest import llama_config, make_hf, native, random_drafter
from native_support import native_library


@pytest.fixture(scope="module")
def models():
    target = native(make_hf(llama_config(vocab=40), seed=1))
    return target, random_drafter(target, block_size=4, seed=2)


def read(target, drafter, prompt, method="cast", cache: PrefixCache | None = None, budget=1000) -> Sequence:
    """A sequence that has read its prompt (after taking what `cache` holds), kept in `cache` afterwards."""
    seq = Sequence(target, drafter, prompt, DecodeConfig(method=method, max_new_tokens=4), 8)
    if cache is not None:
        cache.restore(seq)
    with torch.inference_mode():
        while seq.reading_prompt:
            run_round(target, drafter, [seq], None, prefill_budget=budget)
    if cache is not None:
        cache.store(seq)
    return seq


def test_a_newcomer_takes_the_longest_kept_prefix_but_reads_its_last_token(models):
    target, drafter = models
    cache = PrefixCache(max_bytes=2**30)
    p = list(range(1, 13))
    assert cache.restore(Sequence(target, drafter, p, DecodeConfig(max_new_tokens=2))) == 0  # nothing kept yet
    read(target, drafter, p, cache=cache)
    assert len(cache) == 1
    for prompt, taken in [(p, 11), (p[:5] + [30, 31], 5), (p + [7, 8], 12), ([30] + p, 0), (p[:1], 0)]:
        seq = Sequence(target, drafter, prompt, DecodeConfig(max_new_tokens=2), 8)
        assert cache.restore(seq) == taken, prompt
        assert seq.prefilled == seq.cache.length == taken
        assert seq.draft.pending_rows == taken
    assert cache.hits == 3 and cache.hit_tokens == 28


def test_what_is_kept(models):
    target, drafter = models
    p = list(range(1, 13))
    cache = PrefixCache(max_bytes=2**30)
    read(target, drafter, p, cache=cache)
    read(target, drafter, p[:6], cache=cache)  # already kept, as the start of p
    assert len(cache) == 1
    read(target, drafter, p + [5, 6], cache=cache)  # extends p: replaces it
    assert len(cache) == 1
    read(target, drafter, [20, 21, 22], cache=cache)
    assert len(cache) == 2
    # a prompt read without the drafter keeps no drafter context: a drafting newcomer does not take it
    read(target, drafter, [33, 34, 35, 36], method="ar", cache=cache)
    drafting = Sequence(target, drafter, [33, 34, 35, 36, 1], DecodeConfig(max_new_tokens=2), 8)
    plain = Sequence(target, drafter, [33, 34, 35, 36, 1], DecodeConfig(method="ar", max_new_tokens=2), 8)
    assert cache.restore(drafting) == 0 and cache.restore(plain) == 4


def test_kept_bytes_stay_within_the_bound_oldest_out_first(models):
    target, drafter = models
    one = PrefixCache(max_bytes=2**30)
    read(target, drafter, list(range(1, 11)), cache=one)
    cache = PrefixCache(max_bytes=int(one.bytes * 2.5))
    prompts = [[i, *range(1, 10)] for i in (20, 21, 22)]
    for p in prompts:
        read(target, drafter, p, cache=cache)
    assert len(cache) == 2 and cache.bytes <= cache.max_bytes
    first = Sequence(target, drafter, prompts[0], DecodeConfig(max_new_tokens=2), 8)
    last = Sequence(target, drafter, prompts[2], DecodeConfig(max_new_tokens=2), 8)
    assert cache.restore(first) == 0 and cache.restore(last) == 9
    off = PrefixCache(max_bytes=0)
    read(target, drafter, prompts[0], cache=off)
    assert len(off) == 0
    with pytest.raises(ValueError, match="prefix_cache_mb"):
        SchedulerConfig(prefix_cache_mb=-1)


@pytest.fixture(scope="module")
def lib():
    mp = pytest.MonkeyPatch()
    try:
        yield from native_library(mp)
    finally:
        mp.undo()


def test_bf16_a_copied_prefix_leaves_the_caches_a_full_read_leaves(lib):
    hf = make_hf(llama_config(vocab=40), seed=3)
    target = build_target(hf.config, hf.state_dict(), torch.bfloat16, "cpu")
    drafter = random_drafter(target, block_size=4, seed=4)
    first = list(range(1, 30))
    later = first[:21] + [35, 36, 37, 2, 3]
    cache = PrefixCache(max_bytes=2**30)
    read(target, drafter, first, cache=cache, budget=8)
    copied = read(target, drafter, later, cache=cache, budget=5)
    whole = read(target, drafter, later, budget=1000)
    assert cache.hit_tokens == 21 and target.backend.active  # every read ran the native code
    n = len(later)
    assert torch.equal(copied.cache.k[:, :, :, :n], whole.cache.k[:, :, :, :n])
    assert torch.equal(copied.cache.v[:, :, :, :n], whole.cache.v[:, :, :, :n])
    assert torch.equal(copied.draft.pending, whole.draft.pending)
    assert torch.equal(copied.prompt_logits, whole.prompt_logits)
