// GGML block weights on the GPU (`--isq q8_0|q4_0|q4k|q6k`, GGUF files): quantizers, the decode
// products and a dequantizer for larger batches.
//
// Layout (rserve's, not ggml's file layout: every load is aligned). A weight [n, k] is row-major
// in blocks; each block's f16 scale `d` moves to a separate array [n, k / block] and the rest of
// the block stays in ggml's order:
//   q8_0: 32 int8 per block                         (data 32 B, d)
//   q4_0: 16 bytes of 4-bit levels                  (data 16 B, d)
//   q5_0: qh (u32), then 16 bytes of low 4 bits     (data 20 B, d)
//   q4k : ggml's block whole (d, dmin, scales, qs)  (data 144 B, no d array)
//   q6k : ql (128 B), qh (64 B), scales (16 B)      (data 208 B, d)
// `ggml::split`/`join` in ggml.rs convert from and to ggml's bytes.
//
// The quantizers write the bits of ggml's reference quantizers (`quantize_row_*_ref`, and
// rserve's CPU port in quantize.rs): every step is one IEEE f32 operation in the same order
// (__fmul_rn and friends, which are never fused), so q4k's and q6k's scale searches take the same
// branches.
#include "common.cuh"

namespace {

// ---- formats: a thread's unit of work is a chunk of kVals values of one row, read with aligned
// loads (Raw), unpacked to floats in run order: run r is 8 consecutive values of the row starting
// at run(c, r). `unpack` gives the weights (the dequantizer); the products use `mant` and `coef`
// instead, which avoid int-to-float conversions (an eighth of the FP32 rate on Hopper): `mant`
// gives each level q of a run as the float 1 + q / 2^bits (its bits placed into the mantissa of
// 1.0: two integer ops), and the run's weights times x sum to coef.x * S + coef.y * X, where S is
// the sum of mant * x and X the sum of x over the run.

// Bits [at, at + N) of w moved to [to, to + N), the rest cleared (at, to fold to constants).
template <int N> __device__ __forceinline__ uint32_t field(uint32_t w, int at, int to) {
  const uint32_t v = to >= at ? (w << (to - at)) : (w >> (at - to));
  return v & (((1u << N) - 1) << to);
}
// Byte i (run-time) of a 16-byte vector, by selects rather than a trip through local memory.
__device__ __forceinline__ uint32_t byte_at(const uint4& v, int i) {
  const uint32_t w = i < 8 ? (i < 4 ? v.x : v.y) : (i < 12 ? v.z : v.w);
  return (w >> (8 * (i & 3))) & 0xff;
}
__device__ __forceinline__ float one_plus(uint32_t mant) { return __uint_as_float(0x3F800000u | mant); }

// The levels of run r of a 16-byte chunk of nibbles in ggml's order (runs 0, 1: the low nibbles
// of bytes 0-7, 8-15; runs 2, 3: their high nibbles) as 1 + q / 16.
__device__ __forceinline__ void nibble_mant(const uint4& q, int r, float* f) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int e = 0; e < 8; ++e) f[e] = one_plus(field<4>(w[2 * (r & 1) + (e >> 2)], 8 * (e & 3) + 4 * (r >> 1), 19));
}

struct Q8_0B {
  static constexpr int kBlock = 32, kVals = 16, kSteps = 2;
  struct Raw { uint4 q; __half d; };
  struct Row { const uint4* q; const __half* d; };
  __device__ static Row row(const void* w, const void* d, int r, int k) {
    return {reinterpret_cast<const uint4*>(static_cast<const char*>(w) + (size_t)r * k),
            static_cast<const __half*>(d) + (size_t)r * (k / kBlock)};
  }
  __device__ static Raw load(const Row& w, int c) { return {__ldcs(w.q + c), __ldg(w.d + (c >> 1))}; }
  __device__ static int run(int c, int r) { return 16 * c + 8 * r; }
  __device__ static void unpack(const Raw& raw, int, float* f) {
    const float d = __half2float(raw.d);
    const uint32_t w[4] = {raw.q.x, raw.q.y, raw.q.z, raw.q.w};
#pragma unroll
    for (int i = 0; i < 16; ++i) f[i] = d * (float)(int8_t)(w[i >> 2] >> (8 * (i & 3)));
  }
  // q + 128 as 1 + u / 256: sum (q x) = 256 S - 384 X
  __device__ static void mant(const Raw& raw, int, int r, float* f) {
    const uint32_t w[4] = {raw.q.x, raw.q.y, raw.q.z, raw.q.w};
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = one_plus(field<8>(w[2 * r + (e >> 2)] ^ 0x80808080u, 8 * (e & 3), 15));
  }
  __device__ static float2 coef(const Raw& raw, int, int) {
    const float d = __half2float(raw.d);
    return make_float2(256.f * d, -384.f * d);
  }
};

