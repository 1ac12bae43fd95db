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
#include "mma.cuh"

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


// The same attention on tensor cores, for 16-bit caches with head_dim 64 or 128 and up to 16
// query heads per KV head: the group's queries are the rows of an m16n8k16 A operand (rows past
// the group are zero), so a tile of 16 keys costs 2 * head_dim / 16 mma for the scores and as many
// for P.V instead of 1,024 FMAs per key. Each of the WARPS warps is an independent
// flash-decoding worker over the CTA's keys: tiles of 16 keys, warp w taking tiles w, w + WARPS,
// ..., each copied into the warp's own S-stage ring of shared memory with cp.async (zeros past the
// last key), so the next tiles stream in while the current one is computed and no CTA barrier
// stands between tiles. Softmax is online in registers (log2 domain, as the prompt kernel); P is
// rounded to the cache type for P.V. At the end the warps' (max, sum, O) meet in shared memory.
// The grid takes the KV head from blockIdx.x and the sequence from blockIdx.y, so CTAs resident
// together read neighbouring pieces of the same cache rows.
//
// Two widths are built: 4 warps for small grids (a few sequences, their keys split), 2 warps
// (a quarter of a Hopper SM's shared memory, so 4 CTAs per SM) for grids of several CTAs per SM,
// where more, longer CTAs per SM hide each one's start and end (decode_tc_warps in
// paged_attention.rs chooses).
//
// With KM (groups of up to 8 heads) the products run transposed: keys are the mma's 16 rows and
// the heads its 8 columns, S^T = K Q^T and O^T += V^T P^T. A tile then costs head_dim / 16 mma for
// the scores and as many for P.V, half the count of the row layout, whose 16 rows hold only the
// group's few heads. The score fragment becomes P.V's B operand through one register transpose
// (movmatrix) per 8 keys, and a head's softmax max is taken over the 8 lanes that hold its keys.
//
// FP8 caches (C = e4m3): the ring's stages hold the tiles' E4M3 bytes (rows of head_dim bytes, so
// a 16-byte copy carries 16 values); a warp converts its current tile into one 16-bit stage of
// its own, which the products read as above. The products then run in f16 whatever T is (E4M3
// converts to f16 in one instruction, exactly; queries are saturated to f16's range, P is in
// [0, 1]), and the queries borrow warp 0's converted stage.
//
// Host guarantees, beyond the direct kernel's: block_size is a power of two.
// Shared bytes: decode_tc_shared_bytes in paged_attention.rs
//             = WARPS * S * 2 * 16 * (head_dim + 8) * sizeof(T), or for FP8 caches
//               WARPS * (2 * 16 * (head_dim + 8) * sizeof(T) + S * 2 * 16 * head_dim).
constexpr int kTcKeys = 16;  // keys per warp tile

