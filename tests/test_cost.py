"""Width rules on synthetic cost tables and mass curves with known answers; the probe; width="auto"."""
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from castspec import allocate
from castspec.allocate import PolicySpec, make_policy
from castspec.config import DecodeConfig
from castspec.cost import (Calibration, CostProfile, RoundWidth, least_slopes, monotone, throughput, width_affine,
                           width_table)
from castspec.decode import DecodeStats, decode
from castspec.engine import Engine
from castspec.cli.probe import floor_table
from castspec.floor import Floors, draft_cost, prefill_cost, verify_cost
from castspec.probe import DRAFT_CONTEXT_ROWS, _medians_ms, plot_profile, probe, probe_batch
from castspec.serving.scheduler import SchedulerConfig
from conftest import llama_config, make_hf, native, random_drafter

PACKED = [1, 2, 4, 8, 16, 32, 64, 128]


def profile_from(verify):
    return CostProfile({"device": "test"}, PACKED, [100], [[float(verify(n)) for n in PACKED]], [2.0],
                       {str(n - 1): 0.0 for n in PACKED})


def masses(n=127, decay=0.06):
    return 0.9 * np.exp(-decay * np.arange(n))  # sorted, slowly decaying prefix masses


def test_flat_cost_picks_the_widest_tree():
    prof = profile_from(lambda n: 10.0)
    assert width_table(masses(), prof, 100, 127) == 127
    assert width_affine(masses(), prof, 100, 127) == 127


def test_steep_cost_picks_the_chain_end():
    prof = profile_from(lambda n: 10.0 * n)  # every packed token costs a whole AR step: no room for a tree
    assert width_table(masses(), prof, 100, 127) <= 1
    assert width_affine(masses(), prof, 100, 127) <= 1


def test_cliff_stops_before_it():
    prof = profile_from(lambda n: 10.0 if n <= 16 else 30.0)  # a kernel/tile boundary after 16 packed tokens
    n_table = width_table(masses(decay=0.2), prof, 100, 127)
    assert n_table == 15
    # the affine fit smears the cliff into a slope and lands elsewhere: the table rule is what handles it
    assert width_affine(masses(decay=0.2), prof, 100, 127) != 15


@settings(max_examples=50, deadline=None)
@given(c0=st.floats(1, 50), c1=st.floats(0.0, 5), decay=st.floats(0.01, 2), head=st.floats(0.05, 1.0))
def test_throughput_is_unimodal_and_the_marginal_rule_finds_its_peak(c0, c1, decay, head):
    """Theorem 2: concave g (sorted masses) and affine cost -> unimodal throughput; stopping at the first failure
    of rho_(N+1) >= thr(N) * c1 reaches the maximum."""
    m = head * np.exp(-decay * np.arange(127))
    table = c0 + c1 * np.arange(1, 129)[:128]
    thr = throughput(m, table)
    peak = int(np.argmax(thr))
    diffs = np.diff(thr)
    assert np.all(diffs[:peak] >= -1e-12) and np.all(diffs[peak:] <= 1e-12)
    g, n = 0.0, 0
    while n < 127 and m[n] >= (g + 1) / table[n] * c1:
        g += m[n]
        n += 1
    assert abs(thr[n] - thr[peak]) <= 1e-9 * thr[peak]


def test_round_rule_uses_marginal_cost_and_running_throughput():
    prof = profile_from(lambda n: 10.0 if n <= 8 else 10.0 + (n - 8))
    rule = RoundWidth(prof, max_width=127, init_throughput=0.2)
    scores = np.log(masses(decay=0.1)).tolist()
    n = rule.choose(scores, [1] * 127, 100)
    m = np.exp(scores)
    # free nodes (flat region) are always taken; paid nodes only while mass >= lambda * 1 ms
    assert n >= 7 and np.all(m[7:n] >= 0.2) and (n == 127 or m[n] < 0.2)
    rule.update(committed=4, round_ms=10.0)
    assert 0.2 < rule.lam < 0.4


