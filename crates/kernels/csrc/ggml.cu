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
// loads (Raw). `unpack` gives its weights in run order (run r is 8 consecutive values of the row
// starting at run(c, r)), for the dequantizer. The decode products use `xload` and `dot`
// instead: x comes quantized to int8 in blocks of 32 (XSlab below), and `dot` sums the chunk's
// levels times x's levels four at a time (dp4a), then applies the two blocks' scales once.
// Levels stored unsigned (q4_0, q5_0, q4k, q6k) are below 128, so the signed dp4a takes them
// as they are and the format's offset is subtracted through x's block sums.

// Sum of a[j] * b[j] over the 16 signed bytes of a and b, plus s.
__device__ __forceinline__ int dot16(const uint4& a, const uint4& b, int s) {
  s = __dp4a((int)a.x, (int)b.x, s);
  s = __dp4a((int)a.y, (int)b.y, s);
  s = __dp4a((int)a.z, (int)b.z, s);
  return __dp4a((int)a.w, (int)b.w, s);
}
__device__ __forceinline__ uint4 low_nibbles(const uint4& q) {
  return make_uint4(q.x & 0x0F0F0F0Fu, q.y & 0x0F0F0F0Fu, q.z & 0x0F0F0F0Fu, q.w & 0x0F0F0F0Fu);
}
__device__ __forceinline__ uint4 high_nibbles(const uint4& q) {
  return make_uint4((q.x >> 4) & 0x0F0F0F0Fu, (q.y >> 4) & 0x0F0F0F0Fu, (q.z >> 4) & 0x0F0F0F0Fu,
                    (q.w >> 4) & 0x0F0F0F0Fu);
}

// x's levels for one block of 32 values (a: 0-15, b: 16-31) and (d, d * sum of the levels).
struct X32 {
  uint4 a, b;
  float2 ds;
};
__device__ __forceinline__ X32 xload32(const uint4* q, const float2* ds, int block) {
  return {q[2 * block], q[2 * block + 1], ds[block]};
}

struct Q8_0B {
  static constexpr int kBlock = 32, kVals = 32, kSteps = 2;
  struct Raw { uint4 a, b; __half d; };
  struct Row { const uint4* q; const __half* d; };
  using X = X32;
  __device__ static Row row(const void* w, const void* d, int r, int k) {
    return {reinterpret_cast<const uint4*>(static_cast<const char*>(w) + (size_t)r * k),
            static_cast<const __half*>(d) + (size_t)r * (k / kBlock)};
  }
  __device__ static Raw load(const Row& w, int c) {
    return {__ldcs(w.q + 2 * c), __ldcs(w.q + 2 * c + 1), __ldg(w.d + c)};
  }
  __device__ static int run(int c, int r) { return 32 * c + 8 * r; }
  __device__ static void unpack(const Raw& raw, int, float* f) {
    const float d = __half2float(raw.d);
    const uint32_t w[8] = {raw.a.x, raw.a.y, raw.a.z, raw.a.w, raw.b.x, raw.b.y, raw.b.z, raw.b.w};
#pragma unroll
    for (int i = 0; i < 32; ++i) f[i] = d * (float)(int8_t)(w[i >> 2] >> (8 * (i & 3)));
  }
  __device__ static X xload(const uint4* q, const float2* ds, int c) { return xload32(q, ds, c); }
  __device__ static float dot(const Raw& raw, const X& x, int) {
    return __half2float(raw.d) * x.ds.x * (float)dot16(raw.b, x.b, dot16(raw.a, x.a, 0));
  }
};

struct Q4_0B {
  static constexpr int kBlock = 32, kVals = 32, kSteps = 4;
  struct Raw { uint4 q; __half d; };
  struct Row { const uint4* q; const __half* d; };
  using X = X32;
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
  __device__ static X xload(const uint4* q, const float2* ds, int c) { return xload32(q, ds, c); }
  // sum ((q - 8) x) over the block: d (dx sum(q xq) - 8 dx sum(xq))
  __device__ static float dot(const Raw& raw, const X& x, int) {
    const int s = dot16(high_nibbles(raw.q), x.b, dot16(low_nibbles(raw.q), x.a, 0));
    return __half2float(raw.d) * (x.ds.x * (float)s - 8.f * x.ds.y);
  }
};

