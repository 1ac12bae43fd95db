// Tensor-core and asynchronous-copy building blocks (sm_80+ instructions) shared by the
// attention kernels: mma.sync m16n8k16 with f32 accumulation, ldmatrix, cp.async, exp2.
#pragma once
#include "common.cuh"

// tc_mma<T>::run: c += a (16x16, row-major) * b (16x8, col-major); tc_mma<T>::pack: two floats
// as one register of the A operand, lo being the lower column.
template <typename T> struct tc_mma;
#define TC_MMA(T, PTX_TYPE, T2, PACK2)                                                            \
  template <> struct tc_mma<T> {                                                                \
    static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4],          \
                                               uint32_t b0, uint32_t b1) {                      \
      asm("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE                        \
          ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                        \
          : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                      \
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                      \
    }                                                                                           \
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {                      \
      const T2 v = PACK2(lo, hi);                                                               \
      return *reinterpret_cast<const uint32_t*>(&v);                                            \
    }                                                                                           \
  };
TC_MMA(__nv_bfloat16, "bf16", __nv_bfloat162, __floats2bfloat162_rn)
TC_MMA(__half, "f16", __half2, __floats2half2_rn)
#undef TC_MMA

__device__ __forceinline__ uint32_t tc_smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronous; zeros instead when !valid (src is then not read).
__device__ __forceinline__ void tc_cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(tc_smem_addr(dst)),
               "l"(__cvta_generic_to_global(src)), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void tc_cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most N committed groups of this thread are still in flight.
template <int N> __device__ __forceinline__ void tc_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, register i receives
// (row lane / 4, columns 2 * (lane % 4) + {0, 1}) of matrix i, or its transpose with .trans.
__device__ __forceinline__ void tc_ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(tc_smem_addr(p)));
}
__device__ __forceinline__ void tc_ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(tc_smem_addr(p)));
}

// The transpose of an 8x8 b16 matrix held one register per lane in fragment layout (lane
// 4r + c holds row r, columns 2c and 2c + 1): afterwards the lane holds the same place of the
// transpose.
__device__ __forceinline__ uint32_t tc_movmatrix_trans(uint32_t a) {
  uint32_t d;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(a));
  return d;
}

// 2^x on the special function unit (x <= 0 here; -inf gives 0, tiny results flush to 0).
__device__ __forceinline__ float tc_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Folds a tile's max mx into the running max m; returns the factor that rescales what was summed
// before, and sets m_use, the max the tile's exponents subtract (0 while no key has been seen, so
// no NaN).
__device__ __forceinline__ float tc_fold_max(float& m, float mx, float& m_use) {
  const float m_new = fmaxf(m, mx);
  m_use = m_new == -INFINITY ? 0.f : m_new;
  const float corr = tc_exp2(m - m_use);
  m = m_new;
  return corr;
}

// One online-softmax step of flash attention over a tile's scores in C fragments (log2 domain):
// s[nb][e] is row g + 8 (e >> 1) of key block nb, a row's keys spread over the 4 lanes of a quad.
// Folds the tile's row max into m, rescales the accumulators o and the sums l, and replaces s by
// exp2(s - m). A row that has seen no key yet keeps p = 0 and no NaN.
template <int NB, int ND>
__device__ __forceinline__ void tc_online_softmax(float (&s)[NB][4], float (&o)[ND][4],
                                                  float (&m)[2], float (&l)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = -INFINITY;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) mx = fmaxf(mx, fmaxf(s[nb][2 * h], s[nb][2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    float m_use;
    const float corr = tc_fold_max(m[h], mx, m_use);
    l[h] *= corr;
#pragma unroll
    for (int nd = 0; nd < ND; ++nd) {
      o[nd][2 * h] *= corr;
      o[nd][2 * h + 1] *= corr;
    }
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      s[nb][2 * h] = tc_exp2(s[nb][2 * h] - m_use);
      s[nb][2 * h + 1] = tc_exp2(s[nb][2 * h + 1] - m_use);
      l[h] += s[nb][2 * h] + s[nb][2 * h + 1];
    }
  }
}

