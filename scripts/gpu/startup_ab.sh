#!/usr/bin/env bash
# Start of the Llama-3.1-8B shape (random bf16 weights, page cache warm, the driver's JIT cache
# disabled) with two binaries, alternating run by run, in one call on one machine:
#   scripts/gpu/startup_ab.sh BEFORE AFTER [RUNS]      results: $OUT/startup_ab.jsonl
set -uo pipefail
OUT=${OUT:-/tmp/rserve-gpu}
mkdir -p "$OUT"
python3 -c "import sys; sys.path.insert(0, 'scripts/gpu'); import check; from pathlib import Path; check.fresh_checkpoint('llama-3.1-8b', Path('/tmp/rserve-big'))" >"$OUT/checkpoint.log" 2>&1
for i in $(seq "${3:-3}"); do
  for b in "$1" "$2"; do
    CUDA_CACHE_DISABLE=1 "$b" bench startup /tmp/rserve-big/llama-3.1-8b --runs 1 --json -- \
      --gpu-memory-utilization 0.85 | grep '^{' | sed "s|^{|{\"binary\": \"$b\", |" >>"$OUT/startup_ab.jsonl"
  done
done
cut -c1-400 "$OUT/startup_ab.jsonl"
# the same weights on the GPU: greedy tokens and their log-probs of both binaries, compared exactly
for b in "$1" "$2"; do
  "$b" serve /tmp/rserve-big/llama-3.1-8b --port 8041 --max-model-len 4096 >"$OUT/serve-ab.log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do curl -sf localhost:8041/health >/dev/null && break; sleep 0.1; done
  curl -s localhost:8041/v1/completions -H 'Content-Type: application/json' \
    -d '{"prompt": "t5 t6 t7 t8 t9 t10", "max_tokens": 64, "temperature": 0, "logprobs": 1}' \
    | python3 -c 'import json,sys; c=json.load(sys.stdin)["choices"][0]; print(json.dumps([c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]]))' >"$OUT/greedy-$(basename "$b").json"
  kill $pid; wait $pid 2>/dev/null
done
cmp "$OUT/greedy-$(basename "$1").json" "$OUT/greedy-$(basename "$2").json" && echo "greedy tokens and log-probs identical"