// Bits 0-3 of b moved to bit 4 of bytes 0-3 (the multiply's shifted copies do not overlap).
__device__ __forceinline__ uint32_t bits_to_bytes(uint32_t b) { return ((b & 0xF) * 0x00204081u & 0x01010101u) << 4; }

struct Q5_0B {
  static constexpr int kBlock = 32, kVals = 32, kSteps = 4;
  struct Raw { uint32_t w[5]; __half d; };
  struct Row { const uint32_t* q; const __half* d; };
  using X = X32;
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
  __device__ static X xload(const uint4* q, const float2* ds, int c) { return xload32(q, ds, c); }
  // sum ((q - 16) x): value j's fifth bit is bit j of qh (values 16 + j: bit 16 + j)
  __device__ static float dot(const Raw& raw, const X& x, int) {
    const uint32_t qh = raw.w[0];
    const uint4 q = make_uint4(raw.w[1], raw.w[2], raw.w[3], raw.w[4]);
    const uint4 lo = low_nibbles(q), hi = high_nibbles(q);
    const uint4 l5 = make_uint4(lo.x | bits_to_bytes(qh), lo.y | bits_to_bytes(qh >> 4),
                                lo.z | bits_to_bytes(qh >> 8), lo.w | bits_to_bytes(qh >> 12));
    const uint4 h5 = make_uint4(hi.x | bits_to_bytes(qh >> 16), hi.y | bits_to_bytes(qh >> 20),
                                hi.z | bits_to_bytes(qh >> 24), hi.w | bits_to_bytes(qh >> 28));
    const int s = dot16(h5, x.b, dot16(l5, x.a, 0));
    return __half2float(raw.d) * (x.ds.x * (float)s - 16.f * x.ds.y);
  }
};

// A q4k block's header (d, dmin, then 12 bytes of 6-bit scales and minimums): the scale and
// minimum of sub-blocks 2g (low byte) and 2g + 1 (high byte), as ggml packs them.
__device__ __forceinline__ void q4k_scales(const uint4& head, int g, uint32_t& sc, uint32_t& mn) {
  const int sh = 16 * (g & 1);
  const uint32_t a = head.y >> sh, b = head.z >> sh, e = head.w >> sh;
  if (g < 2) {
    sc = a & 0x3f3f;
    mn = b & 0x3f3f;
  } else {
    sc = (e & 0x0f0f) | ((a & 0xc0c0) >> 2);
    mn = ((e >> 4) & 0x0f0f) | ((b & 0xc0c0) >> 2);
  }
}
__device__ __forceinline__ float2 q4k_d_dmin(const uint4& head) {
  return __half22float2(*reinterpret_cast<const __half2*>(&head.x));
}

