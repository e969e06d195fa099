"""Pack a tree behind its pending root into one verify input: ids, positions, ancestor-only mask.

Row 0 is the root b at position P (the cached prefix length); node i sits at row i+1, position P + depth.
Each row sees the whole cached prefix and exactly its ancestors and itself (Lemma 1: its logits then equal
those of a plain forward over prefix + its path).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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


def ancestor_cells(parents: list[int], offset: int = 0) -> tuple[list[int], list[int]]:
    """The (row, column + offset) cells of the ancestor matrix that are set: row r marks r and its ancestors (row 0,
    the root, itself). Parents come first, so each row's ancestors are its parent's plus itself."""
    chains = [[offset]]
    rows, cols = [0], [offset]
    for i, p in enumerate(parents, start=1):
        chain = [*chains[p + 1], offset + i]
        chains.append(chain)
        rows += [i] * len(chain)
        cols += chain
    return rows, cols


def pack_tree(tree: Tree, root: int, prefix_len: int, device) -> Pack:
    n = len(tree) + 1
    mask = None
    if n > 1:
        full = np.zeros((n, prefix_len + n), dtype=bool)
        full[:, :prefix_len] = True  # every row sees the whole cached prefix
        full[ancestor_cells(tree.parents, prefix_len)] = True  # one numpy call for the tree's cells
        mask = torch.from_numpy(full).to(device).view(1, 1, n, prefix_len + n)
    return Pack([root, *tree.tokens], [prefix_len, *(prefix_len + d for d in tree.depths)], mask, device)
