// Fused element-wise kernels of the decoder layer and the vision towers: SiLU-and-multiply,
// residual-add + RMSNorm, LayerNorm with or without the residual add, and rotary embedding of the
// q and k heads of a fused qkv tensor, in place (alone or with the new keys and values written
// into the paged cache). All compute in f32.
#include "common.cuh"

// out[t, i] = silu(gu[t, i]) * gu[t, I + i]; gu: [tokens, 2 * I], out: [tokens, I]. When I is a
// multiple of a 16-byte vector and both tensors are 16-byte aligned, each thread takes whole
// vectors (one 16-byte load of gate, one of up, one 16-byte store); else single elements.
template <typename T>
__device__ void silu_and_mul_impl(T* __restrict__ out, const T* __restrict__ gu, long n, int inter) {
  pdl_trigger();  // the down product may start streaming its weights
  pdl_wait();     // gu is the kernel before's output
  constexpr int VN = Vec16<T>::N;
  const long stride = (long)gridDim.x * blockDim.x;
  const bool vec = inter % VN == 0 && ((reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(gu)) & 15) == 0;
  if (vec) {
    const int row_vecs = inter / VN;
    for (long v = (long)blockIdx.x * blockDim.x + threadIdx.x; v < n / VN; v += stride) {
      const long row = v / row_vecs;
      const int c = (int)(v - row * row_vecs) * VN;
      float g[VN], u[VN];
      load16(gu + row * 2 * inter + c, g);
      load16(gu + row * 2 * inter + inter + c, u);
      alignas(16) T o[VN];
#pragma unroll
      for (int e = 0; e < VN; ++e) o[e] = from_f32<T>(g[e] / (1.f + __expf(-g[e])) * u[e]);
      *reinterpret_cast<uint4*>(out + row * inter + c) = *reinterpret_cast<const uint4*>(o);
    }
    return;
  }
  for (long idx = (long)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += stride) {
    const long row = idx / inter;
    const int c = idx % inter;
    const float g = to_f32(gu[row * 2 * inter + c]);
    const float u = to_f32(gu[row * 2 * inter + inter + c]);
    out[idx] = from_f32<T>(g / (1.f + __expf(-g)) * u);
  }
}

// out = y + bias for y [rows, cols] and bias [cols] (a linear layer's bias): whole 16-byte vectors
// when cols is a multiple of one and all three are aligned, else single elements. The sum is
// rounded once from f32, as the element-wise add rounds.
template <typename T>
__device__ void add_bias_impl(T* __restrict__ out, const T* __restrict__ y, const T* __restrict__ bias,
                              long n, int cols) {
  constexpr int VN = Vec16<T>::N;
  const long stride = (long)gridDim.x * blockDim.x;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(y) |
                         reinterpret_cast<uintptr_t>(bias);
  if (cols % VN == 0 && (addr & 15) == 0) {
    for (long v = (long)blockIdx.x * blockDim.x + threadIdx.x; v < n / VN; v += stride) {
      const int c = (int)((v * VN) % cols);
      float a[VN], b[VN];
      load16(y + v * VN, a);
      load16(bias + c, b);
      alignas(16) T o[VN];
#pragma unroll
      for (int e = 0; e < VN; ++e) o[e] = from_f32<T>(a[e] + b[e]);
      *reinterpret_cast<uint4*>(out + v * VN) = *reinterpret_cast<const uint4*>(o);
    }
    return;
  }
  for (long idx = (long)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += stride)
    out[idx] = from_f32<T>(to_f32(y[idx]) + to_f32(bias[idx % cols]));
}

// The sum (with MAX, the largest) of the values the block's threads hold, in every thread;
// `partial` is 32 floats of shared memory, free again when this returns.
template <bool MAX>
__device__ __forceinline__ float block_reduce(float v, float* partial) {
  v = MAX ? warp_max(v) : warp_sum(v);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    float t = threadIdx.x < (blockDim.x >> 5) ? partial[threadIdx.x] : 0.f;
    t = MAX ? warp_max(t) : warp_sum(t);
    if (threadIdx.x == 0) partial[0] = t;
  }
  __syncthreads();
  const float r = partial[0];
  __syncthreads();
  return r;
}