// q4k: chunk c is group g = c % 4 of a block: 32 bytes of levels whose low nibbles are the
// values 64g + (0..32) (sub-block 2g) and high nibbles the values 64g + 32 + (0..32) (2g + 1).
struct Q4KB {
  static constexpr int kBlock = 256, kVals = 64, kSteps = 2;
  struct Raw { uint4 lo, hi, head; };
  struct Row { const uint4* q; };
  struct X { X32 s0, s1; };
  __device__ static Row row(const void* w, const void*, int r, int k) {
    return {reinterpret_cast<const uint4*>(w) + (size_t)r * (k / kBlock) * 9};
  }
  __device__ static Raw load(const Row& w, int c) {
    const uint4* b = w.q + 9 * (c >> 2) + 1 + 2 * (c & 3);
    return {__ldcs(b), __ldcs(b + 1), __ldg(w.q + 9 * (c >> 2))};
  }
  __device__ static int run(int c, int r) { return 64 * c + 8 * r; }
  __device__ static void unpack(const Raw& raw, int c, float* f) {
    const float2 dd = q4k_d_dmin(raw.head);
    uint32_t sc, mn;
    q4k_scales(raw.head, c & 3, sc, mn);
    const float d0 = dd.x * (float)(sc & 0xff), o0 = dd.y * (float)(mn & 0xff);
    const float d1 = dd.x * (float)(sc >> 8), o1 = dd.y * (float)(mn >> 8);
    const uint32_t w[8] = {raw.lo.x, raw.lo.y, raw.lo.z, raw.lo.w, raw.hi.x, raw.hi.y, raw.hi.z, raw.hi.w};
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const uint32_t b = (w[j >> 2] >> (8 * (j & 3))) & 0xff;
      f[j] = d0 * (float)(b & 15) - o0;
      f[32 + j] = d1 * (float)(b >> 4) - o1;
    }
  }
  __device__ static X xload(const uint4* q, const float2* ds, int c) {
    return {xload32(q, ds, 2 * c), xload32(q, ds, 2 * c + 1)};
  }
  // sum ((d sc q - dmin mn) x) per sub-block: d sc dx sum(q xq) - dmin mn dx sum(xq)
  __device__ static float dot(const Raw& raw, const X& x, int c) {
    const int s0 = dot16(low_nibbles(raw.hi), x.s0.b, dot16(low_nibbles(raw.lo), x.s0.a, 0));
    const int s1 = dot16(high_nibbles(raw.hi), x.s1.b, dot16(high_nibbles(raw.lo), x.s1.a, 0));
    const float2 dd = q4k_d_dmin(raw.head);
    uint32_t sc, mn;
    q4k_scales(raw.head, c & 3, sc, mn);
    const float p = (float)(sc & 0xff) * x.s0.ds.x * (float)s0 + (float)(sc >> 8) * x.s1.ds.x * (float)s1;
    const float o = (float)(mn & 0xff) * x.s0.ds.y + (float)(mn >> 8) * x.s1.ds.y;
    return dd.x * p - dd.y * o;
  }
};

// q6k: chunk c covers l = 16p + (0..16) of half h of a block (i = c % 4 = 2h + p): the values
// 128h + 32q + l for q = 0..3, from ql[64h + l] (q = 0, 2), ql[64h + 32 + l] (q = 1, 3) and
// qh[32h + l]; sub-block (of 16) 8h + 2q + p.
struct Q6KB {
  static constexpr int kBlock = 256, kVals = 64, kSteps = 2;
  struct Raw { uint4 a, b, h, s; __half d; };
  struct Row { const uint4* q; const __half* d; };
  // x's 16 values of each level group q, their block's dx and 32 times their levels' sum
  struct X { uint4 p[4]; float d[4]; int s32[4]; };
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
  // the int8 scales of the chunk's four sub-blocks (q = 0..3)
  __device__ static void scales(const Raw& raw, int c, int* sc) {
    const int h = (c >> 1) & 1, sh = 8 * (c & 1);
    const uint32_t lo = h ? raw.s.z : raw.s.x, hi = h ? raw.s.w : raw.s.y;
    sc[0] = (int8_t)(lo >> sh);
    sc[1] = (int8_t)(lo >> (16 + sh));
    sc[2] = (int8_t)(hi >> sh);
    sc[3] = (int8_t)(hi >> (16 + sh));
  }
  __device__ static void unpack(const Raw& raw, int c, float* f) {
    const float d = __half2float(raw.d);
    int sc[4];
    scales(raw, c, sc);
    float ds[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) ds[q] = d * (float)sc[q];
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
  __device__ static X xload(const uint4* q, const float2* ds, int c) {
    const int base = 16 * (c >> 2) + 8 * ((c >> 1) & 1) + (c & 1);  // in 16-byte units
    X x;
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      x.p[g] = q[base + 2 * g];
      x.d[g] = ds[(base + 2 * g) >> 1].x;
      x.s32[g] = dot16(make_uint4(0x20202020u, 0x20202020u, 0x20202020u, 0x20202020u), x.p[g], 0);
    }
    return x;
  }
  // sum (d sc (q - 32) x) per sub-block: d sc dx (sum(q xq) - 32 sum(xq))
  __device__ static float dot(const Raw& raw, const X& x, int c) {
    int sc[4];
    scales(raw, c, sc);
    const uint4 h = raw.h;
    const uint4 lv[4] = {
        make_uint4((raw.a.x & 0x0F0F0F0Fu) | ((h.x << 4) & 0x30303030u), (raw.a.y & 0x0F0F0F0Fu) | ((h.y << 4) & 0x30303030u),
                   (raw.a.z & 0x0F0F0F0Fu) | ((h.z << 4) & 0x30303030u), (raw.a.w & 0x0F0F0F0Fu) | ((h.w << 4) & 0x30303030u)),
        make_uint4((raw.b.x & 0x0F0F0F0Fu) | ((h.x << 2) & 0x30303030u), (raw.b.y & 0x0F0F0F0Fu) | ((h.y << 2) & 0x30303030u),
                   (raw.b.z & 0x0F0F0F0Fu) | ((h.z << 2) & 0x30303030u), (raw.b.w & 0x0F0F0F0Fu) | ((h.w << 2) & 0x30303030u)),
        make_uint4(((raw.a.x >> 4) & 0x0F0F0F0Fu) | (h.x & 0x30303030u), ((raw.a.y >> 4) & 0x0F0F0F0Fu) | (h.y & 0x30303030u),
                   ((raw.a.z >> 4) & 0x0F0F0F0Fu) | (h.z & 0x30303030u), ((raw.a.w >> 4) & 0x0F0F0F0Fu) | (h.w & 0x30303030u)),
        make_uint4(((raw.b.x >> 4) & 0x0F0F0F0Fu) | ((h.x >> 2) & 0x30303030u), ((raw.b.y >> 4) & 0x0F0F0F0Fu) | ((h.y >> 2) & 0x30303030u),
                   ((raw.b.z >> 4) & 0x0F0F0F0Fu) | ((h.z >> 2) & 0x30303030u), ((raw.b.w >> 4) & 0x0F0F0F0Fu) | ((h.w >> 2) & 0x30303030u))};
    float acc = 0.f;
#pragma unroll
    for (int g = 0; g < 4; ++g) acc = fmaf((float)sc[g] * x.d[g], (float)(dot16(lv[g], x.p[g], 0) - x.s32[g]), acc);
    return __half2float(raw.d) * acc;
  }
};

