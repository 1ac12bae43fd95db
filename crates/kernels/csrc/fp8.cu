// FP8 E4M3 rows with one f32 scale per row: the weights of `--isq fp8` (quantized on the GPU as
// they load) and the activations of the FP8 tensor-core products (quantized per token, dynamic).
// The scale of a row is amax / 448 (448: E4M3's largest value), at least FLT_MIN, and 1 for a row
// of zeros; each value is x / scale rounded to nearest-even and saturated, the same bits as the
// CPU reference (src/fp8.rs).
#include "common.cuh"
#include <cuda_fp8.h>
#include <float.h>

namespace {

constexpr int kFp8Threads = 256;

__device__ __forceinline__ float block_max(float v) {
  __shared__ float red[kFp8Threads / 32];
  __shared__ float result;
  v = warp_max(v);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    float w = threadIdx.x < kFp8Threads / 32 ? red[threadIdx.x] : 0.f;
    w = warp_max(w);
    if (threadIdx.x == 0) result = w;
  }
  __syncthreads();
  return result;
}

// Vectors of 16 bytes a thread keeps in registers in the single-pass quantizer.
constexpr int kFp8HeldVectors = 4;

// One CTA per row of x [rows, k]: q [rows, k] E4M3 bytes, scale [rows]. Rows of up to
// 256 * kFp8HeldVectors 16-byte vectors (8,192 16-bit values) whose vectors are aligned are read
// once, held in registers while the CTA takes the row's maximum, and written 8 (4) bytes at a
// time; other rows are read twice, one value a thread at a time.
template <typename T>
__device__ void fp8_quantize_rows_impl(uint8_t* __restrict__ q, float* __restrict__ scale,
                                       const T* __restrict__ x, int k) {
  constexpr int VN = Vec16<T>::N;
  const size_t row = blockIdx.x;
  const T* xr = x + row * k;
  uint8_t* qr = q + row * k;
  pdl_wait();
  const bool held = k % VN == 0 && k <= kFp8HeldVectors * VN * kFp8Threads && aligned16(xr) &&
                    (reinterpret_cast<uintptr_t>(qr) & (VN - 1)) == 0;
  float f[kFp8HeldVectors][VN];
  float amax = 0.f;
  if (held) {
#pragma unroll
    for (int r = 0; r < kFp8HeldVectors; ++r) {
      const int i = (r * kFp8Threads + threadIdx.x) * VN;
      if (i < k) {
        load16(xr + i, f[r]);
#pragma unroll
        for (int e = 0; e < VN; ++e) amax = fmaxf(amax, fabsf(f[r][e]));
      }
    }
  } else {
    for (int i = threadIdx.x; i < k; i += kFp8Threads) amax = fmaxf(amax, fabsf(to_f32(xr[i])));
  }
  amax = block_max(amax);
  const float s = fp8_row_scale(amax);
  if (threadIdx.x == 0) scale[row] = s;
  if (held) {
#pragma unroll
    for (int r = 0; r < kFp8HeldVectors; ++r) {
      const int i = (r * kFp8Threads + threadIdx.x) * VN;
      if (i >= k) continue;
      if constexpr (VN == 8) {
        *reinterpret_cast<uint2*>(qr + i) = make_uint2(fp8_pack4(f[r], s), fp8_pack4(f[r] + 4, s));
      } else {
        *reinterpret_cast<uint32_t*>(qr + i) = fp8_pack4(f[r], s);
      }
    }
    return;
  }
  for (int i = threadIdx.x; i < k; i += kFp8Threads) {
    qr[i] = fp8_byte(to_f32(xr[i]), s);
  }
}

// y [rows, k] = q * scale[row]: the weight in 16 bits, for products without FP8 tensor cores.
template <typename T>
__device__ void fp8_dequantize_rows_impl(T* __restrict__ y, const uint8_t* __restrict__ q,
                                         const float* __restrict__ scale, int k) {
  const size_t row = blockIdx.x;
  const float s = scale[row];
  pdl_wait();
  for (int i = threadIdx.x; i < k; i += kFp8Threads) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(q[row * k + i]), __NV_E4M3);
    y[row * k + i] = from_f32<T>(__half2float(*reinterpret_cast<const __half*>(&h)) * s);
  }
}

// y [m, n] = d * sx[i] * sw[j]: the scales of a product taken with unit scales (d: its f32 or
// T output, [m, n]; y may be d). Grid: m * ceil(n / kScaleCols) CTAs, row by row; a thread takes
// 8 neighbouring columns, as one 16-byte vector of T (two of f32) where n and the pointers allow.
constexpr int kScaleCols = 8 * kFp8Threads;

