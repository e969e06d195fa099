#!/usr/bin/env bash
# The measurements docs/performance.md (and the README's results table) quote, in one run on one machine (about
# 40 minutes on 2 CPU cores). Results land in docs/results/ (or $RESULTS), replacing the committed ones: note the
# machine and the date beside them in docs/performance.md. On a shared machine compare ratios within one run.
set -euo pipefail
cd "$(dirname "$0")/.."
C=.venv/bin/castspec
PY=.venv/bin/python
DRAFTER=castspec/assets/drafter-smollm2-135m
R=${RESULTS:-docs/results}
mkdir -p "$R"
DATA=${DATA:-data/smollm2-bf16-greedy}  # make-data output (scripts/train_default_drafter.sh), for diagnose-drafter
# held-out R of the shipped drafter (chain and cast at N = 15/31/63, per domain)
$C eval-drafter --drafter "$DRAFTER" --per-domain 4 --max-new-tokens 96 --out "$R"/eval-drafter.json
# verify / draft / host costs, single and batched; also stored as this deployment's profile for width="auto"
$C probe --packed 1,2,4,8,16,24,32,48,64 --prefix-lens 128,512 --batch-sizes 2,4,8,16 --reps 3 --warmup 1 \
    --out "$R"/probe-batched.json --plot "$R"/probe-batched.png
# the same drafter without its draft vocabulary: drafter pass over the whole vocabulary, and end to end
rm -rf runs/drafter-full-vocab && mkdir -p runs/drafter-full-vocab
cp "$DRAFTER/config.json" "$DRAFTER/model.safetensors" runs/drafter-full-vocab/
$C probe --drafter runs/drafter-full-vocab --packed 1,8 --prefix-lens 128,512 --reps 5 --warmup 2 \
    --out "$R"/probe-full-vocab.json
# ar vs transformers per dtype, the weight-bandwidth floor, host share at N = 63
$PY -m castspec.bench.engine --out "$R"/engine.json
# end to end: ar, chain, cast (auto, auto + calibration, fixed), transformers
$C bench --n 5 --max-new-tokens 96 --methods ar,chain,cast:auto,cast:auto+cal,cast:3,cast:7,cast:15,hf \
    --out "$R"/bench
$C bench --drafter runs/drafter-full-vocab --n 5 --max-new-tokens 96 --methods ar,cast:7 --out "$R"/bench-full-vocab
# against llama.cpp on the same weights in bf16, where llama-cpp-python is installed (pip install -e '.[compare]')
if $PY -c "import llama_cpp" 2>/dev/null; then
  $C bench --n 5 --max-new-tokens 96 --methods ar,llamacpp,hf,cast:auto --out "$R"/bench-llamacpp
fi
# sampling at T = 1: chain vs tree vs auto, three seeds
$C bench --n 3 --max-new-tokens 64 --temperature 1 --seeds 0,1,2 --methods ar,chain,cast:15,cast:auto \
    --out "$R"/bench-t1
# teacher-forced accuracy per block position vs n-gram tables (needs the training data, see docs/training.md)
if [ -d "$DATA" ]; then
  $C diagnose-drafter --data "$DATA" --drafter "$DRAFTER" --out "$R"/diagnose-drafter.json
fi
# width sweep vs the rules' predicted widths
$C sweep --n 2 --max-new-tokens 96 --widths 1,3,7,15,31,63 --resamples 500 --out "$R"/sweep
# serving: allocation policies under fixed concurrency
$C loadtest --policies ar,chain,fixed:7,shared:16,cost --concurrency 1,4,16 --requests 16 --max-tokens 48 \
    --out "$R"/loadtest-packed
# serving with arrivals spread in time: Poisson arrivals above what 16 slots serve, so the batch stays near full
# and no two requests start together (the closed test above starts and ends its requests in step)
$C loadtest --policies ar,cost --concurrency 16 --requests 112 --max-tokens 48 --rate 28 --out "$R"/loadtest-open
