// y = x W^T for a few rows of x (decode batches): bandwidth-bound, so each warp streams two rows
// of W with 16-byte loads (a warp reads 512 contiguous bytes per row per step, several steps in
// flight), multiplies them with every row of x (read through L1, shared by all warps) and reduces
// across the warp. x: [m, k], W: [n, k], y: [m, n], all contiguous; k a multiple of 8, m <= M.
#include "common.cuh"

namespace {

constexpr int kGemvThreads = 256;
constexpr int kGemvRowsPerWarp = 2;

template <typename T, int M>
__device__ void gemv_impl(T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ w,
                          int m, int n, int k) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int row0 = (blockIdx.x * (kGemvThreads / 32) + warp) * kGemvRowsPerWarp;
  if (row0 >= n) return;
  const int rows = min(kGemvRowsPerWarp, n - row0);
  float acc[kGemvRowsPerWarp][M];
#pragma unroll
  for (int r = 0; r < kGemvRowsPerWarp; ++r)
#pragma unroll
    for (int i = 0; i < M; ++i) acc[r][i] = 0.f;

  const uint4* w0 = reinterpret_cast<const uint4*>(w + (size_t)row0 * k);
  const uint4* w1 = reinterpret_cast<const uint4*>(w + (size_t)(row0 + (rows > 1 ? 1 : 0)) * k);
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  const int chunks = k / 8;  // 16-byte chunks per row
  constexpr int U = 4;       // steps whose W loads are issued before any is used
  for (int c0 = lane; c0 < chunks; c0 += 32 * U) {
    uint4 wa[U], wb[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (c < chunks) {
        wa[u] = __ldcs(w0 + c);
        wb[u] = __ldcs(w1 + c);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (c >= chunks) break;
      float a[8], b[8];
      Vec16<T>::unpack(wa[u], a);
      Vec16<T>::unpack(wb[u], b);
#pragma unroll
      for (int i = 0; i < M; ++i) {
        if (i < m) {
          float xf[8];
          Vec16<T>::unpack(__ldg(xv + (size_t)i * chunks + c), xf);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            acc[0][i] = fmaf(a[e], xf[e], acc[0][i]);
            acc[1][i] = fmaf(b[e], xf[e], acc[1][i]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kGemvRowsPerWarp; ++r)
#pragma unroll
    for (int i = 0; i < M; ++i) acc[r][i] = warp_sum(acc[r][i]);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kGemvRowsPerWarp; ++r) {
      if (r >= rows) break;
#pragma unroll
      for (int i = 0; i < M; ++i) {
        if (i < m) y[(size_t)i * n + row0 + r] = from_f32<T>(acc[r][i]);
      }
    }
  }
}

}  // namespace

#define GEMV_M(T, NAME, M)                                                                          \
  extern "C" __global__ void __launch_bounds__(kGemvThreads) gemv_m##M##_##NAME(                    \
      T* y, const T* x, const T* w, int m, int n, int k) {                                          \
    gemv_impl<T, M>(y, x, w, m, n, k);                                                              \
  }
#define GEMV(T, NAME) GEMV_M(T, NAME, 1) GEMV_M(T, NAME, 2) GEMV_M(T, NAME, 4) GEMV_M(T, NAME, 8)
GEMV(__nv_bfloat16, bf16)
GEMV(__half, f16)
