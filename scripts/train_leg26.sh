#!/usr/bin/env bash
# Issue 17's leg 26 (docs/training.md): the shipped drafter (v30, 4 layers) continued on requests for prose the
# target writes itself (make-data --prompts self with leads such as "Write a letter": the kind of chat prompt the
# held-out set's MT-Bench questions are, and the domain where the chain is furthest from its target; "Write"
# alone draws mostly code) with leg 25's chat and instruction data, to ask whether chat's acceptance moves with data
# of its own kind. Every step resumes where it
# stopped: rerun the same command after an interruption (make-data skips the shards it has written,
# train-drafter resumes from its last checkpoint).
#   scripts/train_leg26.sh                 # all of it (the data ~15 min, the training ~1 h on 2 cores)
#   STEPS_NOW=600 scripts/train_leg26.sh   # stop the training after 600 steps (resumable)
set -euo pipefail
cd "$(dirname "$0")/.."
CLI=${CLI:-.venv/bin/castspec}
WRITE=${WRITE:-data/smollm2-bf16-write-s18}
SELF=${SELF:-data/smollm2-bf16-self-s17}
INSTR=${INSTR:-data/smollm2-bf16-instr-s16}
RUN=${RUN:-runs/drafter-smollm2-v31-write}
SHIPPED=castspec/assets/drafter-smollm2-135m
LEADS="Write a blog post|Write an email|Write a short story|Write a letter|Write a poem|Write an essay|Write a speech"
LEADS+="|Write a product description|Write a review|Write a dialogue|Draft a|Compose a"
$CLI make-data --out "$WRITE" --prompts self --self-lead "$LEADS" --seed 18 --batch-size 24
$CLI make-data --out "$SELF" --prompts self --seed 17 --batch-size 24
$CLI make-data --out "$INSTR" --prompts instructions --seed 16 --batch-size 24
stop=()
[ -n "${STEPS_NOW:-}" ] && stop=(--stop-after "$STEPS_NOW")
$CLI train-drafter --data "$WRITE,$WRITE,$SELF,$INSTR" --out "$RUN" --layers 4 --block-size 8 --seqs-per-step 4 \
  --anchors 128 --lr 1e-4 --gamma 3 --kl-weight 0.5 --norm-init ones --init-from "$SHIPPED" --draft-vocab "$SHIPPED" \
  --steps 2000 --checkpoint-every 25 --export-every 500 --eval-per-domain 4 ${stop[@]+"${stop[@]}"}
