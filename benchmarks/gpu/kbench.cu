// Kernel micro-benchmark: times the decode-path kernels of rserve alone on the GPU with CUDA
// events, at the shapes of Llama-3.1-8B and Llama-3.2-1B in bf16, and checks each candidate
// against a plain reference. Weights and caches are spread over enough distinct copies that no
// timed launch finds its operands in L2 (as in a real step, where each layer's weights are new).
//
// Build: make kbench (nvcc, no cargo); run: target/kbench/kbench [sections], sections from
// gemv,step,attn,attn1,attn256,occ,tk,tk256,tk8,tk8one,small,chain,fp8chain,gemm,lt,pchain (default: all
// but attn1, attn256, tk256 and tk8one, which run one case each, with the tensor-core kernel the
// engine picks there, for a profiler).
// Output: one line per measurement.
#include "kernels.cu"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <iterator>
#include <vector>

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));          \
      exit(1);                                                                             \
    }                                                                                      \
  } while (0)

using bf16 = __nv_bfloat16;

// ---------------------------------------------------------------- candidates
// The production GEMV template (csrc/gemv.cu) at other tile shapes, on 16-bit weights (no row
// scales).
template <int M, int R, int U, int NT>
__global__ void __launch_bounds__(NT) gemv_cand(bf16* y, const bf16* x, const void* w,
                                                const float* row_scale, int m, int n, int k) {
  gemv_impl<bf16, DenseW<bf16>, M, R, U, NT>(y, x, w, row_scale, m, n, k);
}

typedef void (*DecodeFn)(bf16*, const bf16*, const bf16*, const bf16*, const uint32_t*,
                         const uint32_t*, const uint32_t*, const uint32_t*, int, int, int, int, int,
                         float, int, long, int, long, float*, float*);
// stages: 0 for the direct kernel, else the tensor-core kernel's depth; warps per CTA of it.
struct Decode {
  const char* name;
  DecodeFn fn;
  int stages;
  int warps;
  // dynamic shared bytes for G = 4, head dim 128, bf16
  int smem() const {
    const int G = 4, D = 128;
    if (stages == 0) return 4 * (G * D + G * 256 + 3 * G + 256);
    return warps * stages * 2 * kTcKeys * (D + 8) * 2;
  }
  dim3 grid(int B, int KVH, int count) const {
    return stages == 0 ? dim3(B, KVH, count) : dim3(KVH, B, count);
  }
  int threads() const { return stages == 0 ? 128 : 32 * warps; }
};
// Occupancy candidates of the tensor-core decode kernel (section `occ`): the same code with at
// least MINB CTAs per SM asked of the register allocator, run with the shared-memory carveout at
// its maximum (the driver's default carveout holds four 2-warp CTAs per SM).
template <int S, int W, int MINB, bool KM = false>
__global__ void __launch_bounds__(32 * W, MINB) tc_occ(PAGED_DECODE_PARAMS(bf16, bf16)) {
  paged_decode_tc_impl<bf16, bf16, 128, S, W, KM>(PAGED_DECODE_ARGS);
}
static const Decode kOcc[] = {{"w2s3c", tc_occ<3, 2, 1>, 3, 2},  {"w2s3c6", tc_occ<3, 2, 6>, 3, 2},
                              {"w2s3c8", tc_occ<3, 2, 8>, 3, 2}, {"w2s4c", tc_occ<4, 2, 1>, 4, 2},
                              {"w2s4c6", tc_occ<4, 2, 6>, 4, 2}, {"w4s3c", tc_occ<3, 4, 1>, 3, 4}};
// The transposed kernel (keys as the mma's rows, section `tk`) at other depths and widths.
static const Decode kTk[] = {{"tk_w2s3", tc_occ<3, 2, 1, true>, 3, 2},
                             {"tk_w2s2", tc_occ<2, 2, 1, true>, 2, 2},
                             {"tk_w2s4", tc_occ<4, 2, 1, true>, 4, 2},
                             {"tk_w1s3", tc_occ<3, 1, 1, true>, 3, 1},
                             {"tk_w1s4", tc_occ<4, 1, 1, true>, 4, 1},
                             {"tk_w4s3", tc_occ<3, 4, 1, true>, 3, 4},
                             {"tk_w4s2", tc_occ<2, 4, 1, true>, 2, 4}};

// The engine's batch-1 decode kernel and its rotary asking for what no earlier kernel writes
// before they wait for the kernel before them (their EARLY forms; section chain): the attention's
// is the engine's paged_decode_tk_early_w4_d128_bf16 (csrc/decode_tc.cu).
static const auto tk_w4_early = paged_decode_tk_early_w4_d128_bf16;
// The rotary's other forms: reads ahead of its wait (EARLY), lets the attention launch only after
// its wait (LATE_TRIGGER).
template <bool EARLY, bool LATE_TRIGGER>
__global__ void rotary_cand(bf16* qkv, const uint32_t* positions, const bf16* cos, const bf16* sin,
                            int heads, int kv_heads, int head_dim, long row_stride, bf16* k_cache,
                            bf16* v_cache, const int64_t* slots, float k_inv, float v_inv) {
  rotary_qk_cache_impl<bf16, bf16, EARLY, LATE_TRIGGER>(qkv, positions, cos, sin, heads, kv_heads,
                                                        head_dim, row_stride, k_cache, v_cache,
                                                        slots, k_inv, v_inv);
}

static const Decode kDecodes[] = {{"direct", paged_decode_g4_bf16, 0, 0},
                                  {"tc_w4", paged_decode_tc_w4_d128_bf16, 3, 4},
                                  {"tc_w2", paged_decode_tc_w2_d128_bf16, 3, 2},
                                  {"tk_w4", paged_decode_tk_w4_d128_bf16, 3, 4},
                                  {"tk_w2", paged_decode_tk_w2_d128_bf16, 3, 2}};

__global__ void gemv_reference(float* y, const bf16* x, const bf16* w, int m, int n, int k) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= n) return;
  for (int i = 0; i < m; ++i) {
    double s = 0;
    for (int c = 0; c < k; ++c)
      s += (double)__bfloat162float(x[(size_t)i * k + c]) * __bfloat162float(w[(size_t)row * k + c]);
    y[(size_t)i * n + row] = (float)s;
  }
}

// A hashed value in [-scale / 2, scale / 2] for element i.
__device__ __forceinline__ float hashed(size_t i, uint32_t seed, float scale) {
  uint32_t h = (uint32_t)(i * 2654435761u) ^ seed;
  h ^= h >> 13;
  h *= 0x5bd1e995u;
  h ^= h >> 15;
  return ((h & 0xffff) / 65535.f - 0.5f) * scale;
}

__global__ void fill(bf16* p, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = __float2bfloat16(hashed(i, seed, scale));
}

// ---------------------------------------------------------------- harness
struct Timer {
  cudaEvent_t a, b;
  Timer() {
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
  }
  void start() { CK(cudaEventRecord(a)); }
  float stop_ms() {
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    CK(cudaGetLastError());
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    return ms;
  }
};

static bf16* alloc_bf16(size_t n, uint32_t seed, float scale) {
  bf16* p;
  CK(cudaMalloc(&p, n * sizeof(bf16)));
  fill<<<1024, 256>>>(p, n, seed, scale);
  CK(cudaGetLastError());
  return p;
}

// y, x, W, W's row scales (null for 16-bit W), m, n, k: the production kernels' arguments.
typedef void (*GemvFn)(bf16*, const bf16*, const void*, const float*, int, int, int);

