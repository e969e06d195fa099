"""Kept prompt prefixes (castspec.prefix_cache): what is kept, what a newcomer takes, the byte bound, and the
bits (tests/test_exact_bf16.py): a prefix copied from another request's prompt leaves the caches exactly as a full
read of the prompt does."""
import pytest
import torch

from castspec.allocate import FixedWidth
from castspec.config import DecodeConfig
from castspec.decode import decode
from castspec.prefix_cache import PrefixCache
from castspec.round import run_round
from castspec.sequence import Sequence
from castspec.serving.scheduler import Scheduler, SchedulerConfig
from conftest import llama_config, make_hf, native, random_drafter, read_prompt, serve_all


@pytest.fixture(scope="module")
def models():
    target = native(make_hf(llama_config(vocab=40), seed=1))
    return target, random_drafter(target, block_size=4, seed=2)


def test_a_newcomer_takes_the_longest_kept_prefix_but_reads_its_last_token(models):
    target, drafter = models
    cache = PrefixCache(max_bytes=2**30)
    p = list(range(1, 13))
    assert cache.restore(Sequence(target, drafter, p, DecodeConfig(max_new_tokens=2))) == 0  # nothing kept yet
    read_prompt(target, drafter, p, cache=cache)
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
    read_prompt(target, drafter, p, cache=cache)
    read_prompt(target, drafter, p[:6], cache=cache)  # already kept, as the start of p
    assert len(cache) == 1
    read_prompt(target, drafter, p + [5, 6], cache=cache)  # extends p: replaces it
    assert len(cache) == 1
    read_prompt(target, drafter, [20, 21, 22], cache=cache)
    assert len(cache) == 2
    # a prompt read without the drafter keeps no drafter context: a drafting newcomer does not take it
    read_prompt(target, drafter, [33, 34, 35, 36], method="ar", cache=cache)
    drafting = Sequence(target, drafter, [33, 34, 35, 36, 1], DecodeConfig(max_new_tokens=2), 8)
    plain = Sequence(target, drafter, [33, 34, 35, 36, 1], DecodeConfig(method="ar", max_new_tokens=2), 8)
    assert cache.restore(drafting) == 0 and cache.restore(plain) == 4


def test_kept_bytes_stay_within_the_bound_oldest_out_first(models):
    target, drafter = models
    one = PrefixCache(max_bytes=2**30)
    read_prompt(target, drafter, list(range(1, 11)), cache=one)
    cache = PrefixCache(max_bytes=int(one.bytes * 2.5))
    prompts = [[i, *range(1, 10)] for i in (20, 21, 22)]
    for p in prompts:
        read_prompt(target, drafter, p, cache=cache)
    assert len(cache) == 2 and cache.bytes <= cache.max_bytes
    first = Sequence(target, drafter, prompts[0], DecodeConfig(max_new_tokens=2), 8)
    last = Sequence(target, drafter, prompts[2], DecodeConfig(max_new_tokens=2), 8)
    assert cache.restore(first) == 0 and cache.restore(last) == 9
    off = PrefixCache(max_bytes=0)
    read_prompt(target, drafter, prompts[0], cache=off)
    assert len(off) == 0
    with pytest.raises(ValueError, match="prefix_cache_mb"):
        SchedulerConfig(prefix_cache_mb=-1)


def test_a_finished_requests_answer_is_kept_with_its_drafter_state(models):
    """At a request's end its prompt and answer are kept: a next turn takes them, the drafter's context cache for
    what its passes fused and the target features of the rest."""
    target, drafter = models
    seq = Sequence(target, drafter, list(range(1, 10)), DecodeConfig(max_new_tokens=12), 8)
    policy = FixedWidth(4, 3)
    with torch.inference_mode():
        while not seq.done:
            run_round(target, drafter, [seq], policy, prefill_budget=100)
    assert seq.draft.cache.length > 0  # its drafter has fused some of the context
    cache = PrefixCache(max_bytes=2**30)
    cache.store(seq)
    # its own storage, mostly used, is kept rather than copied, and counted whole
    assert cache.bytes >= 2 * seq.cache.k.untyped_storage().nbytes()
    context = (seq.prompt + seq.output)[:seq.cache.length]
    turn = Sequence(target, drafter, context + [30, 31], DecodeConfig(max_new_tokens=2), 8)
    assert cache.restore(turn) == len(context)
    fused = seq.draft.cache.length
    assert turn.draft.cache.length == fused and turn.draft.pending_rows == len(context) - fused
    assert torch.equal(turn.draft.cache.k[:, :, :, :fused], seq.draft.cache.k[:, :, :, :fused])
    assert torch.equal(turn.cache.k[:, :, :, :len(context)], seq.cache.k[:, :, :, :len(context)])
    early = Sequence(target, drafter, context[:5] + [30], DecodeConfig(max_new_tokens=2), 8)
    assert cache.restore(early) == 5 and early.draft.cache.length == min(5, fused)


@pytest.mark.parametrize("method", ["cast", "ar"])
def test_requests_arriving_together_read_a_shared_prompt_start_once(models, method):
    """Four requests submitted at once whose prompts begin with the same 20 tokens: with `wait_for_shared_prompt`
    the first reads them and the others, held back until it has, copy them (and answer exactly as alone); with 0
    all four read them, as they used to."""
    target, drafter = models
    system = [(7 * i) % 37 + 1 for i in range(20)]
    prompts = [system + [30 + i, 2, 3 + i] for i in range(4)] + [[39, 38, 37]]  # and one that shares nothing
    truth = [[t for c in decode(target, None, p, DecodeConfig(method="ar", max_new_tokens=6)) for t in c]
             for p in prompts]
    prefill = {}
    for wait in (16, 0):
        cfg = SchedulerConfig(max_batch=8, prefill_budget=64, policy="fixed", width=4, wait_for_shared_prompt=wait)
        sched = Scheduler(target, drafter, cfg, method=method)
        reqs = [(p, DecodeConfig(method=method, max_new_tokens=6)) for p in prompts]
        outs, reasons = serve_all(sched, reqs, arrivals=[0] * len(reqs))
        assert [outs[i] for i in range(len(prompts))] == truth
        m = sched.metrics.snapshot()
        prefill[wait] = m["prefill_tokens"]
        assert m["prefix_hit_tokens"] == (3 * len(system) if wait else 0)
    assert prefill[0] - prefill[16] == 3 * len(system)
    with pytest.raises(ValueError, match="wait_for_shared_prompt"):
        SchedulerConfig(wait_for_shared_prompt=-1)