template <typename T, typename C, int D, int S, int WARPS, bool KM>
__device__ void paged_decode_tc_impl(
    T* __restrict__ out, const T* __restrict__ q, const C* __restrict__ k_cache,
    const C* __restrict__ v_cache, const uint32_t* __restrict__ block_tables,
    const uint32_t* __restrict__ seq_lens, const uint32_t* __restrict__ query_start,
    const uint32_t* __restrict__ seqs, int width, int num_heads, int kv_heads, int /*head_dim*/,
    int block_size, float scale, int window, long q_stride, int split_keys, long total_rows,
    float* __restrict__ part_acc, float* __restrict__ part_ml) {
  constexpr bool F8 = sizeof(C) == 1;
  using MT = typename std::conditional<F8, __half, T>::type;  // the products' 16-bit type
  constexpr int LD = D + 8;                 // padded row: ldmatrix rows hit distinct banks
  constexpr int PIECE = 16 / sizeof(C);     // cache values per 16-byte copy
  constexpr int CH = D / PIECE;             // 16-byte pieces per cache row
  constexpr int KSTEP = 32 / CH;            // keys a warp's lanes cover per copy round
  constexpr int NU = kTcKeys / KSTEP;       // copy rounds per tile
  constexpr int WSTAGE = 2 * kTcKeys * LD;  // one 16-bit warp stage: K tile, then V tile
  constexpr int RSTAGE = 2 * kTcKeys * D;   // one FP8 stage in bytes: K tile, then V tile
  constexpr int ROW_BYTES = F8 ? D : LD * (int)sizeof(MT);     // a key's row in a ring stage
  constexpr int STAGE_BYTES = F8 ? RSTAGE : WSTAGE * (int)sizeof(MT);
  constexpr int CONV_BYTES = F8 ? WSTAGE * (int)sizeof(MT) : 0;  // FP8: the converted stage
  constexpr int WARP_BYTES = CONV_BYTES + S * STAGE_BYTES;
  constexpr int THREADS = 32 * WARPS;
  constexpr int NO = KM ? D / 16 : D / 8;  // accumulator fragments per lane
  using Mma = tc_mma<MT>;
  static_assert(D == 64 || D == 128, "head dim 64 or 128");
  static_assert(S >= 2, "the queries borrow warp 0's last stage");
  static_assert(WARPS * 16 * (D + 2) * 4 <= WARPS * WARP_BYTES,
                "the warps' results must fit in the rings");
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;  // fragment rows g and g + 8
  const int t = lane & 3;   // fragment columns 2t, 2t + 1

  const int group = num_heads / kv_heads;
  const int kvh = blockIdx.x;
  const int h0 = kvh * group;
  const int seq = seqs[blockIdx.y];
  const int tok = query_start[seq];
  const int ctx = seq_lens[seq];
  int k_begin, k_end;
  decode_key_range(ctx, window, split_keys, k_begin, k_end);
  const int n_tiles = (k_end - k_begin + kTcKeys - 1) / kTcKeys;
  const int my_tiles = n_tiles > warp ? (n_tiles - warp + WARPS - 1) / WARPS : 0;

  pdl_trigger();
  extern __shared__ __align__(16) unsigned char tc_dec_smem[];
  unsigned char* wmem = tc_dec_smem + warp * WARP_BYTES;
  MT* conv = reinterpret_cast<MT*>(wmem);  // FP8: this warp's converted stage
  unsigned char* ring = wmem + CONV_BYTES;  // this warp's S stages
  // [16, LD] queries, in warp 0's last stage (FP8: its converted stage): no tile lands there
  // before every warp holds them
  MT* sq = reinterpret_cast<MT*>(tc_dec_smem + (F8 ? 0 : (S - 1) * STAGE_BYTES));

  // this warp's j-th tile -> stage j % S: lane copies piece lane % CH of keys lane / CH + KSTEP u
  const uint32_t* table = block_tables + (size_t)seq * width;
  const size_t row_stride = (size_t)kv_heads * D;
  const int key0 = lane / CH;
  const int col = PIECE * (lane % CH);
  // the cache row of key pos (block_size is a power of two here); when blocks hold whole tiles and
  // the keys start on a tile boundary (no sliding window) a tile lies in one block, so one table
  // read per tile serves its keys
  const int bs_shift = __ffs(block_size) - 1;
  const auto cache_row = [&](int pos) { return paged_slot(table[pos >> bs_shift], pos, bs_shift); };
  const bool whole_tiles = block_size >= kTcKeys && k_begin % kTcKeys == 0;
  const size_t head_col = (size_t)kvh * D + col;
  const auto load = [&](int j) {
    const int k0 = k_begin + (warp + WARPS * j) * kTcKeys;
    unsigned char* sk = ring + (j % S) * STAGE_BYTES + key0 * ROW_BYTES + col * (int)sizeof(C);
    const size_t tile_off = whole_tiles ? cache_row(k0) * row_stride + head_col : 0;
#pragma unroll
    for (int u = 0; u < NU; ++u) {
      const int pos = k0 + key0 + KSTEP * u;
      const bool valid = pos < k_end;
      size_t off = 0;
      if (valid && whole_tiles)
        off = tile_off + (size_t)(key0 + KSTEP * u) * row_stride;
      else if (valid)
        off = cache_row(pos) * row_stride + head_col;
      tc_cp_async16(sk + KSTEP * u * ROW_BYTES, k_cache + off, valid);
      tc_cp_async16(sk + (kTcKeys + KSTEP * u) * ROW_BYTES, v_cache + off, valid);
    }
  };
#pragma unroll
  for (int j = 0; j < S - 1; ++j) {
    if (j < my_tiles) load(j);
    tc_cp_async_commit();
  }

  // queries: rows past the group are zero
  for (int i = tid; i < 16 * (D / 8); i += THREADS) {
    const int r = i / (D / 8), c = 8 * (i % (D / 8));
    stage8_as(sq + r * LD + c, q + (size_t)tok * q_stride + (size_t)(h0 + (r < group ? r : 0)) * D + c,
              r < group);
  }
  __syncthreads();
  // the queries as A fragments (rows: heads), or with KM as B fragments (columns: heads 0..7),
  // dims 16 kk.. 16 kk + 15
  uint32_t qa[KM ? 1 : D / 16][4];
  uint32_t qb[KM ? D / 16 : 1][2];
  if constexpr (KM) {
#pragma unroll
    for (int j = 0; j < D / 32; ++j) {
      uint32_t r[4];
      tc_ldmatrix_x4(r, sq + (lane & 7) * LD + 32 * j + 8 * (lane >> 3));
      qb[2 * j][0] = r[0];
      qb[2 * j][1] = r[1];
      qb[2 * j + 1][0] = r[2];
      qb[2 * j + 1][1] = r[3];
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      tc_ldmatrix_x4(qa[kk], sq + (lane & 15) * LD + 16 * kk + 8 * (lane >> 4));
  }
  __syncthreads();  // warp 0's last stage is free for tiles from here

  const float scale_log2 = scale * 1.4426950408889634f;
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.f, 0.f};
  float o[NO][4];
#pragma unroll
  for (int nd = 0; nd < NO; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;

  for (int j = 0; j < my_tiles; ++j) {
    tc_cp_async_wait<S - 2>();
    __syncwarp();  // every lane's pieces of tile j are in; tile j - 1's stage is consumed
    if (j + S - 1 < my_tiles) load(j + S - 1);
    tc_cp_async_commit();
    const MT* sk = reinterpret_cast<const MT*>(ring + (j % S) * STAGE_BYTES);
    if constexpr (F8) {
      e4m3_rows_to_smem<MT>(conv, LD, ring + (j % S) * STAGE_BYTES, D, RSTAGE / 16, lane, 32);
      __syncwarp();
      sk = conv;
    }
    const MT* sv = sk + kTcKeys * LD;
    const int k0 = k_begin + (warp + WARPS * j) * kTcKeys;
    if constexpr (KM) {
      // S^T = K Q^T: one x4 = keys +0..7 / +8..15 (lane bit 3) x dims +0 / +8 (bit 4); s[e] is
      // key g + 8 (e >> 1), head 2t + (e & 1)
      float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[4];
        tc_ldmatrix_x4(a, sk + (lane & 15) * LD + 16 * kk + 8 * (lane >> 4));
        Mma::run(s, a, qb[kk][0], qb[kk][1]);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e)
        s[e] = k0 + g + 8 * (e >> 1) < k_end ? s[e] * scale_log2 : -INFINITY;

      tc_online_softmax_cols(s, o, m, l);

      // O^T += V^T P^T: P's keys +0..7 and +8..15, transposed, are the B operand (keys 2t, 2t + 1
      // of head g); one x4 .trans of V = dims +0 / +8 (lane bit 3) x keys +0..7 / +8..15 (bit 4)
      const uint32_t p0 = tc_movmatrix_trans(Mma::pack(s[0], s[1]));
      const uint32_t p1 = tc_movmatrix_trans(Mma::pack(s[2], s[3]));
#pragma unroll
      for (int n = 0; n < D / 16; ++n) {
        uint32_t a[4];
        tc_ldmatrix_x4_trans(a, sv + ((lane & 7) + 8 * (lane >> 4)) * LD + 16 * n +
                                    8 * ((lane >> 3) & 1));
        Mma::run(o[n], a, p0, p1);
      }
    } else {
      // S = Q K^T over 16 keys: one x4 = keys +0..7 / +8..15 (lane bit 4) x dims +0 / +8 (bit 3)
      float s[2][4];
#pragma unroll
      for (int nb = 0; nb < 2; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t b[4];
        tc_ldmatrix_x4(b, sk + ((lane & 7) + 8 * (lane >> 4)) * LD + 16 * kk +
                              8 * ((lane >> 3) & 1));
        Mma::run(s[0], qa[kk], b[0], b[1]);
        Mma::run(s[1], qa[kk], b[2], b[3]);
      }
      // s[nb][e]: row g + 8 (e >> 1), key k0 + 8 nb + 2t + (e & 1)
#pragma unroll
      for (int nb = 0; nb < 2; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          s[nb][e] = k0 + 8 * nb + 2 * t + (e & 1) < k_end ? s[nb][e] * scale_log2 : -INFINITY;

      tc_online_softmax(s, o, m, l);

      // O += P V: the two key blocks' C fragments are the A fragment; one x4 .trans = keys
      // +0..7 / +8..15 (lane bit 3) x dims +0 / +8 (lane bit 4)
      const uint32_t pa[4] = {Mma::pack(s[0][0], s[0][1]), Mma::pack(s[0][2], s[0][3]),
                              Mma::pack(s[1][0], s[1][1]), Mma::pack(s[1][2], s[1][3])};
#pragma unroll
      for (int n = 0; n < D / 16; ++n) {
        uint32_t b[4];
        tc_ldmatrix_x4_trans(b, sv + ((lane & 7) + 8 * ((lane >> 3) & 1)) * LD + 16 * n +
                                    8 * (lane >> 4));
        Mma::run(o[2 * n], pa, b[0], b[1]);
        Mma::run(o[2 * n + 1], pa, b[2], b[3]);
      }
    }
  }
  tc_cp_async_wait<0>();
  __syncthreads();  // every ring is free: it now holds the warps' results

  // per warp: O [16, D] f32, then max and sum per row
  float* wo = reinterpret_cast<float*>(tc_dec_smem);
  float* wml = wo + WARPS * 16 * D;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if constexpr (KM) {  // head 2t + h: its keys' sums are spread over the lanes of equal t
      float sum = l[h];
      sum += __shfl_xor_sync(0xffffffffu, sum, 4);
      sum += __shfl_xor_sync(0xffffffffu, sum, 8);
      sum += __shfl_xor_sync(0xffffffffu, sum, 16);
      const int r = 2 * t + h;
      float* dst = wo + (warp * 16 + r) * D + g;
#pragma unroll
      for (int n = 0; n < D / 16; ++n) {
        dst[16 * n] = o[n][h];
        dst[16 * n + 8] = o[n][2 + h];
      }
      if (g == 0) {
        wml[2 * (warp * 16 + r)] = m[h];
        wml[2 * (warp * 16 + r) + 1] = sum;
      }
    } else {
      float sum = l[h];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int r = g + 8 * h;
      float* dst = wo + (warp * 16 + r) * D + 2 * t;
#pragma unroll
      for (int nd = 0; nd < D / 8; ++nd) {
        dst[8 * nd] = o[nd][2 * h];
        dst[8 * nd + 1] = o[nd][2 * h + 1];
      }
      if (t == 0) {
        wml[2 * (warp * 16 + r)] = m[h];
        wml[2 * (warp * 16 + r) + 1] = sum;
      }
    }
  }
  __syncthreads();
  const bool split = gridDim.z > 1;
  for (int i = tid; i < group * D; i += THREADS) {
    const int r = i / D, c = i % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, wml[2 * (w * 16 + r)]);
    float a = 0.f, sum = 0.f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        const float f = tc_exp2(wml[2 * (w * 16 + r)] - mx);  // 0 for a warp without keys
        a += f * wo[(w * 16 + r) * D + c];
        sum += f * wml[2 * (w * 16 + r) + 1];
      }
    }
    const size_t row = (size_t)tok * num_heads + h0 + r;
    if (split) {
      const size_t prow = (size_t)blockIdx.z * total_rows + row;
      part_acc[prow * D + c] = a;
      if (c == 0) {
        part_ml[2 * prow] = mx * 0.6931471805599453f;  // natural-log domain, as the merge reads
        part_ml[2 * prow + 1] = sum;
      }
    } else {
      out[row * D + c] = from_f32<T>(sum > 0.f ? a / sum : 0.f);
    }
  }
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

