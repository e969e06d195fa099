"""A verify of ROWS packed rows behind a random prompt of PREFIX tokens, then a drafter pass, in a loop, as a round
runs them (the default model and drafter, dtype auto): whatever the verify's weight stream evicts, the pass then
reads from memory. Prints one JSON line: per row count, the medians (ms) of the verify and of the pass after it.
For a change to how forwards stream their weights, run on both sides by scripts/paired_script.sh.

    python scripts/verify_then_draft.py [--prefix 128] [--rows 1,8,16] [--iters 150]
"""
from __future__ import annotations

import argparse
import json

import torch

import castspec
from castspec.probe import _draft_calls, _draft_shape, _medians_ms, _prefilled, _verify_call
from castspec.tree import Tree, build_tree


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", type=int, default=128)
    p.add_argument("--rows", default="1,8,16")
    p.add_argument("--iters", type=int, default=150)
    args = p.parse_args()
    engine = castspec.load(device="cpu", dtype="auto")
    target, drafter = engine.target, engine.drafter
    out = {"prefix": args.prefix, "verify_ms": {}, "draft_after_ms": {}}
    with torch.inference_mode():
        L, g, lp = _draft_shape(drafter, target.cfg.vocab_size, 0)
        prompt = torch.randint(0, target.cfg.vocab_size, (args.prefix,), generator=g).tolist()
        s = _prefilled(target, drafter, prompt, 64)
        draft = _draft_calls(target, drafter, [s], L)()
        for n in (int(x) for x in args.rows.split(",")):
            verify = _verify_call(target, [s], Tree.empty() if n == 1 else build_tree(lp, n - 1, 8))
            # each repeat runs the verify, then the pass, each timed
            v, d = _medians_ms([verify, draft], args.iters, 5, target.device)
            out["verify_ms"][n], out["draft_after_ms"][n] = round(v, 3), round(d, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
