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
    ids: torch.Tensor  # [1, N+1]
    positions: torch.Tensor  # [1, N+1]
    mask: torch.Tensor | None  # bool [1, 1, N+1, P+N+1]; None for a lone root (it sees everything)


def ancestor_matrix(parents: list[int]) -> np.ndarray:
    """[N+1, N+1] bool: row r marks r and its ancestors (row of the root = itself). Parents come first,
    so each row is its parent's row plus itself."""
    n = len(parents) + 1
    anc = np.zeros((n, n), dtype=bool)
    anc[0, 0] = True
    for i, p in enumerate(parents, start=1):
        anc[i] = anc[p + 1]
        anc[i, i] = True
    return anc


def pack_tree(tree: Tree, root: int, prefix_len: int, device) -> Pack:
    n = len(tree) + 1
    ids = torch.tensor([[root, *tree.tokens]], dtype=torch.long)
    positions = torch.tensor([[0, *tree.depths]], dtype=torch.long) + prefix_len
    mask = None
    if n > 1:
        full = np.ones((n, prefix_len + n), dtype=bool)
        full[:, prefix_len:] = ancestor_matrix(tree.parents)
        mask = torch.from_numpy(full).to(device).view(1, 1, n, prefix_len + n)
    return Pack(ids.to(device), positions.to(device), mask)
