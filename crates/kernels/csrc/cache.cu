// Cache writes: new keys or values into their slots, and whole-block copies for copy-on-write.
// Slots were validated on the host (negative = skip, all others inside the cache). An FP8 cache
// stores each value times `inv` (1 / the layer's scale), rounded as the CPU encoder rounds.
#include "common.cuh"

// One CTA per token; rows of kv_heads * head_dim elements.
template <typename T, typename C>
__device__ void reshape_and_cache_impl(C* __restrict__ cache,           // [num_slots, row]
                                       const T* __restrict__ src,       // [num_tokens, row], rows src_stride apart
                                       const int64_t* __restrict__ slots,  // [num_tokens]
                                       int row, long src_stride, float inv) {
  const int64_t slot = slots[blockIdx.x];
  if (slot < 0) return;
  const T* s = src + (size_t)blockIdx.x * src_stride;
  C* d = cache + (size_t)slot * row;
  for (int i = threadIdx.x; i < row; i += blockDim.x) d[i] = CacheElem<C>::put(to_f32(s[i]), inv);
}

// One CTA per (pair, chunk); pairs are (src, dst) block ids.
template <typename T>
__device__ void copy_blocks_impl(T* __restrict__ cache, const uint32_t* __restrict__ pairs,
                                 int per_block) {
  const size_t src = (size_t)pairs[2 * blockIdx.x] * per_block;
  const size_t dst = (size_t)pairs[2 * blockIdx.x + 1] * per_block;
  for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < per_block; i += gridDim.y * blockDim.x) {
    cache[dst + i] = cache[src + i];
  }
}

#define CACHE_WRITE(T, C, NAME)                                                                   \
  extern "C" __global__ void reshape_and_cache_##NAME(C* cache, const T* src,                     \
                                                      const int64_t* slots, int row,              \
                                                      long src_stride, float inv) {               \
    reshape_and_cache_impl<T, C>(cache, src, slots, row, src_stride, inv);                        \
  }
RSERVE_FOR_CACHES(CACHE_WRITE)
#define CACHE_COPY(T, NAME)                                                                       \
  extern "C" __global__ void copy_blocks_##NAME(T* cache, const uint32_t* pairs, int per_block) { \
    copy_blocks_impl<T>(cache, pairs, per_block);                                                 \
  }
RSERVE_FOR_DTYPES(CACHE_COPY)
CACHE_COPY(uint8_t, u8)
