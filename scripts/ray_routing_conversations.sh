#!/usr/bin/env bash
# serve-ray on 2 replicas x 1 CPU (a local 2-CPU cluster), MT-Bench two-turn chats at 4 clients (loadtest
# --conversations --url), --routing prefix then balance; results in docs/results/prefix-cache/serve-ray-*
set -u
cd "$(dirname "$0")/.."
for routing in prefix balance; do
  .venv/bin/castspec serve-ray --replicas 2 --cpus-per-replica 1 --local-cpus 2 --max-batch 4 --port 8123 \
      --routing $routing > "${TMPDIR:-/tmp}"/castspec-ray-$routing.out 2> "${TMPDIR:-/tmp}"/castspec-ray-$routing.err &
  pid=$!
  for i in $(seq 1 120); do grep -q '"url"' "${TMPDIR:-/tmp}"/castspec-ray-$routing.out && break; sleep 2; done
  sleep 5
  .venv/bin/castspec loadtest --url http://127.0.0.1:8123 --conversations --requests 16 --concurrency 4 \
      --max-tokens 64 --out docs/results/prefix-cache/serve-ray-$routing
  kill -INT $pid; wait $pid
done
