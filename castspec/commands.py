"""Subcommands beyond `generate`; each module adds its own parser here so cli.py stays thin."""
from __future__ import annotations


def register(sub) -> None:
    from . import analysis_cli, demo, loadtest, probe_cli, ray_cli, serve_cli
    from .bench import cli as bench_cli
    from .train import cli as train_cli

    demo.register(sub)
    bench_cli.register(sub)
    probe_cli.register(sub)
    analysis_cli.register(sub)
    train_cli.register(sub)
    serve_cli.register(sub)
    ray_cli.register(sub)
    loadtest.register(sub)
