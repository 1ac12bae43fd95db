// y = x W^T for a few rows of x (decode batches): bound by reading W once. One CTA owns R rows of
// W and spreads k over all its threads: each thread issues U * R 16-byte weight loads (a CTA
// reads R contiguous 4 KB runs per step) before using any, multiplies them with every row of x
// (read through L1, shared by the CTA's rows), and the CTA reduces through warp shuffles and
// shared memory. Compared with a warp per row this keeps more bytes in flight per thread and
// reads x once per R rows. x: [m, k], W: [n, k], y: [m, n], all contiguous; k a multiple of the
// values in 16 bytes of W (8 for 16-bit W, 16 for FP8), m <= M. Launch: ceil(n / R) CTAs of NT
// threads (the host's table in gemv.rs).
//
// W is stored as the activations' 16-bit type (`DenseW`) or as FP8 E4M3 with one f32 scale per
// row (`Fp8W`: each row's sum is multiplied by its scale before it is rounded).
//
// GLU: W is a fused gate-up projection ([2I, k], gate rows then up rows) and y = silu(x G^T) *
// (x U^T), [m, I]: a CTA owns R/2 gate rows and the R/2 up rows of the same outputs, so the
// SiLU-and-multiply runs in its epilogue (on the products rounded to T, as the separate ops do).
// Launch: ceil(I / (R/2)) CTAs.
#include "common.cuh"
#include <cuda_fp8.h>

namespace {

// Weights in the activations' type: 8 values per 16 bytes, no row scales.
template <typename T> struct DenseW {
  static constexpr int kVals = 8;
  __device__ __forceinline__ static void unpack(const uint4& v, float* f) { Vec16<T>::unpack(v, f); }
};

// 16 FP8 E4M3 values per 16 bytes (converted in pairs through f16, which holds every E4M3 value).
struct Fp8W {
  static constexpr int kVals = 16;
  __device__ __forceinline__ static void unpack(const uint4& v, float* f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(
            static_cast<__nv_fp8x2_storage_t>(w[i] >> (16 * h)), __NV_E4M3);
        const float2 t = __half22float2(*reinterpret_cast<const __half2*>(&r));
        f[4 * i + 2 * h] = t.x;
        f[4 * i + 2 * h + 1] = t.y;
      }
    }
  }
};

constexpr int kGemvRows = 4;  // R
constexpr int kGemvSteps = 2;  // U

// Sums each thread's partial products acc[r][i] (row r of the CTA's rows of W times x's row i)
// over the CTA through warp shuffles and shared memory; entry r * M + i of the result is
// cta_sum(red, r * M + i). Ends with a barrier.
template <int M, int R, int NT>
__device__ __forceinline__ const float* gemv_reduce(const float (&acc)[R][M]) {
  __shared__ float red[NT / 32][R * M];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int i = 0; i < M; ++i) {
      const float v = warp_sum(acc[r][i]);
      if (lane == 0) red[warp][r * M + i] = v;
    }
  __syncthreads();
  return &red[0][0];
}

template <int M, int R, int NT>
__device__ __forceinline__ float cta_sum(const float* red, int e) {
  float s = 0.f;
#pragma unroll
  for (int wp = 0; wp < NT / 32; ++wp) s += red[wp * R * M + e];
  return s;
}

// The epilogue of the streaming products after gemv_reduce: writes y (`outs` wide) for the CTA's
// rows row0 .. row0 + rows; `row_scale` (may be null) multiplies each row's sum; in the GLU form
// rows R/2.. are the up rows of the gate rows 0..R/2 and y is SiLU(gate) * up, both rounded to T
// first.
template <typename T, int M, int R, int NT, bool GLU>
__device__ __forceinline__ void gemv_store(T* __restrict__ y, const float* red,
                                           const float* __restrict__ row_scale, int m, int outs,
                                           int row0, int rows) {
  constexpr int RO = GLU ? R / 2 : R;
  const int tid = threadIdx.x;
  if (tid < RO * M) {
    const int r = tid / M, i = tid % M;
    float s = cta_sum<M, R, NT>(red, tid);
    const int orow = row0 + min(r, rows - 1);
    if (row_scale != nullptr) s *= row_scale[orow];
    if (GLU) {
      float u = cta_sum<M, R, NT>(red, RO * M + tid);
      if (row_scale != nullptr) u *= row_scale[outs + orow];
      const float g = to_f32(from_f32<T>(s));
      s = g / (1.f + __expf(-g)) * to_f32(from_f32<T>(u));
    }
    if (r < rows && i < m) y[(size_t)i * outs + row0 + r] = from_f32<T>(s);
  }
}