// 1 / sqrt(mean + eps) of a row whose squares this block's threads summed into `ss` each (every
// thread gets it); `partial` as for block_reduce.
__device__ __forceinline__ float block_rms_inv(float ss, float* partial, int hidden, float eps) {
  return rsqrtf(block_reduce<false>(ss, partial) / hidden + eps);
}

// One CTA per row. out: [2, tokens, H]: the sum x + residual (rounded to T), then its RMS norm
// times the weight. With FP8 the normed row is also quantized as an FP8 product's activations
// are (fp8_quantize_rows: q [tokens, H] E4M3, qscale [tokens]): the same bits, in the same kernel;
// q starts on a 16-byte boundary (a fresh allocation).
template <typename T, bool FP8 = false>
__device__ void add_rms_norm_impl(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ res,
                                  const T* __restrict__ w, int tokens, int hidden, float eps,
                                  uint8_t* __restrict__ q = nullptr, float* __restrict__ qscale = nullptr) {
  pdl_trigger();  // the next product may start streaming its weights
  pdl_wait();     // x is the kernel before's output
  __shared__ float partial[32];
  const long row = blockIdx.x;
  T* sum = out + row * hidden;
  T* norm = out + ((long)tokens + row) * hidden;
  const T* xr = x + row * hidden;
  const T* rr = res + row * hidden;
  // whole 16-byte vectors when rows are made of them and every tensor is aligned to them
  constexpr int VN = Vec16<T>::N;
  const bool vec = hidden % VN == 0 &&
                   ((reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(x) |
                     reinterpret_cast<uintptr_t>(res) | reinterpret_cast<uintptr_t>(w)) & 15) == 0;
  float ss = 0.f;
  if (vec) {
    for (int i = threadIdx.x * VN; i < hidden; i += blockDim.x * VN) {
      float a[VN], b[VN];
      load16(xr + i, a);
      load16(rr + i, b);
      alignas(16) T s[VN];
#pragma unroll
      for (int e = 0; e < VN; ++e) {
        s[e] = from_f32<T>(a[e] + b[e]);
        const float v = to_f32(s[e]);
        ss += v * v;
      }
      *reinterpret_cast<uint4*>(sum + i) = *reinterpret_cast<const uint4*>(s);
    }
  } else {
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      const T s = from_f32<T>(to_f32(xr[i]) + to_f32(rr[i]));
      sum[i] = s;
      const float v = to_f32(s);
      ss += v * v;
    }
  }
  const float inv = block_rms_inv(ss, partial, hidden, eps);
  float amax = 0.f;
  if (vec) {
    // this thread wrote these sums itself: a plain (coherent) load, not the read-only path
    for (int i = threadIdx.x * VN; i < hidden; i += blockDim.x * VN) {
      float sv[VN], wv[VN];
      Vec16<T>::unpack(*reinterpret_cast<const uint4*>(sum + i), sv);
      load16(w + i, wv);
      alignas(16) T o[VN];
#pragma unroll
      for (int e = 0; e < VN; ++e) {
        o[e] = from_f32<T>(sv[e] * inv * wv[e]);
        if (FP8) amax = fmaxf(amax, fabsf(to_f32(o[e])));
      }
      *reinterpret_cast<uint4*>(norm + i) = *reinterpret_cast<const uint4*>(o);
    }
  } else {
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      const T o = from_f32<T>(to_f32(sum[i]) * inv * to_f32(w[i]));
      norm[i] = o;
      if (FP8) amax = fmaxf(amax, fabsf(to_f32(o)));
    }
  }
  if (!FP8) return;
  // the FP8 form of the normed row, each thread re-reading the values it wrote
  const float s = fp8_row_scale(block_reduce<true>(amax, partial));
  if (threadIdx.x == 0) qscale[row] = s;
  uint8_t* qr = q + row * hidden;
  if (vec) {  // a row of whole vectors: its bytes start on a VN-byte boundary
    for (int i = threadIdx.x * VN; i < hidden; i += blockDim.x * VN) {
      float f[VN];
      Vec16<T>::unpack(*reinterpret_cast<const uint4*>(norm + i), f);
      if constexpr (VN == 8) {
        *reinterpret_cast<uint2*>(qr + i) = make_uint2(fp8_pack4(f, s), fp8_pack4(f + 4, s));
      } else {
        *reinterpret_cast<uint32_t*>(qr + i) = fp8_pack4(f, s);
      }
    }
    return;
  }
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) qr[i] = fp8_byte(to_f32(norm[i]), s);
}