struct Q4_0B {
  static constexpr int kBlock = 32, kVals = 32, kSteps = 2;
  struct Raw { uint4 q; __half d; };
  struct Row { const uint4* q; const __half* d; };
  __device__ static Row row(const void* w, const void* d, int r, int k) {
    return {reinterpret_cast<const uint4*>(w) + (size_t)r * (k / kBlock),
            static_cast<const __half*>(d) + (size_t)r * (k / kBlock)};
  }
  __device__ static Raw load(const Row& w, int c) { return {__ldcs(w.q + c), __ldg(w.d + c)}; }
  __device__ static int run(int c, int r) { return 32 * c + 8 * r; }
  __device__ static void unpack(const Raw& raw, int, float* f) {
    const float d = __half2float(raw.d);
    const uint32_t w[4] = {raw.q.x, raw.q.y, raw.q.z, raw.q.w};
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const uint32_t b = (w[j >> 2] >> (8 * (j & 3))) & 0xff;
      f[j] = d * (float)((int)(b & 15) - 8);
      f[16 + j] = d * (float)((int)(b >> 4) - 8);
    }
  }
  // sum ((q - 8) x) = 16 S - 24 X
  __device__ static void mant(const Raw& raw, int, int r, float* f) { nibble_mant(raw.q, r, f); }
  __device__ static float2 coef(const Raw& raw, int, int) {
    const float d = __half2float(raw.d);
    return make_float2(16.f * d, -24.f * d);
  }
};

