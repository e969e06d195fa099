#!/usr/bin/env bash
# The measurements of castspec's AVX2 build (castspec/native/csrc/avx2.h) that docs/performance.md quotes, in one
# run on a CPU with AVX2 and no AVX-512 BF16 (about 15 minutes on 2 cores): the verify / draft costs against the
# floor with the AVX2 build in bf16 and with torch's kernels in fp32 (what such a CPU ran before), ar against
# transformers, and end to end ar / chain / cast. Results land in $RESULTS (default docs/results/avx2).
set -euo pipefail
cd "$(dirname "$0")/.."
C=.venv/bin/castspec
PY=.venv/bin/python
R=${RESULTS:-docs/results/avx2}
mkdir -p "$R"
$C probe --packed 1,2,4,8,16,32 --prefix-lens 128,512 --reps 3 --warmup 1 --out "$R"/probe.json
CASTSPEC_NATIVE=0 $C probe --dtype fp32 --packed 1,2,4,8,16,32 --prefix-lens 128,512 --reps 3 --warmup 1 \
    --out "$R"/probe-torch-fp32.json
$PY -m castspec.bench.engine --tokens 48 --prompts 3 --repeats 2 --out "$R"/engine.json
$C bench --n 3 --max-new-tokens 64 --methods ar,chain,cast:auto,cast:7 --out "$R"/bench
