"""Forwards of a few rows in native code (castspec/native/csrc/step.c) against the torch forward: decode steps,
causal prefill chunks, packed trees; and the drafter's block pass (csrc/draft.c). The AVX-512 build on AVX-512
BF16 CPUs, the AVX2 one on AVX2 CPUs, the emulated one elsewhere (native_support); tiny models, since the
emulated code is slow."""
import copy
import dataclasses
import logging

import pytest
import torch

from castspec.models.kvcache import Segment
from castspec.native import build as native
from castspec.native import forward as native_step
from castspec.native.forward import NativeDraft, NativeStep
from castspec.pack import pack_tree
from castspec.sequence import DraftState, propose_batch
from castspec.tree import build_tree
from conftest import llama_config, make_hf
from conftest import native as native_target
from conftest import qwen3_config, random_drafter
from native_support import native_library

pytestmark = pytest.mark.usefixtures("zeroed_caches")  # whole caches are compared


@pytest.fixture
def lib(monkeypatch):
    yield from native_library(monkeypatch)


CONFIGS = {
    "llama-tied-rope-scaling": lambda: llama_config(rope_scaling=True),
    "qwen3-untied-qk-norm": lambda: qwen3_config(head_dim=32),
    # the default target's head shape (64 dimensions, 3 query heads per key/value head): in bf16 on a CPU with
    # AMX, attention runs on tiles (csrc/attn_amx.h)
    "llama-head-dim-64": lambda: llama_config(hidden_size=384, intermediate_size=256, num_attention_heads=6,
                                              num_key_value_heads=2),
    # Qwen3-8B's (128 dimensions, 4 query heads per key/value head): two passes of 64 columns on the tiles
    "qwen3-head-dim-128": lambda: qwen3_config(head_dim=128, num_attention_heads=8),
}
# Longer prompts for those shapes: rows then see whole chunks of 32 keys, which the tiles share among the rows of
# a tree or a prompt chunk, and partial ones, which a prompt chunk's rows share too (each row's keys past its end
# weighted zero) and a tree's rows take one by one
LONG = {"llama-head-dim-64": 3, "qwen3-head-dim-128": 3}


def _torch_only(model):
    model.backend.use_torch()
    return model


def _prefilled(target, ids):
    cache = target.new_cache(max(64, ids.shape[1] + 32))
    target(ids, torch.arange(ids.shape[1]).view(1, -1), cache, 0, causal=True)
    return cache


@pytest.mark.usefixtures("lib")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_native_step_matches_torch_forward(name, dtype):
    """Logits, tapped hidden states and the cache agree step after step: to fp32 rounding in fp32, to bf16
    rounding in bf16 (both round at the same places; attention's summation order and exp differ)."""
    cfg = CONFIGS[name]()
    fast, ref = native_target(make_hf(cfg, seed=2), dtype), native_target(make_hf(cfg, seed=2), dtype)
    _torch_only(ref)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (1, 9), generator=g)
    taps = (3, 1)
    with torch.inference_mode():
        c_fast, c_ref = _prefilled(fast, prompt), _prefilled(ref, prompt)
        for slot in range(9, 30):
            tok = torch.randint(0, cfg.vocab_size, (1, 1), generator=g)
            pos = torch.tensor([[slot]])
            logits, feats = fast(tok, pos, c_fast, slot, taps=taps)
            want_logits, want_feats = ref(tok, pos, c_ref, slot, taps=taps)
            tol = 1e-5 if dtype == torch.float32 else 3e-2
            for got, want in ((logits, want_logits), (feats, want_feats)):
                torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())
            assert logits.shape == (1, 1, cfg.vocab_size) and feats.shape == (1, 1, 2 * cfg.hidden_size)
        assert fast.backend.active and fast.backend.checked
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        for got, want in ((c_fast.k, c_ref.k), (c_fast.v, c_ref.v)):  # relative to the largest, as above
            torch.testing.assert_close(got, want, rtol=tol, atol=tol * max(want.abs().max().item(), 1.0))


def _decode_one(target):
    """A prompt token and one decode step through `target` (what builds its native code)."""
    cache = target.new_cache(8)
    target(torch.tensor([[1]]), torch.tensor([[0]]), cache, 0, causal=True)
    return target(torch.tensor([[2]]), torch.tensor([[1]]), cache, 1)


