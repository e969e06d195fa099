"""Bit-exact bf16 (issue 16): greedy `chain` and `cast` at every width commit exactly the tokens `ar` commits, and
a request's tokens (greedy or seeded) do not depend on its batch, its arrival order or the prefill chunking,
when every target forward runs castspec's row-invariant native code (the real build on AVX-512 BF16 CPUs, the
emulated one elsewhere: native_support).

The targets here are tie-prone on purpose: transformers' small random init, untouched, leaves the top logits
within bf16 rounding of each other, so any forward whose rounding depended on the other rows in it would flip a
greedy choice within a few dozen tokens (torch's kernels do, see test_torch_kernels_are_reported_as_near_ties).
"""
import pytest
import torch
from transformers import LlamaForCausalLM, Qwen3ForCausalLM

import castspec
from castspec.config import DecodeConfig
from castspec.cost import CostProfile
from castspec.decode import decode
from castspec.engine import Engine
from castspec.models.load import build_target
from castspec.prefix_cache import PrefixCache
from castspec.serving.scheduler import Scheduler, SchedulerConfig
from conftest import llama_config, qwen3_config, random_drafter, read_prompt, serve_all
from native_support import native_library

VOCAB = 96


@pytest.fixture(scope="module")
def lib():
    mp = pytest.MonkeyPatch()
    try:
        yield from native_library(mp)
    finally:
        mp.undo()


def tie_prone(kind: str):
    """A bf16 target whose greedy choices are near-ties (no widening of the random init, unlike conftest's)."""
    cfg = llama_config(vocab=VOCAB) if kind == "llama" else qwen3_config(vocab=VOCAB, head_dim=16)
    torch.manual_seed(11)
    hf = (LlamaForCausalLM if kind == "llama" else Qwen3ForCausalLM)(cfg).eval()
    return build_target(hf.config, hf.state_dict(), torch.bfloat16, "cpu")


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def models(request, lib):
    target = tie_prone(request.param)
    return target, random_drafter(target, block_size=8, seed=3, scale=2.0)


def flat_profile():
    packed = [1, 2, 4, 8, 16, 32, 64, 128]
    return CostProfile({}, packed, [0, 1024], [[10 + 0.05 * n for n in packed]] * 2, [1.0, 1.0])


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def run(target, drafter, prompt, **kw):
    kw.setdefault("max_new_tokens", 48)
    cfg = DecodeConfig(**kw)
    return [t for chunk in decode(target, drafter, prompt, cfg, profile=flat_profile()) for t in chunk]


def test_bf16_chain_and_cast_equal_ar_at_every_width(models):
    target, drafter = models
    for prompt in prompts(4, seed=1):
        ar = run(target, None, prompt, method="ar")
        for method, width in [("chain", "auto"), ("cast", 1), ("cast", 7), ("cast", 15), ("cast", 63),
                              ("cast", "auto")]:
            assert run(target, drafter, prompt, method=method, width=width) == ar, (method, width)
    assert target.backend.active  # every forward above ran the native code (a fallback would not be exact)


@pytest.mark.parametrize("policy", ["shared", "cost"])
def test_bf16_requests_are_the_same_alone_and_in_any_batch(models, policy):
    target, drafter = models
    ps = prompts(10, seed=2)
    requests = [(p, DecodeConfig(method="cast", max_new_tokens=24)) for p in ps]
    # seeded sampled requests too: their draws are coupled to output positions (castspec.sampling)
    requests += [(p, DecodeConfig(method="cast", max_new_tokens=24, temperature=0.8, seed=40 + i))
                 for i, p in enumerate(ps[:6])]
    alone = [run(target, drafter, p, method="ar", max_new_tokens=c.max_new_tokens, temperature=c.temperature,
                 seed=c.seed) for p, c in requests]
    g = torch.Generator().manual_seed(7)
    for max_batch, budget in [(16, 512), (5, 13), (3, 1)]:
        arrivals = torch.randint(0, 12, (len(requests),), generator=g).tolist()
        cfg = SchedulerConfig(max_batch=max_batch, max_queue=64, prefill_budget=budget, policy=policy, width=40)
        sched = Scheduler(target, drafter, cfg, method="cast", profile=flat_profile())
        outs, _ = serve_all(sched, requests, arrivals)
        for i, ref in enumerate(alone):
            assert outs[i] == ref, (max_batch, budget, i)