// The same step with keys as the rows of the fragments and query heads as their columns (the
// scores S^T = K Q^T of one 16-key tile): s[e] is key g + 8 (e >> 1) of head 2t + (e & 1), a
// head's 16 keys spread over the 8 lanes of equal t. o holds O^T (head dims x heads) in the same
// column layout; l keeps this lane's part of each head's sum (the caller adds the lanes at the
// end).
template <int ND>
__device__ __forceinline__ void tc_online_softmax_cols(float (&s)[4], float (&o)[ND][4],
                                                       float (&m)[2], float (&l)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float mx = fmaxf(s[i], s[2 + i]);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
    float m_use;
    const float corr = tc_fold_max(m[i], mx, m_use);
#pragma unroll
    for (int n = 0; n < ND; ++n) {
      o[n][i] *= corr;
      o[n][2 + i] *= corr;
    }
    s[i] = tc_exp2(s[i] - m_use);
    s[2 + i] = tc_exp2(s[2 + i] - m_use);
    l[i] = l[i] * corr + s[i] + s[2 + i];
  }
}

// The two products of one flash-attention tile for a warp's 16 query rows, on a tile of BK keys
// held in shared memory as rows of LD elements (K row-major, which is the col-major B operand).
// tc_tile_scores: s = Q K^T, qa the warp's Q as A fragments over D (one ldmatrix x4 per 16
// dims); one x4 = keys +0..7 / +8..15 (lane bit 4) x dims +0 / +8 (lane bit 3). s[nb][e] is row
// g + 8 (e >> 1), key 8 nb + 2t + (e & 1).
template <typename MT, int D, int BK, int LD>
__device__ __forceinline__ void tc_tile_scores(float (&s)[BK / 8][4], const uint32_t (&qa)[D / 16][4],
                                               const MT* sk, int lane) {
#pragma unroll
  for (int nb = 0; nb < BK / 8; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int j = 0; j < BK / 16; ++j) {
      uint32_t b[4];
      tc_ldmatrix_x4(b, sk + (16 * j + (lane & 7) + 8 * (lane >> 4)) * LD + 16 * kk + 8 * ((lane >> 3) & 1));
      tc_mma<MT>::run(s[2 * j], qa[kk], b[0], b[1]);
      tc_mma<MT>::run(s[2 * j + 1], qa[kk], b[2], b[3]);
    }
  }
}

// tc_tile_pv: o += P V, P the tile's probabilities left in s by tc_online_softmax. The C
// fragments of key blocks 2ks, 2ks + 1 are the A fragment of key step ks; one x4 .trans = keys
// +0..7 / +8..15 (lane bit 3) x dims +0 / +8 (lane bit 4): b0, b1 of column block 2n and of 2n + 1.
template <typename MT, int D, int BK, int LD>
__device__ __forceinline__ void tc_tile_pv(float (&o)[D / 8][4], const float (&s)[BK / 8][4],
                                           const MT* sv, int lane) {
  using Mma = tc_mma<MT>;
#pragma unroll
  for (int ks = 0; ks < BK / 16; ++ks) {
    const uint32_t pa[4] = {Mma::pack(s[2 * ks][0], s[2 * ks][1]), Mma::pack(s[2 * ks][2], s[2 * ks][3]),
                            Mma::pack(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                            Mma::pack(s[2 * ks + 1][2], s[2 * ks + 1][3])};
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
      uint32_t b[4];
      tc_ldmatrix_x4_trans(b, sv + (16 * ks + (lane & 7) + 8 * ((lane >> 3) & 1)) * LD + 16 * n + 8 * (lane >> 4));
      Mma::run(o[2 * n], pa, b[0], b[1]);
      Mma::run(o[2 * n + 1], pa, b[2], b[3]);
    }
  }
}

// The two rows' softmax sums of a quad (each lane summed its share into l) as the factor that
// normalises them: 1 / sum, or 0 for a row that saw no key.
__device__ __forceinline__ float tc_row_inv_sum(float l) {
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  return l > 0.f ? 1.f / l : 0.f;
}
