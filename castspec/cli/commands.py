"""Subcommands beyond `generate`; each module adds its own parser here so cli.py stays thin."""
from __future__ import annotations


def register(sub) -> None:
    from . import analysis as analysis_cli, demo, loadtest, probe as probe_cli, serve_ray as ray_cli, serve as serve_cli
    from . import bench as bench_cli
    from . import train as train_cli

    demo.register(sub)
    bench_cli.register(sub)
    probe_cli.register(sub)
    analysis_cli.register(sub)
    train_cli.register(sub)
    serve_cli.register(sub)
    ray_cli.register(sub)
    loadtest.register(sub)
