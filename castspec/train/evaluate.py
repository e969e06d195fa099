"""Committed tokens per round (R) of `chain` and `cast` on the held-out prompts, per domain, in real decoding."""
from __future__ import annotations

from collections import defaultdict

from tqdm import tqdm

from ..prompts import heldout_prompts


def evaluate_drafter(engine, per_domain: int = 10, max_new_tokens: int = 128, widths=(15, 31, 63),
                     progress: bool = True) -> dict:
    prompts = heldout_prompts(per_domain)
    methods = [("chain", None)] + [("cast", w) for w in widths]
    rounds = defaultdict(lambda: defaultdict(int))  # (method) -> domain -> rounds
    tokens = defaultdict(lambda: defaultdict(int))
    for p in tqdm(prompts, desc="eval-drafter", disable=not progress):
        msgs = [{"role": "user", "content": p.text}]
        for method, width in methods:
            r = engine.generate(messages=msgs, method=method, width=width or "auto", max_new_tokens=max_new_tokens)
            key = method if width is None else f"cast@{width}"
            # R counts every committed token of every round, the target's own included
            rounds[key][p.domain] += r.stats.num_rounds
            tokens[key][p.domain] += sum(x.accepted + 1 for x in r.stats.rounds)
    report = {"per_domain": per_domain, "max_new_tokens": max_new_tokens, "dtype": engine.dtype_reason, "R": {}}
    for key in rounds:
        per = {d: tokens[key][d] / max(rounds[key][d], 1) for d in rounds[key]}
        per["mean_of_domains"] = sum(per.values()) / len(per)
        report["R"][key] = per
    return report
