#!/usr/bin/env bash
# Issue 17 pilot: does the KL loss (train-drafter --kl-weight) help the drafter more than cross-entropy alone?
# Both arms warm-start from the shipped drafter and fine-tune on the same small slice of the target's own
# responses with the same seed, steps and learning rate; each export replays held-out prompts (RUN/ARM/curve.json).
# Every step resumes: rerun the same command after an interruption.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-data/kl-pilot}
RUN=${RUN:-runs/kl-pilot}
PROMPTS=${PROMPTS:-400}
STEPS=${STEPS:-150}
KL=${KL:-0.5}
CLI=.venv/bin/castspec
$CLI make-data --out "$DATA" --max-prompts "$PROMPTS" --batch-size 24
for arm in ce:0 kl:"$KL"; do
  $CLI train-drafter --data "$DATA" --out "$RUN/${arm%%:*}" --layers 2 --seqs-per-step 2 --anchors 64 --lr 2e-4 \
    --norm-init ones --init-from castspec/assets/drafter-smollm2-135m --steps "$STEPS" --checkpoint-every 25 \
    --export-every 50 --eval-per-domain 4 --kl-weight "${arm#*:}"
done
python3 - "$RUN" <<'PY'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
out = {arm: json.loads((run / arm / "curve.json").read_text()) for arm in ("ce", "kl")}
(run / "pilot.json").write_text(json.dumps(out, indent=1))
for arm, curve in out.items():
    print(arm, json.dumps(curve[-1] if isinstance(curve, list) else curve)[:400])
PY
