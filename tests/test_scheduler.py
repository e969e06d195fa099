"""Batched rounds and continuous batching: exactness whatever else is in the batch, allocation optimality,
ragged verify = per-request dense verify, admission/retirement, failure isolation."""
import itertools
import math
import threading

import pytest
import torch

from castspec.allocate import (DRAFTED_FIRST, PLAIN_FIRST, REFRESH_EVERY, REFRESH_ROUNDS, Chain, CostAware,
                               FixedWidth, PolicySpec, SharedBudget, UniformSplit, make_policy)
from castspec.round import run_round, warm_up
from castspec.config import DecodeConfig
from castspec.cost import BATCH_DRAFT_DEPTH, CostProfile, RoundWidth
from castspec.decode import decode
import castspec.serving.scheduler as scheduler_module
from castspec.serving.scheduler import QueueFull, Request, Scheduler, SchedulerConfig
from castspec.sequence import DraftState, Sequence
from castspec.tree import build_forest, build_tree
from conftest import llama_config, make_hf, native, qwen3_config, random_drafter, serve_all


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def models(request):
    cfg = llama_config(vocab=24) if request.param == "llama" else qwen3_config(vocab=24)
    target = native(make_hf(cfg, seed=1))
    return target, random_drafter(target, block_size=8, seed=2)


def ar(target, prompt, n):
    cfg = DecodeConfig(method="ar", max_new_tokens=n)
    return [t for chunk in decode(target, None, prompt, cfg) for t in chunk]


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 23, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def plain_rounds(policy, batch, ms, n=PLAIN_FIRST):
    """`n` plain rounds of `batch` requests in `ms` each, as a cost policy is told of them (under load it measures
    PLAIN_FIRST of them before it trusts the profile's price of drafting)."""
    for _ in range(n):
        policy.update(batch, ms, drafted=False)


def flat_profile(slope=0.0):
    packed = [1, 2, 4, 8, 16, 32, 64, 128]
    return CostProfile({}, packed, [0, 1024], [[10 + slope * n for n in packed]] * 2, [1.0, 1.0])


@pytest.mark.parametrize("policy", ["chain", "fixed", "uniform", "shared", "cost", "ar"])
def test_batched_greedy_equals_single_request_ar(models, policy):
    target, drafter = models
    ps = prompts(7, seed=3)
    lengths = [40, 17, 33, 1, 25, 40, 9]
    truth = [ar(target, p, n) for p, n in zip(ps, lengths)]
    method = "ar" if policy == "ar" else ("chain" if policy == "chain" else "cast")
    profile = flat_profile(0.05) if policy == "cost" else None
    cfg = SchedulerConfig(max_batch=4, max_queue=16, prefill_budget=11, policy=policy if policy != "ar" else "fixed",
                          width=24)
    sched = Scheduler(target, drafter, cfg, method=method, profile=profile)
    reqs = [(p, DecodeConfig(method=method, max_new_tokens=n)) for p, n in zip(ps, lengths)]
    outs, reasons = serve_all(sched, reqs, arrivals=[0, 0, 1, 3, 3, 8, 20])
    for i, t in enumerate(truth):
        assert outs[i] == t, (policy, i)
        assert reasons[i] == ("length", None)
    m = sched.metrics.snapshot()
    assert m["requests"]["length"] == 7 and m["tokens"] == sum(lengths)
    assert max(m["batch_size_histogram"]) <= 4


def test_stop_tokens_and_sampling_in_a_batch(models):
    target, drafter = models
    ps = prompts(4, seed=9)
    truth = ar(target, ps[0], 30)
    stop = truth[5]
    sched = Scheduler(target, drafter, SchedulerConfig(max_batch=4, policy="fixed", width=6))
    cfgs = [DecodeConfig(method="cast", max_new_tokens=30, stop_token_ids=(stop,)),
            DecodeConfig(method="cast", max_new_tokens=12, temperature=1.0, seed=4),
            DecodeConfig(method="cast", max_new_tokens=12, temperature=1.0, seed=4),
            DecodeConfig(method="cast", max_new_tokens=0)]
    outs, reasons = serve_all(sched, list(zip([ps[0], ps[1], ps[1], ps[2]], cfgs)), [0, 0, 2, 0])
    assert outs[0] == truth[:truth.index(stop) + 1] and reasons[0][0] == "stop"
    # a fixed width gives each request the same tree whatever the batch: the same seed, the same sample
    assert outs[1] == outs[2] and len(outs[1]) == 12
    assert outs[3] == [] and reasons[3][0] == "length"


def test_ragged_verify_logits_equal_per_request_dense_verify(models):
    target, drafter = models
    ps = prompts(3, seed=5)
    seqs = [Sequence(target, drafter, p, DecodeConfig(max_new_tokens=8), 16) for p in ps]
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        first = run_round(target, drafter, seqs, None, prefill_budget=1000)
        assert [len(o.emitted) for o in first.sequences] == [1, 1, 1] and first.prefill_tokens == sum(map(len, ps))
        trees = [build_tree(torch.log_softmax(torch.randn(7, 24, generator=g) * 3, -1), w, 3) for w in (5, 0, 16)]
        ids, pos, segs, dense = [], [], [], []
        for s, tree in zip(seqs, trees):
            pack, seg = s.verify_segment(tree)
            ids += pack.ids[0].tolist()
            pos += pack.positions[0].tolist()
            segs.append(seg)
            ref_cache = target.new_cache(s.cache.capacity)
            ref_cache.k.copy_(s.cache.k)
            ref_cache.v.copy_(s.cache.v)
            dense.append(target(pack.ids, pack.positions, ref_cache, s.prefix_len, mask=pack.mask)[0][0])
        ragged, _ = target.forward_segments(torch.tensor([ids]), torch.tensor([pos]), segs)
    torch.testing.assert_close(ragged[0], torch.cat(dense), rtol=1e-4, atol=1e-4)