@pytest.mark.usefixtures("lib")
def test_native_step_applies_only_where_it_can(monkeypatch):
    with torch.inference_mode():
        assert NativeStep.build(native_target(make_hf(llama_config()))) is not None
        assert NativeStep.build(native_target(make_hf(qwen3_config(head_dim=24)))) is None  # not 16k
        target = native_target(make_hf(llama_config()))
        _decode_one(target)
        assert target.backend.active and target.backend.checked
        target.to("cpu")  # weights may have moved: the native code is dropped and built again when next used
        assert not target.backend.active and not target.backend.checked
        _decode_one(target)
        assert target.backend.active and target.backend.checked
        copied = copy.deepcopy(target)  # a copy has its own weights: it builds its own native code
        assert not copied.backend.active
        torch.testing.assert_close(_decode_one(copied)[0], _decode_one(target)[0])
        assert copied.backend.active
        # the library loaded again with products that read another panel layout (AMX on or off, as tests reload
        # it): the code packed for the old one is dropped and built again
        built, real = target.backend.built, native.panel_group
        first = iter([built.panel_group + 1])
        monkeypatch.setattr(native, "panel_group", lambda: next(first, None) or real())
        torch.testing.assert_close(_decode_one(target)[0], _decode_one(copied)[0])
        assert target.backend.built is not built and target.backend.active and target.backend.checked
        monkeypatch.setattr(native, "library", lambda: None)
        assert NativeStep.build(target) is None
        fresh = native_target(make_hf(llama_config()))
        _decode_one(fresh)
        assert not fresh.backend.active  # no library: the torch forward


@pytest.mark.usefixtures("lib")
def test_native_step_reports_overflow():
    target = native_target(make_hf(llama_config()))
    cache = target.new_cache(4)
    with torch.inference_mode(), pytest.raises(ValueError, match="KV cache overflow"):
        target(torch.tensor([[1]]), torch.tensor([[4]]), cache, 4)


@pytest.mark.usefixtures("lib")
def test_disagreeing_native_step_turns_itself_off(monkeypatch, caplog):
    """The native code is compared with torch when it is built, on scratch caches; a wrong one is reported once
    and never runs a request's forward: every call, the first included, is torch's."""
    caches = []
    real = NativeStep.__call__

    def perturbed(self, ids, positions, segments, logit_rows, taps=()):
        caches.append(segments[0].cache)
        logits, features = real(self, ids, positions, segments, logit_rows, taps)
        return logits + 1.0, features

    monkeypatch.setattr(NativeStep, "__call__", perturbed)
    target, ref = native_target(make_hf(llama_config(), seed=3)), native_target(make_hf(llama_config(), seed=3))
    _torch_only(ref)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.inference_mode(), caplog.at_level(logging.WARNING, logger="castspec"):
        c1, c2 = target.new_cache(64), ref.new_cache(64)
        got = [target(prompt, torch.arange(5).view(1, -1), c1, 0, causal=True)]
        want = [ref(prompt, torch.arange(5).view(1, -1), c2, 0, causal=True)]
        assert not target.backend.active and not target.backend.checked  # off before the first call returned
        for slot in (5, 6):
            got.append(target(torch.tensor([[9]]), torch.tensor([[slot]]), c1, slot))
            want.append(ref(torch.tensor([[9]]), torch.tensor([[slot]]), c2, slot))
    for a, b in zip(got, want):
        assert torch.equal(a[0], b[0])
    assert torch.equal(c1.k, c2.k) and torch.equal(c1.v, c2.v)
    assert caches and all(c is not c1 for c in caches)  # the native code ran the self-test only
    assert caplog.text.count("disagrees") == 1


