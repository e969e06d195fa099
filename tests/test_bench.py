"""The benchmark harness end to end on a tiny model, and its statistics on synthetic data."""
import importlib.util
import json
import sys

import numpy as np
import pytest

from castspec.bench import agreement
from castspec.bench import engine as engine_bench
from castspec.bench import products as products_bench
from castspec.bench import load_rounds as load_rounds_bench
from castspec.bench import rounds as rounds_bench
from castspec.bench.harness import MethodSpec, builtin_prompts
from castspec.bench.stats import paired_bootstrap
from castspec.cli import main
from castspec.models.load import save_drafter
from conftest import llama_config, make_hf, native, random_drafter, tiny_tokenizer


def test_bootstrap_known_answer():
    rng = np.random.default_rng(0)
    n = 200
    tok = rng.integers(50, 150, n).astype(float)
    base = tok * 10.0 * rng.uniform(0.9, 1.1, n)  # ~10 ms/token
    fast = base / 1.25  # exactly 25% faster on every prompt
    g, lo, hi = paired_bootstrap(base, tok, fast, tok, resamples=2000)
    assert abs(g - 0.25) < 1e-9 and lo <= 0.25 <= hi and hi - lo < 1e-6
    noisy = base / 1.25 * rng.uniform(0.8, 1.2, n)
    g, lo, hi = paired_bootstrap(base, tok, noisy, tok, resamples=2000)
    assert lo < g < hi and lo > 0.15 and hi < 0.40
    same = paired_bootstrap(base, tok, base * rng.uniform(0.9, 1.1, n), tok, resamples=2000)
    assert same[1] < 0 < same[2]


@pytest.fixture(scope="module")
def bench_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    hf = make_hf(llama_config(vocab=40))
    hf.save_pretrained(root / "target")
    save_drafter(random_drafter(native(hf)), root / "drafter")
    lines = [{"domain": "a", "input_ids": [1, 2, 3]}, {"domain": "b", "input_ids": [5, 6, 7, 8]}]
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    return root


