#!/usr/bin/env bash
# The test command: formatting, lints, every Rust test, then the black-box Python suites (HTTP via
# the official openai client, the in-process Python package) against freshly built artifacts.
# Installs what it needs itself (Python packages into .venv-test); needs Rust and Python 3.9+.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
# getrandom calls libc's getrandom() directly rather than finding it with dlsym, which a static
# binary cannot do (it would fall back to /dev/urandom, absent from an empty root)
export RUSTFLAGS="${RUSTFLAGS:-} --cfg getrandom_backend=\"linux_getrandom\""
command -v cargo >/dev/null || { echo "cargo is required (https://rustup.rs)" >&2; exit 1; }

echo "== cargo fmt / clippy"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo clippy -p rserve-server --features python --lib -- -D warnings

echo "== CUDA kernels compile (nvcc from PyPI, sm_90a; no GPU needed)"
scripts/check-cuda-kernels.sh

echo "== cargo test"
cargo test --workspace

echo "== build the rserve binary (statically linked, as \`make static\` links the release one)"
cargo rustc -p rserve-server --bin rserve -- -C target-feature=+crt-static -C relocation-model=static
export RSERVE_BIN="$PWD/target/debug/rserve" RSERVE_STATIC_BIN="$PWD/target/debug/rserve"
if [ "$(id -u)" = 0 ] && { ! command -v umoci || ! command -v runc; } >/dev/null && command -v apt-get >/dev/null; then
    echo "== skopeo, umoci and runc (Debian) for the container image tests"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q skopeo umoci runc >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q skopeo umoci runc >/dev/null; }
fi

echo "== Python environment"
PY="${PYTHON:-python3}"
if [ ! -x .venv-test/bin/python ]; then
    "$PY" -m venv .venv-test
fi
VPY="$PWD/.venv-test/bin/python"
"$VPY" -m pip install -q --upgrade pip >/dev/null
"$VPY" -m pip install -q -r tests/requirements.txt maturin
echo "== build the Python extension"
( unset CONDA_PREFIX; VIRTUAL_ENV="$PWD/.venv-test" PATH="$PWD/.venv-test/bin:$PATH" maturin develop -q )

echo "== pytest"
"$VPY" -m pytest tests -q
echo "== target/ holds $(du -sh target 2>/dev/null | cut -f1)"