// One CTA per row: LayerNorm with weight and bias (the vision towers'). The statistics are f32,
// from two passes over the row (its mean, then the squared deviations from it), and each output
// is rounded once, as PyTorch's 16-bit LayerNorm computes. With ADD the row is x + res rounded to
// T (as the element-wise add rounds) and out is [2, tokens, H]: the sums, then the normed rows;
// without, out is [tokens, H] and res is not read.
template <typename T, bool ADD>
__device__ void layer_norm_impl(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ res,
                                const T* __restrict__ w, const T* __restrict__ b, int tokens, int hidden,
                                float eps) {
  pdl_trigger();  // the next product may start streaming its weights
  pdl_wait();     // x is the kernel before's output
  __shared__ float partial[32];
  const long row = blockIdx.x;
  const T* xr = x + row * hidden;
  const T* rr = ADD ? res + row * hidden : nullptr;
  T* sum = out + row * hidden;  // ADD only
  T* norm = out + ((ADD ? (long)tokens : 0) + row) * hidden;
  // the row's values, read back by the thread that wrote (ADD) or first read them
  const T* src = ADD ? sum : xr;
  constexpr int VN = Vec16<T>::N;
  const bool vec = hidden % VN == 0 &&
                   ((reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(x) |
                     reinterpret_cast<uintptr_t>(ADD ? res : x) | reinterpret_cast<uintptr_t>(w) |
                     reinterpret_cast<uintptr_t>(b)) & 15) == 0;
  float s1 = 0.f;
  if (vec) {
    for (int i = threadIdx.x * VN; i < hidden; i += blockDim.x * VN) {
      float a[VN];
      load16(xr + i, a);
      if constexpr (ADD) {
        float r[VN];
        load16(rr + i, r);
        alignas(16) T s[VN];
#pragma unroll
        for (int e = 0; e < VN; ++e) {
          s[e] = from_f32<T>(a[e] + r[e]);
          a[e] = to_f32(s[e]);
        }
        *reinterpret_cast<uint4*>(sum + i) = *reinterpret_cast<const uint4*>(s);
      }
#pragma unroll
      for (int e = 0; e < VN; ++e) s1 += a[e];
    }
  } else {
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      float v = to_f32(xr[i]);
      if constexpr (ADD) {
        const T s = from_f32<T>(v + to_f32(rr[i]));
        sum[i] = s;
        v = to_f32(s);
      }
      s1 += v;
    }
  }
  const float mean = block_reduce<false>(s1, partial) / hidden;
  float s2 = 0.f;
  if (vec) {
    for (int i = threadIdx.x * VN; i < hidden; i += blockDim.x * VN) {
      float a[VN];
      load16_rw(src + i, a);
#pragma unroll
      for (int e = 0; e < VN; ++e) s2 += (a[e] - mean) * (a[e] - mean);
    }
  } else {
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      const float d = to_f32(src[i]) - mean;
      s2 += d * d;
    }
  }
  const float inv = rsqrtf(block_reduce<false>(s2, partial) / hidden + eps);
  if (vec) {
    for (int i = threadIdx.x * VN; i < hidden; i += blockDim.x * VN) {
      float a[VN], wv[VN], bv[VN];
      load16_rw(src + i, a);
      load16(w + i, wv);
      load16(b + i, bv);
#pragma unroll
      for (int e = 0; e < VN; ++e) a[e] = (a[e] - mean) * inv * wv[e] + bv[e];
      store16(norm + i, a);
    }
    return;
  }
  for (int i = threadIdx.x; i < hidden; i += blockDim.x)
    norm[i] = from_f32<T>((to_f32(src[i]) - mean) * inv * to_f32(w[i]) + to_f32(b[i]));
}

