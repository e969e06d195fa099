"""`castspec loadtest`: drive the HTTP server over loopback and compare allocation policies under load.

For every policy spec and concurrency level B the command starts the server in-process (max batch = B) on a free
loopback port, sends held-out chat prompts with B clients in parallel (fixed concurrency) or as Poisson
arrivals (--rate), streams every answer (time to first token, latency, tokens) and reads /metrics afterwards.
Bounded in count (--requests) and time (--time-limit). Writes JSON (and a PNG).
"""
from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from pathlib import Path

import httpx

SPEC_HELP = "ar | chain | fixed:N | uniform:M | shared:M | cost"


def parse_spec(spec: str) -> tuple[str, str, int]:
    """Policy spec -> (method, policy, width)."""
    name, _, arg = spec.partition(":")
    if name == "ar":
        return "ar", "fixed", 0
    if name == "chain":
        return "chain", "chain", 0
    if name == "cost":
        return "cast", "cost", 15
    if name in ("fixed", "uniform", "shared"):
        try:
            width = int(arg)
        except ValueError:
            raise ValueError(f"policy {spec!r} needs a width, e.g. {name}:15") from None
        if width < 0:
            raise ValueError(f"policy {spec!r}: width must be >= 0")
        return "cast", name, width
    raise ValueError(f"unknown policy spec {spec!r}; use {SPEC_HELP}")


class LiveServer:
    """Serve an ASGI app with uvicorn on a free loopback port in a background thread."""

    def __init__(self, app):
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, name="castspec-loadtest-server", daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


async def one_request(client: httpx.AsyncClient, body: dict) -> dict:
    t0 = time.perf_counter()
    ttft, tokens, error = None, 0, None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]["message"]
                    elif event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                    elif ttft is None and any(c["delta"].get("content") for c in event["choices"]):
                        ttft = time.perf_counter() - t0
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    return {"latency_s": time.perf_counter() - t0, "ttft_s": ttft, "tokens": tokens, "error": error}


async def run_load(url: str, messages: list[list[dict]], concurrency: int, requests: int, max_tokens: int,
                   rate: float | None = None, time_limit: float = 300.0, seed: int = 0) -> dict:
    """Send `requests` chat requests (cycling through `messages`); stop submitting after `time_limit` s."""
    bodies = [{"messages": messages[i % len(messages)], "max_tokens": max_tokens, "temperature": 0,
               "stream": True, "stream_options": {"include_usage": True},
               "chat_template_kwargs": {"enable_thinking": False}} for i in range(requests)]
    results: list[dict] = []
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as client:
        before = (await client.get("/metrics", params={"format": "json"})).json()
        t0 = time.perf_counter()
        if rate is None:  # fixed concurrency: B clients, each sends its next request when the last one ends
            queue = list(reversed(bodies))

            async def worker():
                while queue and time.perf_counter() - t0 < time_limit:
                    results.append(await one_request(client, queue.pop()))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:  # Poisson arrivals at `rate` requests per second
            rng = random.Random(seed)
            tasks = []
            for body in bodies:
                if time.perf_counter() - t0 >= time_limit:
                    break
                tasks.append(asyncio.create_task(one_request(client, body)))
                await asyncio.sleep(rng.expovariate(rate))
            results = list(await asyncio.gather(*tasks))
        wall = time.perf_counter() - t0
        after = (await client.get("/metrics", params={"format": "json"})).json()
    ok = [r for r in results if r["error"] is None]
    lat = [r["latency_s"] for r in ok]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    verified = {k: after["acceptance_histogram"].get(k, 0) - before["acceptance_histogram"].get(k, 0)
                for k in after["acceptance_histogram"]}
    rounds_v = sum(verified.values())
    batches = {k: after["batch_size_histogram"].get(k, 0) - before["batch_size_histogram"].get(k, 0)
               for k in after["batch_size_histogram"]}
    return {
        "requests": len(results), "ok": len(ok), "errors": [r["error"] for r in results if r["error"]][:5],
        "tokens": tokens, "wall_s": wall, "goodput_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "p50_latency_s": percentile(lat, 50), "p99_latency_s": percentile(lat, 99),
        "p50_ttft_s": percentile(ttft, 50), "p99_ttft_s": percentile(ttft, 99),
        "mean_committed_per_round": sum((int(k) + 1) * v for k, v in verified.items()) / max(rounds_v, 1),
        "mean_batch": sum(int(k) * v for k, v in batches.items()) / max(sum(batches.values()), 1),
    }


