"""`castspec bench`: ar vs chain vs cast (and the transformers and llama.cpp baselines) on real prompt sets.

Timer (paper, Appendix D): decode-only time opens after prefill (and after the first draft for speculative
methods) and closes after the last token; every method counts its emitted new tokens the same way (up to and
including the first stop token, at most max_new_tokens), and ms/token divides decode time by tokens - 1.
"""
from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..models.load import resolve_target_dir
from ..prompts import MATH_HELDOUT_SEED, Prompt, humaneval, math_problems, mtbench
from .stats import paired_bootstrap, ratio_of_rates

DEFAULT_MAX_NEW = {"code": 256, "math": 256, "chat": 256}
NO_THINKING = {"enable_thinking": False}  # templates with a thinking switch (Qwen3) run with it off; others ignore it
# other implementations' decoding, each method's speed over theirs reported (speedup_vs_<name>): transformers
# `generate`, its prompt lookup, llama.cpp
BASELINES = ("hf", "hf-pld", "llamacpp")


@dataclass(frozen=True)
class BenchPrompt:
    domain: str
    id: str
    messages: list | None = None
    input_ids: list | None = None


@dataclass
class MethodSpec:
    name: str  # ar | chain | cast | hf | hf-pld | llamacpp
    width: int | str | None = None
    calibrate: bool = False  # cast:auto+cal: the per-round rule on recalibrated masses

    @property
    def label(self) -> str:
        return f"cast@{self.width}{'+cal' if self.calibrate else ''}" if self.name == "cast" else self.name

    @staticmethod
    def parse(text: str) -> "MethodSpec":
        name, _, width = text.partition(":")
        if name not in ("ar", "chain", "cast", *BASELINES):
            raise ValueError(f"unknown method {text!r}; use ar, chain, cast[:N|:auto|:auto+cal], "
                             f"{', '.join(BASELINES)}")
        if name == "cast":
            w = width or "auto"
            if w == "auto+cal":
                return MethodSpec("cast", "auto", calibrate=True)
            return MethodSpec("cast", w if w == "auto" else int(w))
        return MethodSpec(name)


def builtin_prompts(domains: list[str], n: int) -> list[BenchPrompt]:
    """First n prompts of each domain in dataset order: HumanEval (code), MT-Bench turn 1 (chat), and math from
    GSM8K through `datasets` when the hub is reachable, else our held-out templated problems."""
    out = []
    for d in domains:
        if d == "code":
            rows = humaneval()[:n]
        elif d == "chat":
            rows = mtbench()[:n]
        elif d == "math":
            rows = hub_prompts("gsm8k", n) or math_problems(n, MATH_HELDOUT_SEED)
        elif d in HUB_SETS:
            rows = hub_prompts(d, n)
            if rows is None:
                raise ValueError(f"domain {d!r} needs the `datasets` library and the hub (or use --prompts FILE)")
        else:
            raise ValueError(f"unknown domain {d!r}; built-in domains are code, math, chat, "
                             f"{', '.join(HUB_SETS)} (or use --prompts)")
        out += [BenchPrompt(d, p.id, messages=[{"role": "user", "content": p.text}]) for p in rows]
    return out


# name -> (dataset id, config, split, text field, domain)
HUB_SETS = {
    "gsm8k": ("openai/gsm8k", "main", "test", "question", "math"),
    "math500": ("HuggingFaceH4/MATH-500", None, "test", "problem", "math"),
    "mbpp": ("google-research-datasets/mbpp", "full", "test", "text", "code"),
}


def hub_prompts(name: str, n: int):
    """The first n prompts of a hub dataset through `datasets`, or None where the library or hub is unavailable."""
    try:
        from datasets import load_dataset  # deferred: an optional package, needed by these sets alone

        repo, config, split, field_name, domain = HUB_SETS[name]
        ds = load_dataset(repo, config, split=split) if config else load_dataset(repo, split=split)
        return [Prompt(domain, name, r[field_name], f"{name}/{i}") for i, r in enumerate(ds.select(range(n)))]
    except Exception:
        return None


