"""Static, preallocated KV cache written at explicit slots.

Slots are storage order, not positions: a packed tree writes its N+1 nodes to consecutive slots while their
RoPE positions are prefix length + depth. After verification `keep_rows` moves the committed nodes down so
that slot == position again for everything kept.

Caches hold the model's dtype on every device: keys and values are computed in fp32 and rounded as they are
written (half the bytes for a bf16 model, which every later row reads back: under load, many requests' caches are
read as much as the weights). On CPU attention widens them back to fp32 (QKVProjection.sdpa, the native forwards).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..native import build as native


def storage(shape: tuple[int, ...], dtype: torch.dtype, device, zeroed: bool = False) -> torch.Tensor:
    """A cache's keys or values. On the CPU a slot is read only once written (the native forwards read the keys a
    row sees, torch's attention the slots before a forward's end), so the memory is left as allocated instead of
    written once more at a request's admission, room for a tree included. Zeros where a reader sees slots it
    never wrote under a mask (`zeroed`: castspec/graphs.py's static caches, read up to a rounded key count; a
    masked-off garbage value would still reach the weighted sum as 0 x NaN) and off the CPU."""
    alloc = torch.zeros if zeroed or torch.device(device).type != "cpu" else torch.empty
    return alloc(shape, dtype=dtype, device=device)


class KVCache:
    def __init__(self, num_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype=torch.float32, device="cpu", zeroed: bool = False):
        shape = (num_layers, batch, kv_heads, capacity, head_dim)
        self.k = storage(shape, dtype, device, zeroed)
        self.v = storage(shape, dtype, device, zeroed)
        self.capacity = capacity
        self.length = 0  # slots [0, length) hold committed entries
        self.owned = True  # its storage is its own (False: lent, and written by other sequences later)

    @classmethod
    def over(cls, k: torch.Tensor, v: torch.Tensor) -> "KVCache":
        """An empty cache whose entries live in existing tensors [layers, B, kv, capacity, d] (castspec/graphs.py
        lends one static storage to one sequence after another: captured CUDA graphs use fixed addresses)."""
        cache = cls.__new__(cls)
        cache.k, cache.v, cache.capacity, cache.length = k, v, k.shape[3], 0
        cache.owned = False
        return cache

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [B,kv,T,d] at slots [start, start+T) and return the views over [0, start+T)."""
        end = start + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache overflow: {end} slots needed, capacity {self.capacity}")
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def keep_rows(self, start: int, rows: list[int]) -> None:
        """After a pack written from slot `start`, keep its rows `rows` (ascending, row 0 first) at slots start,
        start + 1, ...: the rows already in place stay (all of them when the path is the pack's first rows), the
        others move down (one native call on the CPU, else an indexed copy for keys and one for values)."""
        moved = next((i for i, r in enumerate(rows) if r != i), len(rows))  # rows[i] >= i: every later one moves
        src = [start + r for r in rows[moved:]]
        if src and not native.keep_slots(self.k, self.v, src, start + moved):
            src, dst = torch.tensor(src, device=self.k.device), slice(start + moved, start + len(rows))
            self.k[:, :, :, dst] = self.k.index_select(3, src)
            self.v[:, :, :, dst] = self.v.index_select(3, src)
        self.length = start + len(rows)

    def copy_prefix(self, other: "KVCache", n: int) -> None:
        """Take `other`'s first n slots (a forked sequence shares its parent's prompt)."""
        self.k[:, :, :, :n] = other.k[:, :, :, :n]
        self.v[:, :, :, :n] = other.v[:, :, :, :n]
        self.length = n

    def reset(self) -> None:
        self.length = 0


@dataclass
class Segment:
    """The next `length` rows of a flattened (ragged) forward, all belonging to one cache.

    Their keys/values go to slots [start, start + length) of `cache`; `mask` (bool [1,1,length,start+length],
    True = visible) or `causal` (plain triangle, only with start == 0) says what they see; neither = everything.
    """

    cache: KVCache
    start: int
    length: int
    mask: torch.Tensor | None = None
    causal: bool = False