@pytest.mark.usefixtures("lib")
def test_disagreeing_native_drafter_turns_itself_off(monkeypatch, caplog):
    """Likewise for the drafter: a wrong native pass found at build time leaves every pass to torch."""
    real = NativeDraft.__call__
    monkeypatch.setattr(NativeDraft, "__call__", lambda self, *args: real(self, *args) * 1.5)
    target = native_target(make_hf(llama_config(vocab=64), seed=1))
    fast, ref = random_drafter(target, block_size=6), random_drafter(target, block_size=6)
    _torch_only(ref)
    feats = torch.randn(1, 4, len(fast.cfg.target_layer_ids) * target.cfg.hidden_size,
                        generator=torch.Generator().manual_seed(3))
    caches = fast.new_cache(16), ref.new_cache(16)
    with torch.inference_mode(), caplog.at_level(logging.WARNING, logger="castspec"):
        block = target.embed(torch.arange(6).view(1, -1))
        out = [m(block, torch.arange(4, 10).view(1, -1), feats, torch.arange(4).view(1, -1), c, 0)
               for m, c in zip((fast, ref), caches)]
    assert not fast.backend.active and torch.equal(out[0], out[1])
    # the whole cache: draft.c would also have left the block's keys in the slots after the context
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    assert "drafter pass disagrees" in caplog.text


@pytest.mark.usefixtures("lib")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_native_prefill_and_tree_match_torch(name, dtype):
    """A causal prefill chunk and packed trees (ancestor-only masks, positions = prefix + depth) through step.c:
    the logits of the rows asked for, every row's tapped features and the cache agree with torch's."""
    cfg = CONFIGS[name]()
    fast, ref = native_target(make_hf(cfg, seed=5), dtype), native_target(make_hf(cfg, seed=5), dtype)
    _torch_only(ref)
    g = torch.Generator().manual_seed(1)
    tol = 1e-5 if dtype == torch.float32 else 3e-2

    def same(a, b):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * max(b.abs().max().item(), 1.0))

    with torch.inference_mode():
        caches = fast.new_cache(64), ref.new_cache(64)
        prompt = torch.randint(0, cfg.vocab_size, (1, 11), generator=g)
        pos = torch.arange(11).view(1, -1)
        last = torch.tensor([10])
        out = [m(prompt, pos, c, 0, causal=True, logit_rows=last, taps=(2,)) for m, c in zip((fast, ref), caches)]
        assert out[0][0].shape == (1, 1, cfg.vocab_size) and out[0][1].shape == (1, 11, cfg.hidden_size)
        same(out[0][0], out[1][0])
        same(out[0][1], out[1][1])
        start = 11
        for width in (1, 5, 20):  # 20: beyond the drafter's row limit, which the target's forward does not have
            lp = torch.log_softmax(torch.randn(4, cfg.vocab_size, generator=g) * 3, dim=-1)
            pack = pack_tree(build_tree(lp, width, 4), 7, start, "cpu")
            out = [m(pack.ids, pack.positions, c, start, mask=pack.mask, taps=(0, 3))
                   for m, c in zip((fast, ref), caches)]
            same(out[0][0], out[1][0])
            same(out[0][1], out[1][1])
            start += width + 1  # keep the tree in the cache: the next one attends over it (visible prefix)
        assert fast.backend.checked
        same(caches[0].k[:, :, :, :start], caches[1].k[:, :, :, :start])
        same(caches[0].v[:, :, :, :start], caches[1].v[:, :, :, :start])


def _counting_native_calls(monkeypatch, *caches) -> list[int]:
    """The row counts of the native calls (NativeStep.__call__) writing any of `caches` from now on (not the
    self-test's)."""
    calls = []
    real = NativeStep.__call__

    def counted(self, ids, positions, segments, *args, **kwargs):
        if any(seg.cache is cache for seg in segments for cache in caches):
            calls.append(ids.numel())
        return real(self, ids, positions, segments, *args, **kwargs)

    monkeypatch.setattr(NativeStep, "__call__", counted)
    return calls


@pytest.mark.usefixtures("lib")
def test_target_forwards_of_any_size_run_natively_in_chunks(monkeypatch):
    """The target's native forward takes any number of rows (a torch fallback would not be bit-exact), in calls
    of at most CHUNK rows; CASTSPEC_NATIVE_ROWS still sets a limit, beyond which forwards run on torch."""
    target = native_target(make_hf(llama_config()))
    n = native_step.CHUNK + 6
    with torch.inference_mode():
        cache = target.new_cache(n + 1)
        calls = _counting_native_calls(monkeypatch, cache)
        target(torch.arange(n).view(1, -1) % 40, torch.arange(n).view(1, -1), cache, 0, causal=True)
        target(torch.tensor([[3]]), torch.tensor([[n]]), cache, n)
        assert calls == [native_step.CHUNK, 6, 1]
        calls.clear()
        monkeypatch.setenv("CASTSPEC_NATIVE_ROWS", "4")
        target(torch.arange(5).view(1, -1), torch.arange(5).view(1, -1), cache, 0, causal=True)
        target(torch.tensor([[3]]), torch.tensor([[5]]), cache, 5)
    assert calls == [1]