// ---- decode products: y = x W^T for m <= M rows of x, on int8 activations (ggml's route: the
// dp4a products need a tenth of the instructions of float ones, which would bound the kernel
// below the memory bandwidth at 4-5 bits a weight). A CTA of 4 warps owns 4R rows of W, each warp
// R of them; the CTA quantizes a slab of XSlab::kLen values of each row of x into shared memory (per
// block of 32: d = max |x| / 127, levels rounded to nearest, and d times their sum), then each
// lane takes chunks of the slab's k in turn, U chunks of each of its warp's rows in flight, and
// the warp reduces with shuffles. The first weight loads go out before the kernel waits on the
// previous one, and each step's loads are issued as soon as the last step's levels are used, so
// they overlap the next slab's quantization. The GLU form gives each warp R/2 gate rows and the
// R/2 up rows of the same outputs.
constexpr int kGemvThreads = 128;
// 4,096 values of each row of x at a time (one slab of 16,384 for a single row measured slower:
// the whole quantization then precedes the first product)
template <int M> struct XSlab {
  static constexpr int kLen = 4096;
  uint4 q[M][kLen / 16];
  float2 ds[M][kLen / 32];
};

template <typename T, int M>
__device__ void quantize_slab(XSlab<M>& xs, const T* __restrict__ x, int m, int k, int len) {
  const int nb = len / 32;
  for (int j = threadIdx.x; j < m * nb; j += kGemvThreads) {
    const int i = j / nb, b = j % nb;
    const T* src = x + (size_t)i * k + 32 * b;
    float v[32];
#pragma unroll
    for (int h = 0; h < 32; h += Vec16<T>::N) load16(src + h, v + h);
    float amax = 0.f;
#pragma unroll
    for (int e = 0; e < 32; ++e) amax = fmaxf(amax, fabsf(v[e]));
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    // v * id rounded to the nearest integer lands in the low byte of (v * id + 1.5 * 2^23)
    uint32_t w[8];
    int sum = 0;
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      uint32_t b4[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) b4[e] = __float_as_uint(fmaf(v[4 * q + e], id, 12582912.f));
      w[q] = __byte_perm(__byte_perm(b4[0], b4[1], 0x0040), __byte_perm(b4[2], b4[3], 0x0040), 0x5410);
      sum = __dp4a((int)w[q], 0x01010101, sum);
    }
    xs.q[i][2 * b] = make_uint4(w[0], w[1], w[2], w[3]);
    xs.q[i][2 * b + 1] = make_uint4(w[4], w[5], w[6], w[7]);
    const float d = amax / 127.f;
    xs.ds[i][b] = make_float2(d, d * (float)sum);
  }
}

