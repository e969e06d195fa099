"""Static-shape forwards for single-sequence rounds, captured as CUDA graphs on a GPU (issue 22, part 1).

Why: on a GPU an eager forward is bound by kernel launches from the host (hundreds per target forward), not by
the GPU. A CUDA graph replays a whole forward with one launch, but only for the shapes and addresses it was
captured with. A round's shapes vary (a tree of N nodes, a key length that grows every step), so:

  rows      a verify pass of n packed rows (n = 1 is the `ar` decode step) is padded to the bucket b >= n
            (GraphConfig.buckets), the drafter pass's new context rows likewise;
  keys      attention reads the first `keys` slots of the cache, keys = (slots needed) rounded up to a multiple of
            GraphConfig.key_step, with the slots past the rows' own masked out;
  addresses every input is copied into static buffers of its (bucket, keys) entry, and the KV cache of the
            sequence is a static one lent by the runner (`lend`): a graph reads and writes fixed addresses.

Padded rows are masked out both ways. A real row sees exactly what the caller's mask gives it (never a padded
row's slot); a padded row sees only slot 0 (a finite key: a row that saw nothing would make NaNs, and a NaN
value times a zero attention weight is still NaN), has token 0 at position 0, writes its keys/values to the slot
right after the real rows' (start + n .. start + b - 1, never visible to a real row, and overwritten by the next
forward before any row could see it), and its outputs are dropped.

On any other call (a ragged batch, a prompt chunk, more rows than the largest bucket, a cache that is not lent
by the runner) `run` returns None and the model runs its usual forward. With capture off, or off CUDA, the same
padded forward runs eagerly: that is what the CPU tests compare, bit for bit, with the unpadded forward.
The padded forward always goes through the model's torch forward (`_torch_forward`), never castspec's native
CPU code, which has its own row-invariant kernels and no use for padding.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from .config import ConfigError
from .models.dflash import DraftSegment
from .models.kvcache import KVCache, Segment

log = logging.getLogger("castspec")

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class GraphConfig:
    """mode: "auto" pads and captures on CUDA and stays off elsewhere; "on" pads everywhere (captured on CUDA,
    eager elsewhere: what the CPU tests run); "off" never. "off" is the default until the captured graphs have
    passed the exactness tests on a GPU (scripts/device_check.sh runs them with graphs on); pass
    GraphConfig(mode="auto") to use them before that.

    buckets: the padded row counts of a verify pass (and of a drafter pass's new context rows), increasing;
    larger passes run eagerly. key_step: attention key lengths are rounded up to a multiple of it (a larger step
    means fewer graphs, more masked keys read). max_context: the positions the static caches hold (capped at the
    model's context); a sequence that needs more gets an ordinary cache and runs eagerly. capture: capture CUDA
    graphs where the device is CUDA (False: the padded forward eagerly, to compare). warmup: eager runs on a side
    stream before each capture (lazy kernel loading and library workspaces must not happen inside a capture)."""

    mode: str = "off"
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    key_step: int = 512
    max_context: int = 8192
    capture: bool = True
    warmup: int = 2

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError(f"graph mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        b = self.buckets
        if not b or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in b) \
                or any(x >= y for x, y in zip(b, b[1:])):
            raise ConfigError(f"graph buckets must be increasing positive integers, got {b!r}")
        for name in ("key_step", "max_context", "warmup"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"graph {name} must be a positive integer, got {value!r}")

    def active(self, device: torch.device | str) -> bool:
        """Whether the padded forwards run on this device."""
        return self.mode == "on" or (self.mode == "auto" and torch.device(device).type == "cuda")

    @property
    def max_bucket(self) -> int:
        return self.buckets[-1]

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket that holds `rows` rows; None when none does (the pass then runs eagerly)."""
        if rows < 1:
            return None
        return next((b for b in self.buckets if b >= rows), None)

    def key_length(self, needed: int, limit: int) -> int:
        """Keys a padded forward attends over: `needed` rounded up to a multiple of key_step, at most `limit`."""
        return min(-(-needed // self.key_step) * self.key_step, limit)


class SlotWriter:
    """Stands in for a KVCache inside a static-shape forward: writes keys/values at the slots in a tensor
    (static, unlike KVCache.write's Python start) and returns the first `keys` slots of every layer."""

    def __init__(self, storage: KVCache, slots: torch.Tensor, keys: int):
        self.k, self.v, self.slots, self.keys = storage.k, storage.v, slots, keys
        self.length = 0  # DFlashDrafter._torch_forward sets it; the runner sets the real cache's

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.k[layer].index_copy_(2, self.slots, k.to(self.k.dtype))
        self.v[layer].index_copy_(2, self.slots, v.to(self.v.dtype))
        return self.k[layer, :, :, :self.keys], self.v[layer, :, :, :self.keys]


class StaticKV:
    """One KV storage at fixed addresses, lent to one sequence's cache at a time.

    The lent KVCache shares the storage's tensors; the lease ends when that cache object is garbage (a sequence
    holds its cache for its whole life), so nothing has to remember to give it back."""

    def __init__(self, make: Callable[[], KVCache]):
        self._make = make
        self.storage: KVCache | None = None
        self._holder: weakref.ref | None = None

    def lend(self, capacity: int, headroom: int) -> KVCache | None:
        """A cache over the storage for a sequence that needs `capacity` slots (plus `headroom` for padded
        rows), or None when the storage is lent already or too small."""
        if self._holder is not None and self._holder() is not None:
            return None
        if self.storage is None:
            with torch.inference_mode(False):  # plain tensors: writable in and out of inference mode
                self.storage = self._make()
        if capacity + headroom > self.storage.capacity:
            return None
        cache = KVCache.over(self.storage.k, self.storage.v)
        self._holder = weakref.ref(cache)
        return cache

    def holds(self, cache) -> bool:
        return self.storage is not None and getattr(cache, "k", None) is self.storage.k


@dataclass
class Entry:
    """One captured shape: its static input buffers, the static-shape forward over them, and, once captured,
    its CUDA graph and the outputs that every replay overwrites."""

    inputs: dict[str, torch.Tensor]
    forward: Callable[[], object]
    graph: object = None  # torch.cuda.CUDAGraph
    out: object = None


@dataclass
class Counts:
    """What a runner did, for tests and benchmarks: calls it took per bucket, shapes captured, calls declined."""

    padded: dict[int, int] = field(default_factory=dict)
    captured: int = 0
    declined: int = 0


class _Runner:
    """What the target's and the drafter's runners share: the static cache, the entries and their capture."""

    def __init__(self, cfg: GraphConfig):
        self.cfg = cfg
        self._kv: StaticKV | None = None
        self._entries: dict[tuple, Entry] = {}
        self._pool = None  # one CUDA memory pool for every graph of this runner (they never run at once)
        self._arange: torch.Tensor | None = None
        self.disabled: str | None = None  # why capture failed; the runner then takes no more calls
        self.counts = Counts()

    def _lend(self, make: Callable[[], KVCache], capacity: int, batch: int, headroom: int) -> KVCache | None:
        if batch != 1 or self.disabled:
            return None
        if self._kv is None:
            self._kv = StaticKV(make)
        return self._kv.lend(capacity, headroom)

    def _holds(self, cache) -> bool:
        return self._kv is not None and self._kv.holds(cache)

    def _slots(self, out: torch.Tensor, start: int) -> None:
        """out[i] = start + i: every row, real or padded, writes the slot after the previous one."""
        b = out.shape[0]
        if self._arange is None or self._arange.shape[0] < b or self._arange.device != out.device:
            self._arange = torch.arange(max(b, self.cfg.max_bucket), device=out.device)
        torch.add(self._arange[:b], start, out=out)

    def _execute(self, entry: Entry, device: torch.device):
        """The entry's outputs for the inputs now in its buffers: a replay of its graph (captured on first use)
        on CUDA, the static-shape forward itself elsewhere or with capture off. Returns (outputs, whether they
        are the graph's static outputs, which the next replay overwrites)."""
        if device.type != "cuda" or not self.cfg.capture:
            return entry.forward(), False
        if entry.graph is None:
            try:
                self._capture(entry, device)
            except Exception as e:  # noqa: BLE001 - an op that cannot be captured: say so, run eagerly after
                first_line = (str(e).splitlines() or [""])[0][:200]
                self.disabled = f"CUDA graph capture failed ({type(e).__name__}: {first_line})"
                log.warning("castspec: %s; running eagerly", self.disabled)
                torch.cuda.synchronize(device)
                return entry.forward(), False
        entry.graph.replay()
        return entry.out, True

    def _capture(self, entry: Entry, device: torch.device) -> None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            # the warm-up runs write the same keys/values as the replay will (each slot's entry depends only on
            # its row's input), so running them on the live buffers changes nothing
            for _ in range(self.cfg.warmup):
                entry.forward()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            entry.out = entry.forward()
        entry.graph = graph
        self.counts.captured += 1


def _take(out: torch.Tensor | None, rows: int, static: bool) -> torch.Tensor | None:
    """The real rows of a padded output; copied when it is a graph's static output (the next replay would
    overwrite what a caller keeps, such as features waiting for the next drafter pass)."""
    if out is None:
        return None
    real = out[:, :rows]
    return real.clone() if static else real


class TargetGraphs(_Runner):
    """A Decoder's padded verify forwards: one sequence's pack [root, tree] (or its decode row) against the cache
    this runner lent it, every row's logits read."""

    def lend(self, model, capacity: int, batch: int) -> KVCache | None:
        c = model.cfg
        slots = min(self.cfg.max_context, c.max_positions) + 2 * self.cfg.max_bucket + 2

        def make():
            return KVCache(c.num_layers, 1, c.num_kv_heads, slots, c.head_dim, model.dtype, model.device, zeroed=True)

        return self._lend(make, capacity, batch, self.cfg.max_bucket)

    def run(self, model, ids, positions, segments, logit_rows, taps: tuple[int, ...]):
        """(logits [1, n, V], taps [1, n, F] or None) as `Decoder.forward_segments` returns them, from the padded
        forward; None when the call is not one this runner takes."""
        seg = segments[0] if len(segments) == 1 else None
        if (self.disabled or seg is None or torch.is_grad_enabled() or ids.shape[0] != 1 or logit_rows is not None
                or seg.causal or not self._holds(seg.cache)):
            self.counts.declined += 1
            return None
        n, start, capacity = seg.length, seg.start, seg.cache.capacity
        b = self.cfg.bucket(n)
        mask = seg.mask
        if b is None or start + b > capacity or (mask is not None and (
                mask.dtype != torch.bool or tuple(mask.shape) != (1, 1, n, start + n))):
            self.counts.declined += 1
            return None
        keys = self.cfg.key_length(start + n, capacity)
        entry = self._entry(model, b, keys, tuple(taps))
        x = entry.inputs
        x["ids"].zero_()
        x["ids"][:, :n].copy_(ids)
        x["pos"].zero_()
        x["pos"][:, :n].copy_(positions)
        self._slots(x["slots"], start)
        visible = x["mask"][0, 0]
        visible.zero_()
        if mask is None:  # a lone row sees every slot up to its own
            visible[:n, :start + n] = True
        else:
            visible[:n, :start + n].copy_(mask[0, 0])
        visible[n:, 0] = True  # padded rows: slot 0 only
        (logits, feats), static = self._execute(entry, model.device)
        self.counts.padded[b] = self.counts.padded.get(b, 0) + 1
        return _take(logits, n, static), _take(feats, n, static)

    def _entry(self, model, b: int, keys: int, taps: tuple[int, ...]) -> Entry:
        key = (b, keys, taps)
        if key not in self._entries:
            dev = model.device
            with torch.inference_mode(False):
                x = {"ids": torch.zeros(1, b, dtype=torch.long, device=dev),
                     "pos": torch.zeros(1, b, dtype=torch.long, device=dev),
                     "slots": torch.zeros(b, dtype=torch.long, device=dev),
                     "mask": torch.zeros(1, 1, b, keys, dtype=torch.bool, device=dev)}
            storage = self._kv.storage
            def forward():
                writer = SlotWriter(storage, x["slots"], keys)
                return model._torch_forward(x["ids"], x["pos"], [Segment(writer, 0, b, x["mask"])], None, taps)

            self._entries[key] = Entry(x, forward)
        return self._entries[key]


class DraftGraphs(_Runner):
    """A DFlash drafter's padded block passes: one sequence's new context rows (padded to a bucket) and its block
    [root, MASK x L] against the context cache this runner lent it."""

    def lend(self, model, capacity: int, batch: int) -> KVCache | None:
        c = model.cfg
        slots = min(self.cfg.max_context, c.max_positions) + c.block_size + 2 * self.cfg.max_bucket + 2

        def make():
            dev = model.fc.weight.device
            return KVCache(c.num_layers, 1, c.num_kv_heads, slots, c.head_dim, model.dtype, dev, zeroed=True)

        return self._lend(make, capacity, batch, self.cfg.max_bucket)

    def run(self, model, block_emb, block_pos, features, ctx_pos, segments):
        """The final-normed block rows [1, T, H] as `DFlashDrafter.forward_segments` returns them, from the padded
        pass (and the cache's length advanced past the real context rows); None when not taken."""
        seg = segments[0] if len(segments) == 1 else None
        if (self.disabled or seg is None or torch.is_grad_enabled() or block_emb.shape[0] != 1
                or seg.mask is not None or not self._holds(seg.cache)):
            self.counts.declined += 1
            return None
        c, start, capacity, T = seg.ctx_length, seg.start, seg.cache.capacity, seg.block_length
        cb = self.cfg.bucket(c)
        if cb is None or start + cb > capacity or T != block_emb.shape[1]:
            self.counts.declined += 1
            return None
        keys = self.cfg.key_length(start + c, capacity)
        entry = self._entry(model, cb, keys, block_emb, features)
        x = entry.inputs
        x["emb"].copy_(block_emb)
        x["bpos"].copy_(block_pos)
        x["feats"].zero_()  # padded context rows: zero features (fused to zero rows: finite keys, masked out)
        x["feats"][:, :c].copy_(features)
        x["cpos"].zero_()
        x["cpos"][:, :c].copy_(ctx_pos)
        self._slots(x["slots"], start)
        visible = x["mask"][0, 0]
        visible.zero_()
        visible[:, :start + c] = True  # the cached and new context, not the padded rows' slots
        visible[:, keys:] = True  # the block sees itself whole
        hidden, static = self._execute(entry, block_emb.device)
        seg.cache.length = start + c
        self.counts.padded[cb] = self.counts.padded.get(cb, 0) + 1
        return _take(hidden, T, static)

    def _entry(self, model, cb: int, keys: int, block_emb: torch.Tensor, features: torch.Tensor) -> Entry:
        T, H = block_emb.shape[1], block_emb.shape[2]
        key = (cb, keys, T, block_emb.dtype, features.dtype)
        if key not in self._entries:
            dev = block_emb.device
            with torch.inference_mode(False):
                x = {"emb": torch.zeros(1, T, H, dtype=block_emb.dtype, device=dev),
                     "bpos": torch.zeros(1, T, dtype=torch.long, device=dev),
                     "feats": torch.zeros(1, cb, features.shape[2], dtype=features.dtype, device=dev),
                     "cpos": torch.zeros(1, cb, dtype=torch.long, device=dev),
                     "slots": torch.zeros(cb, dtype=torch.long, device=dev),
                     "mask": torch.zeros(1, 1, T, keys + T, dtype=torch.bool, device=dev)}
            storage = self._kv.storage
            def forward():
                writer = SlotWriter(storage, x["slots"], keys)
                seg = DraftSegment(writer, 0, cb, T, x["mask"])
                return model._torch_forward(x["emb"], x["bpos"], x["feats"], x["cpos"], [seg])

            self._entries[key] = Entry(x, forward)
        return self._entries[key]


def enable(target, drafter=None, cfg: GraphConfig | None = None) -> bool:
    """Give the target (and the drafter) padded static-shape forwards where `cfg` is active on the target's
    device; take them away where it is not. Returns whether they are on. Call after the models are on their
    device: the static caches are made there on first use."""
    cfg = cfg or GraphConfig()
    on = cfg.active(target.device)
    target.graphs = TargetGraphs(cfg) if on else None
    if drafter is not None:
        drafter.graphs = DraftGraphs(cfg) if on else None
    return on
