// Attention of decode rows (one query token per sequence) over the paged KV cache, shaped for
// bandwidth: one CTA per (sequence, KV head[, key split]) serves every query head of the group.
//
// Keys are taken in chunks of kChunk. For the scores each thread owns whole keys and reads their
// K rows with 16-byte loads (many loads in flight per thread), the group's scaled queries being
// broadcast from shared memory; the chunk's softmax runs one warp per head (online across chunks);
// for P.V each thread owns 16 bytes of output columns and a stream of keys, so a V row is read by
// a few threads in 16-byte pieces and each thread keeps several rows in flight; the streams' sums
// meet through warp shuffles, then shared memory. With a key split (gridDim.z > 1) each sequence's
// visible keys are cut into gridDim.z slices of at least split_keys keys (a multiple of 16), so a
// grid fixed in advance (a captured CUDA graph) serves any context; slices past a short context
// are empty. The unnormalised partial results go to the same buffers as paged_attention's split,
// merged by paged_attention_combine.
//
// FP8 caches (C = e4m3) are read with 8-byte (4-byte for f32) loads of the same Vec16<T>::N
// values and converted in registers.
//
// Host guarantees: head_dim * sizeof(T) is a multiple of 16 and head_dim <= 256; the group of
// query heads per KV head is <= G; every listed sequence has exactly one query token.
// Shared bytes: 4 * (G * head_dim + G * kChunk + 3 * G + kChunk).
#include "common.cuh"

namespace {

constexpr int kDecThreads = 128;
constexpr int kChunk = 256;

// The keys [k_begin, k_end) a decode CTA attends to: the visible keys of a context of ctx (the
// last `window` when window > 0), or with a key split (gridDim.z > 1) slice blockIdx.z of them,
// slices being at least split_keys keys (a multiple of 16) and empty past a short context.
__device__ __forceinline__ void decode_key_range(int ctx, int window, int split_keys, int& k_begin,
                                                 int& k_end) {
  const int lo = window > 0 ? max(0, ctx - window) : 0;
  k_begin = lo;
  k_end = ctx;
  if (gridDim.z > 1) {
    const int per = max(split_keys, ((ctx - lo + (int)gridDim.z - 1) / (int)gridDim.z + 15) & ~15);
    k_begin = min(ctx, lo + (int)blockIdx.z * per);
    k_end = min(ctx, k_begin + per);
  }
}

// The end of a decode CTA: sums the key streams' P.V accumulators (thread: stream `st`, -1 when
// idle, 16-byte column vector `cv`, `tpk` threads per V row) into `scratch` (G * head_dim floats,
// free once the caller's last loop is done), then writes the group's rows: normalised to `out`, or
// unnormalised with the running max and sum to the split buffers when gridDim.z > 1. When tpk
// divides 32 a warp holds 32 / tpk whole streams, lanes tpk apart owning the same columns:
// shuffles fold them and the warps add their sums one after another; otherwise the streams add one
// after another.
template <typename T, int G>
__device__ void decode_finish(float (&acc)[G][Vec16<T>::N], float* scratch, const float* sm,
                              const float* sl, int tpk, int st, int cv, T* __restrict__ out,
                              int tok, int num_heads, int h0, int group, int D, long total_rows,
                              float* __restrict__ part_acc, float* __restrict__ part_ml) {
  constexpr int VN = Vec16<T>::N;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int nthreads = blockDim.x;
  const bool fold = tpk < 32 && 32 % tpk == 0;
  if (fold) {
    for (int o = tpk; o < 32; o <<= 1) {
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int e = 0; e < VN; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], o);
    }
  }
  const int rounds = fold ? nthreads / 32 : nthreads / tpk;
  const int turn = fold ? (lane < tpk ? warp : -1) : st;
  for (int r = 0; r < rounds; ++r) {
    __syncthreads();
    if (turn == r) {
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int e = 0; e < VN; ++e) {
          float* dst = scratch + g * D + cv * VN + e;
          *dst = r == 0 ? acc[g][e] : *dst + acc[g][e];
        }
    }
  }
  __syncthreads();
  const bool split = gridDim.z > 1;
  for (int i = tid; i < group * D; i += nthreads) {
    const int g = i / D, c = i % D;
    const size_t row = (size_t)tok * num_heads + h0 + g;
    const float a = scratch[i];
    if (split) {
      const size_t prow = (size_t)blockIdx.z * total_rows + row;
      part_acc[prow * D + c] = a;
      if (c == 0) {
        part_ml[2 * prow] = sm[g];
        part_ml[2 * prow + 1] = sl[g];
      }
    } else {
      const float l = sl[g];
      out[row * D + c] = from_f32<T>(l > 0.f ? a / l : 0.f);
    }
  }
}