// Stores Vec16<T>::N floats into a cache row: rounded to T, then (FP8 caches) times `inv` and
// rounded to E4M3, as the CPU path rounds.
template <typename T, typename C> struct CacheStore {
  __device__ __forceinline__ static void vec(C* p, const float* f, float) { store16(p, f); }
};
template <typename T> struct CacheStore<T, e4m3> {
  __device__ __forceinline__ static void vec(e4m3* p, const float* f, float inv) {
#pragma unroll
    for (int e = 0; e < Vec16<T>::N; ++e) p[e] = CacheElem<e4m3>::put(to_f32(from_f32<T>(f[e])), inv);
  }
};

// Rotary embedding with the cache write, one CTA per token. qkv: [tokens, heads + 2 * kv_heads,
// D] (rows `row_stride` apart); q heads rotate in place with cos/sin: [max_positions, D / 2] (the
// "rotate half" layout of Hugging Face Llama), k heads rotate in place and into k_cache at the
// token's slot, v heads are copied into v_cache (caches [slots, kv_heads * D]; a negative slot
// skips the writes, others were validated; FP8 caches take values times k_inv / v_inv). With
// slots null nothing is written to a cache: the first `heads` heads are rotated (rotary_qk,
// kv_heads 0). Two forms benchmarks/gpu/kbench.cu's chain compares with the engine's: EARLY reads
// positions, slots and a thread's first pair of table vectors before the wait for the product
// (they are no kernel's output); LATE_TRIGGER lets the attention launch only once the product is
// done (its CTAs, resident early, hold shared memory the product's CTAs could use).
template <typename T, typename C, bool EARLY = false, bool LATE_TRIGGER = false>
__device__ void rotary_qk_cache_impl(T* __restrict__ qkv, const uint32_t* __restrict__ positions,
                                     const T* __restrict__ cos, const T* __restrict__ sin,
                                     int heads, int kv_heads, int head_dim, long row_stride,
                                     C* __restrict__ k_cache, C* __restrict__ v_cache,
                                     const int64_t* __restrict__ slots, float k_inv, float v_inv) {
  if constexpr (!LATE_TRIGGER) pdl_trigger();  // attention may launch; it waits for this kernel
  if constexpr (!EARLY) pdl_wait();  // qkv is the product's output
  const int half = head_dim / 2;
  const long pos = positions[blockIdx.x];
  const int64_t slot = slots ? slots[blockIdx.x] : -1;
  const long kv_row = (long)kv_heads * head_dim;
  T* row = qkv + (long)blockIdx.x * row_stride;
  C* kd = slot >= 0 ? k_cache + slot * kv_row : nullptr;
  C* vd = slot >= 0 ? v_cache + slot * kv_row : nullptr;
  const T* c = cos + pos * half;
  const T* s = sin + pos * half;
  const int rotated = (heads + kv_heads) * half;
  // 16-byte vectors where every row and half row allows (head dims 64, 80, 96, 128, 256 in 16
  // bits): a thread rotates VN pairs, or copies VN values of V
  constexpr int VN = Vec16<T>::N;
  if (half % VN == 0 && (row_stride * (long)sizeof(T)) % 16 == 0 && aligned16(qkv) &&
      aligned16(cos) && aligned16(sin) && (!kd || aligned16(kd)) && (!vd || aligned16(vd))) {
    const int hv = half / VN;  // vectors per half row
    const int rv = (heads + kv_heads) * hv;
    float cj[VN], sj[VN];
    if constexpr (EARLY) {
      if ((int)threadIdx.x < rv) {
        load16(c + (threadIdx.x % hv) * VN, cj);
        load16(s + (threadIdx.x % hv) * VN, sj);
      }
      pdl_wait();
    }
    if constexpr (LATE_TRIGGER) pdl_trigger();
    for (int i = threadIdx.x; i < rv + kv_row / VN; i += blockDim.x) {
      if (i < rv) {
        const int h = i / hv, j = (i % hv) * VN;
        T* p = row + (long)h * head_dim;
        float x1[VN], x2[VN], y1[VN], y2[VN];
        load16_rw(p + j, x1);
        load16_rw(p + j + half, x2);
        if (!EARLY || i != (int)threadIdx.x) {
          load16(c + j, cj);
          load16(s + j, sj);
        }
#pragma unroll
        for (int e = 0; e < VN; ++e) {
          y1[e] = x1[e] * cj[e] - x2[e] * sj[e];
          y2[e] = x2[e] * cj[e] + x1[e] * sj[e];
        }
        store16(p + j, y1);
        store16(p + j + half, y2);
        if (h >= heads && kd) {
          C* k = kd + (long)(h - heads) * head_dim;
          CacheStore<T, C>::vec(k + j, y1, k_inv);
          CacheStore<T, C>::vec(k + j + half, y2, k_inv);
        }
      } else if (vd) {
        const long v = (long)(i - rv) * VN;
        const T* src = row + (long)(heads + kv_heads) * head_dim + v;
        if constexpr (std::is_same<T, C>::value) {
          *reinterpret_cast<uint4*>(vd + v) = *reinterpret_cast<const uint4*>(src);
        } else {
          float x[VN];
          load16_rw(src, x);
          CacheStore<T, C>::vec(vd + v, x, v_inv);
        }
      }
    }
    return;
  }
  if constexpr (EARLY) pdl_wait();
  if constexpr (LATE_TRIGGER) pdl_trigger();
  for (int i = threadIdx.x; i < rotated + kv_row; i += blockDim.x) {
    if (i < rotated) {
      const int h = i / half, j = i % half;
      T* p = row + (long)h * head_dim;
      const float x1 = to_f32(p[j]), x2 = to_f32(p[j + half]);
      const float cj = to_f32(c[j]), sj = to_f32(s[j]);
      const T y1 = from_f32<T>(x1 * cj - x2 * sj), y2 = from_f32<T>(x2 * cj + x1 * sj);
      p[j] = y1;
      p[j + half] = y2;
      if (h >= heads && kd) {
        C* k = kd + (long)(h - heads) * head_dim;
        k[j] = CacheElem<C>::put(to_f32(y1), k_inv);
        k[j + half] = CacheElem<C>::put(to_f32(y2), k_inv);
      }
    } else if (vd) {
      const long v = i - rotated;
      vd[v] = CacheElem<C>::put(to_f32(row[(long)(heads + kv_heads) * head_dim + v]), v_inv);
    }
  }
}

