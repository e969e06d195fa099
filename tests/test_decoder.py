"""The native decoder against transformers' own implementation (fp32, tight tolerance)."""
import pytest
import torch

from castspec.pack import pack_tree
from castspec.tree import Tree
from conftest import llama_config, make_hf, native, qwen3_config, random_drafter

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


def bf16_products_reference(hf):
    """transformers' model in float64 doing what a bf16 model does on the torch fallback (issue 16): weights
    rounded to bf16, every product's input rounded to bf16 as it enters it and its output rounded to bf16
    (bf16 F.linear / oneDNN); embeddings, residual stream, norms, RoPE, attention and softmax unrounded."""
    import copy

    ref = copy.deepcopy(hf).double()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.bfloat16().double())
    for m in ref.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(lambda mod, args: (args[0].bfloat16().double(),))
            m.register_forward_hook(lambda mod, args, out: out.bfloat16().double())
    return ref


@pytest.mark.parametrize("config", [lambda: llama_config(tie=False, attention_bias=True), lambda: llama_config(),
                                    qwen3_config], ids=["llama-bias", "llama-tied", "qwen3"])
def test_bf16_model_keeps_fp32_activations(config, monkeypatch):
    """A bf16 model means bf16 weights, not bf16 arithmetic: its hidden states (taps) and logits are fp32 (a
    residual stream in bf16 would leave every tap exactly representable in bf16) and follow a float64 reference
    that rounds only the products' inputs and outputs, within what one flip of a product's final rounding can
    leave (which rounding flips depends on the CPU's bf16 GEMM kernel, whose sums are ordered differently from
    the reference's)."""
    import castspec.native.linear as linear_mod

    # every product through bf16 F.linear / oneDNN, whose outputs the reference rounds as they do (the compiled
    # single-row reduction and the native kernels keep fp32 sums: exact products, another reference)
    monkeypatch.setattr(linear_mod, "skinny_linear", lambda x, w: None)
    monkeypatch.setattr(linear_mod, "compiled_rowdot", lambda: None)
    hf = make_hf(config())
    ref = bf16_products_reference(hf)
    model = native(hf, dtype=torch.bfloat16)
    model.backend.use_torch()
    T = 23
    ids = torch.randint(0, hf.config.vocab_size, (1, T))
    with torch.no_grad():
        want = ref(ids, output_hidden_states=True)
    logits, taps = model(ids, torch.arange(T)[None], model.new_cache(T + 1), 0, causal=True, taps=(2, 0))
    assert logits.dtype == taps.dtype == torch.float32
    assert (taps == taps.bfloat16().float()).float().mean() < 0.5  # bf16 activations: all of them
    tol = 2 ** -7 * want.logits.abs().max().item()  # one bf16 ulp at the largest logit
    torch.testing.assert_close(logits.double(), want.logits, rtol=0, atol=tol)
    H = hf.config.hidden_size
    for j, layer in enumerate((2, 0)):  # (HF's last hidden state is after the final norm)
        tap_want = want.hidden_states[layer + 1]
        torch.testing.assert_close(taps[..., j * H:(j + 1) * H].double(), tap_want, rtol=0,
                                   atol=2 ** -7 * tap_want.abs().max().item())
    cache = model.new_cache(T + 1)  # a single decode row after a prefill: the same logits
    model(ids[:, :-1], torch.arange(T - 1)[None], cache, 0, causal=True)
    last, _ = model(ids[:, -1:], torch.tensor([[T - 1]]), cache, T - 1)
    torch.testing.assert_close(last[0, 0].double(), want.logits[0, -1], rtol=0, atol=tol)


def test_rope_tables_stay_fp32_through_conversions():
    hf = make_hf(llama_config(rope_scaling=True))
    fp32 = native(hf)
    cos, sin = fp32.rope.cos.clone(), fp32.rope.sin.clone()
    for model in (native(hf, dtype=torch.bfloat16), native(hf).to(torch.bfloat16), native(hf).bfloat16(),
                  native(hf).half(), native(hf).to(torch.float64).to(torch.bfloat16)):
        assert model.rope.cos.dtype == model.rope.sin.dtype == torch.float32
        assert torch.equal(model.rope.cos, cos) and torch.equal(model.rope.sin, sin)
    drafter = random_drafter(fp32).to(torch.bfloat16)
    assert drafter.rope.cos.dtype == torch.float32 and drafter.converted(torch.bfloat16).rope.sin.dtype == torch.float32


def test_linear_rounds_inputs_and_returns_the_activations_dtype():
    from castspec.native.linear import WeightPack, linear

    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 40, generator=g).bfloat16()
    bias = torch.randn(24, generator=g).bfloat16()
    for rows in (1, 5):
        x = torch.randn(rows, 40, generator=g)
        exact = x.bfloat16().double() @ w.double().T  # the product of the rounded input
        with torch.inference_mode():
            out = linear(x, w, None, WeightPack())
            with_bias = linear(x, w, bias, WeightPack())
            bf16_in = linear(x.bfloat16(), w, None, WeightPack())
        assert out.dtype == with_bias.dtype == torch.float32 and bf16_in.dtype == torch.bfloat16
        # the product's output is at most rounded to bf16 (kernels that keep fp32 sums are closer)
        assert ((out.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-6).all()
        assert torch.equal(with_bias, out + bias.float())  # the bias added in fp32
        assert torch.equal(bf16_in.float(), out.bfloat16().float()) or \
            ((bf16_in.double() - exact).abs() <= 2 ** -7 * exact.abs() + 1e-6).all()
    # training: gradients through the rounding, in each tensor's own dtype
    x = torch.randn(3, 40, generator=g, requires_grad=True)
    wp = torch.nn.Parameter(w.clone())
    y = linear(x, wp, bias)
    assert y.dtype == torch.float32
    y.square().sum().backward()
    assert x.grad.dtype == torch.float32 and wp.grad.dtype == torch.bfloat16 and x.grad.abs().sum() > 0


def test_bf16_drafter_keeps_fp32_rows():
    """The drafter follows the same rule: fp32 block rows and features in, fp32 hidden states out, within
    product rounding of the fp32 drafter that has the same (bf16-rounded) weights."""
    target = native(make_hf(llama_config()))
    fp32 = random_drafter(target)
    fp32 = fp32.converted(torch.bfloat16).converted(torch.float32)  # weights exactly bf16-representable
    bf16 = fp32.converted(torch.bfloat16)
    T, L = 6, 4
    feats = torch.randn(1, T, fp32.fc.weight.shape[1])
    emb = target.embed(torch.randint(0, target.cfg.vocab_size, (1, L)))
    pos, ctx_pos = torch.arange(T, T + L)[None], torch.arange(T)[None]
    want = fp32(emb, pos, feats, ctx_pos, fp32.new_cache(T + L))
    got = bf16(emb, pos, feats, ctx_pos, bf16.new_cache(T + L))
    assert emb.dtype == got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=3e-2 * want.abs().max().item())
    lp = bf16.draft_logprobs(got[0], target)
    assert lp.dtype == torch.float32 and torch.isfinite(lp).all()