@pytest.mark.parametrize("method", ["ar", "cast"])
def test_bf16_prompt_prefixes_copied_from_earlier_requests_change_no_bit(models, method):
    """Prompts that share prefixes with earlier requests (a common start, a prompt and its extension, one prompt
    twice, a next turn after an earlier request's answer): those that copy a kept prefix (castspec.prefix_cache)
    commit exactly what they commit alone, greedy and seeded (tests/test_prefix_cache.py compares the caches'
    bits)."""
    target, drafter = models
    d = drafter if method != "ar" else None
    base = prompts(1, seed=4)[0] + prompts(1, seed=5)[0]
    tails = prompts(4, seed=6)
    answer = run(target, d, base, method=method, max_new_tokens=16)
    # the last: a next turn, the conversation so far (the first request's prompt and answer) and more
    ps = [base, base + tails[0], base[:7] + tails[1], base + tails[0] + tails[2], base, tails[3],
          base + answer + tails[1][:4]]
    requests = [(p, DecodeConfig(method=method, max_new_tokens=16)) for p in ps]
    requests.append((ps[1], DecodeConfig(method=method, max_new_tokens=16, temperature=0.8, seed=5)))
    alone = [run(target, d, p, method=method, max_new_tokens=16, temperature=c.temperature, seed=c.seed)
             for p, c in requests]
    cfg = SchedulerConfig(max_batch=3, prefill_budget=13, policy="cost", width=40)
    sched = Scheduler(target, drafter, cfg, method=method, profile=flat_profile())
    outs, _ = serve_all(sched, requests, arrivals=[0, 6, 12, 18, 24, 30, 120, 36])
    for i, ref in enumerate(alone):
        assert outs[i] == ref, (method, i)
    m = sched.metrics.snapshot()
    assert m["prefix_hits"] >= 6 and m["prefix_hit_tokens"] >= 4 * len(base) + len(answer) - 1
    assert m["prefill_tokens"] + m["prefix_hit_tokens"] == sum(len(p) for p, _ in requests)


def test_bf16_a_copied_prefix_leaves_the_caches_a_full_read_leaves(models):
    """castspec.prefix_cache: a prompt that copies the start of another's and reads the rest holds the bits a full
    read of it writes (target cache, the drafter's pending features, the prompt's logits)."""
    target, drafter = models
    first = prompts(1, seed=8)[0] + prompts(1, seed=9)[0]
    later = first[:len(first) * 2 // 3] + prompts(1, seed=10)[0]
    cache = PrefixCache(max_bytes=2**30)
    read_prompt(target, drafter, first, cache=cache, budget=8)
    copied = read_prompt(target, drafter, later, cache=cache, budget=5)
    whole = read_prompt(target, drafter, later, budget=1000)
    assert cache.hit_tokens >= len(first) * 2 // 3 and target.backend.active  # every read ran the native code
    n = len(later)
    assert torch.equal(copied.cache.k[:, :, :, :n], whole.cache.k[:, :, :, :n])
    assert torch.equal(copied.cache.v[:, :, :, :n], whole.cache.v[:, :, :, :n])
    assert torch.equal(copied.draft.pending, whole.draft.pending)
    assert torch.equal(copied.prompt_logits, whole.prompt_logits)


def test_engine_says_which_guarantee_holds(models):
    target, drafter = models
    engine = Engine(target, None, drafter)
    assert engine.exactness == "bit-exact", engine.exactness_reason
    assert "native" in engine.exactness_reason


def test_torch_kernels_are_reported_as_near_ties():
    """A target on torch's kernels gives no bit-exactness, and the engine says so."""
    target = tie_prone("llama")
    target.backend.use_torch()
    engine = Engine(target, None, None)
    assert engine.exactness == "near-ties" and "torch" in engine.exactness_reason


@pytest.mark.slow
def test_default_target_bf16_chain_and_cast_equal_ar(lib):
    """The shipped deployment in bf16 (SmolLM2-135M-Instruct, shipped drafter): a few real prompts, short."""
    engine = castspec.load(dtype="bf16")
    assert engine.exactness == "bit-exact", engine.exactness_reason
    for prompt in ["def is_prime(n):", "Three facts about the Moon:"]:
        ar = engine.generate(prompt=prompt, method="ar", max_new_tokens=12).token_ids
        for method, width in [("chain", "auto"), ("cast", 15)]:
            assert engine.generate(prompt=prompt, method=method, width=width, max_new_tokens=12).token_ids == ar
