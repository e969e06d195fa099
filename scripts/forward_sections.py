"""Where the default model's native forwards spend their time, section by section (castspec/native/sections.py):
verifies of --rows packed rows behind a random prompt of --prefix tokens, each followed by the drafter pass as a
round runs them, a plain round of --batch requests (one row each, behind prompts of --prefix tokens), and prompts
of --prompts tokens read in one round. Per section the time a call, and for each
product the rate at which it read its weights (GB/s; and for the target's products the rate of its multiply-adds,
GFLOP/s), beside this machine's read and matmul rates measured in the same run (castspec/floor.py). A table on
stderr, one JSON line on stdout.

    python scripts/forward_sections.py [--prefix 128] [--rows 1,8,16] [--batch 16] [--prompts 128,512] [--iters 100]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ["CASTSPEC_SECTIONS"] = "1"  # before castspec loads its native library: the build that keeps the tables

import torch  # noqa: E402

import castspec  # noqa: E402
from castspec.config import DecodeConfig  # noqa: E402
from castspec.floor import Floors  # noqa: E402
from castspec.native import build as native  # noqa: E402
from castspec.native import sections  # noqa: E402
from castspec.probe import _draft_calls, _draft_shape, _prefilled, _verify_call  # noqa: E402
from castspec.round import run_round  # noqa: E402
from castspec.sequence import Sequence  # noqa: E402
from castspec.tree import Tree, build_tree  # noqa: E402


def timed(lib, calls, iters: int) -> tuple[dict, float]:
    """Each kind's seconds per section over `iters` rounds of `calls` (in turn), per round, and the wall time of a
    round (ms)."""
    for call in calls:  # warm-up
        call()
    sections.clear(lib)
    t = time.perf_counter()
    for _ in range(iters):
        for call in calls:
            call()
    wall = (time.perf_counter() - t) / iters * 1e3
    return {kind: {s: v / iters * 1e3 for s, v in secs.items()} for kind, secs in sections.read(lib).items()}, wall


def shape_entry(name: str, kind: str, ms: dict, weights: dict, rows: dict | None) -> dict:
    """One forward's sections (ms a call) and its products' rates; rows: each product's rows (None: no FLOP
    rate)."""
    rates = {}
    for s in sections.PRODUCTS:
        if s in weights and ms[s] > 0:
            nbytes, params = weights[s]
            rates[s] = {"gbps": nbytes / ms[s] / 1e6}
            if rows is not None:
                rates[s]["gflops"] = 2 * params * rows[s] / ms[s] / 1e6
    return {"shape": name, "kind": kind, "ms": ms, "total_ms": sum(ms.values()), "rates": rates}


def table(entries: list[dict], floors: Floors) -> str:
    lines = [f"this run: read {floors.read_gbps:.1f} GB/s, matmul {floors.gemm_gflops:.0f} GFLOP/s"]
    for e in entries:
        lines.append(f"{e['shape']} ({e['kind']}): {e['total_ms']:.3f} ms in its sections")
        for s in sections.SECTIONS:
            ms = e["ms"][s]
            if ms <= 0:
                continue
            r = e["rates"].get(s, {})
            rate = "".join(f"  {r[k]:7.1f} {unit}" for k, unit in (("gbps", "GB/s"), ("gflops", "GFLOP/s")) if k in r)
            lines.append(f"  {s:>10} {ms:9.3f} ms {100 * ms / e['total_ms']:5.1f}%{rate}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", type=int, default=128)
    p.add_argument("--rows", default="1,8,16")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompts", default="128,512")
    p.add_argument("--iters", type=int, default=100)
    args = p.parse_args()
    engine = castspec.load(device="cpu", dtype="auto")
    target, drafter = engine.target, engine.drafter
    lib = native.library()
    if not sections.available(lib):
        sys.exit("forward_sections: the native library has no section tables (is the native code off?)")
    entries = []
    with torch.inference_mode():
        floors = Floors.measure(target.device, target.dtype)
        L, g, lp = _draft_shape(drafter, target.cfg.vocab_size, 0)
        prompt = torch.randint(0, target.cfg.vocab_size, (args.prefix,), generator=g).tolist()
        seq = _prefilled(target, drafter, prompt, 64)
        draft = _draft_calls(target, drafter, [seq], L)()
        code = drafter.backend.built
        weights = sections.product_weights(target, drafter, drafter_int8=code is not None and code.int8)
        for n in (int(x) for x in args.rows.split(",")):
            verify = _verify_call(target, [seq], Tree.empty() if n == 1 else build_tree(lp, n - 1, 8))
            ms, wall = timed(lib, [verify, draft], args.iters)
            entries.append(shape_entry(f"verify of {n} at prefix {args.prefix}", "target", ms["target"],
                                       weights["target"], dict.fromkeys(sections.PRODUCTS, n)))
            entries.append(shape_entry("drafter pass after it", "drafter", ms["drafter"], weights["drafter"], None))
            entries[-1]["round_wall_ms"] = wall
        if args.batch > 1:  # requests' own caches: what a serving round of plain decoding reads
            cfg = DecodeConfig(method="ar", max_new_tokens=2)
            prompts = [torch.randint(0, target.cfg.vocab_size, (args.prefix,), generator=g).tolist()
                       for _ in range(args.batch)]
            seqs = [Sequence(target, None, text, cfg, 1) for text in prompts]
            run_round(target, None, seqs, None, prefill_budget=args.prefix * args.batch)
            ms, _ = timed(lib, [_verify_call(target, seqs, Tree.empty())], args.iters)
            entries.append(shape_entry(f"round of {args.batch} requests at prefix {args.prefix}", "target",
                                       ms["target"], weights["target"], dict.fromkeys(sections.PRODUCTS, args.batch)))
        for P in (int(x) for x in args.prompts.split(",")):
            text = torch.randint(0, target.cfg.vocab_size, (P,), generator=g).tolist()
            ms, _ = timed(lib, [lambda: _prefilled(target, None, text, 1)], max(args.iters // 20, 3))
            rows = {**dict.fromkeys(sections.PRODUCTS, P), "head": 1}  # the last row's logits only
            entries.append(shape_entry(f"prompt of {P}", "target", ms["target"], weights["target"], rows))
        floors = floors.best(Floors.measure(target.device, target.dtype))
    print(table(entries, floors), file=sys.stderr)
    print(json.dumps({"read_gbps": floors.read_gbps, "gemm_gflops": floors.gemm_gflops, "shapes": entries}))


if __name__ == "__main__":
    main()