// out[i] = op(x[i]) computed in f32 over n values: 16-byte loads of x and whole 16-byte stores of
// out per thread where both pointers allow, single elements for the rest.
template <typename T, typename O, typename Op>
__device__ void map_impl(O* __restrict__ out, const T* __restrict__ x, long n, Op op) {
  constexpr int VN = Vec16<T>::N;
  const long stride = (long)gridDim.x * blockDim.x;
  const long first = (long)blockIdx.x * blockDim.x + threadIdx.x;
  long done = 0;
  if (((reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(x)) & 15) == 0) {
    const long nv = n / VN;
    for (long v = first; v < nv; v += stride) {
      float f[VN];
      load16(x + v * VN, f);
#pragma unroll
      for (int e = 0; e < VN; ++e) f[e] = op(f[e]);
#pragma unroll
      for (int e = 0; e < VN; e += Vec16<O>::N) store16(out + v * VN + e, f + e);
    }
    done = nv * VN;
  }
  for (long i = done + first; i < n; i += stride) out[i] = from_f32<O>(op(to_f32(x[i])));
}

// x as f32 (logits leaving the LM head).
struct AsF32 {
  __device__ __forceinline__ float operator()(float v) const { return v; }
};
// x * sigmoid(1.702 x) (quick_gelu), rounded once.
struct QuickGelu {
  __device__ __forceinline__ float operator()(float v) const { return v / (1.f + __expf(-1.702f * v)); }
};

