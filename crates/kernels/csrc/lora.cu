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
// Outputs of u per warp, warps per CTA of the shrink.
constexpr int kShrinkOuts = 4;
constexpr int kShrinkWarps = 4;

// u[t, j] = A[slots[t], j, :] . x[t, :] in f32 for j < pr (0 for rows without an adapter).
// x: [tokens, k] rows ldx apart; u: [tokens, pr]. CTA c covers token c / chunks and kShrinkWarps *
// kShrinkOuts outputs of chunk c % chunks; each warp kShrinkOuts of them.
template <typename T>
__device__ void lora_shrink_impl(float* __restrict__ u, const T* __restrict__ x, long ldx,
                                 const T* __restrict__ a, const uint32_t* __restrict__ slots,
                                 int pr, int k) {
  pdl_wait();
  const int chunks = (pr + kShrinkWarps * kShrinkOuts - 1) / (kShrinkWarps * kShrinkOuts);
  const long t = blockIdx.x / chunks;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int j0 = ((int)(blockIdx.x % chunks) * kShrinkWarps + warp) * kShrinkOuts;
  if (j0 >= pr) return;
  const int nj = min(kShrinkOuts, pr - j0);
  const uint32_t s = slots[t];
  float acc[kShrinkOuts] = {0.f, 0.f, 0.f, 0.f};
  if (s != kNoAdapter) {
    const T* xr = x + t * ldx;
    const T* ar = a + ((size_t)s * pr + j0) * k;
    constexpr int VN = Vec16<T>::N;
    if (k % VN == 0 && aligned16(xr) && aligned16(a)) {
      for (int i = lane * VN; i < k; i += 32 * VN) {
        float xv[VN];
        load16(xr + i, xv);
#pragma unroll
        for (int jj = 0; jj < kShrinkOuts; ++jj) {
          if (jj < nj) {
            float av[VN];
            load16(ar + (size_t)jj * k + i, av);
#pragma unroll
            for (int e = 0; e < VN; ++e) acc[jj] += xv[e] * av[e];
          }
        }
      }
    } else {
      for (int i = lane; i < k; i += 32) {
        const float xv = to_f32(xr[i]);
#pragma unroll
        for (int jj = 0; jj < kShrinkOuts; ++jj)
          if (jj < nj) acc[jj] += xv * to_f32(ar[(size_t)jj * k + i]);
      }
    }
  }
#pragma unroll
  for (int jj = 0; jj < kShrinkOuts; ++jj) {
    const float v = warp_sum(acc[jj]);
    if (lane == 0 && jj < nj) u[t * pr + j0 + jj] = v;
  }
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
    for (int q = 0; q < r; ++q) acc += ut[q] * to_f32(br[q]);
  }
  out[idx] = from_f32<T>(to_f32(y[idx]) + acc);
}

#define RSERVE_LORA(T, S)                                                                          \
  extern "C" __global__ void lora_shrink_##S(float* u, const T* x, long ldx, const T* a,         \
                                             const uint32_t* slots, int pr, int k) {             \
    lora_shrink_impl<T>(u, x, ldx, a, slots, pr, k);                                             \
  }                                                                                                \
  extern "C" __global__ void lora_expand_##S(T* out, const T* y, const float* u, const T* b,     \
                                             const uint32_t* slots, long total, int n, int r,    \
                                             int pr, int e0, int e1) {                           \
    lora_expand_impl<T>(out, y, u, b, slots, total, n, r, pr, e0, e1);                           \
  }
RSERVE_FOR_DTYPES(RSERVE_LORA)
#undef RSERVE_LORA
