// Bidirectional attention within segments of a flattened batch (the vision encoders' windows and
// whole images), on tensor cores, flash-style: keys and values stream through shared memory
// straight from the qkv projection's output, softmax is online, no score matrix leaves registers.
// The building blocks and fragment layouts are prefill.cu's; what differs is that every query of
// a segment sees every key of it (no causal mask) and there is no cache to gather from.
//
//   qkv    [N, 3 * H, D]: each token's q heads, then k heads, then v heads (rows 3 H D apart)
//   out    [N, H, D]
//   starts [S + 1]: segment s is tokens [starts[s], starts[s + 1])
//   work   [W, 2]: (segment, first query index within it); a CTA takes up to 64 queries
//
// One CTA of 4 warps handles a work item for one head (blockIdx.y); warp w owns query rows
// [16w, 16w + 16). Keys go by tiles of BK, double-buffered with cp.async; only the segment's
// last tile is masked (keys past its end). Shared bytes = 2 stages * 2 (K, V) * BK * (D + 8) * 2:
// 45056 for D = 80 (BK 64), 36864 for D = 64 (BK 64), 34816 for D = 128 (BK 32).
//
// Host guarantees: qkv is 16-byte aligned and contiguous; D is 64, 80 or 128.
#include "common.cuh"
#include "mma.cuh"

