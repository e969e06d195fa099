"""build_tree / build_forest against brute force over the top-K universe, and with a support (draft vocabulary)."""
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from castspec.native import build as native
from castspec.tree import Marginals, build_forest, build_tree, universe_size


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


def on_support(L: int, V: int, S: int, step: float | None, g: torch.Generator):
    """Random marginals that are -inf outside a support of S tokens (unsorted): the full [L, V] tensor, the
    support's columns [L, S] and the support. `step` rounds the values to a grid, which makes many of them
    equal (within a row, across rows and along paths)."""
    support = torch.randperm(V, generator=g)[:S]
    sub = torch.log_softmax(torch.randn(L, S, generator=g) * 2, dim=-1)
    if step is not None:
        sub = (sub / step).round() * step
    full = torch.full((L, V), float("-inf")).index_copy_(1, support, sub)
    return full, sub, support


@settings(max_examples=80, deadline=None)
@given(L=st.integers(1, 6), K=st.integers(1, 9), V=st.integers(2, 40), frac=st.floats(0.05, 1.0),
       width=st.integers(0, 70), step=st.sampled_from([None, 0.5, 1.0, 3.0]), seed=st.integers(0, 10_000))
def test_support_gives_the_same_trees(L, K, V, frac, width, step, seed):
    """The top K over a support's columns, mapped back to token ids, builds the tree the full tensor builds:
    same tokens, parents, depths and scores, ties included."""
    g = torch.Generator().manual_seed(seed)
    full, sub, support = on_support(L, V, max(1, int(frac * V)), step, g)
    tree = build_tree(full, width, K)
    assert build_tree(sub, width, K, support=support) == tree
    assert all(t in set(support.tolist()) for t in tree.tokens)


@pytest.mark.parametrize("L,K,V,S", [(15, 8, 2000, 300), (8, 4, 500, 500), (15, 2, 64, 5), (3, 8, 40, 6)])
@pytest.mark.parametrize("step", [None, 0.25])
def test_support_gives_the_same_trees_at_decoding_sizes(L, K, V, S, step):
    g = torch.Generator().manual_seed(L * V + S)
    full, sub, support = on_support(L, V, S, step, g)
    for width in (1, 3, 7, 15, 63, 127):
        assert build_tree(sub, width, K, support=support) == build_tree(full, width, K), width


def test_forest_with_supports_equals_forest_of_full_marginals():
    g = torch.Generator().manual_seed(11)
    requests = [on_support(6, 300, s, step, g) for s, step in ((40, None), (300, 0.5), (7, None), (90, 1.0))]
    fulls = [f for f, _, _ in requests]
    # a mix: some requests with their support, one (a drafter without a draft vocabulary) with the full tensor
    lps = [sub for _, sub, _ in requests[:3]] + [fulls[3]]
    supports = [sup for _, _, sup in requests[:3]] + [None]
    for budget, caps in ((40, None), (200, [15, 15, 63, 63]), (7, [3, 3, 3, 3])):
        assert build_forest(lps, budget, 8, caps, supports) == build_forest(fulls, budget, 8, caps)


def test_requests_that_share_a_support_get_the_trees_each_would_get_alone():
    # a batched drafter pass: every request's block over one draft vocabulary (one top-k for all of them),
    # with ties inside and across the k-th place, blocks of different depths, and a request without the support
    g = torch.Generator().manual_seed(5)
    support = torch.randperm(500, generator=g)[:120]
    blocks = [torch.randint(-6, 0, (d, 120), generator=g).float() for d in (7, 7, 3, 7)]
    full = torch.randn(7, 500, generator=g).log_softmax(-1)
    lps, supports = [*blocks, full], [support] * 4 + [None]
    for budget, caps in ((63, None), (200, [63] * 5), (9, [2, 2, 2, 2, 2])):
        forest = build_forest(lps, budget, 8, caps, supports)
        caps_each = caps or [budget] * 5
        alone = [build_forest([lp], budget, 8, [c], [sup])[0] for lp, sup, c in zip(lps, supports, caps_each)]
        for tree, single in zip(forest, alone):
            assert tree.tokens == single.tokens[:len(tree.tokens)]
            assert tree.scores == single.scores[:len(tree.scores)]
    # the blocks as a batched pass leaves them (views one after the other in one tensor) give the same trees,
    # with the top-k read over that tensor without joining them again; in another order they are joined
    views = list(torch.cat(blocks).split([b.shape[0] for b in blocks]))
    for order in ([0, 1, 2, 3], [2, 0, 3, 1]):
        got = build_forest([views[i] for i in order], 63, 8, None, [support] * 4)
        assert got == build_forest([blocks[i] for i in order], 63, 8, None, [support] * 4)


