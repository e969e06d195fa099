"""Two serving policies on one engine, their rounds alternating: what a round of each costs under the same drifts
of the machine. Each policy gets its own scheduler and the load test's closed loop (`--requests` requests of
`--max-tokens` on `--batch` slots, the held-out prompts in the load test's order); with `--b1-first` each first
serves those requests one at a time, as `castspec loadtest --concurrency 1,16` does before its batched run (the
policy's state and the kept prompt prefixes carry over). Then their rounds alternate, one each, until both are
done. Prints per policy (JSON): rounds, drafted rounds, the median verify and host ms of its plain rounds of a
full batch, and the ms spent in its scheduler steps, inside rounds and outside them (admission, retirement,
kept prefixes).

    python scripts/sched_ab.py [--policies ar,cost] [--batch 16] [--requests 16] [--max-tokens 48] [--b1-first]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import castspec
from castspec.bench.load_rounds import closed_loop_scheduler, submit_closed
from castspec.round import warm_up
from castspec.serving.loadtest import load_messages


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="ar,cost")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--b1-first", action="store_true", help="each policy first serves the requests one at a time")
    args = p.parse_args()
    engine = castspec.load()
    messages = load_messages(8)
    runs = {}
    for name in args.policies.split(","):
        sched, method = closed_loop_scheduler(engine, name, args.batch, args.requests)
        rounds: list = []
        sched.on_round = rounds.append
        warm_up(engine.target, sched.drafter)
        runs[name] = {"sched": sched, "method": method, "rounds": rounds, "done": [], "step_ms": 0.0}

    def submit(run, i) -> None:
        submit_closed(engine, run["sched"], run["method"], messages, i, args.max_tokens, run["done"])

    with torch.inference_mode():
        if args.b1_first:
            for run in runs.values():
                for i in range(args.requests):
                    submit(run, i)
                    while len(run["done"]) <= i:
                        run["sched"].step()
                run["rounds"].clear()
                run["done"].clear()
        for run in runs.values():
            for i in range(args.requests):
                submit(run, i)
        while any(len(run["done"]) < args.requests for run in runs.values()):
            for run in runs.values():
                if len(run["done"]) < args.requests:
                    t = time.perf_counter()
                    run["sched"].step()
                    run["step_ms"] += (time.perf_counter() - t) * 1e3
    for name, run in runs.items():
        rounds = run["rounds"]
        plain = [o for o in rounds if not o.prefill_tokens and not o.draft_ms and o.packed == args.batch]
        inside = sum(o.draft_ms + o.verify_ms + o.host_ms for o in rounds)
        print(json.dumps({"policy": name, "b1_first": args.b1_first, "rounds": len(rounds),
                          "drafted": sum(o.draft_ms > 0 for o in rounds), "plain_full": len(plain),
                          "plain_verify_ms": round(statistics.median(o.verify_ms for o in plain), 3) if plain else None,
                          "plain_host_ms": round(statistics.median(o.host_ms for o in plain), 3) if plain else None,
                          "step_ms": round(run["step_ms"], 1), "in_rounds_ms": round(inside, 1),
                          "outside_rounds_ms": round(run["step_ms"] - inside, 1)}))


if __name__ == "__main__":
    main()