#define FUSED_OPS(T, NAME)                                                                         \
  extern "C" __global__ void silu_and_mul_##NAME(T* out, const T* gu, long n, int inter) {         \
    silu_and_mul_impl<T>(out, gu, n, inter);                                                       \
  }                                                                                                \
  extern "C" __global__ void add_rms_norm_##NAME(T* out, const T* x, const T* res, const T* w,     \
                                                 int tokens, int hidden, float eps) {              \
    add_rms_norm_impl<T>(out, x, res, w, tokens, hidden, eps);                                     \
  }                                                                                                \
  extern "C" __global__ void add_rms_norm_fp8_##NAME(T* out, uint8_t* q, float* qscale,           \
                                                     const T* x, const T* res, const T* w,         \
                                                     int tokens, int hidden, float eps) {          \
    add_rms_norm_impl<T, true>(out, x, res, w, tokens, hidden, eps, q, qscale);                          \
  }                                                                                                \
  extern "C" __global__ void rotary_qk_##NAME(T* qkv, const uint32_t* positions, const T* cos,     \
                                              const T* sin, int rotated_heads, int head_dim,       \
                                              long row_stride) {                                   \
    rotary_qk_cache_impl<T, T>(qkv, positions, cos, sin, rotated_heads, 0, head_dim, row_stride,   \
                               nullptr, nullptr, nullptr, 1.f, 1.f);                               \
  }                                                                                                \
  extern "C" __global__ void to_f32_##NAME(float* out, const T* x, long n) {                       \
    map_impl<T, float>(out, x, n, AsF32{});                                                        \
  }                                                                                                \
  extern "C" __global__ void add_bias_##NAME(T* out, const T* y, const T* bias, long n, int cols) { \
    add_bias_impl<T>(out, y, bias, n, cols);                                                       \
  }                                                                                                \
  extern "C" __global__ void quick_gelu_##NAME(T* out, const T* x, long n) {                       \
    map_impl<T, T>(out, x, n, QuickGelu{});                                                        \
  }                                                                                                \
  extern "C" __global__ void layer_norm_##NAME(T* out, const T* x, const T* w, const T* b,         \
                                               int tokens, int hidden, float eps) {                \
    layer_norm_impl<T, false>(out, x, nullptr, w, b, tokens, hidden, eps);                         \
  }                                                                                                \
  extern "C" __global__ void add_layer_norm_##NAME(T* out, const T* x, const T* res, const T* w,   \
                                                   const T* b, int tokens, int hidden, float eps) {\
    layer_norm_impl<T, true>(out, x, res, w, b, tokens, hidden, eps);                              \
  }
RSERVE_FOR_DTYPES(FUSED_OPS)
#define ROTARY_CACHE(T, C, NAME)                                                                   \
  extern "C" __global__ void rotary_qk_cache_##NAME(                                               \
      T* qkv, const uint32_t* positions, const T* cos, const T* sin, int heads, int kv_heads,      \
      int head_dim, long row_stride, C* k_cache, C* v_cache, const int64_t* slots, float k_inv,    \
      float v_inv) {                                                                               \
    rotary_qk_cache_impl<T, C>(qkv, positions, cos, sin, heads, kv_heads, head_dim, row_stride,    \
                               k_cache, v_cache, slots, k_inv, v_inv);                             \
  }
RSERVE_FOR_CACHES(ROTARY_CACHE)