namespace {

constexpr int sa_threads = 128;  // 4 warps of 16 rows
constexpr int sa_rows = 64;

template <int D> struct sa_tile {
  static_assert(D % 16 == 0, "head dim must be a multiple of 16");
  static constexpr int BK = D <= 80 ? 64 : 32;  // keys per tile
  static constexpr int LD = D + 8;              // shared row stride in elements (16-byte multiple)
  static constexpr int STAGE = 2 * BK * LD;     // one stage: K tile, then V tile
  static constexpr int CHUNKS = BK * (D / 8);   // 16-byte copies of one tile of K (or V)
  static_assert(BK % 16 == 0 && sa_rows * LD <= STAGE, "Q staging must fit in one stage");
  static_assert(CHUNKS % sa_threads == 0, "tile chunks must split evenly over the threads");
};

template <typename T, int D>
__device__ __forceinline__ void segment_attention_impl(T* __restrict__ out,
                                                       const T* __restrict__ qkv,
                                                       const uint32_t* __restrict__ starts,
                                                       const uint32_t* __restrict__ work,
                                                       int heads, float scale) {
  using Tile = sa_tile<D>;
  constexpr int BK = Tile::BK, LD = Tile::LD, STAGE = Tile::STAGE;
  using Mma = tc_mma<T>;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;  // mma groupID: fragment rows g and g + 8
  const int t = lane & 3;   // mma threadID_in_group: fragment columns 2t, 2t + 1

  const int head = blockIdx.y;
  const int seg = work[2 * blockIdx.x];
  const int qi0 = work[2 * blockIdx.x + 1];
  const int s0 = starts[seg];
  const int len = starts[seg + 1] - s0;
  const int nq = min(sa_rows, len - qi0);
  if (nq <= 0) return;
  const long row = 3L * heads * D;  // elements between tokens
  const T* qb = qkv + (long)head * D;
  const T* kb = qkv + (long)(heads + head) * D;
  const T* vb = qkv + (long)(2 * heads + head) * D;
  const int n_tiles = (len + BK - 1) / BK;

  extern __shared__ __align__(16) unsigned char sa_smem[];
  T* stages = reinterpret_cast<T*>(sa_smem);  // stage s at s * STAGE: K tile, then V tile
  T* sq = stages + STAGE;                     // Q is staged in stage 1 until tile 1 loads

  // ---- Q rows to shared memory (zeros for rows past the segment's queries)
  for (int i = tid; i < sa_rows * (D / 8); i += sa_threads) {
    const int r = i / (D / 8), c = i % (D / 8);
    const bool valid = r < nq;
    const T* src = valid ? qb + (long)(s0 + qi0 + r) * row + 8 * c : qkv;
    tc_cp_async16(sq + r * LD + 8 * c, src, valid);
  }
  tc_cp_async_commit();

  // ---- a K/V tile: thread tid copies chunks tid, tid + 128, ... (key i / (D / 8), column
  // chunk i % (D / 8)); keys past the segment are zero-filled (and masked below)
  const auto load_tile = [&](int it) {
    T* sk = stages + (it & 1) * STAGE;
    T* sv = sk + BK * LD;
#pragma unroll
    for (int i = tid; i < Tile::CHUNKS; i += sa_threads) {
      const int r = i / (D / 8), c = i % (D / 8);
      const int key = it * BK + r;
      const bool valid = key < len;
      const long off = valid ? (long)(s0 + key) * row + 8 * c : 0;
      tc_cp_async16(sk + r * LD + 8 * c, kb + off, valid);
      tc_cp_async16(sv + r * LD + 8 * c, vb + off, valid);
    }
  };
  if (n_tiles > 0) load_tile(0);
  tc_cp_async_commit();

  // ---- Q fragments: one x4 per 16 dims is a0..a3 of the m16n8k16 A operand
  tc_cp_async_wait<1>();  // the Q group has landed
  __syncthreads();
  uint32_t qa[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    tc_ldmatrix_x4(qa[kk], sq + (16 * warp + (lane & 15)) * LD + 16 * kk + 8 * (lane >> 4));
  __syncthreads();  // stage 1 may be overwritten now

  const bool warp_active = 16 * warp < nq;
  const float scale_log2 = scale * 1.4426950408889634f;  // exp(x) = exp2(x * log2(e))
  float m[2] = {-INFINITY, -INFINITY};  // running max of the two rows (log2 domain)
  float l[2] = {0.f, 0.f};              // this thread's share of the running sums
  float o[D / 8][4];                    // O accumulator: C fragments over D / 8 column blocks
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;

  for (int it = 0; it < n_tiles; ++it) {
    if (it + 1 < n_tiles) load_tile(it + 1);
    tc_cp_async_commit();
    tc_cp_async_wait<1>();
    __syncthreads();

    if (warp_active) {
      const T* sk = stages + (it & 1) * STAGE;
      const T* sv = sk + BK * LD;
      float s[BK / 8][4];
      tc_tile_scores<T, D, BK, LD>(s, qa, sk, lane);
      // log2-domain scores; s[nb][e] is key it * BK + 8 nb + 2t + (e & 1)
      const bool need_mask = (it + 1) * BK > len;
#pragma unroll
      for (int nb = 0; nb < BK / 8; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool hidden = need_mask && it * BK + 8 * nb + 2 * t + (e & 1) >= len;
          s[nb][e] = hidden ? -INFINITY : s[nb][e] * scale_log2;
        }
      }
      tc_online_softmax(s, o, m, l);
      tc_tile_pv<T, D, BK, LD>(o, s, sv, lane);
    }
    __syncthreads();  // this stage is refilled by the next iteration's prefetch
  }

  // ---- normalise and write the rows of real queries
  if (!warp_active) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float inv = tc_row_inv_sum(l[h]);
    const int r = 16 * warp + g + 8 * h;
    if (r < nq) {
      T* dst = out + ((long)(s0 + qi0 + r) * heads + head) * D + 2 * t;
#pragma unroll
      for (int nd = 0; nd < D / 8; ++nd)
        *reinterpret_cast<uint32_t*>(dst + 8 * nd) =
            Mma::pack(o[nd][2 * h] * inv, o[nd][2 * h + 1] * inv);
    }
  }
}

}  // namespace

#define SEGMENT_ATTENTION(T, NAME, D)                                                              \
  extern "C" __global__ void __launch_bounds__(sa_threads) segment_attention_d##D##_##NAME(        \
      T* out, const T* qkv, const uint32_t* starts, const uint32_t* work, int heads, float scale) { \
    segment_attention_impl<T, D>(out, qkv, starts, work, heads, scale);                             \
  }
#define SEGMENT_ATTENTION_DIMS(T, NAME) \
  SEGMENT_ATTENTION(T, NAME, 64) SEGMENT_ATTENTION(T, NAME, 80) SEGMENT_ATTENTION(T, NAME, 128)
SEGMENT_ATTENTION_DIMS(__nv_bfloat16, bf16)
SEGMENT_ATTENTION_DIMS(__half, f16)
#undef SEGMENT_ATTENTION_DIMS
#undef SEGMENT_ATTENTION