// KU / VU: 16-byte K-row and V-row loads a thread issues before using any of them.
template <typename T, typename C, int G, int KU = 4, int VU = 8>
__device__ void paged_decode_impl(
    T* __restrict__ out, const T* __restrict__ q, const C* __restrict__ k_cache,
    const C* __restrict__ v_cache, const uint32_t* __restrict__ block_tables,
    const uint32_t* __restrict__ seq_lens, const uint32_t* __restrict__ query_start,
    const uint32_t* __restrict__ seqs, int width, int num_heads, int kv_heads, int head_dim,
    int block_size, float scale, int window, long q_stride, int split_keys, long total_rows,
    float* __restrict__ part_acc, float* __restrict__ part_ml) {
  constexpr int VN = Vec16<T>::N;
  using Cv = CacheVec<T, C>;
  const int D = head_dim;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int group = num_heads / kv_heads;
  const int kvh = blockIdx.y;
  const int h0 = kvh * group;
  const int seq = seqs[blockIdx.x];
  const int tok = query_start[seq];
  const int ctx = seq_lens[seq];
  int k_begin, k_end;
  decode_key_range(ctx, window, split_keys, k_begin, k_end);

  pdl_trigger();  // without a split, the o product may start streaming its weights
  extern __shared__ float smem[];
  float* sq = smem;                 // [G, D] scaled queries (zero past the group)
  float* ss = sq + G * D;           // [G, kChunk] scores, then probabilities; end-of-run scratch
  float* sm = ss + G * kChunk;      // [G] running max
  float* sl = sm + G;               // [G] running sum
  float* sc = sl + G;               // [G] this chunk's rescale factor
  uint32_t* sslot = reinterpret_cast<uint32_t*>(sc + G);  // [kChunk] cache slot of each key

  for (int i = tid; i < G * D; i += kDecThreads) {
    const int g = i / D, c = i % D;
    sq[i] = g < group ? to_f32(q[(size_t)tok * q_stride + (size_t)(h0 + g) * D + c]) * scale : 0.f;
  }
  for (int g = tid; g < G; g += kDecThreads) {
    sm[g] = -INFINITY;
    sl[g] = 0.f;
    sc[g] = 0.f;
  }

  // P.V ownership: 16-byte column vector cv of the keys st, st + streams, ...
  const int tpk = D / VN;  // threads per V row
  const int streams = kDecThreads / tpk;
  const bool active = tid < streams * tpk;
  const int cv = tid % tpk;
  const int st = tid / tpk;
  float acc[G][VN];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int e = 0; e < VN; ++e) acc[g][e] = 0.f;

  const uint32_t* table = block_tables + (size_t)seq * width;
  const size_t row_stride = (size_t)kv_heads * D;
  const C* kbase = k_cache + (size_t)kvh * D;
  const C* vbase = v_cache + (size_t)kvh * D;

  for (int c0 = k_begin; c0 < k_end; c0 += kChunk) {
    const int nk = min(kChunk, k_end - c0);
    __syncthreads();  // sq/stats ready; the previous chunk's scores and slots are consumed

    // scores: thread -> keys tid, tid + 128
    for (int kk = tid; kk < nk; kk += kDecThreads) {
      const int pos = c0 + kk;
      // 64-bit arithmetic; a slot itself fits 32 bits (KvCache holds fewer than 2^32 token slots)
      const size_t slot = (size_t)table[pos / block_size] * block_size + pos % block_size;
      sslot[kk] = (uint32_t)slot;
      const C* kr = kbase + (size_t)slot * row_stride;
      float s[G];
#pragma unroll
      for (int g = 0; g < G; ++g) s[g] = 0.f;
      for (int c0 = 0; c0 < D; c0 += KU * VN) {
        typename Cv::Raw raw[KU];  // all KU loads issued before any is used
#pragma unroll
        for (int u = 0; u < KU; ++u) raw[u] = c0 + u * VN < D ? Cv::load(kr + c0 + u * VN) : Cv::zero();
#pragma unroll
        for (int u = 0; u < KU; ++u) {
          const int c = c0 + u * VN;
          if (c >= D) break;
          float f[VN];
          Cv::unpack(raw[u], f);
#pragma unroll
          for (int g = 0; g < G; ++g) {
            const float* qg = sq + g * D + c;
#pragma unroll
            for (int e = 0; e < VN; e += 4) {
              const float4 qv = *reinterpret_cast<const float4*>(qg + e);
              s[g] = fmaf(qv.x, f[e], s[g]);
              s[g] = fmaf(qv.y, f[e + 1], s[g]);
              s[g] = fmaf(qv.z, f[e + 2], s[g]);
              s[g] = fmaf(qv.w, f[e + 3], s[g]);
            }
          }
        }
      }
#pragma unroll
      for (int g = 0; g < G; ++g) ss[g * kChunk + kk] = s[g];
    }
    __syncthreads();

    // softmax of the chunk, one warp per head, online across chunks
    for (int g = warp; g < group; g += kDecThreads / 32) {
      float* sg = ss + g * kChunk;
      float mx = -INFINITY;
      for (int kk = lane; kk < nk; kk += 32) mx = fmaxf(mx, sg[kk]);
      mx = warp_max(mx);
      const float m_old = sm[g];
      const float m_new = fmaxf(m_old, mx);
      float sum = 0.f;
      for (int kk = lane; kk < nk; kk += 32) {
        const float e = __expf(sg[kk] - m_new);
        sg[kk] = e;
        sum += e;
      }
      sum = warp_sum(sum);
      __syncwarp();
      if (lane == 0) {
        const float corr = m_old == -INFINITY ? 0.f : __expf(m_old - m_new);
        sl[g] = sl[g] * corr + sum;
        sm[g] = m_new;
        sc[g] = corr;
      }
    }
    __syncthreads();

    // P.V
    if (active) {
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int e = 0; e < VN; ++e) acc[g][e] *= sc[g];
      for (int k0 = st; k0 < nk; k0 += streams * VU) {
        typename Cv::Raw raw[VU];  // all VU rows' loads issued before any is used
#pragma unroll
        for (int u = 0; u < VU; ++u) {
          const int kk = k0 + u * streams;
          raw[u] = kk < nk ? Cv::load(vbase + (size_t)sslot[kk] * row_stride + cv * VN) : Cv::zero();
        }
#pragma unroll
        for (int u = 0; u < VU; ++u) {
          const int kk = k0 + u * streams;
          if (kk >= nk) break;
          float v[VN];
          Cv::unpack(raw[u], v);
#pragma unroll
          for (int g = 0; g < G; ++g) {
            const float p = ss[g * kChunk + kk];
#pragma unroll
            for (int e = 0; e < VN; ++e) acc[g][e] = fmaf(p, v[e], acc[g][e]);
          }
        }
      }
    }
  }

  decode_finish<T, G>(acc, ss, sm, sl, tpk, active ? st : -1, cv, out, tok, num_heads, h0, group,
                      D, total_rows, part_acc, part_ml);
}

}  // namespace