// Launches any kernel on `st`, as a programmatic dependent of the kernel before it when `dep`
// (as the engine launches every kernel of a step), else as a plain launch.
template <typename... P, typename... A>
static void launch_on(cudaStream_t st, bool dep, void (*fn)(P...), dim3 grid, dim3 block,
                      size_t smem, A... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = dep ? 1 : 0;
  CK(cudaLaunchKernelEx(&cfg, fn, static_cast<P>(args)...));
}
static cublasHandle_t g_cublas;
// A kernel, or cuBLAS (fn null): y [m, n] = x [m, k] W^T with W [n, k] row-major.
struct Gemv {
  std::string name;
  GemvFn fn;
  int rows_per_cta, threads, max_m;
  void launch(bf16* y, const bf16* x, const bf16* w, int m, int n, int k) const {
    if (fn) {
      fn<<<(n + rows_per_cta - 1) / rows_per_cta, threads>>>(y, x, w, nullptr, m, n, k);
      return;
    }
    const float one = 1.f, zero = 0.f;
    const cublasStatus_t st =
        cublasGemmEx(g_cublas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w, CUDA_R_16BF, k, x,
                     CUDA_R_16BF, k, &zero, y, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) {
      fprintf(stderr, "cublasGemmEx: %d\n", (int)st);
      exit(1);
    }
  }
};

template <int M, int R, int U, int NT>
Gemv cand() {
  char name[64];
  snprintf(name, sizeof name, "cta_m%d_r%d_u%d_t%d", M, R, U, NT);
  return {name, gemv_cand<M, R, U, NT>, R, NT, M};
}

struct Shape {
  const char* name;
  int n, k;
};

static const Shape kShapes8b[] = {{"8b.qkv", 6144, 4096},
                                  {"8b.o", 4096, 4096},
                                  {"8b.gate_up", 28672, 4096},
                                  {"8b.down", 4096, 14336},
                                  {"8b.lm_head", 128256, 4096}};
static const Shape kShapes1b[] = {{"1b.qkv", 3072, 2048},
                                  {"1b.o", 2048, 2048},
                                  {"1b.gate_up", 16384, 2048},
                                  {"1b.down", 2048, 8192},
                                  {"1b.lm_head", 128256, 2048}};

template <int M>
static void add_cands(std::vector<Gemv>& v) {
  v.push_back(cand<M, 2, 2, 256>());
  v.push_back(cand<M, 4, 1, 256>());
  v.push_back(cand<M, 4, 2, 256>());
  v.push_back(cand<M, 8, 1, 256>());
  v.push_back(cand<M, 2, 2, 128>());
  v.push_back(cand<M, 4, 2, 128>());
}

static std::vector<Gemv> variants(int m) {
  std::vector<Gemv> v;
  switch (m) {
    case 1:
      v.push_back({"prod_m1", gemv_m1_bf16, 4, 256, 1});
      add_cands<1>(v);
      break;
    case 2:
      v.push_back({"prod_m2", gemv_m2_bf16, 4, 256, 2});
      add_cands<2>(v);
      break;
    case 4:
      v.push_back({"prod_m4", gemv_m4_bf16, 4, 128, 4});
      add_cands<4>(v);
      break;
    default:
      add_cands<8>(v);
  }
  v.push_back({"cublas", nullptr, 0, 0, 64});
  return v;
}

// Whether the comma-separated list `sections` (null: every section) names `s`.
static bool want(const char* sections, const char* s) {
  if (!sections)
    return strcmp(s, "attn1") != 0 && strcmp(s, "attn256") != 0 && strcmp(s, "tk256") != 0 &&
           strcmp(s, "tk8one") != 0;
  const std::string list = std::string(",") + sections + ",";
  return list.find(std::string(",") + s + ",") != std::string::npos;
}

// Each variant on each shape: mean time per launch over many launches that cycle through
// enough weight copies (>= 2 GB) to defeat L2; max error against the f64 reference.
static void bench_gemv(int m) {
  const size_t pool_elems = (size_t)2300 << 20;  // 4.6 GB of bf16
  bf16* pool = alloc_bf16(pool_elems, 1, 0.05f);
  bf16* x = alloc_bf16((size_t)8 * 16384, 2, 1.0f);
  bf16* y;
  CK(cudaMalloc(&y, (size_t)8 * 128256 * sizeof(bf16)));
  float* yref;
  CK(cudaMalloc(&yref, (size_t)8 * 128256 * sizeof(float)));
  std::vector<float> ref(8 * 128256);
  std::vector<bf16> got(8 * 128256);
  Timer t;
  for (const auto* shapes : {kShapes8b, kShapes1b}) {
    for (int si = 0; si < 5; ++si) {
      const Shape s = shapes[si];
      const size_t elems = (size_t)s.n * s.k;
      const int copies = (int)std::min<size_t>(64, pool_elems / elems);
      gemv_reference<<<(s.n + 127) / 128, 128>>>(yref, x, pool, m, s.n, s.k);
      CK(cudaMemcpy(ref.data(), yref, (size_t)m * s.n * 4, cudaMemcpyDeviceToHost));
      double ref_max = 0;
      for (int i = 0; i < m * s.n; ++i) ref_max = std::max(ref_max, (double)fabsf(ref[i]));
      for (const Gemv& g : variants(m)) {
        g.launch(y, x, pool, m, s.n, s.k);
        CK(cudaMemcpy(got.data(), y, (size_t)m * s.n * 2, cudaMemcpyDeviceToHost));
        double err = 0;
        for (int i = 0; i < m * s.n; ++i)
          err = std::max(err, (double)fabsf(__bfloat162float(got[i]) - ref[i]));
        const int reps = std::max(3, 512 / copies);
        for (int c = 0; c < copies; ++c) g.launch(y, x, pool + (size_t)c * elems, m, s.n, s.k);
        t.start();
        for (int r = 0; r < reps; ++r)
          for (int c = 0; c < copies; ++c) g.launch(y, x, pool + (size_t)c * elems, m, s.n, s.k);
        const double us = t.stop_ms() * 1e3 / (reps * copies);
        printf("gemv m=%d %-11s %-20s %8.2f us %6.2f TB/s  err %.2e of %.2e\n", m, s.name,
               g.name.c_str(), us, elems * 2 / us / 1e6, err, ref_max);
      }
    }
  }
  CK(cudaFree(pool));
  CK(cudaFree(x));
  CK(cudaFree(y));
  CK(cudaFree(yref));
}

// The 8B decode step's weight products at batch 1 (32 layers of qkv, o, gate_up, down, distinct
// weights, then the LM head), each variant for every product, and the best per product.
static void bench_step() {
  const Shape* s = kShapes8b;
  size_t layer = 0;
  for (int i = 0; i < 4; ++i) layer += (size_t)s[i].n * s[i].k;
  const size_t total = 32 * layer + (size_t)s[4].n * s[4].k;
  bf16* w = alloc_bf16(total, 3, 0.05f);
  bf16* x = alloc_bf16(16384, 4, 1.0f);
  bf16* y;
  CK(cudaMalloc(&y, (size_t)128256 * sizeof(bf16)));
  Timer t;
  auto run = [&](const std::vector<const Gemv*>& pick) {
    bf16* p = w;
    for (int l = 0; l < 32; ++l)
      for (int i = 0; i < 4; ++i) {
        pick[i]->launch(y, x, p, 1, s[i].n, s[i].k);
        p += (size_t)s[i].n * s[i].k;
      }
    pick[4]->launch(y, x, p, 1, s[4].n, s[4].k);
  };
  const auto vs = variants(1);
  std::vector<std::vector<double>> per(5);
  for (const Gemv& g : vs) {
    std::vector<const Gemv*> pick(5, &g);
    run(pick);
    t.start();
    for (int r = 0; r < 5; ++r) run(pick);
    const double ms = t.stop_ms() / 5;
    printf("step8b gemv b1 %-20s %7.3f ms %6.2f TB/s\n", g.name.c_str(), ms, total * 2 / ms / 1e9);
  }
  CK(cudaFree(w));
  CK(cudaFree(x));
  CK(cudaFree(y));
}

