#!/bin/bash
# The drafter pass on int8 weights against bf16 ones (CASTSPEC_DRAFT_INT8=1 / 0, this checkout), in turn: the
# stock probe in each mode (stored: the profile width="auto" reads there), `castspec eval-drafter`, ROUNDS pairs
# of `castspec bench` and `castspec demo`, and one pair of `castspec loadtest`. Results under OUT.
#   scripts/paired_int8.sh OUT        (SKIP_PROBE=1: the probes were run already)
set -euo pipefail
OUT=$(realpath -m "$1")
PY=$(pwd)/.venv/bin/python
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
cs() { local flag=$1; shift; CASTSPEC_DRAFT_INT8=$flag "$PY" -m castspec "$@"; }
for mode in int8:1 bf16:0; do
  name=${mode%:*} flag=${mode#*:}
  [ -n "${SKIP_PROBE:-}" ] && continue
  cs "$flag" probe --packed 1,2,4,8,16,24,32,48,64 --prefix-lens 128,512 --batch-sizes 4,16 --reps 3 --warmup 1 \
    --out "$OUT/probe-$name.json" > "$OUT/probe-$name.txt" 2>&1
done
for mode in int8:1 bf16:0; do
  name=${mode%:*} flag=${mode#*:}
  cs "$flag" eval-drafter --drafter castspec/assets/drafter-smollm2-135m --per-domain 4 --max-new-tokens 96 --widths 1,15,63 --sets heldout,mtbench-turn2 \
    --out "$OUT/eval-$name.json" > /dev/null 2>&1
done
for i in $(seq 1 "$ROUNDS"); do
  for mode in int8:1 bf16:0; do
    name=${mode%:*} flag=${mode#*:}
    cs "$flag" bench --n 5 --max-new-tokens 96 --methods ar,chain,cast:auto,cast:7 --out "$OUT/bench-$name-$i" \
      > /dev/null 2>&1
    cs "$flag" demo > "$OUT/demo-$name-$i.txt" 2>&1
  done
done
for mode in int8:1 bf16:0; do
  name=${mode%:*} flag=${mode#*:}
  cs "$flag" loadtest --policies ar,cost --concurrency 1,16 --requests 64 --max-tokens 48 --out "$OUT/loadtest-$name" \
    > "$OUT/loadtest-$name.log" 2>&1
done
for f in "$OUT"/probe-*.txt; do echo "$(basename "$f" .txt):"; grep -E "verify 1 |verify 16 |draft" "$f"; done
for f in "$OUT"/demo-*.txt; do
  echo "$(basename "$f" .txt): $(grep -o 'cast:.*speedup over ar [0-9.]*x' "$f" | sed 's/.*speedup over ar \([0-9.]*x\)/\1/' | paste -sd' ')"
done