def test_round_outputs_follow_the_input_order(models):
    target, drafter = models
    ps = prompts(3, seed=6)
    cfgs = [DecodeConfig(method="cast", max_new_tokens=8), DecodeConfig(method="cast", max_new_tokens=0),
            DecodeConfig(method="cast", max_new_tokens=8)]
    seqs = [Sequence(target, drafter, p, c, 16) for p, c in zip(ps, cfgs)]
    policy = FixedWidth(5, 3)
    with torch.inference_mode():
        first = run_round(target, drafter, seqs, policy, prefill_budget=1000)
        second = run_round(target, drafter, seqs, policy)
    # the finished sequence in the middle has an empty output at its own place
    assert [len(o.emitted) for o in first.sequences] == [1, 0, 1] and not any(o.verified for o in first.sequences)
    assert first.prefill_tokens == len(ps[0]) + len(ps[2])
    assert [o.verified for o in second.sequences] == [True, False, True] and second.packed == 2 * (1 + 5)
    for i in (0, 2):
        o = second.sequences[i]
        assert first.sequences[i].emitted + o.emitted == ar(target, ps[i], 8)[:1 + len(o.emitted)]
        # drafted min(L, remaining - 1, the policy's depth under load) = min(7, 6, 5) positions (a tree of 5
        # nodes is at most 5 deep); the policy's 5-node tree was verified
        assert o.draft_logprobs.shape[0] == 5 and len(o.tree) == 5 and o.accepted == len(o.path)
    assert second.sequences[1].emitted == [] and second.sequences[1].error is None


def test_one_factory_from_settings_to_policy():
    profile = flat_profile(0.05)
    L, K = 7, 3
    assert make_policy(PolicySpec("ar"), L) is None
    assert isinstance(make_policy(PolicySpec("chain"), L), Chain)  # chain ignores width, "auto" included
    assert isinstance(make_policy(PolicySpec("cast", "chain", 5), L), Chain)
    fixed = make_policy(PolicySpec("cast", "fixed", 7, K), L)
    assert isinstance(fixed, FixedWidth) and (fixed.width, fixed.top_k_per_position) == (7, K)
    assert isinstance(make_policy(PolicySpec("cast", "uniform", 12, K), L), UniformSplit)
    assert isinstance(make_policy(PolicySpec("cast", "shared", 12, K), L), SharedBudget)
    # width "auto" is the cost rule wherever it is asked for: one request's width, a batch's budget, "cost"
    for spec in (PolicySpec("cast", "fixed", "auto", K), PolicySpec("cast", "shared", "auto", K),
                 PolicySpec("cast", "cost", 15, K), PolicySpec.for_request(DecodeConfig(top_k_per_position=K)),
                 SchedulerConfig(top_k_per_position=K).policy_spec("cast")):
        assert spec.uses_cost
        policy = make_policy(spec, L, profile)
        assert isinstance(policy, CostAware) and policy.top_k_per_position == K
        assert policy.rule.max_width == profile.max_width == 127  # below the K=3, L=7 universe
        with pytest.raises(ValueError, match="cost profile"):
            make_policy(spec, L)
    assert make_policy(PolicySpec("cast", "fixed", "auto", 2), 3, profile).rule.max_width == 14  # 2 + 4 + 8
    assert not PolicySpec.for_request(DecodeConfig(method="chain")).uses_cost
    assert not SchedulerConfig(policy="shared", width=16).policy_spec("cast").uses_cost
    with pytest.raises(ValueError, match="uniform"):
        PolicySpec("cast", "uniform", "auto")
    with pytest.raises(ValueError, match="unknown allocation policy"):
        SchedulerConfig(policy="widest")
    with pytest.raises(ValueError, match="top_k_per_position"):
        SchedulerConfig(top_k_per_position=0)
    # the load tests' specs read through the same spec
    assert PolicySpec.parse("ar") == PolicySpec("ar", "fixed", 0)
    assert PolicySpec.parse("chain") == PolicySpec("chain", "chain", 0)
    assert PolicySpec.parse("cost").uses_cost and PolicySpec.parse("shared:32") == PolicySpec("cast", "shared", 32)
    for bad, match in (("fixed", "needs a width"), ("shared:x", "needs a width"), ("fixed:-1", "non-negative"),
                       ("widest", "unknown")):
        with pytest.raises(ValueError, match=match):
            PolicySpec.parse(bad)


def brute_force_best(logprobs, budget, top_k):
    """Max total mass over all prefix-closed allocations of `budget` nodes (enumerate per-request widths)."""
    best = -1.0
    for widths in itertools.product(range(budget + 1), repeat=len(logprobs)):
        if sum(widths) != budget:
            continue
        mass = sum(sum(torch.tensor(build_tree(lp, w, top_k).scores).exp().tolist()) for lp, w in zip(logprobs, widths))
        best = max(best, mass)
    return best


def test_shared_budget_allocation_is_the_brute_force_optimum():
    g = torch.Generator().manual_seed(1)
    for trial in range(6):
        lps = [torch.log_softmax(torch.randn(3, 6, generator=g) * (1 + trial), -1) for _ in range(3)]
        for budget in (1, 4, 7):
            trees = SharedBudget(budget, top_k_per_position=2).allocate(lps, [0, 0, 0])
            got = sum(sum(torch.tensor(t.scores).exp().tolist()) for t in trees)
            assert sum(len(t) for t in trees) == budget
            assert got == pytest.approx(brute_force_best(lps, budget, 2), rel=1e-6)
            uniform = UniformSplit(budget, top_k_per_position=2).allocate(lps, [0, 0, 0])
            assert got >= sum(sum(torch.tensor(t.scores).exp().tolist()) for t in uniform) - 1e-9


