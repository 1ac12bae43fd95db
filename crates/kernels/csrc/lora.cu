// The LoRA term of one projection for a batch whose rows use different adapters: each row gathers
// its adapter's matrices by its slot index (the BGMV form of Punica), so one launch serves every
// adapter in the step and a step's slots are device data (a captured graph replays with new ones).
// Long runs of rows that share an adapter (prompt chunks) go through cuBLAS instead (src/lora.rs).
//
// The adapters of a projection are stacked over slots: A [S, P * R, K] and B [S, N, R], where the
// projection's output columns are split into P <= 3 parts (q, k, v of a fused qkv; gate, up of a
// fused gate-up) ending at e0 <= e1 <= N, and part p's columns read u[p * R .. (p + 1) * R]. A
// row whose slot is kNoAdapter gets nothing added. Scales are folded into B by the host.
#include "common.cuh"

constexpr uint32_t kNoAdapter = 0xffffffffu;
// The shrink spreads a row's few outputs over many warps (split-K), each covering `chunk` values
// of k (a multiple of 256) and writing its partial sum; the expand adds the partials.
// Most values of u one row has (3 parts of rank 512), kept in shared memory by the expand.
constexpr int kMaxPr = 1536;

// part[c, t, j] = A[slots[t], j, c * chunk ..] . x[row(t), same] in f32, one warp per (token,
// output, chunk); part: [chunks, tokens, pr]; rows without an adapter write nothing (the expand
// does not read them). x: rows ldx apart; row(t) = rows[t] where `rows` is given (the step's
// rows left to these kernels, the others skipped without a launch), else t. Warps are numbered
// token-major, then output, then chunk, so neighbouring warps read neighbouring parts of one row
// of A.
template <typename T>
__device__ void lora_shrink_impl(float* __restrict__ part, const T* __restrict__ x, long ldx,
                                 const T* __restrict__ a, const uint32_t* __restrict__ slots,
                                 const uint32_t* __restrict__ rows, int tokens, int pr, int k,
                                 int chunk) {
  pdl_trigger();  // the next kernel may launch (it waits for this one)
  pdl_wait();
  const int chunks = (k + chunk - 1) / chunk;
  const long w = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const long per_token = (long)pr * chunks;
  const long t = w / per_token;
  if (t >= tokens) return;
  const int rem = (int)(w - t * per_token);
  const int j = rem / chunks, c = rem % chunks;
  const uint32_t s = slots[t];
  if (s == kNoAdapter) return;
  const int k0 = c * chunk, k1 = min(k, k0 + chunk);
  const T* xr = x + (rows != nullptr ? (long)rows[t] : t) * ldx;
  const T* ar = a + ((size_t)s * pr + j) * k;
  constexpr int VN = Vec16<T>::N;
  float acc = 0.f;
  if (k % VN == 0 && aligned16(xr) && aligned16(a)) {
    for (int i = k0 + lane * VN; i < k1; i += 32 * VN) {
      float xv[VN], av[VN];
      load16(xr + i, xv);
      load16(ar + i, av);
#pragma unroll
      for (int e = 0; e < VN; ++e) acc += xv[e] * av[e];
    }
  } else {
    for (int i = k0 + lane; i < k1; i += 32) acc += to_f32(xr[i]) * to_f32(ar[i]);
  }
  acc = warp_sum(acc);
  if (lane == 0) part[((long)c * tokens + t) * pr + j] = acc;
}

// u_p . B[s, o] for the rank-r slice ut of u and column o of B.
template <typename T>
__device__ __forceinline__ float lora_dot(const float* ut, const T* br, int r, bool vec) {
  constexpr int VN = Vec16<T>::N;
  float acc = 0.f;
  if (vec) {
    for (int q = 0; q < r; q += VN) {
      float bv[VN];
      load16(br + q, bv);
#pragma unroll
      for (int e = 0; e < VN; ++e) acc += ut[q + e] * bv[e];
    }
  } else {
    for (int q = 0; q < r; ++q) acc += ut[q] * to_f32(br[q]);
  }
  return acc;
}

