#!/usr/bin/env bash
# Issue 17's leg 25 (docs/training.md): the shipped drafter (v25) grown by a fourth layer and trained for 4,000
# steps on three datasets it has not seen (chat prompts the target writes itself, instructions, the training
# prompts drawn with seed 15, the last counted twice), to ask whether a fourth layer pays with more steps than
# leg 22 gave it. Every step resumes where it stopped: rerun the same command after an interruption (make-data
# skips the shards it has written, train-drafter resumes from its last checkpoint).
#   scripts/train_leg25.sh            # all of it (the data ~1 h, the training ~3 h on 2 cores)
#   STEPS_NOW=600 scripts/train_leg25.sh   # stop the training after 600 steps (resumable)
set -euo pipefail
cd "$(dirname "$0")/.."
SELF=${SELF:-data/smollm2-bf16-self-s17}
INSTR=${INSTR:-data/smollm2-bf16-instr-s16}
GREEDY=${GREEDY:-data/smollm2-bf16-greedy-s15}
RUN=${RUN:-runs/drafter-smollm2-v30-4l}
SHIPPED=castspec/assets/drafter-smollm2-135m
castspec make-data --out "$SELF" --prompts self --seed 17 --batch-size 24
castspec make-data --out "$INSTR" --prompts instructions --seed 16 --batch-size 24
castspec make-data --out "$GREEDY" --batch-size 24 --seed 15
stop=()
[ -n "${STEPS_NOW:-}" ] && stop=(--stop-after "$STEPS_NOW")
castspec train-drafter --data "$SELF,$INSTR,$GREEDY,$GREEDY" --out "$RUN" --layers 4 --block-size 8 \
  --seqs-per-step 4 --anchors 128 --lr 1.5e-4 --gamma 3 --kl-weight 0.5 --norm-init ones --init-from "$SHIPPED" \
  --draft-vocab "$SHIPPED" --steps 4000 --checkpoint-every 25 --export-every 1000 --eval-per-domain 4 ${stop[@]+"${stop[@]}"}
