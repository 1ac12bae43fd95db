// Attention over the paged KV cache for a flattened batch of query tokens (decode tokens, whole
// prompts and prompt chunks mixed), flash-style: keys and values stream through shared memory in
// tiles, softmax is online, no score matrix is ever materialised.
//
// One CTA of 128 threads handles a work item (a sequence and a run of up to `queries_per_cta` of
// its query tokens, from `work`) for `heads_per_cta` query heads of one KV head group. Its rows are
// (query, head) pairs: r -> query r / nh, head r % nh. Each K/V tile is read from the cache once
// and used by every row, so grouped heads (GQA/MQA) and neighbouring prompt tokens share the loads.
//
// Host-chosen sizes (see paged_attention.rs): rows * head_dim <= 4096, rows <= 16 * row_groups,
// tile_keys * head_dim * sizeof(T) <= 8192; head_dim even and <= 256. Shared memory stays < 48 KB.
// FP8 caches (C = e4m3) are converted to T as the tiles are copied to shared memory.
#include "common.cuh"

namespace {

constexpr int kThreads = 128;
constexpr int kSlots = 16;  // row slots per thread in the P.V accumulation (2 columns each)

template <typename T> struct Pad { static constexpr int value = 2; };
template <> struct Pad<float> { static constexpr int value = 1; };

template <typename T, typename C>
__device__ void paged_attention_impl(
    T* __restrict__ out,                         // [num_tokens, num_heads, head_dim]
    const T* __restrict__ q,                     // [num_tokens, num_heads, head_dim], rows q_stride apart
    const C* __restrict__ k_cache,               // [num_blocks, block_size, kv_heads, head_dim]
    const C* __restrict__ v_cache,               // [num_blocks, block_size, kv_heads, head_dim]
    const uint32_t* __restrict__ block_tables,   // [num_seqs, width]
    const uint32_t* __restrict__ seq_lens,       // [num_seqs]
    const uint32_t* __restrict__ query_start,    // [num_seqs + 1]
    const uint32_t* __restrict__ work,           // [num_work, 2]: sequence, first query index
    int width, int num_heads, int kv_heads, int head_dim, int block_size,
    int heads_per_cta, int queries_per_cta, int rows_cap, int tile_keys,
    float scale, int window, long q_stride, int split_keys, long total_rows,
    float* __restrict__ part_acc, float* __restrict__ part_ml) {
  constexpr int PAD = Pad<T>::value;
  const int D = head_dim;
  const int DP = D + PAD;
  const int TKP = tile_keys + 1;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;

  const int group = num_heads / kv_heads;
  const int chunks = (group + heads_per_cta - 1) / heads_per_cta;
  const int kvh = blockIdx.y / chunks;
  const int chunk = blockIdx.y % chunks;
  const int h0 = kvh * group + chunk * heads_per_cta;
  const int nh = min(heads_per_cta, group - chunk * heads_per_cta);

  const int seq = work[2 * blockIdx.x];
  const int qi0 = work[2 * blockIdx.x + 1];
  const int qs = query_start[seq];
  const int q_len = query_start[seq + 1] - qs;
  const int ctx = seq_lens[seq];
  const int nq = min(queries_per_cta, q_len - qi0);
  const int R = nq * nh;
  const int p_first = ctx - q_len + qi0;  // position of this CTA's first query
  const int p_last = p_first + nq - 1;
  const int lo = window > 0 ? max(0, p_first + 1 - window) : 0;
  // split-K (flash-decoding): this CTA sees only keys [z * split_keys, (z + 1) * split_keys)
  const int k_begin = split_keys > 0 ? max(lo, (int)blockIdx.z * split_keys) : lo;
  const int k_end = split_keys > 0 ? min(p_last + 1, ((int)blockIdx.z + 1) * split_keys) : p_last + 1;

  extern __shared__ float smem[];
  float* sq = smem;                      // [rows_cap, D] scaled queries
  float* ss = sq + rows_cap * D;         // [rows_cap, TKP] scores, then probabilities
  float* sm = ss + rows_cap * TKP;       // [rows_cap] running max
  float* sl = sm + rows_cap;             // [rows_cap] running sum
  float* sc = sl + rows_cap;             // [rows_cap] this tile's rescale factor
  T* sk = reinterpret_cast<T*>(sc + rows_cap);  // [tile_keys, DP]
  T* sv = sk + tile_keys * DP;                  // [tile_keys, DP]

  for (int i = tid; i < R * D; i += kThreads) {
    const int r = i / D, c = i % D;
    const int tok = qs + qi0 + r / nh, head = h0 + r % nh;
    sq[i] = to_f32(q[(size_t)tok * q_stride + (size_t)head * D + c]) * scale;
  }
  for (int r = tid; r < R; r += kThreads) {
    sm[r] = -INFINITY;
    sl[r] = 0.f;
  }

  // P.V ownership: column pair cp of rows rg, rg + groups, ...
  const int pairs = D / 2;
  const int groups = kThreads / pairs;
  const bool active = tid < groups * pairs;
  const int cp = tid % pairs;
  const int rg = tid / pairs;
  float acc[2 * kSlots];
#pragma unroll
  for (int j = 0; j < 2 * kSlots; ++j) acc[j] = 0.f;

  const uint32_t* table = block_tables + (size_t)seq * width;
  const size_t row_stride = (size_t)kv_heads * D;

  for (int k0 = k_begin; k0 < k_end; k0 += tile_keys) {
    const int nk = min(tile_keys, k_end - k0);
    __syncthreads();  // the previous tile is no longer read
    for (int i = tid; i < nk * pairs; i += kThreads) {
      const int kk = i / pairs, c = 2 * (i % pairs);
      const int pos = k0 + kk;
      const size_t slot = (size_t)table[pos / block_size] * block_size + pos % block_size;
      const size_t src = slot * row_stride + (size_t)kvh * D + c;
      sk[kk * DP + c] = CacheAs<T, C>::get(k_cache[src]);
      sk[kk * DP + c + 1] = CacheAs<T, C>::get(k_cache[src + 1]);
      sv[kk * DP + c] = CacheAs<T, C>::get(v_cache[src]);
      sv[kk * DP + c + 1] = CacheAs<T, C>::get(v_cache[src + 1]);
    }
    __syncthreads();

    for (int i = tid; i < R * tile_keys; i += kThreads) {
      const int r = i / tile_keys, kk = i % tile_keys;
      const int pos = k0 + kk;
      const int p = p_first + r / nh;
      float s = -INFINITY;
      if (kk < nk && pos <= p && (window <= 0 || pos > p - window)) {
        const float* qr = sq + r * D;
        const T* kr = sk + kk * DP;
        float a = 0.f, b = 0.f;
        for (int c = 0; c < D; c += 2) {
          const float2 kv = load2(kr + c);
          a = fmaf(qr[c], kv.x, a);
          b = fmaf(qr[c + 1], kv.y, b);
        }
        s = a + b;
      }
      ss[r * TKP + kk] = s;
    }
    __syncthreads();

    for (int r = warp; r < R; r += kThreads / 32) {
      float v = -INFINITY;
      if (lane < tile_keys) v = ss[r * TKP + lane];
      const float m_old = sm[r];
      const float m_new = fmaxf(m_old, warp_max(v));
      float p = 0.f, corr = 1.f;
      if (m_new != -INFINITY) {
        p = (v == -INFINITY) ? 0.f : __expf(v - m_new);
        corr = (m_old == -INFINITY) ? 0.f : __expf(m_old - m_new);
      }
      const float sum = warp_sum(p);
      if (lane < tile_keys) ss[r * TKP + lane] = p;
      if (lane == 0) {
        sl[r] = sl[r] * corr + sum;
        sm[r] = m_new;
        sc[r] = corr;
      }
    }
    __syncthreads();

    if (active) {
#pragma unroll
      for (int j = 0; j < kSlots; ++j) {
        const int r = rg + j * groups;
        if (r < R) {
          const float c = sc[r];
          acc[2 * j] *= c;
          acc[2 * j + 1] *= c;
        }
      }
      for (int kk = 0; kk < nk; ++kk) {
        const float2 v = load2(sv + kk * DP + 2 * cp);
#pragma unroll
        for (int j = 0; j < kSlots; ++j) {
          const int r = rg + j * groups;
          if (r < R) {
            const float p = ss[r * TKP + kk];
            acc[2 * j] = fmaf(p, v.x, acc[2 * j]);
            acc[2 * j + 1] = fmaf(p, v.y, acc[2 * j + 1]);
          }
        }
      }
    }
  }
  __syncthreads();

  if (active) {
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      const int r = rg + j * groups;
      if (r < R) {
        const int tok = qs + qi0 + r / nh, head = h0 + r % nh;
        const size_t row = (size_t)tok * num_heads + head;
        if (split_keys > 0) {
          // unnormalised partial result; paged_attention_combine merges the splits
          const size_t prow = (size_t)blockIdx.z * total_rows + row;
          float* pa = part_acc + prow * D + 2 * cp;
          pa[0] = acc[2 * j];
          pa[1] = acc[2 * j + 1];
          if (cp == 0) {
            part_ml[2 * prow] = sm[r];
            part_ml[2 * prow + 1] = sl[r];
          }
          continue;
        }
        const float l = sl[r];
        const float inv = l > 0.f ? 1.f / l : 0.f;
        T* o = out + row * D + 2 * cp;
        o[0] = from_f32<T>(acc[2 * j] * inv);
        o[1] = from_f32<T>(acc[2 * j + 1] * inv);
      }
    }
  }
}

