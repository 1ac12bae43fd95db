#!/usr/bin/env bash
# candle's quantized CUDA module (GGUF types without rserve's kernels) as SASS, with the driver's
# JIT cache disabled: its products against the CPU (`candle_sass`), the GGUF fixtures on the GPU
# (`gguf`), and the start of a GGUF file whose projections run it (q3_K, q5_K) with the number of
# candle modules the log says were loaded as SASS.
#   scripts/gpu/check_gguf_sass.sh BUNDLE FILE.gguf      results: $OUT (default /tmp/rserve-gpu)
set -uo pipefail
B=$1 F=$2
OUT=${OUT:-/tmp/rserve-gpu}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=${CUDA_LIBS:-/usr/local/cuda-13.0/lib64}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export CUDA_CACHE_DISABLE=1 RSERVE_REPO=$PWD
chmod +x "$B"/*
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
for t in candle_sass gguf; do
  "$B/$t" --test-threads=1 >"$OUT/$t.log" 2>&1
  echo "$t: rc=$? $(grep -E '^test result' "$OUT/$t.log" | tail -1)"
done
"$B/rserve" bench startup "$F" --binary "$B/rserve" --runs 3 --json >"$OUT/startup.jsonl" 2>"$OUT/startup.err"
cut -c1-160 "$OUT/startup.jsonl"
"$B/rserve" generate "$F" --prompt "hello there" --max-tokens 16 --temperature 0 --log-level info \
  >"$OUT/generate.txt" 2>"$OUT/generate.log"
grep -E "SASS|GGUF tensors|startup: ready" "$OUT/generate.log" | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-200
