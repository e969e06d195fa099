"""The serving-tax measurement (castspec loadtest --tax) on a tiny model: the three paths commit the same tokens
and every figure is there."""
import pytest

from castspec.bench.tax import measure_tax
from castspec.engine import Engine
from conftest import llama_config, make_hf, native, random_drafter, tiny_tokenizer


@pytest.fixture(scope="module")
def engine():
    target = native(make_hf(llama_config(vocab=24, max_position_embeddings=256), seed=1))
    return Engine(target, tiny_tokenizer(24), random_drafter(target, block_size=8, seed=2))


@pytest.mark.parametrize("method,policy,width", [("ar", "fixed", 0), ("cast", "fixed", 7)])
def test_tax_report(engine, method, policy, width):
    prompts = [[3, 3, 3], [5, 9, 14, 2]]
    rep = measure_tax(engine, prompts, method, max_tokens=12, policy=policy, width=width)
    assert len(rep["rows"]) == 2 and all(r["tokens"] >= 1 for r in rep["rows"])
    s = rep["summary"]
    for path in ("engine", "scheduler", "server"):
        assert s[path]["decode_ms_per_token"] > 0 and s[path]["first_ms"] > 0
    assert s["server_vs_engine_decode"] > 0 and "server_first_minus_scheduler_first_ms" in s