template <typename T, typename F, int M, int R, bool GLU>
__device__ void ggml_gemv_impl(T* __restrict__ y, const T* __restrict__ x, const void* __restrict__ w,
                               const void* __restrict__ d, int m, int n, int k) {
  pdl_trigger();  // the next kernel may launch (it waits for this one)
  constexpr int U = F::kSteps;
  constexpr int RO = GLU ? R / 2 : R;  // outputs per warp
  __shared__ XSlab<M> xs;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int outs = GLU ? n / 2 : n;
  const int row0 = (blockIdx.x * (kGemvThreads / 32) + warp) * RO;
  typename F::Row wr[R];
#pragma unroll
  for (int r = 0; r < R; ++r)
    wr[r] = F::row(w, d, min(row0 + r % RO, outs - 1) + (GLU && r >= RO ? outs : 0), k);
  const int chunks = k / F::kVals;
  typename F::Raw raw[U][R];
  auto fetch = [&](int c0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = min(c0 + 32 * u, chunks - 1);
#pragma unroll
      for (int r = 0; r < R; ++r) raw[u][r] = F::load(wr[r], c);
    }
  };
  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int i = 0; i < M; ++i) acc[r][i] = 0.f;

  if (lane < chunks) fetch(lane);
  pdl_wait();
  for (int s0 = 0; s0 < k; s0 += XSlab<M>::kLen) {
    const int len = min(XSlab<M>::kLen, k - s0);
    if (s0 > 0) __syncthreads();  // every warp is done with the last slab
    quantize_slab<T, M>(xs, x + s0, m, k, len);
    __syncthreads();
    const int cb = s0 / F::kVals, ce = cb + len / F::kVals;
    for (int c0 = cb + lane; c0 < ce; c0 += 32 * U) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + 32 * u;
        if (c >= ce) break;
#pragma unroll
        for (int i = 0; i < M; ++i) {
          if (i < m) {
            const typename F::X xv = F::xload(xs.q[i], xs.ds[i], c - cb);
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r][i] += F::dot(raw[u][r], xv, c);
          }
        }
      }
      // the next step's chunks: on in this slab, else the next slab's first
      const int next = c0 + 32 * U < ce ? c0 + 32 * U : ce + lane;
      if (next < chunks) fetch(next);
    }
  }
  // each (row, x row) sum lands in lane r * M + i
  float mine = 0.f, up = 0.f;
#pragma unroll
  for (int r = 0; r < RO; ++r)
#pragma unroll
    for (int i = 0; i < M; ++i) {
      const float v = warp_sum(acc[r][i]);
      if (lane == r * M + i) mine = v;
      if (GLU) {
        const float u = warp_sum(acc[RO + r][i]);
        if (lane == r * M + i) up = u;
      }
    }
  const int r = lane / M, i = lane % M;
  if (lane < RO * M && i < m && row0 + r < outs) {
    float s = mine;
    if (GLU) {
      const float g = to_f32(from_f32<T>(s));
      s = g / (1.f + __expf(-g)) * to_f32(from_f32<T>(up));
    }
    y[(size_t)i * outs + row0 + r] = from_f32<T>(s);
  }
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

