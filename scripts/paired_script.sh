#!/bin/bash
# A measuring script of this checkout's scripts/ run on this checkout and on a worktree of BASE in turn, ROUNDS
# times; each run prints one JSON line, kept in OUT.jsonl tagged with its side.
#   scripts/paired_script.sh BASE OUT.jsonl SCRIPT.py [its arguments...]
set -euo pipefail
BASE=$1; OUT=$(realpath -m "$2"); SCRIPT=$(realpath "$(dirname "$0")/$3"); shift 3
source "$(dirname "$0")/base_worktree.sh" "$BASE"
mkdir -p "$(dirname "$OUT")"
: > "$OUT"
for i in $(seq 1 "$ROUNDS"); do
  for side in change base; do
    dir=$ROOT; [ "$side" = base ] && dir=$WT
    # the script's castspec is the side's: its directory first on the path
    (cd "$dir" && PYTHONPATH="$dir" $PY "$SCRIPT" "$@" | sed "s/^{/{\"side\": \"$side\", /" >> "$OUT")
  done
done
cat "$OUT"
