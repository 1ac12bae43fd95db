#!/usr/bin/env bash
# Installs the pinned CUDA 13.0 toolchain from PyPI into a local cache (nothing system-wide) and
# prepares what the linker needs. Prints the environment to use, e.g.:
#   eval "$(scripts/cuda-toolchain.sh)"
# The tree lands in ${RSERVE_CUDA_HOME:-$HOME/.cache/rserve/cuda-13.0}; running it again is a no-op.
# With --compiler-only, only what nvcc needs to compile crates/kernels/csrc (no libraries, ~250 MB).
set -euo pipefail
COMPILER_ONLY=0
[[ "${1:-}" == "--compiler-only" ]] && COMPILER_ONLY=1

ROOT="${RSERVE_CUDA_HOME:-$HOME/.cache/rserve/cuda-13.0}"
PY="${PYTHON:-python3}"
# The set that `cuda-toolkit==13.0.2` pins; --no-deps keeps pip from mixing in a newer nvvm.
PKGS=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-cccl==13.0.85
  nvidia-cuda-nvrtc==13.0.88
  nvidia-cublas==13.1.0.3
  nvidia-curand==10.4.0.35
)
if ((COMPILER_ONLY)); then
  PKGS=("${PKGS[@]:0:5}")
  ROOT="$ROOT-compiler"
fi
STAMP="$ROOT/.installed-$(printf '%s\n' "${PKGS[@]}" | sha256sum | cut -c1-16)"
TREE="$ROOT/site/nvidia/cu13"
if ((COMPILER_ONLY)) && [[ -f "$STAMP" ]]; then
  echo "export NVCC='$TREE/bin/nvcc' CUDA_HOME='$TREE'"
  exit 0
fi

if [[ ! -f "$STAMP" ]]; then
  echo "installing CUDA 13.0 toolchain into $ROOT" >&2
  rm -rf "$ROOT/site" "$ROOT"/.installed-*
  mkdir -p "$ROOT"
  "$PY" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile \
    --target "$ROOT/site" "${PKGS[@]}" >&2
  chmod +x "$TREE"/bin/* "$TREE"/nvvm/bin/* 2>/dev/null || true
  if ((COMPILER_ONLY)); then
    touch "$STAMP"
    echo "export NVCC='$TREE/bin/nvcc' CUDA_HOME='$TREE'"
    exit 0
  fi

  # Unversioned names for the linker (the wheels ship only libfoo.so.N).
  for lib in cudart cublas cublasLt curand nvrtc; do
    versioned=$(find "$TREE/lib" -maxdepth 1 -name "lib$lib.so.*" | sort | head -n1)
    [[ -n "$versioned" ]] || { echo "missing lib$lib.so.* in $TREE/lib" >&2; exit 1; }
    ln -sf "$(basename "$versioned")" "$TREE/lib/lib$lib.so"
  done
  ln -sfn lib "$TREE/lib64"
  chmod +x "$TREE"/bin/* "$TREE"/nvvm/bin/* 2>/dev/null || true

  # Link-time stub for the driver library: SONAME libcuda.so.1, one symbol per cu* function declared
  # in cuda.h. The real driver binds at run time; the stub lives outside every run-time search path.
  mkdir -p "$ROOT/stubs"
  grep -oE '\bcu[A-Z][A-Za-z0-9_]*\s*\(' "$TREE/include/cuda.h" | sed -E 's/\s*\($//' | sort -u \
    | awk '{ printf "void %s(void) {}\n", $1 }' >"$ROOT/stubs/libcuda_stub.c"
  # cuda.h renames many entry points to _v2/_v3 variants through macros; define those too.
  grep -oE '#define\s+cu[A-Za-z0-9_]+\s+cu[A-Za-z0-9_]+' "$TREE/include/cuda.h" | awk '{print $3}' \
    | sort -u | awk '{ printf "void %s(void) {}\n", $1 }' >>"$ROOT/stubs/libcuda_stub.c"
  sort -u -o "$ROOT/stubs/libcuda_stub.c" "$ROOT/stubs/libcuda_stub.c"
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$ROOT/stubs/libcuda.so" "$ROOT/stubs/libcuda_stub.c"
  ln -sf libcuda.so "$ROOT/stubs/libcuda.so.1"
  touch "$STAMP"
fi

cat <<EOF
export CUDA_HOME='$TREE'
export NVCC='$TREE/bin/nvcc'
export PATH='$TREE/bin':"\$PATH"
export CUDA_COMPUTE_CAP=90
export CUDARC_CUDA_VERSION=13000
export LIBRARY_PATH='$ROOT/stubs':'$TREE/lib'\${LIBRARY_PATH:+:\$LIBRARY_PATH}
EOF