def file_prompts(path: Path, n: int) -> list[BenchPrompt]:
    """JSONL with one object per line: {"domain", and one of "prompt" | "messages" | "input_ids"}."""
    out, per = [], defaultdict(int)
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i + 1}: invalid JSON ({e.msg})") from None
        dom = row.get("domain", "file")
        if per[dom] >= n:
            continue
        per[dom] += 1
        if "input_ids" in row:
            out.append(BenchPrompt(dom, row.get("id", str(i)), input_ids=list(row["input_ids"])))
        elif "messages" in row:
            out.append(BenchPrompt(dom, row.get("id", str(i)), messages=row["messages"]))
        elif "prompt" in row:
            out.append(BenchPrompt(dom, row.get("id", str(i)), messages=[{"role": "user", "content": row["prompt"]}]))
        else:
            raise ValueError(f"{path}:{i + 1}: needs one of prompt, messages, input_ids")
    return out


class TimingStreamer:
    """transformers streamer that timestamps each generated token (the first put() is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self.tokens: list[int] = []
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.tokens.extend(value.view(-1).tolist())

    def end(self):
        pass


PHASES = ("draft", "verify", "host")  # where a round's time goes (Run.phases_ms), in the report's order


@dataclass
class Run:
    prompt: BenchPrompt
    method: str
    seed: int | None
    tokens: list[int]
    decode_ms: float
    e2e_ms: float
    rounds: int
    committed: int  # tokens committed by rounds (R = committed / rounds)
    # where the decoding rounds' time went, summed over them: drafter passes, target forwards, host work
    # (tree, pack, walk, commit); castspec's methods only
    phases_ms: dict[str, float] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.tokens)


def truncate(tokens: list[int], stop: set[int], max_new: int) -> list[int]:
    out = []
    for t in tokens[:max_new]:
        out.append(t)
        if t in stop:
            break
    return out


def run_ours(engine, p: BenchPrompt, spec: MethodSpec, max_new: int, temperature: float, seed) -> Run:
    t0 = time.perf_counter()
    r = engine.generate(messages=p.messages, input_ids=p.input_ids, method=spec.name,
                        width=spec.width or "auto", max_new_tokens=max_new, temperature=temperature, seed=seed,
                        calibrate=spec.calibrate, chat_template_kwargs=NO_THINKING)
    e2e = (time.perf_counter() - t0) * 1e3
    s = r.stats
    # as the decode timer counts them: without the first round's drafter pass, which also reads the prompt
    phases = dict(zip(PHASES, (sum(x.draft_ms for x in s.rounds) - s.first_draft_ms,
                               sum(x.verify_ms for x in s.rounds), sum(x.host_ms for x in s.rounds))))
    return Run(p, spec.label, seed, r.token_ids, s.decode_ms, e2e, s.num_rounds,
               sum(x.accepted + 1 for x in s.rounds), phases)


def run_hf(hf, engine, p: BenchPrompt, spec: MethodSpec, max_new: int, temperature: float, seed) -> Run:
    ids = engine.encode(messages=p.messages, input_ids=p.input_ids, chat_template_kwargs=NO_THINKING)
    streamer = TimingStreamer()
    kw = dict(max_new_tokens=max_new, streamer=streamer, pad_token_id=0)
    if temperature > 0:
        torch.manual_seed(seed or 0)
        kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kw.update(do_sample=False)
    if spec.name == "hf-pld":
        kw["prompt_lookup_num_tokens"] = 10
    stop = list(engine.stop_ids())
    if stop:
        kw["eos_token_id"] = stop
    t0 = time.perf_counter()
    with torch.inference_mode():
        hf.generate(torch.tensor([ids]), **kw)
    e2e = (time.perf_counter() - t0) * 1e3
    tokens = truncate(streamer.tokens, set(stop), max_new)
    n = len(tokens)
    # the decode timer opens at the first emitted token (after prefill), closes at the last counted one
    decode = (streamer.times[n - 1] - streamer.times[0]) * 1e3 if n > 1 and len(streamer.times) >= n else 0.0
    if spec.name == "hf-pld" and len(streamer.times) < n:  # assisted generation streams several at once
        decode = (streamer.times[-1] - streamer.times[0]) * 1e3
    return Run(p, spec.label, seed, tokens, decode, e2e, max(n - 1, 0), max(n - 1, 0))


def run_llamacpp(runner, engine, p: BenchPrompt, spec: MethodSpec, max_new: int, temperature: float, seed) -> Run:
    """llama.cpp's greedy decoding of the token ids castspec decodes from (`runner`: llamacpp.Runner), timed as
    run_hf times transformers: from its first emitted token to its last counted one."""
    ids = engine.encode(messages=p.messages, input_ids=p.input_ids, chat_template_kwargs=NO_THINKING)
    t0 = time.perf_counter()
    out = runner(ids, set(engine.stop_ids()), max_new)
    e2e = (time.perf_counter() - t0) * 1e3
    n = len(out.token_ids)
    decode = (out.times[n - 1] - out.times[0]) * 1e3 if n > 1 else 0.0
    return Run(p, spec.label, seed, out.token_ids, decode, e2e, max(n - 1, 0), max(n - 1, 0))


@dataclass
class BenchConfig:
    methods: list[MethodSpec]
    max_new: dict = field(default_factory=lambda: dict(DEFAULT_MAX_NEW))
    temperature: float = 0.0
    seeds: list = field(default_factory=lambda: [None])
    resamples: int = 10_000


def run_bench(engine, prompts: list[BenchPrompt], cfg: BenchConfig, progress: bool = True, llamacpp=None) -> dict:
    """`llamacpp`: the runner of the llamacpp method (llamacpp.bench_runner), needed when cfg has it."""
    if any(m.name == "llamacpp" for m in cfg.methods):
        if llamacpp is None:
            raise ValueError("the llamacpp method needs a llama.cpp runner")
        if cfg.temperature > 0:
            raise ValueError("the llamacpp method decodes greedily: run it at temperature 0")
    hf = None
    if any(m.name.startswith("hf") for m in cfg.methods):
        # deferred: only the transformers baselines need it, and it is slow to import
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(resolve_target_dir(engine.source), dtype=engine.dtype).eval()
    # warm-up: one-time kernel compilation must not land in the first measured prompt
    warm = prompts[0]
    for spec in cfg.methods:
        if spec.name == "llamacpp":
            run_llamacpp(llamacpp, engine, warm, spec, 4, cfg.temperature, 0)
        elif not spec.name.startswith("hf"):
            run_ours(engine, warm, spec, 4, cfg.temperature, 0)
    runs: list[Run] = []
    total = len(prompts) * len(cfg.methods) * len(cfg.seeds)
    with tqdm(total=total, desc="bench", disable=not progress) as bar:
        for p in prompts:
            max_new = cfg.max_new.get(p.domain, cfg.max_new.get("*", 256))
            for seed in cfg.seeds:
                for spec in cfg.methods:
                    if spec.name == "llamacpp":
                        runs.append(run_llamacpp(llamacpp, engine, p, spec, max_new, cfg.temperature, seed))
                    elif spec.name.startswith("hf"):
                        runs.append(run_hf(hf, engine, p, spec, max_new, cfg.temperature, seed))
                    else:
                        runs.append(run_ours(engine, p, spec, max_new, cfg.temperature, seed))
                    bar.update(1)
    return summarize(runs, cfg, engine)


def summarize(runs: list[Run], cfg: BenchConfig, engine) -> dict:
    labels = [m.label for m in cfg.methods]
    domains = sorted({r.prompt.domain for r in runs})
    by = defaultdict(list)
    for r in runs:
        by[(r.prompt.domain, r.method)].append(r)
    per_domain = {}
    for d in domains:
        rows = {}
        for m in labels:
            rs = sorted(by[(d, m)], key=lambda r: (r.prompt.id, str(r.seed)))
            ms = np.array([r.decode_ms for r in rs])
            tok = np.array([max(r.n - 1, 0) for r in rs], dtype=float)
            rows[m] = {"ms_per_token": float(ms.sum() / max(tok.sum(), 1)), "R": sum(r.committed for r in rs) /
                       max(sum(r.rounds for r in rs), 1), "tokens": int(sum(r.n for r in rs)),
                       "e2e_ms": float(sum(r.e2e_ms for r in rs)), "_ms": ms, "_tok": tok}
            if rs and all(r.phases_ms for r in rs):
                rounds = max(sum(r.rounds for r in rs), 1)
                rows[m]["ms_per_round"] = {k: sum(r.phases_ms[k] for r in rs) / rounds for k in PHASES}
        for m in labels:
            row = rows[m]
            if "ar" in rows:
                row["speedup_vs_ar"] = ratio_of_rates(rows["ar"]["_ms"], rows["ar"]["_tok"], row["_ms"], row["_tok"])
            if "chain" in rows and m.startswith("cast"):
                g, lo, hi = paired_bootstrap(rows["chain"]["_ms"], rows["chain"]["_tok"], row["_ms"], row["_tok"],
                                             cfg.resamples)
                row["gain_vs_chain"], row["gain_vs_chain_ci95"] = g, [lo, hi]
            for base in BASELINES:
                if base in rows and m not in BASELINES:
                    row[f"speedup_vs_{base}"] = ratio_of_rates(rows[base]["_ms"], rows[base]["_tok"], row["_ms"],
                                                               row["_tok"])
        per_domain[d] = {m: {k: v for k, v in row.items() if not k.startswith("_")} for m, row in rows.items()}
    averages = {}
    for m in labels:
        avg = {}
        for key in ("speedup_vs_ar", "gain_vs_chain", "R", *(f"speedup_vs_{b}" for b in BASELINES)):
            vals = [per_domain[d][m][key] for d in domains if key in per_domain[d][m]]
            if vals:
                avg[key] = float(np.mean(vals))
        averages[m] = avg
    return {
        "dtype": engine.dtype_reason, "temperature": cfg.temperature, "seeds": cfg.seeds,
        "methods": labels, "max_new_tokens": cfg.max_new, "per_domain": per_domain,
        "average_of_domain_ratios": averages,
        "per_prompt": [{"domain": r.prompt.domain, "id": r.prompt.id, "method": r.method, "seed": r.seed,
                        "tokens": r.n, "decode_ms": r.decode_ms, "e2e_ms": r.e2e_ms, "rounds": r.rounds,
                        "committed": r.committed} for r in runs],
    }


def markdown(report: dict) -> str:
    lines = [f"dtype: {report['dtype']}, temperature {report['temperature']}", "",
             "| domain | method | ms/token | speedup vs ar | R | gain vs chain (95% CI) | vs transformers "
             f"| vs llama.cpp | ms a round: {' / '.join(PHASES)} |",
             "|---|---|---|---|---|---|---|---|---|"]
    for d, rows in report["per_domain"].items():
        for m, r in rows.items():
            gain = ""
            if "gain_vs_chain" in r:
                lo, hi = r["gain_vs_chain_ci95"]
                gain = f"{100 * r['gain_vs_chain']:+.1f}% ({100 * lo:+.1f}, {100 * hi:+.1f})"
            vs_hf, vs_llama = (f"{r[k]:.2f}x" if k in r else "" for k in ("speedup_vs_hf", "speedup_vs_llamacpp"))
            phases = " / ".join(f"{r['ms_per_round'][k]:.2f}" for k in PHASES) if "ms_per_round" in r else ""
            lines.append(f"| {d} | {m} | {r['ms_per_token']:.1f} | {r.get('speedup_vs_ar', float('nan')):.2f}x | "
                         f"{r['R']:.2f} | {gain} | {vs_hf} | {vs_llama} | {phases} |")
    lines += ["", "Average of domain ratios:", ""]
    for m, avg in report["average_of_domain_ratios"].items():
        lines.append(f"- {m}: " + ", ".join(f"{k} {v:.3f}" for k, v in avg.items()))
    return "\n".join(lines) + "\n"


def plots(report: dict, out_dir: Path) -> list[Path]:
    import matplotlib  # deferred: imported only to draw, since it is slow to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    domains = list(report["per_domain"])
    methods = report["methods"]
    paths = []
    for key, fname, ylabel in (("speedup_vs_ar", "speedup.png", "speedup over ar"),
                               ("R", "committed_per_round.png", "R (tokens per round)")):
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / max(len(methods), 1)
        for i, m in enumerate(methods):
            vals = [report["per_domain"][d][m].get(key, 0.0) for d in domains]
            ax.bar(np.arange(len(domains)) + i * width, vals, width, label=m)
        ax.set_xticks(np.arange(len(domains)) + width * (len(methods) - 1) / 2, domains)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
        paths.append(out_dir / fname)
    widths = [m for m in methods if m.startswith("cast@") and m[5:].isdigit()]
    if len(widths) > 1:
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [int(m[5:]) for m in widths]
        for d in domains:
            ax.plot(xs, [report["per_domain"][d][m].get("speedup_vs_ar", 0.0) for m in widths], marker="o", label=d)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree width N")
        ax.set_ylabel("speedup over ar")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "sweep.png", dpi=110)
        plt.close(fig)
        paths.append(out_dir / "sweep.png")
    return paths
