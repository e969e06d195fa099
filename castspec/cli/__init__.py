"""`castspec` command line: thin wrappers over the library, one module per subcommand (or group of subcommands),
each with a `register(sub)` that adds its parsers. Errors a user can fix print one line and exit 2."""
from __future__ import annotations

import argparse
import logging
import sys

from ..config import ConfigError
from ..models.load import LoadError
from ..sequence import ContextLengthError
from . import analysis, bench, demo, drafter, generate, loadtest, probe, serve, serve_ray, train
from .common import EXIT_USAGE, UserError

# in the order `castspec --help` lists them
SUBCOMMANDS = (generate, demo, bench, probe, analysis, train, drafter, serve, serve_ray, loadtest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="castspec", description="Exact LLM decoding with cost-aware "
                                     "speculative trees from one-pass block drafters (CAST).")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return args.func(args)
    except (UserError, LoadError, ConfigError, ContextLengthError, ValueError, NotImplementedError,
            FileNotFoundError, PermissionError) as e:
        print(f"castspec: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130

