#!/bin/bash
# A change against a base revision under load, interleaved on one machine: `castspec loadtest` from this checkout
# and from a worktree of BASE (its own native build), alternating, ROUNDS times each (the machine's speed drifts
# within minutes, so only pairs run back to back compare).
#   scripts/paired_loadtest.sh BASE OUT [loadtest arguments...]
# default arguments: --policies ar,cost --concurrency 1,16 --requests 32 --max-tokens 48
set -euo pipefail
BASE=$1; OUT=$(realpath -m "$2"); shift 2  # absolute: the base runs from its worktree
ARGS=("$@")
[ ${#ARGS[@]} -eq 0 ] && ARGS=(--policies ar,cost --concurrency 1,16 --requests 32 --max-tokens 48)
source "$(dirname "$0")/base_worktree.sh" "$BASE"
mkdir -p "$OUT"
for i in $(seq 1 "$ROUNDS"); do
  # python -m puts the working directory first on the path: each run imports its own tree's castspec
  (cd "$ROOT" && $PY -m castspec loadtest "${ARGS[@]}" --out "$OUT/change-$i" > /dev/null)
  (cd "$WT" && $PY -m castspec loadtest "${ARGS[@]}" --out "$OUT/base-$i" > /dev/null)
done
$PY - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for run in sorted(out.glob("*/loadtest.json")):
    summary = json.loads(run.read_text())["summary"]
    print(run.parent.name, {b: {p: round(g, 1) for p, g in v["goodput"].items()} for b, v in summary.items()})
PY
