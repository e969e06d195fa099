"""The paper's GPU pair as config.json dicts: Qwen/Qwen3-8B and z-lab/Qwen3-8B-DFlash-b16 (issue 22, part 3),
and a down-scaled pair of the same structure for a CPU smoke run.

The target's fields are those of Qwen3-8B's public config.json. The drafter's are the public DFlash b16
checkpoint's layout for that target (see /work/shared/design/FACTS.md): a Qwen3 config with 5 layers of the
target's width (hidden 4096, 32 heads / 8 KV heads, head_dim 128, intermediate 12288), block_size 16, taps
[1, 9, 17, 25, 33] of the 36 target layers and mask token 151669; its norm epsilon, RoPE base and context are the
target's. Only shapes matter here: the benchmark gives both models random weights.
"""
from __future__ import annotations

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

QWEN3_8B_DFLASH_B16 = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
    "block_size": 16,
    "num_target_layers": 36,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
}


def small_pair() -> tuple[dict, dict]:
    """Qwen3-8B's structure at a size a CPU runs in seconds: Qwen3 layers (q/k norms, untied head), 4 query
    heads per KV head, head_dim 16 (castspec's native code needs a multiple of 16), MLP 3x the width, a drafter of
    the same width with block size 16 and one tap per drafter layer spread over the target's layers."""
    target = dict(QWEN3_8B, hidden_size=128, intermediate_size=384, num_hidden_layers=8, max_window_layers=8,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=16, vocab_size=2048,
                  max_position_embeddings=1024, bos_token_id=None, eos_token_id=None)
    drafter = dict(QWEN3_8B_DFLASH_B16, hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=16, vocab_size=2048,
                   max_position_embeddings=1024, num_target_layers=8,
                   dflash_config={"mask_token_id": 2047, "target_layer_ids": [1, 3, 5]})
    return target, drafter


def pair(scale: str) -> tuple[dict, dict]:
    """(target config.json, drafter config.json) for scale "full" (Qwen3-8B + DFlash b16) or "small"."""
    if scale == "full":
        return dict(QWEN3_8B), dict(QWEN3_8B_DFLASH_B16)
    if scale == "small":
        return small_pair()
    raise ValueError(f"unknown scale {scale!r}; use full or small")
