// Sampling on the GPU: one CTA of 1024 threads per row of f32 logits. Only the chosen token and
// its log-probability leave the device.
//
// Per row, in the host sampler's order: raw log-sum-exp (for the chosen token's log-probability),
// sparse edits in place (logit bias, suppressed ids, repetition / presence / frequency penalties),
// then either the arg-max (temperature 0) or: temperature, min-p, top-k and top-p as thresholds on
// the scaled logits (found by 32-step bitwise searches over order-preserving integer keys, so no
// sort), and one Gumbel-max draw among the survivors, which samples exactly in proportion to
// exp(logit / T). Uniforms come from a counter hash of the row's seed and the token id, so a row's
// draw does not depend on the batch around it.
#include "common.cuh"

namespace {

constexpr int kSampleThreads = 1024;

__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform in (0, 1) for token i of a row seeded with `seed`.
__device__ __forceinline__ float uniform(uint64_t seed, uint32_t i) {
  const uint64_t h = splitmix64(seed ^ splitmix64(i));
  return ((float)(h >> 40) + 0.5f) * (1.0f / 16777216.0f);
}

__device__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = threadIdx.x < (blockDim.x >> 5) ? scratch[threadIdx.x] : 0.f;
  if (threadIdx.x < 32) r = warp_sum(r);
  if (threadIdx.x == 0) scratch[0] = r;
  __syncthreads();
  return scratch[0];
}

__device__ float block_max(float v, float* scratch) {
  v = warp_max(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = threadIdx.x < (blockDim.x >> 5) ? scratch[threadIdx.x] : -INFINITY;
  if (threadIdx.x < 32) r = warp_max(r);
  if (threadIdx.x == 0) scratch[0] = r;
  __syncthreads();
  return scratch[0];
}

// Arg-max of (value, index) pairs, lowest index on ties.
__device__ void block_argmax(float& v, int& idx, float* sv, int* si) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
    if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
  }
  __syncthreads();
  if ((threadIdx.x & 31) == 0) { sv[threadIdx.x >> 5] = v; si[threadIdx.x >> 5] = idx; }
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < (blockDim.x >> 5) ? sv[threadIdx.x] : -INFINITY;
    idx = threadIdx.x < (blockDim.x >> 5) ? si[threadIdx.x] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, v, o);
      const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
      if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
    }
    if (threadIdx.x == 0) { sv[0] = v; si[0] = idx; }
  }
  __syncthreads();
  v = sv[0];
  idx = si[0];
}

}  // namespace

