"""castspec.bench.llamacpp: the F32/BF16 rewrite of a GGUF (values and metadata), and the llama.cpp runner where
llama-cpp-python is installed."""
import importlib.util
import sys

import gguf
import numpy as np
import pytest
import torch

from castspec.bench import llamacpp

Q = gguf.GGMLQuantizationType
HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A Q8_0 matrix, an F16 matrix and an F32 norm vector, with metadata of several kinds and a custom alignment."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_custom_alignment(64)
    w.add_uint32("llama.block_count", 1)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", ["a", "\u0120b", "<|im_end|>"])
    w.add_array("tokenizer.ggml.token_type", [1, 1, 3])
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    q8 = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(q8, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((3, 8)).astype(np.float16))
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(8).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dequantized(reader):
    return {t.name: (t.tensor_type, gguf.quants.dequantize(t.data, t.tensor_type).reshape(
        tuple(reversed([int(d) for d in t.shape])))) for t in reader.tensors}


def metadata(reader):
    return {k: llamacpp.field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_gguf_in_values_and_metadata(tiny_gguf, tmp_path, dtype):
    src = gguf.GGUFReader(tiny_gguf)
    out = gguf.GGUFReader(llamacpp.gguf_in(tiny_gguf, tmp_path / f"tiny.{dtype}.gguf", dtype))
    before, after = dequantized(src), dequantized(out)
    assert list(after) == list(before)
    for name, (_, fp32) in before.items():
        qtype, got = after[name]
        if dtype == "f32" or fp32.ndim == 1:  # norm vectors stay F32 in a bf16 file
            assert qtype == Q.F32 and np.array_equal(got, fp32)
        else:
            assert qtype == Q.BF16
            assert torch.equal(torch.from_numpy(got), torch.from_numpy(fp32).to(torch.bfloat16).float())
    want, got = metadata(src), metadata(out)
    assert want.pop("general.file_type")[0] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert got.pop("general.file_type") == (llamacpp.STORED[dtype][1], gguf.GGUFValueType.UINT32, None)
    assert got == want and out.alignment == 64


def test_bf16_rounds_to_nearest_even():
    # 1 + 2^-8 lies halfway between two bf16 values; the even one is 1.0. 1 + 3 * 2^-8 rounds up to 1 + 2^-6.
    t = type("T", (), {"shape": np.array([2, 1]), "tensor_type": Q.F32,
                       "data": np.array([[1 + 2 ** -8, 1 + 3 * 2 ** -8]], dtype=np.float32)})
    bits = llamacpp.stored_values(t, Q.BF16)
    assert (bits.astype(np.uint32) << 16).view(np.float32).tolist() == [[1.0, 1 + 2 ** -6]]


def test_missing_llama_cpp_is_one_clear_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` raise ImportError
    with pytest.raises(RuntimeError, match="llama-cpp-python") as e:
        llamacpp.import_llama_cpp()
    assert "\n" not in str(e.value)


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed (pip install -e '.[compare]')")
def test_llama_cpp_f32_follows_castspec_fp32(tmp_path):
    """llama.cpp on the F32 rewrite of the default target, from castspec's token ids, starts as castspec's fp32
    greedy continuation does (a few tokens: long runs may part at near-ties, which is what the measurement counts)."""
    from castspec.bench.agreement import continuations
    from castspec.bench.harness import builtin_prompts
    from castspec.models.load import default_gguf_path

    prompts = builtin_prompts(["chat"], 1)
    ids, stop = llamacpp.castspec_inputs(None, prompts)
    model = llamacpp.cached_gguf(default_gguf_path(), tmp_path, "f32")
    cfg = llamacpp.RunnerConfig(torch.get_num_threads(), "f32", len(ids[0]) + 8)
    got = llamacpp.greedy(model, ids, stop, 4, cfg)[0]
    want = continuations(None, "fp32", "cpu", prompts, 4)[0]
    assert got.token_ids == want.token_ids and len(got.gaps) == len(got.token_ids)


class FakeLlama:
    """Stands in for llama_cpp.Llama: 10 tokens, each step's best token is the last one plus one (8 a close
    second), and it records what it was given."""
    made = []
    ctx = None

    def __init__(self, **kw):
        self.kw, self.evals, self.tokens, self.closed = kw, [], [], False
        self.logits = np.zeros(10, dtype=np.float32)
        FakeLlama.made.append(self)

    def n_vocab(self):
        return 10

    def n_ctx(self):
        return self.kw["n_ctx"]

    def reset(self):
        self.tokens = []

    def eval(self, ids):
        self.evals.append(list(ids))
        self.tokens += list(ids)
        self.logits[:] = 0
        self.logits[8] = 0.75
        self.logits[(self.tokens[-1] + 1) % 10] = 1.0

    def close(self):
        self.closed = True


def fake_llama_cpp():
    import ctypes
    import types

    def logits_ith(ctx, i):
        assert i == -1
        return FakeLlama.made[-1].logits.ctypes.data_as(ctypes.POINTER(ctypes.c_float))

    return types.SimpleNamespace(Llama=FakeLlama, llama_get_logits_ith=logits_ith, __version__="fake")


def test_greedy_runner_takes_argmax_and_stops_like_castspec(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", fake_llama_cpp())
    FakeLlama.made.clear()
    cfg = llamacpp.RunnerConfig(n_threads=3, kv_cache="bf16", n_ctx=32)
    runs = llamacpp.greedy(tmp_path / "m.gguf", [[1, 2, 3], [5]], {7}, 6, cfg)
    assert [r.token_ids for r in runs] == [[4, 5, 6, 7], [6, 7]]  # the stop token is kept, as castspec keeps it
    assert runs[0].gaps == pytest.approx([0.25] * 4)
    llm, = FakeLlama.made
    assert llm.evals == [[1, 2, 3], [4], [5], [6], [5], [6]] and llm.closed  # nothing evaluated after a stop
    assert llm.kw["n_threads"] == llm.kw["n_threads_batch"] == 3 and llm.kw["type_k"] == llm.kw["type_v"] == Q.BF16
    assert [r.token_ids for r in llamacpp.greedy(tmp_path / "m.gguf", [[0]], {7}, 2, cfg)] == [[1, 2]]
    # every token stamped once it is chosen, in order (the bench's decode timer reads these)
    assert all(len(r.times) == len(r.token_ids) and r.times == sorted(r.times) for r in runs)
    assert not llm.kw["flash_attn"]


def test_runner_refuses_a_context_it_cannot_hold(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", fake_llama_cpp())
    runner = llamacpp.Runner(tmp_path / "m.gguf", llamacpp.RunnerConfig(1, "f16", 8, flash_attn=True))
    assert FakeLlama.made[-1].kw["flash_attn"] and FakeLlama.made[-1].kw["type_k"] == Q.F16
    assert runner([1, 2], set(), 6).token_ids == [3, 4, 5, 6, 7, 8]
    with pytest.raises(ValueError, match="exceed llama.cpp's context of 8"):
        runner([1, 2, 3], set(), 6)
    runner.close()
    assert FakeLlama.made[-1].closed


def test_bench_runner_needs_a_gguf_and_llama_cpp(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="needs a GGUF target"):
        llamacpp.bench_runner(str(tmp_path), 64)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as where llama-cpp-python is not installed
    monkeypatch.setattr(llamacpp.env, "cache_dir", lambda: tmp_path)
    with pytest.raises(RuntimeError, match="needs llama-cpp-python"):
        llamacpp.bench_runner(None, 64)  # the default target, before any conversion
    assert not (tmp_path / "llamacpp").exists()


def test_pairs_in_agreement_format():
    from castspec.bench.harness import BenchPrompt

    prompts = [BenchPrompt("code", "a"), BenchPrompt("chat", "b")]
    p = llamacpp.pair(prompts, "ref", [[1, 2, 3], [4, 5]], [[0.5, 0.1, 2.0], [1.0, None]], "cand", [[1, 9, 3], [4, 5]])
    assert p["identical"] == 1 and p["prompts"] == 2
    assert p["per_prompt"][0] == {"domain": "code", "id": "a", "tokens": 3, "first_difference": 1,
                                  "reference_gap_there": 0.1, "reference_min_gap": 0.1}
    assert p["per_prompt"][1]["first_difference"] is None and p["per_prompt"][1]["reference_min_gap"] == 1.0
    assert llamacpp.summary([p]) == "cand vs ref: 1/2 identical (first differences at [1])"