# -- bit-exactness (issue 16): a row's bits depend on its token, position and the keys it sees, nothing else --

def _copy(target, base, n: int):
    """A fresh cache holding the first n slots of `base` (a request forked after its prompt)."""
    cache = target.new_cache(base.capacity)
    cache.copy_prefix(base, n)
    return cache


def _prompt_chunk(a: int, b: int):
    """Slots [a, b) of a prompt as serving prefills them (sequence.prefill_segment): the first chunk causal,
    later ones with a mask over the cached prompt and themselves causally."""
    if a == 0:
        return dict(causal=True)
    vis = torch.ones(b - a, b, dtype=torch.bool)
    vis[:, a:] = torch.tril(vis[:, a:])
    return dict(mask=vis.view(1, 1, b - a, b))


EXACT = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])


@pytest.mark.usefixtures("lib")
@EXACT
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_rows_bits_do_not_depend_on_the_other_rows(name, dtype, monkeypatch):
    """Row invariance: a decode row's logits, taps and keys/values are bit-identical alone and inside ragged
    forwards of 2 to 70 other rows (beyond the drafter's row limit, and beyond CHUNK: then several calls)."""
    cfg = CONFIGS[name]()
    target = native_target(make_hf(cfg, seed=4), dtype)
    g = torch.Generator().manual_seed(4)
    P, taps = 19 * LONG.get(name, 1), (1, 3)
    tok, pos = torch.tensor([[7]]), torch.tensor([[P]])
    with torch.inference_mode():
        base = _prefilled(target, torch.randint(0, cfg.vocab_size, (1, P), generator=g))
        alone = _copy(target, base, P)
        want_logits, want_feats = target(tok, pos, alone, P, taps=taps)
        for before, after in ((1, 1), (3, 4), (9, 11), (native_step.CHUNK + 2, 4)):
            cache = _copy(target, base, P)
            calls = _counting_native_calls(monkeypatch, cache)
            segments = [Segment(target.new_cache(before), 0, before, causal=True), Segment(cache, P, 1),
                        Segment(target.new_cache(after), 0, after, causal=True)]
            ids = torch.cat([torch.randint(0, cfg.vocab_size, (1, before), generator=g), tok,
                             torch.randint(0, cfg.vocab_size, (1, after), generator=g)], dim=1)
            positions = torch.cat([torch.arange(before).view(1, -1), pos, torch.arange(after).view(1, -1)], dim=1)
            logits, feats = target.forward_segments(ids, positions, segments, taps=taps)
            assert calls, "the forward ran on torch"
            assert torch.equal(logits[0, before], want_logits[0, 0]) and torch.equal(feats[0, before], want_feats[0, 0])
            assert torch.equal(cache.k, alone.k) and torch.equal(cache.v, alone.v)