def test_round_rule_pays_a_cost_step_for_the_whole_tree():
    # the first extra packed row costs 3 ms, the next six nothing: no single node of mass 0.1 pays 3 ms at
    # 0.045 tokens/ms, but seven of them do (0.7 tokens for 3 ms); past 8 rows each costs 2.5 ms (0.11 tokens)
    prof = profile_from(lambda n: 27.0 if n == 1 else (30.0 if n <= 8 else 30.0 + 2.5 * (n - 8)))
    rule = RoundWidth(prof, max_width=31, init_throughput=0.045)
    scores = np.log(np.full(31, 0.1)).tolist()
    assert rule.choose(scores, [1] * 31, 100) == 7
    assert rule.choose(np.log(np.full(31, 0.01)).tolist(), [1] * 31, 100) == 0  # 0.07 tokens do not pay 3 ms


# 16 requests with 64 candidates of mass 0.6 each at depths 1..64, prefix 100: RoundWidth.allocate's arguments
SIXTEEN_CONFIDENT = ([np.log(np.full(64, 0.6)).tolist()] * 16, [list(range(1, 65))] * 16, [100] * 16)


def test_costs_past_the_probe_keep_rising_and_a_batch_of_trees_pays_for_them():
    # probed up to 128 packed tokens, costing 10 ms + 0.5 ms per row past 8 (no batched shapes probed)
    prof = profile_from(lambda n: 10.0 if n <= 8 else 10.0 + 0.5 * (n - 8))
    assert prof.verify_at(1024, 100) == pytest.approx(10.0 + 0.5 * 1016)
    assert prof.batch_verify_at(16, 1024, 100) == prof.verify_at(1024, 100)
    assert prof.verify_at(48, 100) == pytest.approx(30.0)  # inside the probe: interpolation as before
    # 16 requests with 64 confident candidates each (mass 0.6): at ~1 token/ms a node must pay its 0.5 ms,
    # and 16 x 64 nodes cost 522 ms of verify (a clamped cost, 70 ms for any total past 128, took them all at
    # any throughput)
    taken = RoundWidth(prof, max_width=64, init_throughput=1.0).allocate(*SIXTEEN_CONFIDENT)
    assert sum(taken) == 16 * 64  # each pays 0.6 tokens for 0.5 ms: worth it at 1 token/ms
    taken = RoundWidth(prof, max_width=64, init_throughput=1.5).allocate(*SIXTEEN_CONFIDENT)
    assert sum(taken) == 0  # 0.6 tokens for 0.5 ms is not worth it at 1.5 tokens/ms, however many


def test_a_known_plain_rate_bounds_lambda_from_below():
    # nodes of mass 0.6 at 0.5 ms each pay at the drafted rate (1 token/ms) but not against plain rounds that
    # commit 1.5 tokens/ms: the round takes none of them then
    prof = profile_from(lambda n: 10.0 if n <= 8 else 10.0 + 0.5 * (n - 8))
    rule = RoundWidth(prof, max_width=64, init_throughput=1.0)
    assert sum(rule.allocate(*SIXTEEN_CONFIDENT)) == 16 * 64
    assert sum(rule.allocate(*SIXTEEN_CONFIDENT, min_throughput=1.5)) == 0
    assert sum(rule.allocate(*SIXTEEN_CONFIDENT, min_throughput=0.5)) == 16 * 64  # a lower rate: lambda as it was


def _batched_profile():
    """A profile with batched shapes: one request's verify flat to 8 rows, then 0.4 ms per row; batches dearer."""
    prof = profile_from(lambda n: 10.0 if n <= 8 else 10.0 + 0.4 * (n - 8))
    prof.host_ms = {"0": 0.1, "15": 0.3, "63": 0.6}
    for b in (2, 4, 16):
        prof.batch[str(b)] = {"packed": [b, 4 * b, 16 * b], "verify_ms": [10.0 + b, 12.0 + 1.5 * b, 14.0 + 7.0 * b],
                              "draft_ms": 1.0}
    return prof


