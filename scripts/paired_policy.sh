#!/bin/bash
# A change to the cost policy (width="auto") against BASE: `scripts/demo_rounds.py` on the demo's chat prompt,
# `castspec bench` (ar, cast auto, cast N = 7) and `castspec demo`, this checkout and a worktree of BASE in turn
# (ROUNDS pairs of demo_rounds and demos, one bench pair).
#   scripts/paired_policy.sh BASE OUT
set -euo pipefail
BASE=$1; OUT=$(realpath -m "$2")
source "$(dirname "$0")/base_worktree.sh" "$BASE"
mkdir -p "$OUT"
for i in $(seq 1 "$ROUNDS"); do
  (cd "$ROOT" && PYTHONPATH="$ROOT" $PY scripts/demo_rounds.py 1 auto 7 > "$OUT/rounds-change-$i.txt" 2>&1)
  (cd "$WT" && PYTHONPATH="$WT" $PY scripts/demo_rounds.py 1 auto 7 > "$OUT/rounds-base-$i.txt" 2>&1)
done
(cd "$ROOT" && $PY -m castspec bench --n 5 --max-new-tokens 96 --methods ar,cast:auto,cast:7 --out "$OUT/bench-change" > /dev/null 2>&1)
(cd "$WT" && $PY -m castspec bench --n 5 --max-new-tokens 96 --methods ar,cast:auto,cast:7 --out "$OUT/bench-base" > /dev/null 2>&1)
for i in $(seq 1 "$ROUNDS"); do
  (cd "$ROOT" && $PY -m castspec demo > "$OUT/demo-change-$i.txt" 2>&1)
  (cd "$WT" && $PY -m castspec demo > "$OUT/demo-base-$i.txt" 2>&1)
done
for f in "$OUT"/rounds-*.txt; do echo "$(basename "$f" .txt):"; grep -o 'width auto: .*plain' "$f"; done
for f in "$OUT"/demo-*.txt; do
  echo "$(basename "$f" .txt): $(grep -o 'cast:.*speedup over ar [0-9.]*x' "$f" | sed 's/.*speedup over ar \([0-9.]*x\)/\1/' | paste -sd' ')"
done