struct Q5_0B {
  static constexpr int kBlock = 32, kVals = 32, kSteps = 2;
  struct Raw { uint32_t w[5]; __half d; };
  struct Row { const uint32_t* q; const __half* d; };
  __device__ static Row row(const void* w, const void* d, int r, int k) {
    return {static_cast<const uint32_t*>(w) + (size_t)r * (k / kBlock) * 5,
            static_cast<const __half*>(d) + (size_t)r * (k / kBlock)};
  }
  __device__ static Raw load(const Row& w, int c) {
    Raw raw;
#pragma unroll
    for (int i = 0; i < 5; ++i) raw.w[i] = __ldcs(w.q + 5 * c + i);
    raw.d = __ldg(w.d + c);
    return raw;
  }
  __device__ static int run(int c, int r) { return 32 * c + 8 * r; }
  __device__ static void unpack(const Raw& raw, int, float* f) {
    const float d = __half2float(raw.d);
    const uint32_t qh = raw.w[0];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const uint32_t b = (raw.w[1 + (j >> 2)] >> (8 * (j & 3))) & 0xff;
      f[j] = d * (float)((int)((b & 15) | (((qh >> j) & 1) << 4)) - 16);
      f[16 + j] = d * (float)((int)((b >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
  }
  // 5-bit levels as 1 + q / 32: sum ((q - 16) x) = 32 S - 48 X
  __device__ static void mant(const Raw& raw, int, int r, float* f) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int j = 8 * (r & 1) + e;  // byte, and value j or 16 + j
      f[e] = one_plus(field<4>(raw.w[1 + (j >> 2)], 8 * (j & 3) + 4 * (r >> 1), 18) |
                      field<1>(raw.w[0], j + 16 * (r >> 1), 22));
    }
  }
  __device__ static float2 coef(const Raw& raw, int, int) {
    const float d = __half2float(raw.d);
    return make_float2(32.f * d, -48.f * d);
  }
};

// The 6-bit scale and minimum of sub-block j of a q4k block's 12 scale bytes.
__device__ __forceinline__ void q4k_scale_min(int j, const uint8_t* q, int& s, int& m) {
  if (j < 4) {
    s = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    s = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// q4k: chunk c is 16 bytes of a block's levels: values 64g + 16p + (0..16) (low nibbles,
// sub-block 2g) and 64g + 32 + 16p + (0..16) (high nibbles, sub-block 2g + 1), i = c % 8 = 2g + p.
struct Q4KB {
  static constexpr int kBlock = 256, kVals = 32, kSteps = 2;
  struct Raw { uint4 q; uint4 head; };
  struct Row { const uint4* q; };
  __device__ static Row row(const void* w, const void*, int r, int k) {
    return {reinterpret_cast<const uint4*>(w) + (size_t)r * (k / kBlock) * 9};
  }
  __device__ static Raw load(const Row& w, int c) {
    const int sb = c >> 3;
    return {__ldcs(w.q + 9 * sb + 1 + (c & 7)), __ldg(w.q + 9 * sb)};
  }
  __device__ static int run(int c, int r) {
    const int i = c & 7;
    return 256 * (c >> 3) + 64 * (i >> 1) + 16 * (i & 1) + (r >= 2 ? 32 : 0) + 8 * (r & 1);
  }
  __device__ static void unpack(const Raw& raw, int c, float* f) {
    const uint32_t h[4] = {raw.head.x, raw.head.y, raw.head.z, raw.head.w};
    const float d = __half2float(__ushort_as_half((unsigned short)(h[0] & 0xffff)));
    const float dmin = __half2float(__ushort_as_half((unsigned short)(h[0] >> 16)));
    const uint8_t* sc = reinterpret_cast<const uint8_t*>(h) + 4;
    const int g = (c & 7) >> 1;
    int s0, m0, s1, m1;
    q4k_scale_min(2 * g, sc, s0, m0);
    q4k_scale_min(2 * g + 1, sc, s1, m1);
    const float d0 = d * s0, o0 = dmin * m0, d1 = d * s1, o1 = dmin * m1;
    const uint32_t w[4] = {raw.q.x, raw.q.y, raw.q.z, raw.q.w};
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const uint32_t b = (w[j >> 2] >> (8 * (j & 3))) & 0xff;
      f[j] = d0 * (float)(b & 15) - o0;
      f[16 + j] = d1 * (float)(b >> 4) - o1;
    }
  }
  // runs 0, 1: sub-block 2g, runs 2, 3: 2g + 1; sum ((d s q - dmin m) x) = 16 d s S - (16 d s + dmin m) X
  __device__ static void mant(const Raw& raw, int, int r, float* f) { nibble_mant(raw.q, r, f); }
  __device__ static float2 coef(const Raw& raw, int c, int r) {
    const float d = __half2float(__ushort_as_half((unsigned short)(raw.head.x & 0xffff)));
    const float dmin = __half2float(__ushort_as_half((unsigned short)(raw.head.x >> 16)));
    // q4k_scale_min of sub-block j over the header's bytes 4..15
    const int j = 2 * ((c & 7) >> 1) + (r >> 1);
    int sc, m;
    if (j < 4) {
      sc = byte_at(raw.head, 4 + j) & 63;
      m = byte_at(raw.head, 8 + j) & 63;
    } else {
      const uint32_t b = byte_at(raw.head, 8 + j);
      sc = (b & 0xF) | ((byte_at(raw.head, j) >> 6) << 4);
      m = (b >> 4) | ((byte_at(raw.head, 4 + j) >> 6) << 4);
    }
    const float ds = 16.f * d * (float)sc;
    return make_float2(ds, -(ds + dmin * (float)m));
  }
};

// q6k: chunk c covers l = 16p + (0..16) of half h of a block (i = c % 4 = 2h + p): the values
// 128h + 32q + l for q = 0..3, from ql[64h + l] (q = 0, 2), ql[64h + 32 + l] (q = 1, 3) and
// qh[32h + l].
struct Q6KB {
  static constexpr int kBlock = 256, kVals = 64, kSteps = 1;
  struct Raw { uint4 a, b, h, s; __half d; };
  struct Row { const uint4* q; const __half* d; };
  __device__ static Row row(const void* w, const void* d, int r, int k) {
    return {reinterpret_cast<const uint4*>(w) + (size_t)r * (k / kBlock) * 13,
            static_cast<const __half*>(d) + (size_t)r * (k / kBlock)};
  }
  __device__ static Raw load(const Row& w, int c) {
    const uint4* b = w.q + 13 * (c >> 2);
    const int h = (c >> 1) & 1, p = c & 1;
    return {__ldcs(b + 4 * h + p), __ldcs(b + 4 * h + 2 + p), __ldcs(b + 8 + 2 * h + p), __ldg(b + 12),
            __ldg(w.d + (c >> 2))};
  }
  __device__ static int run(int c, int r) {
    return 256 * (c >> 2) + 128 * ((c >> 1) & 1) + 32 * (r >> 1) + 16 * (c & 1) + 8 * (r & 1);
  }
  __device__ static void unpack(const Raw& raw, int c, float* f) {
    const float d = __half2float(raw.d);
    const uint32_t s[4] = {raw.s.x, raw.s.y, raw.s.z, raw.s.w};
    const int8_t* sc = reinterpret_cast<const int8_t*>(s) + 8 * ((c >> 1) & 1) + (c & 1);
    float ds[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) ds[q] = d * (float)sc[2 * q];
    const uint32_t a[4] = {raw.a.x, raw.a.y, raw.a.z, raw.a.w};
    const uint32_t b[4] = {raw.b.x, raw.b.y, raw.b.z, raw.b.w};
    const uint32_t hh[4] = {raw.h.x, raw.h.y, raw.h.z, raw.h.w};
#pragma unroll
    for (int l = 0; l < 16; ++l) {
      const int sh = 8 * (l & 3);
      const uint32_t la = (a[l >> 2] >> sh) & 0xff, lb = (b[l >> 2] >> sh) & 0xff;
      const uint32_t lh = (hh[l >> 2] >> sh) & 0xff;
      f[l] = ds[0] * (float)((int)((la & 15) | ((lh & 3) << 4)) - 32);
      f[16 + l] = ds[1] * (float)((int)((lb & 15) | (((lh >> 2) & 3) << 4)) - 32);
      f[32 + l] = ds[2] * (float)((int)((la >> 4) | (((lh >> 4) & 3) << 4)) - 32);
      f[48 + l] = ds[3] * (float)((int)((lb >> 4) | (((lh >> 6) & 3) << 4)) - 32);
    }
  }
  // run r: level group r / 2 (a, b, c, d above), l = 8 (r % 2) + (0..8); 6-bit levels as
  // 1 + q / 64: sum (d sc (q - 32) x) = 64 d sc S - 96 d sc X
  __device__ static void mant(const Raw& raw, int, int r, float* f) {
    const int grp = r >> 1;
    const uint32_t ql[4] = {(grp & 1) ? raw.b.x : raw.a.x, (grp & 1) ? raw.b.y : raw.a.y,
                            (grp & 1) ? raw.b.z : raw.a.z, (grp & 1) ? raw.b.w : raw.a.w};
    const uint32_t qh[4] = {raw.h.x, raw.h.y, raw.h.z, raw.h.w};
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int l = 8 * (r & 1) + e;
      f[e] = one_plus(field<4>(ql[l >> 2], 8 * (l & 3) + 4 * (grp >> 1), 17) |
                      field<2>(qh[l >> 2], 8 * (l & 3) + 2 * grp, 21));
    }
  }
  __device__ static float2 coef(const Raw& raw, int c, int r) {
    const int8_t sc = (int8_t)byte_at(raw.s, 8 * ((c >> 1) & 1) + (c & 1) + 2 * (r >> 1));
    const float ds = __half2float(raw.d) * (float)sc;
    return make_float2(64.f * ds, -96.f * ds);
  }
};

// ---- decode products: y = x W^T for m <= M rows of x. A CTA owns R rows of W; its threads take
// chunks of k in turn and issue U * R chunk loads before using any; each run of 8 values of x
// (read through L1) is converted once and multiplied with the levels of every row; gemv_store
// (gemv.cu) reduces and writes y. The GLU form takes R/2 gate rows and the R/2 up rows of the
// same outputs.
template <typename T, typename F, int M, int R, int NT, bool GLU>
__device__ void ggml_gemv_impl(T* __restrict__ y, const T* __restrict__ x, const void* __restrict__ w,
                               const void* __restrict__ d, int m, int n, int k) {
  constexpr int U = GLU ? 1 : F::kSteps;  // the GLU form has twice the rows in flight
  constexpr int RO = GLU ? R / 2 : R;
  const int outs = GLU ? n / 2 : n;
  const int row0 = blockIdx.x * RO;
  const int rows = min(RO, outs - row0);
  const int chunks = k / F::kVals;
  typename F::Row wr[R];
#pragma unroll
  for (int r = 0; r < R; ++r)
    wr[r] = F::row(w, d, row0 + min(r % RO, rows - 1) + (GLU && r >= RO ? outs : 0), k);
  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int i = 0; i < M; ++i) acc[r][i] = 0.f;

