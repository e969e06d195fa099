"""Where drafters lose, by domain: each drafter's teacher-forced top-1 accuracy per block position on the held-out
replay records (the 4 prompts a domain that training's curve replays, with the target's greedy responses), rounds
rooted at every response token, and its real-walk chain R. One JSON line per drafter.

    python scripts/replay_by_domain.py --records data/D/heldout-4.pt castspec/assets/drafter-smollm2-135m runs/X/drafter
"""
from __future__ import annotations

import argparse
import json

import torch

import castspec
from castspec.models.load import load_drafter
from castspec.train.replay import replay_r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", required=True, help="a heldout-N.pt that train-drafter wrote into its first dataset")
    p.add_argument("drafters", nargs="+")
    args = p.parse_args()
    engine = castspec.load(device="cpu", dtype="auto")
    records = torch.load(args.records, weights_only=True)
    for path in args.drafters:
        drafter = load_drafter(path, engine.target)
        with torch.inference_mode():
            r = replay_r(engine.target, drafter, records, stride=1)
        print(json.dumps({"drafter": path, "walk/chain": r["walk/chain"],
                          "top1": {d: [round(x, 3) for x in acc]
                                   for d, acc in r["top1_accuracy_by_position_by_domain"].items()}}), flush=True)


if __name__ == "__main__":
    main()
