#!/bin/bash
# A change to the native code against BASE, this checkout and a worktree of BASE in turn: the stock probe in each
# (stored: the profile width="auto" reads), then ROUNDS pairs of the products bench (a forward's products alone),
# the probe (not stored), `castspec bench` and `castspec demo`. Results under OUT.
#   scripts/paired_native.sh BASE OUT
set -euo pipefail
BASE=$1; OUT=$(realpath -m "$2")
source "$(dirname "$0")/base_worktree.sh" "$BASE"
mkdir -p "$OUT"
# side S: where S (change: this checkout, base: the worktree of BASE) runs
side() { if [ "$1" = change ]; then echo "$ROOT"; else echo "$WT"; fi; }
PROBE="probe --packed 1,2,4,8,16,24,32,48,64 --prefix-lens 128,512 --batch-sizes 4,16 --reps 3 --warmup 1"
for s in change base; do
  (cd "$(side $s)" && $PY -m castspec $PROBE --out "$OUT/probe-stored-$s.json" > "$OUT/probe-stored-$s.txt" 2>&1)
done
for i in $(seq 1 "$ROUNDS"); do
  for s in change base; do
    (cd "$(side $s)" && $PY -m castspec.bench.products --rows 1,8,16,32,64 --repeats 5 \
      --out "$OUT/products-$s-$i.json" > /dev/null 2>&1)
    (cd "$(side $s)" && $PY -m castspec $PROBE --no-store --out "$OUT/probe-$s-$i.json" > "$OUT/probe-$s-$i.txt" 2>&1)
  done
done
for i in $(seq 1 "$ROUNDS"); do
  for s in change base; do
    (cd "$(side $s)" && $PY -m castspec bench --n 5 --max-new-tokens 96 --methods ar,chain,cast:auto,cast:7 \
      --out "$OUT/bench-$s-$i" > /dev/null 2>&1)
    (cd "$(side $s)" && $PY -m castspec demo > "$OUT/demo-$s-$i.txt" 2>&1)
  done
done
for f in "$OUT"/probe-*.txt; do echo "$(basename "$f" .txt):"; grep -E "verify 1 |verify 16 |draft" "$f"; done
for f in "$OUT"/demo-*.txt; do
  echo "$(basename "$f" .txt): $(grep -o 'cast:.*speedup over ar [0-9.]*x' "$f" | sed 's/.*speedup over ar \([0-9.]*x\)/\1/' | paste -sd' ')"
done