// Every decode kernel's arguments, in the order the host passes them (paged_attention.rs).
#define PAGED_DECODE_PARAMS(T, C)                                                                 \
  T *out, const T *q, const C *k_cache, const C *v_cache, const uint32_t *block_tables,           \
      const uint32_t *seq_lens, const uint32_t *query_start, const uint32_t *seqs, int width,     \
      int num_heads, int kv_heads, int head_dim, int block_size, float scale, int window,         \
      long q_stride, int split_keys, long total_rows, float *part_acc, float *part_ml
#define PAGED_DECODE_ARGS                                                                         \
  out, q, k_cache, v_cache, block_tables, seq_lens, query_start, seqs, width, num_heads,          \
      kv_heads, head_dim, block_size, scale, window, q_stride, split_keys, total_rows, part_acc,  \
      part_ml

#define PAGED_DECODE_G(T, C, NAME, G)                                                             \
  extern "C" __global__ void __launch_bounds__(kDecThreads)                                       \
      paged_decode_g##G##_##NAME(PAGED_DECODE_PARAMS(T, C)) {                                     \
    pdl_wait();                                                                                   \
    paged_decode_impl<T, C, G>(PAGED_DECODE_ARGS);                                                \
  }
#define PAGED_DECODE(T, C, NAME) PAGED_DECODE_G(T, C, NAME, 1) PAGED_DECODE_G(T, C, NAME, 4) \
  PAGED_DECODE_G(T, C, NAME, 8) PAGED_DECODE_G(T, C, NAME, 16)
RSERVE_FOR_CACHES(PAGED_DECODE)