def test_harness_end_to_end(bench_dirs, capsys):
    out = bench_dirs / "out"
    code = main(["bench", "--target", str(bench_dirs / "target"), "--drafter", str(bench_dirs / "drafter"),
                 "--dtype", "fp32", "--prompts", str(bench_dirs / "prompts.jsonl"), "--max-new-tokens", "12",
                 "--methods", "ar,chain,cast:7,hf,hf-pld", "--sweep", "1,15", "--resamples", "200",
                 "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert set(report["per_domain"]) == {"a", "b"}
    methods = ["ar", "chain", "cast@7", "hf", "hf-pld", "cast@1", "cast@15"]
    assert report["methods"] == methods
    for rows in report["per_domain"].values():
        for m in methods:
            assert rows[m]["ms_per_token"] > 0 and rows[m]["tokens"] > 0
        assert "gain_vs_chain_ci95" in rows["cast@7"] and "speedup_vs_hf" in rows["cast@7"]
        # where castspec's rounds spent their time: a drafter pass only where the method drafts, none for hf
        phases = rows["cast@7"]["ms_per_round"]
        assert set(phases) == {"draft", "verify", "host"} and all(v > 0 for v in phases.values())
        assert rows["ar"]["ms_per_round"]["draft"] == 0 and "ms_per_round" not in rows["hf"]
    # identical token counting: greedy fp32 methods emit the same tokens, so their counts agree per prompt
    counts = {}
    for row in report["per_prompt"]:
        counts.setdefault((row["domain"], row["id"]), set()).add(row["tokens"])
    assert all(len(c) == 1 for c in counts.values()), counts
    md = (out / "report.md").read_text()
    assert "| a | cast@7 |" in md
    for png in ("speedup.png", "committed_per_round.png", "sweep.png"):
        assert (out / png).stat().st_size > 1000


def test_llamacpp_method_timed_as_the_others(bench_dirs):
    """The llamacpp method through the harness: its runner decodes from the token ids castspec decodes from, its
    time runs from its first token to its last, and every other method is compared with it."""
    from castspec.bench import llamacpp
    from castspec.bench.harness import BenchConfig, file_prompts, markdown, run_bench
    from castspec.engine import load

    engine = load(target=str(bench_dirs / "target"), drafter=None, device="cpu", dtype="fp32")
    prompts = file_prompts(bench_dirs / "prompts.jsonl", 5)
    seen = []

    def replay(ids, stop, max_new):  # llama.cpp's runner interface, decoding with castspec's ar, 2 ms a token
        seen.append(list(ids))
        r = engine.generate(input_ids=ids, method="ar", max_new_tokens=max_new)
        n = len(r.token_ids)
        return llamacpp.Continuation(r.token_ids, [0.0] * n, [0.002 * i for i in range(n)])

    cfg = BenchConfig(methods=[MethodSpec.parse("ar"), MethodSpec.parse("llamacpp")], resamples=100)
    cfg.max_new["*"] = 10
    report = run_bench(engine, prompts, cfg, progress=False, llamacpp=replay)
    assert [1, 2, 3] in seen and [5, 6, 7, 8] in seen  # the prompts as castspec decodes them
    for rows in report["per_domain"].values():
        assert rows["llamacpp"]["ms_per_token"] == pytest.approx(2.0)
        assert rows["llamacpp"]["tokens"] == rows["ar"]["tokens"]  # the same greedy tokens, counted alike
        assert rows["ar"]["speedup_vs_llamacpp"] > 0 and "speedup_vs_llamacpp" not in rows["llamacpp"]
    assert "speedup_vs_llamacpp" in report["average_of_domain_ratios"]["ar"]
    assert "| vs llama.cpp |" in markdown(report)
    with pytest.raises(ValueError, match="needs a llama.cpp runner"):
        run_bench(engine, prompts, cfg, progress=False)
    cfg.temperature = 1.0
    with pytest.raises(ValueError, match="decodes greedily"):
        run_bench(engine, prompts, cfg, progress=False, llamacpp=replay)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python is not installed (pip install -e '.[compare]')")
def test_bench_against_llama_cpp(tmp_path, capsys):
    """castspec's ar and llama.cpp on the default target's weights in bf16, one chat prompt."""
    code = main(["bench", "--domains", "chat", "--n", "1", "--max-new-tokens", "8", "--methods", "ar,llamacpp",
                 "--resamples", "100", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    rows = json.loads((tmp_path / "report.json").read_text())["per_domain"]["chat"]
    assert rows["llamacpp"]["tokens"] > 1 and rows["llamacpp"]["ms_per_token"] > 0
    assert rows["ar"]["speedup_vs_llamacpp"] > 0


def test_bench_bad_input(bench_dirs, capsys):
    code = main(["bench", "--target", str(bench_dirs / "target"), "--prompts", str(bench_dirs / "nope.jsonl")])
    assert code == 2 and "no such file" in capsys.readouterr().err
    code = main(["bench", "--target", str(bench_dirs / "target"), "--methods", "beam"])
    assert code == 2 and "unknown method" in capsys.readouterr().err
    # llama.cpp reads GGUF files and decodes greedily
    code = main(["bench", "--target", str(bench_dirs / "target"), "--prompts", str(bench_dirs / "prompts.jsonl"),
                 "--methods", "ar,llamacpp", "--out", str(bench_dirs / "out-llama")])
    assert code == 2 and "needs a GGUF target" in capsys.readouterr().err
    code = main(["bench", "--target", str(bench_dirs / "target"), "--methods", "llamacpp", "--temperature", "1"])
    assert code == 2 and "decodes greedily" in capsys.readouterr().err


def test_hub_domains_fail_clearly_offline(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as on a machine without the library
    with pytest.raises(ValueError, match="needs the `datasets` library"):
        builtin_prompts(["mbpp"], 2)
    with pytest.raises(ValueError, match="unknown domain"):
        builtin_prompts(["poetry"], 2)
    math = builtin_prompts(["math"], 3)  # falls back to the held-out templated problems
    assert len(math) == 3 and all(p.domain == "math" for p in math)


def test_method_specs():
    assert MethodSpec.parse("cast:auto+cal") == MethodSpec("cast", "auto", calibrate=True)
    assert MethodSpec.parse("cast:auto+cal").label == "cast@auto+cal"
    assert MethodSpec.parse("cast:7").label == "cast@7" and MethodSpec.parse("cast").width == "auto"
    with pytest.raises(ValueError):
        MethodSpec.parse("beam")


def test_engine_benchmark_end_to_end(tmp_path):
    """`python -m castspec.bench.engine` on a tiny HF directory: every figure it reports is there and sane."""
    make_hf(llama_config(vocab=24)).save_pretrained(tmp_path / "target")
    tiny_tokenizer(24).save_pretrained(tmp_path / "target")
    out = tmp_path / "engine.json"
    assert engine_bench.main(["--target", str(tmp_path / "target"), "--dtypes", "fp32", "--tokens", "4",
                              "--prompts", "1", "--repeats", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    entry = report["dtypes"]["fp32"]
    assert entry["bandwidth_floor_ms"] > 0 and entry["weight_bytes"] > 0
    assert entry["castspec_ar_ms_per_token"] > 0 and entry["transformers_ms_per_token"] > 0
    row = entry["per_prompt"][0]
    assert row["ratio_to_floor"] == pytest.approx(row["ours_decode_step"] / row["bandwidth_floor_ms"])
    assert len(row["ratios_of_repeats"]) == 2 and row["ratio_to_floor"] in row["ratios_of_repeats"]
    gemv = entry["gemv_ms"]
    # the per-matrix best of the kernels can only be at or below each kernel's own total
    assert 0 < gemv["best"] <= min(v for k, v in gemv.items() if k != "best")
    assert 0 < entry["host_share_cast63"]["host_share"] < 1


def test_products_benchmark_end_to_end(tmp_path, capsys):
    """`python -m castspec.bench.products` on a tiny HF directory: a time per kernel and row count, each with its
    ratio to the floor of the same run; bad --rows is a one-line usage error."""
    make_hf(llama_config(vocab=24)).save_pretrained(tmp_path / "target")
    tiny_tokenizer(24).save_pretrained(tmp_path / "target")
    out = tmp_path / "products.json"
    assert products_bench.main(["--target", str(tmp_path / "target"), "--dtype", "fp32", "--rows", "1,3",
                                "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["rows"] == [1, 3] and report["weight_bytes"] > 0 and len(report["floor_ms"]) == 2
    assert "torch" in report["ms"]
    for name, times in report["ms"].items():
        assert len(times) == 2 and all(t > 0 for t in times)
        assert report["ratio_to_floor"][name] == pytest.approx([t / f for t, f in zip(times, report["floor_ms"])])
    with pytest.raises(SystemExit):
        products_bench.main(["--rows", "1,x", "--out", str(out)])
    assert "--rows must be positive integers" in capsys.readouterr().err


def tiny_models(tmp_path) -> None:
    """A tiny target (with a tokenizer) in tmp_path/target and a random drafter for it in tmp_path/drafter."""
    hf = make_hf(llama_config(vocab=24))
    hf.save_pretrained(tmp_path / "target")
    tiny_tokenizer(24).save_pretrained(tmp_path / "target")
    save_drafter(random_drafter(native(hf)), tmp_path / "drafter")


def test_rounds_benchmark_end_to_end(tmp_path, capsys):
    """`python -m castspec.bench.rounds` on a tiny target and drafter: per batch and policy the tokens committed
    (the same for every policy: greedy is exact), drafted rounds only where the policy drafts; a bad policy is a
    one-line usage error."""
    tiny_models(tmp_path)
    out = tmp_path / "rounds.json"
    assert rounds_bench.main(["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
                              "--dtype", "fp32", "--batch", "1,3", "--policy", "ar,fixed:3,cost",
                              "--max-tokens", "6", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["batch"], r["policy"]) for r in results] == [(b, p) for b in (1, 3) for p in ("ar", "fixed:3", "cost")]
    for b in (1, 3):
        got = [r for r in results if r["batch"] == b]
        assert len({r["tokens"] for r in got}) == 1 and 0 < got[0]["tokens"] <= 6 * b
        assert "drafted" not in got[0] and got[1]["drafted"]["rounds"] > 0 and got[1]["drafted"]["median_packed"] > b
    with pytest.raises(SystemExit):
        rounds_bench.main(["--policy", "fast", "--out", str(out)])
    assert "unknown policy spec" in capsys.readouterr().err


def test_load_rounds_benchmark_end_to_end(tmp_path, capsys):
    """`python -m castspec.bench.load_rounds` on a tiny target and drafter: every round of the closed loop is
    logged and split by kind, in process (every request runs to --max-tokens: the tokens the rounds committed plus
    each request's first, from its prompt) and through HTTP; the cost policy with drafting off drafts nothing; the
    rounds in which every slot decoded are counted apart."""
    tiny_models(tmp_path)
    out = tmp_path / "load.json"
    assert load_rounds_bench.main(["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
                                   "--dtype", "fp32", "--batch", "2", "--requests", "3", "--max-tokens", "5",
                                   "--policies", "ar,cost", "--plain-too", "--http", "--repeats", "1",
                                   "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["policy"], r["http"]) for r in results] == [(p, h) for p in ("ar", "cost", "cost-plain")
                                                           for h in (False, True)]
    for r in results:
        kinds, rounds = r["kinds"], r["rounds"]
        assert sum(k["rounds"] for k in kinds.values()) == len(rounds) > 0
        assert all(x["decoding"] <= 2 for x in rounds) and r["tokens_per_s"] > 0
        if not r["http"]:
            assert sum(x["committed"] for x in rounds) + 3 == r["tokens"] == 15
        assert ("drafted" in kinds) <= (r["policy"] == "cost")
        for name, k in kinds.items():  # the rounds in which every slot decoded, apart
            full = [x for x in rounds if x["decoding"] == 2 and name == ("prefill" if x["prefill_tokens"] else
                                                                           "drafted" if x["drafted"] else "plain")]
            assert k["full"]["rounds"] == len(full) and k["full"]["committed"] == sum(x["committed"] for x in full)


def test_agreement_end_to_end(bench_dirs, tmp_path, capsys):
    """`python -m castspec.bench.agreement`: a dtype agrees with itself on every prompt; another dtype's report
    has a first difference inside each continuation or none."""
    assert agreement.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert agreement.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert agreement.first_difference([1, 2], [1, 2, 3]) == 2  # one stopped early
    common = ["--target", str(bench_dirs / "target"), "--prompts", str(bench_dirs / "prompts.jsonl"),
              "--max-new-tokens", "12"]
    for i, (dtypes, extra) in enumerate([("fp32,fp32", []), ("fp32,bf16", []), ("fp32,bf16", ["--same-weights"])]):
        out = tmp_path / f"{i}.json"
        assert agreement.main([*common, "--dtypes", dtypes, *extra, "--out", str(out)]) == 0
        report = json.loads(out.read_text())
        rows = report["per_prompt"]
        assert report["reference_weights"] == ("bf16" if extra else "fp32")
        for r in rows:  # the reference's top-two gap where the two part, and its nearest tie anywhere
            assert r["reference_min_gap"] >= 0
            if r["first_difference"] is None:
                assert r["reference_gap_there"] is None
            elif r["reference_gap_there"] is not None:
                assert r["reference_gap_there"] >= r["reference_min_gap"]
        assert [r["domain"] for r in rows] == ["a", "b"] and report["prompts"] == 2
        assert report["dtype"] == dtypes.split(",")[1] and report["native_mode"] in ("off", "on", "emulate", "avx2")
        assert report["identical"] == sum(r["first_difference"] is None for r in rows)
        assert all(r["first_difference"] is None or 0 <= r["first_difference"] <= 12 for r in rows)
        if dtypes == "fp32,fp32":
            assert report["identical"] == 2
    assert "continuations identical" in capsys.readouterr().out
