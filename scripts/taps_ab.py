"""What a drafting-capable request's taps cost a plain round under load: a verify of 16 decode rows (16 requests,
120-token prompts, the default model and drafter) without taps, with them, and with every round's features kept
alive as a request's pending context keeps them while it does not draft; the three in turn, REPS times. Prints
the median ms of each (JSON).

    python scripts/taps_ab.py [--reps 60]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import castspec
from castspec.config import DecodeConfig
from castspec.round import run_round
from castspec.sequence import Sequence
from castspec.tree import Tree


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
        parts = [s.verify_segment(Tree.empty()) for s in seqs]
        ids = torch.cat([pack.ids for pack, _ in parts], 1)
        positions = torch.cat([pack.positions for pack, _ in parts], 1)
        segments = [seg for _, seg in parts]
        kept: list[torch.Tensor] = []
        modes = {"none": ((), False), "taps": (seqs[0].taps, False), "taps_kept": (seqs[0].taps, True)}
        times: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.reps):
            for mode, (taps, keep) in modes.items():
                t = time.perf_counter()
                _, feats = target.forward_segments(ids, positions, segments, taps=taps)
                if keep:
                    kept.append(feats)
                times[mode].append((time.perf_counter() - t) * 1e3)
            if len(kept) > 48:  # a 48-token request's worth of rounds
                kept.clear()
    print(json.dumps({m: round(statistics.median(v), 3) for m, v in times.items()}))


if __name__ == "__main__":
    main()
