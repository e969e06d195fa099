"""Whether a drafter's first block positions need the rest of its block: teacher-forced top-1 at positions 1-2 on
held-out responses, with the whole block (root + block_size - 1 masks) and with the block cut to root + 2 masks
(what a batched pass finishing only the rows a depth-2 tree reads would compute if it ran only those rows).

    python scripts/truncated_block.py data/<dataset>/heldout-4.pt [--drafter D]

Prints one JSON line per block size. The default model and drafter, dtype auto.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json

import torch

import castspec
from castspec.train.replay import replay_r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("records", help="a make-data held-out records file (a list of prompt/response records)")
    p.add_argument("--drafter", default=None)
    args = p.parse_args()
    engine = castspec.load(drafter=args.drafter)
    target, drafter = engine.target, engine.drafter
    records = torch.load(args.records)
    for block in (drafter.cfg.block_size, 3):
        cut = copy.copy(drafter)  # the same weights; only the block size read by the replay differs
        cut.cfg = dataclasses.replace(drafter.cfg, block_size=block)
        with torch.inference_mode():
            r = replay_r(target, cut, records, widths=())
        print(json.dumps({"block_size": block, "records": len(records),
                          "top1_positions_1_2": [round(x, 3) for x in r["top1_accuracy_by_position"][:2]],
                          "by_domain": {k: [round(x, 3) for x in v[:2]]
                                        for k, v in r["top1_accuracy_by_position_by_domain"].items()}}))


if __name__ == "__main__":
    main()
