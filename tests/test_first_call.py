"""No first-call path: the check the native code passes when it is built runs on scratch caches of its own, so
the first forward after loading computes (and writes to its cache) exactly what every later identical forward
does, and seeded sampling through the Python API repeats from the first call on."""
import pytest
import torch

from castspec.engine import Engine
from conftest import llama_config, make_hf, native, random_drafter
from native_support import native_library

pytestmark = pytest.mark.usefixtures("zeroed_caches")  # whole caches are compared


@pytest.fixture
def lib(monkeypatch):
    yield from native_library(monkeypatch)


def _identical(runs) -> bool:
    """Two runs' outputs (lists of tensors) and the caches they wrote are equal bit for bit."""
    (first, c1), (second, c2) = runs
    return (all(torch.equal(a, b) for a, b in zip(first, second))
            and torch.equal(c1.k, c2.k) and torch.equal(c1.v, c2.v) and c1.length == c2.length)


@pytest.mark.usefixtures("lib")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_decoder_forward_equals_later_ones(dtype):
    """A prompt chunk and a decode step on a fresh cache, twice: the first run (which builds the native code)
    gives the same logits and features, bit for bit, and leaves the same cache as the second."""
    target = native(make_hf(llama_config(), seed=4), dtype)
    prompt = torch.tensor([[5, 3, 9, 1, 7, 2]])
    runs = []
    with torch.inference_mode():
        for _ in range(2):
            cache = target.new_cache(16)
            out = target(prompt, torch.arange(6).view(1, -1), cache, 0, causal=True, logit_rows=torch.tensor([5]),
                         taps=(1, 3))
            out += target(torch.tensor([[4]]), torch.tensor([[6]]), cache, 6, taps=(1, 3))
            runs.append((out, cache))
    assert target.backend.active and target.backend.checked
    assert _identical(runs)


@pytest.mark.usefixtures("lib")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_drafter_pass_equals_later_ones(dtype):
    """Two drafter passes (context, block) on a fresh cache, twice: bit-identical rows and caches."""
    target = native(make_hf(llama_config(), seed=4), dtype)
    drafter = random_drafter(target, block_size=6, seed=1)
    g = torch.Generator().manual_seed(5)
    width = len(drafter.cfg.target_layer_ids) * target.cfg.hidden_size
    feats = torch.randn(1, 7, width, generator=g).to(dtype)
    block = torch.randn(1, 6, target.cfg.hidden_size, generator=g).to(dtype)
    runs = []
    with torch.inference_mode():
        for _ in range(2):
            cache = drafter.new_cache(16)
            out = [drafter(block, torch.arange(5, 11).view(1, -1), feats[:, :5], torch.arange(5).view(1, -1),
                           cache, 0),
                   drafter(block, torch.arange(7, 13).view(1, -1), feats[:, 5:], torch.arange(5, 7).view(1, -1),
                           cache, 5)]
            runs.append((out, cache))
    assert drafter.backend.active and drafter.backend.checked
    assert _identical(runs)


@pytest.mark.usefixtures("lib")
@pytest.mark.parametrize("method", ["ar", "cast"])
def test_seeded_sampling_repeats_from_the_first_call(method):
    """engine.generate with temperature > 0 and a seed, twice on a freshly built engine: the same tokens."""
    target = native(make_hf(llama_config(), seed=6), torch.bfloat16)
    engine = Engine(target, None, random_drafter(target, block_size=8, seed=2))
    kw = dict(input_ids=[3, 1, 4, 1, 5, 9, 2, 6], max_new_tokens=24, method=method, width=4, temperature=1.0,
              seed=11)
    first = engine.generate(**kw).token_ids
    assert first == engine.generate(**kw).token_ids
    assert target.backend.active
    assert engine.drafter.backend.active or method == "ar"