def test_batched_rounds_draft_as_deep_as_their_trees_reach():
    """Under load a drafted round reads BATCH_DRAFT_DEPTH positions of each block at first, then one more than
    the deepest tree of the last drafted round of about its batch (so the pass finishes no rows that no tree
    reads); fixed and shared budgets never read deeper than a tree of their size can be."""
    flat = CostAware(RoundWidth(flat_profile(0.0), 63, init_throughput=0.1))
    assert flat.draft_depth(16, 7) == BATCH_DRAFT_DEPTH
    sure = torch.full((2, 24), -30.0)
    sure[:, 0] = 0.0  # one certain token at each of two positions: trees two deep
    flat.allocate([sure, sure], [10, 10])
    assert flat.draft_depth(2, 7) == 3 and flat.draft_depth(16, 7) == BATCH_DRAFT_DEPTH  # 16: another bucket
    steep = CostAware(RoundWidth(flat_profile(10.0), 63, init_throughput=0.1))
    steep.allocate([sure[:1]] * 12, [10] * 12)  # no node pays: empty trees
    assert steep.draft_depth(12, 7) == 1
    assert FixedWidth(3).draft_depth(8, 7) == 3 and SharedBudget(40).draft_depth(8, 7) == 7
    assert UniformSplit(12).draft_depth(8, 7) == 2


def test_cost_rule_budget_follows_the_batched_cost():
    g = torch.Generator().manual_seed(2)
    lps = [torch.log_softmax(torch.randn(7, 24, generator=g) * 3, -1) for _ in range(4)]
    flat = CostAware(RoundWidth(flat_profile(0.0), 63, init_throughput=0.1))
    steep = CostAware(RoundWidth(flat_profile(10.0), 63, init_throughput=0.1))
    wide = flat.allocate(lps, [10] * 4)
    narrow = steep.allocate(lps, [10] * 4)
    assert sum(map(len, wide)) == 4 * 63  # flat cost: every request gets its cap
    assert sum(map(len, narrow)) == 0  # one packed token costs more than any node is worth
    # trees are heads of the global best-first forest (prefix-closed, best candidates first)
    mid = CostAware(RoundWidth(flat_profile(0.05), 63, init_throughput=0.1)).allocate(lps, [10] * 4)
    forest = build_forest(lps, 63 * 4, 8, [63] * 4)
    for t, f in zip(mid, forest):
        assert t.tokens == f.tokens[:len(t)]
    chosen = [s for t in mid for s in t.scores]
    rest = [s for t, f in zip(mid, forest) for s in f.scores[len(t):]]
    if chosen and rest:
        assert min(chosen) >= max(rest) - 1e-9


def test_queue_limit_and_cancellation(models):
    target, drafter = models
    sched = Scheduler(target, drafter, SchedulerConfig(max_batch=1, max_queue=2, policy="fixed", width=4))
    done = {}
    reqs = [Request([1, 2, 3], DecodeConfig(max_new_tokens=50), lambda t: None,
                    lambda r, e, i=i: done.setdefault(i, r)) for i in range(3)]
    sched.submit(reqs[0])
    sched.submit(reqs[1])
    with pytest.raises(QueueFull):
        sched.submit(reqs[2])
    sched.step()  # admits request 0 only (max_batch 1)
    assert sched.active == 1 and sched.queue_length == 1
    reqs[0].cancel()
    reqs[1].cancel()
    sched.step()
    sched.step()
    assert done == {0: "cancelled", 1: "cancelled"}
    assert sched.active == 0 and sched.queue_length == 0
    assert sched.metrics.snapshot()["rejected"] == 1


def test_the_round_hook_sees_every_round(models):
    target, drafter = models
    sched = Scheduler(target, drafter, SchedulerConfig(max_batch=2, policy="shared", width=8))
    seen = []
    sched.on_round = seen.append
    for p in prompts(3, seed=4):
        sched.submit(Request(p, DecodeConfig(max_new_tokens=6), lambda t: None, lambda r, e: None))
    while sched.step():
        pass
    assert len(seen) == sched.metrics.rounds and sum(o.prefill_tokens for o in seen) == sched.metrics.prefill_tokens
    assert sum(o.accepted + 1 for out in seen for o in out.sequences if o.verified) == sched.metrics.committed


def test_after_callbacks_hooks_follow_every_step_and_close_and_a_failing_one_stops_nothing(models):
    """What the HTTP server wakes its event loop with: every callback of a step (tokens, done) comes before the
    hooks of that step, and close() runs them after cancelling what is left; a hook that raises is logged."""
    target, drafter = models
    sched = Scheduler(target, drafter, SchedulerConfig(max_batch=2, policy="shared", width=8))
    log = []

    def broken():
        raise RuntimeError("injected hook failure")

    sched.after_callbacks += [broken, lambda: log.append("hook")]
    for i, p in enumerate(prompts(3, seed=5)):
        sched.submit(Request(p, DecodeConfig(max_new_tokens=4 if i < 2 else 50), lambda t: log.append("tokens"),
                             lambda r, e: log.append(r)))
    steps = 0
    while "length" not in log:
        assert sched.step()
        steps += 1
        assert log[-1] == "hook"  # this step's callbacks, then its hook
    assert log.count("hook") == steps and "tokens" in log[:log.index("hook")]
    log.clear()
    sched.close(threading.Event())
    assert log[-1] == "hook" and "cancelled" in log


