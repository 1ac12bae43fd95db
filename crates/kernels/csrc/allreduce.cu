// One-shot all-reduce among the GPUs of one process over peer (NVLink) access, for the small
// messages of decode steps, where NCCL's fixed cost per collective dominates.
//
// Every rank owns a data buffer of two halves and a flag array, reachable from every other rank's
// kernels (peer access). A call: each block copies its segment of the input into the half of its
// own buffer that the call's parity picks, tells every peer (a release store into the peer's flag
// for this block and rank), waits for every peer's flag, then sums the segment over every rank's
// buffer in rank order (the same order on every rank, so all ranks get the same bits).
//
// The epoch of a call is a per-block counter kept on the device (graph replays advance it), the
// same on every rank because every rank runs the same calls with the same grid (every kernel here
// runs BLOCKS blocks, and every block meets its peers, rows or not). Why two halves are enough: a
// rank writes half (e & 1) in call e only after it has seen every peer's flag of call e - 1, so
// every peer has finished call e - 2, the last call that read that half (a call starts after
// pdl_wait, so after every kernel before it in its stream has finished).
//
// Two kernels: the plain all-reduce, and the all-reduce fused with the decoder's residual add and
// RMS norm that follow a row-parallel layer (one launch and one pass over the row fewer).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include "common.cuh"

#define AR_MAX_WORLD 8

__device__ __forceinline__ void ar_store_release(unsigned* p, unsigned v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned ar_load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

template <typename T>
struct ArVec;

template <>
struct ArVec<float> {
  static __device__ __forceinline__ void add(float* acc, const uint4& v) {
    const float* f = reinterpret_cast<const float*>(&v);
#pragma unroll
    for (int i = 0; i < 4; i++) acc[i] += f[i];
  }
  static __device__ __forceinline__ uint4 pack(const float* acc) {
    uint4 v;
    float* f = reinterpret_cast<float*>(&v);
#pragma unroll
    for (int i = 0; i < 4; i++) f[i] = acc[i];
    return v;
  }
  static constexpr int N = 4;
};

// 16-bit types: four pairs per vector, each widened to f32 and rounded back once.
__device__ __forceinline__ float2 ar_widen(__nv_bfloat162 h) { return __bfloat1622float2(h); }
__device__ __forceinline__ float2 ar_widen(__half2 h) { return __half22float2(h); }
template <typename T2>
__device__ __forceinline__ T2 ar_narrow(float a, float b);
template <>
__device__ __forceinline__ __nv_bfloat162 ar_narrow(float a, float b) {
  return __floats2bfloat162_rn(a, b);
}
template <>
__device__ __forceinline__ __half2 ar_narrow(float a, float b) {
  return __floats2half2_rn(a, b);
}

template <typename T2>
struct ArVecPairs {
  static __device__ __forceinline__ void add(float* acc, const uint4& v) {
    const T2* h = reinterpret_cast<const T2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; i++) {
      float2 f = ar_widen(h[i]);
      acc[2 * i] += f.x;
      acc[2 * i + 1] += f.y;
    }
  }
  static __device__ __forceinline__ uint4 pack(const float* acc) {
    uint4 v;
    T2* h = reinterpret_cast<T2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; i++) h[i] = ar_narrow<T2>(acc[2 * i], acc[2 * i + 1]);
    return v;
  }
  static constexpr int N = 8;
};

template <>
struct ArVec<__nv_bfloat16> : ArVecPairs<__nv_bfloat162> {};
template <>
struct ArVec<__half> : ArVecPairs<__half2> {};

// The epoch of this block's call: its counter (this rank's, one per block) advanced by one.
__device__ __forceinline__ unsigned ar_next_epoch(unsigned* __restrict__ counters) {
  __shared__ unsigned epoch_s;
  if (threadIdx.x == 0) {
    const unsigned e = counters[blockIdx.x] + 1;
    counters[blockIdx.x] = e;
    epoch_s = e;
  }
  __syncthreads();
  return epoch_s;
}

