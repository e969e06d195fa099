"""castspec/graphs.py: width buckets, padded static-shape forwards and their CUDA graphs.

On CPU the padded forwards run eagerly (what a CUDA graph replays, minus the capture), and in fp32 they give the
unpadded torch forward's bits for the real rows (where torch's own kernels are row-invariant, else its
rounding): logits, tapped features and the keys/values they write. With
`--device cuda` the same tests capture and replay CUDA graphs and compare within rounding.
"""
import functools

import pytest
import torch
import torch.nn.functional as F

from castspec.config import ConfigError, DecodeConfig
from castspec.decode import decode
from castspec.graphs import DEFAULT_BUCKETS, GraphConfig, enable
from castspec.models.dflash import DraftSegment
from castspec.models.kvcache import Segment
from castspec.models.layers import folded_attention
from castspec.pack import pack_tree
from castspec.round import run_round
from castspec.sequence import Sequence
from castspec.tree import build_tree
from conftest import llama_config, make_hf, native, qwen3_config, random_drafter

TAPS = (0, 2)


def test_buckets_and_key_lengths():
    cfg = GraphConfig()
    assert cfg.buckets == DEFAULT_BUCKETS == (1, 2, 4, 8, 16, 32, 64)
    assert [cfg.bucket(n) for n in (1, 2, 3, 5, 8, 9, 33, 63, 64)] == [1, 2, 4, 8, 8, 16, 64, 64, 64]
    assert cfg.bucket(65) is None and cfg.bucket(0) is None  # beyond the largest: eager
    odd = GraphConfig(buckets=(1, 3, 10), key_step=100)
    assert [odd.bucket(n) for n in (1, 2, 3, 4, 10, 11)] == [1, 3, 3, 10, 10, None]
    assert [odd.key_length(n, 250) for n in (1, 100, 101, 201)] == [100, 100, 200, 250]
    assert not cfg.active("cpu") and not cfg.active("cuda")  # off until validated on a GPU
    auto = GraphConfig(mode="auto")
    assert not auto.active("cpu") and auto.active("cuda")  # auto: CUDA only, so CPU defaults are unchanged
    assert GraphConfig(mode="on").active("cpu") and not GraphConfig(mode="off").active("cuda")
    for bad in (dict(buckets=()), dict(buckets=(2, 2)), dict(buckets=(4, 2)), dict(buckets=(0, 1)),
                dict(mode="always"), dict(key_step=0), dict(warmup=0), dict(max_context=-1)):
        with pytest.raises(ConfigError, match="graph"):
            GraphConfig(**bad)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request, device):
    cfg = llama_config(vocab=48) if request.param == "llama" else qwen3_config(vocab=48)
    return native(make_hf(cfg, seed=1, device=device))


