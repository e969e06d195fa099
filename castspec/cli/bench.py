"""`castspec bench`: the method comparison on real prompt sets; JSON + Markdown + PNG plots."""
from __future__ import annotations

import json
from pathlib import Path

from ..bench import llamacpp
from ..bench.harness import BenchConfig, MethodSpec, builtin_prompts, file_prompts, markdown, plots, run_bench
from .common import UserError, add_model_args, int_list, load_engine


def cmd_bench(args) -> int:
    try:
        methods = [MethodSpec.parse(m) for m in args.methods.split(",") if m]
        if args.sweep:
            methods += [MethodSpec("cast", int(w)) for w in args.sweep.split(",")]
        max_new = parse_max_new(args.max_new_tokens)
        seeds = int_list("--seeds", args.seeds) or [None]
    except ValueError as e:
        raise UserError(str(e)) from None
    with_llamacpp = any(m.name == "llamacpp" for m in methods)
    if args.temperature > 0 and with_llamacpp:
        raise UserError("the llamacpp method decodes greedily: run it at --temperature 0")
    if args.temperature > 0 and seeds == [None]:
        seeds = [0]
    if args.prompts:
        if not Path(args.prompts).is_file():
            raise UserError(f"--prompts {args.prompts}: no such file")
        prompts = file_prompts(Path(args.prompts), args.n)
    else:
        prompts = builtin_prompts(args.domains.split(","), args.n)
    if not prompts:
        raise UserError("no prompts to run")
    engine = load_engine(args)
    if any(m.name in ("chain", "cast") for m in methods) and engine.drafter is None:
        raise UserError("chain/cast need a drafter: pass --drafter DIR (or bench only ar,hf,hf-pld,llamacpp)")
    cfg = BenchConfig(methods=methods, temperature=args.temperature, seeds=seeds, resamples=args.resamples)
    cfg.max_new.update(max_new)
    runner = None
    if with_llamacpp:
        try:
            runner = llamacpp.bench_runner(args.target, engine.target.cfg.max_positions)
        except (RuntimeError, ValueError) as e:
            raise UserError(str(e)) from None
    try:
        report = run_bench(engine, prompts, cfg, llamacpp=runner)
    finally:
        if runner is not None:
            runner.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(markdown(report))
    plots(report, out)
    print(markdown(report))
    return 0


def parse_max_new(text: str) -> dict:
    """"256" (every domain) or "code=256,chat=128"."""
    if "=" not in text:
        n = int(text)
        return {"code": n, "math": n, "chat": n, "*": n}
    return {k: int(v) for k, v in (part.split("=") for part in text.split(","))}


def register(sub) -> None:
    p = sub.add_parser("bench", help="ar vs chain vs cast (and transformers) on real prompt sets",
                       description="Decode-only timing (after prefill and the first draft), R, speedups, "
                                   "bootstrap CIs; writes report.json, report.md and plots to --out.")
    add_model_args(p)
    p.add_argument("--domains", default="code,math,chat", help="built-in domains (code=HumanEval, "
                   "chat=MT-Bench turn 1, math=GSM8K via datasets or held-out templated problems) and hub sets "
                   "through datasets: gsm8k, math500, mbpp")
    p.add_argument("--prompts", default=None, help="JSONL of {domain, prompt|messages|input_ids} instead")
    p.add_argument("--n", type=int, default=40, help="first n prompts per domain, in dataset order")
    p.add_argument("--methods", default="ar,chain,cast:auto", help="comma list: ar, chain, cast[:N|:auto|:auto+cal], hf, hf-pld, llamacpp "
                   "(llama.cpp on the same weights in bf16, greedy; pip install -e '.[compare]')")
    p.add_argument("--sweep", default="", help="also run cast at these widths, e.g. 1,3,7,15,31,63")
    p.add_argument("--max-new-tokens", default="256", help="N or per domain: code=256,chat=128")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seeds", default="", help="comma list of seeds (T > 0)")
    p.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples")
    p.add_argument("--out", default="runs/bench", help="output directory")
    p.set_defaults(func=cmd_bench)
