"""build_tree / build_forest against brute force over the top-K universe."""
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from castspec.tree import build_forest, build_tree, universe_size


def brute_force(logprobs: torch.Tensor, width: int, top_k: int):
    vals, ids = logprobs.topk(top_k, dim=-1)
    strings = []
    for d in range(1, logprobs.shape[0] + 1):
        for ranks in itertools.product(range(top_k), repeat=d):
            score = sum(float(vals[j, r]) for j, r in enumerate(ranks))
            strings.append((score, tuple(int(ids[j, r]) for j, r in enumerate(ranks))))
    strings.sort(key=lambda s: (-s[0], len(s[1])))
    return strings[:width]


def paths(tree):
    out = []
    for i in range(len(tree)):
        p, j = [], i
        while j >= 0:
            p.append(tree.tokens[j])
            j = tree.parents[j]
        out.append(tuple(reversed(p)))
    return out


@settings(max_examples=60, deadline=None)
@given(L=st.integers(1, 4), K=st.integers(1, 3), V=st.integers(3, 7), width=st.integers(0, 50),
       seed=st.integers(0, 10_000))
def test_matches_brute_force_and_is_prefix_closed(L, K, V, width, seed):
    g = torch.Generator().manual_seed(seed)
    logprobs = torch.log_softmax(torch.randn(L, V, generator=g) * 2, dim=-1)
    tree = build_tree(logprobs, width, K)
    expected = brute_force(logprobs, width, min(K, V))
    assert len(tree) == min(width, universe_size(L, min(K, V)))
    assert set(paths(tree)) == {s for _, s in expected}
    for i, (par, d) in enumerate(zip(tree.parents, tree.depths)):
        assert par < i  # parents first
        assert d == (1 if par == -1 else tree.depths[par] + 1)
        # score is the parent's plus this position's original log-probability
        base = 0.0 if par == -1 else tree.scores[par]
        assert math.isclose(tree.scores[i], base + float(logprobs[d - 1, tree.tokens[i]]), abs_tol=1e-5)
    assert tree.scores == sorted(tree.scores, reverse=True)  # best-first order


def test_ties_go_to_prefixes():
    # position 2 is certain (log 1 = 0): every extension ties with its prefix
    logprobs = torch.log(torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]).clamp_min(1e-30))
    tree = build_tree(logprobs, 3, 2)
    assert tree.depths == [1, 1, 2]


def test_width_beyond_universe_is_clamped():
    logprobs = torch.log_softmax(torch.randn(3, 10), -1)
    assert len(build_tree(logprobs, 1000, 2)) == universe_size(3, 2) == 14
    assert len(build_tree(logprobs, 0, 2)) == 0


def test_rejects_bad_arguments():
    with pytest.raises(ValueError):
        build_tree(torch.zeros(3), 4, 2)
    with pytest.raises(ValueError):
        build_tree(torch.zeros(3, 4), -1, 2)
    with pytest.raises(TypeError):
        build_tree(torch.zeros(3, 4), 4)
    with pytest.raises(TypeError):
        build_tree(torch.zeros(3, 4), 4, 2, top_k=2)


def test_candidates_per_position_by_either_name():
    logprobs = torch.log_softmax(torch.randn(3, 10, generator=torch.Generator().manual_seed(4)), -1)
    tree = build_tree(logprobs, 9, top_k_per_position=2)
    assert tree == build_tree(logprobs, 9, 2) == build_tree(logprobs, 9, top_k=2)  # top_k: the earlier name
    assert tree != build_tree(logprobs, 9, 3)


def test_forest_shares_one_budget_best_first():
    g = torch.Generator().manual_seed(3)
    lps = [torch.log_softmax(torch.randn(3, 6, generator=g) * s, -1) for s in (0.5, 3.0, 1.5)]
    budget = 12
    trees = build_forest(lps, budget, 3)
    assert sum(len(t) for t in trees) == budget
    # the union is the global top-`budget` of all requests' strings
    every = sorted(((s, r) for r, lp in enumerate(lps) for s, _ in brute_force(lp, 10_000, 3)), reverse=True)
    threshold = every[budget - 1][0]
    for t in trees:
        assert all(s >= threshold - 1e-6 for s in t.scores)
    # each request's share is itself the top of its own universe
    for t, lp in zip(trees, lps):
        assert set(paths(t)) == {s for _, s in brute_force(lp, len(t), 3)}


def test_zero_probability_strings_are_never_taken():
    lp = torch.log_softmax(torch.randn(3, 10), dim=-1)
    lp[:, 4:] = float("-inf")  # a draft vocabulary of four tokens
    tree = build_tree(lp, 1000, 8)
    assert len(tree) == 4 + 16 + 64 and all(t < 4 for t in tree.tokens)
    assert all(s > float("-inf") for s in tree.scores)
