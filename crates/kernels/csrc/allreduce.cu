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
// same on every rank because every rank runs the same calls with the same grid. Why two halves are
// enough: a rank writes half (e & 1) in call e only after it has seen every peer's flag of call
// e - 1, so every peer has finished call e - 2, the last call that read that half.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

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

// in, out: `nvec` 16-byte vectors on this rank. ptrs: every rank's data buffer (AR_MAX_WORLD
// entries) then every rank's flags ([gridDim.x][AR_MAX_WORLD] u32 each). counters: this rank's
// per-block epochs. half_bytes: the size of one half of a data buffer (>= nvec * 16).
template <typename T>
__device__ void allreduce_oneshot(const uint4* __restrict__ in, uint4* __restrict__ out, long nvec,
                                  const unsigned long long* __restrict__ ptrs,
                                  unsigned* __restrict__ counters, long half_bytes, int rank,
                                  int world) {
  __shared__ unsigned epoch_s;
  const int b = blockIdx.x;
  if (threadIdx.x == 0) {
    unsigned e = counters[b] + 1;
    counters[b] = e;
    epoch_s = e;
  }
  __syncthreads();
  const unsigned epoch = epoch_s;
  const long half = (long)(epoch & 1u) * half_bytes;
  const long per = (nvec + gridDim.x - 1) / gridDim.x;
  const long lo = min(nvec, per * b), hi = min(nvec, lo + per);

  uint4* mine = reinterpret_cast<uint4*>(reinterpret_cast<char*>(ptrs[rank]) + half);
  for (long i = lo + threadIdx.x; i < hi; i += blockDim.x) mine[i] = in[i];
  __syncthreads();
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
  constexpr int N = ArVec<T>::N;
  for (long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    float acc[N];
#pragma unroll
    for (int k = 0; k < N; k++) acc[k] = 0.f;
    for (int q = 0; q < world; q++) {
      const uint4* src = reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(ptrs[q]) + half);
      ArVec<T>::add(acc, src[i]);
    }
    out[i] = ArVec<T>::pack(acc);
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
