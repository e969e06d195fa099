#!/usr/bin/env bash
# The CUDA checks, for a machine with an NVIDIA GPU and a python3 that has torch, transformers, pytest and
# hypothesis (no install step: it runs the repository from its source tree).
#
#   bash scripts/device_check.sh TARGET_DIR OUT_DIR
#
# 1. The exactness tests on the GPU: native logits vs transformers (tiny Llama/Qwen3, cache, packed tree),
#    KV compaction, chain/cast == ar token for token in fp32, two sampled-law tests.
# 2. `python -m castspec.bench.engine --device cuda` on TARGET_DIR. TARGET_DIR needs config.json and the
#    tokenizer files; when it has no weights, random ones are written first (timing does not depend on their
#    values, and the embedded checkpoint is larger than what travels to a lent GPU machine here).
set -euo pipefail
target=${1:?TARGET_DIR}
out=${2:?OUT_DIR}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
torch.cuda.get_device_name())"

status=0
if [ "${CHECKS:-all}" != bench ]; then  # CHECKS=bench: the benchmark alone
  timeout 240 python3 -m pytest -p no:cacheprovider --device cuda tests/test_decoder.py tests/test_decode.py \
    "tests/test_sampling.py::test_sampled_decoding_preserves_the_target_law[method=chain]" \
    "tests/test_sampling.py::test_sampled_decoding_preserves_the_target_law[method=cast-width=15]" \
    2>&1 | tee "$out/pytest-cuda.log" || status=1
fi

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
timeout 200 python3 -m castspec.bench.engine --device cuda --target "$target" --out "$out/engine-cuda.json" \
  2>&1 | tee "$out/engine-cuda.log" || status=1
exit $status
