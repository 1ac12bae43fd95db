// Decode attention on tensor cores (the direct kernel, its key ranges and the decode kernels'
// argument list are in decode.cu, included before this file in kernels.cu).
#include "common.cuh"
#include "mma.cuh"

namespace {

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
// a 16-byte copy carries 16 values). The products run in f16 whatever T is (E4M3 converts to f16
// in one instruction, exactly; queries are saturated to f16's range, P is in [0, 1]). With KM the
// lanes build their A fragments from the bytes in registers: the score product sums over the head
// dims in an order of its own (the queries' B fragments follow it), so a lane's K values are
// 16-byte runs of a key's row; for P.V a lane owns head_dim / 8 consecutive output dims, reads them
// from the four keys its fragment covers and pairs the keys' bytes with byte permutes. The 16-byte
// pieces of a row are stored XOR-swizzled by key so that these reads hit distinct banks. Without
// KM a warp converts its current tile into one 16-bit stage of its own, which the products read as
// above, and the queries borrow warp 0's converted stage.
//
// EARLY: the kernel asks for its first S - 1 tiles before it waits for the kernel before it
// (rotary with the cache writes, which writes each sequence's newest key), so their latency
// overlaps that kernel's; the newest key is left out of those copies and read after the wait.
// This needs every other key, the metadata and the block tables to be written before the step's
// first kernel, as in the engine's decode steps (a test that fills the cache with a kernel just
// before the attention breaks it). benchmarks/gpu/kbench.cu's chain compares this form with the
// engine's, which waits at entry. The engine takes it with RSERVE_CUDA_EARLY_ATTENTION=1: in a
// plainly captured graph the attention's output and partial buffers are allocated between rotary
// and the attention, so the attention starts only once rotary has ended and the early form has
// nothing to overlap; with detached allocations (RSERVE_CUDA_GRAPH_DETACH=1) it does
// (benchmarks/gpu-notes.md).
//
// Host guarantees, beyond the direct kernel's: block_size is a power of two.
// Shared bytes: decode_tc_shared_bytes in paged_attention.rs
//             = WARPS * S * 2 * 16 * (head_dim + 8) * sizeof(T); for FP8 caches
//               WARPS * S * 2 * 16 * head_dim with KM, else
//               WARPS * (2 * 16 * (head_dim + 8) * sizeof(T) + S * 2 * 16 * head_dim).
constexpr int kTcKeys = 16;  // keys per warp tile

// The 16-byte piece of an FP8 cache row (head_dim / 16 pieces) that piece p of key r of a tile is
// stored at: K rows alternate halves (a warp reads pieces t, or 4 + t, of keys g), V rows rotate by
// pairs of keys (a warp reads piece g of keys 2t and 2t + 1).
template <int D> __device__ __forceinline__ int f8_k_piece(int r, int p) {
  return D == 128 ? p ^ ((r & 1) << 2) : p;
}
template <int D> __device__ __forceinline__ int f8_v_piece(int r, int p) {
  return D == 128 ? p ^ (((r >> 1) & 3) << 1) : p ^ (((r >> 1) & 1) << 1);
}

template <typename T, typename C, int D, int S, int WARPS, bool KM, bool EARLY = false>
__device__ void paged_decode_tc_impl(
    T* __restrict__ out, const T* __restrict__ q, const C* __restrict__ k_cache,
    const C* __restrict__ v_cache, const uint32_t* __restrict__ block_tables,
    const uint32_t* __restrict__ seq_lens, const uint32_t* __restrict__ query_start,
    const uint32_t* __restrict__ seqs, int width, int num_heads, int kv_heads, int /*head_dim*/,
    int block_size, float scale, int window, long q_stride, int split_keys, long total_rows,
    float* __restrict__ part_acc, float* __restrict__ part_ml) {
  constexpr bool F8 = sizeof(C) == 1;
  constexpr bool F8R = F8 && KM;  // FP8 bytes into fragments in registers
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
  constexpr int CONV_BYTES = F8 && !KM ? WSTAGE * (int)sizeof(MT) : 0;  // the converted stage
  constexpr int QLD = F8R ? D : LD;  // the queries' rows in shared memory
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

  if constexpr (!EARLY) pdl_wait();
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
  // [16, QLD] queries, in warp 0's last stage (FP8 without KM: its converted stage): no tile
  // lands there before every warp holds them
  MT* sq = reinterpret_cast<MT*>(tc_dec_smem + (F8 && !KM ? 0 : (S - 1) * STAGE_BYTES));

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
  // where this lane's piece of key r of a tile lands in its stage: K, then V
  const auto k_dst = [&](unsigned char* stage, int r) {
    if constexpr (F8R) return stage + r * D + 16 * f8_k_piece<D>(r, lane % CH);
    return stage + r * ROW_BYTES + col * (int)sizeof(C);
  };
  const auto v_dst = [&](unsigned char* stage, int r) {
    if constexpr (F8R) return stage + (kTcKeys + r) * D + 16 * f8_v_piece<D>(r, lane % CH);
    return stage + (kTcKeys + r) * ROW_BYTES + col * (int)sizeof(C);
  };
  // `early`: before the wait for the kernel before this one, which writes the sequence's newest
  // key (ctx - 1) into the cache: that key is left out (zeros), every other key being an earlier
  // step's
  const auto load = [&](int j, bool early) {
    const int k0 = k_begin + (warp + WARPS * j) * kTcKeys;
    unsigned char* stage = ring + (j % S) * STAGE_BYTES;
    const size_t tile_off = whole_tiles ? cache_row(k0) * row_stride + head_col : 0;
#pragma unroll
    for (int u = 0; u < NU; ++u) {
      const int r = key0 + KSTEP * u;
      const int pos = k0 + r;
      const bool valid = pos < k_end && !(early && pos == ctx - 1);
      size_t off = 0;
      if (valid && whole_tiles)
        off = tile_off + (size_t)r * row_stride;
      else if (valid)
        off = cache_row(pos) * row_stride + head_col;
      tc_cp_async16(k_dst(stage, r), k_cache + off, valid);
      tc_cp_async16(v_dst(stage, r), v_cache + off, valid);
    }
  };
  // EARLY: after the wait, the lanes whose pieces of the newest key a first stage left out copy
  // them (once their own copies, the zeros among them, have landed)
#pragma unroll
  for (int j = 0; j < S - 1; ++j) {
    if (j < my_tiles) load(j, EARLY);
    tc_cp_async_commit();
  }
  if constexpr (EARLY) {
    pdl_wait();
    const int newest = ctx - 1 - k_begin;  // among this CTA's keys
    const int tile = newest / kTcKeys, r = newest % kTcKeys;
    if (ctx - 1 < k_end && newest >= 0 && tile % WARPS == warp && tile / WARPS < S - 1 &&
        r >= key0 && (r - key0) % KSTEP == 0) {
      tc_cp_async_wait<0>();
      unsigned char* stage = ring + (tile / WARPS) * STAGE_BYTES;
      const size_t off = cache_row(ctx - 1) * row_stride + head_col;
      const uint4 kv = __ldcg(reinterpret_cast<const uint4*>(k_cache + off));
      const uint4 vv = __ldcg(reinterpret_cast<const uint4*>(v_cache + off));
      *reinterpret_cast<uint4*>(k_dst(stage, r)) = kv;
      *reinterpret_cast<uint4*>(v_dst(stage, r)) = vv;
    }
  }

  // queries: rows past the group are zero
  for (int i = tid; i < 16 * (D / 8); i += THREADS) {
    const int r = i / (D / 8), c = 8 * (i % (D / 8));
    stage8_as(sq + r * QLD + c, q + (size_t)tok * q_stride + (size_t)(h0 + (r < group ? r : 0)) * D + c,
              r < group);
  }
  __syncthreads();
  // the queries as A fragments (rows: heads), or with KM as B fragments (columns: heads 0..7),
  // dims 16 kk.. 16 kk + 15
  uint32_t qa[KM ? 1 : D / 16][4];
  uint32_t qb[KM ? D / 16 : 1][2];
  if constexpr (F8R) {
    // score product kk sums dims 64 (kk / 4) + 16 t + 4 (kk % 4) + 0..3 in lane t: its K values
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const MT* qr = sq + g * D + 64 * (kk / 4) + 16 * t + 4 * (kk % 4);
      qb[kk][0] = *reinterpret_cast<const uint32_t*>(qr);
      qb[kk][1] = *reinterpret_cast<const uint32_t*>(qr + 2);
    }
  } else if constexpr (KM) {
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
    if (j + S - 1 < my_tiles) load(j + S - 1, false);
    tc_cp_async_commit();
    const unsigned char* stage = ring + (j % S) * STAGE_BYTES;
    const MT* sk = reinterpret_cast<const MT*>(stage);
    if constexpr (F8 && !KM) {
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
      if constexpr (F8R) {
        // keys g and g + 8, pieces 4 h + t: words w are the values of product 4 h + w
#pragma unroll
        for (int h = 0; h < D / 64; ++h) {
          const int p = f8_k_piece<D>(g, 4 * h + t);
          const uint4 ka = *reinterpret_cast<const uint4*>(stage + g * D + 16 * p);
          const uint4 kb = *reinterpret_cast<const uint4*>(stage + (g + 8) * D + 16 * p);
          const uint32_t wa[4] = {ka.x, ka.y, ka.z, ka.w}, wb[4] = {kb.x, kb.y, kb.z, kb.w};
#pragma unroll
          for (int w = 0; w < 4; ++w) {
            const uint32_t a[4] = {e4m3x2_to_pair<MT>(wa[w]), e4m3x2_to_pair<MT>(wb[w]),
                                   e4m3x2_to_pair<MT>(wa[w] >> 16), e4m3x2_to_pair<MT>(wb[w] >> 16)};
            Mma::run(s, a, qb[4 * h + w][0], qb[4 * h + w][1]);
          }
        }
      } else {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          uint32_t a[4];
          tc_ldmatrix_x4(a, sk + (lane & 15) * LD + 16 * kk + 8 * (lane >> 4));
          Mma::run(s, a, qb[kk][0], qb[kk][1]);
        }
      }
#pragma unroll
      for (int e = 0; e < 4; ++e)
        s[e] = k0 + g + 8 * (e >> 1) < k_end ? s[e] * scale_log2 : -INFINITY;

      tc_online_softmax_cols(s, o, m, l);

      // O^T += V^T P^T: P's keys +0..7 and +8..15, transposed, are the B operand (keys 2t, 2t + 1
      // of head g); one x4 .trans of V = dims +0 / +8 (lane bit 3) x keys +0..7 / +8..15 (bit 4)
      const uint32_t p0 = tc_movmatrix_trans(Mma::pack(s[0], s[1]));
      const uint32_t p1 = tc_movmatrix_trans(Mma::pack(s[2], s[3]));
      if constexpr (F8R) {
        // dims (D / 8) g + 0 .. D / 8 - 1 of keys 2t, 2t + 1, 2t + 8, 2t + 9: product n takes
        // dims (D / 8) g + 2n (its row g) and + 1 (row g + 8)
        constexpr int VW = D / 32;  // words a lane reads of a key
        uint32_t kv[4][VW];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = 2 * t + (i & 1) + 8 * (i >> 1);
          const int byte = (D / 8) * g;
          const unsigned char* src =
              stage + (kTcKeys + r) * D + 16 * f8_v_piece<D>(r, byte / 16) + byte % 16;
          if constexpr (VW == 4) {
            const uint4 v = *reinterpret_cast<const uint4*>(src);
            kv[i][0] = v.x, kv[i][1] = v.y, kv[i][2] = v.z, kv[i][3] = v.w;
          } else {
            const uint2 v = *reinterpret_cast<const uint2*>(src);
            kv[i][0] = v.x, kv[i][1] = v.y;
          }
        }
#pragma unroll
        for (int w = 0; w < VW; ++w)
#pragma unroll
          for (int e = 0; e < 2; ++e) {  // bytes 2e, 2e + 1 of word w: product 2w + e
            const uint32_t sel = e ? 0x7362u : 0x5140u;
            const uint32_t lo = __byte_perm(kv[0][w], kv[1][w], sel);
            const uint32_t hi = __byte_perm(kv[2][w], kv[3][w], sel);
            const uint32_t a[4] = {e4m3x2_to_pair<MT>(lo), e4m3x2_to_pair<MT>(lo >> 16),
                                   e4m3x2_to_pair<MT>(hi), e4m3x2_to_pair<MT>(hi >> 16)};
            Mma::run(o[2 * w + e], a, p0, p1);
          }
      } else {
#pragma unroll
        for (int n = 0; n < D / 16; ++n) {
          uint32_t a[4];
          tc_ldmatrix_x4_trans(a, sv + ((lane & 7) + 8 * (lane >> 4)) * LD + 16 * n +
                                      8 * ((lane >> 3) & 1));
          Mma::run(o[n], a, p0, p1);
        }
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
      // product n's rows g and g + 8: dims 16 n + g and + 8, or with F8R (D / 8) g + 2n and + 1
      float* dst = wo + (warp * 16 + r) * D + (F8R ? (D / 8) * g : g);
      constexpr int NS = F8R ? 2 : 16, RS = F8R ? 1 : 8;
#pragma unroll
      for (int n = 0; n < D / 16; ++n) {
        dst[NS * n] = o[n][h];
        dst[NS * n + RS] = o[n][2 + h];
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

// paged_decode_tc_*: heads as rows (groups up to 16); paged_decode_tk_*: keys as rows (up to 8)
#define PAGED_DECODE_TC_W(T, C, NAME, D, W)                                                       \
  extern "C" __global__ void __launch_bounds__(32 * W)                                            \
      paged_decode_tc_w##W##_d##D##_##NAME(PAGED_DECODE_PARAMS(T, C)) {                           \
    paged_decode_tc_impl<T, C, D, 3, W, false>(PAGED_DECODE_ARGS);                                \
  }                                                                                               \
  extern "C" __global__ void __launch_bounds__(32 * W)                                            \
      paged_decode_tk_w##W##_d##D##_##NAME(PAGED_DECODE_PARAMS(T, C)) {                           \
    paged_decode_tc_impl<T, C, D, 3, W, true>(PAGED_DECODE_ARGS);                                 \
  }
// paged_decode_tk_early_*: the keys-as-rows form of 4 warps (the small grids' width) asking for
// its first tiles before its wait (EARLY above; only for decode-only steps, whose every key but
// the newest an earlier step wrote)
#define PAGED_DECODE_TK_EARLY(T, C, NAME, D)                                                      \
  extern "C" __global__ void __launch_bounds__(128)                                               \
      paged_decode_tk_early_w4_d##D##_##NAME(PAGED_DECODE_PARAMS(T, C)) {                         \
    paged_decode_tc_impl<T, C, D, 3, 4, true, true>(PAGED_DECODE_ARGS);                           \
  }
#define PAGED_DECODE_TC(T, C, NAME, D)                                   \
  PAGED_DECODE_TC_W(T, C, NAME, D, 2) PAGED_DECODE_TC_W(T, C, NAME, D, 4) \
  PAGED_DECODE_TK_EARLY(T, C, NAME, D)
#define PAGED_DECODE_TC_DIMS(T, C, NAME) PAGED_DECODE_TC(T, C, NAME, 64) PAGED_DECODE_TC(T, C, NAME, 128)
PAGED_DECODE_TC_DIMS(__nv_bfloat16, __nv_bfloat16, bf16)
PAGED_DECODE_TC_DIMS(__half, __half, f16)
PAGED_DECODE_TC_DIMS(__nv_bfloat16, e4m3, bf16_fp8)
PAGED_DECODE_TC_DIMS(__half, e4m3, f16_fp8)
#undef PAGED_DECODE_TC_DIMS
#undef PAGED_DECODE_TC
#undef PAGED_DECODE_TK_EARLY
#undef PAGED_DECODE_TC_W
