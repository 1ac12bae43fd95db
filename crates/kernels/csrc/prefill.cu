// Attention of prompt tokens over the paged KV cache on tensor cores (mma.sync m16n8k16, f32
// accumulation), flash-style: K/V tiles stream through shared memory, softmax is online, no score
// matrix leaves registers. Same semantics and argument conventions as paged_attention.cu.
//
// One CTA of 4 warps handles a work item (a sequence and up to `queries_per_cta` of its query
// tokens) for one KV head (blockIdx.y). Its R = nq * group <= 64 rows are (query, head) pairs:
// row r -> query qi0 + r / group, head kvh * group + r % group, so every row uses the same K/V and
// each tile is gathered from the cache once. Warp w owns rows [16w, 16w + 16).
//
//   1. Q (64 rows x D, zeros past R) is copied to shared memory with cp.async, then held in
//      registers as mma A fragments for the whole key loop.
//   2. Keys [lo(first query), last query] go by tiles of BK = 4096 / D, double-buffered: the
//      16-byte chunks of tile i + 1 are gathered from their paged slots (cp.async, zero-filled past
//      the last key; block-table entries read a tile ahead) while tile i is computed.
//   3. Per tile and warp: S = Q K^T (K row-major in shared memory is the col-major B operand),
//      scaled into the log2 domain, masked per element (causal, window) only where the tile is
//      not wholly visible to the warp's rows; the running row max is reduced across each quad,
//      exp2 gives P, which is repacked in registers as the A operand of O += P V (V read with
//      ldmatrix .trans). A warp skips tiles none of its rows can see.
//   4. O / l is written for rows < R (rows that saw no key get 0).
//
// Shared bytes = 2 stages * 2 (K, V) * BK * (D + 8) * sizeof(T), BK = 4096 / D
//              = 32768 * (D + 8) / D: 36864 for D = 64, 34816 for D = 128.
// Rows are padded by 8 elements so that ldmatrix and cp.async touch distinct banks.
//
// FP8 caches (C = e4m3): the two stages hold the tiles' E4M3 bytes (rows of D bytes, so a 16-byte
// copy carries 16 values) and a third, 16-bit stage receives the current tile, converted by the
// whole CTA before the products; Q is staged there. The products then run in f16 whatever T is
// (E4M3 converts to f16 in one instruction; Q is saturated to f16's range, P is in [0, 1]). Shared bytes = 2 * BK * (D + 8) * sizeof(T) +
// 2 stages * 2 * BK * D = 33792 for D = 128, 26624 for D = 64.
//
// Host guarantees: queries_per_cta * (num_heads / kv_heads) <= 64; block_size is a power of two;
// q (and every row, q_stride being a multiple of 8), k_cache and v_cache are 16-byte aligned.
#include "common.cuh"
#include "mma.cuh"

