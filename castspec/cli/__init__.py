"""`castspec` command line: thin wrappers over the library. Errors a user can fix print one line, exit 2."""
from __future__ import annotations

import argparse
import logging
import sys

from .common import EXIT_USAGE, UserError, add_decode_args, add_model_args
from .generate import cmd_generate


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
    from ..config import ConfigError
    from ..decode import ContextLengthError
    from ..models.load import LoadError

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