def test_a_failing_request_does_not_take_down_the_batch(models, monkeypatch):
    target, drafter = models
    ps = prompts(3, seed=11)
    truth = [ar(target, p, 20) for p in ps]
    sched = Scheduler(target, drafter, SchedulerConfig(max_batch=3, policy="shared", width=12))
    outs = {i: [] for i in range(3)}
    reasons = {}
    for i, p in enumerate(ps):
        sched.submit(Request(p, DecodeConfig(max_new_tokens=20), outs[i].extend,
                             lambda r, e, i=i: reasons.setdefault(i, (r, e))))
    sched.step()
    sched.step()
    bad = sched._active[1].seq
    original = Sequence.verify_segment

    def broken(self, tree):
        if self is bad:
            raise RuntimeError("injected failure")
        return original(self, tree)

    monkeypatch.setattr(Sequence, "verify_segment", broken)
    for _ in range(200):
        if not sched.step():
            break
    assert reasons[1][0] == "error" and "injected failure" in reasons[1][1]
    assert outs[0] == truth[0] and outs[2] == truth[2]
    assert reasons[0] == ("length", None) and reasons[2] == ("length", None)


def test_cost_policy_stops_drafting_when_plain_rounds_are_faster():
    policy = CostAware(RoundWidth(flat_profile(0.0), 15, init_throughput=None), explore_every=4, min_drafted=3,
                       try_rounds=2)
    assert policy.should_draft()  # nothing measured yet
    policy.update(1, 200.0)  # the first drafted round (it also reads the prompt) is not an estimate
    assert policy.rule.lam is None and policy.draft_rate is None and policy.should_draft()
    policy.update(2, 40.0)  # drafted rounds at 0.05 tokens/ms, below the profile's 1 / 10 ms plain rate,
    assert policy.should_draft()  # but every request drafts its first min_drafted rounds
    policy.update(2, 40.0)
    decisions = []
    for _ in range(14):
        d = policy.should_draft()
        decisions.append(d)
        policy.update(1, 10.0, drafted=False) if not d else policy.update(2, 40.0)
    # after 4 plain rounds a burst of 2 drafted rounds; it loses, so the next burst waits 8 plain rounds
    assert decisions == [False] * 4 + [True] * 2 + [False] * 8
    assert policy.explore_every == 8 and policy.should_draft()
    policy.update(12, 40.0)
    policy.update(12, 40.0)  # the drafter starts paying: a burst at 0.3 tokens/ms lifts the estimate past 0.1
    assert policy.should_draft() and policy.explore_every == 4


@pytest.mark.parametrize("trace,confidence,drafts", [
    ([2, 1, 2, 1, 1], 1.0, True),  # a thin margin, an unlucky start: the estimate's error keeps it drafting
    ([2, 1, 2, 1, 1], 0.0, False),  # the estimate alone stops it
    ([1, 1, 2, 1, 1], 1.0, False),  # a drafter that clearly loses stops even with the margin
])
def test_cost_policy_keeps_drafting_while_its_estimate_is_uncertain(trace, confidence, drafts):
    # drafted rounds of 8.5 ms against 5.6 ms plain ones: drafting breaks even at 1.52 tokens a round, about what
    # a chat answer's drafted rounds commit; its first rounds commit less
    policy = CostAware(RoundWidth(flat_profile(0.0), 15, init_throughput=None), confidence=confidence)
    policy.update(2, 20.0)  # the first drafted round, left out
    for committed in trace:
        assert policy.should_draft()
        policy.update(committed, 8.5)
    policy.update(1, 5.6, drafted=False)  # the one plain round that measures the alternative
    assert policy.should_draft() == drafts


def test_cost_policy_keeps_its_back_off_after_a_try_that_wins_alone():
    # a burst that beats plain rounds on its own does not double the gap, even if the estimate stays below
    # (the estimate alone decides here: no margin for its standard error)
    policy = CostAware(RoundWidth(flat_profile(0.0), 15, init_throughput=None), explore_every=4, min_drafted=2,
                       try_rounds=1, confidence=0.0)
    policy.update(1, 200.0)
    policy.update(1, 100.0)  # 0.01 tokens/ms
    for _ in range(4):
        assert not policy.should_draft()
        policy.update(1, 10.0, drafted=False)  # plain: 0.1 tokens/ms
    assert policy.should_draft()
    policy.update(3, 25.0)  # 0.12 tokens/ms: the estimate rises to 0.065, still below plain
    assert not policy.should_draft() and policy.explore_every == 4


