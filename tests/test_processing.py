"""Logit processing at every tree node (penalties, bias, min_tokens), log-probabilities, seed-coupled sampling
and forked continuations (n > 1): every method commits what `ar` commits, and seeds reproduce whatever the
method or the batch."""
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from castspec.config import ConfigError, DecodeConfig
from castspec.cost import CostProfile
from castspec.decode import decode
from castspec.sampling import History, LogitProcessor, choice_seed
from castspec.serving.scheduler import Request, Scheduler, SchedulerConfig
from conftest import llama_config, make_hf, native, qwen3_config, random_drafter

V = 24


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def models(request, device):
    cfg = llama_config(vocab=V) if request.param == "llama" else qwen3_config(vocab=V)
    target = native(make_hf(cfg, seed=1, device=device))
    return target, random_drafter(target, block_size=8, seed=2)


def run(target, drafter, prompt, sink=None, **kw):
    kw.setdefault("max_new_tokens", 30)
    return [t for chunk in decode(target, drafter, prompt, DecodeConfig(**kw), logprobs=sink) for t in chunk]


METHODS = [dict(method="ar"), dict(method="chain"), dict(method="cast", width=3), dict(method="cast", width=15),
           dict(method="cast", width=63)]
PROCESSING = [
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.8),
    dict(repetition_penalty=1.6),
    dict(logit_bias={3: 4.0, 5: -100.0}),
    dict(presence_penalty=-0.5, frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={7: 2.5}),
]


@pytest.mark.parametrize("proc", PROCESSING, ids=lambda p: "-".join(p))
def test_greedy_processing_keeps_every_method_equal_to_ar(models, proc):
    target, drafter = models
    prompt = [1, 4, 2, 9, 4, 4]
    plain = run(target, None, prompt, method="ar")
    ref = run(target, None, prompt, method="ar", **proc)
    assert ref != plain  # the processing really changes the output
    for m in METHODS[1:]:
        assert run(target, drafter, prompt, **m, **proc) == ref, m


def test_min_tokens_masks_stop_tokens_at_every_node(models):
    target, drafter = models
    prompt = [3, 1, 4]
    free = run(target, None, prompt, method="ar", max_new_tokens=20)
    # a token greedy decoding emits early (for the first time at j >= 1): make it a stop token
    j = next(j for j in range(1, len(free)) if free[j] not in free[:j])
    stop = free[j]
    stopped = run(target, None, prompt, method="ar", max_new_tokens=20, stop_token_ids=(stop,))
    assert stopped == free[:j + 1]
    for m in METHODS:
        out = run(target, drafter if m["method"] != "ar" else None, prompt, max_new_tokens=20,
                  stop_token_ids=(stop,), min_tokens=8, **{k: v for k, v in m.items()})
        assert stop not in out[:8] and len(out) > 8
        if m["method"] == "ar":
            ref = out
        assert out == ref, m


def test_penalties_match_their_definitions():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(V, generator=g) * 3
    prompt, output = [1, 2, 2, 5], [5, 7, 7, 7]
    history = History(prompt)
    history.extend(output)
    # repetition: transformers' processor over prompt + output
    ours = LogitProcessor(repetition_penalty=1.7).adjusted(logits, history)
    ref = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits.double().view(1, -1))[0]
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    # frequency/presence (OpenAI's definition): only output tokens, count-weighted / once
    ours = LogitProcessor(frequency_penalty=0.5, presence_penalty=0.25).adjusted(logits, history)
    expect = logits.double().clone()
    expect[5] -= 0.5 * 1 + 0.25
    expect[7] -= 0.5 * 3 + 0.25
    torch.testing.assert_close(ours, expect, rtol=0, atol=1e-12)
    # a node's history is the output so far plus its ancestors' tokens
    at = history.at([9, 9])
    assert at.length == 6 and at.output[9] == 2 and history.output[9] == 0
    # min_tokens: stop tokens are -inf until that many tokens are out
    proc = LogitProcessor(min_tokens=5, stop_ids=(3,))
    assert proc.adjusted(logits, history)[3] == float("-inf")
    assert proc.adjusted(logits, history.at([1]))[3] == logits[3].double()


def test_logprobs_are_the_targets_and_equal_across_methods(models):
    target, drafter = models
    prompt = [2, 7, 1, 8]
    ref_lp: list = []
    ref = run(target, None, prompt, sink=ref_lp, method="ar", max_new_tokens=12, logprobs=3)
    assert len(ref_lp) == len(ref) and [x.token for x in ref_lp] == ref
    # against one plain forward over prompt + output: log_softmax of the logits before each token
    ids = torch.tensor([prompt + ref], device=target.device)
    with torch.inference_mode():
        logits, _ = target(ids, torch.arange(ids.shape[1], device=target.device).view(1, -1),
                           target.new_cache(ids.shape[1]), 0, causal=True)
    full = torch.log_softmax(logits[0].double().cpu(), -1)
    for j, x in enumerate(ref_lp):
        row = full[len(prompt) - 1 + j]
        assert abs(x.logprob - row[x.token].item()) < 1e-4
        assert [t for t, _ in x.top] == torch.topk(row, 3).indices.tolist()
        assert x.top[0][0] == x.token  # greedy: the chosen token is the best
    for m in METHODS[1:]:
        lps: list = []
        out = run(target, drafter, prompt, sink=lps, max_new_tokens=12, **m, logprobs=3)
        assert out == ref
        for a, b in zip(lps, ref_lp):
            assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_processed_logprobs_follow_the_sampling_law(models):
    target, drafter = models
    lps: list = []
    out = run(target, drafter, [5, 6, 7], sink=lps, method="cast", width=15, max_new_tokens=10, temperature=0.7,
              top_k=4, seed=3, logprobs=5, logprobs_mode="processed")
    for x in lps:
        finite = [lp for _, lp in x.top if np.isfinite(lp)]
        assert len(finite) <= 4  # top-k = 4 leaves at most four tokens with mass
        assert np.isclose(sum(np.exp(finite)), 1.0)
        assert np.isfinite(x.logprob)  # the drawn token is always inside the processed support
    assert [x.token for x in lps] == out


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_k=5, top_p=0.9),
                                      dict(temperature=1.0, presence_penalty=0.7, repetition_penalty=1.3)],
                         ids=["plain", "top-k-p", "penalties"])
