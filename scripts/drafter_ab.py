"""Two drafters for the same target, compared in one process: for each of `castspec bench`'s prompts, `ar` and
`cast` with drafter A and with drafter B run back to back, ROUNDS times, so that the machine's drifts (its speed
swings between runs and within them) land on all three alike. Prints one JSON line per round and the medians
over rounds: per domain and for the mean of domains, each drafter's decode speedup over the `ar` run beside it,
its committed tokens per round (R), and B over A.

    python scripts/drafter_ab.py --a castspec/assets/drafter-smollm2-135m --b runs/X/drafter [--n 3]
        [--max-new-tokens 96] [--width auto] [--rounds 3] [--domains code,math,chat]

Decode time as `castspec bench` counts it (after prefill and the first drafter pass). Nothing else should run.
"""
from __future__ import annotations

import argparse
import json
import statistics

import castspec
from castspec.bench.harness import MethodSpec, builtin_prompts, run_ours


def one_round(engines: dict, prompts, spec: MethodSpec, max_new: int) -> dict:
    """Per domain, per drafter: the sum of `ar` decode ms over the sum of `cast` decode ms, and R."""
    totals: dict = {}
    for p in prompts:
        ar = run_ours(engines["a"], p, MethodSpec("ar"), max_new, 0.0, None)
        for side, engine in engines.items():
            run = run_ours(engine, p, spec, max_new, 0.0, None)
            t = totals.setdefault(p.domain, {}).setdefault(side, {"ar_ms": 0.0, "ms": 0.0, "committed": 0,
                                                                   "rounds": 0})
            # per token, since the two runs of a prompt emit the same tokens (greedy, exact)
            t["ar_ms"] += ar.decode_ms
            t["ms"] += run.decode_ms
            t["committed"] += run.committed
            t["rounds"] += run.rounds
    out = {}
    for domain, sides in totals.items():
        out[domain] = {side: {"speedup": t["ar_ms"] / t["ms"], "R": t["committed"] / max(t["rounds"], 1)}
                       for side, t in sides.items()}
    out["mean_of_domains"] = {side: {k: statistics.mean(out[d][side][k] for d in totals) for k in ("speedup", "R")}
                              for side in engines}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, help="drafter A (the reference)")
    p.add_argument("--b", required=True, help="drafter B")
    p.add_argument("--n", type=int, default=3, help="prompts per domain")
    p.add_argument("--domains", default="code,math,chat")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--width", default="auto", help="cast's width: auto or an integer")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    engines = {"a": castspec.load(drafter=args.a), "b": castspec.load(drafter=args.b)}
    for engine in engines.values():  # one-time costs (the cost profile, first calls) before anything is timed
        engine.generate(prompt="Hello", method="cast", max_new_tokens=8)
    prompts = builtin_prompts(args.domains.split(","), args.n)
    spec = MethodSpec.parse(f"cast:{args.width}")
    rounds = []
    for i in range(args.rounds):
        r = one_round(engines, prompts, spec, args.max_new_tokens)
        rounds.append(r)
        print(json.dumps({"round": i, **{d: {s: {k: round(v, 3) for k, v in x.items()} for s, x in sides.items()}
                                         for d, sides in r.items()}}), flush=True)
    medians = {d: {s: {k: round(statistics.median(r[d][s][k] for r in rounds), 3) for k in ("speedup", "R")}
                   for s in engines} for d in rounds[0]}
    for d, sides in medians.items():
        sides["b/a"] = round(sides["b"]["speedup"] / sides["a"]["speedup"], 3)
    print(json.dumps({"a": args.a, "b": args.b, "width": args.width, "median": medians}))


if __name__ == "__main__":
    main()
