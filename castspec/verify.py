"""Walk a verified tree: which drafted nodes does the target accept, and what does it say next."""
from __future__ import annotations

from .tree import Tree


def children_by_token(tree: Tree) -> list[dict[int, int]]:
    """For each pack row (0 = root), its children's rows keyed by token."""
    kids: list[dict[int, int]] = [{} for _ in range(len(tree) + 1)]
    for i, (tok, par) in enumerate(zip(tree.tokens, tree.parents), start=1):
        kids[par + 1].setdefault(tok, i)
    return kids


def greedy_walk(tree: Tree, target_tokens: list[int]) -> tuple[list[int], int]:
    """Follow, from the root, the child whose token is the target's greedy choice at the current row.

    target_tokens[r] is the target's argmax at pack row r. Returns (accepted pack rows in order, the target's
    token after the last accepted row: the next pending root).
    """
    kids = children_by_token(tree)
    path: list[int] = []
    row = 0
    while (nxt := kids[row].get(target_tokens[row])) is not None:
        path.append(nxt)
        row = nxt
    return path, target_tokens[row]
