"""`castspec demo`'s exactness check: fp32 differences fail loudly, bf16 ones are reported with where and why."""
import re
from io import StringIO

import pytest
import torch

import castspec.cli.demo
from castspec.cli import main
from castspec.cli.demo import ExactnessError, first_difference, run_demo
from castspec.engine import Engine
from castspec.models.load import save_drafter
from conftest import llama_config, make_hf, native, random_drafter, tiny_tokenizer
from native_support import native_library

VOCAB = 24


class WrongCast(Engine):
    """An engine whose `cast` output is corrupted at one position: what an exactness bug would look like."""

    wrong_at = 2

    def generate(self, *args, **kw):
        r = super().generate(*args, **kw)
        if kw.get("method") == "cast" and len(r.token_ids) > self.wrong_at:
            r.token_ids[self.wrong_at] = (r.token_ids[self.wrong_at] + 1) % VOCAB
        return r


def tiny_engine(cls=Engine, dtype=torch.float32, torch_kernels=False):
    hf = make_hf(llama_config(vocab=VOCAB, max_position_embeddings=256), seed=1)
    target = native(hf, dtype)
    if torch_kernels:
        target.backend.use_torch()
    return cls(target, tiny_tokenizer(VOCAB), random_drafter(target, block_size=8, seed=2), "test")


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1, 2, 3], [1, 2]) == 2


def test_exact_fp32_demo_reports_no_difference():
    out = StringIO()
    rows = run_demo(tiny_engine(), max_new_tokens=8, width=3, out=out)
    assert [r["method"] for r in rows] == ["ar", "cast"] * 3
    assert "part at" not in out.getvalue()
    assert out.getvalue().splitlines()[1].startswith("exactness: ")  # the header says which guarantee holds


def test_fp32_difference_fails_loudly_with_the_position():
    out = StringIO()
    with pytest.raises(ExactnessError, match=r"part at output position 2 .* in fp32.*exactness bug"):
        run_demo(tiny_engine(WrongCast), max_new_tokens=8, width=3, out=out)
    assert "may part at near-ties" not in out.getvalue()


@pytest.fixture
def lib(monkeypatch):
    yield from native_library(monkeypatch)


def test_bf16_difference_on_bit_exact_forwards_fails_loudly(lib):
    engine = tiny_engine(WrongCast, torch.bfloat16)
    assert engine.exactness == "bit-exact"
    with pytest.raises(ExactnessError, match=r"part at output position 2 .* in bfloat16 on bit-exact.*bug"):
        run_demo(engine, max_new_tokens=8, width=3, out=StringIO())


def test_bf16_difference_on_torch_kernels_names_the_position_and_the_logit_gap():
    out = StringIO()
    run_demo(tiny_engine(WrongCast, torch.bfloat16, torch_kernels=True), max_new_tokens=8, width=3, out=out)
    notes = [line for line in out.getvalue().splitlines() if "part at" in line]
    assert len(notes) == 3  # one per prompt, each naming the position and how near the tie was
    for line in notes:
        assert "output position 2" in line and "bfloat16" in line and "near-ties" in line
        gap = float(re.search(r"top two logits there are (\S+) apart", line).group(1))
        assert gap >= 0


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    hf = make_hf(llama_config(vocab=VOCAB, max_position_embeddings=256), seed=1)
    hf.save_pretrained(root / "target")
    tiny_tokenizer(VOCAB).save_pretrained(root / "target")
    save_drafter(random_drafter(native(hf), block_size=8, seed=2), root / "drafter")
    return root


def test_demo_command_exits_zero_when_exact(model_dirs, capsys):
    code = main(["demo", "--target", str(model_dirs / "target"), "--drafter", str(model_dirs / "drafter"),
                 "--dtype", "fp32", "--max-new-tokens", "6", "--width", "3"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.count("speedup over ar") == 6 and "part at" not in out


def test_demo_command_exits_nonzero_on_an_fp32_difference(monkeypatch, capsys):
    monkeypatch.setattr(castspec.cli.demo, "load_engine", lambda args: tiny_engine(WrongCast))
    code = main(["demo", "--max-new-tokens", "6", "--width", "3"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("castspec demo: FAILED: cast and ar part at output position 2")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_each_method_runs_in_turn_and_reports_its_faster_run():
    """With repeats, the methods alternate (ar, cast, ar, cast) on every prompt and each row is its method's
    faster run, so a machine that slows between two runs does not decide the speedup."""
    engine = tiny_engine()
    order, runs = [], {}
    generate = engine.generate

    def recorded(**kw):
        r = generate(**kw)
        if "messages" in kw:  # not the untimed warm-up
            order.append(kw["method"])
            runs.setdefault((kw["messages"][0]["content"], kw["method"]), []).append(r.stats.decode_ms_per_token)
        return r

    engine.generate = recorded
    rows = run_demo(engine, max_new_tokens=8, width=3, out=StringIO(), repeats=2)
    assert order == ["ar", "cast", "ar", "cast"] * 3
    for row in rows:
        assert row["decode_ms_per_token"] == min(runs[(row["prompt"], row["method"])])