// Streams the R rows of W at wr (each k values of W's format) against the first m rows of x
// ([m, k] contiguous) into acc. Launched as a dependent kernel, the first weight loads overlap the
// previous kernel's tail: x (its output) is read only after pdl_wait.
template <typename T, typename W, int M, int R, int U, int NT>
__device__ __forceinline__ void gemv_stream(float (&acc)[R][M], const uint4* const (&wr)[R],
                                            const T* __restrict__ x, int m, int k) {
  constexpr int XV = W::kVals / 8;  // 16-byte loads of x per chunk of W
  const int tid = threadIdx.x;
  const int chunks = k / W::kVals;  // 16-byte chunks per row of W
  const int xchunks = k / 8;        // 16-byte chunks per row of x
  const uint4* xv = reinterpret_cast<const uint4*>(x);
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int i = 0; i < M; ++i) acc[r][i] = 0.f;

  bool waited = false;
  for (int c0 = tid; c0 < chunks; c0 += NT * U) {
    uint4 wv[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + NT * u;
#pragma unroll
      for (int r = 0; r < R; ++r) wv[u][r] = c < chunks ? __ldcs(wr[r] + c) : make_uint4(0, 0, 0, 0);
    }
    if (!waited) {
      pdl_wait();
      waited = true;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + NT * u;
      if (c >= chunks) break;
      float xf[M][W::kVals];
#pragma unroll
      for (int i = 0; i < M; ++i) {
        if (i < m) {
#pragma unroll
          for (int h = 0; h < XV; ++h)
            Vec16<T>::unpack(__ldg(xv + (size_t)i * xchunks + (size_t)c * XV + h), xf[i] + 8 * h);
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float a[W::kVals];
        W::unpack(wv[u][r], a);
#pragma unroll
        for (int i = 0; i < M; ++i) {
          if (i < m) {
#pragma unroll
            for (int e = 0; e < W::kVals; ++e) acc[r][i] = fmaf(a[e], xf[i][e], acc[r][i]);
          }
        }
      }
    }
  }
  if (!waited) pdl_wait();
}

// The row pointers of the CTA owning outputs row0 .. row0 + rows of y (`outs` wide): W's rows
// from w (each wrow_bytes long), in the GLU form the gate rows then the up rows `outs` later.
template <int R, bool GLU>
__device__ __forceinline__ void gemv_rows(const uint4* (&wr)[R], const void* w, size_t wrow_bytes,
                                          int outs, int row0, int rows) {
  constexpr int RO = GLU ? R / 2 : R;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int wrow = row0 + min(r % RO, rows - 1) + (GLU && r >= RO ? outs : 0);
    wr[r] = reinterpret_cast<const uint4*>(static_cast<const char*>(w) + wrow * wrow_bytes);
  }
}

template <typename T, typename W, int M, int R, int U, int NT, bool GLU = false>
__device__ void gemv_impl(T* __restrict__ y, const T* __restrict__ x, const void* __restrict__ w,
                          const float* __restrict__ row_scale, int m, int n, int k) {
  pdl_trigger();  // the next kernel may launch (it waits for this one)
  constexpr int RO = GLU ? R / 2 : R;  // output rows per CTA
  const int outs = GLU ? n / 2 : n;    // width of y
  const int row0 = blockIdx.x * RO;
  const int rows = min(RO, outs - row0);
  const uint4* wr[R];
  gemv_rows<R, GLU>(wr, w, (size_t)(k / W::kVals) * 16, outs, row0, rows);
  float acc[R][M];
  gemv_stream<T, W, M, R, U, NT>(acc, wr, x, m, k);
  gemv_store<T, M, R, NT, GLU>(y, gemv_reduce<M, R, NT>(acc), row_scale, m, outs, row0, rows);
}

}  // namespace

// gemv[_fp8]_m<M>_<dtype>: NT = 256 threads for M <= 2, 128 for M = 4, U steps in flight (what
// measured fastest on H100: 2, and 1 for one row of FP8 weights). The 16-bit form takes no scales
// (row_scale null).
#define GEMV_M(T, NAME, WT, WNAME, M, NT, U)                                                        \
  extern "C" __global__ void __launch_bounds__(NT) gemv##WNAME##_m##M##_##NAME(                     \
      T* y, const T* x, const void* w, const float* row_scale, int m, int n, int k) {              \
    gemv_impl<T, WT, M, kGemvRows, U, NT>(y, x, w, row_scale, m, n, k);                             \
  }
// gemv_glu[_fp8]_m<M>_<dtype>: the GLU form, 4 gate + 4 up rows per CTA, one step in flight (the
// same loads in flight per thread as the plain form); NT as the plain form's but 128 for one row
// of FP8 weights (gemv.rs: gemv_kernel_shape).
#define GEMV_GLU_M(T, NAME, WT, WNAME, M, NT)                                                       \
  extern "C" __global__ void __launch_bounds__(NT) gemv_glu##WNAME##_m##M##_##NAME(                 \
      T* y, const T* x, const void* w, const float* row_scale, int m, int n, int k) {              \
    gemv_impl<T, WT, M, 2 * kGemvRows, 1, NT, true>(y, x, w, row_scale, m, n, k);                   \
  }
#define GEMV_W(T, NAME, WT, WNAME, U1, GLU_NT1)                                                     \
  GEMV_M(T, NAME, WT, WNAME, 1, 256, U1) GEMV_M(T, NAME, WT, WNAME, 2, 256, kGemvSteps)             \
  GEMV_M(T, NAME, WT, WNAME, 4, 128, kGemvSteps) GEMV_GLU_M(T, NAME, WT, WNAME, 1, GLU_NT1)         \
  GEMV_GLU_M(T, NAME, WT, WNAME, 2, 256) GEMV_GLU_M(T, NAME, WT, WNAME, 4, 128)
#define GEMV(T, NAME) GEMV_W(T, NAME, DenseW<T>, , kGemvSteps, 256) GEMV_W(T, NAME, Fp8W, _fp8, 1, 128)
GEMV(__nv_bfloat16, bf16)
GEMV(__half, f16)
