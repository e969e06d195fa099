"""Tiny random models in the real layouts: HF Llama/Qwen3 targets and DFlash-layout drafters."""
from __future__ import annotations

import os
import shutil
import tempfile


def session_cache() -> tuple[str, bool]:
    """Hermetic runs: each test session gets its own empty cache (cost profiles, native builds, dequantized
    GGUFs), removed at the end, instead of writing into the user's ~/.cache/castspec or reusing what an earlier
    run left there. Processes that tests start inherit it; one that imports this module again (a Ray worker
    unpickling a test's objects, a nested pytest) shares the session's directory and does not own it."""
    inherited = os.environ.get("CASTSPEC_TEST_SESSION_CACHE")
    if inherited:
        return inherited, False
    path = tempfile.mkdtemp(prefix="castspec-test-cache-")
    os.environ["CASTSPEC_TEST_SESSION_CACHE"] = path
    return path, True


# set before castspec is imported, so that nothing can read the cache directory first
TEST_CACHE, OWNS_TEST_CACHE = session_cache()
os.environ["CASTSPEC_CACHE"] = TEST_CACHE

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from castspec.config import DecodeConfig, DrafterConfig  # noqa: E402
from castspec.models import kvcache  # noqa: E402
from castspec.models.dflash import DFlashDrafter  # noqa: E402
from castspec.models.load import build_target  # noqa: E402
from castspec.round import run_round  # noqa: E402
from castspec.sequence import Sequence  # noqa: E402
from castspec.serving.scheduler import Request  # noqa: E402

# Tiny models: one thread is faster (no fork/join per op) and keeps the suite steady on a loaded machine.
torch.set_num_threads(1)


def pytest_unconfigure(config):
    if OWNS_TEST_CACHE:
        shutil.rmtree(TEST_CACHE, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu",
                     help="device for the model-level exactness tests (test_decoder, test_decode, test_sampling): "
                          "cpu (default) or cuda")


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    dev = torch.device(request.config.getoption("--device"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        pytest.fail("--device cuda asked for, but torch sees no CUDA device")
    if dev.type == "cuda":
        # the exactness contract is stated for true fp32: no TF32 in the reference's or our matmuls
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return dev


def llama_config(vocab=48, rope_scaling=False, tie=True, **kw):
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if rope_scaling:
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    base = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                max_position_embeddings=512, rope_parameters=rope, eos_token_id=None, bos_token_id=None)
    base.update(kw)
    return LlamaConfig(**base)


def qwen3_config(vocab=48, **kw):
    base = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False,
                max_position_embeddings=512, eos_token_id=None, bos_token_id=None)
    base.update(kw)
    return Qwen3Config(**base)


def make_hf(config, seed=0, device="cpu"):
    torch.manual_seed(seed)
    cls = LlamaForCausalLM if config.model_type == "llama" else Qwen3ForCausalLM
    model = cls(config).eval().to(device)
    # random init is small; widen the logits so greedy choices are not near-ties
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return model


def native(hf_model, dtype=torch.float32):
    """Our decoder with the HF model's weights, on the HF model's device."""
    return build_target(hf_model.config, hf_model.state_dict(), dtype, hf_model.device)


def random_drafter(target, block_size=8, layers=2, taps=None, seed=0, scale=3.0, inter=96) -> DFlashDrafter:
    t = target.cfg
    cfg = DrafterConfig(hidden_size=t.hidden_size, num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=16,
                        intermediate_size=inter, rms_norm_eps=1e-6, block_size=block_size,
                        mask_token_id=t.vocab_size - 1, target_layer_ids=taps or [0, t.num_layers - 2],
                        num_target_layers=t.num_layers, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                        max_positions=t.max_positions, vocab_size=t.vocab_size)
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg, dtype=target.dtype, device=target.device)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if p.dim() == 2:
                p.normal_(0, scale / p.shape[1] ** 0.5)
    return d.eval().requires_grad_(False)


@pytest.fixture(autouse=True)
def poisoned_caches(monkeypatch):
    """Every cache the CPU leaves as allocated starts as NaNs in the tests (models/kvcache.storage), so that a read
    of a slot no forward wrote, which decoding must never make, turns the outputs to NaN instead of passing on
    whatever the allocator returned."""
    real = kvcache.storage

    def poisoned(shape, dtype, device, zeroed=False):
        out = real(shape, dtype, device, zeroed)
        return out.fill_(float("nan")) if not zeroed and out.device.type == "cpu" and out.is_floating_point() else out

    monkeypatch.setattr(kvcache, "storage", poisoned)


@pytest.fixture
def zeroed_caches(monkeypatch):
    """KV caches made zeroed (the CPU leaves them as allocated, models/kvcache.storage): for tests that compare
    whole caches, the scratch slots a pass writes past its context included, where slots neither side wrote must
    agree too."""
    real = kvcache.storage
    monkeypatch.setattr(kvcache, "storage", lambda shape, dtype, device, zeroed=False: real(shape, dtype, device,
                                                                                          zeroed=True))


@pytest.fixture(scope="session")
def tiny_llama():
    return make_hf(llama_config())


@pytest.fixture(scope="session")
def tiny_qwen3():
    return make_hf(qwen3_config())


def tiny_tokenizer(vocab: int = 24):
    """A real (word-level) fast tokenizer over `vocab` tokens with a chat template, for HTTP/API tests."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<eos>", "<user>", "<assistant>"] + [f"w{i}" for i in range(vocab - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="w0")
    fast.chat_template = ("{% for m in messages %}{{ '<user> ' if m['role'] == 'user' else '<assistant> ' }}"
                          "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    return fast


def serve_all(scheduler, reqs, arrivals):
    """Submit request i before round arrivals[i]; run until everything finished. Returns outputs, reasons."""
    outs = {i: [] for i in range(len(reqs))}
    reasons = {}
    pending = sorted(range(len(reqs)), key=lambda i: arrivals[i])
    step = 0
    while pending or scheduler.active or scheduler.queue_length:
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            prompt, cfg = reqs[i]
            scheduler.submit(Request(prompt, cfg, outs[i].extend, lambda r, e, i=i: reasons.setdefault(i, (r, e))))
        scheduler.step()
        step += 1
        assert step < 2000
    return outs, reasons


def read_prompt(target, drafter, prompt, method="cast", cache=None, budget=1000):
    """A Sequence that has read its prompt in chunks of at most `budget` tokens, after taking what `cache` (a
    castspec.prefix_cache.PrefixCache) holds and kept in it afterwards."""
    seq = Sequence(target, drafter, prompt, DecodeConfig(method=method, max_new_tokens=4), 8)
    if cache is not None:
        cache.restore(seq)
    with torch.inference_mode():
        while seq.reading_prompt:
            run_round(target, drafter, [seq], None, prefill_budget=budget)
    if cache is not None:
        cache.store(seq)
    return seq
