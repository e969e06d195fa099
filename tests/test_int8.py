"""The drafter's int8 products (csrc/gemm.c's gemm_i8_f32, on AMX-INT8 or AVX-512 VNNI): exact against an integer
reference for 1-64 rows on either unit (so the same bits on both), each row's result its own, and a bf16 drafter's
native pass on int8 weights where the CPU has them."""
from __future__ import annotations

import logging

import pytest
import torch

from castspec.native import build as native
from castspec.native import forward as native_forward
from castspec.native.forward import NativeDraft
from castspec.native.pack import int8_product, pack_int8, quantize
from castspec.sequence import DraftState, propose_batch
from conftest import llama_config, make_hf
from conftest import native as native_target
from conftest import random_drafter
from native_support import native_library


@pytest.fixture(params=["amx", "avx512-vnni"])
def int8_lib(request, monkeypatch):
    """The library with its int8 products on AMX tiles, or on AVX-512 VNNI (CASTSPEC_AMX=0), where they run."""
    monkeypatch.setenv("CASTSPEC_AMX", "1" if request.param == "amx" else "0")
    for lib in native_library(monkeypatch):
        if request.param == "amx" and not lib.gemm_amx_on():
            pytest.skip("no AMX here")
        if not native.int8_products():
            pytest.skip(f"no int8 products on {request.param} here (CASTSPEC_DRAFT_INT8 not 0, the avx512 build, "
                        "AMX-INT8 or AVX-512 VNNI)")
        yield lib