@pytest.mark.parametrize("batch_draft_ms,tries", [(100.0, False), (1.0, True)])
def test_cost_policy_skips_tries_the_profile_prices_out_under_load(batch_draft_ms, tries):
    # 16 requests: a plain round costs 20 ms; drafted rounds committed 1.5 tokens per request with one node each.
    # With a drafter pass for 16 blocks of 100 ms no try can pay (24 tokens in ~130 ms against 16 in 20): the
    # policy waits for its longest gap; with a 1 ms pass (24 tokens in ~30 ms) it tries as before (the exploration
    # budget aside: its own test)
    prof = flat_profile(0.0)
    prof.batch = {"16": {"packed": [16, 32, 64], "verify_ms": [20.0, 25.0, 35.0], "draft_ms": batch_draft_ms}}
    policy = CostAware(RoundWidth(prof, 15, init_throughput=None), explore_every=4, min_drafted=2, try_rounds=1,
                       max_explore_every=16, max_explore_loaded=16, explore_share=math.inf)
    assert policy.should_draft(1) and not policy.should_draft(16)  # under load a plain round is measured first
    plain_rounds(policy, 16, 20.0)
    assert policy.should_draft(16) == tries  # before any drafted round: PRIOR_ACCEPT
    policy.batch, policy.nodes = 2, 2  # the acceptance is measured on rounds of 2 requests, none of 16 yet
    policy.update(3, 200.0)  # warm-up round
    policy.update(3, 300.0)
    assert policy.request_tokens == pytest.approx(1.5) and policy.request_nodes == pytest.approx(1.0)
    assert policy.draft_could_pay(16) == tries and policy.draft_could_pay(1)
    drafted_after = []
    for plain_round in range(1, 17):
        assert not policy.should_draft(16)
        policy.update(16, 20.0, drafted=False)
        if policy.should_draft(16):
            drafted_after.append(plain_round)
            break
    assert drafted_after == ([4] if tries else [16])


@pytest.mark.parametrize("verify_32_ms,drafts", [(30.0, False), (25.0, True)])
def test_cost_policy_prior_under_load_pays_for_the_nodes_its_tokens_need(verify_32_ms, drafts):
    # before any drafted round, one node per request accepted half the time is assumed: 16 requests verify 32
    # rows and commit 24 tokens. At 30 ms for those rows (and 1 ms for the pass) that cannot beat plain rounds of
    # 16 in 20 ms; at 25 ms it can. With the nodes free it would look like 1.15x either way.
    prof = flat_profile(0.0)
    prof.batch = {"16": {"packed": [16, 32, 64], "verify_ms": [20.0, verify_32_ms, 80.0], "draft_ms": 1.0}}
    policy = CostAware(RoundWidth(prof, 15, init_throughput=None))
    assert not policy.should_draft(16) and policy.should_draft(1)  # under load a plain round is measured first
    plain_rounds(policy, 16, 20.0)
    assert policy.should_draft(16) == drafts


@pytest.mark.parametrize("single,batched,horizon,drafts", [(None, None, 16 * 20, False), (None, None, 16 * 48, True),
                                                           ([0.001, 0.001], 0.1, 16 * 20, False),
                                                           ([0.1, 0.1], 0.001, 16 * 20, True)])
def test_cost_policy_drafts_under_load_where_its_catch_up_is_repaid(single, batched, horizon, drafts):
    # 16 requests whose drafter has not read their prompts (1600 context rows). A drafted round as the profile
    # prices it pays: a pass of 1 ms and 32 rows verified in 22 ms for 24 tokens, against 16 in 20 ms (1.30x, ~0.29
    # ms saved a token). Fusing what the drafter has not read, the rows past a drafted round's own (16 blocks of 8),
    # costs 1472 rows at the batch's own price per context row, once: at 0.1 ms a row (147 ms) more than 16
    # requests save over their last 20 tokens each, less than over 48; at 0.001 ms it pays at once (one request's
    # price says nothing of 16's). A profile without prices per row prices a context row like a row of the probed
    # pass (1 ms / (8 block rows + 3): 134 ms).
    prof = flat_profile(0.0)
    prof.batch = {"16": {"packed": [16, 32, 64], "verify_ms": [20.0, 22.0, 80.0], "draft_ms": 1.0}}
    prof.draft_context_ms = single
    if batched is not None:
        prof.batch["16"]["draft_context_ms"] = batched
    policy = CostAware(RoundWidth(prof, 15, init_throughput=None), block_rows=8)
    plain_rounds(policy, 16, 20.0, PLAIN_FIRST - 1)
    assert not policy.should_draft(16, context_rows=16 * 3)  # a few plain rounds of 16 are measured first
    plain_rounds(policy, 16, 20.0, 1)
    assert policy.should_draft(16, context_rows=16 * 8, horizon=16)  # what drafted rounds fuse: no catch-up
    assert not policy.should_draft(16, context_rows=16 * 3, prefilling=True)  # the round also reads a prompt
    assert policy.should_draft(16, context_rows=1600, horizon=horizon) == drafts
    assert policy.should_draft(1, context_rows=1600, horizon=1)  # one request drafts its first rounds regardless


def test_cost_policy_measures_drafting_under_load_after_its_catch_up():
    # the round that fuses 16 prompts costs 100 ms for 24 tokens (0.3x plain rounds of 16 in 20 ms): it enters no
    # gain, and the next round drafts whatever the prices say, to measure drafting's own price: 24 tokens in 25 ms
    prof = flat_profile(0.0)
    prof.batch = {"16": {"packed": [16, 32, 64], "verify_ms": [20.0, 22.0, 80.0], "draft_ms": 1.0,
                         "draft_context_ms": 0.001}}
    policy = CostAware(RoundWidth(prof, 15, init_throughput=None), block_rows=8)
    plain_rounds(policy, 16, 20.0, PLAIN_FIRST)
    assert policy.should_draft(16, context_rows=1600, horizon=16 * 40)
    policy.batch, policy.nodes = 16, 16
    policy.update(24, 100.0)  # the catch-up
    assert not policy.gains
    prof.batch["16"]["verify_ms"] = [20.0, 300.0, 800.0]  # prices that say drafting cannot pay
    policy._pass_prices.clear()
    assert policy.should_draft(16, context_rows=16 * 2, horizon=16 * 39)
    policy.update(24, 25.0)
    assert policy.gains[16] == pytest.approx(24 / 25.0 / (16 / 20.0))
    assert policy.should_draft(16, context_rows=16 * 2, horizon=16 * 38)  # measured: 1.2x plain rounds