// Decode attention (8B: 32 query heads, 8 KV heads, head dim 128, blocks of 16) for a batch of
// sequences of ctx keys, with the engine's split rule, then the split merge.
// Key slices per sequence (1: no split); the kernel cuts each context into that many slices of at
// least kMinSplitKeys keys.
constexpr int kMinSplitKeys = 64;
static int decode_splits(int ctas, int ctx, int sms) {
  if (ctas >= 2 * sms) return 1;
  return std::max(1, std::min((2 * sms + ctas - 1) / ctas, ctx / kMinSplitKeys));
}

// The decode kernels' metadata on the device for B sequences of ctx keys, each its own run of
// `width` blocks: block tables, lengths, query starts (one token each) and the sequence list.
static void decode_metadata(int B, int ctx, int width, uint32_t*& dt, uint32_t*& dl, uint32_t*& ds,
                            uint32_t*& dq) {
  std::vector<uint32_t> tables((size_t)B * width), lens(B, ctx), starts(B + 1), seqs(B);
  for (int b = 0; b < B; ++b) {
    for (int j = 0; j < width; ++j) tables[(size_t)b * width + j] = b * width + j;
    starts[b] = b;
    seqs[b] = b;
  }
  starts[B] = B;
  CK(cudaMalloc(&dt, tables.size() * 4));
  CK(cudaMalloc(&dl, B * 4));
  CK(cudaMalloc(&ds, (B + 1) * 4));
  CK(cudaMalloc(&dq, B * 4));
  CK(cudaMemcpy(dt, tables.data(), tables.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dl, lens.data(), B * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(ds, starts.data(), (B + 1) * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dq, seqs.data(), B * 4, cudaMemcpyHostToDevice));
}

static void bench_attn_case(int B, int ctx, int forced_split, int sms, const Decode& dk = kDecodes[0]) {
  const int H = 32, KVH = 8, D = 128, BS = 16;
  const int width = (ctx + BS - 1) / BS;
  const size_t slots = (size_t)B * width * BS;
  const size_t layer_elems = slots * KVH * D;
  const int layers = (int)std::max<size_t>(2, std::min<size_t>(32, ((size_t)2 << 30) / (layer_elems * 4)));
  bf16* k = alloc_bf16(layer_elems * layers, 5, 1.0f);
  bf16* v = alloc_bf16(layer_elems * layers, 6, 1.0f);
  bf16* q = alloc_bf16((size_t)B * H * D, 7, 1.0f);
  bf16* out;
  CK(cudaMalloc(&out, (size_t)B * H * D * 2));
  uint32_t *dt, *dl, *ds, *dq;
  decode_metadata(B, ctx, width, dt, dl, ds, dq);
  // forced_split: keys per slice (0: no split)
  const int count = forced_split >= 0 ? (forced_split > 0 ? (ctx + forced_split - 1) / forced_split : 1)
                                      : decode_splits(B * KVH, ctx, sms);
  const int split = count > 1 ? std::max(kMinSplitKeys, forced_split) : 0;
  const long rows = (long)B * H;
  float *acc, *ml;
  CK(cudaMalloc(&acc, (size_t)count * rows * D * 4));
  CK(cudaMalloc(&ml, (size_t)count * rows * 2 * 4));
  const float scale = 1.f / sqrtf((float)D);
  const dim3 grid = dk.grid(B, KVH, count);
  auto attn = [&](int l) {
    dk.fn<<<grid, dk.threads(), dk.smem()>>>(
        out, q, k + (size_t)l * layer_elems, v + (size_t)l * layer_elems, dt, dl, ds, dq, width,
        H, KVH, D, BS, scale, 0, (long)H * D, split, rows, acc, ml);
  };
  auto merge = [&]() {
    if (count > 1) paged_attention_combine_bf16<<<rows, 128>>>(out, acc, ml, count, rows, D);
  };
  Timer t;
  const int reps = std::max(4, 256 / layers);
  auto time = [&](auto&& f) {
    for (int l = 0; l < layers; ++l) f(l);
    t.start();
    for (int r = 0; r < reps; ++r)
      for (int l = 0; l < layers; ++l) f(l);
    return t.stop_ms() * 1e3 / (reps * layers);
  };
  const double us_attn = time([&](int l) { attn(l); });
  const double us_merge = time([&](int) { merge(); });
  const double us_both = time([&](int l) {
    attn(l);
    merge();
  });
  // error against the direct kernel on layer 0
  float err = 0.f;
  {
    const size_t n = (size_t)B * H * D;
    std::vector<bf16> mine(n), ref(n);
    attn(0);
    merge();
    CK(cudaMemcpy(mine.data(), out, n * 2, cudaMemcpyDeviceToHost));
    const Decode& p = kDecodes[0];
    p.fn<<<dim3(B, KVH, count), 128, p.smem()>>>(out, q, k, v, dt, dl, ds, dq, width, H, KVH, D, BS,
                                                  scale, 0, (long)H * D, split, rows, acc, ml);
    merge();
    CK(cudaMemcpy(ref.data(), out, n * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; ++i)
      err = std::max(err, std::fabs(__bfloat162float(mine[i]) - __bfloat162float(ref[i])));
  }
  const double bytes = 2.0 * B * ctx * KVH * D * 2;
  printf("attn %-6s b=%-3d ctx=%-5d split=%-4d (x%-3d) kernel %8.2f us  merge %6.2f us  both %8.2f us"
         "  %6.0f GB/s  err %.2e\n",
         dk.name, B, ctx, split, count, us_attn, us_merge, us_both, bytes / us_both / 1e3, err);
  for (void* p : {(void*)k, (void*)v, (void*)q, (void*)out, (void*)dt, (void*)dl, (void*)ds,
                  (void*)dq, (void*)acc, (void*)ml})
    CK(cudaFree(p));
}

static void bench_attn(int sms) {
  for (int split : {-1, 0, 32, 64, 128, 256}) bench_attn_case(1, 768, split, sms);
  for (const Decode& dk : kDecodes) {
    bench_attn_case(1, 768, -1, sms, dk);
    bench_attn_case(1, 4096, -1, sms, dk);
    for (int B : {8, 64, 128, 256}) bench_attn_case(B, 768, -1, sms, dk);
    bench_attn_case(256, 577, -1, sms, dk);
    bench_attn_case(64, 4096, -1, sms, dk);
  }
}

// Each candidate with the shared-memory carveout at its maximum: its registers and CTAs per SM,
// then the decode cases of bench_attn.
template <size_t N>
static void bench_occ(const Decode (&list)[N], int sms) {
  for (const Decode& dk : list) {
    CK(cudaFuncSetAttribute(dk.fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            std::max(dk.smem(), 48 << 10)));
    CK(cudaFuncSetAttribute(dk.fn, cudaFuncAttributePreferredSharedMemoryCarveout,
                            cudaSharedmemCarveoutMaxShared));
    cudaFuncAttributes fa;
    CK(cudaFuncGetAttributes(&fa, dk.fn));
    int blocks = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, dk.fn, dk.threads(), dk.smem()));
    printf("occ %-7s %d registers, %zu local bytes, %d CTAs per SM\n", dk.name, fa.numRegs,
           fa.localSizeBytes, blocks);
    for (int B : {1, 8, 64, 128, 256}) bench_attn_case(B, 768, -1, sms, dk);
    bench_attn_case(256, 577, -1, sms, dk);
    bench_attn_case(64, 4096, -1, sms, dk);
  }
}

