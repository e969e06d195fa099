#!/usr/bin/env bash
# A drafter's acceptance and what it buys end to end (docs/training.md), in one run on one machine:
# R of chain and cast at N = 15/31/63 in real decoding on the held-out prompts and on the sets of other kinds
# (eval-drafter --sets), then ar vs chain vs cast (auto, N = 7) at T = 0. Nothing else should run beside it.
#   DRAFTER=dir OUT=docs/results/x scripts/measure_drafter.sh
set -euo pipefail
cd "$(dirname "$0")/.."
C=.venv/bin/castspec
DRAFTER=${DRAFTER:-castspec/assets/drafter-smollm2-135m}
OUT=${OUT:-docs/results/drafter}
mkdir -p "$OUT"
$C eval-drafter --drafter "$DRAFTER" --per-domain 4 --max-new-tokens 96 \
    --sets heldout,mtbench-turn2,humaneval-completion,unseen-modules --out "$OUT"/eval-drafter.json
if [ "${BENCH:-1}" = 1 ]; then
  $C bench --drafter "$DRAFTER" --n 5 --max-new-tokens 96 --methods ar,chain,cast:auto,cast:7 --out "$OUT"/bench
fi
