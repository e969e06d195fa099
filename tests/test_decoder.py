"""The native decoder against transformers' own implementation (fp32, tight tolerance)."""
import pytest
import torch

from castspec.pack import pack_tree
from castspec.tree import Tree
from conftest import llama_config, make_hf, native, qwen3_config

CONFIGS = {
    "llama-tied": lambda: llama_config(tie=True),
    "llama-rope-scaling": lambda: llama_config(rope_scaling=True),
    "llama-untied": lambda: llama_config(tie=False),
    "qwen3-untied": lambda: qwen3_config(),
}


@pytest.fixture(params=list(CONFIGS), scope="module")
def pair(request, device):
    hf = make_hf(CONFIGS[request.param](), device=device)
    return hf, native(hf)


def test_prefill_logits_and_taps_match_transformers(pair):
    hf, model = pair
    ids = torch.randint(0, hf.config.vocab_size, (2, 23)).to(model.device)
    ref = hf(ids, output_hidden_states=True)
    logits, taps = model(ids, torch.arange(23, device=model.device).expand(2, -1), model.new_cache(32, batch=2), 0, causal=True,
                         taps=(2, 0))
    torch.testing.assert_close(logits, ref.logits, rtol=1e-5, atol=1e-5)
    H = hf.config.hidden_size
    torch.testing.assert_close(taps[..., :H], ref.hidden_states[3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(taps[..., H:], ref.hidden_states[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", [1, 7, 40])
def test_cached_decoding_matches_full_forward(pair, split):
    hf, model = pair
    dev = model.device
    ids = torch.randint(0, hf.config.vocab_size, (1, 48)).to(dev)
    ref = hf(ids).logits
    cache = model.new_cache(64)
    model(ids[:, :split], torch.arange(split, device=dev)[None], cache, 0, causal=True)
    rows = []
    for t in range(split, 48):
        lg, _ = model(ids[:, t:t + 1], torch.tensor([[t]], device=dev), cache, t)
        rows.append(lg)
    torch.testing.assert_close(torch.cat(rows, 1), ref[:, split:], rtol=1e-5, atol=1e-5)


def test_packed_tree_equals_separate_forwards(pair):
    """Lemma 1: with the ancestor-only mask each packed node's logits equal a plain forward over its path."""
    hf, model = pair
    V = hf.config.vocab_size
    dev = model.device
    prefix = torch.randint(0, V, (1, 11)).to(dev)
    P = prefix.shape[1]
    tree = Tree(tokens=[5, 9, 3, 7, 1, 2, 8], parents=[-1, -1, 0, 0, 2, 1, 4], depths=[1, 1, 2, 2, 3, 2, 4],
                scores=[0.0] * 7)
    root = 4
    cache = model.new_cache(P + 16)
    model(prefix, torch.arange(P, device=dev)[None], cache, 0, causal=True)
    pack = pack_tree(tree, root, P, dev)
    packed, _ = model(pack.ids, pack.positions, cache, P, mask=pack.mask)
    for row in range(len(tree) + 1):
        path = []
        r = row
        while r > 0:
            path.append(tree.tokens[r - 1])
            r = tree.parents[r - 1] + 1
        seq = torch.cat([prefix, torch.tensor([[root, *reversed(path)]], device=dev)], dim=1)
        ref = hf(seq).logits[0, -1]
        torch.testing.assert_close(packed[0, row], ref, rtol=1e-5, atol=1e-5)


def test_spelled_out_kv_heads_equal_grouped_attention():
    """The CUDA path for masked rows expands key/value heads instead of asking SDPA for grouped heads."""
    import torch.nn.functional as F

    from castspec.models.layers import repeat_kv

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 5, 8, generator=g)
    k, v = torch.randn(1, 2, 9, 8, generator=g), torch.randn(1, 2, 9, 8, generator=g)
    mask = torch.rand(1, 1, 5, 9, generator=g) > 0.4
    mask[..., 0] = True  # every row sees at least one slot
    grouped = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    spelled = F.scaled_dot_product_attention(q, repeat_kv(k, 3), repeat_kv(v, 3), attn_mask=mask)
    torch.testing.assert_close(spelled, grouped, rtol=1e-6, atol=1e-6)
    # and against attention written out per head: query head i reads key/value head i // 3
    for h in range(6):
        w = (q[0, h] @ k[0, h // 3].T / 8 ** 0.5).masked_fill(~mask[0, 0], float("-inf")).softmax(-1)
        torch.testing.assert_close(spelled[0, h], w @ v[0, h // 3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", [lambda: llama_config(tie=False, attention_bias=True), qwen3_config],
                         ids=["llama-bias", "qwen3"])
def test_converting_a_built_model_keeps_its_fused_weights(config):
    """`.to(dtype)` after building: the fused q|k|v and gate|up matrices follow the converted Parameters (the
    forward reads the fused ones), so the result equals a model built in that dtype from the start."""
    hf = make_hf(config())
    converted = native(hf).to(torch.float64).to(torch.bfloat16)
    built = native(hf, dtype=torch.bfloat16)
    layer = converted.model.layers[0]
    assert layer.self_attn.qkv_weight.dtype == torch.bfloat16
    assert layer.self_attn.q_proj.weight.data_ptr() == layer.self_attn.qkv_weight.data_ptr()
    assert layer.mlp.up_proj.weight.data_ptr() != layer.mlp.gate_up_weight.data_ptr()  # a view at its offset
    ids = torch.randint(0, hf.config.vocab_size, (1, 9))
    pos = torch.arange(9)[None]
    got, _ = converted(ids, pos, converted.new_cache(16), 0, causal=True)
    want, _ = built(ids, pos, built.new_cache(16), 0, causal=True)
    assert torch.equal(got, want)
