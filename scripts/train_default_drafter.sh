#!/usr/bin/env bash
# The shipped drafter for SmolLM2-135M-Instruct, end to end. Every step resumes where it stopped:
# rerun the same command after an interruption (or in a later session with the same DATA/RUN folders).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-data/smollm2-bf16-greedy}
RUN=${RUN:-runs/drafter-smollm2-v3}
STEPS=${STEPS:-1100}
CLI=.venv/bin/castspec

# 1. data: greedy bf16 responses of the target (bf16 is what decoding serves here), two single-thread workers
if [ "${SKIP_DATA:-0}" != 1 ]; then
  $CLI make-data --out "$DATA" --threads 1 --batch-size 24 --part 0/2 &
  $CLI make-data --out "$DATA" --threads 1 --batch-size 24 --part 1/2 &
  wait
fi
# 2. training (checkpoint every 50 steps; replay R on 10 held-out prompts per domain at every export).
#    The drafter's layers start from the target's last three layers and its final norm from the target's.
$CLI train-drafter --data "$DATA" --out "$RUN" --steps "$STEPS" --lr 1e-3 --init-from-target \
    --checkpoint-every 50 --export-every 275
# 3. ship: bf16 weights in the public DFlash layout, installed with the package
mkdir -p castspec/assets/drafter-smollm2-135m
cp "$RUN/drafter/config.json" "$RUN/drafter/model.safetensors" castspec/assets/drafter-smollm2-135m/
