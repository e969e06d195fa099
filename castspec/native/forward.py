"""Target forwards (decode steps, packed trees, prefill chunks; csrc/step.c) and the drafter's block pass
(csrc/draft.c) in one native call each, on AVX-512 CPUs.

Why: such a forward streams every weight once, but eager torch adds ~50 small ops per layer whose dispatch can
cost more than the weight reads. step.c runs the same layers (products on castspec's own kernels, the rest in
plain C), with fp32 activations and bf16 products' inputs rounded as they enter them, as the torch forward.

Exactness (issue 16): every row of a native target forward computes the same bits whatever else is in the
forward (csrc/layer.h), so a tree row gives the bits of the decode step at its position and a prompt the same
cache whatever its chunking. A forward that fell back to torch would not, so the target's native forward takes
any number of rows (`max_rows`), cut into calls of at most CHUNK rows to bound its scratch.

`NativeStep` (a Decoder's) and `NativeDraft` (a DFlash drafter's) each say which calls the C code takes
(`accepts`), are built for one model (`build`: None where they do not apply: no native library, unsupported
shapes or layouts) and run a call returning what the model's torch forward returns (`run`); `selftest` gives the
synthetic forwards native/dispatch.py compares with the torch forward when it builds the native code. Which of
the two forwards a model uses is decided there, in one place.
"""
from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass

import torch

from .. import env
from . import build as native
from . import hugepages
from .abi import LAYER_FIELDS, DraftModel, DraftSegment, Int8Weight, Layer, Segment, StepModel
from .linear import head_logprobs, weight_key
from .pack import INT8_INPUTS, pack_int8, pack_panels, packable

# the rows of each synthetic forward of a self-test (fewer where the row limit is lower)
SELFTEST_ROWS = 4
# How far a drafter pass on int8 weights may stray from its torch forward (bf16 weights) in the self-test,
# relative to the largest output: the int8 rounding of weights and inputs moves the outputs by several percent of
# it on the self-test's random inputs, a wrong layout by all of it. The int8 products themselves are checked
# exactly when the library is loaded (native/build.py).
INT8_TOLERANCE = 0.25