def test_cost_policy_prices_a_plain_round_from_a_measured_batch_of_its_bucket():
    # plain rounds of 16 measured at twice the profile's price: a round of 12 (same bucket, not measured) is
    # priced at the measured level with the profile's shape, and so is a round of 4 (another bucket) until a
    # batch of its own bucket has been measured
    prof = flat_profile(1.0)
    prof.batch = {"16": {"packed": [16, 32, 64], "verify_ms": [20.0, 30.0, 80.0], "draft_ms": 1.0}}
    policy = CostAware(RoundWidth(prof, 15, init_throughput=None))
    priced = {b: policy._batch_plain_rate(b) for b in (4, 12, 16)}
    plain_rounds(policy, 16, 2 * prof.plain_round_ms(16, 0.0))
    assert policy._batch_plain_rate(16) == pytest.approx(priced[16] / 2)
    assert policy._batch_plain_rate(12) == pytest.approx(priced[12] / 2)
    assert policy._batch_plain_rate(4) == pytest.approx(priced[4] / 2)  # another bucket: the nearest measured
    plain_rounds(policy, 3, prof.plain_round_ms(3, 0.0))  # 3-4 measured at the profile's level
    assert policy._batch_plain_rate(4) == pytest.approx(priced[4])  # its own bucket first


@pytest.mark.parametrize("drafted_ms,drafts,gaps", [(40.0, False, [16, 16, 16, 16]), (32.0, False, [4, 8, 16, 16]),
                                                     (25.0, True, None)])
def test_cost_policy_under_load_goes_by_drafted_rounds_measured_at_that_batch(drafted_ms, drafts, gaps):
    # the profile prices a pass for 16 blocks at 1 ms, so drafting looks like it pays at 16; measured, a drafted
    # round of 16 commits 24 tokens in `drafted_ms` against plain rounds of 16 in 20 ms (0.8 tokens/ms): a gain of
    # 0.75 / 0.94 / 1.2. Slow rounds of one request meanwhile make the rates over all batches say the opposite of
    # the batch's own. (The exploration budget aside: its own test.)
    prof = flat_profile(0.0)
    prof.batch = {"16": {"packed": [16, 32, 64], "verify_ms": [20.0, 25.0, 35.0], "draft_ms": 1.0}}
    policy = CostAware(RoundWidth(prof, 15, init_throughput=None), explore_every=4, min_drafted=2, try_rounds=1,
                       max_explore_every=16, max_explore_loaded=16, explore_share=math.inf)
    plain_rounds(policy, 16, 20.0)
    assert policy.should_draft(16)
    policy.batch, policy.nodes = 16, 16
    for _ in range(DRAFTED_FIRST):  # under load the first drafted round counts too; a few before they decide
        assert policy.should_draft(16)
        policy.update(24, drafted_ms)
    assert policy.draft_could_pay(16) == drafts and policy.should_draft(12) == drafts  # 9-16 measured together
    policy.batch = 1
    policy.update(2, 100.0 if drafts else 2.0)  # one request's drafted rounds: far slower / faster than plain
    if drafts:  # winning at 16 it keeps drafting
        assert all(policy.should_draft(16) for _ in range(17))
        return
    # losing at 16 by little (within TRY_GAIN): a try after explore_every plain rounds, the gap doubling after each
    # try that loses, up to max_explore_loaded (a gain measured near 1 may be a slow moment of the machine); by
    # more, a try only after the longest gap
    seen = []
    for _ in range(4):
        gap = 0
        while not policy.should_draft(16):
            policy.update(16, 20.0, drafted=False)
            gap += 1
        seen.append(gap)
        policy.batch = 16
        policy.update(24, drafted_ms)  # the try loses again
    assert seen == gaps


@pytest.mark.parametrize("slope,drafts", [(1.0, False), (0.0, True)])
def test_cost_policy_prices_a_batched_pass_from_one_request_without_batched_shapes(slope, drafts):
    # no batched shapes in the profile: a pass for 16 blocks of 16 rows is priced as the single pass (5 ms)
    # scaled the way this device's verify grows from 16 rows to 256. Where each row costs 1 ms of compute that
    # is ~51 ms, so 2 tokens a request cannot beat a plain round of 16 (26 ms); where a forward is flat the
    # pass stays 5 ms against a 10 ms plain round, and drafting is tried as before
    packed = [1, 2, 4, 8, 16, 32, 64, 128]
    prof = CostProfile({}, packed, [0, 1024], [[10 + slope * n for n in packed]] * 2, [5.0, 5.0])
    assert prof.batch_draft_at(16, 0.0) is None
    assert prof.batch_draft_at(16, 0.0, 16) == pytest.approx(5 * prof.verify_at(256, 0.0) / prof.verify_at(16, 0.0))
    assert prof.batch_draft_at(1, 0.0, 16) == prof.draft_at(0.0)
    policy = CostAware(RoundWidth(prof, 15, init_throughput=None), block_rows=16)
    plain_rounds(policy, 16, prof.plain_round_ms(16, 0.0))
    assert policy.should_draft(1) and policy.should_draft(16) == drafts
    assert make_policy(PolicySpec.parse("cost"), 15, prof).block_rows == 16


