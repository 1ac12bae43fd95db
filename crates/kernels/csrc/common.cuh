// Element conversions shared by the kernels: every kernel reads and writes f32, bf16 or f16 and
// computes in f32.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <float.h>
#include <stdint.h>
#include <type_traits>

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

// ---- FP8 E4M3 activation rows (the FP8 products' per-token quantization, csrc/fp8.cu): a row's
// scale is amax / 448 (448: E4M3's largest value), at least FLT_MIN, and 1 for a row of zeros;
// each value is x / scale rounded to nearest-even and saturated, the bits of src/fp8.rs.
__device__ __forceinline__ float fp8_row_scale(float amax) {
  return amax > 0.f ? fmaxf(amax / 448.f, FLT_MIN) : 1.f;
}
__device__ __forceinline__ uint8_t fp8_byte(float x, float s) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x / s, __NV_SATFINITE, __NV_E4M3));
}
// Four E4M3 bytes of four values divided by s.
__device__ __forceinline__ uint32_t fp8_pack4(const float* f, float s) {
  uint32_t w = 0;
#pragma unroll
  for (int e = 0; e < 4; ++e) w |= (uint32_t)fp8_byte(f[e], s) << (8 * e);
  return w;
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

// ---- FP8 E4M3 KV caches (`--kv-cache-dtype fp8`): one byte per value, holding value / scale
// with a per-layer scale that the host folds into the attention's score scale (keys) and into the
// output (values). Every E4M3 value is exact in f16 and bf16, so reading is a pure conversion.
struct e4m3 {
  uint8_t bits;
};

// x rounded to nearest-even and saturated, the same bits as the CPU encoder (src/fp8.rs).
__device__ __forceinline__ uint8_t f32_to_e4m3(float x) {
  return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}
// Two E4M3 values (the low byte first) as floats.
__device__ __forceinline__ float2 e4m3x2_to_f2(uint32_t pair) {
  const __half2_raw r =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xffffu), __NV_E4M3);
  return __half22float2(*reinterpret_cast<const __half2*>(&r));
}
__device__ __forceinline__ float e4m3_to_f32(uint8_t b) { return e4m3x2_to_f2(b).x; }

// A cache element as a float, and a float as a cache element (`inv`: 1 / the layer's scale).
template <typename C> struct CacheElem {
  __device__ __forceinline__ static float get(C x) { return to_f32(x); }
  __device__ __forceinline__ static C put(float x, float) { return from_f32<C>(x); }
};
template <> struct CacheElem<e4m3> {
  __device__ __forceinline__ static float get(e4m3 x) { return e4m3_to_f32(x.bits); }
  __device__ __forceinline__ static e4m3 put(float x, float inv) { return {f32_to_e4m3(x * inv)}; }
};

// A cache element in the compute type T (a plain copy when the cache holds T).
template <typename T, typename C> struct CacheAs {
  __device__ __forceinline__ static T get(C x) { return from_f32<T>(CacheElem<C>::get(x)); }
};
template <typename T> struct CacheAs<T, T> {
  __device__ __forceinline__ static T get(T x) { return x; }
};

// Vec16<T>::N consecutive cache elements read as floats in one load: 16 bytes for a cache of the
// compute type T, 8 or 4 bytes of E4M3 for an FP8 cache (p aligned to the load's size).
template <int N> struct E4m3Load;
template <> struct E4m3Load<8> { using Raw = uint2; };
template <> struct E4m3Load<4> { using Raw = uint32_t; };
template <typename T, typename C> struct CacheVec {
  static constexpr int N = Vec16<T>::N;
  using Raw = uint4;
  __device__ __forceinline__ static Raw zero() { return make_uint4(0, 0, 0, 0); }
  __device__ __forceinline__ static Raw load(const C* p) { return ldg16(p); }
  __device__ __forceinline__ static void unpack(const Raw& r, float* f) { Vec16<T>::unpack(r, f); }
};
template <typename T> struct CacheVec<T, e4m3> {
  static constexpr int N = Vec16<T>::N;
  using Raw = typename E4m3Load<N>::Raw;
  __device__ __forceinline__ static Raw zero() { return Raw{}; }
  __device__ __forceinline__ static Raw load(const e4m3* p) {
    return __ldg(reinterpret_cast<const Raw*>(p));
  }
  __device__ __forceinline__ static void unpack(const Raw& r, float* f) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(&r);
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const float2 a = e4m3x2_to_f2(w[i]), b = e4m3x2_to_f2(w[i] >> 16);
      f[4 * i] = a.x;
      f[4 * i + 1] = a.y;
      f[4 * i + 2] = b.x;
      f[4 * i + 3] = b.y;
    }
  }
};

