#!/bin/bash
# `castspec demo` from this checkout and from a worktree of BASE (its own native build, its own cost profile),
# alternating, ROUNDS times each: the speedup of `cast` over `ar` on the demo's prompts, before and after a
# change, with the machine's drifts landing on both.
#   scripts/paired_demo.sh BASE OUT [demo arguments...]
set -euo pipefail
BASE=$1; OUT=$(realpath -m "$2"); shift 2
source "$(dirname "$0")/base_worktree.sh" "$BASE"
mkdir -p "$OUT"
for i in $(seq 1 "$ROUNDS"); do
  (cd "$ROOT" && $PY -m castspec demo "$@" > "$OUT/change-$i.txt" 2>&1)
  (cd "$WT" && $PY -m castspec demo "$@" > "$OUT/base-$i.txt" 2>&1)
done
for f in "$OUT"/*.txt; do
  echo "$(basename "$f" .txt): $(grep -o 'cast:.*speedup over ar [0-9.]*x' "$f" | sed 's/.*R=\([0-9.]*\).*speedup over ar \([0-9.]*x\)/\2 (R \1)/' | paste -sd' ')"
done