  bool waited = false;
  for (int c0 = threadIdx.x; c0 < chunks; c0 += NT * U) {
    typename F::Raw raw[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = min(c0 + NT * u, chunks - 1);
#pragma unroll
      for (int r = 0; r < R; ++r) raw[u][r] = F::load(wr[r], c);
    }
    if (!waited) {
      pdl_wait();
      waited = true;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + NT * u;
      if (c >= chunks) break;
      // each run of 8 values: x converted once, then every row's levels against it
#pragma unroll
      for (int run = 0; run < F::kVals / 8; ++run) {
        float xf[M][8], xs[M];
#pragma unroll
        for (int i = 0; i < M; ++i) {
          if (i < m) {
            Vec16<T>::unpack(ldg16(x + (size_t)i * k + F::run(c, run)), xf[i]);
            xs[i] = ((xf[i][0] + xf[i][1]) + (xf[i][2] + xf[i][3])) + ((xf[i][4] + xf[i][5]) + (xf[i][6] + xf[i][7]));
          }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float f[8];
          F::mant(raw[u][r], c, run, f);
          const float2 co = F::coef(raw[u][r], c, run);
#pragma unroll
          for (int i = 0; i < M; ++i) {
            if (i < m) {
              float sum = f[0] * xf[i][0];
#pragma unroll
              for (int e = 1; e < 8; ++e) sum = fmaf(f[e], xf[i][e], sum);
              acc[r][i] = fmaf(co.x, sum, fmaf(co.y, xs[i], acc[r][i]));
            }
          }
        }
      }
    }
  }
  if (!waited) pdl_wait();
  gemv_store<T, M, R, NT, GLU>(y, acc, nullptr, m, outs, row0, rows);
}

// ---- the weight in T [n, k] (products over more rows dequantize, then multiply on tensor
// cores). One thread per chunk.
template <typename T, typename F>
__device__ void ggml_dequantize_impl(T* __restrict__ out, const void* __restrict__ w,
                                     const void* __restrict__ d, int n, int k) {
  const int chunks = k / F::kVals;
  const size_t total = (size_t)n * chunks;
  pdl_wait();
  for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < total;
       t += (size_t)gridDim.x * blockDim.x) {
    const int r = (int)(t / chunks), c = (int)(t % chunks);
    float a[F::kVals];
    F::unpack(F::load(F::row(w, d, r, k), c), c, a);
    T* o = out + (size_t)r * k;
#pragma unroll
    for (int run = 0; run < F::kVals / 8; ++run)
#pragma unroll
      for (int h = 0; h < 8; h += Vec16<T>::N) store16(o + F::run(c, run) + h, a + 8 * run + h);
  }
}

