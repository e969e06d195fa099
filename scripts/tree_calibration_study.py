"""Do trees built on the drafter's product scores leave acceptance on the table that a recalibrated score would
take? An offline study (docs/performance.md, "Recalibrated tree scores"):

    python scripts/tree_calibration_study.py [--per-domain 4] [--conditional]

Greedy `cast` (N = 15) decodes the held-out prompts once, keeping every full drafted block's marginals and the
target's tokens after its root (the output is the target's greedy continuation whatever the trees). Then, per
round, the tokens a tree would commit (its deepest node on the target's path) for trees of N = 7 / 15 / 63
built from the raw marginals and from recalibrated ones: each candidate's log-probability replaced by the
log of P(it is the target's token | its depth, its probability), counted in bins on the other half of the
prompts (two-fold, by prompt), monotone in the probability so trees stay prefix-closed. `--conditional`
counts a depth only where the target's tokens before it lie in the top 8 of their positions (acceptance given
that the parent path can be accepted). A third tree, chain-aware, scores each child by the same kind of table
counted apart for parents on the drafter's top-1 chain and off it (a best-first of its own). Prints, per
domain, how often the target's path runs through the raw
N = 15 trees' nodes against their path masses, by depth, and committed tokens per round (1 + accepted).
"""
from __future__ import annotations

import argparse
import math

import numpy as np
import torch

import castspec
from castspec.bench.harness import NO_THINKING
from castspec.config import DecodeConfig
from castspec.decode import decode
from castspec.prompts import heldout_prompts
from castspec.tree import build_tree

BINS = np.linspace(-12, 0, 25)  # log-probability bins
TOP_K = 8
DOMAINS = ("code", "math", "chat")


def collect(engine, per_domain: int) -> list[tuple[str, int, torch.Tensor, list[int]]]:
    """(domain, prompt index, marginals [L, V], the target's L tokens after the root) of every full block."""
    L = engine.drafter.cfg.num_draft_positions
    profile = engine.cost_profile()
    rounds = []
    for index, prompt in enumerate(heldout_prompts(per_domain)):
        ids = engine.encode(messages=[{"role": "user", "content": prompt.text}], chat_template_kwargs=NO_THINKING)
        cfg = DecodeConfig(method="cast", width=15, max_new_tokens=96, stop_token_ids=tuple(engine.stop_ids()))
        out, blocks = [], []
        on_round = lambda lp, tree, path, emitted: blocks.append((len(out), lp.detach().cpu().clone()))  # noqa: E731
        for chunk in decode(engine.target, engine.drafter, ids, cfg, profile=profile, on_round=on_round):
            out.extend(chunk)
        for before, lp in blocks:  # out[before - 1] is the round's root
            truth = out[before:before + L]
            if lp.shape[0] == L and len(truth) == L:
                rounds.append((prompt.domain, index, lp, truth))
    return rounds


def fit(rounds, L: int, conditional: bool) -> np.ndarray:
    """P(target's token | depth, log-probability bin) [L, bins], pulled toward the bin's mean probability by 4
    pseudo-counts and made non-decreasing in the probability."""
    hits, total, mass = (np.zeros((L, len(BINS))) for _ in range(3))
    for _, _, lp, truth in rounds:
        vals, cols = lp.topk(TOP_K, dim=-1)
        inside = [truth[j] in cols[j].tolist() for j in range(L)]
        for d in range(L):
            if conditional and not all(inside[:d]):
                break
            for v, c in zip(vals[d].tolist(), cols[d].tolist()):
                if v == float("-inf"):
                    continue
                b = min(int(np.searchsorted(BINS, v)), len(BINS) - 1)
                total[d, b] += 1
                hits[d, b] += c == truth[d]
                mass[d, b] += math.exp(v)
    mean = np.where(total > 0, mass / np.maximum(total, 1), np.exp(BINS))
    rate = np.maximum.accumulate((hits + 4.0 * mean) / (total + 4.0), axis=1)
    return np.clip(rate, 1e-6, 1.0)


def recalibrated(lp: torch.Tensor, table: np.ndarray) -> torch.Tensor:
    bins = torch.bucketize(lp.clamp(min=float(BINS[0])), torch.tensor(BINS, dtype=lp.dtype)).clamp(max=len(BINS) - 1)
    return torch.where(torch.isfinite(lp), torch.gather(torch.tensor(np.log(table), dtype=lp.dtype), 1, bins), lp)


