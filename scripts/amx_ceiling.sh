#!/usr/bin/env bash
# The AMX unit's ceilings on this CPU (scripts/amx_ceiling.c): each core alone, then both at once, as JSON lines
# (GFLOP/s a core). Nothing else should run meanwhile.
#
#   scripts/amx_ceiling.sh [OUT.json]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=$(mktemp -d)/amx_ceiling
trap 'rm -rf "$(dirname "$bin")"' EXIT
"${CC:-cc}" -O2 -mamx-tile -mamx-bf16 "$here/amx_ceiling.c" -o "$bin"
cores=$(nproc)
{
    for ((core = 0; core < cores; ++core)); do
        echo "{\"cores\": \"$core alone\", \"rates\": $(taskset -c "$core" "$bin")}"
    done
    pids=()
    for ((core = 0; core < cores; ++core)); do
        taskset -c "$core" "$bin" > "$bin.$core" & pids+=($!)
    done
    wait "${pids[@]}"
    for ((core = 0; core < cores; ++core)); do
        echo "{\"cores\": \"$core of $cores at once\", \"rates\": $(cat "$bin.$core")}"
    done
} | tee "${1:-/dev/null}"