// ---- quantizers: f32 steps that are never fused, in the order of quantize.rs.
__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float dvd(float a, float b) { return __fdiv_rn(a, b); }
// ggml's nearest_int: round half to even through the float adder.
__device__ __forceinline__ int nearest_int(float v) {
  return (int)(__float_as_uint(add(v, 12582912.f)) & 0x007fffff) - 0x00400000;
}
__device__ __forceinline__ float f16_round(float v) { return __half2float(__float2half_rn(v)); }
__device__ __forceinline__ unsigned short f16_bits(float v) { return __half_as_ushort(__float2half_rn(v)); }

template <typename T> __device__ __forceinline__ void load_block(const T* x, float* v, int n) {
  for (int i = 0; i < n; i += Vec16<T>::N) load16(x + i, v + i);
}

// One thread per block of 32.
template <typename T>
__device__ void quantize_q8_0(uint8_t* q, __half* dd, const T* x, size_t blocks) {
  pdl_wait();
  const size_t b = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (b >= blocks) return;
  float v[32];
  load_block(x + 32 * b, v, 32);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(v[i]));
  const float d = dvd(amax, 127.f);
  const float id = d != 0.f ? dvd(1.f, d) : 0.f;
  dd[b] = __float2half_rn(d);
  uint32_t o[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) word |= ((uint32_t)(uint8_t)(int8_t)roundf(mul(v[4 * i + j], id))) << (8 * j);
    o[i] = word;
  }
  uint4* out = reinterpret_cast<uint4*>(q + 32 * b);
  out[0] = make_uint4(o[0], o[1], o[2], o[3]);
  out[1] = make_uint4(o[4], o[5], o[6], o[7]);
}

// The value of largest magnitude, the first such.
__device__ __forceinline__ float signed_max(const float* v) {
  float amax = 0.f, best = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i)
    if (amax < fabsf(v[i])) {
      amax = fabsf(v[i]);
      best = v[i];
    }
  return best;
}

// q4_0 (levels 0..15 around 8) and q5_0 (0..31 around 16): one thread per block of 32.
template <typename T, bool FIVE>
__device__ void quantize_q4_5_0(uint8_t* q, __half* dd, const T* x, size_t blocks) {
  pdl_wait();
  const size_t b = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (b >= blocks) return;
  float v[32];
  load_block(x + 32 * b, v, 32);
  const float d = dvd(signed_max(v), FIVE ? -16.f : -8.f);
  const float id = d != 0.f ? dvd(1.f, d) : 0.f;
  dd[b] = __float2half_rn(d);
  const float off = FIVE ? 16.5f : 8.5f;
  const int top = FIVE ? 31 : 15;
  uint32_t qs[4] = {0, 0, 0, 0}, qh = 0;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int q0 = min(top, (int)add(mul(v[j], id), off));
    const int q1 = min(top, (int)add(mul(v[16 + j], id), off));
    qs[j >> 2] |= (uint32_t)((q0 & 15) | ((q1 & 15) << 4)) << (8 * (j & 3));
    qh |= (uint32_t)((q0 >> 4) & 1) << j;
    qh |= (uint32_t)((q1 >> 4) & 1) << (j + 16);
  }
  if (FIVE) {
    uint32_t* out = reinterpret_cast<uint32_t*>(q + 20 * b);
    out[0] = qh;
#pragma unroll
    for (int i = 0; i < 4; ++i) out[1 + i] = qs[i];
  } else {
    *reinterpret_cast<uint4*>(q + 16 * b) = make_uint4(qs[0], qs[1], qs[2], qs[3]);
  }
}

// ggml's make_qkx2_quants for one sub-block of 32 with levels 0..15 (rmin -1, rdelta 0.1, 20
// steps): levels into l, returns (scale, -min).
__device__ float2 make_qkx2_quants(const float* x, const float* wt, uint8_t* l) {
  const int nmax = 15;
  float lo = x[0], hi = x[0], sum_w = wt[0], sum_x = mul(sum_w, x[0]);
  for (int i = 1; i < 32; ++i) {
    if (x[i] < lo) lo = x[i];
    if (x[i] > hi) hi = x[i];
    sum_w = add(sum_w, wt[i]);
    sum_x = add(sum_x, mul(wt[i], x[i]));
  }
  if (lo > 0.f) lo = 0.f;
  if (hi == lo) {
    for (int i = 0; i < 32; ++i) l[i] = 0;
    return make_float2(0.f, -lo);
  }
  float iscale = dvd((float)nmax, sub(hi, lo));
  float scale = dvd(1.f, iscale);
  float best_error = 0.f;
  for (int i = 0; i < 32; ++i) {
    const int q = min(nmax, max(0, nearest_int(mul(iscale, sub(x[i], lo)))));
    l[i] = (uint8_t)q;
    const float diff = sub(add(mul(scale, (float)q), lo), x[i]);
    best_error = add(best_error, mul(wt[i], mul(diff, diff)));
  }
  for (int is = 0; is <= 20; ++is) {
    iscale = dvd(add(add(-1.f, mul(0.1f, (float)is)), (float)nmax), sub(hi, lo));
    float sum_l = 0.f, sum_l2 = 0.f, sum_xl = 0.f;
    uint8_t aux[32];
    for (int i = 0; i < 32; ++i) {
      const int q = min(nmax, max(0, nearest_int(mul(iscale, sub(x[i], lo)))));
      aux[i] = (uint8_t)q;
      const float lf = (float)q;
      sum_l = add(sum_l, mul(wt[i], lf));
      sum_l2 = add(sum_l2, mul(mul(wt[i], lf), lf));
      sum_xl = add(sum_xl, mul(mul(wt[i], lf), x[i]));
    }
    const float det = sub(mul(sum_w, sum_l2), mul(sum_l, sum_l));
    if (det > 0.f) {
      float this_scale = dvd(sub(mul(sum_w, sum_xl), mul(sum_x, sum_l)), det);
      float this_min = dvd(sub(mul(sum_l2, sum_x), mul(sum_l, sum_xl)), det);
      if (this_min > 0.f) {
        this_min = 0.f;
        this_scale = dvd(sum_xl, sum_l2);
      }
      float cur_error = 0.f;
      for (int i = 0; i < 32; ++i) {
        const float diff = sub(add(mul(this_scale, (float)aux[i]), this_min), x[i]);
        cur_error = add(cur_error, mul(wt[i], mul(diff, diff)));
      }
      if (cur_error < best_error) {
        for (int i = 0; i < 32; ++i) l[i] = aux[i];
        best_error = cur_error;
        scale = this_scale;
        lo = this_min;
      }
    }
  }
  return make_float2(scale, -lo);
}

