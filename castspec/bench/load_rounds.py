"""Where a load test's time goes (JSON): the scheduler in-process on the load test's prompts, every round logged.

    python -m castspec.bench.load_rounds --batch 16 --requests 64 --out runs/load-rounds.json
        [--policies ar,cost] [--max-tokens 48] [--repeats 2] [--plain-too] [--http] [--target T --drafter D]

`castspec loadtest` measures goodput through HTTP; this runs the same closed loop (`--requests` requests over
`--batch` slots, the held-out prompts in the load test's order) by stepping the scheduler itself, and splits its
rounds by kind: rounds that also read a newcomer's prompt, drafted rounds, plain rounds. Per kind: rounds, time in
the drafter pass / verify forward / host work, tokens committed, prompt tokens, and the tokens per ms of its rounds
in which every slot decoded (drafted and plain rounds of one run compared at one batch). `--plain-too` adds the
cost policy with drafting switched off, which prices what a drafting-capable request costs when it does not draft
(the drafter's features, its state); `--http` runs each also through the load test's own clients and server
(loopback, the scheduler on its thread), with the same split. Runs alternate within each repeat (the machine's speed
drifts).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import torch

from ..allocate import PolicySpec
from ..engine import load
from ..round import warm_up
from ..serving.frontend import ServerConfig
from ..serving.live import LiveServer
from ..serving.loadtest import load_messages, run_load
from ..serving.scheduler import Request, SchedulerConfig
from ..serving.server import create_app


def closed_loop_scheduler(engine, spec: str, batch: int, requests: int,
                          prefix_cache_mb: float = SchedulerConfig.prefix_cache_mb):
    """The scheduler a closed loop of `requests` requests on `batch` slots runs on, for a load test policy `spec`
    (ar, chain, cost, fixed:N, ...); and its decoding method."""
    parsed = PolicySpec.parse(spec)
    return engine.scheduler(SchedulerConfig(max_batch=batch, max_queue=max(64, requests), policy=parsed.policy,
                                            width=parsed.width, prefix_cache_mb=prefix_cache_mb),
                            parsed.method), parsed.method


def submit_closed(engine, sched, method: str, messages: list, i: int, max_tokens: int, done: list) -> None:
    """Request i of a closed loop (the load test's messages in its order), run to max_tokens as the load test's
    are; its finish reason is appended to `done`."""
    ids = engine.encode(messages=messages[i % len(messages)])
    cfg = engine.config(method=method, max_new_tokens=max_tokens, stop_token_ids=())
    sched.submit(Request(list(ids), cfg, lambda _t: None, lambda reason, _e: done.append(reason)))


def run(engine, spec: str, batch: int, requests: int, max_tokens: int, http: bool = False,
        prefix_cache_mb: float = SchedulerConfig.prefix_cache_mb) -> dict:
    """One closed loop; `spec` is a load test policy (ar, chain, cost, fixed:N, ...) or "<policy>-plain" (never
    drafts). `http`: through the load test's clients and server instead of stepping the scheduler here.
    `prefix_cache_mb`: the scheduler's kept prompt prefixes (0: every prompt read whole)."""
    messages = load_messages(8)  # the load test's, in its order
    sched, method = closed_loop_scheduler(engine, spec.removesuffix("-plain"), batch, requests, prefix_cache_mb)
    if spec.endswith("-plain"):
        sched.policy.should_draft = lambda *_, **__: False  # this run's policy object only
    rounds, done = [], []

    def log(out) -> None:
        verified = [o for o in out.sequences if o.verified]
        rounds.append({"decoding": len(verified), "drafted": out.draft_ms > 0,
                       "drafting": sum(o.draft_marginals is not None for o in verified),
                       "draft_ms": round(out.draft_ms, 3), "verify_ms": round(out.verify_ms, 3),
                       "host_ms": round(out.host_ms, 3), "rows": out.packed,
                       "prefill_tokens": out.prefill_tokens, "committed": sum(o.accepted + 1 for o in verified)})

    sched.on_round = log
    if http:  # the load test itself: its clients, the server on loopback, the scheduler on its own thread
        with LiveServer(create_app(engine, sched, ServerConfig())) as url:
            res = asyncio.run(run_load(url, messages, batch, requests, max_tokens))
        return summary(spec, batch, requests, res["tokens"], res["wall_s"], rounds) | {"http": True}
    warm_up(engine.target, sched.drafter)  # one-time costs, which Scheduler.run pays before serving
    for i in range(requests):
        submit_closed(engine, sched, method, messages, i, max_tokens, done)
    t = time.perf_counter()
    with torch.inference_mode():
        while len(done) < requests:
            sched.step()
    wall = time.perf_counter() - t
    return summary(spec, batch, requests, requests * max_tokens, wall, rounds)


def round_ms(r: dict) -> float:
    """A logged round's time: its drafter pass, verify forward and host work."""
    return r["draft_ms"] + r["verify_ms"] + r["host_ms"]


def summary(spec: str, batch: int, requests: int, tokens: int, wall: float, rounds: list[dict]) -> dict:
    """Rounds split by kind (prefill / drafted / plain) with their times and tokens, and the run's rate. Per kind
    also `full`: its rounds in which all `batch` requests decoded, with their tokens per ms (drafted and plain
    rounds of one run compared at the same batch, where the machine's speed drifts less than between runs)."""
    kinds = {}
    for r in rounds:
        kind = "prefill" if r["prefill_tokens"] else "drafted" if r["drafted"] else "plain"
        k = kinds.setdefault(kind, {"rounds": 0, "draft_ms": 0.0, "verify_ms": 0.0, "host_ms": 0.0, "committed": 0,
                                    "prefill_tokens": 0, "rows": 0, "full": {"rounds": 0, "ms": 0.0, "committed": 0}})
        k["rounds"] += 1
        for key in ("draft_ms", "verify_ms", "host_ms", "committed", "prefill_tokens", "rows"):
            k[key] += r[key]
        if r["decoding"] == batch:
            full = k["full"]
            full["rounds"] += 1
            full["ms"] += round_ms(r)
            full["committed"] += r["committed"]
    for k in kinds.values():
        k["full"]["tokens_per_ms"] = k["full"]["committed"] / k["full"]["ms"] if k["full"]["ms"] else None
    in_rounds = sum(round_ms(r) for r in rounds)
    return {"policy": spec, "batch": batch, "requests": requests, "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "in_rounds_ms": in_rounds,
            "outside_rounds_ms": wall * 1e3 - in_rounds, "http": False, "kinds": kinds, "rounds": rounds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--policies", default="ar,cost")
    p.add_argument("--plain-too", action="store_true", help="also the cost policy with drafting switched off")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--http", action="store_true", help="each run also through HTTP, as `castspec loadtest` does")
    p.add_argument("--out", default="runs/load-rounds.json")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--target", default=None)
    p.add_argument("--drafter", default=None)
    p.add_argument("--prefix-cache-mb", type=float, default=SchedulerConfig.prefix_cache_mb,
                   help="the server's kept prompt prefixes (0: off)")
    args = p.parse_args(argv)
    specs = [s.strip() for s in args.policies.split(",") if s.strip()] + (["cost-plain"] if args.plain_too else [])
    engine = load(target=args.target, drafter=args.drafter, dtype=args.dtype)
    results = []
    for rep in range(args.repeats):
        for spec, http in [(s, h) for s in specs for h in ((False, True) if args.http else (False,))]:
            res = run(engine, spec, args.batch, args.requests, args.max_tokens, http, args.prefix_cache_mb)
            results.append({"repeat": rep, **res})
            kinds = {kind: {"rounds": v["rounds"], "ms": round(round_ms(v)),
                            "committed": v["committed"], "full_tokens_per_ms": v["full"]["tokens_per_ms"]}
                     for kind, v in res["kinds"].items()}
            print(json.dumps({k: res[k] for k in ("policy", "http", "batch", "tokens_per_s", "in_rounds_ms",
                                                   "outside_rounds_ms")} | kinds))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # compact: every round of every run is in it
    out.write_text(json.dumps({"config": vars(args), "results": results}, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
