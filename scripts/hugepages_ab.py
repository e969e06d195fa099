"""Packed weights on ordinary pages against huge pages (castspec/native/hugepages.py), in one process: two engines,
one loaded with CASTSPEC_HUGEPAGES=0 and one with it on, their verify forwards of ROWS packed rows behind a random
prompt of PREFIX tokens, each followed by a drafter pass as a round runs them, alternating engines call by call
so that the machine's drifts land on both. Prints medians (ms) per engine and shape as JSON lines, and the
kernel's AnonHugePages once both are loaded.

    python scripts/hugepages_ab.py [--prefix 128] [--rows 1,8,16] [--iters 300] [--huge-first]
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

import castspec
from castspec.probe import _draft_calls, _draft_shape, _medians_ms, _prefilled, _verify_call
from castspec.tree import Tree, build_tree


def shapes(engine, prefix: int, rows: list[int]) -> dict:
    """Per row count: (verify call, drafter pass call) on one request behind a random prompt."""
    target, drafter = engine.target, engine.drafter
    L, g, lp = _draft_shape(drafter, target.cfg.vocab_size, 0)
    prompt = torch.randint(0, target.cfg.vocab_size, (prefix,), generator=g).tolist()
    s = _prefilled(target, drafter, prompt, 64)
    draft = _draft_calls(target, drafter, [s], L)()
    return {n: (_verify_call(target, [s], Tree.empty() if n == 1 else build_tree(lp, n - 1, 8)), draft)
            for n in rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", type=int, default=128)
    p.add_argument("--rows", default="1,8,16")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--huge-first", action="store_true", help="load and call the huge-page engine first")
    args = p.parse_args()
    rows = [int(x) for x in args.rows.split(",")]
    kinds = [("ordinary", "0"), ("huge", "1")]
    engines, calls = {}, {}
    with torch.inference_mode():
        for name, flag in kinds[::-1] if args.huge_first else kinds:
            os.environ["CASTSPEC_HUGEPAGES"] = flag  # read when the native forwards pack their weights
            engines[name] = castspec.load(device="cpu", dtype="auto")
            calls[name] = shapes(engines[name], args.prefix, rows)
        meminfo = Path("/proc/meminfo")
        huge = [line.split()[1] for line in meminfo.read_text().splitlines()
                if line.startswith("AnonHugePages")] if meminfo.exists() else []
        print(json.dumps({"anon_huge_pages_kb": int(huge[0]) if huge else None}))
        # one repeat: each engine's verify and the pass after it, engine after engine, shape after shape
        order = [(name, n) for n in rows for name in calls]
        medians = _medians_ms([f for name, n in order for f in calls[name][n]], args.iters, 5, torch.device("cpu"))
    for i, (name, n) in enumerate(order):
        print(json.dumps({"pages": name, "prefix": args.prefix, "rows": n, "verify_ms": round(medians[2 * i], 3),
                          "draft_after_ms": round(medians[2 * i + 1], 3)}))

if __name__ == "__main__":
    main()