def test_the_verify_table_is_the_pointwise_costs_at_once():
    prof = _batched_profile()
    for batch, prefix in [(1, 100), (3, 60), (16, 250), (20, 100)]:
        table = prof.verify_table(40 * batch, prefix, batch)
        pointwise = np.maximum.accumulate([prof.batch_host_at(batch, w) + prof.batch_verify_at(batch, w + batch, prefix)
                                           for w in range(40 * batch + 1)])
        np.testing.assert_allclose(table, pointwise, rtol=1e-12)
        assert isinstance(prof.verify_at(37, prefix), float) and isinstance(prof.host_at(7), float)


def test_a_batch_below_the_smallest_probed_lies_between_one_request_and_that_batch():
    prof = _batched_profile()
    del prof.batch["2"], prof.batch["4"]  # only batch 16 probed: 16 rows cost 26 ms, one request's 4 rows 10 ms
    four = prof.batch_verify_at(4, 4, 100)
    assert four == pytest.approx(10.0 + (26.0 - 10.0) * 3 / 15)  # not batch 16's 26 ms for 4 requests' roots
    assert prof.batch_verify_at(16, 16, 100) == pytest.approx(26.0)


def test_host_work_of_a_batch_is_each_request_s_own():
    prof = _batched_profile()  # one request: 0.1 ms without a tree, 0.3 ms for 15 nodes
    assert prof.batch_host_at(1, 15) == prof.host_at(15)
    assert prof.batch_host_at(16, 16 * 15) == pytest.approx(16 * 0.3)
    assert prof.batch_host_at(16, 0) == pytest.approx(16 * 0.1)
    np.testing.assert_allclose(prof.batch_host_at(4, np.array([0, 60])), [0.4, 1.2])
    assert prof.plain_round_ms(16, 100) == pytest.approx(prof.batch_verify_at(16, 16, 100) + 1.6)


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_a_batched_round_builds_only_the_nodes_that_can_pay(batch, monkeypatch):
    """The cost policy's early stop (RoundWidth.stop_rule) ends the best-first selection once no further node can
    pay: the same trees as selecting every candidate and cutting after, from far fewer nodes under load."""
    prof = _batched_profile()
    g = torch.Generator().manual_seed(batch)
    lps = [torch.log_softmax(torch.randn(8, 40, generator=g) * 3, dim=-1) for _ in range(batch)]
    spec = PolicySpec.for_request(DecodeConfig(method="cast", width="auto"))
    selected = []  # the trees build_forest returned, before the rule cut them
    real = allocate.build_forest
    monkeypatch.setattr(allocate, "build_forest", lambda *a, **k: selected.append(real(*a, **k)) or selected[-1])
    # (lambda, the plain rounds' rate); before lambda is measured the plain rate alone bounds what pays
    for lam, plain in ((0.05, 0.025), (0.3, 0.15), (1.0, 0.5), (None, 0.3)):
        fast, full = make_policy(spec, 8, prof), make_policy(spec, 8, prof)
        full.rule.stop_rule = lambda *a, **k: None
        trees = []
        for pol in (fast, full):
            pol.rule.lam, pol.plain_rate = lam, plain
            trees.append(pol.allocate(lps, [100] * batch))
        assert trees[0] == trees[1], lam
        examined, everything = (sum(len(t) for t in forest) for forest in selected[-2:])
        assert examined <= everything
        if batch == 16 and plain >= 0.15:  # few nodes pay: the selection stops long before 16 whole trees
            assert examined < everything / 2


