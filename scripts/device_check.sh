#!/usr/bin/env bash
# The CUDA checks, for a machine with an NVIDIA GPU and a python3 that has torch, transformers, pytest and
# hypothesis (no install step: it runs the repository from its source tree). Sized for one ~10-minute call.
#
#   bash scripts/device_check.sh [TARGET_DIR] [OUT_DIR]
#
# OUT_DIR defaults to $OUT (the folder a lent device machine sends back); TARGET_DIR may be empty ("").
# 1. tests: the exactness tests on the GPU (native logits vs transformers on tiny Llama/Qwen3 with a cache and
#    a packed tree, KV compaction, chain/cast == ar token for token in fp32, two sampled-law tests) and
#    tests/test_graphs.py (padded forwards captured as CUDA graphs: outputs against the eager forward, greedy
#    decoding with graphs == ar) -> pytest-cuda.log
# 2. scale: `python -m castspec.bench.gpu_scale --device cuda`: Qwen3-8B and DFlash-b16 shapes with random bf16
#    weights made on the GPU; ar against the HBM floor, verify 1..128 tokens at prefixes 512 and 4096, the
#    drafter pass, host work per round, transformers generate; graphs and eager -> gpu-scale.json, gpu-scale.log
# 3. engine (only with TARGET_DIR): `python -m castspec.bench.engine --device cuda --target TARGET_DIR`.
#    TARGET_DIR needs config.json and the tokenizer files; when it has no weights, random ones are written first
#    -> engine-cuda.json
# CHECKS=tests|scale|engine (comma-separated) runs only those; every part has its own time limit, and the
# script exits non-zero when one failed (the others still run). status.txt says which. TESTS_S, SCALE_S and
# ENGINE_S set those limits in seconds (default 240, 240, 100: together under a 10-minute call).
set -uo pipefail
target=${1:-}
out=${2:-${OUT:?OUT_DIR or \$OUT}}
checks=${CHECKS:-tests,scale,engine}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
torch.cuda.get_device_name())" 2>&1 | tee "$out/versions.txt"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true

status=0
record() {  # NAME EXIT_CODE
  echo "$1: $([ "$2" = 0 ] && echo ok || echo "failed ($2)")" | tee -a "$out/status.txt"
  [ "$2" = 0 ] || status=1
}
wants() { [[ ",$checks," == *",$1,"* ]]; }

if wants tests; then
  timeout "${TESTS_S:-240}" python3 -m pytest -p no:cacheprovider --device cuda tests/test_decoder.py tests/test_decode.py \
    tests/test_graphs.py \
    "tests/test_sampling.py::test_sampled_decoding_preserves_the_target_law[method=chain]" \
    "tests/test_sampling.py::test_sampled_decoding_preserves_the_target_law[method=cast-width=15]" \
    > "$out/pytest-cuda.log" 2>&1
  record tests $?
  tail -5 "$out/pytest-cuda.log"
fi

if wants scale; then
  timeout "${SCALE_S:-240}" python3 -m castspec.bench.gpu_scale --device cuda --out "$out/gpu-scale.json" \
    > "$out/gpu-scale.log" 2>&1
  record scale $?
  tail -30 "$out/gpu-scale.log"
fi

if wants engine && [ -n "$target" ]; then
  if [ ! -e "$target/model.safetensors" ]; then
    random=$(mktemp -d)/target
    cp -r "$target" "$random"
    python3 - "$random" <<'EOF'
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1])).save_pretrained(sys.argv[1])
EOF
    target=$random
  fi
  timeout "${ENGINE_S:-100}" python3 -m castspec.bench.engine --device cuda --target "$target" --out "$out/engine-cuda.json" \
    > "$out/engine-cuda.log" 2>&1
  record engine $?
fi
exit $status
