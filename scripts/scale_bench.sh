#!/usr/bin/env bash
# castspec loadtest against single-process `castspec serve` and `castspec serve-ray` with 1 and 2 engine
# replicas (one CPU each, a local Ray cluster on this machine), on the default model and shipped drafter.
# For each server: the main load (fixed concurrency, streamed chat requests) and a per-request overhead probe
# (one client, 1-token answers: prefill and the path between the client and the scheduler), and the path alone
# (GET /v1/models, no model work).
# Usage: bash scripts/scale_bench.sh [OUT_DIR]   (results: OUT_DIR/<server>/{load,overhead}/loadtest.json)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/results/scale-out}
CASTSPEC=.venv/bin/castspec
PY=.venv/bin/python
MODEL=(--policy fixed --width 15 --max-batch 8)
LOAD=(--concurrency 8 --requests 32 --max-tokens 64 --per-domain 4)
PROBE=(--concurrency 1 --requests 30 --max-tokens 1 --per-domain 4)
mkdir -p "$OUT"

free_port() { "$PY" -c 'from castspec.serving.live import free_port; print(free_port())'; }

wait_healthy() {  # URL: until /health answers ok (replicas loaded)
  for _ in $(seq 1 600); do
    if "$PY" -c 'import sys, httpx; sys.exit(httpx.get(sys.argv[1] + "/health", timeout=5).json().get("status") != "ok")' "$1" 2>/dev/null; then
      return 0
    fi
    sleep 1
  done
  echo "server at $1 did not become healthy" >&2; return 1
}

run_against() {  # NAME URL
  echo "== $1: load average $(cut -d' ' -f1-3 /proc/loadavg) before" | tee -a "$OUT/loadavg.txt"
  "$CASTSPEC" loadtest --url "$2" "${LOAD[@]}" --out "$OUT/$1/load"
  "$CASTSPEC" loadtest --url "$2" "${PROBE[@]}" --out "$OUT/$1/overhead"
  # the path alone: GET /v1/models touches no model, so its latency is HTTP (+ Serve's proxy, the ingress, the
  # handle call and the replica's loopback hop under Ray)
  "$PY" - "$2" "$OUT/$1/relay.json" <<'EOF_RELAY'
import json, sys, time
import httpx
url, out = sys.argv[1], sys.argv[2]
with httpx.Client(base_url=url, timeout=30) as c:
    for _ in range(10):
        c.get("/v1/models")
    ms = []
    for _ in range(200):
        t = time.perf_counter()
        assert c.get("/v1/models").status_code == 200
        ms.append((time.perf_counter() - t) * 1e3)
ms.sort()
json.dump({"requests": len(ms), "p50_ms": ms[len(ms) // 2], "p99_ms": ms[int(0.99 * (len(ms) - 1))]}, open(out, "w"))
EOF_RELAY
  echo "== $1: load average $(cut -d' ' -f1-3 /proc/loadavg) after" | tee -a "$OUT/loadavg.txt"
}

stop() { kill -INT "$1"; wait "$1" || true; }

: > "$OUT/loadavg.txt"
port=$(free_port)
"$CASTSPEC" serve --port "$port" "${MODEL[@]}" & pid=$!
wait_healthy "http://127.0.0.1:$port"
run_against single "http://127.0.0.1:$port"
stop $pid

for n in 1 2; do
  port=$(free_port)
  "$CASTSPEC" serve-ray --port "$port" "${MODEL[@]}" --replicas "$n" --cpus-per-replica 1 --local-cpus 2 \
      --object-store-mb 200 > "$OUT/ray-$n.url" 2> "$OUT/ray-$n.log" & pid=$!
  wait_healthy "http://127.0.0.1:$port"
  run_against "ray-$n" "http://127.0.0.1:$port"
  stop $pid
done

"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = []
for name in ("single", "ray-1", "ray-2"):
    load = json.loads((out / name / "load" / "loadtest.json").read_text())["results"][0]
    probe = json.loads((out / name / "overhead" / "loadtest.json").read_text())["results"][0]
    relay = json.loads((out / name / "relay.json").read_text())
    rows.append({"server": name, "ok": f"{load['ok']}/{load['requests']}", "goodput_tokens_per_s": load["goodput_tokens_per_s"],
                 "models_get_p50_ms": relay["p50_ms"], "models_get_p99_ms": relay["p99_ms"],
                 "p50_latency_s": load["p50_latency_s"], "p99_latency_s": load["p99_latency_s"],
                 "p99_ttft_s": load["p99_ttft_s"], "one_token_p50_s": probe["p50_latency_s"],
                 "one_token_p99_s": probe["p99_latency_s"]})
(out / "summary.json").write_text(json.dumps(rows, indent=2))
print(json.dumps(rows, indent=2))
EOF