def test_profile_round_trip(tmp_path):
    prof = profile_from(lambda n: 1.0 + n)
    prof.floor = {"read_gbps": 30.0, "gemm_gflops": 400.0, "verify_floor_ms": [[1.0] * len(PACKED)],
                  "verify_ratio": [[2.0 + n for n in PACKED]], "draft_floor_ms": [0.5], "draft_ratio": [4.0]}
    prof.save(tmp_path / "p.json")
    again = CostProfile.load(tmp_path / "p.json")
    assert again == prof and again.round_ms(15, 100) == prof.round_ms(15, 100)


def test_a_profile_written_before_floors_still_loads(tmp_path):
    old = {"key": {"device": "test"}, "packed": [1, 8], "prefix_lens": [100], "verify_ms": [[10.0, 12.0]],
           "draft_ms": [2.0], "host_ms": {"0": 0.1, "7": 0.3}, "batch": {}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    prof = CostProfile.load(tmp_path / "old.json")
    assert prof.floor is None and prof.round_ms(7, 100) == pytest.approx(2.0 + 0.3 + 12.0)
    assert prof.draft_context_ms is None and prof.context_row_ms(100, 1, block_rows=8) == pytest.approx(2.0 / 11)
    # and one written by a newer version: what this one does not know is left out
    (tmp_path / "new.json").write_text(json.dumps({**old, "a_later_field": [1.0]}))
    assert CostProfile.load(tmp_path / "new.json") == prof


def test_calibration_learns_observed_acceptance():
    cal = Calibration(depths=4, bins=6)
    rng = np.random.default_rng(0)
    pred = rng.uniform(0.05, 0.5, 4000)
    hit = rng.uniform(size=4000) < np.minimum(2 * pred, 1)  # the drafter is under-confident by 2x
    cal.observe(np.full(4000, 2), pred, hit)
    out = cal.apply([2, 2], [0.1, 0.3])
    assert 0.15 < out[0] < 0.25 and 0.45 < out[1] < 0.7
    assert cal.apply([3], [0.2])[0] == pytest.approx(0.2)  # unseen bins keep the raw mass


def test_the_probe_times_its_shapes_in_turn_not_one_after_another():
    calls = []
    medians = _medians_ms([lambda: calls.append("a"), lambda: calls.append("b")], reps=3, warmup=1,
                          device=torch.device("cpu"))
    assert calls == ["a", "b"] * 4 and len(medians) == 2 and all(m >= 0 for m in medians)
    # what precedes a call in decoding (a verify before a drafter pass) runs before every timed call, untimed
    calls.clear()
    _medians_ms([lambda: calls.append("a"), lambda: calls.append("b")], reps=2, warmup=1,
                device=torch.device("cpu"), between=lambda: calls.append("v"))
    assert calls == ["a", "b"] + ["v", "a", "v", "b"] * 2


def test_probe_and_auto_width_stay_exact_and_inside_the_universe(tmp_path, monkeypatch):
    monkeypatch.setenv("CASTSPEC_CACHE", str(tmp_path))
    target = native(make_hf(llama_config(vocab=24), seed=1))
    drafter = random_drafter(target, block_size=4)
    engine = Engine(target, None, drafter, source="tiny", drafter_source="tiny-drafter")
    prof = probe(engine, packed=(1, 2, 4, 8, 16), prefix_lens=(8, 32), reps=2, warmup=1, progress=False)
    assert len(prof.verify_ms) == 2 and len(prof.verify_ms[0]) == 5 and all(v > 0 for v in prof.verify_ms[0])
    assert set(prof.host_ms) == {"0", "1", "3", "7", "15"} and prof.draft_ms[0] > 0
    # what a pending context row adds to a drafter pass, per prefix (timed: noise may put it at 0, never below)
    assert len(prof.draft_context_ms) == 2 and all(c >= 0 for c in prof.draft_context_ms)
    # every shape's floor, at rates measured in the same run, and measured / floor
    fl = prof.floor
    assert fl["read_gbps"] > 0 and fl["gemm_gflops"] > 0
    floors = Floors(fl["read_gbps"], fl["gemm_gflops"])
    for i, P in enumerate(prof.prefix_lens):
        assert fl["verify_floor_ms"][i] == [verify_cost(target, n, P).floor_ms(floors) for n in prof.packed]
        pairs = zip(prof.verify_ms[i], fl["verify_floor_ms"][i])
        assert fl["verify_ratio"][i] == pytest.approx([m / f for m, f in pairs])
        # verify(n) / verify(1) measured and at the floor (n rows never need less than one row's weight read)
        assert fl["verify_over_one_row"][i] == pytest.approx([m / prof.verify_ms[i][0] for m in prof.verify_ms[i]])
        floor_over = fl["verify_floor_over_one_row"][i]
        assert floor_over[0] == 1.0 and all(b >= a for a, b in zip(floor_over, floor_over[1:]))
        draft_floor = draft_cost(drafter, target, P, ctx_rows=DRAFT_CONTEXT_ROWS).floor_ms(floors)
        assert fl["draft_floor_ms"][i] == draft_floor > 0
        assert fl["draft_ratio"][i] == pytest.approx(prof.draft_ms[i] / fl["draft_floor_ms"][i])
        # the pass over the 1-row verify timed before it in the same loop, and the floor's ratio of the two
        assert prof.draft_step_ms[i] > 0
        assert fl["draft_over_one_row"][i] == pytest.approx(prof.draft_ms[i] / prof.draft_step_ms[i])
        assert fl["draft_floor_over_one_row"][i] == pytest.approx(draft_floor / fl["verify_floor_ms"][i][0])
        # a prompt of P tokens read in one round, with its floor
        assert prof.prefill_ms[i] > 0 and fl["prefill_floor_ms"][i] == prefill_cost(target, P).floor_ms(floors)
        assert fl["prefill_ratio"][i] == pytest.approx(prof.prefill_ms[i] / fl["prefill_floor_ms"][i])
    assert all(f > 0 for row in fl["verify_floor_ms"] for f in row)
    probe_batch(engine, prof, batch_sizes=(2, 3), per_request=(1, 4), prefix=8, reps=1, warmup=0, progress=False)
    # one request's one-node tree behind the other roots (B + 1) beside B x n: where a round's first node steps
    assert prof.batch["3"]["packed"] == [3, 4, 12] and all(v > 0 for v in prof.batch["3"]["verify_ms"])
    assert prof.batch["3"]["draft_context_ms"] >= 0 and prof.context_row_ms(8, 3) >= 0
    assert prof.batch["2"]["draft_ms"] > 0
    entry = prof.batch["3"]
    assert entry["verify_floor_ms"] == [verify_cost(target, n, 8, 3).floor_ms(floors) for n in (1, 4 / 3, 4)]
    assert entry["verify_ratio"] == pytest.approx([m / f for m, f in zip(entry["verify_ms"], entry["verify_floor_ms"])])
    assert entry["draft_ratio"] == pytest.approx(entry["draft_ms"] / entry["draft_floor_ms"])
    table = floor_table(prof)
    assert "batch 3 verify 12" in table and "prompt of 32" in table and "over 1 row" in table
    plot_profile(prof, tmp_path / "p.png")  # draws the floors too
    assert (tmp_path / "p.png").stat().st_size > 0
    # batched costs interpolate between probed batch sizes; B = 1 is the single-request curve
    mid = prof.batch_verify_at(2.5, 6, 8)
    assert min(prof.batch_verify_at(2, 6, 8), prof.batch_verify_at(3, 6, 8)) <= mid
    assert mid <= max(prof.batch_verify_at(2, 6, 8), prof.batch_verify_at(3, 6, 8))
    assert prof.batch_verify_at(1, 4, 8) == prof.verify_at(4, 8)
    prof.save(tmp_path / "p.json")
    assert CostProfile.load(tmp_path / "p.json") == prof  # floors included
    # with a flat made-up cost the rule wants everything, but K=2, L=3 leaves only 14 strings
    flat = profile_from(lambda n: 1.0)
    engine.set_cost_profile(flat)
    cfg = DecodeConfig(method="cast", width="auto", top_k_per_position=2, max_new_tokens=30)
    spec = PolicySpec.for_request(cfg)
    assert engine.cost_inputs(spec) == (flat, None)
    assert make_policy(spec, drafter.cfg.num_draft_positions, flat).rule.max_width == 14
    ar = [t for c in decode(target, None, [1, 2, 3], DecodeConfig(method="ar", max_new_tokens=30)) for t in c]
    stats = DecodeStats()
    out = [t for c in decode(target, drafter, [1, 2, 3], cfg, stats, flat) for t in c]
    assert out == ar and max(r.packed for r in stats.rounds) <= 15
    with pytest.raises(ValueError, match="cost profile"):  # "auto" is the cost rule, not a silent fixed width
        next(decode(target, drafter, [1, 2, 3], cfg))
    # through the engine, which passes its profile: the same rule, the same tokens
    r = engine.generate(input_ids=[1, 2, 3], method="cast", width="auto", top_k_per_position=2, max_new_tokens=30,
                        stop_token_ids=())
    assert r.token_ids == ar and max(x.packed for x in r.stats.rounds) <= 15
    # recalibrated masses: still exact, and the engine keeps what it observed for the next requests
    r = engine.generate(input_ids=[1, 2, 3], method="cast", width="auto", top_k_per_position=2, max_new_tokens=30,
                        stop_token_ids=(), calibrate=True)
    assert r.token_ids == ar and engine._calibration.trials.sum() > 0
    assert engine.cost_inputs(spec, calibrate=True) == (flat, engine._calibration)
    # a missing profile is probed once and cached for this deployment
    engine._profile = None
    assert engine.cost_profile() is not None and list(tmp_path.glob("profiles/*.json"))
    # a scheduler's asks for batched shapes too: probed once beside it (B + 1 among them), kept in the same file
    assert not engine.cost_profile().batch
    sched = engine.scheduler(SchedulerConfig(max_batch=2, policy="cost"))
    assert sched.policy.rule.profile is engine.cost_profile()
    assert engine.cost_profile().batch["16"]["packed"][:2] == [16, 17]
    engine._profile = None
    assert engine.cost_profile().batch.keys() == {"2", "4", "8", "16"}  # read back from the cache


def test_profile_key_follows_the_drafter_shape():
    # a retrained drafter shipped at the same path must not reuse the old drafter's measured costs
    from castspec.probe import engine_key

    target = native(make_hf(llama_config(vocab=24), seed=1))
    keys = [engine_key(Engine(target, None, random_drafter(target, block_size=bs), source="t", drafter_source="d"))
            for bs in (4, 6)]
    assert keys[0] != keys[1]
    assert engine_key(Engine(target, None, None, source="t"))["drafter"] == "none"


SAVE_UNDER_A_FILE_SIZE_LIMIT = """
import resource, signal, sys
from pathlib import Path
from castspec.cost import CostProfile

path = Path(sys.argv[1])
profile = CostProfile.load(path)
profile.host_ms = {str(n): 1.0 for n in range(500)}  # a bigger file than the limit lets through
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit, write() fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (256, 256))
try:
    profile.save(path)
except OSError:
    sys.exit(3)
"""


def test_a_failed_profile_save_leaves_the_old_profile_whole(tmp_path):
    """A save that fails halfway (here: a file-size limit, as a full disk would) must not leave a truncated
    profile behind: the next start would read half a JSON file."""
    import subprocess
    import sys

    path = tmp_path / "profiles" / "p.json"
    old = profile_from(lambda n: 10 + n)
    old.save(path)
    run = subprocess.run([sys.executable, "-c", SAVE_UNDER_A_FILE_SIZE_LIMIT, str(path)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 3, run.stderr
    assert CostProfile.load(path) == old
    assert [p.name for p in path.parent.iterdir()] == ["p.json"]  # the temporary file is gone too


def test_concurrent_profile_saves_never_show_a_partial_file(tmp_path):
    """Two processes saving the same profile while a third keeps reading it: every read is a whole profile."""
    import subprocess
    import sys

    path = tmp_path / "p.json"
    big = profile_from(lambda n: 10 + n)
    big.host_ms = {str(n): float(n) for n in range(5000)}  # big enough to be caught mid-write when not atomic
    big.save(path)
    writer = ("import sys; from pathlib import Path; from castspec.cost import CostProfile\n"
              "p = CostProfile.load(sys.argv[1])\n"
              "for _ in range(15): p.save(Path(sys.argv[1]))\n")
    procs = [subprocess.Popen([sys.executable, "-c", writer, str(path)]) for _ in range(2)]
    reads = 0
    try:
        while any(p.poll() is None for p in procs):
            assert CostProfile.load(path) == big
            reads += 1
    finally:
        codes = [p.wait(timeout=120) for p in procs]
    assert codes == [0, 0] and reads > 0
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


def test_least_slopes_and_one_request_width_match_their_definitions():
    """RoundWidth's tables: slopes[n] = min over m > n of (l(m) - l(n)) / (m - n); with one request the width is
    the N maximizing g(N) - lambda * l(N) over its best-first masses (brute force over every N)."""
    rng = np.random.default_rng(0)
    steps = np.repeat(rng.random(30) * 4, 10).cumsum() + np.arange(300) * 0.01  # plateaus and jumps, as measured
    for table in [np.maximum.accumulate(rng.random(L) * 3 + np.arange(L) * 0.2) for L in (1, 2, 9, 64, 300)] + [
            steps, np.round(steps), np.full(50, 2.0), np.arange(40.0) ** 2, np.sqrt(np.arange(40.0))]:
        L = len(table)
        brute = [min(((table[m] - table[n]) / (m - n) for m in range(n + 1, L)), default=np.inf) for n in range(L)]
        assert np.allclose(least_slopes(table), brute)
    packed = [1, 2, 4, 8, 16, 32, 64]
    prof = CostProfile({}, packed, [0, 1024], [[10 + 0.3 * n + (n > 16) * 4.0 for n in packed]] * 2, [1.0, 1.0])
    for seed in range(20):
        r = np.random.default_rng(seed)
        masses = np.sort(r.random(40) ** 3)[::-1]
        rule = RoundWidth(prof, 40, init_throughput=float(r.uniform(0.05, 2.0)))
        got = rule.choose(list(np.log(masses)), [1] * 40, 100)
        table = rule._table(100, 1)
        value = [masses[:n].sum() - rule.lam * table[n] for n in range(len(masses) + 1)]
        assert got == int(np.argmax(value))


def test_one_slow_measurement_does_not_raise_every_larger_shape():
    """A quick probe's hiccup at 2 packed rows (a shared machine) is pooled with its neighbours: the curve the
    width rule reads stays non-decreasing and near the others, instead of every larger shape costing the hiccup."""
    packed = [1, 2, 4, 8, 16, 32, 64]
    measured = [10.55, 12.76, 10.31, 10.54, 11.50, 14.79, 23.25]  # a quick probe of the AMX CPU, as stored
    prof = CostProfile({}, packed, [256], [measured], [1.1])
    curve = [prof.verify_at(n, 256) for n in packed]
    assert all(b >= a for a, b in zip(curve, curve[1:]))
    assert curve[0] == pytest.approx(10.55) and curve[1] == pytest.approx((12.76 + 10.31 + 10.54) / 3)
    assert curve[4:] == pytest.approx(measured[4:])
    assert monotone([3.0, 1.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0]) and list(monotone([1.0, 2.0])) == [1.0, 2.0]
