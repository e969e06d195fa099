"""The native forwards' section timers (castspec/native/sections.py, csrc/sections.h)."""
from __future__ import annotations

import time

import pytest

from castspec.engine import Engine
from castspec.native import sections
from castspec.probe import probe
from conftest import llama_config, make_hf, native, random_drafter
from native_support import native_library


@pytest.fixture
def lib(monkeypatch):
    yield from native_library(monkeypatch)


@pytest.fixture
def timed_lib(monkeypatch):
    monkeypatch.setenv("CASTSPEC_SECTIONS", "1")  # a library of its own, with the tables
    yield from native_library(monkeypatch)


def tiny_engine() -> Engine:
    target = native(make_hf(llama_config(vocab=24), seed=1))
    return Engine(target, None, random_drafter(target, block_size=4), source="tiny", drafter_source="tiny-drafter")


def test_the_default_library_keeps_no_tables(lib):
    assert not sections.available(lib)


def test_sections_hold_the_forwards_time_and_clear(timed_lib):
    assert sections.available(timed_lib)
    engine = tiny_engine()
    sections.clear(timed_lib)
    start = time.perf_counter()
    probe(engine, packed=(1, 2), prefix_lens=(8,), reps=1, warmup=0, progress=False)  # verifies, passes, prompts
    wall = time.perf_counter() - start
    spent = sections.read(timed_lib)
    assert all(spent["target"][s] > 0 for s in ("qkv", "attention", "o", "gate_up", "down", "head"))
    assert all(spent["drafter"][s] > 0 for s in ("fc", "qkv", "attention", "gate_up"))
    # wall time between marks on the calling thread: never more than the calls took
    assert 0 < sum(sum(kind.values()) for kind in spent.values()) < wall
    sections.clear(timed_lib)
    assert all(v == 0 for kind in sections.read(timed_lib).values() for v in kind.values())


def test_product_weights_count_every_layer_and_the_heads():
    engine = tiny_engine()
    target, drafter = engine.target, engine.drafter
    sizes = sections.product_weights(target, drafter, drafter_int8=True)
    item = target.head_weight.element_size()
    qkv = sum(layer.self_attn.qkv()[0].numel() for layer in target.model.layers)
    assert sizes["target"]["qkv"] == (qkv * item, qkv)
    assert sizes["target"]["head"] == (target.head_weight.numel() * item, target.head_weight.numel())
    down = sum(layer.mlp.down_proj.weight.numel() for layer in drafter.layers)
    assert sizes["drafter"]["down"] == (down, down)  # int8: a byte a weight
    assert set(sizes["drafter"]) == set(sections.PRODUCTS) and "fc" not in sizes["target"]
    assert set(sections.product_weights(target)) == {"target"}