// One CTA per (token, head) row: merges the splits' (max, sum, accumulator) into the output.
// Warp 0 weighs the splits: their maxima's maximum M, each split's weight exp(m_s - M), the total
// L = sum of weight * sum, and the list of splits with a nonzero weight in split order (at most
// kMaxSplits splits; the host never makes more); then each thread adds its columns over the
// listed splits, eight loads in flight at a time.
constexpr int kMaxSplits = 512;
constexpr int kCombineBatch = 8;

template <typename T>
__device__ void combine_impl(T* __restrict__ out, const float* __restrict__ part_acc,
                             const float* __restrict__ part_ml, int splits, long total_rows, int D) {
  pdl_trigger();  // the o product may start streaming its weights
  pdl_wait();     // the partials are the split kernel's output
  __shared__ float w[kMaxSplits];
  __shared__ int live_split[kMaxSplits];
  __shared__ float total;
  __shared__ int live_count;
  const long row = blockIdx.x;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    float M = -INFINITY;
    for (int s = lane; s < splits; s += 32) M = fmaxf(M, part_ml[2 * (s * total_rows + row)]);
    M = warp_max(M);
    float L = 0.f;
    int count = 0;
    for (int s0 = 0; s0 < splits; s0 += 32) {
      const int s = s0 + lane;
      float ws = 0.f;
      if (s < splits) {
        const float ms = part_ml[2 * (s * total_rows + row)];
        ws = ms > -INFINITY ? __expf(ms - M) : 0.f;
        L = fmaf(ws, part_ml[2 * (s * total_rows + row) + 1], L);
      }
      const unsigned live = __ballot_sync(0xffffffffu, ws != 0.f);
      if (ws != 0.f) {
        const int at = count + __popc(live & ((1u << lane) - 1u));
        w[at] = ws;
        live_split[at] = s;
      }
      count += __popc(live);
    }
    L = warp_sum(L);
    if (lane == 0) {
      total = L;
      live_count = count;
    }
  }
  __syncthreads();
  const float inv = total > 0.f ? 1.f / total : 0.f;
  const int n = live_count;
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    float a = 0.f;
    int i = 0;
    for (; i + kCombineBatch <= n; i += kCombineBatch) {
      float v[kCombineBatch];
#pragma unroll
      for (int e = 0; e < kCombineBatch; ++e)
        v[e] = part_acc[(live_split[i + e] * total_rows + row) * D + c];
#pragma unroll
      for (int e = 0; e < kCombineBatch; ++e) a = fmaf(w[i + e], v[e], a);
    }
    for (; i < n; ++i) a = fmaf(w[i], part_acc[(live_split[i] * total_rows + row) * D + c], a);
    out[row * D + c] = from_f32<T>(a * inv);
  }
}

}  // namespace