def fit_chain(rounds, L: int) -> np.ndarray:
    """P(target's token | depth, log-probability bin, whether the parent path is the drafter's top-1 chain)
    [2, L, bins], counted where the target's tokens before the depth are that parent path (the top-1 chain, or
    any other path inside the top 8): acceptance that runs together along the block's own best guess."""
    hits, total, mass = (np.zeros((2, L, len(BINS))) for _ in range(3))
    for _, _, lp, truth in rounds:
        vals, cols = lp.topk(TOP_K, dim=-1)
        chain = True
        for d in range(L):
            for v, c in zip(vals[d].tolist(), cols[d].tolist()):
                if v == float("-inf"):
                    continue
                b = min(int(np.searchsorted(BINS, v)), len(BINS) - 1)
                total[int(chain), d, b] += 1
                hits[int(chain), d, b] += c == truth[d]
                mass[int(chain), d, b] += math.exp(v)
            if truth[d] not in cols[d].tolist():
                break
            chain = chain and truth[d] == cols[d, 0].item()
    mean = np.where(total > 0, mass / np.maximum(total, 1), np.exp(BINS))
    rate = np.maximum.accumulate((hits + 4.0 * mean) / (total + 4.0), axis=2)
    return np.clip(rate, 1e-6, 1.0)


def chain_aware_tree(lp: torch.Tensor, table: np.ndarray, width: int):
    """Best-first over the top-8 universe with node scores summed from fit_chain's table: a child's factor
    depends on whether its parent lies on the top-1 chain. Prefix-closed (factors are at most 1)."""
    import heapq
    from castspec.tree import Tree
    vals, cols = lp.topk(TOP_K, dim=-1)
    vals, cols = vals.tolist(), cols.tolist()
    L = len(vals)

    def score(d, r, on_chain):
        v = vals[d][r]
        if v == float("-inf"):
            return float("-inf")
        return math.log(table[int(on_chain), d, min(int(np.searchsorted(BINS, v)), len(BINS) - 1)])

    tokens, parents, depths, scores = [], [], [], []
    heap = [(-score(0, r, True), 0, r, -1, True) for r in range(len(vals[0]))]
    heapq.heapify(heap)
    while heap and len(tokens) < width:
        neg, d, r, parent, parent_chain = heapq.heappop(heap)
        if neg == float("inf"):
            break
        node = len(tokens)
        tokens.append(cols[d][r]); parents.append(parent); depths.append(d + 1); scores.append(-neg)
        on_chain = parent_chain and r == 0
        if d + 1 < L:
            for r2 in range(len(vals[d + 1])):
                heapq.heappush(heap, (neg - score(d + 1, r2, on_chain), d + 1, r2, node, on_chain))
    return Tree(tokens, parents, depths, scores)


def accepted(tree, truth: list[int]) -> int:
    """Depth of the tree's deepest node on the target's path."""
    on_path, best = {-1: True}, 0
    for i, (token, parent, depth) in enumerate(zip(tree.tokens, tree.parents, tree.depths)):
        on_path[i] = on_path[parent] and token == truth[depth - 1]
        best = max(best, depth) if on_path[i] else best
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-domain", type=int, default=4)
    ap.add_argument("--conditional", action="store_true")
    args = ap.parse_args(argv)
    engine = castspec.load()
    rounds = collect(engine, args.per_domain)
    L = engine.drafter.cfg.num_draft_positions
    sums: dict[tuple, list[int]] = {}
    for fold in (0, 1):
        table = fit([r for r in rounds if r[1] % 2 != fold], L, args.conditional)
        chain_table = fit_chain([r for r in rounds if r[1] % 2 != fold], L)
        for domain, index, lp, truth in rounds:
            if index % 2 != fold:
                continue
            for N in (7, 15, 63):
                trees = (("raw", build_tree(lp, N, TOP_K)), ("recalibrated", build_tree(recalibrated(lp, table), N, TOP_K)),
                         ("chain-aware", chain_aware_tree(lp, chain_table, N)))
                for name, tree in trees:
                    s = sums.setdefault((N, name, domain), [0, 0])
                    s[0] += accepted(tree, truth)
                    s[1] += 1
    # raw N = 15 trees: a node's path mass (the product of its positions' probabilities) against how often
    # the target's path runs through it, per domain and depth
    paths: dict[tuple, list[float]] = {}
    for domain, _, lp, truth in rounds:
        tree = build_tree(lp, 15, TOP_K)
        on_path = {-1: True}
        for i, (token, parent, depth, score) in enumerate(zip(tree.tokens, tree.parents, tree.depths, tree.scores)):
            on_path[i] = on_path[parent] and token == truth[depth - 1]
            p = paths.setdefault((domain, min(depth, 4)), [0.0, 0.0])
            p[0] += math.exp(score)
            p[1] += on_path[i]
    print("accepted / path mass, N = 15, depth 1 / 2 / 3 / 4+:",
          {d: [round(paths[d, k][1] / max(paths[d, k][0], 1e-9), 2) for k in (1, 2, 3, 4) if (d, k) in paths]
           for d in DOMAINS})
    print(f"{len(rounds)} rounds of full blocks")
    for N in (7, 15, 63):
        print(f"N = {N}:", {name: {d: round(1 + sums[N, name, d][0] / sums[N, name, d][1], 3) for d in DOMAINS}
                             for name in ("raw", "recalibrated", "chain-aware")})


if __name__ == "__main__":
    main()
