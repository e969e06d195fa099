"""Pack a tree behind its pending root into one verify input: ids, positions, ancestor-only mask.

Row 0 is the root b at position P (the cached prefix length); node i sits at row i+1, position P + depth.
Each row sees the whole cached prefix and exactly its ancestors and itself (Lemma 1: its logits then equal
those of a plain forward over prefix + its path).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import Tree


@dataclass
class Pack:
    id_list: list[int]  # N+1 token ids: the root, then the tree's nodes
    position_list: list[int]  # their positions
    mask: torch.Tensor | None  # bool [1, 1, N+1, P+N+1]; None for a lone root (it sees everything)
    device: torch.device | str = "cpu"

    @property
    def ids(self) -> torch.Tensor:
        """[1, N+1] (a round lays out the lists of all its packs as one tensor instead)."""
        return torch.tensor([self.id_list], dtype=torch.long, device=self.device)

    @property
    def positions(self) -> torch.Tensor:
        """[1, N+1]"""
        return torch.tensor([self.position_list], dtype=torch.long, device=self.device)


def ancestor_rows(parents: list[int]) -> list[bytearray]:
    """The pack's own block of the ancestor matrix, one row of len(parents) + 1 bytes per pack row (1 = may
    attend): the root sees itself, and each node its parent's row plus itself (parents come first)."""
    n = len(parents) + 1
    root = bytearray(n)
    root[0] = 1
    rows = [root]
    for i, p in enumerate(parents, start=1):
        row = bytearray(rows[p + 1])
        row[i] = 1
        rows.append(row)
    return rows


def pack_tree(tree: Tree, root: int, prefix_len: int, device) -> Pack:
    n = len(tree) + 1
    mask = None
    if n > 1:
        # the mask's rows as bytes, joined into one buffer the tensor takes over: a round's few Python calls
        # rather than numpy's fills and fancy indexing (host work runs on every round, its caches cold after the
        # verify before it)
        seen = b"\x01" * prefix_len  # every row sees the whole cached prefix
        cells = bytearray(b"".join(seen + row for row in ancestor_rows(tree.parents)))
        mask = torch.frombuffer(cells, dtype=torch.bool).view(1, 1, n, prefix_len + n).to(device)
    return Pack([root, *tree.tokens], [prefix_len, *(prefix_len + d for d in tree.depths)], mask, device)