@pytest.mark.usefixtures("lib")
@EXACT
@pytest.mark.parametrize("name", list(CONFIGS))
def test_tree_rows_give_the_bits_of_ar_steps(name, dtype):
    """Attention in position order: every row of a packed tree (the prefix, then its ancestors at slots further
    on) gives the logits, taps and keys/values of the `ar` decode steps along its path (the same keys at slots
    0..pos), bit for bit."""
    cfg = CONFIGS[name]()
    target = native_target(make_hf(cfg, seed=6), dtype)
    g = torch.Generator().manual_seed(6)
    # a prefix over more than one group of sixteen keys, the tree's rows across the next
    P, taps = 21 * LONG.get(name, 1), (0, 2)
    lp = torch.log_softmax(torch.randn(4, cfg.vocab_size, generator=g) * 3, dim=-1)
    pack = pack_tree(build_tree(lp, 12, 4), 5, P, "cpu")
    ancestors = pack.mask[0, 0, :, P:]  # [rows, rows]: row r sees its ancestors and itself
    with torch.inference_mode():
        base = _prefilled(target, torch.randint(0, cfg.vocab_size, (1, P), generator=g))
        tree = _copy(target, base, P)
        logits, feats = target(pack.ids, pack.positions, tree, P, mask=pack.mask, taps=taps)
        leaves = [r for r in range(pack.ids.shape[1]) if ancestors[:, r].sum() == 1]
        for leaf in leaves:  # every row lies on some leaf's path
            ar = _copy(target, base, P)
            for depth, row in enumerate(ancestors[leaf].nonzero().view(-1).tolist()):
                slot = P + depth
                step_logits, step_feats = target(pack.ids[:, row:row + 1], torch.tensor([[slot]]), ar, slot,
                                                 taps=taps)
                assert torch.equal(step_logits[0, 0], logits[0, row]) and torch.equal(step_feats[0, 0], feats[0, row])
                assert torch.equal(ar.k[..., slot, :], tree.k[..., P + row, :])
                assert torch.equal(ar.v[..., slot, :], tree.v[..., P + row, :])


@pytest.mark.usefixtures("lib")
@EXACT
@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_chunking_does_not_change_the_cache(name, dtype):
    """A 40-token prompt prefilled in one call, or in chunks of 1, 7 or 16 rows (masked as serving prefills
    them): bit-identical keys/values and logits of the last row."""
    cfg = CONFIGS[name]()
    target = native_target(make_hf(cfg, seed=8), dtype)
    n = 40 * LONG.get(name, 1)
    prompt = torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(8))
    positions = torch.arange(n).view(1, -1)
    with torch.inference_mode():
        whole = target.new_cache(n)
        want, _ = target(prompt, positions, whole, 0, causal=True, logit_rows=torch.tensor([n - 1]))
        for size in (1, 7, 16):
            cache = target.new_cache(n)
            for a in range(0, n, size):
                b = min(n, a + size)
                got, _ = target(prompt[:, a:b], positions[:, a:b], cache, a, logit_rows=torch.tensor([b - a - 1]),
                                **_prompt_chunk(a, b))
            assert torch.equal(got, want), size
            assert torch.equal(cache.k, whole.k) and torch.equal(cache.v, whole.v), size


@pytest.mark.usefixtures("lib")
def test_chunked_native_calls_equal_one_call(monkeypatch):
    """NativeStep.run cuts a long forward into calls of at most CHUNK rows, segments at the cuts (a decode row,
    a tree and a prompt chunk here, cut every 5 rows): the same bits as one call. A segment whose rows see later
    rows' slots cannot be cut, and runs in one call."""
    cfg = CONFIGS["qwen3-untied-qk-norm"]()
    target = native_target(make_hf(cfg, seed=9), torch.bfloat16)
    g = torch.Generator().manual_seed(9)
    P = 6
    lp = torch.log_softmax(torch.randn(3, cfg.vocab_size, generator=g) * 3, dim=-1)
    pack = pack_tree(build_tree(lp, 12, 3), 5, P, "cpu")
    ids = torch.cat([torch.tensor([[4]]), pack.ids, torch.arange(9).view(1, -1) + 10], dim=1)
    positions = torch.cat([torch.tensor([[P]]), pack.positions, torch.arange(9).view(1, -1)], dim=1)
    with torch.inference_mode():
        base = _prefilled(target, torch.randint(0, cfg.vocab_size, (1, P), generator=g))

        def forward(ids, positions, extra=()):
            caches = _copy(target, base, P), _copy(target, base, P), target.new_cache(16)
            calls = _counting_native_calls(monkeypatch, *caches)
            segments = [Segment(caches[0], P, 1), Segment(caches[1], P, pack.ids.shape[1], pack.mask),
                        Segment(caches[2], 0, 9, causal=True), *extra]
            return target.forward_segments(ids, positions, segments, taps=(1,)), caches, calls

        want, want_caches, one = forward(ids, positions)
        monkeypatch.setattr(native_step, "CHUNK", 5)
        got, got_caches, calls = forward(ids, positions)
        assert one == [ids.shape[1]] and calls == [5, 5, 5, 5, 3]
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        for a, b in zip(got_caches, want_caches):
            assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
        # three rows that all see each other (no decoding pattern, but a valid forward): one call
        everything = Segment(target.new_cache(3), 0, 3, torch.ones(1, 1, 3, 3, dtype=torch.bool))
        _, _, calls = forward(torch.cat([ids, ids[:, :3]], dim=1), torch.cat([positions, positions[:, :3]], dim=1),
                              (everything,))
        assert len(calls) == 1