// FP8 caches (section `tk8`): the transposed tensor-core kernel over E4M3 caches at other depths,
// widths and CTAs per SM, against the direct kernel on the same bytes. GB/s counts the cache bytes
// read (one byte a value).
typedef void (*Decode8Fn)(PAGED_DECODE_PARAMS(bf16, e4m3));
template <int S, int W, int MINB>
__global__ void __launch_bounds__(32 * W, MINB) tk8_occ(PAGED_DECODE_PARAMS(bf16, e4m3)) {
  paged_decode_tc_impl<bf16, e4m3, 128, S, W, true>(PAGED_DECODE_ARGS);
}
struct Decode8 {
  const char* name;
  Decode8Fn fn;
  int stages;  // 0: the direct kernel
  int warps;
  int smem() const {
    const int G = 4, D = 128;
    if (stages == 0) return 4 * (G * D + G * 256 + 3 * G + 256);
    return warps * stages * 2 * kTcKeys * D;
  }
};
static const Decode8 kTk8[] = {{"tk8_w2s3", tk8_occ<3, 2, 1>, 3, 2}, {"tk8_w2s4", tk8_occ<4, 2, 1>, 4, 2},
                               {"tk8_w2s6", tk8_occ<6, 2, 1>, 6, 2}, {"tk8_w4s3", tk8_occ<3, 4, 1>, 3, 4},
                               {"tk8_w4s4", tk8_occ<4, 4, 1>, 4, 4}, {"tk8_w1s4", tk8_occ<4, 1, 1>, 4, 1},
                               {"tk8_w1s6", tk8_occ<6, 1, 1>, 6, 1}, {"tk8_w2s3c6", tk8_occ<3, 2, 6>, 3, 2},
                               {"tk8_w2s3c8", tk8_occ<3, 2, 8>, 3, 2}, {"tk8_w2s4c8", tk8_occ<4, 2, 8>, 4, 2}};
static const Decode8 kDirect8 = {"direct8", paged_decode_g4_bf16_fp8, 0, 0};

__global__ void fill_e4m3(e4m3* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i].bits = f32_to_e4m3(hashed(i, seed, 4.f));
}

static void bench_attn8_case(int B, int ctx, int sms, const Decode8& dk) {
  const int H = 32, KVH = 8, D = 128, BS = 16;
  const int width = (ctx + BS - 1) / BS;
  const size_t slots = (size_t)B * width * BS;
  const size_t layer_elems = slots * KVH * D;
  const int layers = (int)std::max<size_t>(2, std::min<size_t>(32, ((size_t)2 << 30) / (layer_elems * 2)));
  e4m3 *k, *v;
  CK(cudaMalloc(&k, layer_elems * layers));
  CK(cudaMalloc(&v, layer_elems * layers));
  fill_e4m3<<<1024, 256>>>(k, layer_elems * layers, 5);
  fill_e4m3<<<1024, 256>>>(v, layer_elems * layers, 6);
  bf16* q = alloc_bf16((size_t)B * H * D, 7, 1.0f);
  bf16* out;
  CK(cudaMalloc(&out, (size_t)B * H * D * 2));
  uint32_t *dt, *dl, *ds, *dq;
  decode_metadata(B, ctx, width, dt, dl, ds, dq);
  const int count = decode_splits(B * KVH, ctx, sms);
  const int split = count > 1 ? kMinSplitKeys : 0;
  const long rows = (long)B * H;
  float *acc, *ml;
  CK(cudaMalloc(&acc, (size_t)count * rows * D * 4));
  CK(cudaMalloc(&ml, (size_t)count * rows * 2 * 4));
  const float scale = 1.f / sqrtf((float)D);
  auto launch = [&](const Decode8& d, int l) {
    const dim3 grid = d.stages == 0 ? dim3(B, KVH, count) : dim3(KVH, B, count);
    d.fn<<<grid, d.stages == 0 ? 128 : 32 * d.warps, d.smem()>>>(
        out, q, k + (size_t)l * layer_elems, v + (size_t)l * layer_elems, dt, dl, ds, dq, width, H,
        KVH, D, BS, scale, 0, (long)H * D, split, rows, acc, ml);
    if (count > 1) paged_attention_combine_bf16<<<rows, 128>>>(out, acc, ml, count, rows, D);
  };
  Timer t;
  const int reps = std::max(4, 256 / layers);
  for (int l = 0; l < layers; ++l) launch(dk, l);
  t.start();
  for (int r = 0; r < reps; ++r)
    for (int l = 0; l < layers; ++l) launch(dk, l);
  const double us = t.stop_ms() * 1e3 / (reps * layers);
  const size_t n = (size_t)B * H * D;
  std::vector<bf16> mine(n), ref(n);
  launch(dk, 0);
  CK(cudaMemcpy(mine.data(), out, n * 2, cudaMemcpyDeviceToHost));
  launch(kDirect8, 0);
  CK(cudaMemcpy(ref.data(), out, n * 2, cudaMemcpyDeviceToHost));
  float err = 0.f;
  for (size_t i = 0; i < n; ++i)
    err = std::max(err, std::fabs(__bfloat162float(mine[i]) - __bfloat162float(ref[i])));
  int blocks = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, dk.fn, dk.stages == 0 ? 128 : 32 * dk.warps,
                                                   dk.smem()));
  const double bytes = 2.0 * B * ctx * KVH * D;
  printf("attn8 %-10s b=%-3d ctx=%-5d x%-3d %d CTAs/SM  %8.2f us  %6.0f GB/s  err %.2e\n", dk.name, B,
         ctx, count, blocks, us, bytes / us / 1e3, err);
  for (void* p : {(void*)k, (void*)v, (void*)q, (void*)out, (void*)dt, (void*)dl, (void*)ds,
                  (void*)dq, (void*)acc, (void*)ml})
    CK(cudaFree(p));
}

static void bench_tk8(int sms, bool one) {
  for (const Decode8& dk : kTk8) {
    CK(cudaFuncSetAttribute(dk.fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            std::max(dk.smem(), 48 << 10)));
    CK(cudaFuncSetAttribute(dk.fn, cudaFuncAttributePreferredSharedMemoryCarveout,
                            cudaSharedmemCarveoutMaxShared));
  }
  if (one) {  // the engine's choice at 256 sequences, for a profiler
    bench_attn8_case(256, 768, sms, kTk8[0]);
    return;
  }
  for (int B : {256, 64}) {
    bench_attn_case(B, 768, -1, sms, kDecodes[4]);  // 16-bit cache beside
    for (const Decode8& dk : kTk8) bench_attn8_case(B, 768, sms, dk);
  }
  bench_attn_case(256, 577, -1, sms, kDecodes[4]);
  for (const Decode8& dk : kTk8) bench_attn8_case(256, 577, sms, dk);
  bench_attn_case(64, 4096, -1, sms, kDecodes[4]);
  for (const Decode8& dk : kTk8) bench_attn8_case(64, 4096, sms, dk);
  bench_attn8_case(256, 768, sms, kDirect8);
}

