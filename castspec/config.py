"""Validated configuration dataclasses.

`TargetConfig` is our compact view of an HF Llama/Qwen3 config; `DrafterConfig` of a DFlash drafter config.
The HF config object itself is kept only for what transformers computes better than we would (RoPE tables).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

SUPPORTED_TARGETS = ("llama", "qwen3")


class ConfigError(ValueError):
    """A configuration or checkpoint that castspec cannot use; the message names the problem."""


@dataclass(slots=True)
class TargetConfig:
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_positions: int
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3: per-head RMSNorm on q and k before RoPE
    attention_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.model_type not in SUPPORTED_TARGETS:
            raise ConfigError(f"unsupported model_type {self.model_type!r}; castspec supports {SUPPORTED_TARGETS}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads {self.num_heads} is not a multiple of kv heads {self.num_kv_heads}")
        for name in ("hidden_size", "num_layers", "head_dim", "intermediate_size", "vocab_size", "max_positions"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_hf(cls, hf) -> "TargetConfig":
        model_type = getattr(hf, "model_type", None)
        heads = hf.num_attention_heads
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            intermediate_size=hf.intermediate_size,
            vocab_size=hf.vocab_size,
            rms_norm_eps=hf.rms_norm_eps,
            max_positions=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qk_norm=model_type == "qwen3",
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            eos_token_ids=eos_ids,
        )


def default_tap_layers(num_target_layers: int, num_taps: int) -> list[int]:
    """Taps spread evenly over target layers 1 .. N-3 (the public DFlash convention when none are given)."""
    if num_taps == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    return [int(lo + i * (hi - lo) / (num_taps - 1)) for i in range(num_taps)]


@dataclass(slots=True)
class DrafterConfig:
    """The fields of a public DFlash `config.json` that the drafter uses."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1e6})
    max_positions: int = 32768
    attention_bias: bool = False
    vocab_size: int | None = None
    # a drafter trained also on blocks cut to this many rows (train-drafter --short-blocks): a batched pass whose
    # trees read no deeper than such a block may run its blocks cut (castspec's own field; 0: whole blocks only)
    short_block_rows: int = 0

    def __post_init__(self):
        if self.block_size < 2:
            raise ConfigError(f"drafter block_size must be at least 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ConfigError("drafter has no target_layer_ids")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"drafter heads {self.num_heads} not a multiple of kv heads {self.num_kv_heads}")
        if self.short_block_rows and not 2 <= self.short_block_rows <= self.block_size:
            raise ConfigError(f"drafter short_block_rows {self.short_block_rows} outside 2..{self.block_size}")

    @property
    def num_draft_positions(self) -> int:
        """L: the block is [root, MASK x (block_size-1)] and every MASK row predicts one future token."""
        return self.block_size - 1

    @classmethod
    def from_json(cls, cfg: dict) -> "DrafterConfig":
        try:
            dflash = cfg.get("dflash_config") or {}
            layers = cfg["num_hidden_layers"]
            n_target = cfg.get("num_target_layers")
            taps = dflash.get("target_layer_ids") or default_tap_layers(n_target, layers)
            rope = cfg.get("rope_parameters") or dict(cfg.get("rope_scaling") or {})
            rope.setdefault("rope_type", rope.pop("type", "default") if "type" in rope else "default")
            rope.setdefault("rope_theta", cfg.get("rope_theta", 1e6))
            heads = cfg["num_attention_heads"]
            return cls(
                hidden_size=cfg["hidden_size"],
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                intermediate_size=cfg["intermediate_size"],
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                block_size=cfg["block_size"],
                mask_token_id=dflash["mask_token_id"],
                target_layer_ids=list(taps),
                num_target_layers=n_target if n_target is not None else max(taps) + 1,
                rope_parameters=rope,
                max_positions=cfg.get("max_position_embeddings", 32768),
                attention_bias=bool(cfg.get("attention_bias", False)),
                vocab_size=cfg.get("vocab_size"),
                short_block_rows=int(dflash.get("short_block_rows") or 0),
            )
        except KeyError as e:
            raise ConfigError(f"drafter config.json lacks field {e.args[0]!r}") from None

    def to_json(self) -> dict:
        """A config.json in the public DFlash layout (a Qwen3 config plus the DFlash fields)."""
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu",
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_positions,
            "rope_theta": self.rope_parameters.get("rope_theta"),
            "rope_parameters": dict(self.rope_parameters),
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids),
                              **({"short_block_rows": self.short_block_rows} if self.short_block_rows else {})},
        }

    def block_rows(self, depth: int) -> int:
        """The rows of a block whose trees read its first `depth` positions: cut to short_block_rows where the
        drafter was trained on such blocks and they hold those positions, else the whole block."""
        return self.short_block_rows if 0 < depth < self.short_block_rows else self.block_size


METHODS = ("ar", "chain", "cast")
VERIFIERS = ("coupled", "rrs", "direct")


@dataclass(slots=True)
class DecodeConfig:
    method: str = "cast"
    width: int | str = "auto"  # tree nodes per round for `cast`; "auto": the cost rule (castspec.allocate)
    top_k_per_position: int = 8  # the tree's candidates at each drafted position
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # sampling: draw among the k likeliest tokens (0 = all); unrelated to top_k_per_position
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # T > 0: "coupled" (each output position's draw fixed by the seed, so every method commits the same tokens),
    # "rrs" (proposal-aware recursive rejection sampling) or "direct"; all three keep the target's law
    verifier: str = "coupled"
    # vLLM-style logit processing, applied at every tree node exactly as at an `ar` step (castspec.sampling)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    # log-probabilities of each output token and its `logprobs` best alternatives (None: off); "raw" from the
    # target's logits, "processed" from the law the token is drawn from
    logprobs: int | None = None
    logprobs_mode: str = "raw"
    # width="auto": recalibrate the drafter's masses from the acceptance the engine has observed (depth x mass
    # bins, monotone) before the per-round rule reads them
    calibrate: bool = False

    def __post_init__(self):
        if self.method not in METHODS:
            raise ConfigError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.width != "auto" and (not isinstance(self.width, int) or isinstance(self.width, bool) or self.width < 0):
            raise ConfigError(f"width must be a non-negative integer or 'auto', got {self.width!r}")
        if not isinstance(self.top_k_per_position, int) or self.top_k_per_position < 1:
            raise ConfigError(f"top_k_per_position must be >= 1, got {self.top_k_per_position!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be a non-negative integer, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        if self.verifier not in VERIFIERS:
            raise ConfigError(f"verifier must be one of {', '.join(VERIFIERS)}, got {self.verifier!r}")
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ConfigError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(not isinstance(t, int) or t < 0 or not math.isfinite(b) for t, b in self.logit_bias.items()):
            raise ConfigError("logit_bias must map non-negative token ids to finite numbers")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ConfigError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ConfigError(f"logprobs must be None or a non-negative integer, got {self.logprobs!r}")
        if self.logprobs_mode not in ("raw", "processed"):
            raise ConfigError(f"logprobs_mode must be 'raw' or 'processed', got {self.logprobs_mode!r}")
