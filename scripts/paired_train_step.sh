#!/bin/bash
# Training steps (scripts/train_step.py) of this checkout and of a worktree of BASE in turn, ROUNDS times (one
# JSON line each, tagged with its side), for a change to drafter training. Give --data as an absolute path.
#   scripts/paired_train_step.sh BASE OUT.jsonl --data DIR [train_step.py arguments...]
set -euo pipefail
exec "$(dirname "$0")/paired_script.sh" "$1" "$2" train_step.py "${@:3}"
