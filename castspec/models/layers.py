"""Building blocks shared by the target decoder and the drafter (HF parameter names throughout).

Activations are fp32 whatever the weights' dtype (issue 16: a bf16 model means bf16 weights, not bf16
arithmetic, as in llama.cpp): the residual stream, norms, RoPE, attention and softmax run in fp32, and only
the input of a product with a bf16 weight is rounded to bf16, inside `linear`. The models put their embeddings
into fp32 once; everything here keeps the dtype it is given.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..native.linear import WeightPack, linear

# CUDA attention backends, cuDNN left out: it builds an execution plan for every new key length, and a decode
# step's key length is always new (measured in docs/performance.md).
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back to x's dtype before the weight, as the HF Llama/Qwen3 norms do;
    fp32 x times a bf16 weight gives fp32 (the weight is widened exactly), so fp32 activations stay fp32."""

    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


def fused_linears(parent: nn.Module, in_features: int, outs: dict[str, int], bias: bool,
                  dtype=None, device=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Create nn.Linear children named like the HF checkpoint whose weights (and biases) are views into one
    fused matrix (and vector).

    Loading a checkpoint writes through the views, so the forward can run one GEMM (q|k|v or gate|up)
    instead of several: on CPU each op costs microseconds of dispatch, and a 30-layer decode step is
    otherwise dominated by it. `.to()` / `.float()` convert each Parameter on its own, which ends the
    aliasing: the owning module's `_apply` fuses them again (`refused`).
    The fused tensors are plain tensors, invisible to autograd: forwards take them through `fused_params`.
    """
    total = sum(outs.values())
    weight = torch.empty(total, in_features, dtype=dtype, device=device)
    fused_bias = torch.zeros(total, dtype=dtype, device=device) if bias else None
    offset = 0
    for name, out in outs.items():
        lin = nn.Linear(in_features, out, bias=False, device="meta")
        lin.weight = nn.Parameter(weight[offset:offset + out])
        if bias:
            lin.bias = nn.Parameter(fused_bias[offset:offset + out])
        setattr(parent, name, lin)
        offset += out
    return weight, fused_bias


def refused(parent: nn.Module, names: tuple[str, ...], weight: torch.Tensor,
            bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused weight and bias after a conversion of `parent`: unchanged while the children are still views of
    them, otherwise one new matrix (and vector) from the converted children, which become views of it again."""
    children = [getattr(parent, n) for n in names]
    first = children[0].weight
    if first.data_ptr() == weight.data_ptr() and first.dtype == weight.dtype and first.device == weight.device:
        return weight, bias
    with torch.no_grad():
        weight = torch.cat([c.weight for c in children])
        bias = None if bias is None else torch.cat([c.bias for c in children])
    offset = 0
    for c in children:
        rows = c.weight.shape[0]
        c.weight = nn.Parameter(weight[offset:offset + rows], requires_grad=c.weight.requires_grad)
        if bias is not None:
            c.bias = nn.Parameter(bias[offset:offset + rows], requires_grad=c.bias.requires_grad)
        offset += rows
    return weight, bias


def fused_params(parent: nn.Module, names: tuple[str, ...], weight: torch.Tensor, bias: torch.Tensor | None):
    """The fused weight and bias for a forward.

    Inference uses the fused tensors as they are (no copy). When gradients are wanted, the fused matrix is
    rebuilt from the Parameters (one copy per forward), because autograd would otherwise never reach them:
    the drafters trained before this existed kept their q/k/v and gate/up weights at initialization.
    """
    children = [getattr(parent, n) for n in names]
    if torch.is_grad_enabled() and children[0].weight.requires_grad:
        return (torch.cat([c.weight for c in children]),
                None if bias is None else torch.cat([c.bias for c in children]))
    return weight, bias


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool = False, dtype=None, device=None):
        super().__init__()
        self.gate_up_weight, self.gate_up_bias = fused_linears(
            self, hidden, {"gate_proj": inter, "up_proj": inter}, bias, dtype, device)
        self.down_proj = nn.Linear(inter, hidden, bias=bias, dtype=dtype, device=device)
        self._gate_up_pack, self._down_pack = WeightPack(), WeightPack()

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self.gate_up_weight, self.gate_up_bias = refused(self, ("gate_proj", "up_proj"), self.gate_up_weight,
                                                         self.gate_up_bias)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = fused_params(self, ("gate_proj", "up_proj"), self.gate_up_weight, self.gate_up_bias)
        gate, up = linear(x, w, b, self._gate_up_pack).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.down_proj.weight, self.down_proj.bias, self._down_pack)