def test_pending_features_join_in_order_when_read(models):
    # rounds that do not draft append their features; the drafter reads them joined, in order
    state = DraftState(models[1], 64)
    assert state.pending is None
    chunks = [torch.randn(1, n, 8) for n in (5, 1, 2)]
    for c in chunks:
        state.add_context(c)
    assert state.pending_rows == 8 and len(state._chunks) == 3  # counted without joining them
    assert torch.equal(state.pending, torch.cat(chunks, dim=1)) and torch.equal(state.pending, torch.cat(chunks, dim=1))
    state.pending = chunks[0][:, 2:]
    state.add_context(chunks[1])
    assert torch.equal(state.pending, torch.cat([chunks[0][:, 2:], chunks[1]], dim=1)) and state.pending_rows == 4
    state.pending = None
    assert state.pending is None and state.pending_rows == 0
    # a round's rollback restores the cache length and the pending chunks, which a snapshot does not join
    state.add_context(chunks[0])
    state.add_context(chunks[1])
    snap = state.snapshot()
    assert len(state._chunks) == 2
    state.add_context(chunks[2])
    state.cache.length = 7
    state.restore(snap)
    assert state.cache.length == 0 and torch.equal(state.pending, torch.cat(chunks[:2], dim=1))
    assert state.pending_rows == 6


def test_cost_policy_measures_a_plain_round_before_trusting_the_profile():
    # a profile probed on a busy machine: plain steps look 10x slower than they are
    slow = CostProfile({}, [1, 2, 4], [0, 1024], [[100.0, 100.0, 100.0]] * 2, [1.0, 1.0])
    policy = CostAware(RoundWidth(slow, 15, init_throughput=None), explore_every=4, min_drafted=2)
    assert policy.should_draft()
    policy.update(1, 200.0)  # warm-up round, left out
    policy.update(2, 40.0)  # 0.05 tokens/ms: better than the profile's plain guess (0.01), worse than reality
    assert not policy.should_draft()  # so one plain round is measured before the guess is trusted
    policy.update(1, 10.0, drafted=False)  # 0.1 tokens/ms
    assert [policy.should_draft() or policy.update(1, 10.0, drafted=False) for _ in range(2)] == [None] * 2


def test_cost_policy_keeps_a_drafter_that_wins_on_average_through_bad_runs():
    # committed tokens of drafted rounds (37 ms each) like those on a held-out math prompt, against 28 ms plain
    # rounds: 1.73 tokens per round on average, i.e. drafting wins by 31%, with a run of single-token rounds
    trace = [2, 3, 2, 2, 2, 2, 1, 3, 1, 2, 2, 2, 2, 1, 2, 1, 1, 1, 1, 1, 3, 2, 1, 2, 3, 2, 1, 1, 1, 2]
    policy = CostAware(RoundWidth(flat_profile(0.0), 15, init_throughput=None), explore_every=8)
    policy.update(2, 60.0)  # warm-up round
    policy.update(2, 37.0)
    policy.update(1, 28.0, drafted=False)  # the one plain round that measures the alternative
    for committed in trace:
        assert policy.should_draft()
        policy.update(committed, 37.0)
    # the width rule's own (short) estimate did dip below plain rounds: it alone would have stopped drafting
    lam = None
    for committed in [2] + trace:
        rate = committed / 37.0
        lam = rate if lam is None else 0.8 * lam + 0.2 * rate
        if lam < 1 / 28.0:
            break
    assert lam < 1 / 28.0


def test_cost_policy_counts_request_rounds_under_load():
    # 16 requests per round: the burn-in and a try each take one round, not 6 and 3. Drafting measured losing
    # at 16 by far more than TRY_GAIN, a try comes after the longest gap (max_explore_loaded plain rounds), and
    # the gap doubles when it loses (the exploration budget aside: its own test)
    policy = CostAware(RoundWidth(flat_profile(0.0), 15, init_throughput=None), explore_every=4,
                       max_explore_every=8, max_explore_loaded=8, explore_share=math.inf)
    policy.batch = 16  # what allocate() records for a round of 16 drafting requests
    policy.update(16, 200.0)  # warm-up round
    policy.update(16, 400.0)  # 0.04 tokens/ms against plain rounds of 16 tokens in 10 ms
    assert not policy.should_draft(16)  # burn-in done after one round of 16: measure plain rounds
    plain_rounds(policy, 16, 10.0)
    while policy.gains_seen[16] < DRAFTED_FIRST:  # and a few drafted ones before their gain decides
        assert policy.should_draft(16)
        policy.update(16, 400.0)
    for _ in range(8):
        assert not policy.should_draft(16)
        policy.update(16, 10.0, drafted=False)
    assert policy.should_draft(16)  # a try
    policy.update(16, 400.0)
    assert not policy.should_draft(16) and policy.explore_every == 8  # one round of 16 was the whole try


def test_cost_policy_counts_only_the_drafting_requests_tokens_as_theirs():
    # 8 requests verified, 3 of them drafting (the others in their last round): 12 tokens committed are 7 for the
    # three (2.33 each) and 1 each for the five; the round is measured against plain rounds of all 8 (10 ms)
    prof = flat_profile(0.0)
    prof.batch = {"8": {"packed": [8, 16, 32], "verify_ms": [10.0, 14.0, 20.0], "draft_ms": 1.0}}
    policy = CostAware(RoundWidth(prof, 15, init_throughput=None))
    plain_rounds(policy, 8, 10.0)
    policy.batch, policy.nodes = 3, 6
    policy.update(12, 15.0, requests=8)
    assert policy.request_tokens == pytest.approx(7 / 3) and policy.request_nodes == pytest.approx(2.0)
    assert policy.gains[4] == pytest.approx((12 / 0.8) / 15.0)  # keyed by the drafting requests' bucket
    assert policy.explore_lost_ms == pytest.approx(15.0 - 12 / 0.8)


