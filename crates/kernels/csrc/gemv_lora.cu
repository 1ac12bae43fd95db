// A decode batch's product with the shrink of its LoRA term in the same launch: y = x W^T and
// u[t] = A_s x[t] for each row t of adapter slot s (the stacks and parts of lora.cu), for up to
// kLoraTokens rows of x and a 16-bit W. The expand of lora.cu (one partial: chunks = 1) then adds
// B_s u[t] to y. Two launches per projection instead of three (product, split-K shrink, expand),
// and the expand reads one complete u instead of adding split-K partials.
//
// The grid: first the shrink CTAs, kLoraTokens * ceil(pr / R) of them, each streaming R rows of its
// token's A with the product's loop into u [kLoraTokens, pr] (f32, complete sums); then the
// product's CTAs exactly as gemv.cu launches them. No CTA waits on another. (A form that also
// added B_s u in the product's epilogue, its CTAs waiting on the shrink CTAs through a counter,
// measured slower than three launches: the waits held every SM's first wave.)
#include "common.cuh"

namespace {

constexpr int kLoraTokens = 4;  // rows of x the shrink CTAs cover (GEMV_MAX_ROWS in gemv.rs)

template <typename T, int M, int R, int U, int NT>
__device__ void gemv_shrink_impl(T* __restrict__ y, const T* __restrict__ x,
                                 const T* __restrict__ w, int m, int n, int k,
                                 const T* __restrict__ a, const uint32_t* __restrict__ slots,
                                 float* __restrict__ u, int pr) {
  pdl_trigger();  // the expand may launch (it waits for this kernel)
  using W = DenseW<T>;
  const int per_token = (pr + R - 1) / R;
  const int shrinks = kLoraTokens * per_token;
  float acc[R][M];
  const uint4* wr[R];
  if ((int)blockIdx.x < shrinks) {
    // u[t, j0 .. j0 + R] = A_s[j0 ..] . x[t]; slots and the stacks are written by copies before
    // the step, never by a kernel of it, so A streams before the wait as W does
    const int t = blockIdx.x / per_token, j0 = (blockIdx.x % per_token) * R;
    const uint32_t slot = t < m ? slots[t] : kNoAdapter;
    if (slot == kNoAdapter) {
      pdl_wait();
      return;
    }
    const T* as = a + (size_t)slot * pr * k;
#pragma unroll
    for (int q = 0; q < R; ++q)
      wr[q] = reinterpret_cast<const uint4*>(as + (size_t)min(j0 + q, pr - 1) * k);
    gemv_stream<T, W, M, R, U, NT>(acc, wr, x + (size_t)t * k, 1, k);
    const float* red = gemv_reduce<M, R, NT>(acc);
    const int tid = threadIdx.x;
    if (tid < R && j0 + tid < pr) u[(size_t)t * pr + j0 + tid] = cta_sum<M, R, NT>(red, tid * M);
    return;
  }
  const int row0 = (blockIdx.x - shrinks) * R;
  const int rows = min(R, n - row0);
  gemv_rows<R, false>(wr, w, (size_t)k * sizeof(T), n, row0, rows);
  gemv_stream<T, W, M, R, U, NT>(acc, wr, x, m, k);
  gemv_store<T, M, R, NT, false>(y, gemv_reduce<M, R, NT>(acc), nullptr, m, n, row0, rows);
}

}  // namespace

// gemv_shrink_m<M>_<dtype>(y, x, w, m, n, k, a, slots, u, pr): y [m, n] = x W^T and
// u [kLoraTokens, pr] f32 (rows of tokens with an adapter written), x [m, k], W [n, k],
// A [S, pr, k], slots [m]; m <= M, k a multiple of 8. Launch: kLoraTokens * ceil(pr / 4) + ceil(n / 4)
// CTAs of gemv.cu's threads.
#define GEMV_SHRINK_M(T, NAME, M, NT)                                                        \
  extern "C" __global__ void __launch_bounds__(NT) gemv_shrink_m##M##_##NAME(               \
      T* y, const T* x, const T* w, int m, int n, int k, const T* a, const uint32_t* slots, \
      float* u, int pr) {                                                                   \
    gemv_shrink_impl<T, M, kGemvRows, kGemvSteps, NT>(y, x, w, m, n, k, a, slots, u, pr);   \
  }
#define GEMV_SHRINK(T, NAME) \
  GEMV_SHRINK_M(T, NAME, 1, 256) GEMV_SHRINK_M(T, NAME, 2, 256) GEMV_SHRINK_M(T, NAME, 4, 128)
GEMV_SHRINK(__nv_bfloat16, bf16)
GEMV_SHRINK(__half, f16)
#undef GEMV_SHRINK
#undef GEMV_SHRINK_M
