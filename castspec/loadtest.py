"""`castspec loadtest`: drive the HTTP server over loopback and compare allocation policies under load.

For every policy spec and concurrency level B the command starts the server in-process (max batch = B) on a free
loopback port, sends held-out chat prompts with B clients in parallel (fixed concurrency) or as Poisson
arrivals (--rate), streams every answer (time to first token, latency, tokens) and reads /metrics afterwards.
Bounded in count (--requests) and time (--time-limit). Writes JSON (and a PNG).

`--soak` instead runs one long mixed load against a real `castspec serve` process on 127.0.0.1: streaming and
non-streaming, chat and completions, greedy and seeded sampling, a share of streams abandoned by their clients.
It reports errors, p50/p99 latency, what is still running or queued afterwards, the server's resident memory
over the run, and how long the server takes to exit on SIGTERM.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

SPEC_HELP = "ar | chain | fixed:N | uniform:M | shared:M | cost"
DEFAULT_POLICIES = "ar,chain,fixed:3,fixed:7,fixed:15,shared:16,shared:32,cost"


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


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_loopback(url: str) -> str:
    """Load tests only ever talk to this machine."""
    host = urlsplit(url).hostname
    if host not in LOOPBACK:
        raise ValueError(f"--url must point at this machine ({', '.join(LOOPBACK)}), got host {host!r}")
    return url.rstrip("/")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`castspec serve` in a child process on a free loopback port; leaving the block sends SIGTERM and
    records how long the process took to exit (`shutdown_s`)."""

    def __init__(self, serve_args: list[str], log_path: Path, start_timeout: float = 600.0):
        self.port = free_port()
        self.args = [sys.executable, "-m", "castspec", "serve", "--host", "127.0.0.1", "--port",
                     str(self.port), *serve_args]
        self.log_path, self.start_timeout = log_path, start_timeout
        self.proc: subprocess.Popen | None = None
        self.shutdown_s: float | None = None

    def __enter__(self) -> str:
        url = f"http://127.0.0.1:{self.port}"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.time() + self.start_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"castspec serve exited with status {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"castspec serve did not answer /health within {self.start_timeout:.0f} s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            t = time.perf_counter()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
                self.shutdown_s = time.perf_counter() - t
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@dataclass
class SoakConfig:
    requests: int = 400
    concurrency: int = 12
    max_tokens: int = 64
    stream_share: float = 0.5  # of requests that stream
    abandon_share: float = 0.25  # of streams whose client leaves after the first chunk
    chat_share: float = 0.75  # of requests to /v1/chat/completions (the rest to /v1/completions)
    sampled_share: float = 0.25  # of requests at temperature 0.8 with a seed (the rest greedy)
    time_limit: float = 600.0  # seconds after which no new request starts
    sample_every: float = 2.0  # seconds between /metrics readings
    seed: int = 0

    def __post_init__(self):
        if self.requests < 1 or self.concurrency < 1 or self.max_tokens < 1:
            raise ValueError("--requests, --concurrency and --max-tokens must be >= 1")
        for name in ("stream_share", "abandon_share", "chat_share", "sampled_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name.replace('_', '-')} must be in [0, 1], got {getattr(self, name)}")
        if self.time_limit <= 0 or self.sample_every <= 0:
            raise ValueError("--time-limit and --sample-every must be > 0")


def soak_plan(messages: list[list[dict]], cfg: SoakConfig) -> list[dict]:
    """The requests of a soak, drawn from `cfg.seed`: endpoint, body and whether the client abandons it."""
    rng = random.Random(cfg.seed)
    plan = []
    for i in range(cfg.requests):
        msgs = messages[i % len(messages)]
        chat = rng.random() < cfg.chat_share
        stream = rng.random() < cfg.stream_share
        body = {"max_tokens": cfg.max_tokens, "stream": stream, "temperature": 0.0}
        if rng.random() < cfg.sampled_share:
            body.update(temperature=0.8, seed=rng.randrange(2 ** 31))
        if chat:
            body["messages"] = msgs
        else:
            body["prompt"] = msgs[-1]["content"]
        if stream:
            body["stream_options"] = {"include_usage": True}
        plan.append({"path": "/v1/chat/completions" if chat else "/v1/completions", "body": body,
                     "abandon": stream and rng.random() < cfg.abandon_share})
    return plan