// q4k: 8 lanes per block of 256, one per sub-block of 32; a CTA of 256 threads does 32 blocks.
template <typename T> __device__ void quantize_q4k(uint8_t* q, const T* x, size_t blocks) {
  __shared__ uint8_t levels[32][256];
  pdl_wait();
  const int lane = threadIdx.x & 7, slot = threadIdx.x >> 3;
  const size_t b0 = blockIdx.x * (size_t)32 + slot;
  const size_t b = min(b0, blocks - 1);  // every lane takes part in the shuffles
  float v[32], wt[32];
  uint8_t* l = levels[slot] + 32 * lane;
  load_block(x + 256 * b + 32 * lane, v, 32);
  float sum_x2 = 0.f;
  for (int i = 0; i < 32; ++i) sum_x2 = add(sum_x2, mul(v[i], v[i]));
  const float av_x = __fsqrt_rn(dvd(sum_x2, 32.f));
  for (int i = 0; i < 32; ++i) wt[i] = add(av_x, fabsf(v[i]));
  uint8_t lv[32];
  const float2 sm = make_qkx2_quants(v, wt, lv);
  float max_scale = fmaxf(sm.x, 0.f), max_min = fmaxf(sm.y, 0.f);
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) {
    max_scale = fmaxf(max_scale, __shfl_xor_sync(0xffffffffu, max_scale, o, 8));
    max_min = fmaxf(max_min, __shfl_xor_sync(0xffffffffu, max_min, o, 8));
  }
  const float inv_scale = max_scale > 0.f ? dvd(63.f, max_scale) : 0.f;
  const float inv_min = max_min > 0.f ? dvd(63.f, max_min) : 0.f;
  const int ls = min(63, (int)(uint8_t)nearest_int(mul(inv_scale, sm.x)));
  const int lm = min(63, (int)(uint8_t)nearest_int(mul(inv_min, sm.y)));
  const float d_all = f16_round(dvd(max_scale, 63.f)), dmin_all = f16_round(dvd(max_min, 63.f));
  const float dq = mul(d_all, (float)ls);
  if (dq != 0.f) {
    const float dm = mul(dmin_all, (float)lm);
    for (int i = 0; i < 32; ++i) lv[i] = (uint8_t)min(15, max(0, nearest_int(dvd(add(v[i], dm), dq))));
  }
  for (int i = 0; i < 32; ++i) l[i] = lv[i];
  // the 12 scale bytes, gathered from the 8 lanes
  int lss[8], lms[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    lss[j] = __shfl_sync(0xffffffffu, ls, j, 8);
    lms[j] = __shfl_sync(0xffffffffu, lm, j, 8);
  }
  __syncwarp();
  if (b0 >= blocks) return;
  uint8_t* out = q + 144 * b;
  if (lane == 0) {
    uint8_t head[16];
    const unsigned short hd = f16_bits(dvd(max_scale, 63.f)), hm = f16_bits(dvd(max_min, 63.f));
    head[0] = hd & 0xff; head[1] = hd >> 8; head[2] = hm & 0xff; head[3] = hm >> 8;
    uint8_t* sc = head + 4;
#pragma unroll
    for (int j = 0; j < 12; ++j) sc[j] = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < 4) {
        sc[j] = (uint8_t)lss[j];
        sc[j + 4] = (uint8_t)lms[j];
      } else {
        sc[j + 4] = (uint8_t)((lss[j] & 0xF) | ((lms[j] & 0xF) << 4));
        sc[j - 4] |= (uint8_t)((lss[j] >> 4) << 6);
        sc[j] |= (uint8_t)((lms[j] >> 4) << 6);
      }
    }
    *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(head);
  }
  // lane j writes qs bytes 16j..16j+16: group c = j / 2, l = 16 (j % 2) + (0..16)
  const uint8_t* lvs = levels[slot];
  const int c = lane >> 1, l0 = 16 * (lane & 1);
  alignas(16) uint8_t qs[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) qs[i] = lvs[64 * c + l0 + i] | (lvs[64 * c + 32 + l0 + i] << 4);
  *reinterpret_cast<uint4*>(out + 16 + 16 * lane) = *reinterpret_cast<const uint4*>(qs);
}

