# Sourced by the paired_*.sh scripts with the base revision as $1: sets ROOT (this checkout), PY (its virtual
# environment's python), ROUNDS (default 2) and WT, a worktree of the base revision (its own native build and
# cost profile), removed when the caller exits.
ROOT=$(pwd)
PY=$ROOT/.venv/bin/python
ROUNDS=${ROUNDS:-2}
WT=$(mktemp -d)/base
git worktree add -q --detach "$WT" "$1"
trap 'git -C "$ROOT" worktree remove --force "$WT"' EXIT
