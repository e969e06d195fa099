"""One-pass block drafter in the public DFlash checkpoint layout.

Context: the target's hidden states after the tapped layers, concatenated and fused by `hidden_norm(fc(.))`.
Every layer turns the fused context into keys/values (with its own k/v projections) and lets the block
[root, MASK x (L)] attend to context + block without a causal mask. Rows 1..L, after the final norm and the
target's lm_head, are q_1..q_L. The checkpoint has no embedding and no lm_head: the target's are used.
As in the target (models/layers.py), the block rows, context rows and hidden states keep the dtype they come in
(fp32 from the target's embeddings and taps) whatever the drafter's weights' dtype; only product inputs are
rounded to it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..config import DrafterConfig
from ..native.dispatch import NativeSwitch
from ..native.linear import PanelPack, WeightPack, linear, panel_linear, panel_logprobs
from ..native.pack import packable
from ..tree import Marginals
from .kvcache import KVCache
from .layers import MLP, QKVProjection, RMSNorm, RotaryTable


@dataclass
class DraftSegment:
    """One request in a flattened drafter pass: its next `ctx_length` context rows and `block_length` block rows.

    With a cache, the context rows' keys/values go to slots [start, start + ctx_length) and the block sees the
    whole cache; without one (training) the keys are exactly [context rows, block rows] and `mask` decides.
    """

    cache: KVCache | None
    start: int
    ctx_length: int
    block_length: int
    mask: torch.Tensor | None = None
    # training: where `mask` lets no block row see block rows outside its own group of this many (whole blocks), the
    # rows attend group by group, each group over the context and its own rows only (0: all rows over all keys)
    group_rows: int = 0


def grouped_attention(attn, q, kc, vc, kb, vb, mask: torch.Tensor, rows: int) -> torch.Tensor:
    """attn.sdpa of block rows q [1,h,Q,d] over [context kc/vc [1,kv,T,d], block rows kb/vb [1,kv,Q,d]] under
    `mask` [1,1,Q,T+Q], for a mask under which each group of `rows` block rows sees no block row of another
    group (DraftSegment.group_rows): every group runs over the context and its own rows only, so the keys of
    other groups (all masked: most of a training pass's keys) are never scored. Whole groups go in one batched
    call, a last partial group in another."""
    Q = q.shape[2]
    whole = Q - Q % rows
    parts = [(0, Q // rows, rows), (whole, 1, Q - whole)]
    outs = [_attend_groups(attn, q, kc, vc, kb, vb, mask, start, count, size)
            for start, count, size in parts if count and size]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _attend_groups(attn, q, kc, vc, kb, vb, mask, start: int, count: int, size: int) -> torch.Tensor:
    """grouped_attention's `count` groups of `size` block rows from row `start`, as a batch of `count`."""
    T, d = kc.shape[2], q.shape[3]
    rows = slice(start, start + count * size)

    def split(x):  # [1, heads, Q, d] -> [count, heads, size, d]
        return x[0, :, rows].reshape(x.shape[1], count, size, d).transpose(0, 1)

    m = mask[0, 0, rows]
    each = torch.arange(count)
    own = m[:, T + start:T + start + count * size].reshape(count, size, count, size)[each, :, each, :]
    group_mask = torch.cat([m[:, :T].reshape(count, size, T), own], dim=-1).unsqueeze(1)
    k = torch.cat([kc.expand(count, -1, -1, -1), split(kb)], dim=2)
    v = torch.cat([vc.expand(count, -1, -1, -1), split(vb)], dim=2)
    out = attn.sdpa(split(q), k, v, group_mask)
    return out.transpose(0, 1).reshape(1, q.shape[1], count * size, d)


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, dtype=None, device=None):
        super().__init__()
        H = cfg.hidden_size
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype, device)
        self.self_attn = QKVProjection(H, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                                       qk_norm=True, bias=cfg.attention_bias, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(H, cfg.intermediate_size, False, dtype, device)

    def forward(self, x, ctx, ctx_rope, block_rope, segments: list[DraftSegment], layer: int):
        """x: block rows [B,Tb,H]; ctx: fused context rows [B,Tc,H], both split in order by `segments`."""
        attn = self.self_attn
        k_ctx, v_ctx = attn.project_kv(ctx, *ctx_rope)
        q, k_blk, v_blk = attn.project(self.input_layernorm(x), *block_rope)
        outs, c0, b0 = [], 0, 0
        for seg in segments:
            c1, b1 = c0 + seg.ctx_length, b0 + seg.block_length
            kc, vc = k_ctx[:, :, c0:c1], v_ctx[:, :, c0:c1]
            if seg.cache is not None:
                kc, vc = seg.cache.write(layer, kc, vc, seg.start)
            if seg.group_rows:
                outs.append(grouped_attention(attn, q[:, :, b0:b1], kc, vc, k_blk[:, :, b0:b1], v_blk[:, :, b0:b1],
                                              seg.mask, seg.group_rows))
            else:
                k = torch.cat([kc, k_blk[:, :, b0:b1]], dim=2)
                v = torch.cat([vc, v_blk[:, :, b0:b1]], dim=2)
                outs.append(attn.sdpa(q[:, :, b0:b1], k, v, seg.mask))
            c0, b0 = c1, b1
        x = x + attn.output(outs[0] if len(outs) == 1 else torch.cat(outs, dim=2))
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, dtype=torch.float32, device="cpu", hf_config=None):
        super().__init__()
        self.cfg, self.hf_config = cfg, hf_config
        H = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False, dtype=dtype, device=device)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps, dtype, device)
        self.layers = nn.ModuleList(DrafterLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps, dtype, device)
        self.rope = RotaryTable(cfg.rope_parameters, cfg.head_dim, cfg.max_positions, hf_config, device)
        self._fc_pack = WeightPack()
        # the draft vocabulary (models/draft_vocab.py): None scores every target token
        self.draft_vocab: torch.Tensor | None = None
        self._sub_head: tuple[torch.Tensor, torch.Tensor] | None = None  # (target head it came from, its rows)
        self._sub_pack = WeightPack()
        self._sub_panels = PanelPack()
        self.backend = NativeSwitch.for_drafter()  # which code runs forward_segments: native or torch
        self.graphs = None  # castspec/graphs.py: padded static-shape passes (CUDA graphs), when enabled

    def set_draft_vocab(self, token_ids: torch.Tensor | None) -> None:
        self.draft_vocab = None if token_ids is None else token_ids.to(torch.long).to(self.fc.weight.device)
        self._sub_head = None

    def draft_logprobs(self, rows: torch.Tensor, target) -> torch.Tensor:
        """log q_j over the full vocabulary [..., V] (fp32) for final-normed block rows [..., H], through the
        target's lm_head; with a draft vocabulary only its rows of the head are read and every other token
        gets -inf (probability 0)."""
        return self.marginals(rows, target).full

    def marginals(self, rows: torch.Tensor, target) -> Marginals:
        """`draft_logprobs` for block rows [N, H], together with its support: with a draft vocabulary, the
        log-probabilities of its tokens alone [N, S] (fp32) and their ids, which is all a tree needs."""
        if self.draft_vocab is None:
            return Marginals.dense(torch.log_softmax(target.vocab_scores(rows).float(), dim=-1))
        head = self.vocab_head(target)
        scores = panel_linear(rows, head, self._sub_panels)  # gemm.c where it runs: near the read rate
        if scores is None:
            scores = linear(rows, head, None, self._sub_pack)
        sub = torch.log_softmax(scores.float(), dim=-1)
        return Marginals(sub, self.draft_vocab, target.head_weight.shape[0])

    def block_marginals(self, hidden: torch.Tensor, depths: list[int], target,
                        block_rows: int | None = None) -> list[Marginals]:
        """Per-request marginals of a pass over len(depths) blocks: hidden [blocks * block_rows, H] holds each block's
        final-normed rows, its root's first (block_rows: the pass's rows a block, by default the whole block's L + 1);
        request i drafts its first depths[i] rows after the root. With a draft vocabulary on castspec's C library,
        the rows' head product and log-softmax are one native call."""
        rows = self._drafting_rows(depths, block_rows)
        if self.draft_vocab is not None:
            code, head = self.backend.built, self.vocab_head(target)
            if code is not None and self._native_head(head):  # the head's arithmetic of the native pass (int8)
                sub = code.logprobs(hidden, rows, head)
            else:
                sub = panel_logprobs(hidden, rows, head, self._sub_panels)
            if sub is not None:
                return Marginals(sub, self.draft_vocab, target.head_weight.shape[0]).split(depths)
        return self.marginals(hidden[rows], target).split(depths)

    def propose_segments(self, target, block_ids: torch.Tensor, block_pos: torch.Tensor, features: torch.Tensor,
                         ctx_pos: torch.Tensor, segments: list[DraftSegment], depths: list[int]) -> list[Marginals]:
        """`forward_segments` of the blocks whose token ids are block_ids [1, T] (embedded by the target) and then
        `block_marginals` (the other arguments of both): where the pass runs on draft.c (once its code is built
        and checked, by an earlier pass) with a draft vocabulary whose head gemm.c multiplies, the embedding, the
        pass and the head in one native call, the same bits without the host's work between them."""
        code = self.backend.code_for(self, block_ids, block_pos, features, ctx_pos, segments) \
            if self.graphs is None and self.draft_vocab is not None else None
        if code is not None:
            head, embed = self.vocab_head(target), target.embedding_table
            if code.takes(head, embed, self._native_head, self._native_embedding):
                sub = code.marginals(block_ids, block_pos, features, ctx_pos, segments, head,
                                     self._drafting_rows(depths, segments[0].block_length), embed)
                return Marginals(sub, self.draft_vocab, self._sub_head[0].shape[0]).split(depths)
        hidden = self.forward_segments(target.embed(block_ids), block_pos, features, ctx_pos, segments)
        return self.block_marginals(hidden[0], depths, target, segments[0].block_length)

    def _native_head(self, head: torch.Tensor) -> bool:
        """Whether the drafter's native code multiplies by this draft-vocabulary head (packing it as its layers)."""
        return head.dtype == self.dtype and packable(head)

    def _native_embedding(self, table: torch.Tensor) -> bool:
        """Whether the drafter's native pass reads its block rows from this embedding table [V, H] as it is: in the
        drafter's dtype (the rows it reads widen to the fp32 rows `Decoder.embed` gives), contiguous."""
        return (table.dtype == self.dtype and table.dim() == 2 and table.shape[1] == self.cfg.hidden_size
                and table.is_contiguous())

    def _drafting_rows(self, depths: list[int], block_rows: int | None = None) -> list[int]:
        """The rows of a pass over len(depths) blocks of `block_rows` rows each (default: whole blocks) whose
        marginals the trees read: block i's first depths[i] rows after its root."""
        L1 = block_rows or self.cfg.num_draft_positions + 1
        return [i * L1 + j for i, d in enumerate(depths) for j in range(1, d + 1)]

    def vocab_head(self, target) -> torch.Tensor:
        """The rows of the target's lm_head this drafter scores: the draft vocabulary's (gathered once per head
        and kept), or the whole head without one."""
        head = target.head_weight
        if self.draft_vocab is None:
            return head
        if self._sub_head is None or self._sub_head[0] is not head:
            self._sub_head = (head, head.index_select(0, self.draft_vocab).contiguous())
        return self._sub_head[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def converted(self, dtype: torch.dtype, device=None) -> "DFlashDrafter":
        """A copy in another dtype/device (rebuilt, because `.to()` would break the fused weight views)."""
        clone = DFlashDrafter(self.cfg, dtype=dtype, device=device or self.fc.weight.device, hf_config=self.hf_config)
        clone.load_state_dict({k: v.to(dtype) for k, v in self.state_dict().items()})
        clone.set_draft_vocab(self.draft_vocab)
        return clone.eval().requires_grad_(False)

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        if self.graphs is not None:  # the graphs' static cache when it is free (their passes need it)
            lent = self.graphs.lend(self, capacity, batch)
            if lent is not None:
                return lent
        c = self.cfg
        return KVCache(c.num_layers, batch, c.num_kv_heads, capacity, c.head_dim, self.dtype,
                       self.fc.weight.device)

    def fuse_context(self, features: torch.Tensor) -> torch.Tensor:
        """Tapped target features [B,C,K*H] -> context rows [B,C,H]."""
        return self.hidden_norm(linear(features, self.fc.weight, None, self._fc_pack))

    def forward(self, block_emb: torch.Tensor, block_pos: torch.Tensor, features: torch.Tensor,
                ctx_pos: torch.Tensor, cache: KVCache | None = None, start: int = 0,
                mask: torch.Tensor | None = None, group_rows: int = 0) -> torch.Tensor:
        """Returns the final-normed hidden states of every block row [B,T,H] (apply the target's lm_head).

        With a cache, `features` are the context rows not yet cached (written at slots [start, start+C)) and
        the block sees every cached row. The block's own keys are never cached: the next round's context is
        whatever the target commits.
        """
        seg = DraftSegment(cache, start, features.shape[1], block_emb.shape[1], mask, group_rows)
        return self.forward_segments(block_emb, block_pos, features, ctx_pos, [seg])

    def forward_segments(self, block_emb: torch.Tensor, block_pos: torch.Tensor, features: torch.Tensor,
                         ctx_pos: torch.Tensor, segments: list[DraftSegment]) -> torch.Tensor:
        """One pass for several requests: block and context rows are concatenated in segment order."""
        if self.graphs is not None:
            out = self.graphs.run(self, block_emb, block_pos, features, ctx_pos, segments)
            if out is not None:
                return out
        return self.backend.run(self, self._torch_forward, block_emb, block_pos, features, ctx_pos, segments)

    def _torch_forward(self, block_emb, block_pos, features, ctx_pos, segments: list[DraftSegment]) -> torch.Tensor:
        ctx = self.fuse_context(features)
        ctx_rope = self.rope(ctx_pos)
        block_rope = self.rope(block_pos)
        x = block_emb
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, ctx_rope, block_rope, segments, i)
        for seg in segments:
            if seg.cache is not None:
                seg.cache.length = seg.start + seg.ctx_length
        return self.norm(x)