// After this block's data of call `epoch` is in its own buffer: tells every peer (a release store
// into the peer's flag for this block and rank) and waits until every peer's data is in theirs.
// ptrs: every rank's data buffer (AR_MAX_WORLD entries) then every rank's flags
// ([gridDim.x][AR_MAX_WORLD] u32 each).
__device__ __forceinline__ void ar_meet(const unsigned long long* __restrict__ ptrs, unsigned epoch,
                                        int rank, int world) {
  __syncthreads();
  const int b = blockIdx.x;
  if (threadIdx.x < world) {
    const int p = threadIdx.x;
    unsigned* theirs = reinterpret_cast<unsigned*>(ptrs[AR_MAX_WORLD + p]) + b * AR_MAX_WORLD + rank;
    ar_store_release(theirs, epoch);
    const unsigned* own =
        reinterpret_cast<const unsigned*>(ptrs[AR_MAX_WORLD + rank]) + b * AR_MAX_WORLD + p;
    // a peer is at most one call ahead; wrap-safe comparison. A peer that never comes (its
    // thread died) ends this kernel with an error after ~30 s at full clock instead of a hang.
    const long long t0 = clock64();
    unsigned seen;
    while ((int)((seen = ar_load_acquire(own)) - epoch) < 0) {
      if (clock64() - t0 > 60000000000LL) __trap();
    }
    // more than one call ahead: the ranks are out of step, and a sum would be wrong
    if (seen - epoch > 1u) __trap();
  }
  __syncthreads();
}

// Rank q's half of the call with epoch `epoch`, as 16-byte vectors.
__device__ __forceinline__ const uint4* ar_half(const unsigned long long* __restrict__ ptrs, int q,
                                                unsigned epoch, long half_bytes) {
  return reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(ptrs[q]) +
                                        (long)(epoch & 1u) * half_bytes);
}

// Vector i summed over every rank's half, in rank order, in f32.
template <typename T>
__device__ __forceinline__ void ar_sum(float* acc, const unsigned long long* __restrict__ ptrs,
                                       unsigned epoch, long half_bytes, int world, long i) {
#pragma unroll
  for (int k = 0; k < ArVec<T>::N; k++) acc[k] = 0.f;
  for (int q = 0; q < world; q++) ArVec<T>::add(acc, ar_half(ptrs, q, epoch, half_bytes)[i]);
}

// in, out: `nvec` 16-byte vectors on this rank, split evenly among the blocks. counters: this
// rank's per-block epochs. half_bytes: the size of one half of a data buffer (>= nvec * 16).
template <typename T>
__device__ void allreduce_oneshot(const uint4* __restrict__ in, uint4* __restrict__ out, long nvec,
                                  const unsigned long long* __restrict__ ptrs,
                                  unsigned* __restrict__ counters, long half_bytes, int rank,
                                  int world) {
  pdl_wait();  // the product that wrote `in` has finished (and every kernel before it)
  pdl_trigger();
  const unsigned epoch = ar_next_epoch(counters);
  const int b = blockIdx.x;
  const long per = (nvec + gridDim.x - 1) / gridDim.x;
  const long lo = min(nvec, per * b), hi = min(nvec, lo + per);
  uint4* mine = const_cast<uint4*>(ar_half(ptrs, rank, epoch, half_bytes));
  for (long i = lo + threadIdx.x; i < hi; i += blockDim.x) mine[i] = in[i];
  ar_meet(ptrs, epoch, rank, world);
  for (long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    float acc[ArVec<T>::N];
    ar_sum<T>(acc, ptrs, epoch, half_bytes, world, i);
    out[i] = ArVec<T>::pack(acc);
  }
}

