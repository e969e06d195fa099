#!/bin/bash
# The batched drafter pass (scripts/batched_pass.py) of this checkout and of a worktree of BASE in turn, ROUNDS
# times (one JSON line each, tagged with its side), for a change to the drafter's native code.
#   scripts/paired_pass.sh BASE OUT.jsonl [batched_pass.py arguments...]
set -euo pipefail
BASE=$1; OUT=$(realpath -m "$2"); shift 2
SCRIPT=$(realpath "$(dirname "$0")/batched_pass.py")
source "$(dirname "$0")/base_worktree.sh" "$BASE"
mkdir -p "$(dirname "$OUT")"
: > "$OUT"
for i in $(seq 1 "$ROUNDS"); do
  for side in change base; do
    dir=$ROOT; [ "$side" = base ] && dir=$WT
    # the script's castspec is the side's: its directory first on the path
    (cd "$dir" && PYTHONPATH="$dir" $PY "$SCRIPT" --repeats 1 "$@" | sed "s/^{/{\"side\": \"$side\", /" >> "$OUT")
  done
done
cat "$OUT"
