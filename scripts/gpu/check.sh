#!/usr/bin/env bash
# The whole GPU check-and-measure, run from the repository root on a GPU machine; builds nothing.
# Needs the bundle that `make gpu-bundle` leaves in target/gpu-bundle (the CUDA rserve binary and the
# CUDA test binaries), python3 with torch + transformers, and the CUDA 13 runtime libraries.
#   scripts/gpu/check.sh [parts]      parts: kernels,parity,coldstart,tiny,batch,big (default: all)
# Results: $OUT (default /tmp/rserve-gpu) holds each step's log, results.jsonl and summary.txt.
set -uo pipefail
BUNDLE=${RSERVE_BUNDLE:-target/gpu-bundle}
OUT=${OUT:-/tmp/rserve-gpu}
PARTS=${1:-kernels,parity,coldstart,tiny,batch,big}
mkdir -p "$OUT"
export RSERVE_REPO=$PWD
export LD_LIBRARY_PATH=${CUDA_LIBS:-/usr/local/cuda-13.0/lib64}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-/tmp/rserve-cuda-cache} CUDA_CACHE_MAXSIZE=4294967296
export PYTHONUNBUFFERED=1
chmod +x "$BUNDLE"/* 2>/dev/null

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
: >"$OUT/summary.txt"
step() {
  local name=$1; shift
  local t0=$SECONDS
  echo "== $name: $*"
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  printf '%-10s rc=%s %ss\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$OUT/summary.txt"
}
has() { [[ ",$PARTS," == *",$1,"* ]]; }

if has kernels; then
  step kernels "$BUNDLE/paged_attention" --test-threads=1
  step fused "$BUNDLE/fused" --test-threads=1
  step sampling "$BUNDLE/sampling" --test-threads=1
fi
if has parity; then
  RSERVE_TEST_DEVICE=cuda step parity-f32 "$BUNDLE/parity" --test-threads=1
  RSERVE_TEST_DEVICE=cuda step batching "$BUNDLE/batching" --test-threads=1
fi
py_parts=()
for p in coldstart tiny batch big; do has $p && py_parts+=("$p"); done
if ((${#py_parts[@]})); then
  step python python3 scripts/gpu/check.py --binary "$BUNDLE/rserve" --out "$OUT" \
    --parts "$(IFS=,; echo "${py_parts[*]}")" ${RSERVE_BIG:+--big "$RSERVE_BIG"}
fi
echo "== summary"; cat "$OUT/summary.txt"
[[ -f "$OUT/results.jsonl" ]] && cat "$OUT/results.jsonl" | cut -c1-600
