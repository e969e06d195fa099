"""Subcommands beyond `generate`; each module adds its own parser here so cli.py stays thin."""
from __future__ import annotations


def register(sub) -> None:
    from .train import cli as train_cli

    train_cli.register(sub)