// ggml's make_qx_quants (rmse_type 1, weights x^2) for one sub-block of 16 with levels -32..31:
// levels + 32 into l, returns the scale.
__device__ float make_qx_quants(const float* x, uint8_t* l) {
  const int nmax = 32;
  float vmax = 0.f, amax = 0.f;
  for (int i = 0; i < 16; ++i)
    if (fabsf(x[i]) > amax) {
      amax = fabsf(x[i]);
      vmax = x[i];
    }
  if (amax < 1e-15f) {
    for (int i = 0; i < 16; ++i) l[i] = 0;
    return 0.f;
  }
  auto level = [&](float iscale, float v) { return min(nmax - 1, max(-nmax, nearest_int(mul(iscale, v)))); };
  auto sums = [&](float iscale, float& sumlx, float& suml2) {
    sumlx = 0.f;
    suml2 = 0.f;
    for (int i = 0; i < 16; ++i) {
      const float q = (float)level(iscale, x[i]);
      const float w = mul(x[i], x[i]);
      sumlx = add(sumlx, mul(mul(w, x[i]), q));
      suml2 = add(suml2, mul(mul(w, q), q));
    }
  };
  float iscale = dvd(-(float)nmax, vmax);
  for (int i = 0; i < 16; ++i) l[i] = (uint8_t)(level(iscale, x[i]) + nmax);
  float sumlx, suml2;
  sums(iscale, sumlx, suml2);
  float scale = suml2 != 0.f ? dvd(sumlx, suml2) : 0.f;
  float best = mul(scale, sumlx);
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    iscale = dvd(-add((float)nmax, mul(0.1f, (float)is)), vmax);
    sums(iscale, sumlx, suml2);
    if (suml2 > 0.f && mul(sumlx, sumlx) > mul(best, suml2)) {
      for (int i = 0; i < 16; ++i) l[i] = (uint8_t)(level(iscale, x[i]) + nmax);
      scale = dvd(sumlx, suml2);
      best = mul(scale, sumlx);
    }
  }
  return scale;
}

// q6k: 16 lanes per block of 256, one per sub-block of 16; a CTA of 256 threads does 16 blocks.
template <typename T> __device__ void quantize_q6k(uint8_t* q, __half* dd, const T* x, size_t blocks) {
  __shared__ uint8_t levels[16][256];
  pdl_wait();
  const int lane = threadIdx.x & 15, slot = threadIdx.x >> 4;
  const size_t b0 = blockIdx.x * (size_t)16 + slot;
  const size_t b = min(b0, blocks - 1);
  float v[16];
  load_block(x + 256 * b + 16 * lane, v, 16);
  uint8_t lv[16];
  const float s = make_qx_quants(v, lv);
  // the scale of largest magnitude, the first such
  float best = fabsf(s), best_s = s;
  int best_i = lane;
#pragma unroll
  for (int o = 1; o < 16; o <<= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, o, 16);
    const float os = __shfl_xor_sync(0xffffffffu, best_s, o, 16);
    const int oi = __shfl_xor_sync(0xffffffffu, best_i, o, 16);
    if (ob > best || (ob == best && oi < best_i)) {
      best = ob;
      best_s = os;
      best_i = oi;
    }
  }
  const bool zero = best < 1e-15f;
  int sc = 0;
  if (!zero) {
    const float iscale = dvd(-128.f, best_s);
    const float d_all = f16_round(dvd(1.f, iscale));
    sc = (int)(int8_t)min(127, nearest_int(mul(iscale, s)));
    const float dq = mul(d_all, (float)sc);
    if (dq != 0.f)
      for (int i = 0; i < 16; ++i) lv[i] = (uint8_t)(min(31, max(-32, nearest_int(dvd(v[i], dq)))) + 32);
    if (b0 < blocks && lane == 0) dd[b] = __float2half_rn(dvd(1.f, iscale));
  } else if (b0 < blocks && lane == 0) {
    dd[b] = __float2half_rn(0.f);
  }
  uint8_t* lvs = levels[slot];
  for (int i = 0; i < 16; ++i) lvs[16 * lane + i] = lv[i];
  __syncwarp();
  if (b0 >= blocks) return;
  uint8_t* out = q + 208 * b;
  // lane t writes ql bytes 8t..8t+8, qh bytes 4t..4t+4 and scale byte t
  alignas(8) uint8_t ql[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int t = 8 * lane + i, h = t >> 6, u = t & 63, base = 128 * h + (u & 31) + (u >= 32 ? 32 : 0);
    ql[i] = zero ? 0 : (uint8_t)((lvs[base] & 0xF) | ((lvs[base + 64] & 0xF) << 4));
  }
  *reinterpret_cast<uint2*>(out + 8 * lane) = *reinterpret_cast<const uint2*>(ql);
  alignas(4) uint8_t qh[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int t = 4 * lane + i, base = 128 * (t >> 5) + (t & 31);
    qh[i] = zero ? 0
                 : (uint8_t)((lvs[base] >> 4) | ((lvs[base + 32] >> 4) << 2) | ((lvs[base + 64] >> 4) << 4) |
                             ((lvs[base + 96] >> 4) << 6));
  }
  *reinterpret_cast<uint32_t*>(out + 128 + 4 * lane) = *reinterpret_cast<const uint32_t*>(qh);
  out[192 + lane] = zero ? 0 : (uint8_t)(int8_t)sc;
}

}  // namespace

