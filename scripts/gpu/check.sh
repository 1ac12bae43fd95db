#!/usr/bin/env bash
# The whole GPU check-and-measure, run from the repository root on a GPU machine; builds nothing.
# Needs the bundle that `make gpu-bundle` leaves in target/gpu-bundle (the CUDA rserve binary and the
# CUDA test binaries), python3 with torch + transformers, and the CUDA 13 runtime libraries.
#   scripts/gpu/check.sh [parts]      parts: kernels,parity,coldstart,tiny,batch,big (default), wheel, profile, speed, quant, lora, prefix, structured, vision, startup, tp, tp70, ggml-bench, kbench
# `tp` runs the tensor-parallel tests (every GPU of the machine) and the 8B shape at TP=1 and TP=2,4
# where the GPUs are there; `tp70` the 70B shape at the largest TP (scripts/gpu/check_tp.py).
# RSERVE_TP_AB names the variants each TP > 1 also runs in (check_tp.py's VARIANTS; default all).
# NCCL: RSERVE_NCCL_LIB, else the libnccl.so.2 that the machine's Python packages ship.
# `wheel` installs target/cuda/wheels/*.whl (`make cuda-wheel`) with the wheels in .whl (pydantic
# and its needs, where the machine lacks them) and runs scripts/gpu/check_wheel.py.
# Results: $OUT (default /tmp/rserve-gpu) holds each step's log, results.jsonl and summary.txt.
# Exits 1 when a step failed, else 0.
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
failed=0
step() {
  local name=$1; shift
  local t0=$SECONDS
  echo "== $name: $*"
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  ((rc)) && failed=1
  tail -n 25 "$OUT/$name.log"
  printf '%-10s rc=%s %ss\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$OUT/summary.txt"
}
has() { [[ ",$PARTS," == *",$1,"* ]]; }

# test binaries absent from the bundle are reported as skipped
test_bin() {
  local name=$1 bin=$BUNDLE/$2; shift 2
  if [[ -x "$bin" ]]; then step "$name" "$bin" --test-threads=1 "$@"; else echo "$name: skipped (no $bin)" | tee -a "$OUT/summary.txt"; fi
}
if has kernels; then
  test_bin kernels paged_attention
  # the attention's kernels launched plainly (RSERVE_CUDA_PDL_ATTENTION=0, for comparisons)
  RSERVE_CUDA_PDL_ATTENTION=0 test_bin kernels-plain paged_attention cuda_decode cuda_split
  # the batch-1 decode attention asking for its first tiles before its wait (opt-in)
  RSERVE_CUDA_EARLY_ATTENTION=1 test_bin kernels-early paged_attention cuda_decode cuda_split
  RSERVE_CUDA_EARLY_ATTENTION=1 test_bin fp8-cache-early fp8_cache cuda_fp8_split_decode
  test_bin candle-sass candle_sass
  test_bin fused fused
  test_bin sampling sampling
  test_bin gemv gemv
  test_bin fp8 fp8
  test_bin fp8-cache fp8_cache
  test_bin ggml ggml
  test_bin lora lora
  test_bin allreduce allreduce
fi
if has ggml-bench; then  # the GGML dequantizers and 256-row products, 8B shapes
  if [[ -x "$BUNDLE/ggml_gpu_bench" ]]; then step ggml-bench "$BUNDLE/ggml_gpu_bench"; else echo "ggml-bench: skipped (no $BUNDLE/ggml_gpu_bench)" | tee -a "$OUT/summary.txt"; fi
fi
if has kbench; then  # the 8B batch-1 step's kernels replayed from a graph, mode by mode (kbench.cu)
  if [[ -x "$BUNDLE/kbench" ]]; then step kbench "$BUNDLE/kbench" chain; else echo "kbench: skipped (no $BUNDLE/kbench)" | tee -a "$OUT/summary.txt"; fi
fi
if has parity; then
  RSERVE_TEST_DEVICE=cuda test_bin parity-f32 parity
  RSERVE_TEST_DEVICE=cuda test_bin batching batching
  # decode graphs captured with detached allocations, the early decode attention in them (opt-in)
  RSERVE_TEST_DEVICE=cuda RSERVE_CUDA_GRAPH_DETACH=1 RSERVE_CUDA_EARLY_ATTENTION=1 \
    test_bin batching-detached batching
  RSERVE_TEST_DEVICE=cuda test_bin lora-serving lora_serving
  RSERVE_TEST_DEVICE=cuda test_bin prefix-cache prefix_cache
  RSERVE_TEST_DEVICE=cuda test_bin structured structured
  RSERVE_TEST_DEVICE=cuda test_bin vision vision
fi
if has tp || has tp70; then
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  if [[ -z "${RSERVE_NCCL_LIB:-}" ]]; then
    site=$(python3 -c 'import site; print(" ".join(site.getsitepackages()))')
    RSERVE_NCCL_LIB=$(find $site -name 'libnccl.so.2' 2>/dev/null | head -n 1)
    export RSERVE_NCCL_LIB
  fi
  echo "NCCL: $RSERVE_NCCL_LIB" | tee -a "$OUT/summary.txt"
  nvidia-smi topo -m >"$OUT/topo.txt" 2>&1; cat "$OUT/topo.txt"
fi
if has tp; then
  test_bin allreduce-group allreduce
  RSERVE_TEST_DEVICE=cuda test_bin tensor-parallel tensor_parallel
  RSERVE_TP_PEER_ALLREDUCE=0 RSERVE_TEST_DEVICE=cuda test_bin tensor-parallel-nccl tensor_parallel
  step tp-8b python3 scripts/gpu/check_tp.py --binary "$BUNDLE/rserve" --out "$OUT" --parts 8b --sizes 1,2,4 --ab "${RSERVE_TP_AB:-all}"
fi
if has tp70; then
  # 141 GB of weights: more than the disk or a default /dev/shm holds, so a tmpfs of its own
  scratch70=${RSERVE_SCRATCH70:-/mnt/rserve-70b}
  mkdir -p "$scratch70"; mountpoint -q "$scratch70" || mount -t tmpfs -o size=200g tmpfs "$scratch70"
  df -h "$scratch70" | tee -a "$OUT/summary.txt"
  step tp-70b python3 scripts/gpu/check_tp.py --binary "$BUNDLE/rserve" --out "$OUT" --parts 70b --sizes 1,2,4 --ab "${RSERVE_TP_AB:-all}" \
    --scratch70 "$scratch70"
fi
if has wheel; then
  rm -rf /tmp/rserve-site
  step wheel-install python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/rserve-site \
    target/cuda/wheels/*.whl $(ls .whl/*.whl 2>/dev/null)
  PYTHONPATH=/tmp/rserve-site step wheel python3 scripts/gpu/check_wheel.py
fi
py_parts=()
for p in coldstart tiny batch big profile speed quant lora prefix structured vision startup; do has $p && py_parts+=("$p"); done
if ((${#py_parts[@]})); then
  step python python3 scripts/gpu/check.py --binary "$BUNDLE/rserve" --out "$OUT" \
    --parts "$(IFS=,; echo "${py_parts[*]}")" ${RSERVE_BIG:+--big "$RSERVE_BIG"}
fi
echo "== summary"; cat "$OUT/summary.txt"
if [[ -f "$OUT/results.jsonl" ]]; then cut -c1-600 "$OUT/results.jsonl"; fi
exit $failed
