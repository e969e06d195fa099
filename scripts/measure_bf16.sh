#!/usr/bin/env bash
# Issue 16's measurements, before and after in one run: greedy agreement of bf16 with fp32 (12 prompts x 96 new
# tokens, castspec.bench.agreement; as loaded, and with the fp32 reference on the same bf16-rounded weights) and the cost of ar and cast in bf16 (castspec bench), for each native mode
# given (default: torch's kernels, and the AVX2 build where no AVX-512 BF16 is present, else the AVX-512 one).
#
#   scripts/measure_bf16.sh BEFORE_CHECKOUT OUT_DIR [MODES]
#
# BEFORE_CHECKOUT is a checkout of the commit to compare with (`git worktree add /tmp/before <commit>`); it runs
# with this checkout's .venv, and with this checkout's agreement tool when it has none. Run on a quiet machine.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
BEFORE=$(cd "$1" && pwd)
OUT=$(mkdir -p "$2" && cd "$2" && pwd)
if [ -n "${3:-}" ]; then MODES=$3
elif grep -q avx512_bf16 /proc/cpuinfo; then MODES="0 1"
else MODES="0 avx2"; fi
PY=$HERE/.venv/bin/python
# the before side gets this checkout's agreement tool (it measures; it does not decode differently)
cp "$HERE/castspec/bench/agreement.py" "$BEFORE/castspec/bench/"
for mode in $MODES; do
  for side in before after; do
    tree=$HERE; [ "$side" = before ] && tree=$BEFORE
    # `python -m` puts the working directory first on sys.path: each side runs its own castspec package
    # the bf16 deployment against the fp32 one, then against fp32 arithmetic on the same (bf16-rounded) weights
    (cd "$tree" && CASTSPEC_NATIVE=$mode "$PY" -m castspec.bench.agreement --n 4 --max-new-tokens 96 \
        --out "$OUT/agreement-$side-native$mode.json")
    (cd "$tree" && CASTSPEC_NATIVE=$mode "$PY" -m castspec.bench.agreement --same-weights --n 4 \
        --max-new-tokens 96 --out "$OUT/agreement-sameweights-$side-native$mode.json")
    (cd "$tree" && CASTSPEC_NATIVE=$mode "$PY" -m castspec bench --dtype bf16 --n 1 --max-new-tokens 64 \
        --methods ar,cast:7,cast:15 --resamples 200 --out "$OUT/bench-$side-native$mode")
  done
done
