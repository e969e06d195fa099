"""Seconds per training step of the shipped drafter's recipe (legs 20-24: 4 sequences x 128 blocks of 8, KL as half
the loss, the draft vocabulary), warm-started from the shipped drafter on the first records of a dataset.
One JSON line. Used by scripts/paired_train_step.sh to compare a change to training against a base revision.

    python scripts/train_step.py --data data/smollm2-bf16-self-s17 [--records 200 --steps 6 --warm 2]
"""
import argparse
import json
import tempfile
import time
from pathlib import Path

from transformers import AutoConfig

from castspec.engine import DTYPES
from castspec.models.load import load_target, rope_parameters_of
from castspec.train.datagen import load_records
from castspec.train.trainer import TrainConfig, train

SHIPPED = str(Path(__file__).resolve().parent.parent / "castspec" / "assets" / "drafter-smollm2-135m")

ap = argparse.ArgumentParser()
ap.add_argument("--data", required=True)
ap.add_argument("--records", type=int, default=200)
ap.add_argument("--steps", type=int, default=6)
ap.add_argument("--warm", type=int, default=2)
args = ap.parse_args()
loaded = load_target(None, dtype=DTYPES["bf16"])
records = load_records(Path(args.data))[:args.records]
rope = rope_parameters_of(AutoConfig.from_pretrained(loaded.source))


def leg(steps: int) -> TrainConfig:
    return TrainConfig(steps=steps, seqs_per_step=4, anchors_per_seq=128, block_size=8, num_layers=3, lr=1.2e-4,
                       mask_token_id=16, bf16=True, checkpoint_every=10**6, export_every=10**6, norm_init="ones",
                       init_from=SHIPPED, kl_weight=0.5, draft_vocab=SHIPPED, gamma=3.0)


with tempfile.TemporaryDirectory() as runs:  # each leg's last checkpoint and export, removed after
    train(loaded.model, records, Path(runs) / "warm", leg(args.warm), rope, progress=False)
    start = time.perf_counter()
    train(loaded.model, records, Path(runs) / "timed", leg(args.steps), rope, progress=False)
    elapsed = time.perf_counter() - start
print(json.dumps({"s_per_step": elapsed / args.steps, "steps": args.steps,
                  "records": len(records), "data": args.data}))