// Batch-1 element-wise kernels as the 8B layer launches them, 64 launches in a row each.
static void bench_small() {
  const int hidden = 4096, inter = 14336, D = 128, H = 32, KVH = 8;
  bf16* a = alloc_bf16((size_t)2 * inter, 8, 1.0f);
  bf16* b = alloc_bf16((size_t)2 * inter, 9, 1.0f);
  bf16* o = alloc_bf16((size_t)2 * inter, 10, 1.0f);
  bf16* w = alloc_bf16(hidden, 11, 1.0f);
  bf16* qkv = alloc_bf16((size_t)(H + 2 * KVH) * D, 12, 1.0f);
  bf16* cs = alloc_bf16((size_t)8192 * D / 2, 13, 1.0f);
  bf16* cache = alloc_bf16((size_t)4096 * KVH * D, 14, 1.0f);
  uint32_t* pos;
  CK(cudaMalloc(&pos, 4));
  CK(cudaMemset(pos, 0, 4));
  int64_t* slot;
  CK(cudaMalloc(&slot, 8));
  CK(cudaMemset(slot, 0, 8));
  Timer t;
  auto time = [&](const char* name, auto&& f) {
    f();
    t.start();
    for (int i = 0; i < 64; ++i) f();
    printf("small %-18s %6.2f us per launch\n", name, t.stop_ms() * 1e3 / 64);
  };
  time("add_rms_norm", [&] { add_rms_norm_bf16<<<1, 1024>>>(o, a, b, w, 1, hidden, 1e-5f); });
  time("rotary_qk", [&] {
    rotary_qk_bf16<<<1, 512>>>(qkv, pos, cs, cs, H + KVH, D, (long)(H + 2 * KVH) * D);
  });
  // the cache writes' FP8 factors (1 / the layer's scale) are 1 for a 16-bit cache
  time("reshape_and_cache", [&] {
    reshape_and_cache_bf16<<<1, 256>>>(cache, qkv + (H * D), slot, KVH * D, (long)(H + 2 * KVH) * D,
                                       1.f);
  });
  time("rotary_qk_cache", [&] {
    rotary_qk_cache_bf16<<<1, 1024>>>(qkv, pos, cs, cs, H, KVH, D, (long)(H + 2 * KVH) * D, cache,
                                      cache + (size_t)2048 * KVH * D, slot, 1.f, 1.f);
  });
  time("silu_and_mul", [&] {
    silu_and_mul_bf16<<<(inter + 255) / 256, 256>>>(o, a, (long)inter, inter);
  });
  time("empty(1 CTA)", [&] { reshape_and_cache_bf16<<<1, 32>>>(cache, qkv, slot, 0, 0, 1.f); });
  for (void* p : {(void*)a, (void*)b, (void*)o, (void*)w, (void*)qkv, (void*)cs, (void*)cache,
                  (void*)pos, (void*)slot})
    CK(cudaFree(p));
}

