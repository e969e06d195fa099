"""Round logs and the analyses behind the width choice (paper §3.3, Appendix G).

A round log keeps, per speculative round, the drafter's top-K log-probabilities per position (full-vocabulary
normalized) and the target's realized continuation after the root. Everything else replays from logs:
best-first masses, trees of any width or shape, and what a greedy round would have committed with them.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
from tqdm import tqdm

from .cost import Calibration, width_affine, width_table
from .decode import decode
from .tree import build_tree


def collect_rounds(engine, prompts, max_new_tokens: int = 128, top_k: int = 32, width: int = 15,
                   progress: bool = True) -> list[dict]:
    """Decode each prompt with `cast` (greedy) and log every round's top-K marginals and true continuation."""
    logs = []
    L = engine.drafter.cfg.num_draft_positions
    for p in tqdm(prompts, desc="collect", disable=not progress):
        ids = engine.encode(messages=[{"role": "user", "content": p.text}])
        rounds, emitted = [], []

        def on_round(logprobs, tree, path, new, rounds=rounds, emitted=emitted):
            vals, idx = logprobs.float().topk(top_k, dim=-1)
            rounds.append({"start": len(emitted), "top_logprobs": vals.cpu().numpy().astype(np.float32),
                           "top_ids": idx.cpu().numpy().astype(np.int32)})

        cfg = engine.config(method="cast", width=width, max_new_tokens=max_new_tokens)
        for chunk in decode(engine.target, engine.drafter, ids, cfg, on_round=on_round):
            emitted.extend(chunk)
        for r in rounds:
            # the round's root is emitted[start - 1]; the target's continuation after it is what followed
            r["continuation"] = emitted[r["start"]:r["start"] + L + 1]
            r["domain"] = p.domain
        logs.extend(rounds)
    return logs


def node_outcomes(log: dict, width: int | None, K: int = 8):
    """(depth, rank at its position, mass, accepted?) for every node of the best-first tree of `width` over the
    logged top-K (None = the top-1 chain). The tree is built on the compact [depth, K] log-prob matrix, so it sees
    exactly the candidates and scores the decoder saw; its column indices map back to token ids."""
    ids = np.asarray(log["top_ids"])[:, :K]
    cont = log["continuation"]
    depth = min(ids.shape[0], len(cont) - 1)
    if depth < 1:
        return []
    lp = torch.from_numpy(np.asarray(log["top_logprobs"])[:depth, :K])
    tree = build_tree(lp, depth, 1) if width is None else build_tree(lp, width, K)
    out, paths = [], {-1: ()}
    for i, (col, par, d, s) in enumerate(zip(tree.tokens, tree.parents, tree.depths, tree.scores)):
        paths[i] = paths[par] + (int(ids[d - 1, col]),)
        out.append((d, int(col), float(np.exp(s)), list(paths[i]) == cont[:d]))
    return out


def replay_commit(log: dict, width: int | None, K: int = 8) -> int:
    """Committed tokens of a greedy round with that tree: the deepest accepted node (prefix-closed) + 1."""
    return 1 + max((d for d, _, _, ok in node_outcomes(log, width, K) if ok), default=0)


def mass_curves(logs: list[dict], max_width: int = 127, K: int = 8) -> dict:
    """Mean sorted prefix-mass curve rho_(1..N) per domain (Figure 4c), the empirical hit rate per rank, and the
    curve after recalibrating every node's mass on the acceptance observed in these rounds (cost.Calibration:
    depth x mass bins, monotone), the masses the rules would read with `calibrate=True` once warmed up."""

    by, hits, nodes_by = defaultdict(list), defaultdict(list), defaultdict(list)
    for log in logs:
        nodes = node_outcomes(log, max_width, K)
        nodes_by[log["domain"]].append(nodes)
        m = np.zeros(max_width)
        h = np.full(max_width, np.nan)
        for i, (_, _, mass, ok) in enumerate(nodes):
            m[i], h[i] = mass, float(ok)
        by[log["domain"]].append(m)
        hits[log["domain"]].append(h)
    out = {}
    for d in by:
        depth_cap = max((n[0] for nodes in nodes_by[d] for n in nodes), default=1)
        cal = Calibration(depths=depth_cap)
        for nodes in nodes_by[d]:
            if nodes:
                depths, _, masses, ok = zip(*nodes)
                cal.observe(depths, masses, [float(x) for x in ok])
        calibrated = []
        for nodes in nodes_by[d]:
            c = np.zeros(max_width)
            if nodes:
                depths, _, masses, _ = zip(*nodes)
                c[:len(nodes)] = cal.apply(depths, masses)
            calibrated.append(np.sort(c)[::-1])  # the rules read a best-first (descending) curve
        out[d] = {"rounds": len(by[d]), "mean_mass": np.mean(by[d], axis=0).tolist(),
                  "hit_rate": np.nanmean(np.array(hits[d]), axis=0).tolist(),
                  "calibrated_mass": np.mean(calibrated, axis=0).tolist()}
    return out


