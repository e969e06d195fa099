#!/bin/bash
# The batched drafter pass (scripts/batched_pass.py) of this checkout and of a worktree of BASE in turn, ROUNDS
# times (one JSON line each, tagged with its side), for a change to the drafter's native code.
#   scripts/paired_pass.sh BASE OUT.jsonl [batched_pass.py arguments...]
set -euo pipefail
exec "$(dirname "$0")/paired_script.sh" "$1" "$2" batched_pass.py --repeats 1 "${@:3}"