// One CTA per (token, tile of blockDim.x output columns). The CTA adds the shrink's partials of
// its token into u (shared memory), or, with part null, reads u from y's row itself (the product
// over a weight stored above its adapters' A rows: y [tokens, ldy], u of slot s at columns
// n + s * pr ..), then each thread writes one output (y's rows ldy apart, ldy = n otherwise).
// Token t is row rows[t] of y and out where `rows` is given (as in the shrink), else row t:
//   kGlu = false: out[t, o] = y[t, o] + u_{p(o)} . B[s, o]  (out may be y: rows without an
//                 adapter are then left alone), out [tokens, n];
//   kGlu = true:  with g = y[t, o] + u_0 . B[s, o] and v = y[t, h + o] + u_1 . B[s, h + o], each
//                 rounded to T as an unfused add would, out[t, o] = silu(g) * v; out
//                 [tokens, h], h = n / 2 (a fused gate-up); every row is written.
template <typename T, bool kGlu>
__device__ void lora_expand_impl(T* out, const T* y, long ldy, const float* __restrict__ part,
                                 const T* __restrict__ b, const uint32_t* __restrict__ slots,
                                 const uint32_t* __restrict__ rows, int tokens, int n, int r,
                                 int pr, int chunks, int e0, int e1) {
  pdl_trigger();  // the next kernel may launch (it waits for this one)
  pdl_wait();
  __shared__ float u[kMaxPr];
  const int width = kGlu ? n / 2 : n;
  const int tiles = (width + blockDim.x - 1) / blockDim.x;
  const long t = blockIdx.x / tiles;
  const int o = (int)(blockIdx.x - t * tiles) * blockDim.x + threadIdx.x;
  uint32_t s = slots[t];
  // with u in the row, a slot past the row's last one (the product covered fewer slots) has
  // no u there: the row is left as a base row rather than read past its end
  if (part == nullptr && s != kNoAdapter && (long)n + ((long)s + 1) * pr > ldy) s = kNoAdapter;
  const long row = rows != nullptr ? (long)rows[t] : t;
  const T* yr = y + row * ldy;
  T* orow = out + row * width;
  if (s == kNoAdapter) {
    if (o >= width) return;
    if constexpr (kGlu) {
      const float g = to_f32(yr[o]);
      orow[o] = from_f32<T>(g / (1.f + __expf(-g)) * to_f32(yr[width + o]));
    } else if (orow != yr) {
      orow[o] = yr[o];
    }
    return;
  }
  for (int i = threadIdx.x; i < pr; i += blockDim.x) {
    float acc = 0.f;
    if (part == nullptr) {
      acc = to_f32(yr[n + (long)s * pr + i]);
    } else {
      for (int c = 0; c < chunks; ++c) acc += part[((long)c * tokens + t) * pr + i];
    }
    u[i] = acc;
  }
  __syncthreads();
  if (o >= width) return;
  const bool vec = r % Vec16<T>::N == 0 && aligned16(b);
  const T* bs = b + (size_t)s * n * r;
  if constexpr (kGlu) {
    const float g = to_f32(from_f32<T>(to_f32(yr[o]) + lora_dot(u, bs + (size_t)o * r, r, vec)));
    const float v = to_f32(
        from_f32<T>(to_f32(yr[width + o]) + lora_dot(u + r, bs + (size_t)(width + o) * r, r, vec)));
    orow[o] = from_f32<T>(g / (1.f + __expf(-g)) * v);
  } else {
    const int p = o < e0 ? 0 : (o < e1 ? 1 : 2);
    orow[o] = from_f32<T>(to_f32(yr[o]) + lora_dot(u + p * r, bs + (size_t)o * r, r, vec));
  }
}

#define RSERVE_LORA(T, S)                                                                          \
  extern "C" __global__ void lora_shrink_##S(float* part, const T* x, long ldx, const T* a,      \
                                             const uint32_t* slots, const uint32_t* rows,        \
                                             int tokens, int pr, int k, int chunk) {             \
    lora_shrink_impl<T>(part, x, ldx, a, slots, rows, tokens, pr, k, chunk);                     \
  }                                                                                                \
  extern "C" __global__ void lora_expand_##S(T* out, const T* y, long ldy, const float* part,   \
                                             const T* b, const uint32_t* slots,                  \
                                             const uint32_t* rows, int tokens, int n, int r,     \
                                             int pr, int chunks, int e0, int e1) {               \
    lora_expand_impl<T, false>(out, y, ldy, part, b, slots, rows, tokens, n, r, pr, chunks, e0,  \
                               e1);                                                              \
  }                                                                                                \
  extern "C" __global__ void lora_expand_glu_##S(T* out, const T* y, long ldy,                   \
                                                 const float* part, const T* b,                  \
                                                 const uint32_t* slots, const uint32_t* rows,    \
                                                 int tokens, int n, int r, int pr, int chunks,   \
                                                 int e0, int e1) {                               \
    lora_expand_impl<T, true>(out, y, ldy, part, b, slots, rows, tokens, n, r, pr, chunks, e0,   \
                              e1);                                                               \
  }
RSERVE_FOR_DTYPES(RSERVE_LORA)
#undef RSERVE_LORA