// The whole batch-1 decode step of the 8B shape on the device, kernel for kernel as the engine
// launches it (32 layers of: add + RMSNorm, qkv product, rotary with the K and V cache writes,
// decode attention with its split merge, o product, add + RMSNorm, gate-up product, SiLU-and-mul, down
// product; then the LM head), issued to a stream and replayed from a CUDA graph: the difference
// is what launch gaps cost. The modes after the first three launch every kernel as a dependent,
// as the engine does: the engine's kernels, then candidate forms of the rotary and the attention
// (reads ahead of their waits, the attention launched only after the qkv product), then the same
// chain with one kernel kind left out at a time (rotary, the split merge, the whole attention
// chain, everything but the products): the differences are what each costs the graph. Before
// the timings, the candidates' output is checked bit for bit against the engine's kernels.
static void bench_chain(int sms) {
  const int hidden = 4096, inter = 14336, H = 32, KVH = 8, D = 128, BS = 16, ctx = 768;
  const int qkv_n = (H + 2 * KVH) * D, vocab = 128256;
  const size_t per_layer = (size_t)qkv_n * hidden + (size_t)hidden * H * D +
                           (size_t)2 * inter * hidden + (size_t)hidden * inter;
  bf16* w = alloc_bf16(32 * per_layer + (size_t)vocab * hidden, 20, 0.05f);
  const int width = ctx / BS;
  const size_t cache_layer = (size_t)width * BS * KVH * D;
  bf16* kc = alloc_bf16(32 * cache_layer, 21, 1.0f);
  bf16* vc = alloc_bf16(32 * cache_layer, 22, 1.0f);
  bf16* x = alloc_bf16(hidden, 23, 1.0f);
  bf16* res = alloc_bf16(hidden, 24, 1.0f);
  bf16* norm = alloc_bf16(2 * hidden, 25, 1.0f);
  bf16* nw = alloc_bf16(hidden, 26, 1.0f);
  bf16* qkv = alloc_bf16(qkv_n, 27, 1.0f);
  bf16* att = alloc_bf16(H * D, 28, 1.0f);
  bf16* gu = alloc_bf16(2 * inter, 29, 1.0f);
  bf16* act = alloc_bf16(inter, 30, 1.0f);
  bf16* logits = alloc_bf16(vocab, 31, 1.0f);
  bf16* cs = alloc_bf16((size_t)8192 * D / 2, 32, 1.0f);
  std::vector<uint32_t> tables(width);
  for (int j = 0; j < width; ++j) tables[j] = j;
  uint32_t *dt, *dl, *ds, *dq, *pos;
  int64_t* slot;
  CK(cudaMalloc(&dt, width * 4));
  CK(cudaMalloc(&dl, 4));
  CK(cudaMalloc(&ds, 8));
  CK(cudaMalloc(&dq, 4));
  CK(cudaMalloc(&pos, 4));
  CK(cudaMalloc(&slot, 8));
  CK(cudaMemcpy(dt, tables.data(), width * 4, cudaMemcpyHostToDevice));
  const uint32_t len = ctx, starts[2] = {0, 1}, zero = 0, p = ctx - 1;
  const int64_t sl = ctx - 1;
  CK(cudaMemcpy(dl, &len, 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(ds, starts, 8, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dq, &zero, 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(pos, &p, 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(slot, &sl, 8, cudaMemcpyHostToDevice));
  const int count = decode_splits(KVH, ctx, sms);
  const int split = kMinSplitKeys;
  float *acc, *ml;
  CK(cudaMalloc(&acc, (size_t)count * H * D * 4));
  CK(cudaMalloc(&ml, (size_t)count * H * 2 * 4));
  // the kernel the engine picks here: keys as the products' rows, 4 warps (8 x count CTAs)
  const Decode& attn_k = kDecodes[3];
  const int tc_smem = attn_k.smem();
  CK(cudaFuncSetAttribute(attn_k.fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          std::max(tc_smem, 48 << 10)));
  const float scale = 1.f / sqrtf((float)D);
  const Gemv g1 = {"prod_m1", gemv_m1_bf16, 4, 256, 1};
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  CK(cudaFuncSetAttribute(tk_w4_early, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          std::max(tc_smem, 48 << 10)));
  // A mode: which launches are dependents, and which kernels between the products run.
  struct Mode {
    const char* name;
    bool pdl, glu, all_dep, rotary, attention, merge, norms, early_attention, early_rotary,
        late_trigger, plain_attention, attention_w2;
  };
  const Decode& attn_w2 = kDecodes[4];  // the 2-warp form: half the shared memory
  CK(cudaFuncSetAttribute(attn_w2.fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          std::max(attn_w2.smem(), 48 << 10)));
  const Mode modes[] = {
      {"plain", false, false, false, true, true, true, true},
      {"pdl (products)", true, false, false, true, true, true, true},
      {"pdl+glu (products)", true, true, false, true, true, true, true},
      {"all dependents", true, true, true, true, true, true, true},
      {"all dep, early attention", true, true, true, true, true, true, true, true, false},
      {"all dep, early attention + rotary", true, true, true, true, true, true, true, true, true},
      {"all dep, rotary triggers late", true, true, true, true, true, true, true, false, false,
       true},
      {"all dep, early both, late trigger", true, true, true, true, true, true, true, true, true,
       true},
      {"all dep but the attention", true, true, true, true, true, true, true, false, false, false,
       true},
      {"all dep, 2-warp attention", true, true, true, true, true, true, true, false, false, false,
       false, true},
      {"all dep, no rotary", true, true, true, false, true, true, true},
      {"all dep, no merge", true, true, true, true, true, false, true},
      {"all dep, no rotary, no merge", true, true, true, false, true, false, true},
      {"all dep, no attention chain", true, true, true, false, false, false, true},
      {"products only", true, true, true, false, false, false, false},
  };
  Mode m = modes[0];
  // n: rows of W; the GLU form writes n / 2 outputs
  auto launch = [&](GemvFn fn, int outs, bf16* y, const bf16* in, const bf16* wt, int n, int k) {
    launch_on(st, m.pdl, fn, dim3((outs + 3) / 4), dim3(256), 0, y, in, wt, (const float*)nullptr,
              1, n, k);
  };
  auto gemv = [&](bf16* y, const bf16* in, const bf16* wt, int n, int k) {
    launch(g1.fn, n, y, in, wt, n, k);
  };
  // rotary (its EARLY / LATE_TRIGGER forms), the attention (kernel, threads, shared bytes) and
  // the split merge of one layer's caches
  auto rotary = [&](bool dep, bool early, bool late, bf16* kl, bf16* vl) {
    launch_on(st, dep,
              early ? (late ? rotary_cand<true, true> : rotary_cand<true, false>)
                    : (late ? rotary_cand<false, true> : rotary_qk_cache_bf16),
              dim3(1), dim3(1024), 0, qkv, (const uint32_t*)pos, (const bf16*)cs, (const bf16*)cs,
              H, KVH, D, (long)qkv_n, kl, vl, (const int64_t*)slot, 1.f, 1.f);
  };
  auto attention = [&](bool dep, DecodeFn fn, int threads, int smem, const bf16* kl,
                       const bf16* vl) {
    launch_on(st, dep, fn, attn_k.grid(1, KVH, count), dim3(threads), smem, att,
              (const bf16*)qkv, kl, vl, (const uint32_t*)dt, (const uint32_t*)dl,
              (const uint32_t*)ds, (const uint32_t*)dq, width, H, KVH, D, BS, scale, 0,
              (long)qkv_n, split, (long)H, acc, ml);
  };
  auto merge = [&](bool dep) {
    if (count > 1)
      launch_on(st, dep, paged_attention_combine_bf16, dim3(H), dim3(128), 0, att,
                (const float*)acc, (const float*)ml, count, (long)H, D);
  };
  auto norm_k = [&]() {
    if (m.norms)
      launch_on(st, m.all_dep, add_rms_norm_bf16, dim3(1), dim3(1024), 0, norm, (const bf16*)x,
                (const bf16*)res, (const bf16*)nw, 1, hidden, 1e-5f);
  };
  auto step = [&]() {
    const bf16* wp = w;
    for (int l = 0; l < 32; ++l) {
      norm_k();
      gemv(qkv, norm + hidden, wp, qkv_n, hidden);
      wp += (size_t)qkv_n * hidden;
      bf16* kl = kc + l * cache_layer;
      bf16* vl = vc + l * cache_layer;
      if (m.rotary) rotary(m.all_dep, m.early_rotary, m.late_trigger, kl, vl);
      if (m.attention) {
        const Decode& k = m.attention_w2 ? attn_w2 : attn_k;
        attention(m.all_dep && !m.plain_attention, m.early_attention ? tk_w4_early : k.fn,
                  k.threads(), m.attention_w2 ? k.smem() : tc_smem, kl, vl);
      }
      if (m.merge) merge(m.all_dep);
      gemv(x, att, wp, hidden, H * D);
      wp += (size_t)hidden * H * D;
      norm_k();
      if (m.glu) {
        launch(gemv_glu_m1_bf16, inter, act, norm + hidden, wp, 2 * inter, hidden);
      } else {
        gemv(gu, norm + hidden, wp, 2 * inter, hidden);
        launch_on(st, m.all_dep, silu_and_mul_bf16, dim3((inter + 255) / 256), dim3(256), 0, act,
                  (const bf16*)gu, (long)inter, inter);
      }
      wp += (size_t)2 * inter * hidden;
      gemv(x, act, wp, hidden, inter);
      wp += (size_t)hidden * inter;
    }
    gemv(logits, norm + hidden, wp, vocab, hidden);
  };
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  auto timed = [&](auto&& f, int reps) {
    f();
    CK(cudaStreamSynchronize(st));
    CK(cudaGetLastError());
    CK(cudaEventRecord(a, st));
    for (int r = 0; r < reps; ++r) f();
    CK(cudaEventRecord(b, st));
    CK(cudaEventSynchronize(b));
    CK(cudaGetLastError());
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    return ms / reps;
  };
  const double weights = (32 * per_layer + (size_t)vocab * hidden) * 2.0;
  printf("chain8b b1: ctx %d, %d key slices, attention %s\n", ctx, count, attn_k.name);
  {
    // the early forms against the engine's on layer 0, each run as the chain runs them (rotary,
    // then the attention and its merge as dependents) from the same q, k and v, with the newest
    // key's cache rows overwritten first: an attention that read them before the rotary wrote
    // them would differ (the same keys in the same order otherwise: the same bits)
    const int n = H * D;
    bf16* saved;
    CK(cudaMalloc(&saved, (size_t)qkv_n * 2));
    CK(cudaMemcpy(saved, qkv, (size_t)qkv_n * 2, cudaMemcpyDeviceToDevice));
    std::vector<bf16> ref(n), got(n);
    for (int early = 0; early < 2; ++early) {
      CK(cudaMemcpyAsync(qkv, saved, (size_t)qkv_n * 2, cudaMemcpyDeviceToDevice, st));
      CK(cudaMemsetAsync(kc + (size_t)(ctx - 1) * KVH * D, 0x7f, (size_t)KVH * D * 2, st));
      CK(cudaMemsetAsync(vc + (size_t)(ctx - 1) * KVH * D, 0x7f, (size_t)KVH * D * 2, st));
      CK(cudaMemsetAsync(att, 0, n * 2, st));
      rotary(true, early, early, kc, vc);
      attention(true, early ? tk_w4_early : attn_k.fn, attn_k.threads(), tc_smem, kc, vc);
      merge(true);
      CK(cudaMemcpyAsync(early ? got.data() : ref.data(), att, n * 2, cudaMemcpyDeviceToHost,
                         st));
    }
    CK(cudaStreamSynchronize(st));
    CK(cudaFree(saved));
    printf("chain8b early rotary and attention: %s the engine's\n",
           memcmp(ref.data(), got.data(), n * 2) == 0 ? "the same bits as" : "DIFFER from");
  }
  // every mode, then the dependents' modes again with each kernel of the chain preferring the
  // largest shared-memory carveout: the attention needs most of an SM's shared memory, the other
  // kernels little, and an SM runs CTAs of one L1/shared split at a time, so with the driver's
  // per-kernel choice the attention's CTAs cannot join the kernels before them on an SM
  const void* chain_fns[] = {(const void*)gemv_m1_bf16, (const void*)gemv_glu_m1_bf16,
                             (const void*)rotary_qk_cache_bf16, (const void*)rotary_cand<true, true>,
                             (const void*)rotary_cand<true, false>,
                             (const void*)rotary_cand<false, true>, (const void*)attn_k.fn,
                             (const void*)tk_w4_early, (const void*)attn_w2.fn,
                             (const void*)paged_attention_combine_bf16,
                             (const void*)add_rms_norm_bf16, (const void*)silu_and_mul_bf16};
  std::vector<Mode> runs(std::begin(modes), std::end(modes));
  const size_t uniform_from = runs.size();
  for (const Mode& mode : modes)
    if (mode.all_dep && mode.rotary && mode.attention && !mode.plain_attention) runs.push_back(mode);
  for (size_t i = 0; i < runs.size(); ++i) {
    if (i == uniform_from)
      for (const void* fn : chain_fns)
        CK(cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout,
                                cudaSharedmemCarveoutMaxShared));
    m = runs[i];
    const std::string label = std::string(i >= uniform_from ? "carveout max, " : "") + m.name;
    const float ms_stream = timed(step, 10);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    step();
    CK(cudaStreamEndCapture(st, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    const float ms_graph = timed([&] { CK(cudaGraphLaunch(exec, st)); }, 20);
    printf("chain8b b1 %-48s stream %.3f ms (%.0f tok/s)  graph %.3f ms (%.0f tok/s)  "
           "weights %.2f GB: %.2f / %.2f TB/s\n",
           label.c_str(), ms_stream, 1e3 / ms_stream, ms_graph, 1e3 / ms_graph, weights / 1e9,
           weights / ms_stream / 1e9, weights / ms_graph / 1e9);
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
  }
  CK(cudaStreamDestroy(st));
  for (void* q : {(void*)w, (void*)kc, (void*)vc, (void*)x, (void*)res, (void*)norm, (void*)nw,
                  (void*)qkv, (void*)att, (void*)gu, (void*)act, (void*)logits, (void*)cs,
                  (void*)dt, (void*)dl, (void*)ds, (void*)dq, (void*)pos, (void*)slot, (void*)acc,
                  (void*)ml})
    CK(cudaFree(q));
}

// cuBLAS on the 8B layer shapes at prompt-chunk sizes: TFLOP/s of x [m, k] W^T (prefill is
// these products; decode at batch 256 is the m = 256 row).
static void bench_gemm() {
  const Gemv blas = {"cublas", nullptr, 0, 0, 1 << 20};
  for (const Shape& s : kShapes8b) {
    if (s.n > 100000) continue;  // the lm_head runs on sampled rows only
    bf16* w = alloc_bf16((size_t)s.n * s.k, 1, 0.02f);
    for (int m : {256, 2048, 8192}) {
      bf16* x = alloc_bf16((size_t)m * s.k, 2, 1.0f);
      bf16* y;
      CK(cudaMalloc(&y, (size_t)m * s.n * sizeof(bf16)));
      blas.launch(y, x, w, m, s.n, s.k);
      Timer t;
      const int reps = 20;
      t.start();
      for (int r = 0; r < reps; ++r) blas.launch(y, x, w, m, s.n, s.k);
      const float us = t.stop_ms() * 1e3f / reps;
      printf("gemm %-12s m=%-5d n=%-6d k=%-6d %9.1f us  %6.1f TFLOP/s\n", s.name, m, s.n, s.k, us,
             2.0 * m * s.n * s.k / us / 1e6);
      CK(cudaFree(x));
      CK(cudaFree(y));
    }
    CK(cudaFree(w));
  }
}

// cuBLAS against cuBLASLt's candidate algorithms (heuristic order, each timed) on the 8B layer
// products at decode-sized m, with the weights rotated over copies so that none is read from L2.
static void bench_lt() {
  cublasLtHandle_t lt;
  if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) {
    fprintf(stderr, "cublasLtCreate failed\n");
    exit(1);
  }
  const size_t ws_bytes = 32u << 20;
  void* ws;
  CK(cudaMalloc(&ws, ws_bytes));
  const Gemv blas = {"cublas", nullptr, 0, 0, 1 << 20};
  for (const Shape& s : kShapes8b) {
    const size_t wn = (size_t)s.n * s.k;
    const int copies = (int)std::max<size_t>(2, std::min<size_t>(16, ((size_t)1 << 30) / (wn * 2)));
    bf16* w = alloc_bf16(wn * copies, 1, 0.02f);
    for (int m : {64, 128, 256, 512, 2048, 8192}) {
      bf16* x = alloc_bf16((size_t)m * s.k, 2, 1.0f);
      bf16* y;
      CK(cudaMalloc(&y, (size_t)m * s.n * sizeof(bf16)));
      Timer t;
      const int reps = 4 * copies;
      auto time = [&](auto&& f) {
        for (int c = 0; c < copies; ++c) f(w + c * wn);
        t.start();
        for (int r = 0; r < reps; ++r) f(w + (r % copies) * wn);
        return t.stop_ms() * 1e3f / reps;
      };
      const float us_blas = time([&](const bf16* wc) { blas.launch(y, x, wc, m, s.n, s.k); });

      cublasLtMatmulDesc_t op;
      cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
      const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
      cublasLtMatrixLayout_t la, lb, lc;
      cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, s.k, s.n, s.k);
      cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, s.k, m, s.k);
      cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, s.n, m, s.n);
      cublasLtMatmulPreference_t pref;
      cublasLtMatmulPreferenceCreate(&pref);
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                           sizeof ws_bytes);
      cublasLtMatmulHeuristicResult_t res[32];
      int found = 0;
      cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 32, res, &found);
      float best = 1e30f, first = 0.f;
      int best_i = -1;
      for (int i = 0; i < found; ++i) {
        if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
        const float one = 1.f, zero = 0.f;
        bool ok = true;
        const float us = time([&](const bf16* wc) {
          if (cublasLtMatmul(lt, op, &one, wc, la, x, lb, &zero, y, lc, y, lc, &res[i].algo, ws,
                             ws_bytes, 0) != CUBLAS_STATUS_SUCCESS)
            ok = false;
        });
        if (!ok) continue;
        if (i == 0) first = us;
        if (us < best) {
          best = us;
          best_i = i;
        }
      }
      printf("lt %-12s m=%-5d n=%-6d k=%-6d cublas %7.1f us  lt#0 %7.1f us  best lt#%-2d %7.1f us"
             "  (%d algos)  %5.1f -> %5.1f TFLOP/s\n",
             s.name, m, s.n, s.k, us_blas, first, best_i, best, found,
             2.0 * m * s.n * s.k / us_blas / 1e6, 2.0 * m * s.n * s.k / best / 1e6);
      cublasLtMatmulPreferenceDestroy(pref);
      cublasLtMatrixLayoutDestroy(la);
      cublasLtMatrixLayoutDestroy(lb);
      cublasLtMatrixLayoutDestroy(lc);
      cublasLtMatmulDescDestroy(op);
      CK(cudaFree(x));
      CK(cudaFree(y));
    }
    CK(cudaFree(w));
  }
  CK(cudaFree(ws));
  cublasLtDestroy(lt);
}