// logits: [rows, vocab] f32, edited in place. Per row: temperature (0 = greedy), top_k (0 = off),
// top_p, min_p, seed. Edits of row r are entries edit_start[r]..edit_start[r + 1] of edit_token
// and edit_val ([n, 3]: bias, repetition penalty, amount subtracted; +inf subtracts to -inf);
// edit_raw ([n]) receives each edited token's raw logit. At most one edit per token and row.
extern "C" __global__ void __launch_bounds__(kSampleThreads) sample_rows(
    float* __restrict__ logits, int vocab, const float* __restrict__ temperature,
    const int* __restrict__ top_k, const float* __restrict__ top_p, const float* __restrict__ min_p,
    const uint64_t* __restrict__ seeds, const uint32_t* __restrict__ edit_start,
    const uint32_t* __restrict__ edit_token, const float* __restrict__ edit_val,
    float* __restrict__ edit_raw, uint32_t* __restrict__ out_token, float* __restrict__ out_logprob) {
  __shared__ float sv[32];
  __shared__ int si[32];
  const int row = blockIdx.x;
  float* x = logits + (size_t)row * vocab;
  const int tid = threadIdx.x, nt = blockDim.x;

  // raw log-sum-exp
  float m = -INFINITY;
  for (int i = tid; i < vocab; i += nt) m = fmaxf(m, x[i]);
  const float raw_max = block_max(m, sv);
  float z = 0.f;
  if (raw_max > -INFINITY)
    for (int i = tid; i < vocab; i += nt) z += __expf(x[i] - raw_max);
  const float raw_lse = raw_max + __logf(block_sum(z, sv));

  // edits, remembering each edited token's raw value
  const uint32_t e0 = edit_start[row], e1 = edit_start[row + 1];
  for (uint32_t e = e0 + tid; e < e1; e += nt) {
    const uint32_t t = edit_token[e];
    if (t >= (uint32_t)vocab) continue;  // unsigned: an id of 2^31 or more is out of range too
    edit_raw[e] = x[t];
    float v = x[t] + edit_val[3 * e];
    const float rp = edit_val[3 * e + 1];
    v = v > 0.f ? v / rp : v * rp;
    v -= edit_val[3 * e + 2];
    x[t] = v;
  }
  __syncthreads();

  const float temp = temperature[row];
  int chosen = 0;
  if (temp < 1e-5f) {
    float best = -INFINITY;
    int idx = 0x7fffffff;
    for (int i = tid; i < vocab; i += nt) {
      if (x[i] > best) { best = x[i]; idx = i; }
    }
    block_argmax(best, idx, sv, si);
    chosen = idx == 0x7fffffff ? 0 : idx;
  } else {
    const float inv_t = 1.f / temp;
    float mm = -INFINITY;
    for (int i = tid; i < vocab; i += nt) mm = fmaxf(mm, x[i]);
    const float emax = block_max(mm, sv);  // edited max (unscaled)
    // survivors: key(x) >= thr; min-p first (relative to the max after temperature)
    uint32_t thr = 0;
    const float mp = min_p[row];
    if (mp > 0.f) thr = order_key(emax + fminf(__logf(mp), 0.f) * temp);
    const int k = top_k[row];
    if (k > 0 && k < vocab) {
      uint32_t K = 0;
      for (int bit = 31; bit >= 0; --bit) {
        const uint32_t cand = K | (1u << bit);
        float c = 0.f;
        for (int i = tid; i < vocab; i += nt) c += order_key(x[i]) >= cand ? 1.f : 0.f;
        if (block_sum(c, sv) >= (float)k) K = cand;
      }
      thr = max(thr, K);
    }
    const float p = top_p[row];
    if (p < 1.f) {
      float tot = 0.f;
      for (int i = tid; i < vocab; i += nt)
        if (order_key(x[i]) >= thr) tot += __expf((x[i] - emax) * inv_t);
      const float target = p * block_sum(tot, sv);
      uint32_t K = 0;
      for (int bit = 31; bit >= 0; --bit) {
        const uint32_t cand = K | (1u << bit);
        if (cand < thr) { K = cand; continue; }
        float s = 0.f;
        for (int i = tid; i < vocab; i += nt)
          if (order_key(x[i]) >= cand) s += __expf((x[i] - emax) * inv_t);
        if (block_sum(s, sv) >= target) K = cand;
      }
      thr = max(thr, K);
    }
    const uint64_t seed = seeds[row];
    float best = -INFINITY;
    int idx = 0x7fffffff;
    for (int i = tid; i < vocab; i += nt) {
      const float v = x[i];
      if (v == -INFINITY || order_key(v) < thr) continue;
      const float g = (v - emax) * inv_t - __logf(-__logf(uniform(seed, (uint32_t)i)));
      if (g > best) { best = g; idx = i; }
    }
    block_argmax(best, idx, sv, si);
    chosen = idx == 0x7fffffff ? 0 : idx;
  }
  if (tid == 0) {
    float raw = x[chosen];
    for (uint32_t e = e0; e < e1; ++e) {
      if (edit_token[e] == (uint32_t)chosen) { raw = edit_raw[e]; break; }
    }
    out_token[row] = (uint32_t)chosen;
    out_logprob[row] = raw - raw_lse;
  }
}

// Feeds sampled tokens to the next step without a trip to the host: for i < n,
// dst[pairs[2 i]] = src[pairs[2 i + 1]] (dst: the step's token ids; src: a sampler's out_token).
extern "C" __global__ void scatter_tokens(uint32_t* __restrict__ dst,
                                          const uint32_t* __restrict__ src,
                                          const uint32_t* __restrict__ pairs, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) dst[pairs[2 * i]] = src[pairs[2 * i + 1]];
}

// Structured output: logits[rows[r], t] = -inf wherever bit t of row r's mask is clear.
// masks: [n, words] u32 (bit t % 32 of word t / 32); grid (ceil(vocab / blockDim), n).
extern "C" __global__ void apply_token_bitmask(float* __restrict__ logits, int vocab,
                                               const uint32_t* __restrict__ rows,
                                               const uint32_t* __restrict__ masks, int words) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= vocab) return;
  const uint32_t bits = masks[(size_t)blockIdx.y * words + (t >> 5)];
  if (!((bits >> (t & 31)) & 1u)) logits[(size_t)rows[blockIdx.y] * vocab + t] = -INFINITY;
}
