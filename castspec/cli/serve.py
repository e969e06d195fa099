"""`castspec serve`: the OpenAI-compatible server on uvicorn; also the scheduler and request-limit flags and their
checks, which `castspec serve-ray` shares."""
from __future__ import annotations

from ..allocate import POLICIES
from ..config import METHODS
from ..serving.frontend import ServerConfig
from ..serving.scheduler import SchedulerConfig
from ..serving.server import create_app, run_server
from .common import UserError, add_model_args, load_engine


def scheduler_config(args):
    try:
        return SchedulerConfig(max_batch=args.max_batch, max_queue=args.max_queue, prefill_budget=args.prefill_budget,
                               prefix_cache_mb=args.prefix_cache_mb, policy=args.policy, width=args.width,
                               top_k_per_position=args.top_k_per_position)
    except ValueError as e:
        raise UserError(str(e)) from None


def server_config(args):
    """The request limits and shutdown deadline from the command line (checked before the model loads)."""
    try:
        return ServerConfig(model_name=args.model_name, default_max_tokens=args.default_max_tokens,
                            max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars,
                            max_messages=args.max_messages, max_stop_strings=args.max_stop_strings,
                            max_stop_chars=args.max_stop_chars,
                            allow_request_chat_template=args.allow_request_chat_template,
                            shutdown_timeout_s=args.shutdown_timeout, prepare_threads=args.prepare_threads,
                            max_n=args.max_n, logprobs_mode=args.logprobs_mode)
    except ValueError as e:
        raise UserError(f"{e} (see castspec serve --help)") from None


def serving_configs(args):
    """The method, policy and port checks shared by `serve` and `serve-ray`, then (SchedulerConfig,
    ServerConfig), all before any model loads."""
    if args.method not in METHODS:
        raise UserError(f"unknown method {args.method!r}; choose one of {', '.join(METHODS)}")
    if args.policy not in POLICIES:
        raise UserError(f"unknown policy {args.policy!r}; choose one of {', '.join(POLICIES)}")
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    return scheduler_config(args), server_config(args)


def cmd_serve(args) -> int:
    cfg, server_cfg = serving_configs(args)
    engine = load_engine(args)
    if args.method != "ar" and engine.drafter is None:
        raise UserError(f"method {args.method!r} needs a drafter: pass --drafter (or --method ar)")
    scheduler = engine.scheduler(cfg, args.method)
    run_server(create_app(engine, scheduler, server_cfg), args.host, args.port,
               log_level="info" if args.verbose else "warning")
    return 0


def add_scheduler_args(p) -> None:
    p.add_argument("--method", default="cast", help="ar, chain or cast (default cast)")
    p.add_argument("--policy", default="cost",
                   help="tree allocation under load: cost (measured-cost shared budget, default), shared "
                        "(best-first, fixed budget --width), uniform (--width split evenly), fixed (--width each)")
    p.add_argument("--width", type=int, default=15, help="fixed: nodes per request; shared/uniform: per round")
    p.add_argument("--top-k-per-position", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests beyond which new ones get 429")
    p.add_argument("--prefill-budget", type=int, default=512, help="prompt tokens prefilled per round")
    add_prefix_cache_arg(p)


def add_prefix_cache_arg(p) -> None:
    p.add_argument("--prefix-cache-mb", type=float, default=SchedulerConfig.prefix_cache_mb,
                   help="MiB of prompt prefixes kept for later requests that start the same way (0: off)")


def add_limit_args(p) -> None:
    d = ServerConfig()
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help=f"larger request bodies get 413 (default {d.max_body_bytes})")
    p.add_argument("--max-prompt-chars", type=int, default=None,
                   help="characters of prompt text, all messages together, checked before tokenizing (default: "
                        "32 per token of the model's context)")
    p.add_argument("--max-messages", type=int, default=d.max_messages, help="messages per chat request")
    p.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings, help="stop strings per request")
    p.add_argument("--max-stop-chars", type=int, default=d.max_stop_chars, help="characters per stop string")
    p.add_argument("--max-n", type=int, default=d.max_n, help="continuations per request (n)")
    p.add_argument("--logprobs-mode", default=d.logprobs_mode, choices=("raw", "processed"),
                   help="log-probabilities from the target's logits (raw, default) or from the law tokens are drawn "
                        "from after penalties, temperature, top-k and top-p (processed)")
    p.add_argument("--allow-request-chat-template", action="store_true",
                   help="render Jinja chat templates sent by clients in chat_template_kwargs.chat_template "
                        "(refused by default: a template is code, and its rendering time is not bounded)")
    p.add_argument("--prepare-threads", type=int, default=d.prepare_threads,
                   help="threads that parse and tokenize requests off the event loop")
    p.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout_s,
                   help="seconds requests in flight get after SIGTERM/SIGINT before they are ended with an error "
                        "(a second signal exits at once)")


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching",
                       description="POST /v1/completions, /v1/chat/completions (SSE with stream=true), "
                                   "GET /v1/models, /health, /metrics.")
    add_model_args(p)
    add_scheduler_args(p)
    add_limit_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default="castspec", help="the id reported by /v1/models")
    p.add_argument("--default-max-tokens", type=int, default=256, help="when a request gives no max_tokens")
    p.set_defaults(func=cmd_serve)