// The same, staged through shared memory so that the stores are coalesced: a CTA of kTileChunks
// threads unpacks kTileChunks consecutive chunks (chunk t = row * chunks + c), whose values are
// the contiguous range [t0 * kVals, (t0 + kTileChunks) * kVals) of `out` (the chunks of one
// K-quant block permute values only inside that block, and kTileChunks is a multiple of 4), then
// writes that range out 16 bytes a thread. Shared memory holds 16 bytes of padding after every
// 128, so a thread's 16-byte runs (a chunk apart) fall in different banks.
constexpr int kTileChunks = 128;
__device__ __forceinline__ int tile_pad(int byte) { return byte + (byte >> 7) * 16; }
template <typename T, typename F>
__device__ void ggml_dequantize_tiled_impl(T* __restrict__ out, const void* __restrict__ w,
                                           const void* __restrict__ d, int n, int k) {
  constexpr int kTileBytes = kTileChunks * F::kVals * (int)sizeof(T);
  __shared__ alignas(16) unsigned char tile[kTileBytes + kTileBytes / 8];
  const int chunks = k / F::kVals;
  const size_t total = (size_t)n * chunks;
  bool waited = false;
  for (size_t t0 = (size_t)blockIdx.x * kTileChunks; t0 < total; t0 += (size_t)gridDim.x * kTileChunks) {
    const size_t t = t0 + threadIdx.x;
    if (t < total) {
      const int r = (int)(t / chunks), c = (int)(t % chunks);
      float a[F::kVals];
      F::unpack(F::load(F::row(w, d, r, k), c), c, a);
#pragma unroll
      for (int run = 0; run < F::kVals / 8; ++run)
#pragma unroll
        for (int h = 0; h < 8; h += Vec16<T>::N) {
          // out[row * k + run(c, run) + h] less out[t0 * kVals], with row * k = (t - c) * kVals
          const int at = (int)threadIdx.x * F::kVals + F::run(c, run) - F::kVals * c + h;
          store16(reinterpret_cast<T*>(tile + tile_pad(at * (int)sizeof(T))), a + 8 * run + h);
        }
    }
    __syncthreads();
    if (!waited) {  // the weights are read-only: only the first store waits for the kernel before
      pdl_wait();
      waited = true;
    }
    const size_t left = (total - t0) * F::kVals * sizeof(T);
    const int bytes = left < (size_t)kTileBytes ? (int)left : kTileBytes;
    unsigned char* dst = reinterpret_cast<unsigned char*>(out + t0 * F::kVals);
    for (int b = (int)threadIdx.x * 16; b < bytes; b += kTileChunks * 16)
      *reinterpret_cast<uint4*>(dst + b) = *reinterpret_cast<const uint4*>(tile + tile_pad(b));
    __syncthreads();
  }
  if (!waited) pdl_wait();
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

// ggml_gemv[_glu]_<fmt>_m<M>_<dtype>(y, x, w, d, m, n, k): ceil(n / 16) CTAs (GLU: ceil(n / 2 / 8),
// each warp 2 gate + 2 up rows) of kGemvThreads threads. d is the block scales (null for q4k).
#define GGML_GEMV_M(T, NAME, F, FNAME, M)                                                           \
  extern "C" __global__ void __launch_bounds__(kGemvThreads) ggml_gemv_##FNAME##_m##M##_##NAME(     \
      T* y, const T* x, const void* w, const void* d, int m, int n, int k) {                       \
    ggml_gemv_impl<T, F, M, 4, false>(y, x, w, d, m, n, k);                                         \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(kGemvThreads) ggml_gemv_glu_##FNAME##_m##M##_##NAME( \
      T* y, const T* x, const void* w, const void* d, int m, int n, int k) {                       \
    ggml_gemv_impl<T, F, M, 4, true>(y, x, w, d, m, n, k);                                          \
  }
#define GGML_GEMV(T, NAME, F, FNAME)                                                                \
  GGML_GEMV_M(T, NAME, F, FNAME, 1) GGML_GEMV_M(T, NAME, F, FNAME, 2)                               \
  GGML_GEMV_M(T, NAME, F, FNAME, 4) GGML_GEMV_M(T, NAME, F, FNAME, 8)
// ggml_dequantize_<fmt>_<dtype>(out, w, d, n, k): a grid-stride loop over the chunks;
// ggml_dequantize_tiled_<fmt>_<dtype>: the same over tiles of kTileChunks chunks, kTileChunks threads.
#define GGML_DEQUANTIZE(T, NAME, F, FNAME)                                                          \
  extern "C" __global__ void ggml_dequantize_##FNAME##_##NAME(T* out, const void* w, const void* d, \
                                                              int n, int k) {                      \
    ggml_dequantize_impl<T, F>(out, w, d, n, k);                                                    \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(kTileChunks) ggml_dequantize_tiled_##FNAME##_##NAME( \
      T* out, const void* w, const void* d, int n, int k) {                                        \
    ggml_dequantize_tiled_impl<T, F>(out, w, d, n, k);                                              \
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