class QKVProjection(nn.Module):
    """q/k/v projections (fused), optional per-head q/k RMSNorm (Qwen3) and the output projection."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                 qk_norm: bool, bias: bool = False, dtype=None, device=None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.qkv_weight, self.qkv_bias = fused_linears(
            self, hidden, {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim,
                           "v_proj": kv_heads * head_dim}, bias, dtype, device)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias, dtype=dtype, device=device)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps, dtype, device)
            self.k_norm = RMSNorm(head_dim, eps, dtype, device)
        else:
            self.q_norm = self.k_norm = None
        self._q_rows = heads * head_dim  # rows of the fused q|k|v matrix that belong to q
        self._qkv_pack, self._kv_pack, self._o_pack = WeightPack(), WeightPack(), WeightPack()

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self.qkv_weight, self.qkv_bias = refused(self, ("q_proj", "k_proj", "v_proj"), self.qkv_weight,
                                                 self.qkv_bias)
        return out

    def qkv(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return fused_params(self, ("q_proj", "k_proj", "v_proj"), self.qkv_weight, self.qkv_bias)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B,T,H] -> q [B,h,T,d], k/v [B,kv,T,d] with RoPE applied at the given cos/sin [B,T,d]."""
        B, T, _ = x.shape
        heads = linear(x, *self.qkv(), self._qkv_pack).view(B, T, -1, self.head_dim)  # q | k | v heads
        qk = self.qk_rope(heads[:, :, :self.heads], heads[:, :, self.heads:self.heads + self.kv_heads], cos, sin)
        q, k = qk.transpose(1, 2).split([self.heads, self.kv_heads], dim=1)
        return q, k, heads[:, :, self.heads + self.kv_heads:].transpose(1, 2)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Keys and values only (the drafter's context rows never ask for queries)."""
        B, T, _ = x.shape
        w, b = self.qkv()
        kv_w = w[self._q_rows:]
        kv_b = None if b is None else b[self._q_rows:]
        heads = linear(x, kv_w, kv_b, self._kv_pack).view(B, T, -1, self.head_dim)  # k | v heads
        k = self.qk_rope(None, heads[:, :, :self.kv_heads], cos, sin)
        return k.transpose(1, 2), heads[:, :, self.kv_heads:].transpose(1, 2)

    def qk_rope(self, q: torch.Tensor | None, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Per-head norms (Qwen3), then RoPE on the query and key heads [B,T,*,d] together -> [B,T,h+kv,d].

        One rotation over q and k at once: on CPU a decode step's small ops cost more than their arithmetic,
        and this halves RoPE's."""
        if self.q_norm is not None:
            k = self.k_norm(k)
            q = None if q is None else self.q_norm(q)
        qk = k if q is None else torch.cat((q, k), dim=2)
        return apply_rope(qk, cos.unsqueeze(2), sin.unsqueeze(2))

    def sdpa(self, q, k, v, mask=None, causal=False) -> torch.Tensor:
        """q [B,h,T,d] over k/v [B,kv,S,d]; mask is a bool [B|1,1,T,S] (True = visible) or None."""
        # Caches hold the model's dtype. On CPU attention runs in fp32 (activations are, and torch's bf16 CPU
        # attention kernels are an order of magnitude slower than its fp32 ones at decode shapes): the cached
        # keys and values are widened (the native forwards multiply a bf16 cache in bf16 instead, with AVX-512 or
        # AMX tiles: each path computes every forward alike); on CUDA q is rounded to the cache's dtype (CUDA's
        # weaker guarantee).
        grouped = self.heads != self.kv_heads
        if not q.is_cuda:
            return self._attention(q, k.to(q.dtype), v.to(q.dtype), mask, causal, grouped)
        with sdpa_kernel(CUDA_SDPA_BACKENDS):
            if grouped and mask is not None:
                # CUDA's flash and memory-efficient kernels take no grouped heads with a mask (only the math one
                # does): the query heads that share a key/value head become rows of that head instead, so the
                # memory-efficient kernel runs a tree's masked rows (and every padded row of castspec/graphs.py)
                # reading each key/value head once, not a copy per query head
                return folded_attention(q, k, v, mask)
            return self._attention(q, k, v, mask, causal, grouped)

    @staticmethod
    def _attention(q, k, v, mask, causal, grouped) -> torch.Tensor:
        return F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=mask,
                                              is_causal=causal and mask is None, enable_gqa=grouped)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output [B,h,T,d] -> o_proj over [B,T,h*d]."""
        B, _, T, _ = out.shape
        out = out.transpose(1, 2).reshape(B, T, self.heads * self.head_dim)
        return linear(out, self.o_proj.weight, self.o_proj.bias, self._o_pack)

    def attend_segments(self, q, k, v, segments, layer: int) -> torch.Tensor:
        """Ragged attention: consecutive row ranges of q/k/v [B,*,T,d] belong to different caches.

        Each segment writes its keys/values to its own cache at its own slots and attends over that cache only,
        so requests of any prefix length share one forward (the projections and MLPs run once over all rows)
        without padding to the longest one.
        """
        outs, off = [], 0
        for seg in segments:
            end = off + seg.length
            ks, vs = seg.cache.write(layer, k[:, :, off:end], v[:, :, off:end], seg.start)
            outs.append(self.sdpa(q[:, :, off:end], ks, vs, seg.mask, seg.causal))
            off = end
        return self.output(outs[0] if len(outs) == 1 else torch.cat(outs, dim=2))


def folded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked grouped-query attention as plain attention over the key/value heads: q [B,h,T,d] -> [B,kv,g*T,d]
    (query head i = j*g + r reads key/value head j, and becomes rows r*T .. r*T+T-1 of head j), the mask
    [B|1,1,T,S] repeated for each of the g row groups. Every row attends exactly as in grouped attention."""
    B, h, T, d = q.shape
    kv = k.shape[1]
    g = h // kv
    rows = q.reshape(B, kv, g * T, d)
    m = mask.unsqueeze(2).expand(mask.shape[0], 1, g, T, mask.shape[-1]).reshape(mask.shape[0], 1, g * T, -1)
    out = F.scaled_dot_product_attention(rows.to(k.dtype), k, v, attn_mask=m)
    return out.reshape(B, h, T, d)  # CUDA's kernels may return the rows in another memory order


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B,kv,S,d] -> [B,kv*groups,S,d], query head i reading key/value head i // groups (grouped-query attention)."""
    return x.repeat_interleave(groups, dim=1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., d]; cos/sin broadcastable to it (fp32 tables), sin with rotate-half's sign folded in
    (RotaryTable): rotate_half(x) * sin == roll(x, d/2) * signed sin, one op instead of three."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class RotaryTable(nn.Module):
    """cos and sign-folded sin (see apply_rope) for every position up to max_positions, from transformers'
    RoPE init functions.

    Precomputing the table turns RoPE into one gather per forward; positions are explicit (tree nodes sit at
    prefix length + depth, not at their slot in the pack). The tables are fp32 whatever the model's dtype, also
    after converting the model (`_apply`): RoPE runs on the fp32 activations, and bf16 tables would round every
    rotation angle's cosine and sine.
    """

    def __init__(self, rope_parameters: dict, head_dim: int, max_positions: int, hf_config=None, device=None):
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rope_type = rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            theta = rope_parameters["rope_theta"]
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scale = 1.0
        else:
            if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
                raise ValueError(f"unsupported RoPE type {rope_type!r}")
            inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
        pos = torch.arange(max_positions, dtype=torch.float)
        freqs = torch.outer(pos, inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scale).to(device=device), persistent=False)
        sin = emb.sin() * scale
        sin[:, :head_dim // 2] *= -1  # rotate_half's sign (apply_rope)
        self.register_buffer("sin", sin.to(device=device), persistent=False)

    def _apply(self, fn, *args, **kwargs):
        """Conversions move the tables to the new device but keep them fp32 (from the fp32 tables themselves,
        not from a rounded copy)."""
        tables = {name: getattr(self, name) for name in ("cos", "sin")}
        out = super()._apply(fn, *args, **kwargs)
        for name, table in tables.items():
            moved = getattr(self, name)
            if moved.dtype != table.dtype:
                setattr(self, name, table.to(moved.device))
        return out

    def forward(self, positions: torch.Tensor):
        """cos and signed sin [B,T,d] for positions [B,T]."""
        return self.cos[positions], self.sin[positions]
