"""Sampled decoding (T > 0) keeps the target's law: logit processing, the single-node verifier, end to end."""
import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from castspec.config import DecodeConfig
from castspec.decode import decode
from castspec.sampling import History, LogitProcessor, Sampler, choice_seed, inverse_cdf
from castspec.serving.scheduler import Request, Scheduler, SchedulerConfig
from castspec.verify import rrs_node
from conftest import llama_config, make_hf, native, random_drafter


def hf_reference(logits: torch.Tensor, temperature, top_k, top_p) -> np.ndarray:
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))
    x = warpers(None, logits.double().view(1, -1))
    return torch.softmax(x, -1)[0].numpy()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8), (0.9, 5, 0.6)])
def test_logit_processing_matches_transformers_warpers(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(12, generator=g) * 2
        ours = LogitProcessor(temperature, top_k, top_p).probs(logits)
        np.testing.assert_allclose(ours, hf_reference(logits, temperature, top_k, top_p), atol=1e-12)


def test_coupled_draws_follow_the_law_and_depend_on_seed_and_index_only():
    logits = torch.tensor([0.3, -1.0, 2.0, 0.0, 1.1, -0.4, 0.7, 1.5])
    proc = LogitProcessor(temperature=1.0, top_k=5)  # 3 tokens of mass 0
    law = proc.probs(logits)
    n = 20_000
    draws = np.array([Sampler(proc, seed=s % 97).draw(logits, s // 97) for s in range(n)])
    counts = np.bincount(draws, minlength=len(law)).astype(float)
    assert counts[law == 0].sum() == 0  # a token of mass 0 is never drawn
    assert chi_square_pvalue(counts, law) > 1e-4
    assert 0.5 * np.abs(counts / n - law).sum() <= mc_floor(law, n, np.random.default_rng(3))
    # the draw of index t reads (seed, t) and p alone: another sampler of the same seed, other indices in between
    a, b = Sampler(proc, seed=5), Sampler(proc, seed=5)
    first = [a.draw(logits, t) for t in range(50)]
    assert [b.draw(logits, t) for t in reversed(range(50))][::-1] == first
    for u in (0.0, 1.0 - 2.0 ** -53):  # the extreme coins land on tokens of the law too
        c = Sampler(proc, seed=0)
        c.coin = lambda t, u=u: u
        assert law[c.draw(logits, 0)] > 0


def test_inverse_cdf_over_a_vocabulary_picks_what_one_cumulative_sum_picks():
    # a vocabulary-sized law (not a multiple of the block, whole blocks and scattered tokens of mass 0): the
    # two-level search lands where one cumulative sum over everything does, and never on a token of mass 0
    rng = np.random.default_rng(0)
    w = rng.exponential(size=5000) ** 4
    w[rng.random(5000) < 0.3] = 0.0
    w[512:1024] = 0.0
    w[-300:] = 0.0
    cdf = np.cumsum(w)
    for u in [0.0, 1.0 - 2.0 ** -53, *rng.random(3000)]:
        i = inverse_cdf(w, u)
        assert w[i] > 0
        if u < 1 - 1e-9:
            assert i == int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    assert inverse_cdf(w, 1.0 - 2.0 ** -53) == int(np.flatnonzero(w)[-1])


def exact_rrs_law(mu, tokens, q):
    """Output law of rrs_node followed by a residual draw, by enumerating every draw order (float64)."""
    w = np.array([q[t] for t in tokens])
    if not tokens or w.sum() <= 0:
        return mu
    q_t = w / w.sum()
    out = np.zeros_like(mu)
    for j, t in enumerate(tokens):
        if q_t[j] == 0:  # a zero-mass child is never drawn
            continue
        acc = min(1.0, mu[t] / q_t[j])
        out[t] += q_t[j] * acc
        if acc < 1:
            res = mu.copy()
            res[tokens] = np.maximum(res[tokens] - q_t, 0)
            res /= res.sum()
            out += q_t[j] * (1 - acc) * exact_rrs_law(res, tokens[:j] + tokens[j + 1:], q)
    return out


NODE_CASES = {
    "generic": ([0, 1, 2], None, None),
    "zero-mass child": ([0, 1, 2], 1, None),  # q gives child 1 no mass
    "child outside support of mu": ([0, 3, 4], None, 3),  # mu(3) = 0 (e.g. cut by top-k)
    "single child (chain)": ([2], None, None),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(NODE_CASES))
def test_single_node_verifier_law(case):
    tokens, zero_q, zero_mu = NODE_CASES[case]
    rng = np.random.default_rng(1)
    mu = rng.dirichlet(np.ones(6))
    q = rng.dirichlet(np.ones(6) * 0.5)
    if zero_q is not None:
        q[zero_q] = 0
        q /= q.sum()
    if zero_mu is not None:
        mu[zero_mu] = 0
        mu /= mu.sum()
    np.testing.assert_allclose(exact_rrs_law(mu, tokens, q), mu, atol=1e-12)  # Theorem 3 for this node
    sampler = Sampler(LogitProcessor(), seed=0)
    n = 40_000
    counts = np.zeros(6)
    for _ in range(n):
        picked, res = rrs_node(mu, tokens, q, sampler)
        counts[tokens[picked] if picked is not None else sampler.choice(res)] += 1
    tv = 0.5 * np.abs(counts / n - mu).sum()
    assert tv < 4 * mc_floor(mu, n, np.random.default_rng(2)), (tv, counts / n, mu)
    if zero_mu is not None:
        assert counts[zero_mu] == 0


def mc_floor(law: np.ndarray, n: int, rng, reps: int = 200) -> float:
    """Typical (99th percentile) total variation of an n-sample empirical law from the exact one."""
    tvs = [0.5 * np.abs(rng.multinomial(n, law) / n - law).sum() for _ in range(reps)]
    return float(np.quantile(tvs, 0.99))


def chi_square_pvalue(counts: np.ndarray, law: np.ndarray) -> float:
    n = counts.sum()
    expected = law * n
    keep = expected >= 5
    # merge the sparse cells into one so that the asymptotic test is valid
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = len(obs) - 1
    # chi-square survival function: the regularized upper incomplete gamma Q(dof/2, stat/2)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


V, NEW = 6, 5


@pytest.fixture(scope="module")
def law_setup(device):
    target = native(make_hf(llama_config(vocab=V), seed=4, device=device))
    drafter = random_drafter(target, block_size=5, seed=1, scale=1.0)
    return target, drafter


def exact_marginals(target, prompt, proc: LogitProcessor):
    """Exact law of the first NEW sampled tokens, marginals of each position and of adjacent pairs."""
    seqs = list(itertools.product(range(V), repeat=NEW - 1))
    ids = torch.tensor([prompt + list(s) for s in seqs], device=target.device)
    T = ids.shape[1]
    with torch.inference_mode():
        logits, _ = target(ids, torch.arange(T, device=target.device).expand(len(seqs), -1), target.new_cache(T, batch=len(seqs)), 0,
                           causal=True)
    logits = logits.cpu()
    P = len(prompt)
    joint = {}
    for r, s in enumerate(seqs):
        prob_prefix = 1.0
        history = History(prompt)  # what the penalties read before each position
        for t in range(NEW - 1):
            prob_prefix *= proc.probs(logits[r, P - 1 + t], history.at(list(s[:t])))[s[t]]
        last = proc.probs(logits[r, P - 1 + NEW - 1], history.at(list(s)))
        for y in range(V):
            joint[s + (y,)] = prob_prefix * last[y]
    singles = [np.zeros(V) for _ in range(NEW)]
    pairs = [np.zeros((V, V)) for _ in range(NEW - 1)]
    for seq, p in joint.items():
        for t in range(NEW):
            singles[t][seq[t]] += p
        for t in range(NEW - 1):
            pairs[t][seq[t], seq[t + 1]] += p
    assert math.isclose(sum(joint.values()), 1.0, rel_tol=1e-9)
    return singles, pairs


CONFIGS = [
    dict(method="ar"),
    dict(method="chain"),
    dict(method="cast", width=3),
    dict(method="cast", width=15),
    dict(method="cast", width=15, verifier="direct"),
    dict(method="cast", width=15, verifier="rrs"),
    dict(method="chain", verifier="rrs"),
    dict(method="cast", width=15, presence_penalty=0.8, repetition_penalty=1.4),  # the law after penalties
    dict(method="cast", width=15, n=4),  # four forked continuations per prompt (scheduler, one prefill)
    dict(method="cast", width=15, top_k=4, top_p=0.9, temperature=0.8),
    dict(method="chain", top_k=4, top_p=0.9, temperature=0.8),
    dict(method="cast", width=15, draft_vocab=(0, 2, 3, 5)),  # q is 0 outside the draft vocabulary
]


@pytest.mark.slow
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_sampled_decoding_preserves_the_target_law(law_setup, cfg):
    target, drafter = law_setup
    cfg = {"temperature": 1.0, **cfg}
    if "draft_vocab" in cfg:
        drafter = drafter.converted(drafter.dtype)
        drafter.set_draft_vocab(torch.tensor(cfg.pop("draft_vocab")))
    prompt = [1, 4, 2]
    forks = cfg.pop("n", 1)
    dcfg = DecodeConfig(max_new_tokens=NEW, **cfg)
    proc = LogitProcessor.from_config(dcfg)
    singles, pairs = exact_marginals(target, prompt, proc)
    n = 1500
    samples = np.zeros((n, NEW), dtype=int)
    accepted = 0
    from castspec.decode import DecodeStats

    if forks > 1:
        for i in range(0, n, forks):
            sched = Scheduler(target, drafter, SchedulerConfig(policy="fixed", width=dcfg.width))
            outs = [[] for _ in range(forks)]
            lead = None
            for j in range(forks):
                r = Request(prompt, replace(dcfg, seed=choice_seed(i, j)), outs[j].extend, lambda *a: None,
                            fork_of=lead)
                lead = lead or r
                sched.submit(r)
            while sched.active or sched.queue_length:
                sched.step()
            samples[i:i + forks] = outs
            accepted += sched.metrics.committed - sched.metrics.verified
            assert sched.metrics.prefill_tokens == len(prompt)
    for i in range(n if forks == 1 else 0):
        stats = DecodeStats()
        out = [t for c in decode(target, drafter, prompt, replace(dcfg, seed=i), stats) for t in c]
        samples[i] = out
        accepted += sum(r.accepted for r in stats.rounds)
    if cfg["method"] != "ar":
        assert accepted >= 10  # the acceptance path really is exercised
    rng = np.random.default_rng(0)
    for t in range(NEW):
        counts = np.bincount(samples[:, t], minlength=V).astype(float)
        tv = 0.5 * np.abs(counts / n - singles[t]).sum()
        assert tv <= mc_floor(singles[t], n, rng), (t, tv)
        assert chi_square_pvalue(counts, singles[t]) > 1e-4
    for t in range(NEW - 1):
        counts = np.zeros((V, V))
        np.add.at(counts, (samples[:, t], samples[:, t + 1]), 1)
        law = pairs[t].ravel()
        tv = 0.5 * np.abs(counts.ravel() / n - law).sum()
        assert tv <= mc_floor(law, n, rng), (t, tv)
        assert chi_square_pvalue(counts.ravel(), law) > 1e-4


def test_same_seed_same_output(law_setup):
    target, drafter = law_setup
    runs = [[t for c in decode(target, drafter, [2, 3], DecodeConfig(method="cast", width=7, temperature=1.0,
                                                                     seed=s, max_new_tokens=20)) for t in c]
            for s in (11, 11, 12)]
    assert runs[0] == runs[1] != runs[2]
