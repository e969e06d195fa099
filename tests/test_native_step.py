"""The single-token decode step in native code (castspec/csrc/step.c) against the torch forward."""
import logging

import pytest
import torch

from castspec import native
from castspec.models.native_step import NativeStep
from conftest import llama_config, make_hf
from conftest import native as native_target
from conftest import qwen3_config

needs_native = pytest.mark.skipif(native.library() is None, reason="no AVX-512 BF16 CPU or no C compiler here")

CONFIGS = {
    "llama-tied-rope-scaling": lambda: llama_config(rope_scaling=True),
    "qwen3-untied-qk-norm": lambda: qwen3_config(head_dim=32),
}


def _torch_only(target):
    target._native_step = None  # what _single_token reads: "does not apply"


def _prefilled(target, ids):
    cache = target.new_cache(64)
    target(ids, torch.arange(ids.shape[1]).view(1, -1), cache, 0, causal=True)
    return cache


@needs_native
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
        assert isinstance(fast._native_step, NativeStep) and fast._native_step.checked
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(c_fast.k, c_ref.k, rtol=tol, atol=tol)
        torch.testing.assert_close(c_fast.v, c_ref.v, rtol=tol, atol=tol)


@needs_native
def test_native_step_applies_only_where_it_can(monkeypatch):
    with torch.inference_mode():
        assert NativeStep.for_decoder(native_target(make_hf(llama_config()))) is not None
        assert NativeStep.for_decoder(native_target(make_hf(qwen3_config(head_dim=24)))) is None  # not 16k
        target = native_target(make_hf(llama_config()))
        target.new_cache(8)
        target._native_step = NativeStep.for_decoder(target)
        target.to("cpu")  # weights may have moved: the pointers are looked up again
        assert target._native_step is False
        monkeypatch.setattr(native, "library", lambda: None)
        assert NativeStep.for_decoder(target) is None


@needs_native
def test_native_step_reports_overflow():
    target = native_target(make_hf(llama_config()))
    cache = target.new_cache(4)
    with torch.inference_mode(), pytest.raises(ValueError, match="KV cache overflow"):
        target(torch.tensor([[1]]), torch.tensor([[4]]), cache, 4)


@needs_native
def test_disagreeing_native_step_turns_itself_off(monkeypatch, caplog):
    """The first native step is compared with torch's; a wrong one is reported once and never used."""
    calls = []

    def broken(self, token, position, cache, slot, taps=()):
        calls.append(slot)
        return torch.zeros(self._model.vocab), None

    monkeypatch.setattr(NativeStep, "__call__", broken)
    target, ref = native_target(make_hf(llama_config(), seed=3)), native_target(make_hf(llama_config(), seed=3))
    _torch_only(ref)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.inference_mode(), caplog.at_level(logging.WARNING, logger="castspec"):
        c1, c2 = _prefilled(target, prompt), _prefilled(ref, prompt)
        for slot in (5, 6):
            got, _ = target(torch.tensor([[9]]), torch.tensor([[slot]]), c1, slot)
            want, _ = ref(torch.tensor([[9]]), torch.tensor([[slot]]), c2, slot)
            torch.testing.assert_close(got, want)
    assert calls == [5] and target._native_step is None
    assert "disagrees" in caplog.text
