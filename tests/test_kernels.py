"""The packed CPU linear: same results as F.linear, and never stale after an in-place weight update."""
import pytest
import torch
import torch.nn.functional as F

from castspec.kernels import WeightPack, linear, packing_available


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_packed_linear_matches_f_linear(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(40, 24, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype)
    x = torch.randn(2, rows, 24, generator=g).to(dtype)
    pack = WeightPack()
    with torch.inference_mode():
        out = linear(x, w, b, pack)
    assert out.shape == (2, rows, 40) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), F.linear(x, w, b).float(), rtol=tol, atol=tol)
    assert (pack.get(w) is not None) == packing_available()


def test_pack_follows_in_place_updates_through_views():
    fused = torch.randn(30, 16)
    part = fused[10:20]  # like k_proj.weight inside the fused q|k|v matrix
    pack = WeightPack()
    x = torch.randn(4, 16)
    with torch.no_grad():
        before = linear(x, part, None, pack)
        fused[10:20] += 1.0  # an optimizer step or a checkpoint load through another alias
        after = linear(x, part, None, pack)
    torch.testing.assert_close(after, F.linear(x, part), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, after)


def test_gradients_bypass_the_pack():
    w = torch.randn(8, 4, requires_grad=True)
    out = linear(torch.randn(3, 4), w, None, WeightPack())
    out.sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0
