# Builds with CUDA (sm_90: H100/H200) on any Linux machine, GPU or not. The toolchain comes from
# PyPI into ~/.cache/rserve/cuda-13.0 (scripts/cuda-toolchain.sh); nothing is installed system-wide.
#   make cuda         target/cuda/release/rserve and the wheel in target/cuda/wheels
#   make gpu-bundle   the binary and the CUDA test binaries in target/gpu-bundle, for scripts/gpu/check.sh
#   make cuda-check   compile-check the cuda feature (what CI runs)
#   make kbench       the kernel micro-benchmark (benchmarks/gpu/kbench.cu) in target/kbench, nvcc only
#   make gpu-pack     the bundle in one xz-compressed tar, target/gpu-pack/bundle.txz, small enough
#                     to carry to a GPU machine (unpack there with python3 -c "import tarfile;
#                     tarfile.open('target/gpu-pack/bundle.txz').extractall('target')")
# Without CUDA:
#   make static       a CPU rserve with no dynamic dependencies, target/static/rserve
#   make image-cpu    OCI image FROM scratch with it: target/image/cpu (layout) and cpu.tar (archive)
#   make image-cuda   OCI image with the CUDA binary and the CUDA libraries it loads: target/image/cuda
#                     (MODEL=dir bakes a model in as its own layer)
SHELL := /bin/bash
CUDA_ENV = eval "$$(scripts/cuda-toolchain.sh)" && export CARGO_TARGET_DIR=$(CURDIR)/target/cuda
BUNDLE := target/gpu-bundle

.PHONY: cuda cuda-binary cuda-wheel cuda-check gpu-bundle kbench gpu-pack static image-cpu image-cuda
STATIC_TRIPLE := x86_64-unknown-linux-gnu

# glibc's crt-static, not position-independent; --target keeps the flags off build scripts and
# proc-macros. getrandom calls the libc function (a static binary has no dlsym to find it with).
STATIC_FLAGS := -C target-feature=+crt-static -C relocation-model=static --cfg getrandom_backend="linux_getrandom"
static:
	CARGO_TARGET_DIR=$(CURDIR)/target/static RUSTFLAGS='$(STATIC_FLAGS)' \
	  cargo build --profile static --target $(STATIC_TRIPLE) -p rserve-server --bin rserve
	cp target/static/$(STATIC_TRIPLE)/static/rserve target/static/rserve
	@ldd target/static/rserve 2>&1 | sed 's/^/ldd: /'; ls -la target/static/rserve

image-cpu: static
	python3 scripts/image.py cpu --binary target/static/rserve --out target/image/cpu

image-cuda: cuda-binary
	$(CUDA_ENV) && python3 scripts/image.py cuda --binary target/cuda/release/rserve \
	  --cuda-lib "$$CUDA_HOME/lib" --out target/image/cuda $(if $(MODEL),--model $(MODEL))

cuda: cuda-binary cuda-wheel

cuda-binary:
	$(CUDA_ENV) && cargo build --release -p rserve-server --features cuda

cuda-wheel:
	$(CUDA_ENV) && python3 -m pip install -q 'maturin>=1.7,<2' && \
	  maturin build --release --features python,cuda --auditwheel skip -o target/cuda/wheels

cuda-check:
	$(CUDA_ENV) && cargo check --workspace --tests --features rserve-server/cuda

gpu-bundle: cuda-binary kbench
	set -o pipefail && $(CUDA_ENV) && cargo test --release --features cuda -p rserve-kernels -p rserve-core --no-run \
	  --test paged_attention --test candle_sass --test fused --test sampling --test gemv --test fp8 --test fp8_cache --test ggml --test lora --test parity --test batching --test lora_serving --test prefix_cache --test structured --test vision --test tensor_parallel --test allreduce --message-format=json 2>/dev/null \
	  | python3 -c 'import json,sys; [print(m["executable"]) for m in map(json.loads, sys.stdin) if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]]' \
	  >target/cuda/test-binaries.txt
	$(CUDA_ENV) && cargo build --release --features cuda -p rserve-kernels --example ggml_gpu_bench
	rm -rf $(BUNDLE) && mkdir -p $(BUNDLE)
	cp target/cuda/release/rserve target/cuda/release/examples/ggml_gpu_bench target/kbench/kbench $(BUNDLE)/
	while read -r exe; do name=$$(basename "$$exe"); cp "$$exe" "$(BUNDLE)/$${name%-*}"; done <target/cuda/test-binaries.txt
	strip $(BUNDLE)/*
	ls -la $(BUNDLE)

kbench:
	eval "$$(scripts/cuda-toolchain.sh)" && mkdir -p target/kbench && \
	  nvcc -O3 -std=c++17 -lineinfo -gencode=arch=compute_90a,code=sm_90a -I crates/kernels/csrc \
	  benchmarks/gpu/kbench.cu -L"$$CUDA_HOME/lib" -lcublas -lcublasLt -o target/kbench/kbench

# the test binaries each embed the same kernel modules: one xz stream with a dictionary larger than a
# binary stores them once (~33 MB for ~900 MB)
gpu-pack: gpu-bundle
	mkdir -p target/gpu-pack && tar cf - -C target gpu-bundle | xz -T2 -6 --lzma2=preset=6,dict=1GiB >target/gpu-pack/bundle.txz
	ls -la target/gpu-pack
