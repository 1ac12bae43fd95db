// Element conversions shared by the kernels: every kernel reads and writes f32, bf16 or f16 and
// computes in f32.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

template <typename T> __device__ __forceinline__ float to_f32(T x);
template <> __device__ __forceinline__ float to_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_f32<__half>(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half(x); }

// Two adjacent elements (index even, row 4-byte aligned for 16-bit types) as floats.
template <typename T> __device__ __forceinline__ float2 load2(const T* p);
template <> __device__ __forceinline__ float2 load2<float>(const float* p) { return make_float2(p[0], p[1]); }
template <> __device__ __forceinline__ float2 load2<__nv_bfloat16>(const __nv_bfloat16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
template <> __device__ __forceinline__ float2 load2<__half>(const __half* p) {
  return __half22float2(*reinterpret_cast<const __half2*>(p));
}

// The elements of a 16-byte vector (eight 16-bit or four f32) as floats.
template <typename T> struct Vec16;
template <> struct Vec16<float> {
  static constexpr int N = 4;
  __device__ __forceinline__ static void unpack(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
  }
};
template <typename H, typename H2, float2 (*CVT)(H2)> struct Vec16Half {
  static constexpr int N = 8;
  __device__ __forceinline__ static void unpack(const uint4& v, float* f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 t = CVT(*reinterpret_cast<const H2*>(&w[i]));
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  }
};
__device__ __forceinline__ float2 rserve_bf162_to_f2(__nv_bfloat162 x) { return __bfloat1622float2(x); }
__device__ __forceinline__ float2 rserve_h2_to_f2(__half2 x) { return __half22float2(x); }
template <> struct Vec16<__nv_bfloat16>
    : Vec16Half<__nv_bfloat16, __nv_bfloat162, rserve_bf162_to_f2> {};
template <> struct Vec16<__half> : Vec16Half<__half, __half2, rserve_h2_to_f2> {};

// Loads 16 bytes at p (16-byte aligned, not written during the kernel) as floats, in one
// 128-bit load through the read-only path.
template <typename T> __device__ __forceinline__ uint4 ldg16(const T* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}
template <typename T> __device__ __forceinline__ void load16(const T* p, float* f) {
  Vec16<T>::unpack(ldg16(p), f);
}
// The same through the ordinary path, for memory the kernel also writes.
template <typename T> __device__ __forceinline__ void load16_rw(const T* p, float* f) {
  Vec16<T>::unpack(*reinterpret_cast<const uint4*>(p), f);
}
// Stores Vec16<T>::N floats at p (16-byte aligned) in one 128-bit store.
template <typename T> __device__ __forceinline__ void store16(T* p, const float* f) {
  alignas(16) T v[Vec16<T>::N];
#pragma unroll
  for (int e = 0; e < Vec16<T>::N; ++e) v[e] = from_f32<T>(f[e]);
  *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(v);
}
__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Programmatic dependent launch (sm_90). A kernel launched with programmatic stream
// serialization may start while the kernel before it in the stream is still running: it must call
// pdl_wait() before it reads anything that kernel writes and before it writes anything at all
// (its output may reuse memory the earlier kernel still reads); what no kernel writes (weights)
// it may read before. pdl_trigger() lets such a dependent kernel start launching early. Both are
// no-ops when the launch did not ask for it.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" :::); }

// The cache slot of key `pos` of a sequence, `block` being its block-table entry for that key,
// in blocks of 2^bs_shift keys.
__device__ __forceinline__ size_t paged_slot(uint32_t block, int pos, int bs_shift) {
  return ((size_t)block << bs_shift) + (pos & ((1 << bs_shift) - 1));
}

// One instantiation per dtype, named `<name>_<f32|bf16|f16>`.
#define RSERVE_FOR_DTYPES(M) M(float, f32) M(__nv_bfloat16, bf16) M(__half, f16)