def _drafting_rounds(target, drafters, dtype, g):
    """Two requests drafted in one pass (serving), with different context lengths and depths (a whole block, and
    the few first positions a pass finishes alone), for three rounds, on each of `drafters` alike: every round's
    marginals per drafter (in the order given), and the drafters' draft states."""
    width = len(drafters[0].cfg.target_layer_ids) * target.cfg.hidden_size
    states = {m: (DraftState(m, 64), DraftState(m, 64)) for m in drafters}
    rounds = []
    for new_rows, depths in (((6, 2), (5, 4)), ((1, 4), (1, 5)), ((3, 1), (2, 1))):
        feats = [torch.randn(1, n, width, generator=g).to(dtype) for n in new_rows]
        for pair in states.values():
            for st, f in zip(pair, feats):
                st.add_context(f)
        rounds.append([propose_batch(target, m, list(pair), [5, 9], list(depths)) for m, pair in states.items()])
    return rounds, states


@pytest.mark.usefixtures("lib")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_drafter_pass_matches_torch(dtype):
    """Rounds of drafting through draft.c and through torch, two requests per pass: the same log-probabilities
    (and the same draft-vocabulary support), the same context in each drafter cache."""
    target = native_target(make_hf(llama_config(vocab=64), seed=1), dtype)
    # blocks of 6 rows: two requests' blocks stay within the native row limit
    fast, ref = (random_drafter(target, block_size=6).converted(dtype) for _ in range(2))
    _torch_only(ref)
    g = torch.Generator().manual_seed(2)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    with torch.inference_mode():
        rounds, states = _drafting_rounds(target, (fast, ref), dtype, g)
        for got, want in rounds:
            for a, b in ((x.full, y.full) for x, y in zip(got, want)):
                assert torch.equal(torch.isfinite(a), torch.isfinite(b))
                seen = torch.isfinite(b)
                torch.testing.assert_close(a[seen], b[seen], rtol=tol, atol=tol * b[seen].abs().max().item())
        assert fast.backend.active and fast.backend.checked
        for a, b, n in zip(states[fast], states[ref], (10, 7)):
            assert a.cache.length == b.cache.length == n
            torch.testing.assert_close(a.cache.k[..., :n, :], b.cache.k[..., :n, :], rtol=tol, atol=tol)
            torch.testing.assert_close(a.cache.v[..., :n, :], b.cache.v[..., :n, :], rtol=tol, atol=tol)


@pytest.mark.usefixtures("lib")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_pass_of_many_requests_gives_each_the_bits_of_its_own_pass(dtype):
    """A pass of 12 requests (84 block rows, 90 context rows: draft.c's per-row norms, RoPE and cache writes then
    run on every thread) gives every request the log-probabilities and drafter cache of its pass alone, bit for
    bit, in two rounds."""
    target = native_target(make_hf(llama_config(vocab=64), seed=1), dtype)
    drafter = random_drafter(target, block_size=7).converted(dtype)
    drafter.set_draft_vocab(torch.arange(0, 64, 2))  # its head on gemm.c, in the same call, as a shipped drafter's
    width = len(drafter.cfg.target_layer_ids) * target.cfg.hidden_size
    g = torch.Generator().manual_seed(5)
    many, alone = ([DraftState(drafter, 64) for _ in range(12)] for _ in range(2))
    roots = [int(r) for r in torch.randint(0, 64, (12,), generator=g)]
    with torch.inference_mode():
        for new_rows in ([9, 5, 8, 6, 7, 10, 9, 4, 8, 7, 9, 8], [1, 2, 1, 1, 3, 1, 1, 2, 1, 1, 1, 2]):
            for a, b, n in zip(many, alone, new_rows):
                f = torch.randn(1, n, width, generator=g).to(dtype)
                a.add_context(f)
                b.add_context(f)
            together = propose_batch(target, drafter, many, roots, [5] * 12)
            assert drafter.backend.active
            for st, root, got in zip(alone, roots, together):
                want = propose_batch(target, drafter, [st], [root], [5])[0]
                assert torch.equal(got.on_support, want.on_support) and torch.equal(got.support, want.support)
    for a, b in zip(many, alone):
        assert a.cache.length == b.cache.length
        assert torch.equal(a.cache.k, b.cache.k) and torch.equal(a.cache.v, b.cache.v)