async def soak_request(client: httpx.AsyncClient, item: dict) -> dict:
    """One request of the plan: status "ok", "abandoned", "rejected" (429) or "error", latency and tokens."""
    t0 = time.perf_counter()
    out = {"status": "ok", "error": None, "ttft_s": None, "tokens": 0, "stream": item["body"]["stream"]}
    try:
        if not item["body"]["stream"]:
            r = await client.post(item["path"], json=item["body"])
            if r.status_code == 200:
                out["tokens"] = r.json()["usage"]["completion_tokens"]
            else:
                out.update(status="rejected" if r.status_code == 429 else "error",
                           error=f"HTTP {r.status_code}: {r.text[:200]}")
        else:
            async with client.stream("POST", item["path"], json=item["body"]) as r:
                if r.status_code != 200:
                    out.update(status="rejected" if r.status_code == 429 else "error",
                               error=f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
                else:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        if out["ttft_s"] is None:
                            out["ttft_s"] = time.perf_counter() - t0
                        if item["abandon"]:
                            out["status"] = "abandoned"
                            break  # leaving the block closes the connection mid-stream
                        event = json.loads(line[6:])
                        if "error" in event:
                            out.update(status="error", error=event["error"]["message"])
                        elif event.get("usage"):
                            out["tokens"] = event["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        out.update(status="error", error=f"{type(e).__name__}: {e}")
    out["latency_s"] = time.perf_counter() - t0
    return out


async def run_soak(url: str, messages: list[list[dict]], cfg: SoakConfig) -> dict:
    """Run the soak against `url` (loopback): `cfg.concurrency` clients work through the plan; /metrics is
    read every `cfg.sample_every` s for the server's resident memory, running and queued requests."""
    url = check_loopback(url)
    plan = list(reversed(soak_plan(messages, cfg)))
    results: list[dict] = []
    samples: list[dict] = []
    limits = httpx.Limits(max_connections=cfg.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def metrics() -> dict:
            return (await client.get("/metrics", params={"format": "json"})).json()

        before = await metrics()
        t0 = time.perf_counter()

        def sample(snap: dict) -> None:
            samples.append({"t_s": round(time.perf_counter() - t0, 2), "done": len(results),
                            "rss_mb": round(snap["rss_bytes"] / 2 ** 20, 1), "active": snap["active"],
                            "queued": snap["queued"]})

        async def sampler():
            while True:
                sample(await metrics())
                await asyncio.sleep(cfg.sample_every)

        async def worker():
            while plan and time.perf_counter() - t0 < cfg.time_limit:
                results.append(await soak_request(client, plan.pop()))

        watch = asyncio.create_task(sampler())
        await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
        wall = time.perf_counter() - t0
        watch.cancel()
        settle = time.perf_counter()  # abandoned requests leave at the next round boundary
        after = await metrics()
        while (after["active"] or after["queued"]) and time.perf_counter() - settle < 30:
            await asyncio.sleep(0.2)
            after = await metrics()
        sample(after)
    return soak_report(results, samples, before, after, wall, cfg)


def soak_report(results: list[dict], samples: list[dict], before: dict, after: dict, wall: float,
                cfg: SoakConfig) -> dict:
    by = {k: [r for r in results if r["status"] == k] for k in ("ok", "abandoned", "rejected", "error")}
    lat = [r["latency_s"] for r in by["ok"]]
    ttft = [r["ttft_s"] for r in by["ok"] + by["abandoned"] if r["ttft_s"] is not None]
    rss = [s["rss_mb"] for s in samples]
    half = [s["rss_mb"] for s in samples if s["done"] >= len(results) / 2]
    return {
        "config": asdict(cfg), "requests": len(results), "unsent": cfg.requests - len(results),
        "ok": len(by["ok"]), "abandoned": len(by["abandoned"]), "rejected_429": len(by["rejected"]),
        "errors": len(by["error"]), "error_samples": [r["error"] for r in by["error"]][:5],
        "streamed": sum(r["stream"] for r in results), "tokens": sum(r["tokens"] for r in by["ok"]),
        "wall_s": wall, "p50_latency_s": percentile(lat, 50), "p99_latency_s": percentile(lat, 99),
        "p50_ttft_s": percentile(ttft, 50), "p99_ttft_s": percentile(ttft, 99),
        "after": {"active": after["active"], "queued": after["queued"]},
        "server_requests": {k: after["requests"].get(k, 0) - before["requests"].get(k, 0) for k in after["requests"]},
        "rss_mb": {"first": rss[0] if rss else None, "last": rss[-1] if rss else None,
                   "max": max(rss) if rss else None,
                   "second_half_range": [min(half), max(half)] if half else None},
        "samples": samples,
    }


def plot_soak(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s["done"] for s in report["samples"]], [s["rss_mb"] for s in report["samples"]], marker=".")
    ax.set_xlabel("requests done")
    ax.set_ylabel("server resident memory (MiB)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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


def soak_serve_args(args, spec: str) -> list[str]:
    """`castspec serve` flags for the soak's server: the model flags given to loadtest, and the policy spec."""
    method, policy, width = parse_spec(spec)
    out = ["--method", method, "--policy", "fixed" if method == "ar" else policy, "--width", str(width),
           "--max-batch", str(args.max_batch), "--prefill-budget", str(args.prefill_budget),
           "--device", args.device, "--dtype", args.dtype]
    for flag, value in (("--target", args.target), ("--drafter", args.drafter)):
        if value is not None:
            out += [flag, value]
    return out


def cmd_soak(args, messages: list[list[dict]], out: Path) -> int:
    from .cli import UserError

    spec = args.policies or "cost"
    try:
        cfg = SoakConfig(requests=args.requests or 400, concurrency=int(args.concurrency or 12),
                         max_tokens=args.max_tokens, abandon_share=args.abandon, stream_share=args.stream_share,
                         time_limit=args.time_limit, sample_every=args.sample_every)
        serve_args = soak_serve_args(args, spec)
    except ValueError as e:
        raise UserError(f"{e} (--soak takes one --policies spec and one --concurrency)") from None
    if args.max_batch < 1:
        raise UserError("--max-batch must be >= 1")
    server = None
    if args.url:
        report = asyncio.run(run_soak(args.url, messages, cfg))
    else:
        server = ServeProcess(serve_args, out / "server.log")
        with server as url:
            report = asyncio.run(run_soak(url, messages, cfg))
        report["shutdown_s"] = server.shutdown_s
        report["server"] = {"policy": spec, "max_batch": args.max_batch, "exit_status": server.proc.returncode}
    (out / "soak.json").write_text(json.dumps(report, indent=2))
    plot_soak(report, out / "soak.png")
    print(json.dumps({k: v for k, v in report.items() if k not in ("samples", "config")}, indent=2))
    return 0


def cmd_loadtest(args) -> int:
    from .cli import UserError, load_engine
    from .prompts import heldout_prompts
    from .scheduler import SchedulerConfig
    from .server import ServerConfig, create_app

    try:
        if args.url:
            args.url = check_loopback(args.url)
    except ValueError as e:
        raise UserError(str(e)) from None
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot write to {out}: {e}") from None
    prompts = heldout_prompts(args.per_domain)
    messages = [[{"role": "user", "content": p.text}] for p in prompts]
    random.Random(0).shuffle(messages)
    if args.soak:
        return cmd_soak(args, messages, out)
    if args.tax:
        return cmd_tax(args, messages, out)
    args.requests = args.requests or 16
    try:
        levels = [int(x) for x in (args.concurrency or "1,4,8,16").split(",")]
        specs = [s.strip() for s in (args.policies or DEFAULT_POLICIES).split(",") if s.strip()]
        parsed = {s: parse_spec(s) for s in specs}
    except ValueError as e:
        raise UserError(str(e) if "policy" in str(e) else "--concurrency is a comma list of integers") from None
    if min(levels) < 1 or args.requests < 1 or args.max_tokens < 1 or (args.rate is not None and args.rate <= 0):
        raise UserError("concurrency, --requests and --max-tokens must be >= 1 and --rate > 0")
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


def cmd_tax(args, messages: list[list[dict]], out: Path) -> int:
    """--tax: the server's per-token cost over the engine it wraps, at concurrency 1 (castspec/bench/tax.py)."""
    from .bench.tax import measure_tax
    from .cli import UserError, load_engine

    engine = load_engine(args)
    prompts = [engine.encode(messages=m) for m in messages[:args.requests or 6]]
    report = {"config": {k: v for k, v in vars(args).items() if k != "func"}, "results": []}
    for spec in [s.strip() for s in (args.policies or "ar").split(",") if s.strip()]:
        method, policy, width = parse_spec(spec)
        if method != "ar" and engine.drafter is None:
            raise UserError(f"policy {spec!r} needs a drafter (pass --drafter)")
        res = measure_tax(engine, prompts, method, args.max_tokens, policy, width, args.repeats)
        report["results"].append({"policy": spec, **res})
        print(json.dumps({"policy": spec, **res["summary"]}))
    (out / "tax.json").write_text(json.dumps(report, indent=2))
    return 0


def register(sub) -> None:
    from .cli import add_model_args

    p = sub.add_parser("loadtest", help="load the HTTP server over loopback; compare allocation policies",
                       description="Fixed concurrency (or Poisson arrivals) of streamed chat requests; p50/p99 "
                                   "latency, goodput, committed tokens per round; JSON + PNG.")
    add_model_args(p)
    p.add_argument("--policies", default=None,
                   help=f"comma list of {SPEC_HELP} (default {DEFAULT_POLICIES}; --soak: one spec, default cost)")
    p.add_argument("--concurrency", default=None,
                   help="client counts B, also the server's max batch (default 1,4,8,16; --soak: one count, "
                        "default 12)")
    p.add_argument("--requests", type=int, default=None, help="requests per level, at least B (default 16; "
                                                               "--soak: in all, default 400)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second instead of fixed B")
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds per level before submission stops")
    p.add_argument("--per-domain", type=int, default=8, help="held-out prompts per domain to cycle through")
    p.add_argument("--prefill-budget", type=int, default=512)
    p.add_argument("--url", default=None, help="load an already running server on this machine instead")
    p.add_argument("--out", default="runs/loadtest")
    t = p.add_argument_group("serving tax (--tax)")
    t.add_argument("--tax", action="store_true",
                   help="at concurrency 1: engine.generate vs the scheduler in-process vs streamed HTTP on the same "
                        "prompts (decode ms/token, time to first token); --requests prompts (default 6)")
    t.add_argument("--repeats", type=int, default=1, help="passes over the prompts")
    s = p.add_argument_group("soak (--soak)")
    s.add_argument("--soak", action="store_true",
                   help="one long mixed load against a `castspec serve` process on 127.0.0.1: errors, p50/p99, "
                        "running/queued afterwards, the server's memory over the run, its exit time on SIGTERM")
    s.add_argument("--max-batch", type=int, default=8, help="the soak server's --max-batch")
    s.add_argument("--abandon", type=float, default=0.25, help="share of streams whose client leaves early")
    s.add_argument("--stream-share", type=float, default=0.5, help="share of requests that stream")
    s.add_argument("--sample-every", type=float, default=2.0, help="seconds between readings of /metrics")
    p.set_defaults(func=cmd_loadtest)