template <typename T, typename D>
__device__ void fp8_scale_outer_impl(T* y, const D* d, const float* __restrict__ sx,
                                     const float* __restrict__ sw, int n) {
  pdl_wait();
  const int per_row = (n + kScaleCols - 1) / kScaleCols;
  const int i = blockIdx.x / per_row;
  const int j = (blockIdx.x % per_row) * kScaleCols + 8 * threadIdx.x;
  if (j >= n) return;
  const size_t e = (size_t)i * n + j;
  const float si = sx[i];
  if (n % 8 == 0 && aligned16(y) && aligned16(d) && aligned16(sw)) {
    float v[8];
#pragma unroll
    for (int h = 0; h < 8; h += Vec16<D>::N) load16_rw(d + e + h, v + h);
    const float4 w0 = *reinterpret_cast<const float4*>(sw + j);
    const float4 w1 = *reinterpret_cast<const float4*>(sw + j + 4);
    const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
    for (int c = 0; c < 8; ++c) v[c] = v[c] * si * w[c];
#pragma unroll
    for (int h = 0; h < 8; h += Vec16<T>::N) store16(y + e + h, v + h);
    return;
  }
  for (int c = 0; c < 8 && j + c < n; ++c) y[e + c] = from_f32<T>(to_f32(d[e + c]) * si * sw[j + c]);
}

// The end of an FP8 gate-up product, one CTA per row: from the product's unscaled sums d [m,
// 2 * inter] (gate columns, then up), a [m, inter] = silu(g) * u with g and u the sums times
// sx[row] * sw[column] rounded to T, and a's FP8 rows q [m, inter] with their scales qs [m]: the
// bits of fp8_scale_outer, silu_and_mul and fp8_quantize_rows one after another, in one pass over
// the sums (the next product takes the rows). A thread takes 8 neighbouring columns at a time and
// reads its own values of a back for the bytes.
// Host guarantees: inter % 8 == 0; every pointer 16-byte aligned (contiguous tensors).
template <typename T, typename D>
__device__ void fp8_glu_rows_impl(T* __restrict__ a, uint8_t* __restrict__ q,
                                  float* __restrict__ qs, const D* __restrict__ d,
                                  const float* __restrict__ sx, const float* __restrict__ sw,
                                  int inter) {
  pdl_wait();
  const size_t row = blockIdx.x;
  const D* dg = d + row * 2 * inter;
  const D* du = dg + inter;
  T* ar = a + row * inter;
  uint8_t* qr = q + row * inter;
  const float si = sx[row];
  float amax = 0.f;
  for (int j = 8 * threadIdx.x; j < inter; j += 8 * kFp8Threads) {
    float g[8], u[8], o[8];
#pragma unroll
    for (int h = 0; h < 8; h += Vec16<D>::N) {
      load16(dg + j + h, g + h);
      load16(du + j + h, u + h);
    }
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const float gc = to_f32(from_f32<T>(g[c] * si * sw[j + c]));
      const float uc = to_f32(from_f32<T>(u[c] * si * sw[inter + j + c]));
      o[c] = to_f32(from_f32<T>(gc / (1.f + __expf(-gc)) * uc));
      amax = fmaxf(amax, fabsf(o[c]));
    }
#pragma unroll
    for (int h = 0; h < 8; h += Vec16<T>::N) store16(ar + j + h, o + h);
  }
  amax = block_max(amax);
  const float s = fp8_row_scale(amax);
  if (threadIdx.x == 0) qs[row] = s;
  for (int j = 8 * threadIdx.x; j < inter; j += 8 * kFp8Threads) {
    float o[8];
#pragma unroll
    for (int h = 0; h < 8; h += Vec16<T>::N) load16_rw(ar + j + h, o + h);
    *reinterpret_cast<uint2*>(qr + j) = make_uint2(fp8_pack4(o, s), fp8_pack4(o + 4, s));
  }
}

}  // namespace

#define FP8_OPS(T, NAME)                                                                           \
  extern "C" __global__ void __launch_bounds__(kFp8Threads) fp8_quantize_rows_##NAME(              \
      uint8_t* q, float* scale, const T* x, int k) {                                               \
    fp8_quantize_rows_impl<T>(q, scale, x, k);                                                     \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(kFp8Threads) fp8_dequantize_rows_##NAME(            \
      T* y, const uint8_t* q, const float* scale, int k) {                                         \
    fp8_dequantize_rows_impl<T>(y, q, scale, k);                                                   \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(kFp8Threads) fp8_scale_outer_##NAME(                \
      T* y, const T* d, const float* sx, const float* sw, int n) {                                 \
    fp8_scale_outer_impl<T, T>(y, d, sx, sw, n);                                                   \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(kFp8Threads) fp8_scale_outer_f32_##NAME(            \
      T* y, const float* d, const float* sx, const float* sw, int n) {                             \
    fp8_scale_outer_impl<T, float>(y, d, sx, sw, n);                                               \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(kFp8Threads) fp8_glu_rows_##NAME(                   \
      T* a, uint8_t* q, float* qs, const T* d, const float* sx, const float* sw, int inter) {      \
    fp8_glu_rows_impl<T, T>(a, q, qs, d, sx, sw, inter);                                           \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(kFp8Threads) fp8_glu_rows_f32_##NAME(               \
      T* a, uint8_t* q, float* qs, const float* d, const float* sx, const float* sw, int inter) {  \
    fp8_glu_rows_impl<T, float>(a, q, qs, d, sx, sw, inter);                                       \
  }
RSERVE_FOR_DTYPES(FP8_OPS)