// paged_decode_tc_*: heads as rows (groups up to 16); paged_decode_tk_*: keys as rows (up to 8)
#define PAGED_DECODE_TC_W(T, C, NAME, D, W)                                                       \
  extern "C" __global__ void __launch_bounds__(32 * W)                                            \
      paged_decode_tc_w##W##_d##D##_##NAME(PAGED_DECODE_PARAMS(T, C)) {                           \
    pdl_wait();                                                                                   \
    paged_decode_tc_impl<T, C, D, 3, W, false>(PAGED_DECODE_ARGS);                                \
  }                                                                                               \
  extern "C" __global__ void __launch_bounds__(32 * W)                                            \
      paged_decode_tk_w##W##_d##D##_##NAME(PAGED_DECODE_PARAMS(T, C)) {                           \
    pdl_wait();                                                                                   \
    paged_decode_tc_impl<T, C, D, 3, W, true>(PAGED_DECODE_ARGS);                                 \
  }
#define PAGED_DECODE_TC(T, C, NAME, D) \
  PAGED_DECODE_TC_W(T, C, NAME, D, 2) PAGED_DECODE_TC_W(T, C, NAME, D, 4)
#define PAGED_DECODE_TC_DIMS(T, C, NAME) PAGED_DECODE_TC(T, C, NAME, 64) PAGED_DECODE_TC(T, C, NAME, 128)
PAGED_DECODE_TC_DIMS(__nv_bfloat16, __nv_bfloat16, bf16)
PAGED_DECODE_TC_DIMS(__half, __half, f16)
PAGED_DECODE_TC_DIMS(__nv_bfloat16, e4m3, bf16_fp8)
PAGED_DECODE_TC_DIMS(__half, e4m3, f16_fp8)
#undef PAGED_DECODE_TC_DIMS
#undef PAGED_DECODE_TC
#undef PAGED_DECODE_TC_W
