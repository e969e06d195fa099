"""`castspec loadtest`: compare allocation policies under load (the default), soak a `castspec serve` process
(--soak), or measure the serving tax (--tax). This module turns flags into runs and writes the reports; the load
generators are in castspec/serving/loadtest.py, the tax measurement in castspec/bench/tax.py.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

from ..allocate import PolicySpec
from ..bench.tax import measure_tax
from ..prompts import mtbench_second_turns
from ..serving.frontend import ServerConfig
from ..serving.live import LiveServer, ServeProcess, check_loopback
from ..serving.loadtest import (SoakConfig, load_messages, plot, plot_soak, run_conversations, run_load,
                                  run_soak, summarize)
from ..serving.scheduler import SchedulerConfig
from ..serving.server import create_app
from .common import UserError, add_model_args, load_engine
from .serve import add_prefix_cache_arg


SPEC_HELP = "ar | chain | fixed:N | uniform:M | shared:M | cost"


DEFAULT_POLICIES = "ar,chain,fixed:3,fixed:7,fixed:15,shared:16,shared:32,cost"


def parse_spec(spec: str) -> tuple[str, str, int]:
    """Policy spec -> (method, policy, width), as allocate.PolicySpec reads it (width 0 where it is unused)."""
    parsed = PolicySpec.parse(spec)
    return parsed.method, parsed.policy, parsed.width


def soak_serve_args(args, spec: str) -> list[str]:
    """`castspec serve` flags for the soak's server: the model flags given to loadtest, and the policy spec."""
    method, policy, width = parse_spec(spec)
    out = ["--method", method, "--policy", "fixed" if method == "ar" else policy, "--width", str(width),
           "--max-batch", str(args.max_batch), "--prefill-budget", str(args.prefill_budget),
           "--prefix-cache-mb", str(args.prefix_cache_mb),
           "--device", args.device, "--dtype", args.dtype]
    for flag, value in (("--target", args.target), ("--drafter", args.drafter)):
        if value is not None:
            out += [flag, value]
    return out


def cmd_soak(args, messages: list[list[dict]], out: Path) -> int:
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


def levels_and_policies(args, levels: str, policies: str) -> tuple[list[int], dict[str, tuple[str, str, int]]]:
    """--concurrency and --policies (`levels` and `policies` where not given): the client counts, and each
    policy spec with its (method, policy, width)."""
    try:
        counts = [int(x) for x in (args.concurrency or levels).split(",")]
    except ValueError:
        raise UserError("--concurrency is a comma list of integers") from None
    try:
        return counts, {s: parse_spec(s) for s in (x.strip() for x in (args.policies or policies).split(",")) if s}
    except ValueError as e:  # PolicySpec's message names the spec
        raise UserError(str(e)) from None


def check_drafter(engine, spec: str, method: str) -> None:
    """A policy that drafts needs the engine's drafter: a one-line refusal before any level runs."""
    if method != "ar" and engine.drafter is None:
        raise UserError(f"policy {spec!r} needs a drafter (pass --drafter)")


def level_server(engine, args, method: str, policy: str, width: int, B: int) -> LiveServer:
    """The in-process server one load level runs against: B requests decode together, with the run's prefill
    budget and kept prefixes."""
    cfg = SchedulerConfig(max_batch=B, max_queue=max(64, 4 * B), policy=policy, width=width,
                          prefill_budget=args.prefill_budget, prefix_cache_mb=args.prefix_cache_mb)
    return LiveServer(create_app(engine, engine.scheduler(cfg, method), ServerConfig()))


def each_level(args, parsed: dict, levels: list[int], level: Callable[[str, int, str], None]) -> None:
    """level(policy, B, url) for every level: against the server at --url ("external": it has its own options),
    else against an in-process server made for each policy and concurrency."""
    if args.url:
        for B in levels:
            level("external", B, args.url)
        return
    engine = load_engine(args)
    for spec, (method, policy, width) in parsed.items():
        check_drafter(engine, spec, method)
        for B in levels:
            with level_server(engine, args, method, policy, width, B) as url:
                level(spec, B, url)