// The products of a prompt step sustained: 32 layers of distinct 8B weights at m = 8,192 rows,
// each product whole or cut into row chunks (per product: qkv, o, gate_up, down), timed over the
// whole chain as a prefill step runs them, so clocks settle as they do under that load.
static void bench_pchain() {
  const int m = 8192;
  const Shape* s = kShapes8b;
  size_t layer = 0;
  for (int i = 0; i < 4; ++i) layer += (size_t)s[i].n * s[i].k;
  bf16* w = alloc_bf16(32 * layer, 3, 0.02f);
  bf16* x = alloc_bf16((size_t)m * 14336, 4, 1.0f);
  bf16* y;
  CK(cudaMalloc(&y, (size_t)m * 28672 * sizeof(bf16)));
  const Gemv blas = {"cublas", nullptr, 0, 0, 1 << 20};
  double flop = 0;
  for (int i = 0; i < 4; ++i) flop += 2.0 * m * s[i].n * s[i].k * 32;
  Timer t;
  auto chain = [&](const int (&chunk)[4]) {
    const bf16* p = w;
    for (int l = 0; l < 32; ++l)
      for (int i = 0; i < 4; ++i) {
        const int c = chunk[i] > 0 ? chunk[i] : m;
        for (int r = 0; r < m; r += c)
          blas.launch(y + (size_t)r * s[i].n, x + (size_t)r * s[i].k, p, std::min(c, m - r),
                      s[i].n, s[i].k);
        p += (size_t)s[i].n * s[i].k;
      }
  };
  const int cases[][4] = {
      {0, 0, 0, 0},    {4096, 4096, 4096, 4096}, {2048, 2048, 2048, 2048}, {1024, 1024, 1024, 1024},
      {2048, 0, 0, 0}, {0, 2048, 0, 0},          {0, 0, 2048, 0},          {0, 0, 0, 2048},
      {0, 0, 4096, 0}, {0, 0, 1024, 0},          {2048, 0, 2048, 0},       {0, 0, 0, 0}};
  for (const auto& c : cases) {
    chain(c);
    float best = 1e30f, sum = 0.f;
    const int reps = 4;
    for (int r = 0; r < reps; ++r) {
      t.start();
      chain(c);
      const float ms = t.stop_ms();
      best = std::min(best, ms);
      sum += ms;
    }
    printf("pchain m=%d chunks qkv %-5d o %-5d gate_up %-5d down %-5d  mean %7.2f ms"
           "  best %7.2f ms  %5.1f TFLOP/s\n",
           m, c[0], c[1], c[2], c[3], sum / reps, best, flop / (sum / reps) / 1e9);
  }
  CK(cudaFree(w));
  CK(cudaFree(x));
  CK(cudaFree(y));
}

