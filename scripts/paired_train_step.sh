#!/bin/bash
# Training steps (scripts/train_step.py) of this checkout and of a worktree of BASE in turn, ROUNDS times (one
# JSON line each, tagged with its side), for a change to drafter training.
#   scripts/paired_train_step.sh BASE OUT.jsonl --data DIR [train_step.py arguments...]
set -euo pipefail
BASE=$1; OUT=$(realpath -m "$2"); shift 2
SCRIPT=$(realpath "$(dirname "$0")/train_step.py")
source "$(dirname "$0")/base_worktree.sh" "$BASE"
mkdir -p "$(dirname "$OUT")"
: > "$OUT"
for i in $(seq 1 "$ROUNDS"); do
  for side in change base; do
    dir=$ROOT; [ "$side" = base ] && dir=$WT
    # the script's castspec is the side's: its directory first on the path
    (cd "$dir" && PYTHONPATH="$dir" $PY "$SCRIPT" "$@" 2>/dev/null | sed "s/^{/{\"side\": \"$side\", /" >> "$OUT")
  done
done
cat "$OUT"
