"""Load generators for a running server (over loopback), the reports they make and their plots.

- `run_load`: chat requests, all streamed, from B clients in parallel (fixed concurrency) or as Poisson arrivals;
  time to first token, latency, goodput, and what /metrics says the server did meanwhile (committed tokens per
  round, batch sizes). `summarize` compares allocation policies per concurrency level.
- `run_soak`: one long mixed load (streaming and not, chat and completions, greedy and seeded sampling, a share
  of streams abandoned by their clients), with /metrics read as it runs: errors, p50/p99, what is still running
  or queued afterwards, the server's resident memory over the run.

`castspec loadtest` (castspec/cli/loadtest.py) starts the servers, picks the policies and writes the reports.
Bounded in count (requests) and time (time_limit).

The clients are aiohttp's (its HTTP parser is C) and parse only the events they read something from: on 2 cores
the load generator shares the CPU (and, against an in-process server, the interpreter) with what it measures, so
what it spends a token is taken from the server. Reports say how much CPU the client's thread used
(`client_cpu_s`).
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from ..prompts import heldout_prompts
from .live import check_loopback


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def chat_body(messages: list[dict], max_tokens: int) -> dict:
    """A load test's request: greedy, streamed, its usage in the last event, no thinking turn."""
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "chat_template_kwargs": {"enable_thinking": False}}


def session(url: str, connections: int = 100) -> aiohttp.ClientSession:
    """The load generators' client for the server at `url`: at most `connections` open at once."""
    return aiohttp.ClientSession(base_url=url, timeout=aiohttp.ClientTimeout(total=600.0),
                                 connector=aiohttp.TCPConnector(limit=connections))


async def metrics_json(client: aiohttp.ClientSession) -> dict:
    async with client.get("/metrics", params={"format": "json"}) as r:
        return await r.json()


def data_event(line: bytes) -> bytes | None:
    """An SSE line's JSON payload; None for other lines and the closing [DONE]."""
    if not line.startswith(b"data: "):
        return None
    payload = line[6:].rstrip()
    return None if payload == b"[DONE]" else payload


async def http_error(r: aiohttp.ClientResponse) -> str:
    """A refused response's status and the start of the server's message."""
    return f"HTTP {r.status}: {(await r.read()).decode()[:200]}"


async def one_request(client: aiohttp.ClientSession, body: dict, keep_text: bool = False) -> dict:
    """One streamed chat request: latency, time to first token, tokens, the usage's prompt and cached prompt
    tokens; with `keep_text`, the answer's text too. Events after the first token are parsed only when they may
    carry an error or the usage (or the text is kept): the counts come from the usage."""
    t0 = time.perf_counter()
    ttft, tokens, error, usage, text = None, 0, None, {}, []
    try:
        async with client.post("/v1/chat/completions", json=body) as r:
            if r.status != 200:
                error = await http_error(r)
            else:
                async for line in r.content:
                    payload = data_event(line)
                    if payload is None:
                        continue
                    if ttft is not None and not keep_text and b'"usage"' not in payload and b'"error"' not in payload:
                        continue
                    event = json.loads(payload)
                    if "error" in event:
                        error = event["error"]["message"]
                    elif event.get("usage"):
                        usage = event["usage"]
                        tokens = usage["completion_tokens"]
                    else:
                        if ttft is None and any(c["delta"].get("content") for c in event["choices"]):
                            ttft = time.perf_counter() - t0
                        if keep_text:
                            text.extend(c["delta"].get("content") or "" for c in event["choices"])
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        error = f"{type(e).__name__}: {e}"
    out = {"latency_s": time.perf_counter() - t0, "ttft_s": ttft, "tokens": tokens, "error": error,
           "prompt_tokens": usage.get("prompt_tokens", 0),
           "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)}
    if keep_text:
        out["text"] = "".join(text)
    return out


async def run_conversations(url: str, conversations: list[tuple[str, str]], concurrency: int, max_tokens: int,
                            time_limit: float = 300.0) -> dict:
    """Two-turn chats (first question, second question) over `concurrency` clients: each sends its first turn,
    then the whole conversation with the second (the server's answer included), as a chat client does. Per
    turn: p50/p99 time to first token, the prompt tokens and those the server copied instead of reading them
    (castspec.prefix_cache)."""
    turns: dict[int, list[dict]] = {1: [], 2: []}
    queue = list(reversed(conversations))
    async with session(url) as client:
        t0, cpu0 = time.perf_counter(), time.thread_time()

        async def worker():
            while queue and time.perf_counter() - t0 < time_limit:
                first, second = queue.pop()
                chat = [{"role": "user", "content": first}]
                one = await one_request(client, chat_body(chat, max_tokens), keep_text=True)
                turns[1].append(one)
                if one["error"] is None:
                    chat += [{"role": "assistant", "content": one["text"]}, {"role": "user", "content": second}]
                    turns[2].append(await one_request(client, chat_body(chat, max_tokens)))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    report = {"conversations": len(turns[1]), "wall_s": wall, "client_cpu_s": cpu}
    for t, results in turns.items():
        ok = [r for r in results if r["error"] is None]
        ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
        report[f"turn{t}"] = {
            "requests": len(results), "ok": len(ok), "errors": [r["error"] for r in results if r["error"]][:5],
            "p50_ttft_s": percentile(ttft, 50), "p99_ttft_s": percentile(ttft, 99),
            "prompt_tokens": sum(r["prompt_tokens"] for r in ok), "cached_tokens": sum(r["cached_tokens"] for r in ok),
            "tokens": sum(r["tokens"] for r in ok)}
    return report


def load_messages(per_domain: int) -> list[list[dict]]:
    """The load test's requests: the held-out prompts (`per_domain` of each domain) as one user turn each, in one
    fixed shuffled order."""
    messages = [[{"role": "user", "content": p.text}] for p in heldout_prompts(per_domain)]
    random.Random(0).shuffle(messages)
    return messages


async def run_load(url: str, messages: list[list[dict]], concurrency: int, requests: int, max_tokens: int,
                   rate: float | None = None, time_limit: float = 300.0, seed: int = 0) -> dict:
    """Send `requests` chat requests (cycling through `messages`); stop submitting after `time_limit` s."""
    bodies = [chat_body(messages[i % len(messages)], max_tokens) for i in range(requests)]
    results: list[dict] = []
    async with session(url) as client:
        before = await metrics_json(client)
        t0, cpu0 = time.perf_counter(), time.thread_time()
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
        wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
        after = await metrics_json(client)
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
        "requests": len(results), "ok": len(ok),
        # prompt tokens the server read, and those it copied from kept prefixes instead (castspec.prefix_cache)
        "prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
        "prefix_hit_tokens": after.get("prefix_hit_tokens", 0) - before.get("prefix_hit_tokens", 0), "errors": [r["error"] for r in results if r["error"]][:5],
        "tokens": tokens, "wall_s": wall, "goodput_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        # the load generator's own CPU time (its thread's), taken from the cores the server runs on
        "client_cpu_s": cpu,
        "p50_latency_s": percentile(lat, 50), "p99_latency_s": percentile(lat, 99),
        "p50_ttft_s": percentile(ttft, 50), "p99_ttft_s": percentile(ttft, 99),
        "mean_committed_per_round": sum((int(k) + 1) * v for k, v in verified.items()) / max(rounds_v, 1),
        "mean_batch": sum(int(k) * v for k, v in batches.items()) / max(sum(batches.values()), 1),
    }


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


