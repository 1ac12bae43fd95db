// The LoRA term of one projection for a batch whose rows use different adapters: each row gathers
// its adapter's matrices by its slot index (the BGMV form of Punica), so one launch serves every
// adapter in the step and a step's slots are device data (a captured graph replays with new ones).
//
// The adapters of a projection are stacked over slots: A [S, P * R, K] and B [S, N, R], where the
// projection's output columns are split into P <= 3 parts (q, k, v of a fused qkv; gate, up of a
// fused gate-up) ending at e0 <= e1 <= N, and part p's columns read u[p * R .. (p + 1) * R]. A
// row whose slot is kNoAdapter gets nothing added. Scales are folded into B by the host.
#include "common.cuh"

constexpr uint32_t kNoAdapter = 0xffffffffu;
// Values of k one warp of the shrink covers: a decode row's few outputs are spread over many
// warps (split-K), each adding its part into u.
constexpr int kShrinkChunk = 512;

// u[t, j] += A[slots[t], j, k0:k1] . x[t, k0:k1] in f32, one warp per (token, output, chunk of
// kShrinkChunk values); u: [tokens, pr] zeroed before; rows without an adapter add nothing.
// x: [tokens, k] rows ldx apart. Warps are numbered token-major, then output, then chunk, so
// neighbouring warps read neighbouring parts of one row of A.
template <typename T>
__device__ void lora_shrink_impl(float* __restrict__ u, const T* __restrict__ x, long ldx,
                                 const T* __restrict__ a, const uint32_t* __restrict__ slots,
                                 int tokens, int pr, int k) {
  pdl_wait();
  const int chunks = (k + kShrinkChunk - 1) / kShrinkChunk;
  const long w = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const long per_token = (long)pr * chunks;
  const long t = w / per_token;
  if (t >= tokens) return;
  const int rem = (int)(w - t * per_token);
  const int j = rem / chunks, c = rem % chunks;
  const uint32_t s = slots[t];
  if (s == kNoAdapter) return;
  const int k0 = c * kShrinkChunk, k1 = min(k, k0 + kShrinkChunk);
  const T* xr = x + t * ldx;
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
  if (lane == 0) atomicAdd(u + t * pr + j, acc);
}

// out[t, o] = y[t, o] + sum_q u[t, p(o) * r + q] * B[slots[t], o, q], p(o) the part of column o.
// y, out: [tokens, n] contiguous (out may be y); one thread per element.
template <typename T>
__device__ void lora_expand_impl(T* out, const T* y, const float* __restrict__ u,
                                 const T* __restrict__ b, const uint32_t* __restrict__ slots,
                                 long total, int n, int r, int pr, int e0, int e1) {
  pdl_wait();
  const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= total) return;
  const long t = idx / n;
  const int o = (int)(idx - t * n);
  const uint32_t s = slots[t];
  float acc = 0.f;
  if (s != kNoAdapter) {
    const int p = o < e0 ? 0 : (o < e1 ? 1 : 2);
    const float* ut = u + t * pr + p * r;
    const T* br = b + ((size_t)s * n + o) * r;
    constexpr int VN = Vec16<T>::N;
    if (r % VN == 0 && aligned16(b)) {
      for (int q = 0; q < r; q += VN) {
        float bv[VN];
        load16(br + q, bv);
#pragma unroll
        for (int e = 0; e < VN; ++e) acc += ut[q + e] * bv[e];
      }
    } else {
      for (int q = 0; q < r; ++q) acc += ut[q] * to_f32(br[q]);
    }
  }
  out[idx] = from_f32<T>(to_f32(y[idx]) + acc);
}

#define RSERVE_LORA(T, S)                                                                          \
  extern "C" __global__ void lora_shrink_##S(float* u, const T* x, long ldx, const T* a,         \
                                             const uint32_t* slots, int tokens, int pr, int k) { \
    lora_shrink_impl<T>(u, x, ldx, a, slots, tokens, pr, k);                                     \
  }                                                                                                \
  extern "C" __global__ void lora_expand_##S(T* out, const T* y, const float* u, const T* b,     \
                                             const uint32_t* slots, long total, int n, int r,    \
                                             int pr, int e0, int e1) {                           \
    lora_expand_impl<T>(out, y, u, b, slots, total, n, r, pr, e0, e1);                           \
  }
RSERVE_FOR_DTYPES(RSERVE_LORA)
#undef RSERVE_LORA