def analyze(logs: list[dict], K_small: int = 8, budgets=(15, 31, 63)) -> dict:
    """The Appendix G analyses from round logs."""
    report: dict = {}
    # 1. rank of the target's correction at the first chain rejection
    ranks = defaultdict(lambda: defaultdict(int))
    # 2. depth-1 calibration: predicted top-1 probability vs hit rate
    calib = defaultdict(lambda: np.zeros((10, 2)))
    for log in logs:
        ids, lp, cont = np.asarray(log["top_ids"]), np.asarray(log["top_logprobs"]), log["continuation"]
        Kmax = ids.shape[1]
        for d in range(min(ids.shape[0], len(cont))):
            if ids[d, 0] != cont[d]:
                where = np.nonzero(ids[d] == cont[d])[0]
                r = int(where[0]) + 1 if len(where) else None
                key = "outside_top_%d" % Kmax if r is None else ("rank_2_4" if r <= 4 else
                                                                 "rank_5_8" if r <= 8 else "rank_9_plus")
                ranks[log["domain"]][key] += 1
                break
        if cont:
            p = float(np.exp(lp[0, 0]))
            b = min(int(p * 10), 9)
            calib[log["domain"]][b] += [1, float(ids[0, 0] == cont[0])]
    report["first_rejection_rank"] = {d: {k: v / max(sum(c.values()), 1) for k, v in c.items()}
                                      for d, c in ranks.items()}
    report["depth1_calibration"] = {d: [{"bin": f"[{b / 10:.1f},{(b + 1) / 10:.1f})", "rounds": int(c[b, 0]),
                                         "hit_rate": float(c[b, 1] / c[b, 0]) if c[b, 0] else None}
                                        for b in range(10)] for d, c in calib.items()}
    # 3. rank-cap ablation and 4. tree shape at matched budgets, replayed
    doms = sorted({log["domain"] for log in logs})
    Kmax = min(np.asarray(logs[0]["top_ids"]).shape[1], 32) if logs else K_small
    ablation, shapes = {}, {}
    for d in doms:
        ds = [log for log in logs if log["domain"] == d]
        ablation[d] = {f"N={n}": {f"K={k}": float(np.mean([replay_commit(log, n, k) for log in ds]))
                                  for k in (K_small, Kmax)} for n in budgets}
        shapes[d] = {f"N={n}": {"top-N best-first": float(np.mean([replay_commit(log, n, K_small) for log in ds])),
                                "fixed K-ary then chains": float(np.mean([fixed_shape_commit(log, n) for log in ds]))}
                     for n in budgets}
        shapes[d]["chain"] = float(np.mean([replay_commit(log, None) for log in ds]))
    report["rank_cap_ablation"] = ablation
    report["tree_shape_at_matched_budget"] = shapes
    return report


def fixed_shape_commit(log: dict, budget: int) -> int:
    """A fixed shape with the same node count: the top-b tokens at depth 1, each followed by its top-1 chain
    (b chosen so that b * depth ~ budget), the kind of static tree a sweep-free system would hard-code."""
    ids = np.asarray(log["top_ids"])
    cont = log["continuation"]
    depth = min(ids.shape[0], len(cont) - 1)
    if depth < 1:
        return 1
    branches = max(1, min(ids.shape[1], budget // depth))
    best = 0
    for b in range(branches):
        path = [int(ids[0, b])] + [int(ids[j, 0]) for j in range(1, depth)]
        n = 0
        while n < len(path) and path[n] == cont[n]:
            n += 1
        best = max(best, n)
    return best + 1


def predicted_widths(curves: dict, profile, prefix: int, max_width: int) -> dict:
    """Per domain, the width the affine and the table rule pick for its mean mass curve."""
    out = {}
    for d, c in curves.items():
        m = np.asarray(c["mean_mass"])
        out[d] = {"affine": width_affine(m, profile, prefix, max_width),
                  "table": width_table(m, profile, prefix, max_width)}
        if "calibrated_mass" in c:
            cm = np.asarray(c["calibrated_mass"])
            out[d].update(affine_cal=width_affine(cm, profile, prefix, max_width),
                          table_cal=width_table(cm, profile, prefix, max_width))
    return out