def test_cost_policy_under_load_measures_its_plain_rounds_again_while_it_drafts():
    # the first plain rounds of 16 ran slow (20 ms: a load's start); drafted rounds of 16 commit 24 tokens in 25 ms,
    # 1.2x that stale rate, but plain rounds now take 15 ms (drafting loses: 0.96 tokens/ms against 1.07). While
    # the bucket drafts, every REFRESH_EVERY drafted rounds it runs REFRESH_ROUNDS plain ones, and drafting stops
    # once the plain rate measured again says it loses (without the plain rounds it would draft to the end)
    prof = flat_profile(0.0)
    prof.batch = {"16": {"packed": [16, 32, 64], "verify_ms": [20.0, 25.0, 35.0], "draft_ms": 1.0}}
    policy = CostAware(RoundWidth(prof, 15, init_throughput=None), explore_every=4, max_explore_loaded=1000,
                       explore_share=0.0)
    plain_rounds(policy, 16, 20.0)
    decisions = []
    for _ in range(3 * REFRESH_EVERY):
        d = policy.should_draft(16)
        decisions.append(d)
        if d:
            policy.batch, policy.nodes = 16, 16
            policy.update(24, 25.0)
        else:
            policy.update(16, 15.0, drafted=False)
    first_plain = decisions.index(False)
    assert all(decisions[:first_plain]) and first_plain == REFRESH_EVERY
    assert decisions[first_plain:first_plain + REFRESH_ROUNDS] == [False] * REFRESH_ROUNDS
    # measured again, drafting loses: it stops within a few rounds (its gain an average), then tries now and then
    assert policy.gains[16] < 1.0 and sum(decisions[-REFRESH_EVERY:]) <= 2


@pytest.mark.parametrize("share", [0.02, 0.05])
def test_cost_policy_under_load_loses_at_most_its_exploration_share_to_tries(share):
    # drafted rounds of 16 commit 24 tokens in 32 ms against plain rounds of 16 in 20 ms (a gain of 0.94: within
    # TRY_GAIN, so tries keep coming), and each try's first round also fuses the context its requests gathered
    # since the last one (60 ms). Without a budget its tries lose ~8% of the time served; with one, what they lose
    # stays within the share (give or take the try that crossed it), and they still come now and then
    prof = flat_profile(0.0)
    prof.batch = {"16": {"packed": [16, 32, 64], "verify_ms": [20.0, 25.0, 35.0], "draft_ms": 1.0}}

    def serve(explore_share: float) -> tuple[float, float, int]:
        policy = CostAware(RoundWidth(prof, 15, init_throughput=None), explore_every=4, max_explore_every=16,
                           max_explore_loaded=16, explore_share=explore_share)
        plain_rounds(policy, 16, 20.0)
        ms = lost = 0.0
        tries, drafted_last = 0, True
        for _ in range(3000):
            if policy.should_draft(16):
                round_ms = 32.0 if drafted_last else 60.0
                tries += not drafted_last
                policy.batch, policy.nodes = 16, 16
                policy.update(24, round_ms)
                ms, lost, drafted_last = ms + round_ms, lost + round_ms - 24 / 0.8, True
            else:
                policy.update(16, 20.0, drafted=False)
                ms, drafted_last = ms + 20.0, False
        return lost, ms, tries

    lost, ms, tries = serve(math.inf)
    assert lost > 0.06 * ms and tries > 100
    lost, ms, tries = serve(share)
    assert lost <= share * ms + 60.0 and tries >= 10


class Recording(FixedWidth):
    """A fixed-width policy that keeps every update it gets."""

    def __init__(self):
        super().__init__(3, 2)
        self.updates = []

    def update(self, committed, round_ms, drafted=True, requests=None):
        self.updates.append(committed)


def test_a_round_that_also_prefills_a_newcomer_gives_the_policy_no_update(models):
    target, drafter = models
    a, b = prompts(2, seed=9)
    policy = Recording()
    old = Sequence(target, drafter, a, DecodeConfig(method="cast", max_new_tokens=8), 16)
    with torch.inference_mode():
        run_round(target, drafter, [old], policy)  # its prefill: nothing verified
        run_round(target, drafter, [old], policy)  # a plain verify round: one update
        assert len(policy.updates) == 1
        new = Sequence(target, drafter, b, DecodeConfig(method="cast", max_new_tokens=8), 16)
        mixed = run_round(target, drafter, [old, new], policy)  # old verifies while new reads its prompt
        assert mixed.sequences[0].verified and mixed.prefill_tokens == len(b)
        assert len(policy.updates) == 1
        run_round(target, drafter, [old, new], policy)
        assert len(policy.updates) == 2


@pytest.mark.parametrize("fails", [False, True])
def test_the_serving_thread_warms_up_first_and_serves_even_if_that_fails(models, monkeypatch, fails):
    """Scheduler.run warms the models up on its own thread before serving (round.warm_up, on scratch caches of
    its own); a warm-up that fails is logged and the requests are served all the same."""
    target, drafter = models
    calls = []

    def observed(t, d):
        calls.append(threading.current_thread().name)
        if fails:
            raise RuntimeError("injected warm-up failure")
        warm_up(t, d)

    monkeypatch.setattr(scheduler_module, "warm_up", observed)
    sched = Scheduler(target, drafter, SchedulerConfig(max_batch=2, policy="cost"), profile=flat_profile(0.05))
    p = prompts(1, seed=5)[0]
    done = threading.Event()
    out = []
    stop = sched.start()
    try:
        sched.submit(Request(p, DecodeConfig(max_new_tokens=12), out.extend, lambda r, e: done.set()))
        assert done.wait(timeout=60)
    finally:
        sched.close(stop)
    assert calls == ["castspec-scheduler"]
    assert out == ar(target, p, 12)