// ggml_gemv[_glu]_<fmt>_m<M>_<dtype>(y, x, w, d, m, n, k): ceil(n / 4) CTAs (GLU: ceil(n / 2 / 4)
// with 4 gate + 4 up rows each) of NT threads. d is the block scales (null for q4k).
#define GGML_GEMV_M(T, NAME, F, FNAME, M, NT)                                                       \
  extern "C" __global__ void __launch_bounds__(NT) ggml_gemv_##FNAME##_m##M##_##NAME(               \
      T* y, const T* x, const void* w, const void* d, int m, int n, int k) {                       \
    ggml_gemv_impl<T, F, M, 4, NT, false>(y, x, w, d, m, n, k);                                     \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(NT) ggml_gemv_glu_##FNAME##_m##M##_##NAME(           \
      T* y, const T* x, const void* w, const void* d, int m, int n, int k) {                       \
    ggml_gemv_impl<T, F, M, 8, NT, true>(y, x, w, d, m, n, k);                                      \
  }
#define GGML_GEMV(T, NAME, F, FNAME)                                                                \
  GGML_GEMV_M(T, NAME, F, FNAME, 1, 128) GGML_GEMV_M(T, NAME, F, FNAME, 2, 128)                     \
  GGML_GEMV_M(T, NAME, F, FNAME, 4, 128) GGML_GEMV_M(T, NAME, F, FNAME, 8, 128)
// ggml_dequantize_<fmt>_<dtype>(out, w, d, n, k): a grid-stride loop over the chunks.
#define GGML_DEQUANTIZE(T, NAME, F, FNAME)                                                          \
  extern "C" __global__ void ggml_dequantize_##FNAME##_##NAME(T* out, const void* w, const void* d, \
                                                              int n, int k) {                      \
    ggml_dequantize_impl<T, F>(out, w, d, n, k);                                                    \
  }
#define GGML_FORMAT(F, FNAME)                                                                       \
  GGML_GEMV(__nv_bfloat16, bf16, F, FNAME)                                                          \
  GGML_GEMV(__half, f16, F, FNAME)                                                                  \
  GGML_DEQUANTIZE(float, f32, F, FNAME)                                                             \
  GGML_DEQUANTIZE(__nv_bfloat16, bf16, F, FNAME)                                                    \
  GGML_DEQUANTIZE(__half, f16, F, FNAME)
GGML_FORMAT(Q8_0B, q8_0)
GGML_FORMAT(Q4_0B, q4_0)
GGML_FORMAT(Q5_0B, q5_0)
GGML_FORMAT(Q4KB, q4k)
GGML_FORMAT(Q6KB, q6k)

// ggml_quantize_<fmt>_<dtype>(q, d, x, blocks): x holds `blocks` blocks, contiguous. q8_0, q4_0,
// q5_0: one thread per block; q4k: 256-thread CTAs of 32 blocks (d unused); q6k: 256-thread CTAs
// of 16 blocks.
#define GGML_QUANTIZE(T, NAME)                                                                      \
  extern "C" __global__ void ggml_quantize_q8_0_##NAME(uint8_t* q, __half* d, const T* x,          \
                                                       unsigned long long blocks) {                 \
    quantize_q8_0<T>(q, d, x, blocks);                                                              \
  }                                                                                                \
  extern "C" __global__ void ggml_quantize_q4_0_##NAME(uint8_t* q, __half* d, const T* x,          \
                                                       unsigned long long blocks) {                 \
    quantize_q4_5_0<T, false>(q, d, x, blocks);                                                     \
  }                                                                                                \
  extern "C" __global__ void ggml_quantize_q5_0_##NAME(uint8_t* q, __half* d, const T* x,          \
                                                       unsigned long long blocks) {                 \
    quantize_q4_5_0<T, true>(q, d, x, blocks);                                                      \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(256) ggml_quantize_q4k_##NAME(                       \
      uint8_t* q, __half*, const T* x, unsigned long long blocks) {                                 \
    quantize_q4k<T>(q, x, blocks);                                                                  \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(256) ggml_quantize_q6k_##NAME(                       \
      uint8_t* q, __half* d, const T* x, unsigned long long blocks) {                               \
    quantize_q6k<T>(q, d, x, blocks);                                                               \
  }
RSERVE_FOR_DTYPES(GGML_QUANTIZE)