async def soak_request(client: aiohttp.ClientSession, item: dict) -> dict:
    """One request of the plan: status "ok", "abandoned", "rejected" (429) or "error", latency and tokens."""
    t0 = time.perf_counter()
    out = {"status": "ok", "error": None, "ttft_s": None, "tokens": 0, "stream": item["body"]["stream"]}
    try:
        async with client.post(item["path"], json=item["body"]) as r:
            if r.status != 200:
                out.update(status="rejected" if r.status == 429 else "error",
                           error=await http_error(r))
            elif not item["body"]["stream"]:
                out["tokens"] = (await r.json())["usage"]["completion_tokens"]
            else:
                async for line in r.content:
                    payload = data_event(line)
                    if payload is None:
                        continue
                    if out["ttft_s"] is None:
                        out["ttft_s"] = time.perf_counter() - t0
                    if item["abandon"]:
                        out["status"] = "abandoned"
                        r.close()  # the connection closes mid-stream, as a client that leaves does
                        break
                    event = json.loads(payload)
                    if "error" in event:
                        out.update(status="error", error=event["error"]["message"])
                    elif event.get("usage"):
                        out["tokens"] = event["usage"]["completion_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
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
    async with session(url, connections=cfg.concurrency + 4) as client:
        before = await metrics_json(client)
        t0 = time.perf_counter()

        def sample(snap: dict) -> None:
            samples.append({"t_s": round(time.perf_counter() - t0, 2), "done": len(results),
                            "rss_mb": round(snap["rss_bytes"] / 2 ** 20, 1), "active": snap["active"],
                            "queued": snap["queued"]})

        async def sampler():
            while True:
                sample(await metrics_json(client))
                await asyncio.sleep(cfg.sample_every)

        async def worker():
            while plan and time.perf_counter() - t0 < cfg.time_limit:
                results.append(await soak_request(client, plan.pop()))

        watch = asyncio.create_task(sampler())
        await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
        wall = time.perf_counter() - t0
        watch.cancel()
        settle = time.perf_counter()  # abandoned requests leave at the next round boundary
        after = await metrics_json(client)
        while (after["active"] or after["queued"]) and time.perf_counter() - settle < 30:
            await asyncio.sleep(0.2)
            after = await metrics_json(client)
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


def _pyplot():
    """matplotlib's pyplot drawing to files; imported only to draw, since it is slow to import."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_soak(report: dict, path: Path) -> None:
    plt = _pyplot()
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
    plt = _pyplot()
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