// Two E4M3 values (low byte first) as one register of two 16-bit T (exact).
template <typename T> __device__ __forceinline__ uint32_t e4m3x2_to_pair(uint32_t pair);
template <> __device__ __forceinline__ uint32_t e4m3x2_to_pair<__half>(uint32_t pair) {
  const __half2_raw r =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xffffu), __NV_E4M3);
  return *reinterpret_cast<const uint32_t*>(&r);
}
template <> __device__ __forceinline__ uint32_t e4m3x2_to_pair<__nv_bfloat16>(uint32_t pair) {
  const __nv_bfloat162 v = __float22bfloat162_rn(e4m3x2_to_f2(pair));
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Converts rows of E4M3 bytes (`row_bytes` apart, a multiple of 16) into rows of 16-bit T
// (`ld` elements apart, a multiple of 8), both in shared memory: `pieces` 16-byte pieces in
// total, thread `first` taking pieces first, first + step, ...
template <typename T>
__device__ __forceinline__ void e4m3_rows_to_smem(T* __restrict__ dst, int ld,
                                                  const uint8_t* __restrict__ src, int row_bytes,
                                                  int pieces, int first, int step) {
  const int per_row = row_bytes / 16;
  for (int p = first; p < pieces; p += step) {
    const int r = p / per_row, c = 16 * (p % per_row);
    const uint4 v = *reinterpret_cast<const uint4*>(src + r * row_bytes + c);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    uint32_t o[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      o[2 * i] = e4m3x2_to_pair<T>(w[i]);
      o[2 * i + 1] = e4m3x2_to_pair<T>(w[i] >> 16);
    }
    uint4* d = reinterpret_cast<uint4*>(dst + r * ld + c);
    d[0] = make_uint4(o[0], o[1], o[2], o[3]);
    d[1] = make_uint4(o[4], o[5], o[6], o[7]);
  }
}

// Eight 16-bit values of T at src (16 bytes, global) into dst (shared) as MT: a plain copy when
// MT is T, else converted (saturated to MT's range) - the queries of the tensor-core attention
// kernels, whose products run in f16 over an FP8 cache.
template <typename T, typename MT>
__device__ __forceinline__ void stage8_as(MT* dst, const T* src, bool valid) {
  uint4 v = make_uint4(0, 0, 0, 0);
  if (valid) v = ldg16(src);
  if constexpr (!std::is_same<T, MT>::value) {
    float f[8];
    Vec16<T>::unpack(v, f);
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = fminf(fmaxf(f[e], -65504.f), 65504.f);
    store16(dst, f);
  } else {
    *reinterpret_cast<uint4*>(dst) = v;
  }
}

// One instantiation per (compute dtype T, cache element C): caches of T named
// `<name>_<f32|bf16|f16>`, FP8 caches `<name>_<f32|bf16|f16>_fp8`.
#define RSERVE_FOR_CACHES(M)                                                                      \
  M(float, float, f32) M(__nv_bfloat16, __nv_bfloat16, bf16) M(__half, __half, f16)               \
  M(float, e4m3, f32_fp8) M(__nv_bfloat16, e4m3, bf16_fp8) M(__half, e4m3, f16_fp8)