namespace {

constexpr int pf_threads = 128;  // 4 warps of 16 rows
constexpr int pf_rows = 64;

template <int D> struct pf_tile {
  static_assert(D % 16 == 0, "head dim must be a multiple of 16");
  static constexpr int BK = 4096 / D;      // keys per tile
  static constexpr int LD = D + 8;         // shared row stride in elements (16-byte multiple)
  static constexpr int STAGE = 2 * BK * LD;  // one stage: K tile, then V tile
  static_assert(BK % 16 == 0 && pf_rows * LD <= STAGE, "Q staging must fit in one stage");
  static_assert((BK * D / 16) % pf_threads == 0, "tile chunks must split evenly over the threads");
};

__device__ __forceinline__ int pf_window_lo(int p, int window) {
  return window > 0 ? max(0, p + 1 - window) : 0;
}

template <typename T, typename C, int D>
__device__ __forceinline__ void pf_paged_prefill_impl(
    T* __restrict__ out,                        // [num_tokens, num_heads, D]
    const T* __restrict__ q,                    // [num_tokens, num_heads, D], tokens q_stride apart
    const C* __restrict__ k_cache,              // [num_blocks, block_size, kv_heads, D]
    const C* __restrict__ v_cache,              // [num_blocks, block_size, kv_heads, D]
    const uint32_t* __restrict__ block_tables,  // [num_seqs, width]
    const uint32_t* __restrict__ seq_lens,      // [num_seqs]
    const uint32_t* __restrict__ query_start,   // [num_seqs + 1]
    const uint32_t* __restrict__ work,          // [num_work, 2]: sequence, first query index
    int width, int num_heads, int kv_heads, int block_size, int queries_per_cta, float scale,
    int window, long q_stride) {
  using Tile = pf_tile<D>;
  constexpr int BK = Tile::BK, LD = Tile::LD, STAGE = Tile::STAGE;
  constexpr bool F8 = sizeof(C) == 1;
  using MT = typename std::conditional<F8, __half, T>::type;  // the products' 16-bit type
  constexpr int PIECE = 16 / sizeof(C);  // cache values per 16-byte copy
  constexpr int CH = D / PIECE;          // 16-byte copies per cache row
  // a copy stage: K tile then V tile, rows of ROW_BYTES; FP8 adds a 16-bit stage in front
  constexpr int ROW_BYTES = F8 ? D : LD * (int)sizeof(MT);
  constexpr int STAGE_BYTES = 2 * BK * ROW_BYTES;
  constexpr int CONV_BYTES = F8 ? STAGE * (int)sizeof(MT) : 0;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;  // mma groupID: fragment rows g and g + 8
  const int t = lane & 3;   // mma threadID_in_group: fragment columns 2t, 2t + 1

  const int group = num_heads / kv_heads;
  const int kvh = blockIdx.y;
  const int seq = work[2 * blockIdx.x];
  const int qi0 = work[2 * blockIdx.x + 1];
  const int qs = query_start[seq];
  const int q_len = query_start[seq + 1] - qs;
  const int ctx = seq_lens[seq];
  const int nq = min(queries_per_cta, q_len - qi0);
  if (nq <= 0) return;
  const int R = nq * group;
  const int p_first = ctx - q_len + qi0;  // position of the CTA's first query
  const int k_begin = pf_window_lo(p_first, window);
  const int k_end = p_first + nq;         // one past the last query's position
  const int n_tiles = (k_end - k_begin + BK - 1) / BK;

  extern __shared__ __align__(16) unsigned char pf_smem[];
  MT* conv = reinterpret_cast<MT*>(pf_smem);  // FP8: the converted tile (K, then V at BK * LD)
  unsigned char* stages = pf_smem + CONV_BYTES;  // stage s at s * STAGE_BYTES: K, then V
  // Q staging: in stage 1 (free until tile 1 loads), for FP8 in the converted stage
  MT* sq = reinterpret_cast<MT*>(F8 ? pf_smem : stages + STAGE_BYTES);

  // ---- phase 1a: Q rows to shared memory (zeros for padding rows)
  for (int i = tid; i < pf_rows * (D / 8); i += pf_threads) {
    const int r = i / (D / 8), c = i % (D / 8);
    const bool valid = r < R;
    const T* src = valid ? q + (size_t)(qs + qi0 + r / group) * q_stride +
                               (size_t)(kvh * group + r % group) * D + 8 * c
                         : q;
    if constexpr (std::is_same<T, MT>::value)
      tc_cp_async16(sq + r * LD + 8 * c, src, valid);
    else
      stage8_as(sq + r * LD + 8 * c, src, valid);
  }
  tc_cp_async_commit();

  // ---- K/V tile gather: thread tid copies the 16-byte column chunk tid % CH of the tile's keys
  // tid / CH + j * (128 / CH). Their block-table entries are read one tile ahead (blk), so that
  // issuing the copies never waits on a table load.
  constexpr int NJ = BK * CH / pf_threads;
  constexpr int KEY_STEP = pf_threads / CH;
  const int key0 = tid / CH;
  const int col = PIECE * (tid % CH);
  const uint32_t* table = block_tables + (size_t)seq * width;
  const size_t slot_stride = (size_t)kv_heads * D;
  const int bs_shift = __ffs(block_size) - 1;
  uint32_t blk[NJ];
  const auto fetch_blocks = [&](int it) {
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int pos = k_begin + it * BK + key0 + j * KEY_STEP;
      blk[j] = pos < k_end ? table[pos >> bs_shift] : 0u;
    }
  };
  const auto load_tile = [&](int it) {
    unsigned char* sk = stages + (it & 1) * STAGE_BYTES + key0 * ROW_BYTES + col * (int)sizeof(C);
    unsigned char* sv = sk + BK * ROW_BYTES;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int pos = k_begin + it * BK + key0 + j * KEY_STEP;
      const bool valid = pos < k_end;
      const size_t off =
          valid ? paged_slot(blk[j], pos, bs_shift) * slot_stride + (size_t)kvh * D + col : 0;
      tc_cp_async16(sk + j * KEY_STEP * ROW_BYTES, k_cache + off, valid);
      tc_cp_async16(sv + j * KEY_STEP * ROW_BYTES, v_cache + off, valid);
    }
  };
  if (n_tiles > 0) {
    fetch_blocks(0);
    load_tile(0);
    fetch_blocks(1);
  }
  tc_cp_async_commit();

  // ---- phase 1b: Q fragments. Matrices of one x4: rows +0/+8 (lanes bit 3), columns +0/+8
  // (lanes bit 4), i.e. exactly a0..a3 of the m16n8k16 A operand.
  tc_cp_async_wait<1>();  // the Q group has landed
  __syncthreads();
  uint32_t qa[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    tc_ldmatrix_x4(qa[kk], sq + (16 * warp + (lane & 15)) * LD + 16 * kk + 8 * (lane >> 4));
  __syncthreads();  // stage 1 may be overwritten now

  // ---- per-warp and per-thread row facts (padding rows behave like row R - 1)
  const bool warp_active = 16 * warp < R;
  const int wp_min = p_first + (16 * warp) / group;              // first row's position
  const int wp_max = p_first + min(16 * warp + 15, R - 1) / group;  // last row's position
  const int wlo_min = pf_window_lo(wp_min, window);
  const int wlo_max = pf_window_lo(wp_max, window);
  int row_p[2], row_lo[2];  // rows 16w + g and 16w + g + 8: visible keys [row_lo, row_p]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_p[h] = p_first + min(16 * warp + g + 8 * h, R - 1) / group;
    row_lo[h] = pf_window_lo(row_p[h], window);
  }

  const float scale_log2 = scale * 1.4426950408889634f;  // exp(x) = exp2(x * log2(e))
  float m[2] = {-INFINITY, -INFINITY};  // running max of the two rows (log2 domain)
  float l[2] = {0.f, 0.f};              // this thread's share of the running sums
  float o[D / 8][4];                    // O accumulator: C fragments over D / 8 column blocks
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;

  for (int it = 0; it < n_tiles; ++it) {
    // ---- phase 2: prefetch the next tile, wait for this one
    if (it + 1 < n_tiles) {
      load_tile(it + 1);
      fetch_blocks(it + 2);
    }
    tc_cp_async_commit();
    tc_cp_async_wait<1>();
    __syncthreads();

    const int k0 = k_begin + it * BK;
    const MT* sk = reinterpret_cast<const MT*>(stages + (it & 1) * STAGE_BYTES);
    if constexpr (F8) {
      e4m3_rows_to_smem<MT>(conv, LD, stages + (it & 1) * STAGE_BYTES, D, 2 * BK * D / 16, tid,
                           pf_threads);
      __syncthreads();
      sk = conv;
    }
    if (warp_active && k0 <= wp_max && k0 + BK - 1 >= wlo_min) {
      const MT* sv = sk + BK * LD;

      // ---- phase 3a: S = Q K^T
      float s[BK / 8][4];
      tc_tile_scores<MT, D, BK, LD>(s, qa, sk, lane);

      // ---- phase 3b: log2-domain scores; s[nb][e] is row g + 8 * (e >> 1), key
      // k0 + 8 * nb + 2t + (e & 1). Mask only tiles not wholly visible to every row of the warp.
      const bool need_mask = k0 + BK - 1 > wp_min || k0 < wlo_max;
#pragma unroll
      for (int nb = 0; nb < BK / 8; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int pos = k0 + 8 * nb + 2 * t + (e & 1);
          const int h = e >> 1;
          const bool hidden = need_mask && (pos > row_p[h] || pos < row_lo[h]);
          s[nb][e] = hidden ? -INFINITY : s[nb][e] * scale_log2;
        }
      }

      // ---- phase 3c: online softmax. A row lives in the 4 lanes of a quad.
      tc_online_softmax(s, o, m, l);

      // ---- phase 3d: O += P V
      tc_tile_pv<MT, D, BK, LD>(o, s, sv, lane);
    }
    __syncthreads();  // this stage is refilled by the next iteration's prefetch
  }

  // ---- phase 4: normalise and write rows < R
  if (!warp_active) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float inv = tc_row_inv_sum(l[h]);
    const int r = 16 * warp + g + 8 * h;
    if (r < R) {
      const int tok = qs + qi0 + r / group;
      const int head = kvh * group + r % group;
      T* dst = out + ((size_t)tok * num_heads + head) * D + 2 * t;
#pragma unroll
      for (int nd = 0; nd < D / 8; ++nd)
        *reinterpret_cast<uint32_t*>(dst + 8 * nd) =
            tc_mma<T>::pack(o[nd][2 * h] * inv, o[nd][2 * h + 1] * inv);
    }
  }
}

}  // namespace