@functools.lru_cache(maxsize=None)
def torch_rows_invariant() -> bool:
    """Whether torch's fp32 CPU kernels give a row the same bits whatever the row count, for the shapes of these
    tests: a padded forward can only match the unpadded one bit for bit where they do. Some CPUs' BLAS picks
    another kernel for 3 rows than for 4 (seen on an AMD EPYC with AVX-512; each within rounding)."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(64, 64, generator=g), torch.randn(8, 64, generator=g)
    q, kv = torch.randn(1, 4, 8, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g)
    for m in (1, 3, 5):
        if not torch.equal(F.linear(x[:m], w), F.linear(x[:m + 1], w)[:m]):
            return False
        alone = F.scaled_dot_product_attention(q[:, :, :m], kv, kv, enable_gqa=True)
        if not torch.equal(alone, F.scaled_dot_product_attention(q[:, :, :m + 1], kv, kv, enable_gqa=True)[:, :, :m]):
            return False
    return True


def exact(device) -> dict:
    """Bit for bit on CPU where torch's kernels are row-invariant; within rounding on other CPUs and on CUDA,
    whose kernels tile a forward by its shape."""
    if device.type == "cpu":
        return dict(rtol=0, atol=0) if torch_rows_invariant() else dict(rtol=1e-5, atol=1e-6)
    return dict(rtol=1e-4, atol=1e-4)


def prefilled(target, prompt, cache):
    P = prompt.shape[1]
    pos = torch.arange(P, device=target.device)[None]
    target._torch_forward(prompt, pos, [Segment(cache, 0, P, None, True)], slice(0, 0), ())
    cache.length = P


def ordinary_cache(target, capacity):
    runner, target.graphs = target.graphs, None
    try:
        return target.new_cache(capacity)
    finally:
        target.graphs = runner


def pack_of(n, prefix, device, seed):
    """A best-first tree of n - 1 nodes behind root 5 (n = 1: a lone decode row, no mask)."""
    if n == 1:
        return (torch.tensor([[5]], device=device), torch.tensor([[prefix]], device=device), None)
    g = torch.Generator().manual_seed(seed)
    tree = build_tree(torch.log_softmax(torch.randn(16, 48, generator=g) * 3, -1), n - 1, 4)
    pack = pack_tree(tree, 5, prefix, device)
    return pack.ids, pack.positions, pack.mask


# n = 33 is left out: torch's CPU attention cuts its queries into blocks of 32 and computes a lone last row
# on another path, so the unpadded 33-row forward itself rounds row 32 differently from any forward with more
# rows (test_a_lone_tail_row_is_torch_rounding); every other count keeps the unpadded forward's bits
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 16, 17, 31, 40, 64])
def test_padded_verify_equals_unpadded_forward(target, device, n):
    enable(target, None, GraphConfig(mode="on", key_step=1))
    P, cap = 37, 200
    prompt = torch.randint(0, 48, (1, P), generator=torch.Generator().manual_seed(n)).to(device)
    with torch.inference_mode():
        lent, ref = target.new_cache(cap), ordinary_cache(target, cap)
        assert target.graphs._holds(lent) and not target.graphs._holds(ref)
        for c in (lent, ref):
            prefilled(target, prompt, c)
        lent.k[:, :, :, P:] = 7.0  # stale entries past the prefix must stay invisible to real rows
        lent.v[:, :, :, P:] = -7.0
        before = lent.k.clone()
        ids, pos, mask = pack_of(n, P, device, seed=n)
        got = target.forward_segments(ids, pos, [Segment(lent, P, n, mask)], None, TAPS)
        want = target._torch_forward(ids, pos, [Segment(ref, P, n, mask)], None, TAPS)
    b = GraphConfig().bucket(n)
    assert target.graphs.counts.padded == {b: 1}
    assert got[0].shape == want[0].shape == (1, n, 48) and got[1].shape == want[1].shape
    torch.testing.assert_close(got[0], want[0], **exact(device))
    torch.testing.assert_close(got[1], want[1], **exact(device))
    # the real rows' keys/values, and nothing outside [start, start + bucket) was written
    torch.testing.assert_close(lent.k[:, :, :, :P + n], ref.k[:, :, :, :P + n], **exact(device))
    torch.testing.assert_close(lent.v[:, :, :, :P + n], ref.v[:, :, :, :P + n], **exact(device))
    assert torch.equal(lent.k[:, :, :, P + b:], before[:, :, :, P + b:])
    # what the rows saw: real rows the caller's mask and no padded slot, padded rows slot 0 alone
    (entry,) = target.graphs._entries.values()
    visible = entry.inputs["mask"][0, 0]
    want_visible = torch.ones(n, P + n, dtype=torch.bool, device=device) if mask is None else mask[0, 0]
    assert torch.equal(visible[:n, :P + n], want_visible) and not visible[:n, P + n:].any()
    assert visible[n:, 0].all() and not visible[n:, 1:].any()


def test_a_lone_tail_row_is_torch_rounding(device):
    """Why n = 33 is not compared bit for bit above: torch's CPU attention gives a 33rd query row other bits
    alone in its block than beside 31 more rows, with the same keys and mask (the padded forward puts it beside
    them; either is the row's attention within fp32 rounding)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 64, 16, generator=g).to(device)
    k, v = torch.randn(1, 2, 100, 16, generator=g).to(device), torch.randn(1, 2, 100, 16, generator=g).to(device)
    mask = (torch.rand(1, 1, 64, 100, generator=g) > 0.3).to(device)
    mask[..., 0] = True
    alone = F.scaled_dot_product_attention(q[:, :, :33], k, v, attn_mask=mask[:, :, :33], enable_gqa=True)
    beside = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)[:, :, :33]
    torch.testing.assert_close(alone, beside, rtol=1e-5, atol=1e-6)


