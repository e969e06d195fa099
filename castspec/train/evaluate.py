"""Committed tokens per round (R) of `chain` and `cast` in real decoding, per domain, on the held-out prompts and
on prompt sets of other kinds (prompts.EVAL_SETS), each also relative to the held-out figure."""
from __future__ import annotations

from collections import defaultdict
from itertools import product

from tqdm import tqdm

from ..prompts import Prompt, eval_prompts


def request_of(engine, prompt: Prompt, max_new_tokens: int) -> dict:
    """The keyword arguments of `engine.generate` for `prompt`: a raw prompt, or the chat so far, where each
    earlier user turn is followed by the target's own (greedy `ar`) answer."""
    if not prompt.chat:
        return {"prompt": prompt.text}
    messages = []
    for turn in prompt.earlier_turns:
        messages.append({"role": "user", "content": turn})
        answer = engine.generate(messages=messages, method="ar", max_new_tokens=max_new_tokens)
        messages.append({"role": "assistant", "content": answer.text})
    return {"messages": messages + [{"role": "user", "content": prompt.text}]}


def r_per_domain(engine, prompts: list[Prompt], max_new_tokens: int, widths, progress: bool, desc: str,
                 temperature: float = 0.0, seeds=(None,)) -> dict:
    """{method: {domain: R, "mean_of_domains": R}} over `prompts` (at T > 0, once per seed, rounds pooled)."""
    methods = [("chain", None)] + [("cast", w) for w in widths]
    rounds = defaultdict(lambda: defaultdict(int))  # method -> domain -> rounds
    tokens = defaultdict(lambda: defaultdict(int))
    for p in tqdm(prompts, desc=desc, disable=not progress):
        request = request_of(engine, p, max_new_tokens)
        for (method, width), seed in product(methods, seeds):
            r = engine.generate(**request, method=method, width=width or "auto", max_new_tokens=max_new_tokens,
                                temperature=temperature, seed=seed)
            key = method if width is None else f"cast@{width}"
            # R counts every committed token of every round, the target's own included
            rounds[key][p.domain] += r.stats.num_rounds
            tokens[key][p.domain] += sum(x.accepted + 1 for x in r.stats.rounds)
    out = {}
    for key in rounds:
        per = {d: tokens[key][d] / max(rounds[key][d], 1) for d in rounds[key]}
        per["mean_of_domains"] = sum(per.values()) / len(per)
        out[key] = per
    return out


def evaluate_drafter(engine, per_domain: int = 10, max_new_tokens: int = 128, widths=(15, 31, 63),
                     progress: bool = True, sets=("heldout",), temperature: float = 0.0, seeds=(0,)) -> dict:
    """R per set (`per_domain` prompts per domain of the held-out split; as many prompts in every other set).
    "R" is the held-out table; "sets" has every set's, "relative_to_heldout" each other set's mean of domains
    over the held-out one's, per method, and "relative_to_heldout_by_domain" each of its domains over the same
    domain of the held-out set (like against like: the held-out mean includes math, whose templated answers
    are accepted far more than any other kind, and most other sets hold no math). At `temperature` > 0 every
    prompt is decoded once per seed (sampled decoding accepts by the drafter's whole distribution, not its
    top-1 alone)."""
    report = {"per_domain": per_domain, "max_new_tokens": max_new_tokens, "dtype": engine.dtype_reason}
    if temperature > 0:
        report.update(temperature=temperature, seeds=list(seeds))
    run_seeds = tuple(seeds) if temperature > 0 else (None,)
    tables = {name: r_per_domain(engine, eval_prompts(name, per_domain), max_new_tokens, widths, progress, name,
                                 temperature, run_seeds)
              for name in sets}
    if "heldout" in tables:
        report["R"] = tables["heldout"]
    if set(tables) != {"heldout"}:
        report["sets"] = tables
    if "heldout" in tables and len(tables) > 1:
        held = tables["heldout"]
        report["relative_to_heldout"] = {
            name: {m: t[m]["mean_of_domains"] / held[m]["mean_of_domains"] for m in t}
            for name, t in tables.items() if name != "heldout"}
        report["relative_to_heldout_by_domain"] = {
            name: {m: {d: r / held[m][d] for d, r in t[m].items() if d != "mean_of_domains" and d in held[m]}
                   for m in t}
            for name, t in tables.items() if name != "heldout"}
    return report