// The all-reduce of a row-parallel layer's output `in` [tokens, hidden] followed by the decoder's
// residual add and RMS norm, in one kernel: out [2, tokens, hidden] holds sum = reduced + res
// (the reduced value rounded to T first, as the all-reduce returns it) and rms_norm(sum) * w,
// the same bits as the all-reduce kernel then add_rms_norm with as many threads. A block takes
// rows blockIdx.x, blockIdx.x + gridDim.x, ...; every block of the grid meets its peers whether
// it has rows or not, so the epochs of all blocks advance together. hidden is a multiple of
// ArVec<T>::N.
template <typename T>
__device__ void allreduce_add_rms_norm(const T* __restrict__ in, const T* __restrict__ res,
                                       const T* __restrict__ w, T* __restrict__ out, int tokens,
                                       int hidden, float eps,
                                       const unsigned long long* __restrict__ ptrs,
                                       unsigned* __restrict__ counters, long half_bytes, int rank,
                                       int world) {
  pdl_wait();
  pdl_trigger();  // the next product may start streaming its weights while the ranks meet
  const unsigned epoch = ar_next_epoch(counters);
  constexpr int VN = ArVec<T>::N;
  const int rv = hidden / VN;  // vectors per row
  uint4* mine = const_cast<uint4*>(ar_half(ptrs, rank, epoch, half_bytes));
  const uint4* in4 = reinterpret_cast<const uint4*>(in);
  for (int row = blockIdx.x; row < tokens; row += gridDim.x)
    for (int i = threadIdx.x; i < rv; i += blockDim.x) mine[(long)row * rv + i] = in4[(long)row * rv + i];
  ar_meet(ptrs, epoch, rank, world);
  __shared__ float partial[32];
  for (int row = blockIdx.x; row < tokens; row += gridDim.x) {
    T* sum = out + (long)row * hidden;
    T* norm = out + ((long)tokens + row) * hidden;
    const T* rr = res + (long)row * hidden;
    float ss = 0.f;
    for (int i = threadIdx.x; i < rv; i += blockDim.x) {
      float acc[VN], r[VN];
      ar_sum<T>(acc, ptrs, epoch, half_bytes, world, (long)row * rv + i);
      load16(rr + i * VN, r);
      alignas(16) T s[VN];
#pragma unroll
      for (int e = 0; e < VN; ++e) {
        s[e] = from_f32<T>(to_f32(from_f32<T>(acc[e])) + r[e]);
        const float v = to_f32(s[e]);
        ss += v * v;
      }
      *reinterpret_cast<uint4*>(sum + i * VN) = *reinterpret_cast<const uint4*>(s);
    }
    const float inv = block_rms_inv(ss, partial, hidden, eps);
    for (int i = threadIdx.x; i < rv; i += blockDim.x) {
      float sv[VN], wv[VN];
      load16_rw(sum + i * VN, sv);
      load16(w + i * VN, wv);
      alignas(16) T o[VN];
#pragma unroll
      for (int e = 0; e < VN; ++e) o[e] = from_f32<T>(sv[e] * inv * wv[e]);
      *reinterpret_cast<uint4*>(norm + i * VN) = *reinterpret_cast<const uint4*>(o);
    }
  }
}

#define AR_KERNEL(name, T)                                                                       \
  extern "C" __global__ void __launch_bounds__(512)                                             \
      name(const uint4* in, uint4* out, long nvec, const unsigned long long* ptrs,              \
           unsigned* counters, long half_bytes, int rank, int world) {                          \
    allreduce_oneshot<T>(in, out, nvec, ptrs, counters, half_bytes, rank, world);               \
  }

AR_KERNEL(allreduce_oneshot_f32, float)
AR_KERNEL(allreduce_oneshot_bf16, __nv_bfloat16)
AR_KERNEL(allreduce_oneshot_f16, __half)

#define AR_NORM_KERNEL(name, T)                                                                  \
  extern "C" __global__ void __launch_bounds__(1024)                                            \
      name(const T* in, const T* res, const T* w, T* out, int tokens, int hidden, float eps,    \
           const unsigned long long* ptrs, unsigned* counters, long half_bytes, int rank,       \
           int world) {                                                                         \
    allreduce_add_rms_norm<T>(in, res, w, out, tokens, hidden, eps, ptrs, counters, half_bytes, \
                              rank, world);                                                     \
  }

AR_NORM_KERNEL(allreduce_add_rms_norm_f32, float)
AR_NORM_KERNEL(allreduce_add_rms_norm_bf16, __nv_bfloat16)
AR_NORM_KERNEL(allreduce_add_rms_norm_f16, __half)