def summarize(results: list[dict]) -> dict:
    """Per concurrency level: the best static width (fixed:N), best-first shared budgets and the cost rule."""
    out = {}
    for B in sorted({r["concurrency"] for r in results}):
        rows = {r["policy"]: r["goodput_tokens_per_s"] for r in results if r["concurrency"] == B}
        static = {k: v for k, v in rows.items() if k.startswith("fixed:")}
        shared = {k: v for k, v in rows.items() if k.startswith("shared:") or k == "cost"}
        entry = {"goodput": rows}
        if static:
            best = max(static, key=static.get)
            entry["best_static"] = {"policy": best, "goodput": static[best]}
            for k, v in shared.items():
                entry.setdefault("vs_best_static", {})[k] = v / static[best] if static[best] else None
        out[str(B)] = entry
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for pol in dict.fromkeys(r["policy"] for r in results):
        rows = sorted((r for r in results if r["policy"] == pol), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rows]
        axes[0].plot(xs, [r["goodput_tokens_per_s"] for r in rows], marker="o", label=pol)
        axes[1].plot(xs, [r["p99_latency_s"] or 0 for r in rows], marker="o", label=pol)
    axes[0].set_ylabel("goodput (tokens/s)")
    axes[1].set_ylabel("p99 latency (s)")
    for ax in axes:
        ax.set_xlabel("concurrency B")
        ax.set_xscale("log", base=2)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_loadtest(args) -> int:
    from .cli import UserError, load_engine
    from .prompts import heldout_prompts
    from .scheduler import SchedulerConfig
    from .server import ServerConfig, create_app

    try:
        levels = [int(x) for x in args.concurrency.split(",")]
        specs = [s.strip() for s in args.policies.split(",") if s.strip()]
        parsed = {s: parse_spec(s) for s in specs}
    except ValueError as e:
        raise UserError(str(e) if "policy" in str(e) else "--concurrency is a comma list of integers") from None
    if min(levels) < 1 or args.requests < 1 or args.max_tokens < 1 or (args.rate is not None and args.rate <= 0):
        raise UserError("concurrency, --requests and --max-tokens must be >= 1 and --rate > 0")
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot write to {out}: {e}") from None
    prompts = heldout_prompts(args.per_domain)
    messages = [[{"role": "user", "content": p.text}] for p in prompts]
    random.Random(0).shuffle(messages)
    results = []
    if args.url:
        for B in levels:
            res = asyncio.run(run_load(args.url, messages, B, max(args.requests, B), args.max_tokens, args.rate,
                                       args.time_limit))
            results.append({"policy": "external", "concurrency": B, **res})
            print(json.dumps(results[-1]))
    else:
        engine = load_engine(args)
        for spec, (method, policy, width) in parsed.items():
            if method != "ar" and engine.drafter is None:
                raise UserError(f"policy {spec!r} needs a drafter (pass --drafter)")
            for B in levels:
                cfg = SchedulerConfig(max_batch=B, max_queue=max(64, 4 * B), policy=policy, width=width,
                                      prefill_budget=args.prefill_budget)
                app = create_app(engine, engine.scheduler(cfg, method), ServerConfig())
                with LiveServer(app) as url:
                    res = asyncio.run(run_load(url, messages, B, max(args.requests, B), args.max_tokens, args.rate,
                                               args.time_limit))
                results.append({"policy": spec, "concurrency": B, **res})
                print(json.dumps({k: results[-1][k] for k in ("policy", "concurrency", "ok", "goodput_tokens_per_s",
                                                              "p50_latency_s", "p99_latency_s",
                                                              "mean_committed_per_round")}))
    report = {"config": {k: v for k, v in vars(args).items() if k != "func"}, "results": results,
              "summary": summarize(results)}
    (out / "loadtest.json").write_text(json.dumps(report, indent=2))
    plot(results, out / "loadtest.png")
    print(json.dumps(report["summary"], indent=2))
    return 0


def register(sub) -> None:
    from .cli import add_model_args

    p = sub.add_parser("loadtest", help="load the HTTP server over loopback; compare allocation policies",
                       description="Fixed concurrency (or Poisson arrivals) of streamed chat requests; p50/p99 "
                                   "latency, goodput, committed tokens per round; JSON + PNG.")
    add_model_args(p)
    p.add_argument("--policies", default="ar,chain,fixed:3,fixed:7,fixed:15,shared:16,shared:32,cost",
                   help=f"comma list of {SPEC_HELP}")
    p.add_argument("--concurrency", default="1,4,8,16", help="client counts B (also the server's max batch)")
    p.add_argument("--requests", type=int, default=16, help="requests per level (at least B)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second instead of fixed B")
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds per level before submission stops")
    p.add_argument("--per-domain", type=int, default=8, help="held-out prompts per domain to cycle through")
    p.add_argument("--prefill-budget", type=int, default=512)
    p.add_argument("--url", default=None, help="load an already running server instead (one config)")
    p.add_argument("--out", default="runs/loadtest")
    p.set_defaults(func=cmd_loadtest)
