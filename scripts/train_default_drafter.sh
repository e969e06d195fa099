#!/usr/bin/env bash
# The shipped drafter for SmolLM2-135M-Instruct, end to end. Every step resumes where it stopped:
# rerun the same command after an interruption (or in a later session with the same DATA/RUN folders).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-data/smollm2-bf16-greedy}
RUN=${RUN:-runs/drafter-smollm2-v5}
STEPS=${STEPS:-800}
CLI=.venv/bin/castspec

# 1. data: greedy bf16 responses of the target (bf16 is what decoding serves here), two single-thread workers
if [ "${SKIP_DATA:-0}" != 1 ]; then
  $CLI make-data --out "$DATA" --threads 1 --batch-size 24 --part 0/2 &
  $CLI make-data --out "$DATA" --threads 1 --batch-size 24 --part 1/2 &
  wait
fi
# 2. training: 2 layers from random init with norms at 1 (the public start), 2 sequences x 64 blocks per step,
#    and a short-context curriculum: blocks see only the last 8 context rows for 200 steps, the last 64 until
#    step 450, then everything (docs/training.md says why). Checkpoint every 25 steps; replay R on 4 held-out
#    prompts per domain at every export (RUN/curve.json).
$CLI train-drafter --data "$DATA" --out "$RUN" --steps "$STEPS" --layers 2 --seqs-per-step 2 --anchors 64 \
    --lr 1e-3 --norm-init ones --context-window 8:200,64:450 --checkpoint-every 25 --export-every 100 \
    --eval-per-domain 4
# 3. ship: bf16 weights in the public DFlash layout, installed with the package
mkdir -p castspec/assets/drafter-smollm2-135m
cp "$RUN/drafter/config.json" "$RUN/drafter/model.safetensors" castspec/assets/drafter-smollm2-135m/