class _Kept:
    """Tensors and structs whose memory native code reads: kept alive here, their addresses handed out. Packed
    weights, which every forward streams, go to huge pages where the platform has them (native/hugepages.py)."""

    def __init__(self):
        self.kept: list[torch.Tensor | ctypes.Structure] = []
        self._arena = hugepages.HugePageArena() if hugepages.available() else None

    def __call__(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        self.kept.append(t)
        return t.data_ptr()

    def weight(self, t: torch.Tensor) -> int:
        """The address of packed weights `t` (a copy on huge pages where available: `t` is not kept then)."""
        return self(t if self._arena is None else self._arena.copy(t))

    def struct(self, s: ctypes.Structure) -> int:
        self.kept.append(s)
        return ctypes.addressof(s)


def _packed(keep: _Kept, w: torch.Tensor) -> int:
    """The address of a weight matrix packed for csrc/gemm.c (the packed copy kept alive)."""
    return keep.weight(pack_panels(w, native.panel_group()))


def _packed_int8(keep: _Kept, w: torch.Tensor) -> int:
    """The address of model.h's Int8Weight for a weight matrix quantized and packed for gemm.c's int8 products."""
    panels, scales, sums = pack_int8(w, native.panel_group())
    return keep.struct(Int8Weight(keep.weight(panels), keep(scales), keep(sums)))


def _layer_array(layers, keep: _Kept, packed=_packed):
    """model.h's Layer structs for decoder or drafter layers (both have the HF layer's submodules), with the
    matrices packed by `packed`."""
    out = (Layer * len(layers))()
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv_w, qkv_b = attn.qkv()
        values = (keep(layer.input_layernorm.weight), packed(keep, qkv_w), keep(qkv_b),
                  packed(keep, attn.o_proj.weight), keep(attn.o_proj.bias),
                  keep(None if attn.q_norm is None else attn.q_norm.weight),
                  keep(None if attn.k_norm is None else attn.k_norm.weight),
                  keep(layer.post_attention_layernorm.weight), packed(keep, mlp.gate_up_weight),
                  keep(mlp.gate_up_bias), packed(keep, mlp.down_proj.weight), keep(mlp.down_proj.bias))
        for name, address in zip(LAYER_FIELDS, values):
            setattr(out[i], name, address)
    return out


def _usable(dtype: torch.dtype, head_dim: int, tensors, rope) -> bool:
    """What step.c and draft.c need: CPU, fp32 or bf16, head_dim a multiple of 16 up to 512, contiguous
    weights all in the model's dtype (matrices gemm.c can multiply by, native/pack.py), the RoPE tables (`rope`, a RotaryTable) on the CPU."""
    return (dtype in (torch.float32, torch.bfloat16) and not head_dim % 16 and head_dim <= 512
            and all(t.device.type == "cpu" and t.is_contiguous() and t.dtype == dtype
                    and (t.dim() != 2 or packable(t)) for t in tensors)
            and rope.cos.device.type == rope.sin.device.type == "cpu")


def _tables(rope, keep: _Kept) -> tuple[int, int]:
    """The addresses of a RotaryTable's cos and sin as the fp32 tables layer.h reads whatever the model's dtype
    (a converted copy, kept alive, where the tables are not fp32 already)."""
    return tuple(keep(t.float().contiguous()) for t in (rope.cos, rope.sin))


# The most rows one native target call takes: a longer forward runs as consecutive calls of at most this many
# rows, since a call's scratch grows with its rows (and masked rows' key lists with rows times the cache length).
# Every call streams all the weights once, so a serving round (the prefill budget, 512 rows by default, plus the
# running requests' trees) should fit in one: at 64 rows a 512-row prompt chunk read them eight times.
CHUNK = 1024


def max_rows(dtype: torch.dtype) -> int | None:
    """The most rows a native forward takes, target or drafter, the same for every dtype (None: any number).
    CASTSPEC_NATIVE_ROWS sets a limit (0: torch only), at the price of bit-exactness across row counts. The
    drafter's passes took at most 16 block rows on AVX-512 tiles until gemm.c fetched its weights ahead of the
    compute; since then a batched pass (16 requests' blocks, 256 rows) runs faster natively than on oneDNN's
    blocked products (docs/performance.md)."""
    return env.native_rows()


def _within(n: int, limit: int | None) -> bool:
    return 0 < n and (limit is None or n <= limit)


def _selftest_rows(limit: int | None) -> int:
    return SELFTEST_ROWS if limit is None else min(SELFTEST_ROWS, limit)


def cache_fits(cache, dtype: torch.dtype) -> bool:
    """The cache layout step.c and draft.c write for a model of `dtype`: that dtype, one sequence, contiguous, on
    the CPU."""
    return (cache.k.dtype == dtype and cache.v.dtype == dtype and cache.k.shape[1] == 1 and cache.k.is_contiguous()
            and cache.v.is_contiguous() and cache.k.device.type == "cpu")


@dataclass
class SelfTest:
    """A few forwards of one model on synthetic inputs, writing a cache of their own (never a request's): what the
    native code is compared with the torch forward on when it is built. Each `selftest` call makes a fresh one,
    so the two forwards each run on their own cache."""

    calls: list[tuple]  # argument tuples of the model's forward_segments, run in this order
    cache: object  # the scratch KV cache (models/kvcache.KVCache) those calls write
    slots: int  # the slots [0, slots) that hold keys/values afterwards (draft.c uses the ones above as scratch)

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.k[..., :self.slots, :], self.cache.v[..., :self.slots, :]


def _matrices(layers) -> list[torch.Tensor]:
    """The fused matrices (plain tensors, not Parameters) the native code reads besides the Parameters."""
    return [t for layer in layers for t in (layer.self_attn.qkv()[0], layer.mlp.gate_up_weight)]


def _sees_no_later_row(seg) -> bool:
    """Whether no row of a kvcache.Segment sees the slot of a later row of it (true of the causal triangle, of a
    single row and of tree masks, whose rows see ancestors only): then its rows can run in consecutive calls,
    each finding every key it sees already written."""
    if seg.mask is None:
        return True
    own = seg.mask.reshape(seg.length, seg.start + seg.length)[:, seg.start:]  # [rows, rows]: rows' own slots
    return not own.triu(1).any().item()


def _piece(seg, i: int, j: int):
    """Rows [i, j) of a kvcache.Segment as a segment of their own: their slots, the mask columns up to the last
    of them, or the causal triangle's rows (mask None, which step.c reads as row r seeing slots [0, start + r]
    at any start; pieces go to step.c only, never to the torch forward)."""
    if (i, j) == (0, seg.length):
        return seg
    mask = None if seg.mask is None else seg.mask[..., i:j, :seg.start + j]
    return dataclasses.replace(seg, start=seg.start + i, length=j - i, mask=mask)


def _chunks(segments, size: int):
    """The rows of a forward over `segments` in consecutive ranges [a, b) of at most `size` rows, each with the
    pieces of segments in it (`_piece`); valid where every segment `_sees_no_later_row`."""
    a, pieces, taken = 0, [], 0  # taken: rows in the current chunk
    for seg in segments:
        i = 0
        while i < seg.length:
            j = min(seg.length, i + size - taken)
            pieces.append(_piece(seg, i, j))
            taken, i = taken + j - i, j
            if taken == size:
                yield a, a + taken, pieces
                a, pieces, taken = a + taken, [], 0
    if pieces:
        yield a, a + taken, pieces


class NativeStep:
    """The pointers step.c reads for one Decoder, kept alive with their tensors (the model's NativeSwitch drops
    this when the model's weights move, since the pointers would then be stale)."""

    what = "forward"
    tolerance = None  # the self-test's, relative to the largest output: the dtype's (native/dispatch.py)

    def __init__(self, decoder, lib):
        cfg = decoder.cfg
        self._fn = lib.forward_rows
        self.panel_group = lib.gemm_panel_group()  # the layout its weights are packed in (native/pack.py)
        keep = self._kept = _Kept()
        self._layers = _layer_array(decoder.model.layers, keep)
        self._model = StepModel(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                cfg.intermediate_size, cfg.vocab_size, decoder.dtype == torch.bfloat16, False,
                                cfg.rms_norm_eps, keep(decoder.model.embed_tokens.weight),
                                keep(decoder.model.norm.weight), _packed(keep, decoder.head_weight),
                                *_tables(decoder.rope, keep), ctypes.cast(self._layers, ctypes.POINTER(Layer)))
        self._tap_cache: dict[tuple[int, ...], torch.Tensor] = {}

    @staticmethod
    def accepts(decoder, ids, positions, segments, logit_rows, taps: tuple[int, ...]) -> bool:
        """Whether step.c takes this `Decoder.forward_segments` call: one sequence of rows (any number but where
        max_rows limits them) on the CPU, distinct taps, every segment with a bool tree mask or the causal
        triangle (or a single row) on a cache step.c can write."""
        if not _within(ids.numel(), max_rows(decoder.dtype)) or ids.shape[0] != 1 or ids.device.type != "cpu" \
                or len(set(taps)) != len(taps):
            return False
        # every row seeing every slot is no decoding pattern; float masks are not trees
        return all(not (seg.mask is None and seg.length > 1 and not seg.causal) and cache_fits(seg.cache, decoder.dtype)
                   and (seg.mask is None or seg.mask.dtype == torch.bool) for seg in segments)

    @staticmethod
    def build(decoder) -> "NativeStep | None":
        lib = native.library()
        tensors = [*decoder.parameters(), *_matrices(decoder.model.layers), decoder.head_weight]
        if lib is None or not _usable(decoder.dtype, decoder.cfg.head_dim, tensors, decoder.rope):
            return None
        return NativeStep(decoder, lib)

    @staticmethod
    def candidates(decoder):
        """The native codes to try for a decoder, best first (native/dispatch.py keeps the first whose self-test
        agrees with the torch forward): its one build, where it applies."""
        code = NativeStep.build(decoder)
        if code is not None:
            yield code

    @staticmethod
    def selftest(decoder, ids, positions, segments, logit_rows, taps) -> SelfTest:
        """What a decoder's native code is checked on: a causal prefill chunk (logits of its last row), a packed
        tree after it (ancestor masks, positions prefix + depth), both with taps, then a decode row seeing all of
        that. The arguments are the call that built the code; only the class of its segments is taken from it
        (models/kvcache.Segment: the models import this package, not the other way round)."""
        cfg, rows = decoder.cfg, _selftest_rows(max_rows(decoder.dtype))
        segment = type(segments[0])
        cache = decoder.new_cache(2 * rows + 1)
        tokens = (torch.arange(2 * rows + 1) * 7 + 3) % cfg.vocab_size
        tap_layers = tuple(dict.fromkeys((cfg.num_layers - 1, 0)))
        # a binary tree, parents first: each row sees the prefix, its ancestors and itself
        parents = [(i - 1) // 2 for i in range(rows)]
        mask = torch.zeros(rows, 2 * rows, dtype=torch.bool)
        mask[:, :rows] = True
        depth = [0] * rows
        for i in range(rows):
            if i:
                mask[i] = mask[parents[i]]
                depth[i] = depth[parents[i]] + 1
            mask[i, rows + i] = True
        prefill = (tokens[:rows].view(1, -1), torch.arange(rows).view(1, -1),
                   [segment(cache, 0, rows, causal=True)], torch.tensor([rows - 1]), tap_layers)
        tree = (tokens[rows:2 * rows].view(1, -1), (rows + torch.tensor(depth)).view(1, -1),
                [segment(cache, rows, rows, mask.view(1, 1, rows, 2 * rows))], None, tap_layers)
        decode = (tokens[2 * rows:].view(1, 1), torch.tensor([[rows + max(depth) + 1]]),
                  [segment(cache, 2 * rows, 1)], None, ())
        return SelfTest([prefill, tree, decode], cache, 2 * rows + 1)

    def run(self, ids, positions, segments, logit_rows, taps: tuple[int, ...]):
        """The call as `Decoder.forward_segments` returns it: (logits [1, R, V] fp32, features [1, M, taps * H]
        fp32 or None). More than CHUNK rows run as consecutive native calls of at most CHUNK rows (`_chunks`),
        which gives the same bits as one call: each row's arithmetic is independent of the rest."""
        M = ids.numel()
        rows = torch.arange(M) if logit_rows is None else torch.arange(M)[logit_rows].view(-1)
        ids, positions = ids.reshape(-1).contiguous(), positions.reshape(-1).contiguous()
        if M <= CHUNK or not all(map(_sees_no_later_row, segments)):
            logits, features = self(ids, positions, segments, rows, taps)
        else:
            logits = torch.empty(rows.numel(), self._model.vocab, dtype=torch.float32)
            features = torch.empty(M, len(taps) * self._model.hidden) if taps else None
            for a, b, pieces in _chunks(segments, CHUNK):
                inside = ((rows >= a) & (rows < b)).nonzero().view(-1)  # the logit rows in [a, b), in order
                part, feats = self(ids[a:b], positions[a:b], pieces, rows[inside] - a, taps)
                logits[inside] = part
                if feats is not None:
                    features[a:b] = feats
        return logits.unsqueeze(0), None if features is None else features.unsqueeze(0)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, segments, logit_rows: torch.Tensor,
                 taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward of the M rows ids/positions [M], split in order into `segments` (kvcache.Segment: one
        cache, its slots, a bool mask [1, 1, rows, start + rows] or none for the causal triangle).

        Returns (logits [R, V] fp32 of the rows in `logit_rows` [R], hidden states after the layers in `taps`
        [M, len(taps) * H] fp32, None without taps)."""
        M = ids.numel()
        segs = (Segment * len(segments))()
        masks = []  # kept alive for the call
        for i, seg in enumerate(segments):
            if seg.start + seg.length > seg.cache.capacity:
                raise ValueError(f"KV cache overflow: {seg.start + seg.length} slots needed, "
                                 f"capacity {seg.cache.capacity}")
            mask = None if seg.mask is None else seg.mask.reshape(seg.length, seg.start + seg.length).contiguous()
            masks.append(mask)
            segs[i] = Segment(seg.cache.k.data_ptr(), seg.cache.v.data_ptr(), seg.cache.capacity, seg.start,
                              seg.length, None if mask is None else mask.data_ptr())
        logits = torch.empty(logit_rows.numel(), self._model.vocab, dtype=torch.float32)
        features = tap_slot = None
        if taps:
            features = torch.empty(M, len(taps) * self._model.hidden, dtype=torch.float32)
            tap_slot = self._tap_slots(taps)
        rc = self._fn(ctypes.byref(self._model), M, ids.data_ptr(), positions.data_ptr(), len(segments), segs,
                      logit_rows.numel(), logit_rows.data_ptr(), logits.data_ptr(),
                      None if tap_slot is None else tap_slot.data_ptr(), len(taps),
                      None if features is None else features.data_ptr())
        if rc != 0:
            raise MemoryError("native forward: out of memory")
        return logits, features

    def _tap_slots(self, taps: tuple[int, ...]) -> torch.Tensor:
        """Per layer, the tap it fills, or -1 (cached: a drafter's taps never change)."""
        slots = self._tap_cache.get(taps)
        if slots is None:
            slots = torch.full((self._model.layers,), -1, dtype=torch.int32)
            for j, layer in enumerate(taps):
                slots[layer] = j
            self._tap_cache[taps] = slots
        return slots


class NativeDraft:
    """The pointers draft.c reads for one DFlash drafter (dropped when its weights move, as above)."""

    what = "drafter pass"

    def __init__(self, drafter, lib, int8: bool = False):
        """`int8`: multiply by int8 weights (where `_int8_fits`): a pass then reads half the bytes, and the drafter
        proposes what its bf16 weights do within the replay's noise (docs/performance.md)."""
        cfg = drafter.cfg
        self._lib = lib
        self.panel_group = lib.gemm_panel_group()  # the layout its weights are packed in (native/pack.py)
        keep = self._kept = _Kept()
        self.int8 = int8
        self.tolerance = INT8_TOLERANCE if int8 else None
        self.what = "drafter pass on int8 weights" if int8 else "drafter pass"
        self._packed = _packed_int8 if self.int8 else _packed
        self._layers = _layer_array(drafter.layers, keep, self._packed)
        self._bf16 = drafter.dtype == torch.bfloat16
        base = StepModel(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                         cfg.intermediate_size, 0, self._bf16, self.int8, cfg.rms_norm_eps, None,
                         keep(drafter.norm.weight), None, *_tables(drafter.rope, keep),
                         ctypes.cast(self._layers, ctypes.POINTER(Layer)))
        self._model = DraftModel(base, self._packed(keep, drafter.fc.weight), keep(drafter.hidden_norm.weight),
                                 drafter.fc.weight.shape[1])
        self._hidden = cfg.hidden_size
        self._head: tuple = (None, None, None)  # (weight_key, address, _Kept) of the head packed as the layers
        self._takes: tuple = (None, None, False)  # (head, embedding table, whether `marginals` takes the two)

    @staticmethod
    def accepts(drafter, block_emb, block_pos, features, ctx_pos, segments) -> bool:
        """Whether draft.c takes this `DFlashDrafter.forward_segments` call: every request with a cache it can
        write (decoding, not training) and room there for its context and block, no masks, the blocks at most
        max_rows(dtype) rows in all."""
        dtype = drafter.dtype  # asked every round: once, and the segments in a plain loop
        if block_emb.shape[0] != 1 or block_emb.device.type != "cpu" or not _within(block_emb.shape[1],
                                                                                      max_rows(dtype)):
            return False
        for seg in segments:
            cache = seg.cache
            if (cache is None or seg.mask is not None or not cache_fits(cache, dtype)
                    or seg.start + seg.ctx_length + seg.block_length > cache.capacity):
                return False
        return True

    @staticmethod
    def build(drafter, int8: bool = False) -> "NativeDraft | None":
        lib = native.library()
        tensors = [*drafter.parameters(), *_matrices(drafter.layers)]
        if lib is None or not _usable(drafter.dtype, drafter.cfg.head_dim, tensors, drafter.rope):
            return None
        return NativeDraft(drafter, lib, int8)

    @staticmethod
    def candidates(drafter):
        """The native codes to try for a drafter, best first: on int8 weights where they fit (`_int8_fits`), then
        on the drafter's own, so that a drafter whose int8 pass strays from its torch forward by more than int8
        rounding (a checkpoint unlike those tested) still gets a native pass."""
        for int8 in ((True, False) if _int8_fits(drafter) else (False,)):
            code = NativeDraft.build(drafter, int8)
            if code is None:
                return
            yield code

    @staticmethod
    def selftest(drafter, block_emb, block_pos, features, ctx_pos, segments) -> SelfTest:
        """What a drafter's native code is checked on: a block pass after a few context rows, then another after
        one more context row (the block sees the cached context of both). The arguments are the call that built
        the code; only the class of its segments is taken from it (models/dflash.DraftSegment, whose module
        imports this package)."""
        rows = _selftest_rows(max_rows(drafter.dtype))
        segment = type(segments[0])
        context = (rows, 1)
        cache = drafter.new_cache(sum(context) + rows)
        g = torch.Generator().manual_seed(0)  # a generator of its own: a request's seeded draws stay untouched
        feats = torch.randn(1, sum(context), drafter.fc.weight.shape[1], generator=g).to(drafter.dtype)
        block = torch.randn(1, rows, drafter.cfg.hidden_size, generator=g).to(drafter.dtype)
        calls, start = [], 0
        for n in context:
            end = start + n
            calls.append((block, torch.arange(end, end + rows).view(1, -1), feats[:, start:end],
                          torch.arange(start, end).view(1, -1), [segment(cache, start, n, rows)]))
            start = end
        return SelfTest(calls, cache, sum(context))

    def run(self, block_emb, block_pos, features, ctx_pos, segments) -> torch.Tensor:
        """The call as `DFlashDrafter.forward_segments` returns it (final-normed block rows [1, T, H] fp32), each
        cache's length advanced past its new context as the torch forward does."""
        hidden = self(*_flat_pass(block_emb, block_pos, features, ctx_pos), segments)
        _advance_caches(segments)
        return hidden.unsqueeze(0)

    def __call__(self, block_emb: torch.Tensor, block_pos: torch.Tensor, features: torch.Tensor,
                 ctx_pos: torch.Tensor, segments) -> torch.Tensor:
        """Final-normed block rows [T, H] for block_emb [T, H] at block_pos [T], after writing the context rows
        (features [C, taps * H] at ctx_pos [C]) to their caches; rows of both are split in order into
        `segments` (dflash.DraftSegment, one request each). All fp32 activations, whatever the model's dtype."""
        T, C = block_emb.shape[0], features.shape[0]
        out = torch.empty(T, self._hidden, dtype=torch.float32)
        rc = self._lib.draft_block(ctypes.byref(self._model), len(segments), _draft_segments(segments), C,
                                   features.data_ptr(), ctx_pos.data_ptr(), T, block_emb.data_ptr(),
                                   block_pos.data_ptr(), None, T, out.data_ptr())
        if rc != 0:
            raise MemoryError("native drafter pass: out of memory")
        return out

    def head_address(self, head: torch.Tensor) -> int:
        """The draft vocabulary's head [S, H] (the drafter's dtype) packed as the layers are (int8 or panels),
        packed once and again only when the head changes."""
        key = weight_key(head)
        if self._head[0] != key:
            keep = _Kept()
            self._head = (key, self._packed(keep, head.detach()), keep)
        return self._head[1]

    def takes(self, head: torch.Tensor, embed: torch.Tensor, head_ok, embed_ok) -> bool:
        """Whether `marginals` takes this head and embedding table, by the drafter's tests head_ok(head) and
        embed_ok(embed): asked once per head and table (a round asks every time), kept while they are the same
        tensors."""
        kept = self._takes
        if kept[0] is not head or kept[1] is not embed:
            kept = self._takes = (head, embed, head_ok(head) and embed_ok(embed))
        return kept[2]

    def logprobs(self, hidden: torch.Tensor, rows: list[int], head: torch.Tensor) -> torch.Tensor | None:
        """Block rows `rows` of a pass's final-normed rows hidden [*, H] (fp32) through the draft vocabulary's
        head as log-probabilities [len(rows), S] fp32: the head's arithmetic of `marginals` (None as
        linear.head_logprobs)."""
        return head_logprobs(self._lib, self._bf16, self.int8, self.head_address(head), tuple(head.shape), hidden,
                             rows)

    def marginals(self, block_ids, block_pos, features, ctx_pos, segments, head: torch.Tensor, rows: list[int],
                  embed: torch.Tensor) -> torch.Tensor:
        """The same pass as `run` on block rows given by their ids (block_ids [1, T], rows of the target's
        embedding table `embed` [V, H], which must be in the drafter's dtype and contiguous), then its block rows
        `rows` through the draft vocabulary's head (`head` [S, H], the target's lm_head rows in the drafter's
        dtype) as log-probabilities [len(rows), S] fp32, in one native call: what the table's rows, `run` and
        `logprobs` give one after the other, bit for bit (the pass finishes only the rows `rows`, ascending)."""
        block_pos, features, ctx_pos = _flat_positions_features(block_pos, features, ctx_pos)
        block_ids = block_ids.reshape(-1).contiguous()
        vocab = head.shape[0]
        out = torch.empty(len(rows), vocab, dtype=torch.float32)
        rc = self._lib.draft_pass(ctypes.byref(self._model), len(segments), _draft_segments(segments),
                                  features.shape[0], features.data_ptr(), ctx_pos.data_ptr(), block_ids.shape[0],
                                  block_ids.data_ptr(), embed.data_ptr(), block_pos.data_ptr(),
                                  self.head_address(head), vocab, (ctypes.c_int64 * len(rows))(*rows), len(rows),
                                  out.data_ptr())
        if rc != 0:
            raise MemoryError("native drafter pass: out of memory")
        _advance_caches(segments)
        return out


def _int8_fits(drafter) -> bool:
    """Whether a drafter's native pass multiplies by int8 weights: a bf16 drafter where gemm.c has int8 products
    (native/build.py), every product's input width a multiple of pack.INT8_INPUTS (the hidden size: the layers'
    and the head's; the MLP's; the taps')."""
    cfg = drafter.cfg
    widths = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size, drafter.fc.weight.shape[1])
    return (drafter.dtype == torch.bfloat16 and native.int8_products()
            and all(w % INT8_INPUTS == 0 for w in widths))


def _flat_pass(block_emb, block_pos, features, ctx_pos) -> tuple[torch.Tensor, ...]:
    """`DFlashDrafter.forward_segments`' arguments as draft.c reads them: block rows [T, H] and features
    [C, taps * H] in fp32, positions [T] and [C], all contiguous."""
    return block_emb[0].float().contiguous(), *_flat_positions_features(block_pos, features, ctx_pos)


def _flat_positions_features(block_pos, features, ctx_pos) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's positions [T], the features [C, taps * H] in fp32 and their positions [C], contiguous."""
    return block_pos.reshape(-1).contiguous(), features[0].float().contiguous(), ctx_pos.reshape(-1).contiguous()


def _advance_caches(segments) -> None:
    """Each drafter cache's length past its new context rows, as the torch forward leaves it."""
    for seg in segments:
        seg.cache.length = seg.start + seg.ctx_length


def _draft_segments(segments) -> ctypes.Array:
    """draft.c's DraftSegment array for dflash.DraftSegments (each with a cache with room for its context and its
    block's scratch keys)."""
    segs = (DraftSegment * len(segments))()
    for i, seg in enumerate(segments):
        need = seg.start + seg.ctx_length + seg.block_length  # the block's keys need scratch slots too
        if need > seg.cache.capacity:
            raise ValueError(f"drafter cache overflow: {need} slots needed, capacity {seg.cache.capacity}")
        segs[i] = DraftSegment(seg.cache.k.data_ptr(), seg.cache.v.data_ptr(), seg.cache.capacity, seg.start,
                               seg.ctx_length, seg.block_length)
    return segs
