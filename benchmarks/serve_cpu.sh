#!/usr/bin/env bash
# Serving figures on the CPU: binary size, launch to /health 200 with the embedded tiny model (and
# with a model directory if given), then `rserve bench serve` against it.
# Usage: benchmarks/serve_cpu.sh [MODEL_DIR] [extra bench-serve flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${RSERVE_BIN:-target/release/rserve}"
MODEL="${1:-}"
shift || true
PORT="${PORT:-8321}"
echo "binary: $BIN, $(stat -c %s "$BIN") bytes ($(numfmt --to=iec "$(stat -c %s "$BIN")"))"
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg)"
start=$(date +%s.%N)
if [ -n "$MODEL" ]; then
    "$BIN" serve "$MODEL" --port "$PORT" --served-model-name bench > /tmp/rserve-serve-bench.log 2>&1 &
else
    "$BIN" serve --port "$PORT" --served-model-name bench > /tmp/rserve-serve-bench.log 2>&1 &
fi
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do sleep 0.01; done
end=$(date +%s.%N)
echo "launch to /health 200: $(echo "$end - $start" | bc) s"
"$BIN" bench serve --base-url "http://127.0.0.1:$PORT/v1" --model bench "$@"