def test_rounded_key_lengths_hide_the_tail(target, device):
    """key_step > 1 attends over more slots than the rows need: the extra ones (stale, here huge) are masked."""
    enable(target, None, GraphConfig(mode="on", key_step=64))
    P, n = 37, 9
    prompt = torch.randint(0, 48, (1, P), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.inference_mode():
        lent, ref = target.new_cache(200), ordinary_cache(target, 200)
        for c in (lent, ref):
            prefilled(target, prompt, c)
        lent.k[:, :, :, P:] = 1e4
        lent.v[:, :, :, P:] = 1e4
        ids, pos, mask = pack_of(n, P, device, seed=3)
        got, _ = target.forward_segments(ids, pos, [Segment(lent, P, n, mask)], None, ())
        want, _ = target._torch_forward(ids, pos, [Segment(ref, P, n, mask)], None, ())
    (entry,) = target.graphs._entries.values()
    assert entry.inputs["mask"].shape[-1] == 64  # 37 + 9 slots rounded up to the step
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_calls_the_runner_does_not_take_run_as_before(target, device):
    enable(target, None, GraphConfig(mode="on", buckets=(1, 2, 4)))
    P = 10
    prompt = torch.randint(0, 48, (1, P), generator=torch.Generator().manual_seed(4)).to(device)
    with torch.inference_mode():
        lent, other = target.new_cache(100), target.new_cache(100)
        assert target.graphs._holds(lent) and not target.graphs._holds(other)  # lent to one cache at a time
        pos = torch.arange(P, device=device)[None]
        target.forward_segments(prompt, pos, [Segment(lent, 0, P, None, True)], None, ())  # a causal prompt chunk
        lent.length = other.length = P
        ids, pos, mask = pack_of(6, P, device, seed=4)  # more rows than the largest bucket
        target.forward_segments(ids, pos, [Segment(lent, P, 6, mask)], None, ())
        ids, pos, mask = pack_of(3, P, device, seed=4)
        target.forward_segments(ids, pos, [Segment(other, P, 3, mask)], None, ())  # not the runner's cache
        target.forward_segments(ids, pos, [Segment(lent, P, 3, mask)], torch.tensor([2], device=device), ())
        assert target.graphs.counts.padded == {} and target.graphs.counts.declined == 4
        del lent
        again = target.new_cache(100)  # the lease ended with the last reference to the cache that held it
        assert target.graphs._holds(again)
        del again
        assert target.graphs.lend(target, target.cfg.max_positions + 1000, 1) is None  # longer than the storage
        assert target.graphs.lend(target, 100, 2) is None  # batched caches are never lent
        assert target.graphs.lend(target, 100, 1) is not None


def test_padded_drafter_pass_equals_unpadded(target, device):
    drafter = random_drafter(target, block_size=8, taps=list(TAPS), seed=2)
    enable(target, drafter, GraphConfig(mode="on", key_step=1))
    L, F_ = 8, len(TAPS) * target.cfg.hidden_size
    g = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        lent, ref = drafter.new_cache(100), drafter.new_cache(100)
        assert drafter.graphs._holds(lent) and not drafter.graphs._holds(ref)
        start = 0
        for ctx in (12, 3, 1, 5):  # the first pass after a prompt, then a round's committed rows
            feats = (torch.randn(1, ctx, F_, generator=g) * 3).to(device)
            emb = target.embed(torch.randint(0, 48, (1, L), generator=g).to(device))
            cpos = torch.arange(start, start + ctx, device=device)[None]
            bpos = torch.arange(start + ctx, start + ctx + L, device=device)[None]
            got = drafter.forward_segments(emb, bpos, feats, cpos, [DraftSegment(lent, start, ctx, L)])
            want = drafter._torch_forward(emb, bpos, feats, cpos, [DraftSegment(ref, start, ctx, L)])
            torch.testing.assert_close(got, want, **exact(device))
            assert lent.length == ref.length == start + ctx
            start += ctx
            torch.testing.assert_close(lent.k[:, :, :, :start], ref.k[:, :, :, :start], **exact(device))
            torch.testing.assert_close(lent.v[:, :, :, :start], ref.v[:, :, :, :start], **exact(device))
    assert drafter.graphs.counts.padded == {16: 1, 4: 1, 1: 1, 8: 1}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def models(request, device):
    cfg = llama_config(vocab=24) if request.param == "llama" else qwen3_config(vocab=24)
    target = native(make_hf(cfg, seed=1, device=device))
    return target, random_drafter(target, block_size=8, seed=2)


def run(target, drafter, prompt, **kw):
    kw.setdefault("max_new_tokens", 40)
    return [t for chunk in decode(target, drafter, prompt, DecodeConfig(**kw)) for t in chunk]


@pytest.mark.parametrize("key_step", [1, 16])
def test_greedy_decoding_with_graphs_equals_ar(models, device, key_step):
    target, drafter = models
    enable(target, drafter, GraphConfig(mode="auto"))  # captured graphs on CUDA, plain forwards elsewhere
    assert (target.graphs is not None) == (device.type == "cuda")
    prompts = [[5, 3, 8, 1, 9, 2, 2, 7, 4], [1, 2, 3], [7] * 70]
    ar = [run(target, None, p, method="ar") for p in prompts]
    enable(target, drafter, GraphConfig(mode="on", key_step=key_step))
    for p, want in zip(prompts, ar):
        for method, width, k in [("ar", "auto", 8), ("chain", "auto", 8), ("cast", 7, 8), ("cast", 63, 8),
                                 ("cast", 100, 8)]:  # 101 rows: beyond the largest bucket, eager
            out = run(target, drafter if method != "ar" else None, p, method=method, width=width,
                      top_k_per_position=k)
            assert out == want, (p, method, width)
    t, d = target.graphs.counts, drafter.graphs.counts
    assert {1, 8, 64} <= set(t.padded) and t.declined > 0  # ar, cast 7, cast 63; prompts and 101-row trees
    assert d.padded and d.declined > 0  # the 70-token prompt's first drafter pass is wider than 64 rows
    assert (t.captured > 0 and d.captured > 0) == (device.type == "cuda")
    enable(target, drafter, GraphConfig(mode="off"))
    assert target.graphs is None and drafter.graphs is None


def test_a_batch_beside_the_lent_cache_stays_exact(models, device):
    """In a ragged batch (the scheduler's rounds) the forwards run eagerly; one sequence holds the static cache."""
    target, drafter = models
    prompts = [[5, 3, 8, 1], [2, 2, 9]]
    ar = [run(target, None, p, method="ar", max_new_tokens=20) for p in prompts]
    enable(target, drafter, GraphConfig(mode="on"))
    from castspec.allocate import PolicySpec, make_policy

    cfg = DecodeConfig(method="cast", width=7, max_new_tokens=20)
    policy = make_policy(PolicySpec.for_request(cfg), 7, None, None)
    seqs = [Sequence(target, drafter, p, cfg, policy.max_nodes(7)) for p in prompts]
    assert target.graphs._holds(seqs[0].cache) and not target.graphs._holds(seqs[1].cache)
    outs = [[], []]
    with torch.inference_mode():
        while not all(s.done for s in seqs):
            for o, so in zip(outs, run_round(target, drafter, seqs, policy).sequences):
                o.extend(so.emitted)
    assert outs == ar
    enable(target, drafter, GraphConfig(mode="off"))


def test_folded_attention_equals_grouped_attention():
    """The CUDA path for masked grouped rows (models/layers.py): query heads folded into rows of their key/value
    head, against SDPA's own grouped heads and attention written out per head."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 5, 8, generator=g)
    k, v = torch.randn(1, 2, 9, 8, generator=g), torch.randn(1, 2, 9, 8, generator=g)
    mask = torch.rand(1, 1, 5, 9, generator=g) > 0.4
    mask[..., 0] = True
    folded = folded_attention(q, k, v, mask)
    grouped = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(folded, grouped, rtol=1e-6, atol=1e-6)
    for h in range(6):
        w = (q[0, h] @ k[0, h // 3].T / 8 ** 0.5).masked_fill(~mask[0, 0], float("-inf")).softmax(-1)
        torch.testing.assert_close(folded[0, h], w @ v[0, h // 3], rtol=1e-5, atol=1e-5)
