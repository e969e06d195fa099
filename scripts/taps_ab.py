"""What a drafting-capable request's taps cost a plain round under load: a verify of 16 decode rows (16 requests,
120-token prompts, the default model and drafter) without taps, with them, and with every round's features kept
alive as a request's pending context keeps them while it does not draft; the three in turn (the probe's
interleaved timing), REPS times. Prints the median ms of each (JSON).

    python scripts/taps_ab.py [--reps 60]
"""
from __future__ import annotations

import argparse
import json

import torch

import castspec
from castspec.config import DecodeConfig
from castspec.probe import _medians_ms, _verify_call
from castspec.round import run_round
from castspec.sequence import Sequence
from castspec.tree import Tree

REQUEST_ROUNDS = 48  # a 48-token request's worth of rounds: how long a request keeps its pending features


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=60)
    args = p.parse_args()
    engine = castspec.load(device="cpu", dtype="auto")
    target, drafter = engine.target, engine.drafter
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        seqs = []
        for _ in range(16):
            prompt = torch.randint(0, target.cfg.vocab_size, (120,), generator=g).tolist()
            s = Sequence(target, drafter, prompt, DecodeConfig(method="cast", max_new_tokens=64), 64)
            run_round(target, drafter, [s], None, prefill_budget=512)
            seqs.append(s)
        plain, tapped = _verify_call(target, seqs, Tree.empty(), taps=()), _verify_call(target, seqs, Tree.empty())
        kept: list[torch.Tensor] = []

        def tapped_kept():
            kept.append(tapped())
            if len(kept) > REQUEST_ROUNDS:
                kept.clear()

        ms = _medians_ms([plain, tapped, tapped_kept], args.reps, 0, target.device)
    print(json.dumps(dict(zip(("none", "taps", "taps_kept"), (round(m, 3) for m in ms)))))


if __name__ == "__main__":
    main()
