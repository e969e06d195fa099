"""The serving tax: what `castspec serve` adds per token over the engine it wraps, at concurrency 1.

For each prompt, the same greedy request three ways, interleaved so that the machine's drift hits all alike:
`engine.generate` (one request, no scheduler), the scheduler stepped in this thread (no HTTP), and a streamed
request to the HTTP server on loopback (scheduler thread + event loop + SSE). Greedy decoding commits the same
tokens all three ways (checked), so per-token times compare like with like:
- decode ms/token: from the first output token to the last, divided by the tokens after the first;
- time to first token (server, seen by the client) against prefill + the first round in-process.
`castspec loadtest --tax` runs it; the report goes to JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx
import torch

from ..config import DecodeConfig
from ..engine import Engine
from ..models.load import build_target
from ..native.threads import release_workers
from ..serving.frontend import ServerConfig
from ..serving.live import LiveServer
from ..serving.scheduler import Request, SchedulerConfig
from ..serving.server import create_app


def engine_run(engine, ids: list[int], method: str, max_tokens: int, width) -> dict:
    """engine.generate's timer: prefill (with the first token) and the decode rounds after it."""
    t0 = time.perf_counter()
    r = engine.generate(input_ids=ids, max_new_tokens=max_tokens, method=method, width=width, temperature=0.0)
    wall = (time.perf_counter() - t0) * 1e3
    s = r.stats
    return {"tokens": r.token_ids, "first_ms": s.prefill_ms,
            "decode_ms_per_token": (wall - s.prefill_ms) / max(len(r.token_ids) - 1, 1)}


def scheduler_run(engine, scheduler, ids: list[int], cfg: DecodeConfig) -> dict:
    """The scheduler stepped in this thread: when each chunk of tokens came out."""
    out, stamps = [], []

    def on_tokens(tokens):
        out.extend(tokens)
        stamps.append(time.perf_counter())

    t0 = time.perf_counter()
    scheduler.submit(Request(ids, cfg, on_tokens, lambda *a: None))
    while scheduler.active or scheduler.queue_length:
        scheduler.step()
    return {"tokens": out, "first_ms": (stamps[0] - t0) * 1e3,
            "decode_ms_per_token": (stamps[-1] - stamps[0]) * 1e3 / max(len(out) - 1, 1)}


async def server_run(client: httpx.AsyncClient, ids: list[int], max_tokens: int) -> dict:
    """One streamed completion over HTTP: first and last content chunk as the client sees them."""
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif event["choices"] and (event["choices"][0]["text"] or event["choices"][0]["finish_reason"]):
                last = time.perf_counter()  # text, or the end of an output with no visible text
                first = first or last
    return {"n_tokens": tokens, "first_ms": (first - t0) * 1e3,
            "decode_ms_per_token": (last - first) * 1e3 / max(tokens - 1, 1)}


def measure_tax(engine, prompts: list[list[int]], method: str = "ar", max_tokens: int = 64, policy: str = "cost",
                width: int = 15, repeats: int = 1) -> dict:
    """Per prompt and repeat: engine, in-process scheduler and HTTP server, interleaved; medians and ratios.
    The engine decodes with the width the policy gives one request: the cost rule ("auto") or `width`."""
    engine_width = "auto" if policy == "cost" else width
    if engine.tokenizer is None:
        raise ValueError("the serving tax is timed on streamed text: the target needs a tokenizer")

    # every prompt is read in full, as engine.generate reads it (repeats would otherwise copy kept prompts)
    cfg = SchedulerConfig(max_batch=1, policy=policy, width=width, prefix_cache_mb=0)
    decode_cfg = DecodeConfig(method=method, max_new_tokens=max_tokens, temperature=0.0,
                              stop_token_ids=engine.stop_ids())
    local = engine.scheduler(cfg, method)
    app = create_app(engine, engine.scheduler(cfg, method), ServerConfig())
    rows = []
    with LiveServer(app) as url:
        async def http(ids):
            release_workers()  # this thread's OpenMP workers would slow the server's thread (native/threads.py)
            async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as client:
                return await server_run(client, ids, max_tokens)

        for ids in prompts[:1]:  # warm-up of all three paths (first-use checks, allocator, profiles)
            engine_run(engine, ids, method, max_tokens, engine_width)
            scheduler_run(engine, local, ids, decode_cfg)
            asyncio.run(http(ids))
        for rep in range(repeats):
            for i, ids in enumerate(prompts):
                e = engine_run(engine, ids, method, max_tokens, engine_width)
                s = scheduler_run(engine, local, ids, decode_cfg)
                h = asyncio.run(http(ids))
                if s["tokens"] != e["tokens"] or h["n_tokens"] != len(e["tokens"]):
                    raise RuntimeError(f"prompt {i}: the three paths committed different tokens")
                rows.append({"prompt": i, "repeat": rep, "tokens": len(e["tokens"]),
                             "engine": {k: v for k, v in e.items() if k != "tokens"},
                             "scheduler": {k: v for k, v in s.items() if k != "tokens"}, "server": h})

    decoded = [r for r in rows if r["tokens"] >= 2]  # decode speed needs a token after the first
    if not decoded:
        raise ValueError("every output ended at its first token: no decode time to compare")

    def med(path, key):
        return statistics.median(r[path][key] for r in (decoded if key == "decode_ms_per_token" else rows))

    summary = {p: {"decode_ms_per_token": med(p, "decode_ms_per_token"), "first_ms": med(p, "first_ms")}
               for p in ("engine", "scheduler", "server")}
    summary["server_vs_engine_decode"] = statistics.median(
        r["server"]["decode_ms_per_token"] / r["engine"]["decode_ms_per_token"] for r in decoded)
    summary["server_vs_scheduler_decode"] = statistics.median(
        r["server"]["decode_ms_per_token"] / r["scheduler"]["decode_ms_per_token"] for r in decoded)
    summary["server_first_minus_scheduler_first_ms"] = statistics.median(
        r["server"]["first_ms"] - r["scheduler"]["first_ms"] for r in rows)
    return {"method": method, "policy": policy, "max_tokens": max_tokens, "summary": summary, "rows": rows}


def small_engine():
    """A small random Llama (6 layers, 256 wide, 4,096-token word-level vocabulary): its step is short, so the
    server's fixed per-token costs show against it."""
    # deferred: only this script's own model needs them, and transformers is slow to import for `castspec loadtest`
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=None, bos_token_id=None)
    hf = LlamaForCausalLM(cfg).eval()
    words = {f"w{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Engine(build_target(cfg, hf.state_dict(), torch.float32, hf.device),
                  PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0"), None)


if __name__ == "__main__":  # python -m castspec.bench.tax [--out FILE]: the small model, ar, 4 prompts x 2
    p = argparse.ArgumentParser(description="serving tax on a small random model (castspec loadtest --tax for "
                                            "real models)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    engine = small_engine()
    prompts = [[(i * 37 + j) % 4000 + 3 for j in range(20 + 5 * i)] for i in range(4)]
    report = measure_tax(engine, prompts, "ar", max_tokens=64, policy="fixed", width=0, repeats=2)
    print(json.dumps(report["summary"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
