"""Forwards of a few rows in native code (castspec/native/csrc/step.c) against the torch forward: decode steps,
causal prefill chunks, packed trees; and the drafter's block pass (csrc/draft.c). The real library on AVX-512
BF16 CPUs, the emulated one elsewhere (native_support); tiny models, since the emulated code is slow."""
import copy
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


@pytest.fixture
def lib(monkeypatch):
    yield from native_library(monkeypatch)


CONFIGS = {
    "llama-tied-rope-scaling": lambda: llama_config(rope_scaling=True),
    "qwen3-untied-qk-norm": lambda: qwen3_config(head_dim=32),
}


def _torch_only(model):
    model.backend.use_torch()
    return model


def _prefilled(target, ids):
    cache = target.new_cache(64)
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
        torch.testing.assert_close(c_fast.k, c_ref.k, rtol=tol, atol=tol)
        torch.testing.assert_close(c_fast.v, c_ref.v, rtol=tol, atol=tol)


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
        for width in (1, 5, native_step.max_rows(dtype) - 1):
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


@pytest.mark.usefixtures("lib")
def test_forwards_beyond_the_row_limit_run_on_torch(monkeypatch):
    calls = []
    real = NativeStep.__call__
    target = native_target(make_hf(llama_config()))
    with torch.inference_mode():
        cache = target.new_cache(64)

        def counted(self, ids, positions, segments, *args, **kwargs):
            if segments[0].cache is cache:  # not the build-time self-test
                calls.append(ids.numel())
            return real(self, ids, positions, segments, *args, **kwargs)

        monkeypatch.setattr(NativeStep, "__call__", counted)
        n = native_step.max_rows(target.dtype) + 1
        target(torch.arange(n).view(1, -1) % 40, torch.arange(n).view(1, -1), cache, 0, causal=True)
        target(torch.tensor([[3]]), torch.tensor([[n]]), cache, n)
    assert calls == [1]


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
    width = len(fast.cfg.target_layer_ids) * target.cfg.hidden_size
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    with torch.inference_mode():
        # two requests drafted in one pass (serving), with different context lengths and depths
        states = {m: (DraftState(m, 64), DraftState(m, 64)) for m in (fast, ref)}
        for new_rows in ((6, 2), (1, 4), (3, 1)):
            feats = [torch.randn(1, n, width, generator=g).to(dtype) for n in new_rows]
            for pair in states.values():
                for st, f in zip(pair, feats):
                    st.add_context(f)
            got, want = (propose_batch(target, m, list(pair), [5, 9], [5, 4]) for m, pair in states.items())
            for a, b in zip(got, want):
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


def test_portable_build_runs_decode_steps_and_leaves_trees_to_torch(monkeypatch):
    """CASTSPEC_NATIVE=portable (simde built for this CPU's own vector ISA): the library builds and passes its
    checks, decode steps run natively and agree with torch, forwards of several rows stay on torch."""
    if not native.emulation_available():
        pytest.skip("no simde headers (libsimde-dev)")
    monkeypatch.setenv("CASTSPEC_NATIVE", "portable")
    native.library.cache_clear()
    try:
        if native.library() is None:
            pytest.fail("the portable native library did not build or load; see the warning")
        assert native_step.max_rows(torch.float32) == 1
        cfg = CONFIGS["qwen3-untied-qk-norm"]()
        fast, ref = native_target(make_hf(cfg, seed=3)), _torch_only(native_target(make_hf(cfg, seed=3)))
        calls = []
        run = NativeStep.run
        monkeypatch.setattr(NativeStep, "run", lambda self, *a: calls.append(a[0].numel()) or run(self, *a))
        prompt = torch.randint(0, cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            c_fast, c_ref = _prefilled(fast, prompt), _prefilled(ref, prompt)
            assert calls == []  # a prefill chunk of 6 rows: torch
            for slot in range(6, 10):
                tok = torch.tensor([[slot % cfg.vocab_size]])
                pos = torch.tensor([[slot]])
                got, _ = fast(tok, pos, c_fast, slot)
                want, _ = ref(tok, pos, c_ref, slot)
                torch.testing.assert_close(got, want, rtol=0, atol=1e-3 * want.abs().max().item())
        # the build's self-test forwards count too: every native forward was a single row
        assert fast.backend.active and len(calls) >= 4 and set(calls) == {1}
    finally:
        native.library.cache_clear()
