"""`castspec diagnose-drafter`: a drafter's teacher-forced accuracy per block position next to n-gram baselines
counted on the same responses, so a drafter stuck below what the previous token alone predicts shows up at once.
"""
from __future__ import annotations

import random
from collections import Counter, defaultdict

from .replay import replay_r


def ngram_baselines(train: list[dict], test: list[dict], orders=(1, 2, 3)) -> dict:
    """Top-1 accuracy on `test` responses of "the most frequent next token after the previous n-1 tokens",
    counted on `train` responses (a context never seen counts as a miss)."""
    def events(records: list[dict], n: int):
        """(previous n-1 tokens, next token) for every response token (the prompt's tail gives the first context)."""
        for r in records:
            t = r["prompt_ids"][-(n - 1):] + r["response_ids"] if n > 1 else r["response_ids"]
            for i in range(n - 1, len(t)):
                yield tuple(t[i - n + 1:i]), t[i]

    out = {}
    for n in orders:
        counts: dict[tuple, Counter] = defaultdict(Counter)
        for context, nxt in events(train, n):
            counts[context][nxt] += 1
        best = {k: c.most_common(1)[0][0] for k, c in counts.items()}
        hits = total = 0
        for context, nxt in events(test, n):
            total += 1
            hits += best.get(context) == nxt
        out[{1: "unigram", 2: "bigram", 3: "trigram"}.get(n, f"{n}-gram")] = hits / max(total, 1)
    return out


def diagnose(target, drafter, records: list[dict], test_records: int = 200, seed: int = 0) -> dict:
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    test = [records[i] for i in order[:test_records]]
    train = [records[i] for i in order[test_records:]]
    replay = replay_r(target, drafter, test)
    return {"test_records": len(test), "ngram_top1": ngram_baselines(train, test),
            "drafter_top1_by_position": replay.pop("top1_accuracy_by_position"),
            "drafter_top1_by_position_by_domain": replay.pop("top1_accuracy_by_position_by_domain"),
            "replay_R": {k: v["mean_of_domains"] for k, v in replay.items()}}
