#!/bin/bash
# `castspec bench` from this checkout and from a worktree of BASE (its own native build, its own cost profile), in
# turn, ROUNDS times each: each method's speedup over `ar` (mean of domains) before and after a change, with the
# machine's drifts landing on both. Reports in OUT/{change,base}-N/.
#   scripts/paired_bench.sh BASE OUT [bench arguments...]
set -euo pipefail
BASE=$1; OUT=$(realpath -m "$2"); shift 2
source "$(dirname "$0")/base_worktree.sh" "$BASE"
mkdir -p "$OUT"
for i in $(seq 1 "$ROUNDS"); do
  for side in change base; do
    dir=$ROOT; [ "$side" = base ] && dir=$WT
    (cd "$dir" && $PY -m castspec bench "$@" --out "$OUT/$side-$i" > "$OUT/$side-$i.log" 2>&1)
    $PY -c "import json, sys; d = json.load(open(sys.argv[1]))['average_of_domain_ratios']
print(sys.argv[2], {m: round(v['speedup_vs_ar'], 3) for m, v in d.items()})" "$OUT/$side-$i/report.json" "$side-$i"
  done
done