#define PAGED_ATTENTION(T, C, NAME)                                                                \
  extern "C" __global__ void __launch_bounds__(kThreads) paged_attention_##NAME(                   \
      T* out, const T* q, const C* k_cache, const C* v_cache, const uint32_t* block_tables,       \
      const uint32_t* seq_lens, const uint32_t* query_start, const uint32_t* work, int width,     \
      int num_heads, int kv_heads, int head_dim, int block_size, int heads_per_cta,               \
      int queries_per_cta, int rows_cap, int tile_keys, float scale, int window, long q_stride,   \
      int split_keys, long total_rows, float* part_acc, float* part_ml) {                         \
    pdl_wait();                                                                                   \
    paged_attention_impl<T, C>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start, work,  \
                            width, num_heads, kv_heads, head_dim, block_size, heads_per_cta,      \
                            queries_per_cta, rows_cap, tile_keys, scale, window, q_stride,        \
                            split_keys, total_rows, part_acc, part_ml);                           \
  }
RSERVE_FOR_CACHES(PAGED_ATTENTION)
#define PAGED_ATTENTION_COMBINE(T, NAME)                                                          \
  extern "C" __global__ void paged_attention_combine_##NAME(                                      \
      T* out, const float* part_acc, const float* part_ml, int splits, long total_rows, int D) {  \
    combine_impl<T>(out, part_acc, part_ml, splits, total_rows, D);                               \
  }
RSERVE_FOR_DTYPES(PAGED_ATTENTION_COMBINE)
