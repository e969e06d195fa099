#!/usr/bin/env bash
# Issue 17's leg 27 (docs/training.md): leg 26's drafter (v31: v30 continued on prose requests the target writes
# itself, which moved chat but cost math) continued on that prose beside the code and math data v30 learned from
# (data/smollm2-bf16-greedy-s15, counted twice as in leg 25) and leg 25's chat and instructions, to keep chat's gain
# and win math back. Needs leg 26's run (scripts/train_leg26.sh). Every step resumes where it stopped: rerun the
# same command after an interruption (make-data skips the shards it has written, train-drafter resumes from its
# last checkpoint).
#   scripts/train_leg27.sh                 # all of it (~1 h on 2 cores once leg 26's data exists)
#   STEPS_NOW=600 scripts/train_leg27.sh   # stop the training after 600 steps (resumable)
set -euo pipefail
cd "$(dirname "$0")/.."
CLI=${CLI:-.venv/bin/castspec}
WRITE=${WRITE:-data/smollm2-bf16-write-s18}
SELF=${SELF:-data/smollm2-bf16-self-s17}
INSTR=${INSTR:-data/smollm2-bf16-instr-s16}
GREEDY=${GREEDY:-data/smollm2-bf16-greedy-s15}
FROM=${FROM:-runs/drafter-smollm2-v31-write}
RUN=${RUN:-runs/drafter-smollm2-v32-mix}
$CLI make-data --out "$GREEDY" --batch-size 24 --seed 15
stop=()
[ -n "${STEPS_NOW:-}" ] && stop=(--stop-after "$STEPS_NOW")
$CLI train-drafter --data "$WRITE,$WRITE,$SELF,$INSTR,$GREEDY,$GREEDY" --out "$RUN" --layers 4 --block-size 8 \
  --seqs-per-step 4 --anchors 128 --lr 1e-4 --gamma 3 --kl-weight 0.5 --norm-init ones --init-from "$FROM/drafter" \
  --draft-vocab "$FROM/drafter" --steps 2000 --checkpoint-every 25 --export-every 500 --eval-per-domain 4 \
  ${stop[@]+"${stop[@]}"}
