#!/usr/bin/env bash
# Compile-checks rserve's own CUDA kernels (crates/kernels/csrc) for sm_90a with the pinned nvcc
# from PyPI, warnings as errors. Needs no GPU; the full `cargo build --features cuda` (which also
# builds candle's kernels, ~20 minutes on two cores) is `make cuda`.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/cuda-toolchain.sh --compiler-only)"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$NVCC" --fatbin -O3 -std=c++17 -Werror all-warnings \
  -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_90,code=compute_90 \
  crates/kernels/csrc/kernels.cu -o "$out/kernels.fatbin"
echo "crates/kernels/csrc: compiled for sm_90a + compute_90 ($(stat -c %s "$out/kernels.fatbin") bytes)"