def test_equal_log_probabilities_rank_by_token_id():
    row = torch.tensor([[-2.0, -1.0, -3.0, -1.0, -2.0, -1.0, -2.0]])
    assert build_tree(row, 4, 4).tokens == [1, 3, 5, 0]  # the smallest id among the -2.0s takes the 4th place
    assert build_tree(row, 2, 2).tokens == [1, 3]
    inside = torch.tensor([[-2.0, -1.0, -3.0, -1.0, -5.0, -1.0]])  # ties above the k-th place only
    assert build_tree(inside, 3, 3).tokens == [1, 3, 5] and build_tree(inside, 4, 4).tokens == [1, 3, 5, 0]
    support = torch.tensor([6, 4, 2, 3, 1, 0, 5])  # unsorted columns: the rule goes by token id, not by column
    assert build_tree(row[:, support], 4, 4, support=support) == build_tree(row, 4, 4)
    assert build_tree(row[:, support], 7, 7, support=support).tokens == [1, 3, 5, 0, 4, 6, 2]


def test_support_must_match_the_columns():
    with pytest.raises(ValueError, match="one token id per column"):
        build_tree(torch.zeros(3, 4), 4, 2, support=torch.arange(5))
    with pytest.raises(ValueError, match="one support per request"):
        build_forest([torch.zeros(3, 4)] * 2, 4, 2, supports=[None])


def test_marginals_split_per_request():
    g = torch.Generator().manual_seed(2)
    full, sub, support = on_support(7, 50, 12, None, g)
    whole = Marginals(sub, support, full.shape[-1])
    assert torch.equal(whole.full, full)  # the whole-vocabulary tensor, made on first use
    parts = whole.split([3, 4])
    assert [p.full.shape[0] for p in parts] == [3, 4] and all(p.support is support for p in parts)
    assert torch.equal(parts[1].on_support, sub[3:]) and torch.equal(parts[1].full, full[3:])
    dense = Marginals.dense(full).split([5, 2])
    assert dense[0].support is None and dense[0].on_support is dense[0].full


def test_native_top_k_gives_the_trees_of_torchs(monkeypatch):
    """The tree's candidates from castspec's C top-k (ties ranked by token id in C) and from torch's top-k (ties
    settled afterwards) give the same trees, scores to the bit: ties inside and across the k-th place, rows of
    -inf, shared and separate supports, caps, several requests."""
    if native.library() is None:
        pytest.skip("no native library here: both sides would be torch's top-k")
    g = torch.Generator().manual_seed(11)
    for trial in range(60):
        V, k = (5, 17, 300)[trial % 3], (1, 2, 8)[trial % 3 - 1]
        shared = torch.randperm(1000, generator=g)[:V] if trial % 4 else None
        lps, supports = [], []
        for r in range(1 + trial % 4):
            x = (torch.randint(-12, 0, (7, V), generator=g).float() / 4 if r % 2
                 else torch.randn(7, V, generator=g).bfloat16().float())
            if trial % 7 == 0:
                x[0, :V // 2] = -float("inf")
            lps.append(x)
            supports.append(shared if trial % 2 or shared is None else torch.randperm(1000, generator=g)[:V])
        caps = [3, 15, 63, 0][:len(lps)] if trial % 5 == 0 else None
        native_trees = build_forest(lps, (5, 15, 63, 200)[trial % 4], k, caps, supports)
        with monkeypatch.context() as m:
            m.setattr(native, "topk_rows", lambda *a, **kw: None)
            assert build_forest(lps, (5, 15, 63, 200)[trial % 4], k, caps, supports) == native_trees