def product(lib, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    M, I = x.shape
    panels, sw, sums = pack_int8(w, lib.gemm_panel_group())
    qx, sx = quantize(x)
    xq = torch.zeros(-(-M // 16) * 16, I, dtype=torch.int8)  # whole groups of 16 rows, as AMX tiles read them
    xq[:M] = qx
    out = torch.empty(M, w.shape[0])
    lib.gemm_i8_f32(panels.data_ptr(), sw.data_ptr(), sums.data_ptr(), xq.data_ptr(), sx.data_ptr(), out.data_ptr(),
                    M, w.shape[0], I, I, w.shape[0])
    return out


@pytest.mark.parametrize("rows", [1, 3, 8, 16, 17, 32, 33, 64])
@pytest.mark.parametrize("shape", [(40, 64), (200, 128), (576, 576), (1536, 576), (576, 1536)])
def test_int8_products_equal_the_integer_reference(int8_lib, rows, shape):
    O, I = shape
    g = torch.Generator().manual_seed(rows * 7 + O)
    x, w = torch.randn(rows, I, generator=g) * 3, torch.randn(O, I, generator=g)
    x[0] = 0.0  # a zero row: scale 0, zeros out
    got = product(int8_lib, x, w)
    assert torch.equal(got, int8_product(x, w))
    assert torch.equal(got[0], torch.zeros(O))
    for r in (0, rows // 2, rows - 1):  # each row's bits are its own, wherever it sits
        assert torch.equal(product(int8_lib, x[r:r + 1], w)[0], got[r])


@pytest.mark.parametrize("group", [1, 3])
def test_int8_panels_interleave_in_groups(group):
    """The int8 layout: element [g, p, j, c, k] is column 16 * (g * group + j) + c's quantized weight for input
    4 * p + k, and zero past the weight's columns (up to whole groups of panels)."""
    w = torch.randn(37, 64)
    packed, _, _ = pack_int8(w, group)
    q, _ = quantize(w)
    groups = -(-37 // (16 * group))
    assert packed.shape == (groups, 16, group, 16, 4)
    for g, p, j, c, k in [(0, 0, 0, 0, 0), (0, 9, group - 1, 5, 3), (groups - 1, 15, group - 1, 15, 1)]:
        row = 16 * (g * group + j) + c
        assert packed[g, p, j, c, k] == (q[row, 4 * p + k] if row < 37 else 0)


def test_int8_quantize_rounds_half_to_even_and_saturates():
    q, s = quantize(torch.tensor([[127.0, 0.5, 1.5, -2.5, -127.0]]))
    assert s.item() == 1.0 and q.tolist() == [[127, 0, 2, -2, -127]]


def _drafting(target, drafter, g, rounds=3):
    """Two requests drafted in one pass for a few rounds: each round's marginals."""
    width = len(drafter.cfg.target_layer_ids) * target.cfg.hidden_size
    states = (DraftState(drafter, 64), DraftState(drafter, 64))
    out = []
    for new_rows in ((6, 2), (1, 4), (3, 1))[:rounds]:
        for st, n in zip(states, new_rows):
            st.add_context(torch.randn(1, n, width, generator=g).to(drafter.dtype))
        out.append(propose_batch(target, drafter, list(states), [5, 9], [5, 4]))
    return out


def _int8_drafter(target):
    d = random_drafter(target, block_size=6, inter=128).converted(torch.bfloat16)  # every input width 64k
    d.set_draft_vocab(torch.arange(0, 64, 2))
    return d


def test_int8_drafter_pass_follows_its_bf16_weights(int8_lib):
    """A bf16 drafter's native pass on int8 weights proposes what its torch forward (bf16 weights) does up to the
    int8 rounding, and its one-call pass gives the bits of the block and then the head."""
    target = native_target(make_hf(llama_config(vocab=64), seed=1), torch.bfloat16)
    fast, ref, split = (_int8_drafter(target) for _ in range(3))
    ref.backend.use_torch()
    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(split, "propose_segments", lambda target, ids, *a: split.block_marginals(
            split.forward_segments(target.embed(ids), *a[:-1])[0], a[-1], target))
        rounds = [_drafting(target, m, torch.Generator().manual_seed(4)) for m in (fast, ref, split)]
    assert isinstance(fast.backend.built, NativeDraft) and fast.backend.built.int8 and fast.backend.checked
    for got, want, two_calls in zip(*rounds):
        for a, b, c in zip(got, want, two_calls):
            assert torch.equal(a.support, b.support)
            assert torch.equal(a.on_support, c.on_support)
            torch.testing.assert_close(a.on_support.exp(), b.on_support.exp(), rtol=0, atol=0.03)


def test_int8_off_keeps_bf16_weights(int8_lib, monkeypatch):
    monkeypatch.setenv("CASTSPEC_DRAFT_INT8", "0")
    target = native_target(make_hf(llama_config(vocab=64), seed=1), torch.bfloat16)
    d = _int8_drafter(target)
    with torch.inference_mode():
        _drafting(target, d, torch.Generator().manual_seed(4), rounds=1)
    assert isinstance(d.backend.built, NativeDraft) and not d.backend.built.int8


def test_an_int8_pass_that_strays_falls_back_to_bf16_weights(int8_lib, monkeypatch, caplog):
    """A drafter whose int8 pass strays from its torch forward by more than the self-test allows (here: a
    tolerance of zero) keeps a native pass on its bf16 weights, not torch."""
    monkeypatch.setattr(native_forward, "INT8_TOLERANCE", 0.0)
    target = native_target(make_hf(llama_config(vocab=64), seed=1), torch.bfloat16)
    d = _int8_drafter(target)
    with torch.inference_mode(), caplog.at_level(logging.WARNING, logger="castspec"):
        _drafting(target, d, torch.Generator().manual_seed(4), rounds=1)
    assert isinstance(d.backend.built, NativeDraft) and not d.backend.built.int8 and d.backend.checked
    assert "drafter pass on int8 weights disagrees" in caplog.text and "using torch" not in caplog.text


def test_the_floor_of_an_int8_pass_counts_one_byte_a_weight(int8_lib, monkeypatch):
    """floor.draft_cost of a drafter whose native pass is on int8 weights: the weights' bytes halve (bf16 -> int8),
    the cache's stay, and the products count half their FLOPs."""
    from castspec.floor import _kv_bytes, draft_cost

    target = native_target(make_hf(llama_config(vocab=64), seed=1), torch.bfloat16)
    costs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("CASTSPEC_DRAFT_INT8", flag)
        d = _int8_drafter(target)
        with torch.inference_mode():
            _drafting(target, d, torch.Generator().manual_seed(4), rounds=1)
        assert d.backend.built.int8 == (flag == "1")
        costs[flag] = draft_cost(d, target, 20, 2, 3)
    kv = 2 * _kv_bytes(d.cfg, d.dtype, 20)
    assert costs["0"].nbytes - kv == 2 * (costs["1"].nbytes - kv)
    assert costs["1"].flops < costs["0"].flops
