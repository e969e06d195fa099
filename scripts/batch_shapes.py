"""Where a serving round's verify time goes: ragged verifies of B requests x R rows each behind prefixes of P tokens,
and one request's one-row verify (the `ar` step) beside them, all interleaved (one JSON line of medians, ms, per
repeat). The rows-per-request curve prices what a round's trees add; the prefixes price attention over each
request's own cache (at P = 16 it is nearly nothing).

    python scripts/batch_shapes.py [--batch 16] [--rows 1,2,3,4] [--prefixes 16,128,256] [--reps 9] [--repeats 3]

Every rows / prefix pair is one shape (the rows at the middle prefix, the prefixes at one row). Nothing else should
run meanwhile.
"""
from __future__ import annotations

import argparse
import json

import torch

import castspec
from castspec.config import DecodeConfig
from castspec.probe import _draft_shape, _medians_ms, _verify_call
from castspec.round import run_round
from castspec.sequence import Sequence
from castspec.tree import build_tree


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rows", default="1,2,3,4")
    p.add_argument("--prefixes", default="16,128,256")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    prefixes = [int(x) for x in args.prefixes.split(",")]
    engine = castspec.load()
    target, drafter = engine.target, engine.drafter
    _, g, logprobs = _draft_shape(drafter, target.cfg.vocab_size, 0)
    B, V = args.batch, target.cfg.vocab_size
    shapes, kept = {}, []
    with torch.inference_mode():
        for P in prefixes:
            seqs = [Sequence(target, drafter, torch.randint(0, V, (P,), generator=g).tolist(),
                             DecodeConfig(method="cast", max_new_tokens=2), max(rows)) for _ in range(B)]
            run_round(target, drafter, seqs, None, prefill_budget=P * B)
            kept.append(seqs)  # the caches the calls below read
            for r in rows if P == prefixes[len(prefixes) // 2] else [1]:
                shapes[f"{B} x {r} rows, prefix {P}"] = _verify_call(target, seqs, build_tree(logprobs, r - 1, 8))
            if P == prefixes[len(prefixes) // 2]:
                shapes[f"1 x 1 row, prefix {P}"] = _verify_call(target, seqs[:1], build_tree(logprobs, 0, 8))
        for repeat in range(args.repeats):
            ms = _medians_ms(list(shapes.values()), args.reps, 2, target.device)
            print(json.dumps({"repeat": repeat, "verify_ms": {k: round(m, 2) for k, m in zip(shapes, ms)}}),
                  flush=True)


if __name__ == "__main__":
    main()
