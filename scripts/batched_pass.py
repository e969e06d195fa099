"""The batched drafter pass under load at several depths (block positions whose rows the pass finishes), each
timed right after the batch's verify as rounds run it, and that verify (B requests x 2 rows): medians (ms) over
REPS passes, one JSON line per repeat.

    python scripts/batched_pass.py [--batch 16] [--depths 7,2,1] [--prefix 128] [--context 3] [--reps 9]
        [--repeats 3] [--cut-block 3]

--context: the new context rows each request's pass fuses (3 as a round that drafted the round before; up to
--prefix as a catch-up, whose pass fuses what its requests gathered since they last drafted, their prompts at first).

Runs with any checkout's Python (`PYTHONPATH=<its root> python scripts/batched_pass.py`), so that a checkout from
before a change can be timed in turn with one after it. Nothing else should run meanwhile.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

import castspec
from castspec.config import DecodeConfig
from castspec.probe import _draft_shape, _medians_ms, _verify_call
from castspec.round import run_round
from castspec.sequence import Sequence, propose_batch
from castspec.tree import build_tree

CONTEXT = 3  # new context rows per request a pass fuses, as the probe's (cost.DRAFT_CONTEXT_ROWS)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--depths", default="7,2,1")
    p.add_argument("--prefix", type=int, default=128)
    p.add_argument("--context", type=int, default=CONTEXT, help="new context rows a request's pass fuses")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cut-block", type=int, default=0, metavar="N",
                   help="also time each depth below N with every block cut to N rows (root included), in turn "
                        "with the whole blocks (a drafter trained with train-drafter --short-blocks drafts from "
                        "such blocks)")
    args = p.parse_args()
    engine = castspec.load()
    target, drafter = engine.target, engine.drafter
    L, g, logprobs = _draft_shape(drafter, target.cfg.vocab_size, 0)
    depths = [min(int(d), L) for d in args.depths.split(",")]
    B, V = args.batch, target.cfg.vocab_size
    if not 1 <= args.context <= args.prefix:
        raise SystemExit("--context must be between 1 and --prefix")
    with torch.inference_mode():
        seqs = [Sequence(target, drafter, torch.randint(0, V, (args.prefix,), generator=g).tolist(),
                         DecodeConfig(method="cast", max_new_tokens=2), 16) for _ in range(B)]
        run_round(target, drafter, seqs, None, prefill_budget=args.prefix * B)
        verify = _verify_call(target, seqs, build_tree(logprobs, 1, 8))  # each request: its root and one node
        states = [s.draft for s in seqs]
        pending = [st.pending for st in states]
        ends = [st.cache.length + c.shape[1] for st, c in zip(states, pending)]
        roots = [s.root for s in seqs]
        propose_batch(target, drafter, states, roots, [L] * B)  # the prompts' context cached once

        # probe._draft_calls' passes at one depth each: written out here because checkouts from before the
        # depth existed (the ones this script times in turn) have no way to ask that helper for it
        whole = drafter.cfg
        cut = dataclasses.replace(whole, block_size=args.cut_block or whole.block_size)

        def pass_at(depth: int, cfg=whole):
            def draft():
                for st, c, end in zip(states, pending, ends):
                    st.cache.length = end - args.context
                    st.pending = c[:, -args.context:]
                drafter.cfg = cfg  # the block size propose_batch reads
                try:
                    propose_batch(target, drafter, states, roots, [depth] * B)
                finally:
                    drafter.cfg = whole
            return draft

        cut_depths = [d for d in depths if args.cut_block and d < args.cut_block]
        calls = [pass_at(d) for d in depths] + [pass_at(d, cut) for d in cut_depths] + [verify]
        for repeat in range(args.repeats):
            ms = _medians_ms(calls, args.reps, 2, target.device, verify)
            line = {"repeat": repeat, "batch": B, "prefix": args.prefix, "context": args.context,
                    "pass_ms": {str(d): round(m, 3) for d, m in zip(depths, ms)}, "verify_ms": round(ms[-1], 3)}
            if cut_depths:
                line["cut_block"] = args.cut_block
                line["cut_pass_ms"] = {str(d): round(m, 3) for d, m in zip(cut_depths, ms[len(depths):-1])}
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