def cmd_loadtest(args) -> int:
    try:
        if args.url:
            args.url = check_loopback(args.url)
    except ValueError as e:
        raise UserError(str(e)) from None
    if args.prefix_cache_mb < 0:
        raise UserError("--prefix-cache-mb must be >= 0 (0 turns the prefix cache off)")
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot write to {out}: {e}") from None
    messages = load_messages(args.per_domain)
    if args.soak:
        return cmd_soak(args, messages, out)
    if args.tax:
        return cmd_tax(args, messages, out)
    if args.conversations:
        return cmd_conversations(args, out)
    args.requests = args.requests or 16
    levels, parsed = levels_and_policies(args, "1,4,8,16", DEFAULT_POLICIES)
    if min(levels) < 1 or args.requests < 1 or args.max_tokens < 1 or (args.rate is not None and args.rate <= 0):
        raise UserError("concurrency, --requests and --max-tokens must be >= 1 and --rate > 0")
    results = []

    def level(spec: str, B: int, url: str) -> None:
        res = asyncio.run(run_load(url, messages, B, max(args.requests, B), args.max_tokens, args.rate,
                                   args.time_limit))
        results.append({"policy": spec, "concurrency": B, **res})
        print(json.dumps({k: results[-1][k] for k in ("policy", "concurrency", "ok", "goodput_tokens_per_s",
                                                      "p50_latency_s", "p99_latency_s", "mean_committed_per_round")}))

    each_level(args, parsed, levels, level)
    report = {"config": {k: v for k, v in vars(args).items() if k != "func"}, "results": results,
              "summary": summarize(results)}
    (out / "loadtest.json").write_text(json.dumps(report, indent=2))
    plot(results, out / "loadtest.png")
    print(json.dumps(report["summary"], indent=2))
    return 0


def cmd_conversations(args, out: Path) -> int:
    """--conversations: two-turn chats (MT-Bench's first and second questions, the server's own answer between
    them) at each concurrency; what the second turn's time to first token and prompt reading cost."""
    levels, parsed = levels_and_policies(args, "1,8", "ar")
    count = args.requests or 16
    if min(levels) < 1 or count < 1 or args.max_tokens < 1:
        raise UserError("concurrency, --requests and --max-tokens must be >= 1")
    conversations = [(p.earlier_turns[0], p.text) for p in mtbench_second_turns(count)]
    results = []

    def level(spec: str, B: int, url: str) -> None:
        res = asyncio.run(run_conversations(url, conversations, B, args.max_tokens, args.time_limit))
        results.append({"policy": spec, "concurrency": B, **res})
        print(json.dumps({"policy": spec, "concurrency": B,
                          **{t: {k: res[t][k] for k in ("p50_ttft_s", "prompt_tokens", "cached_tokens")}
                             for t in ("turn1", "turn2")}}))

    each_level(args, parsed, levels, level)
    report = {"config": {k: v for k, v in vars(args).items() if k != "func"}, "results": results}
    (out / "conversations.json").write_text(json.dumps(report, indent=2))
    return 0


def cmd_tax(args, messages: list[list[dict]], out: Path) -> int:
    """--tax: the server's per-token cost over the engine it wraps, at concurrency 1 (castspec/bench/tax.py)."""
    engine = load_engine(args)
    prompts = [engine.encode(messages=m) for m in messages[:args.requests or 6]]
    report = {"config": {k: v for k, v in vars(args).items() if k != "func"}, "results": []}
    for spec in [s.strip() for s in (args.policies or "ar").split(",") if s.strip()]:
        method, policy, width = parse_spec(spec)
        check_drafter(engine, spec, method)
        res = measure_tax(engine, prompts, method, args.max_tokens, policy, width, args.repeats)
        report["results"].append({"policy": spec, **res})
        print(json.dumps({"policy": spec, **res["summary"]}))
    (out / "tax.json").write_text(json.dumps(report, indent=2))
    return 0


def register(sub) -> None:
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
    add_prefix_cache_arg(p)
    p.add_argument("--url", default=None, help="load an already running server on this machine instead")
    p.add_argument("--out", default="runs/loadtest")
    t = p.add_argument_group("serving tax (--tax)")
    t.add_argument("--tax", action="store_true",
                   help="at concurrency 1: engine.generate vs the scheduler in-process vs streamed HTTP on the same "
                        "prompts (decode ms/token, time to first token); --requests prompts (default 6)")
    t.add_argument("--repeats", type=int, default=1, help="passes over the prompts")
    c = p.add_argument_group("two-turn chats (--conversations)")
    c.add_argument("--conversations", action="store_true",
                   help="MT-Bench's first and second questions as chats (the server's answer between them) over "
                        "--requests conversations (default 16), at each --concurrency (default 1,8), policies "
                        "default ar: each turn's time to first token, prompt tokens and those copied from kept "
                        "prefixes")
    s = p.add_argument_group("soak (--soak)")
    s.add_argument("--soak", action="store_true",
                   help="one long mixed load against a `castspec serve` process on 127.0.0.1: errors, p50/p99, "
                        "running/queued afterwards, the server's memory over the run, its exit time on SIGTERM")
    s.add_argument("--max-batch", type=int, default=8, help="the soak server's --max-batch")
    s.add_argument("--abandon", type=float, default=0.25, help="share of streams whose client leaves early")
    s.add_argument("--stream-share", type=float, default=0.5, help="share of requests that stream")
    s.add_argument("--sample-every", type=float, default=2.0, help="seconds between readings of /metrics")
    p.set_defaults(func=cmd_loadtest)
