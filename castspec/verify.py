"""Walk a verified tree: which drafted nodes does the target accept, and what does it say next."""
from __future__ import annotations

import numpy as np

from .sampling import draft_proposal
from .tree import Tree


def child_rows(tree: Tree) -> dict[tuple[int, int], int]:
    """(pack row, token) -> the row of that row's child with that token (0 = root; node i sits at row i + 1): one
    dict for the whole tree, where a walk looks up one child per accepted row."""
    kids: dict[tuple[int, int], int] = {}
    for i, key in enumerate(zip((p + 1 for p in tree.parents), tree.tokens), start=1):
        kids.setdefault(key, i)
    return kids


def walk(tree: Tree, pick) -> tuple[list[int], int]:
    """Follow, from the root, the child whose token is the target's choice at the current row.

    pick(row, path_tokens) is the target's token at pack row `row`, reached through the drafted tokens
    `path_tokens`: the plain argmax, the argmax after penalties, or a seed-coupled draw (castspec.sampling).
    Returns (accepted pack rows in order, the target's token after the last accepted row: the next root).
    """
    kids = child_rows(tree)
    path: list[int] = []
    tokens: list[int] = []
    row = 0
    while True:
        tok = pick(row, tokens)
        nxt = kids.get((row, tok))
        if nxt is None:
            return path, tok
        path.append(nxt)
        tokens.append(tok)
        row = nxt


def greedy_walk(tree: Tree, target_tokens: list[int]) -> tuple[list[int], int]:
    """`walk` with target_tokens[r], the target's argmax at pack row r."""
    return walk(tree, lambda row, _: target_tokens[row])


def rrs_node(mu: np.ndarray, child_tokens: list[int], q: np.ndarray, sampler) -> tuple[int | None, np.ndarray]:
    """Recursive rejection sampling without replacement over one node's children (Theorem 3).

    Draw a child from q restricted to the children still available, accept it with min(1, mu(c) / q~(c)); on
    rejection replace mu by (mu - q~)+ renormalized and remove the child. Returns (index of the accepted child,
    None if all were rejected) and the residual target law from which the caller draws when nothing was accepted.
    A rejected child always has mu(c) < q~(c), so its residual mass is 0 and it can never be drawn again.
    """
    avail = list(range(len(child_tokens)))
    for _ in range(len(child_tokens)):
        w = np.array([q[child_tokens[i]] for i in avail])
        total = w.sum()
        if total <= 0.0:  # the proposal gives no mass to what is left: fall through to the residual
            break
        q_tilde = w / total
        j = sampler.choice(q_tilde)
        tok = child_tokens[avail[j]]
        if sampler.uniform() * q_tilde[j] < mu[tok]:  # accept with probability min(1, mu/q~)
            return avail[j], mu
        mu = mu.copy()
        toks = [child_tokens[i] for i in avail]
        mu[toks] = np.maximum(mu[toks] - q_tilde, 0.0)
        s = mu.sum()
        mu = mu / s if s > 0 else mu
        del avail[j]
    return None, mu


def sampled_walk(tree: Tree, target_logits, draft_logprobs, sampler, direct: bool = False,
                 history=None) -> tuple[list[int], int]:
    """Stochastic verification from the root: the output path + next token are distributed exactly as sampling
    the target autoregressively with the sampler's logit processing (`history`: the tokens before the root, for
    the penalties).

    direct=False: proposal-aware recursive rejection sampling over each visited node's children.
    direct=True: the simpler walk that samples the target at each node and descends if a child matches.
    """
    kids: list[list[int]] = [[] for _ in range(len(tree) + 1)]
    for i, par in enumerate(tree.parents, start=1):
        kids[par + 1].append(i)
    path: list[int] = []
    row, depth = 0, 0
    proc = sampler.processor
    while True:
        mu = proc.probs(target_logits[row], history.at([tree.tokens[r - 1] for r in path]) if history else None)
        children = kids[row]
        if not children:
            return path, sampler.choice(mu)
        tokens = [tree.tokens[c - 1] for c in children]
        if direct:
            y = sampler.choice(mu)
            if y not in tokens:
                return path, y
            nxt = children[tokens.index(y)]
        else:
            q = draft_proposal(draft_logprobs[depth], proc.temperature)
            picked, mu = rrs_node(mu, tokens, q, sampler)
            if picked is None:
                return path, sampler.choice(mu)
            nxt = children[picked]
        path.append(nxt)
        row, depth = nxt, depth + 1