#define PF_PAGED_PREFILL(T, C, NAME, D)                                                            \
  extern "C" __global__ void __launch_bounds__(pf_threads) paged_prefill_d##D##_##NAME(            \
      T* out, const T* q, const C* k_cache, const C* v_cache, const uint32_t* block_tables,       \
      const uint32_t* seq_lens, const uint32_t* query_start, const uint32_t* work, int width,     \
      int num_heads, int kv_heads, int block_size, int queries_per_cta, float scale, int window,  \
      long q_stride) {                                                                            \
    pdl_wait();                                                                                   \
    pf_paged_prefill_impl<T, C, D>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start, \
                                   work, width, num_heads, kv_heads, block_size, queries_per_cta, \
                                   scale, window, q_stride);                                      \
  }
#define PF_PAGED_PREFILL_DIMS(T, C, NAME) PF_PAGED_PREFILL(T, C, NAME, 64) PF_PAGED_PREFILL(T, C, NAME, 128)
PF_PAGED_PREFILL_DIMS(__nv_bfloat16, __nv_bfloat16, bf16)
PF_PAGED_PREFILL_DIMS(__half, __half, f16)
PF_PAGED_PREFILL_DIMS(__nv_bfloat16, e4m3, bf16_fp8)
PF_PAGED_PREFILL_DIMS(__half, e4m3, f16_fp8)
#undef PF_PAGED_PREFILL_DIMS
#undef PF_PAGED_PREFILL
