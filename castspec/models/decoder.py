"""Native Llama / Qwen3 decoder: explicit positions, explicit masks, a static KV cache, tapped hidden states.

The model knows nothing about decoding: callers decide which slots to write, which positions each row has,
what each row may see, and which rows need logits. Hidden states are fp32 whatever the weights' dtype (see
models/layers.py): a bf16 model rounds only the inputs of its products.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..config import TargetConfig
from ..native.dispatch import NativeSwitch
from ..native.linear import WeightPack, linear
from .kvcache import KVCache, Segment
from .layers import MLP, QKVProjection, RMSNorm, RotaryTable


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, dtype=None, device=None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = QKVProjection(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                       cfg.rms_norm_eps, cfg.qk_norm, cfg.attention_bias, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype, device)

    def forward(self, x, cos, sin, segments: list[Segment], layer: int):
        q, k, v = self.self_attn.project(self.input_layernorm(x), cos, sin)
        x = x + self.self_attn.attend_segments(q, k, v, segments, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """`model.*` and `lm_head` follow the HF checkpoint names, so safetensors load without conversion."""

    def __init__(self, cfg: TargetConfig, rope_parameters: dict, hf_config=None, dtype=torch.float32, device="cpu"):
        super().__init__()
        self.cfg = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        self.rope = RotaryTable(rope_parameters, cfg.head_dim, cfg.max_positions, hf_config, device)
        self._head_pack = WeightPack()
        self.backend = NativeSwitch.for_decoder()  # which code runs forward_segments: native or torch
        # castspec/graphs.py: padded static-shape forwards (CUDA graphs) for one sequence's rounds, when enabled
        self.graphs = None

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        if self.graphs is not None:  # the graphs' static cache when it is free (their forwards need it)
            lent = self.graphs.lend(self, capacity, batch)
            if lent is not None:
                return lent
        c = self.cfg
        return KVCache(c.num_layers, batch, c.num_kv_heads, capacity, c.head_dim, self.dtype, self.device)

    @property
    def embedding_table(self) -> torch.Tensor:
        """The token embeddings [V, H] (model dtype) that `embed` reads."""
        return self.model.embed_tokens.weight

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows in fp32 (the activations' dtype; bf16 rows widen exactly)."""
        return self.model.embed_tokens(ids).float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head over fp32 hidden states: fp32 logits, so argmax ties and softmax are not
        decided by bf16 rounding."""
        return self.vocab_scores(self.model.norm(hidden)).float()

    def vocab_scores(self, normed: torch.Tensor) -> torch.Tensor:
        """lm_head over final-normed rows (the drafter's rows go through it too)."""
        return linear(normed, self.head_weight, None, self._head_pack)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, start: int,
                mask: torch.Tensor | None = None, causal: bool = False,
                logit_rows: torch.Tensor | slice | None = None, taps: tuple[int, ...] = ()):
        """ids/positions [B,T] written to cache slots [start, start+T).

        mask: bool [B|1,1,T,start+T], True = may attend; None with causal=False lets every row see every slot
        (a single decode row), causal=True is the plain prefill triangle (only valid when start == 0).
        Returns (logits [B,R,V] fp32 for `logit_rows` (all rows when None; no logits when an empty slice),
        taps [B,T,len(taps)*H] fp32 = hidden states after each tapped layer, concatenated; None without taps).
        """
        segment = Segment(cache, start, ids.shape[1], mask, causal)
        return self.forward_segments(ids, positions, [segment], logit_rows, taps)

    def forward_segments(self, ids: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
                         logit_rows: torch.Tensor | slice | None = None, taps: tuple[int, ...] = ()):
        """The ragged forward: the rows of ids/positions [B,T] are split, in order, into `segments`, each with
        its own cache, slots and mask (one request each when serving). Returns as `forward`."""
        if self.graphs is not None:
            out = self.graphs.run(self, ids, positions, segments, logit_rows, taps)
            if out is not None:
                return out
        return self.backend.run(self, self._torch_forward, ids, positions, segments, logit_rows, taps)

    def _torch_forward(self, ids, positions, segments: list[Segment], logit_rows, taps: tuple[int, ...]):
        x = self.embed(ids)
        cos, sin = self.rope(positions)
        tapped = []
        tap_set = set(taps)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, segments, i)
            if i in tap_set:
                tapped.append(x)
        features = None
        if taps:
            order = {t: j for j, t in enumerate(sorted(tap_set))}
            features = torch.cat([tapped[order[t]] for t in taps], dim=-1)
        rows = x if logit_rows is None else x[:, logit_rows]
        return self.logits(rows), features