def test_seeded_sampling_is_the_same_for_every_method(models, sampling):
    target, drafter = models
    for seed in (0, 1, 2):
        ref = run(target, None, [4, 2, 8], method="ar", seed=seed, **sampling)
        for m in METHODS[1:]:
            assert run(target, drafter, [4, 2, 8], seed=seed, **m, **sampling) == ref, (seed, m)
    assert run(target, None, [4, 2, 8], method="ar", seed=0, **sampling) != \
        run(target, None, [4, 2, 8], method="ar", seed=1, **sampling)


def serve(scheduler, requests):
    """Submit all, run to completion; returns each request's tokens."""
    outs = [[] for _ in requests]
    for i, r in enumerate(requests):
        r.on_tokens = outs[i].extend
        scheduler.submit(r)
    steps = 0
    while scheduler.active or scheduler.queue_length:
        scheduler.step()
        steps += 1
        assert steps < 2000
    return outs


def sampled(seed, n=24, **kw):
    return DecodeConfig(method=kw.pop("method", "cast"), temperature=1.0, seed=seed, max_new_tokens=n, **kw)


def scheduler(target, drafter, policy="shared", **kw):
    # the cost policy with a profile whose slope makes it change width with the batch
    packed = [1, 2, 4, 8, 16, 32, 64, 128]
    profile = CostProfile({}, packed, [0, 1024], [[10 + 0.05 * n for n in packed]] * 2, [1.0, 1.0]) \
        if policy == "cost" else None
    return Scheduler(target, drafter, SchedulerConfig(policy=policy, **kw), profile=profile)


def test_a_seeded_request_draws_the_same_tokens_alone_and_in_a_batch(models):
    target, drafter = models
    prompt = [3, 3, 9, 1]
    alone = serve(scheduler(target, drafter, "fixed", width=3), [Request(prompt, sampled(42), None, lambda *a: None)])[0]
    for policy in ("shared", "cost", "fixed"):
        others = [Request([i % V, (3 * i) % V, 5], sampled(100 + i, n=10 + i), None, lambda *a: None)
                  for i in range(8)]
        mixed = serve(scheduler(target, drafter, policy, max_batch=16, prefill_budget=3),
                      others[:4] + [Request(prompt, sampled(42), None, lambda *a: None)] + others[4:])
        assert mixed[4] == alone, policy


def test_forked_continuations_equal_independent_requests(models):
    target, drafter = models
    prompt = [7, 1, 7, 2, 9]
    seeds = [choice_seed(5, i) for i in range(4)]
    alone = [serve(scheduler(target, drafter), [Request(prompt, sampled(s), None, lambda *a: None)])[0]
             for s in seeds]
    assert len({tuple(a) for a in alone}) > 1
    sched = scheduler(target, drafter, max_batch=8)
    lead = Request(prompt, sampled(seeds[0]), None, lambda *a: None)
    forks = [Request(prompt, sampled(s), None, lambda *a: None, fork_of=lead) for s in seeds[1:]]
    outs = serve(sched, [lead, *forks])
    assert outs == alone
    assert sched.metrics.prefill_tokens == len(prompt)  # the prompt was read once
    # greedy forks: every continuation is the greedy one
    lead = Request(prompt, DecodeConfig(max_new_tokens=12), None, lambda *a: None)
    outs = serve(scheduler(target, drafter), [lead, Request(prompt, DecodeConfig(max_new_tokens=12), None,
                                                           lambda *a: None, fork_of=lead)])
    assert outs[0] == outs[1]


def test_choice_seeds():
    assert choice_seed(7, 0) == 7 and choice_seed(None, 1) is None
    assert len({choice_seed(7, i) for i in range(100)}) == 100


@pytest.mark.parametrize("bad", [dict(repetition_penalty=0.0), dict(presence_penalty=float("nan")),
                                 dict(logit_bias={-1: 1.0}), dict(logit_bias={2: float("inf")}),
                                 dict(min_tokens=-1), dict(logprobs=-2), dict(logprobs_mode="soft"),
                                 dict(verifier="psychic")])
def test_bad_processing_options_are_config_errors(bad):
    with pytest.raises(ConfigError):
        DecodeConfig(**bad)
