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
