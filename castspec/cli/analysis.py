"""`castspec collect | masses | width | analyze | sweep`: round logs and the width analyses."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..analysis import analyze, collect_rounds, mass_curves, predicted_widths
from ..bench.harness import BenchConfig, MethodSpec, builtin_prompts, plots, run_bench
from ..cost import CostProfile, affine_fit, throughput
from ..probe import probe
from ..prompts import heldout_prompts
from .common import UserError, add_model_args, load_engine, write_json


def _load_logs(path: str):
    try:
        return torch.load(path, weights_only=False)
    except FileNotFoundError:
        raise UserError(f"no round log at {path}: run `castspec collect --out {path}` first") from None
    except Exception as e:
        raise UserError(f"{path} is not a castspec round log ({type(e).__name__})") from None


def cmd_collect(args) -> int:
    engine = load_engine(args)
    if engine.drafter is None:
        raise UserError("collect needs a drafter")
    logs = collect_rounds(engine, heldout_prompts(args.per_domain), args.max_new_tokens, args.top_k)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(logs, args.out)
    print(json.dumps({"rounds": len(logs), "out": args.out}))
    return 0


def cmd_masses(args) -> int:
    curves = mass_curves(_load_logs(args.logs), args.max_width, args.top_k)
    write_json(curves, args.out)
    if args.plot:  # matplotlib is imported only to draw: it is slow to import and most runs write JSON alone
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for d, c in curves.items():
            ax.plot(np.arange(1, len(c["mean_mass"]) + 1), c["mean_mass"], label=f"{d} mass")
            ax.plot(np.arange(1, len(c["hit_rate"]) + 1), c["hit_rate"], ":", label=f"{d} realized")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("node rank in the best-first tree")
        ax.set_ylabel("prefix mass")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
    return 0


def cmd_width(args) -> int:
    try:
        profile = CostProfile.load(Path(args.profile))
    except FileNotFoundError:
        raise UserError(f"no profile at {args.profile}: run `castspec probe --out {args.profile}`") from None
    curves = mass_curves(_load_logs(args.logs), min(args.max_width, profile.max_width), args.top_k)
    widths = predicted_widths(curves, profile, args.prefix, min(args.max_width, profile.max_width))
    c0, c1 = affine_fit(profile, args.prefix)
    for d, w in widths.items():
        m = np.asarray(curves[d]["mean_mass"])
        table = profile.round_table(len(m), args.prefix)
        thr = throughput(m, table)
        print(f"{d}: affine rule N*={w['affine']} (c1={c1:.3f} ms/node, stop when next mass < throughput x c1); "
              f"table rule N*={w['table']} (max (g+1)/l = {thr[w['table']]:.4f} tok/ms; chain-length tree "
              f"{thr[min(15, len(thr) - 1)]:.4f})")
    write_json({"prefix": args.prefix, "c0": c0, "c1": c1, "widths": widths}, args.out)
    return 0


def cmd_analyze(args) -> int:
    report = analyze(_load_logs(args.logs))
    write_json(report, args.out)
    print(json.dumps(report["tree_shape_at_matched_budget"], indent=2))
    return 0


def register(sub) -> None:
    c = sub.add_parser("collect", help="round logs: top-K marginals and realized continuations (held-out prompts)")
    add_model_args(c)
    c.add_argument("--out", required=True, help="round log file (.pt)")
    c.add_argument("--per-domain", type=int, default=10)
    c.add_argument("--max-new-tokens", type=int, default=128)
    c.add_argument("--top-k", type=int, default=32, help="ranks kept per position (>= 8 for the rank-cap ablation)")
    c.set_defaults(func=cmd_collect)

    m = sub.add_parser("masses", help="mean sorted prefix-mass curves per domain from round logs")
    m.add_argument("--logs", required=True)
    m.add_argument("--max-width", type=int, default=127)
    m.add_argument("--top-k", type=int, default=8)
    m.add_argument("--out", default=None)
    m.add_argument("--plot", default=None)
    m.set_defaults(func=cmd_masses)

    w = sub.add_parser("width", help="N* of the affine and table rules, with why")
    w.add_argument("--logs", required=True)
    w.add_argument("--profile", required=True, help="profile JSON from `castspec probe --out`")
    w.add_argument("--prefix", type=int, default=256)
    w.add_argument("--max-width", type=int, default=127)
    w.add_argument("--top-k", type=int, default=8)
    w.add_argument("--out", default=None)
    w.set_defaults(func=cmd_width)

    a = sub.add_parser("analyze", help="first-rejection ranks, calibration, rank cap, tree shape (JSON)")
    a.add_argument("--logs", required=True)
    a.add_argument("--out", default=None)
    a.set_defaults(func=cmd_analyze)
    register_sweep(sub)


def cmd_sweep(args) -> int:
    """Width sweep on held-out prompts + each rule's predicted width and its gain vs the sweep oracle."""
    widths = [int(w) for w in args.widths.split(",")]
    engine = load_engine(args)
    if engine.drafter is None:
        raise UserError("sweep needs a drafter")
    profile = engine.cost_profile()
    if args.reprobe:
        profile = probe(engine, progress=False)
        engine.set_cost_profile(profile)
    prompts = builtin_prompts(args.domains.split(","), args.n)
    methods = [MethodSpec("ar"), MethodSpec("chain"), MethodSpec("cast", "auto"),
               MethodSpec("cast", "auto", calibrate=True)] + [MethodSpec("cast", w) for w in widths]
    cfg = BenchConfig(methods=methods, resamples=args.resamples)
    cfg.max_new.update({d: args.max_new_tokens for d in ("code", "math", "chat")})
    report = run_bench(engine, prompts, cfg)
    logs = collect_rounds(engine, heldout_prompts(args.n), args.max_new_tokens, top_k=8)
    curves = mass_curves(logs, min(max(widths), profile.max_width), 8)
    predicted = predicted_widths(curves, profile, args.prefix, min(max(widths), profile.max_width))
    summary = {}
    for d, rows in report["per_domain"].items():
        speed = {w: rows[f"cast@{w}"]["speedup_vs_ar"] for w in widths}
        chain = rows["chain"]["speedup_vs_ar"]
        oracle = max(speed, key=speed.get)
        nearest = lambda n: min(widths, key=lambda w: abs(w - n))  # noqa: E731
        entry = {"oracle_width": oracle, "oracle_gain_vs_chain": speed[oracle] / chain - 1,
                 "auto_gain_vs_chain": rows["cast@auto"]["speedup_vs_ar"] / chain - 1,
                 "auto_cal_gain_vs_chain": rows["cast@auto+cal"]["speedup_vs_ar"] / chain - 1,
                 "auto_speedup_vs_ar": rows["cast@auto"]["speedup_vs_ar"],
                 "chain_speedup_vs_ar": chain}
        for rule, n in predicted.get(d, {}).items():
            entry[f"{rule}_width"] = n
            entry[f"{rule}_gain_vs_chain"] = speed[nearest(n)] / chain - 1
        summary[d] = entry
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({"summary": summary, "bench": report,
                                                "profile_key": profile.key}, indent=2))
    plots(report, out)
    print(json.dumps(summary, indent=2))
    return 0


def register_sweep(sub) -> None:
    s = sub.add_parser("sweep", help="width sweep vs the rules' predicted widths (JSON + plot)")
    add_model_args(s)
    s.add_argument("--widths", default="1,3,7,15,31,47,63,95,127")
    s.add_argument("--domains", default="code,math,chat")
    s.add_argument("--n", type=int, default=10, help="prompts per domain")
    s.add_argument("--max-new-tokens", type=int, default=128)
    s.add_argument("--prefix", type=int, default=256, help="prefix length at which the static rules read costs")
    s.add_argument("--reprobe", action="store_true", help="probe the full grid first")
    s.add_argument("--resamples", type=int, default=2000)
    s.add_argument("--out", default="runs/sweep")
    s.set_defaults(func=cmd_sweep)