// The production GEMV template on FP8 weights at other tile shapes (plain and GLU forms).
template <int R, int U, int NT, bool GLU>
__global__ void __launch_bounds__(NT) gemv8_cand(bf16* y, const bf16* x, const void* w,
                                                 const float* row_scale, int m, int n, int k) {
  gemv_impl<bf16, Fp8W, 1, R, U, NT, GLU>(y, x, w, row_scale, m, n, k);
}
struct Gemv8 {
  std::string name;
  GemvFn fn;
  int rows_per_cta, threads;  // rows of W per CTA (the GLU form: gate + up rows)
};
template <int R, int U, int NT, bool GLU>
Gemv8 cand8() {
  char name[64];
  snprintf(name, sizeof name, "%s_r%d_u%d_t%d", GLU ? "glu" : "plain", R, U, NT);
  return {name, gemv8_cand<R, U, NT, GLU>, R, NT};
}

// The 8B batch-1 step's products alone with FP8 weights (qkv, o, gate-up with SiLU, down; bf16
// LM head), launched as dependents and replayed from a graph: the production kernels, then each
// tile shape of the plain products (GLU at the production shape) and of the GLU form (plain at
// the production shape).
static void bench_fp8_chain() {
  const int hidden = 4096, inter = 14336, qkv_n = 6144, vocab = 128256;
  const size_t per_layer = (size_t)qkv_n * hidden + (size_t)hidden * hidden +
                           (size_t)2 * inter * hidden + (size_t)hidden * inter;  // bytes
  // random bytes as E4M3 (timing only: some are NaN)
  uint8_t* w = reinterpret_cast<uint8_t*>(alloc_bf16(32 * per_layer / 2, 50, 0.05f));
  bf16* head = alloc_bf16((size_t)vocab * hidden, 51, 0.05f);
  bf16* x = alloc_bf16(inter, 52, 1.0f);
  bf16* y = alloc_bf16(vocab, 53, 1.0f);
  std::vector<float> ones(2 * inter, 1.f);
  float* scales;
  CK(cudaMalloc(&scales, ones.size() * 4));
  CK(cudaMemcpy(scales, ones.data(), ones.size() * 4, cudaMemcpyHostToDevice));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  auto launch = [&](GemvFn fn, int ctas, int threads, const void* wt, const float* sc, int n, int k) {
    launch_on(st, true, fn, dim3(ctas), dim3(threads), 0, y, (const bf16*)x, wt, sc, 1, n, k);
  };
  auto step = [&](const Gemv8& p, const Gemv8& g) {
    const uint8_t* wp = w;
    auto plain = [&](int n, int k) {
      launch(p.fn, (n + p.rows_per_cta - 1) / p.rows_per_cta, p.threads, wp, scales, n, k);
      wp += (size_t)n * k;
    };
    for (int l = 0; l < 32; ++l) {
      plain(qkv_n, hidden);
      plain(hidden, hidden);
      const int per = g.rows_per_cta / 2;
      launch(g.fn, (inter + per - 1) / per, g.threads, wp, scales, 2 * inter, hidden);
      wp += (size_t)2 * inter * hidden;
      plain(hidden, inter);
    }
    launch(gemv_m1_bf16, (vocab + 3) / 4, 256, head, nullptr, vocab, hidden);
  };
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  const double bytes = 32.0 * per_layer + (double)vocab * hidden * 2;
  auto run = [&](const Gemv8& p, const Gemv8& g) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    step(p, g);
    CK(cudaStreamEndCapture(st, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    CK(cudaGraphLaunch(exec, st));
    CK(cudaEventRecord(a, st));
    const int reps = 20;
    for (int r = 0; r < reps; ++r) CK(cudaGraphLaunch(exec, st));
    CK(cudaEventRecord(b, st));
    CK(cudaEventSynchronize(b));
    CK(cudaGetLastError());
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    ms /= reps;
    printf("fp8chain plain %-18s glu %-16s graph %.3f ms (%.0f tok/s)  %.2f GB: %.2f TB/s\n",
           p.name.c_str(), g.name.c_str(), ms, 1e3 / ms, bytes / 1e9, bytes / ms / 1e9);
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
  };
  const Gemv8 prod_p = {"prod", gemv_fp8_m1_bf16, 4, 256};
  const Gemv8 prod_g = {"prod", gemv_glu_fp8_m1_bf16, 8, 128};
  const Gemv8 plains[] = {cand8<4, 2, 256, false>(),  cand8<4, 4, 256, false>(),
                          cand8<8, 1, 256, false>(),  cand8<8, 2, 256, false>(),
                          cand8<16, 1, 256, false>(), cand8<4, 2, 128, false>(),
                          cand8<8, 2, 128, false>(),  cand8<2, 4, 256, false>()};
  const Gemv8 glus[] = {cand8<8, 1, 256, true>(), cand8<8, 2, 256, true>(),
                        cand8<16, 1, 256, true>(), cand8<4, 2, 256, true>()};
  run(prod_p, prod_g);
  for (const Gemv8& p : plains) run(p, prod_g);
  for (const Gemv8& g : glus) run(prod_p, g);
  run(prod_p, prod_g);
  CK(cudaStreamDestroy(st));
  for (void* q : {(void*)w, (void*)head, (void*)x, (void*)y, (void*)scales}) CK(cudaFree(q));
}

int main(int argc, char** argv) {
  const char* sections = argc > 1 ? argv[1] : nullptr;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("device %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  for (const Decode& dk : kDecodes)
    CK(cudaFuncSetAttribute(dk.fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            std::max(dk.smem(), 48 << 10)));
  if (cublasCreate(&g_cublas) != CUBLAS_STATUS_SUCCESS) {
    fprintf(stderr, "cublasCreate failed\n");
    return 1;
  }
  if (want(sections, "gemv")) {
    for (int m : {1, 2, 4, 8}) bench_gemv(m);
  }
  if (want(sections, "step")) bench_step();
  if (want(sections, "attn")) bench_attn(prop.multiProcessorCount);
  if (want(sections, "attn1")) bench_attn_case(1, 768, -1, prop.multiProcessorCount, kDecodes[1]);
  if (want(sections, "occ")) bench_occ(kOcc, prop.multiProcessorCount);
  if (want(sections, "tk")) bench_occ(kTk, prop.multiProcessorCount);
  if (want(sections, "attn256")) bench_attn_case(256, 768, -1, prop.multiProcessorCount, kDecodes[2]);
  if (want(sections, "tk256")) bench_attn_case(256, 768, -1, prop.multiProcessorCount, kDecodes[4]);
  if (want(sections, "tk8")) bench_tk8(prop.multiProcessorCount, false);
  if (want(sections, "tk8one")) bench_tk8(prop.multiProcessorCount, true);
  if (want(sections, "small")) bench_small();
  if (want(sections, "chain")) bench_chain(prop.multiProcessorCount);
  if (want(sections, "fp8chain")) bench_fp8_chain();
  if (want(sections, "gemm")) bench_gemm();
  if (want(sections, "lt")) bench_lt();
  if (want(sections, "pchain")) bench_pchain();
  return 0;
}