@pytest.mark.usefixtures("lib")
@pytest.mark.parametrize("native_pass", [True, False])
def test_a_drafter_trained_on_cut_blocks_drafts_a_shallow_batch_from_cut_blocks(native_pass):
    """A drafter whose config says it was trained on blocks cut to 3 rows (train-drafter --short-blocks): a pass of
    several requests whose trees read at most 2 positions runs blocks of 3 rows (the marginals of the same weights
    with a block size of 3); deeper, and for one request alone, its whole blocks."""
    target = native_target(make_hf(llama_config(vocab=64), seed=1), torch.float32)
    cut, whole, small = (random_drafter(target, block_size=6) for _ in range(3))
    cut.cfg = dataclasses.replace(cut.cfg, short_block_rows=3)
    small.cfg = dataclasses.replace(small.cfg, block_size=3)
    for m in (cut, whole, small):
        m.set_draft_vocab(torch.arange(0, 64, 2))
        if not native_pass:
            _torch_only(m)
    width = len(cut.cfg.target_layer_ids) * target.cfg.hidden_size
    g = torch.Generator().manual_seed(4)
    feats = [torch.randn(1, n, width, generator=g) for n in (6, 4)]

    def propose(m, depths, requests=2):
        states = [DraftState(m, 64) for _ in range(requests)]
        for st, f in zip(states, feats):
            st.add_context(f)
        return propose_batch(target, m, states, [5, 9][:requests], depths)

    with torch.inference_mode():
        for depths, same_as in (([2, 1], small), ([2, 2], small), ([4, 2], whole)):
            for got, want in zip(propose(cut, depths), propose(same_as, depths)):
                torch.testing.assert_close(got.on_support, want.on_support, rtol=1e-5, atol=1e-5)
        alone_cut, alone_whole = propose(cut, [2], 1)[0], propose(whole, [2], 1)[0]
        torch.testing.assert_close(alone_cut.on_support, alone_whole.on_support, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(propose(cut, [2, 1])[0].on_support, propose(whole, [2, 1])[0].on_support)


@pytest.mark.usefixtures("lib")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_drafter_pass_gives_the_bits_of_block_and_head(dtype):
    """A pass through the draft vocabulary in one native call (draft_pass, once the drafter's native code is built
    and checked) gives the bits of draft_block and then the head's call: log-probabilities and drafter caches."""
    target = native_target(make_hf(llama_config(vocab=64), seed=1), dtype)
    fused, split = (random_drafter(target, block_size=6).converted(dtype) for _ in range(2))
    for m in (fused, split):
        m.set_draft_vocab(torch.arange(0, 64, 2))  # a head of 32 rows, as a shipped draft vocabulary
    g = torch.Generator().manual_seed(3)
    calls = []
    code_marginals = NativeDraft.marginals

    def counting(self, *args):
        calls.append(1)
        return code_marginals(self, *args)

    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(NativeDraft, "marginals", counting)
        # `split` runs the pass as three steps: the embedding, forward_segments, then block_marginals
        mp.setattr(split, "propose_segments", lambda target, ids, *a: split.block_marginals(
            split.forward_segments(target.embed(ids), *a[:-1])[0], a[-1], target))
        rounds, states = _drafting_rounds(target, (fused, split), dtype, g)
        for got, want in rounds:
            for x, y in zip(got, want):
                assert torch.equal(x.on_support, y.on_support) and torch.equal(x.support, y.support)
        assert len(calls) == 2, "the first pass builds the native code; the later ones run in one call"
        for a, b in zip(states[fused], states[split]):
            assert a.cache.length == b.cache.length
            assert torch.equal(a.cache.k, b.cache.k) and torch.equal(a.cache.v, b.cache.v)


@pytest.mark.usefixtures("lib")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_ragged_forward_matches_torch(dtype):
    """Several requests in one forward (serving): a decode row, a packed tree and a causal prompt chunk, each on
    its own cache at its own prefix length, against the torch forward of the same segments."""
    cfg = llama_config()
    fast, ref = native_target(make_hf(cfg, seed=7), dtype), native_target(make_hf(cfg, seed=7), dtype)
    _torch_only(ref)
    g = torch.Generator().manual_seed(3)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    with torch.inference_mode():
        caches = {}
        for name, model in (("fast", fast), ("ref", ref)):
            a, b, c = model.new_cache(64), model.new_cache(64), model.new_cache(64)
            for cache, n in ((a, 9), (b, 4)):  # two requests with prompts already in their caches
                ids = torch.arange(n).view(1, -1) * 3 % cfg.vocab_size
                model(ids, torch.arange(n).view(1, -1), cache, 0, causal=True)
            caches[name] = (a, b, c)
        lp = torch.log_softmax(torch.randn(3, cfg.vocab_size, generator=g) * 3, dim=-1)
        pack = pack_tree(build_tree(lp, 5, 3), 11, 4, "cpu")
        ids = torch.cat([torch.tensor([[5]]), pack.ids, torch.tensor([[7, 8, 9]])], dim=1)
        pos = torch.cat([torch.tensor([[9]]), pack.positions, torch.arange(3).view(1, -1)], dim=1)
        out = {}
        for name, model in (("fast", fast), ("ref", ref)):
            a, b, c = caches[name]
            segments = [Segment(a, 9, 1), Segment(b, 4, 6, pack.mask), Segment(c, 0, 3, causal=True)]
            out[name] = model.forward_segments(ids, pos, segments, taps=(1,))
        for got, want in zip(out["fast"], out["ref"]):
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())
        assert fast.backend.checked
        for got, want in zip(caches["fast"], caches["ref"]):
            torch.testing.assert_close(got.k, want.k, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_and_emulated_builds_agree(monkeypatch, dtype):
    """The AVX2 build (csrc/avx2.h: 512-bit operations as pairs of 256-bit ones, bf16 pair products as fused
    multiply-adds) and the emulated AVX-512 build (simde) agree on a whole forward, a prefill chunk then a packed
    tree of several rows, logits and cache alike, to the rounding their multiply-adds differ by (simde's
    emulation rounds the product and the sum separately). Both run on any CPU with AVX2 and simde's headers, so
    a machine without AVX-512 still runs the AVX-512 code paths (gemm.c's AVX-512 tiles) somewhere."""
    if not native.cpu_supported("avx2") or not native.emulation_available():
        pytest.skip("needs an AVX2 CPU and simde's headers (libsimde-dev)")
    cfg = CONFIGS["qwen3-untied-qk-norm"]()
    prompt = torch.randint(0, cfg.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
    tree = torch.randint(0, cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(2))
    parents = [-1, 0, 0, 1, 3]
    visible = torch.zeros(5, 7 + 5, dtype=torch.bool)
    visible[:, :7] = True
    for i, p in enumerate(parents):
        visible[i, 7 + i] = True
        while p >= 0:
            visible[i, 7 + p], p = True, parents[p]
    depth = torch.tensor([[0, 1, 1, 2, 3]]) + 7
    out = {}
    try:
        for build in ("avx2", "emulate"):
            monkeypatch.setenv("CASTSPEC_NATIVE", build)
            native.library.cache_clear()
            if native.library() is None:
                pytest.fail(f"the {build} native library did not build or load; see the warning")
            target = native_target(make_hf(cfg, seed=3), dtype)
            with torch.inference_mode():
                cache = target.new_cache(16)
                first, _ = target(prompt, torch.arange(7).view(1, -1), cache, 0, causal=True)
                logits, _ = target(tree, depth, cache, 7, mask=visible.view(1, 1, 5, 12))
            assert target.backend.active
            out[build] = (first, logits, cache.k.clone(), cache.v.clone())
    finally:
        native.library.cache_clear()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for got, want in zip(out["avx2"], out["emulate"]):
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * max(want.abs().max().item(), 1))
