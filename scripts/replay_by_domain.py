"""Where drafters lose, by domain: each drafter's teacher-forced top-1 accuracy per block position, rounds rooted at
every response token, and its real-walk chain R. One JSON line per drafter.

Records come from a held-out replay file (the 4 prompts a domain that training's curve replays, with the target's
greedy responses) or, with `--data`, from datasets (`--per-set` responses of `--domain` from each, past its first
`--skip` ones), each response cut at `--split` tokens into its start and the rest (the rest as a domain of
its own, `<set>-late`): training data against data the drafter never saw, and the first tokens of an answer against
its later ones.

    python scripts/replay_by_domain.py --records data/D/heldout-4.pt castspec/assets/drafter-smollm2-135m runs/X/drafter
    python scripts/replay_by_domain.py --data data/A,data/B --records data/D/heldout-4.pt --domain chat --split 128 D
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import castspec
from castspec.models.load import load_drafter
from castspec.train.datagen import load_records
from castspec.train.replay import replay_r


def dataset_records(dirs: list[str], domain: str, per_set: int, skip: int, split: int) -> list[dict]:
    """`per_set` responses of `domain` (at least `split` + 32 tokens long) from each dataset, as two records each:
    the first `split` response tokens, and the next `split` after them (domain `<set>-late`)."""
    out = []
    for d in dirs:
        name = Path(d).name
        picked = [r for r in load_records(Path(d)) if r["domain"] == domain
                  and len(r["response_ids"]) >= split + 32][skip:skip + per_set]
        for r in picked:
            resp = r["response_ids"]
            out.append({"prompt_ids": r["prompt_ids"], "response_ids": resp[:split], "domain": name})
            out.append({"prompt_ids": r["prompt_ids"] + resp[:split], "response_ids": resp[split:2 * split],
                        "domain": f"{name}-late"})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", help="a heldout-N.pt that train-drafter wrote into its first dataset")
    p.add_argument("--data", help="datasets from make-data, comma-separated (see above)")
    p.add_argument("--domain", default="chat", help="--data: the domain whose responses are replayed")
    p.add_argument("--per-set", type=int, default=4, help="--data: responses from each dataset")
    p.add_argument("--skip", type=int, default=0, help="--data: responses of --domain passed over first")
    p.add_argument("--split", type=int, default=128, help="--data: where a response's start ends")
    p.add_argument("drafters", nargs="+")
    args = p.parse_args()
    if not args.records and not args.data:
        p.error("give --records, --data or both")
    engine = castspec.load(device="cpu", dtype="auto")
    records = torch.load(args.records, weights_only=True) if args.records else []
    if args.data:
        records = [r for r in records if r["domain"] == args.domain] + dataset_records(
            args.data.split(","), args.domain, args.per_set, args.skip, args.split)
    for path in args.drafters:
        drafter = load_drafter(path, engine.target)
        with torch.inference_mode():
            r = replay_r(engine.target, drafter, records, stride=1)
        print(json.dumps({"drafter": path, "walk/chain": r["walk/chain"],
                          "top1": {d: [round(x, 3) for x in acc]
                                   for d, acc in r["top1_accuracy_by_position_by_domain"].items()}}), flush=True)


if __name__ == "__main__":
    main()
