//! The quantizers' AVX2 paths, each the same bits as its scalar code.
//!
//! - The K-quant scale searches with one sub-block per lane: the eight sub-blocks of a `q4k`
//!   block, or eight of a `q6k` block's sixteen, are searched in lockstep, so that each trial
//!   scale is one pass of 8-wide instructions over the sub-blocks' values instead of eight
//!   scalar passes. Each lane performs the scalar search's IEEE operations (`kquant.rs`) in the
//!   scalar order: the same multiplies, adds and divides (never fused), ggml's magic-number
//!   rounding, and every `if` turned into a select under the same comparison (ordered `<` and
//!   `>`, which are false for NaN as Rust's are).
//! - The 32-value formats' levels (`q8_0`, `q4_0`, `q5_0`) 8 at a time: the scaled value rounded
//!   half away from zero (`roundf`) or offset and truncated, then cast to i8 as Rust's `as`
//!   casts (saturating, NaN to 0); the block's largest magnitude; and `q4_0`'s and `q5_0`'s
//!   nibbles and fifth bits packed 16 and 32 at a time.
//!
//! Tests hold each to its scalar code over random, constant, one-signed, zero and non-finite
//! values.

use super::{Cast, QK_K};
use std::arch::x86_64::*;

type V = __m256;

#[inline]
#[target_feature(enable = "avx2")]
fn splat(v: f32) -> V {
    _mm256_set1_ps(v)
}

#[inline]
#[target_feature(enable = "avx2")]
fn add(a: V, b: V) -> V {
    _mm256_add_ps(a, b)
}

#[inline]
#[target_feature(enable = "avx2")]
fn sub(a: V, b: V) -> V {
    _mm256_sub_ps(a, b)
}

#[inline]
#[target_feature(enable = "avx2")]
fn mul(a: V, b: V) -> V {
    _mm256_mul_ps(a, b)
}

#[inline]
#[target_feature(enable = "avx2")]
fn div(a: V, b: V) -> V {
    _mm256_div_ps(a, b)
}

/// `b` where `mask` is set, else `a`.
#[inline]
#[target_feature(enable = "avx2")]
fn select(a: V, b: V, mask: V) -> V {
    _mm256_blendv_ps(a, b, mask)
}

#[inline]
#[target_feature(enable = "avx2")]
fn lt(a: V, b: V) -> V {
    _mm256_cmp_ps::<_CMP_LT_OQ>(a, b)
}

#[inline]
#[target_feature(enable = "avx2")]
fn gt(a: V, b: V) -> V {
    _mm256_cmp_ps::<_CMP_GT_OQ>(a, b)
}

#[inline]
#[target_feature(enable = "avx2")]
fn abs(v: V) -> V {
    _mm256_andnot_ps(splat(-0.0), v)
}

/// ggml's `nearest_int(v)` clamped to `lo..=hi`, as f32 (`|v| < 2^22`, as in the scalar code).
#[inline]
#[target_feature(enable = "avx2")]
fn level(v: V, lo: i32, hi: i32) -> V {
    let bits = _mm256_castps_si256(add(v, splat(12582912.0)));
    let q = _mm256_sub_epi32(
        _mm256_and_si256(bits, _mm256_set1_epi32(0x007f_ffff)),
        _mm256_set1_epi32(0x0040_0000),
    );
    let q = _mm256_min_epi32(
        _mm256_max_epi32(q, _mm256_set1_epi32(lo)),
        _mm256_set1_epi32(hi),
    );
    _mm256_cvtepi32_ps(q)
}

/// 8 values from `c` (at least 8 long).
#[inline]
#[target_feature(enable = "avx2")]
fn load(c: &[f32]) -> V {
    assert!(c.len() >= 8);
    // SAFETY: `c` holds at least 8 values (asserted)
    unsafe { _mm256_loadu_ps(c.as_ptr()) }
}

/// [`super::abs_max`] of a 32-value block: the largest magnitude, NaN ignored (`maxps` returns
/// its second operand, the running maximum, when the first is NaN).
#[target_feature(enable = "avx2")]
pub(super) fn abs_max(x: &[f32]) -> f32 {
    let mut m = _mm256_setzero_ps();
    for c in x.chunks_exact(8) {
        m = _mm256_max_ps(abs(load(c)), m);
    }
    lanes(m).into_iter().fold(0f32, f32::max)
}

/// `v` rounded half away from zero, as `roundf`: truncated, then moved one away from zero where
/// the dropped fraction (exact) is at least one half.
#[inline]
#[target_feature(enable = "avx2")]
fn round_away(v: V) -> V {
    let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
    let half = _mm256_cmp_ps::<_CMP_GE_OQ>(abs(sub(v, t)), splat(0.5));
    let one = _mm256_or_ps(_mm256_and_ps(v, splat(-0.0)), splat(1.0));
    add(t, _mm256_and_ps(half, one))
}

/// [`super::casts`] of a 32-value block.
#[target_feature(enable = "avx2")]
pub(super) fn casts(x: &[f32], id: f32, cast: Cast) -> [i8; 32] {
    let mut out = [0i8; 32];
    for (o, c) in out.chunks_exact_mut(8).zip(x.chunks_exact(8)) {
        let v = mul(load(c), splat(id));
        let t = match cast {
            Cast::Round => round_away(v),
            Cast::Offset(off) => {
                _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(add(v, splat(off)))
            }
        };
        // `as i8`: NaN to 0, then saturated (the value is whole, so the conversion is exact)
        let t = _mm256_andnot_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(t, t), t);
        let t = _mm256_min_ps(_mm256_max_ps(t, splat(-128.0)), splat(127.0));
        let mut q = [0i32; 8];
        // SAFETY: `q` holds 8 values
        unsafe { _mm256_storeu_si256(q.as_mut_ptr().cast(), _mm256_cvttps_epi32(t)) };
        for (o, q) in o.iter_mut().zip(q) {
            *o = q as i8;
        }
    }
    out
}

/// Levels `q` clamped to `top` (a signed minimum, as the scalar `min`).
#[inline]
#[target_feature(enable = "avx2")]
fn clamped(q: &[i8; 32], top: i8) -> __m256i {
    // SAFETY: `q` holds 32 bytes
    let v = unsafe { _mm256_loadu_si256(q.as_ptr().cast()) };
    _mm256_min_epi8(v, _mm256_set1_epi8(top))
}

/// The low and high 16 bytes of `v`.
#[inline]
#[target_feature(enable = "avx2")]
fn halves(v: __m256i) -> (__m128i, __m128i) {
    (_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v))
}

#[inline]
#[target_feature(enable = "avx2")]
fn bytes16(v: __m128i) -> [u8; 16] {
    let mut out = [0u8; 16];
    // SAFETY: `out` holds 16 bytes
    unsafe { _mm_storeu_si128(out.as_mut_ptr().cast(), v) };
    out
}

/// [`super::pack_q4_0`]: the low half's levels as they are, the high half's low nibbles shifted
/// up (a byte's shift drops the rest, as the scalar `u8` shift does).
#[target_feature(enable = "avx2")]
pub(super) fn pack_q4_0(q: &[i8; 32]) -> [u8; 16] {
    let (lo, hi) = halves(clamped(q, 15));
    let hi = _mm_slli_epi16::<4>(_mm_and_si128(hi, _mm_set1_epi8(0x0F)));
    bytes16(_mm_or_si128(lo, hi))
}

/// [`super::pack_q5_0`]: the fifth bits by one byte mask (bit 4 of each level shifted to bit 7;
/// the 16-bit shift carries no other bit there), the nibbles as `q4_0`'s, both halves masked.
#[target_feature(enable = "avx2")]
pub(super) fn pack_q5_0(q: &[i8; 32]) -> (u32, [u8; 16]) {
    let v = clamped(q, 31);
    let qh = _mm256_movemask_epi8(_mm256_slli_epi16::<3>(v)) as u32;
    let (lo, hi) = halves(v);
    let m = _mm_set1_epi8(0x0F);
    let low = _mm_or_si128(
        _mm_and_si128(lo, m),
        _mm_slli_epi16::<4>(_mm_and_si128(hi, m)),
    );
    (qh, bytes16(low))
}

/// `N` vectors, vector `i` holding value `i` of sub-blocks `first..first + 8` of `N` values each.
#[inline]
#[target_feature(enable = "avx2")]
fn transpose<const N: usize>(x: &[f32], first: usize) -> [V; N] {
    let mut t = [[0f32; 8]; N];
    for (j, sub) in x[N * first..N * (first + 8)].chunks_exact(N).enumerate() {
        for (i, &v) in sub.iter().enumerate() {
            t[i][j] = v;
        }
    }
    // SAFETY: each row of `t` holds 8 values
    std::array::from_fn(|i| unsafe { _mm256_loadu_ps(t[i].as_ptr()) })
}

/// Writes lane `j` of each of `l` (levels as f32) to `out[n * j + i]`.
#[inline]
#[target_feature(enable = "avx2")]
fn store_levels<const N: usize>(l: &[V; N], out: &mut [u8]) {
    for (i, v) in l.iter().enumerate() {
        for (j, &q) in lanes(*v).iter().enumerate() {
            out[N * j + i] = q as u8;
        }
    }
}

#[inline]
#[target_feature(enable = "avx2")]
fn lanes(v: V) -> [f32; 8] {
    let mut out = [0f32; 8];
    // SAFETY: `out` holds 8 values
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) };
    out
}

/// [`super::kquant::q4k_search`], sub-block `j` in lane `j`: `make_qkx2_quants(15, ..., -1, 0.1,
/// 20)` under weights `rms + |x|`. The search's levels are written to `levels` only when
/// `LEVELS` (`q4k` recomputes every sub-block's levels from its stored scale, and needs the
/// search's only where that scale is 0): without them each trial saves a select per value.
///
/// `x` must hold at least 256 values (whole blocks).
#[target_feature(enable = "avx2")]
pub(super) fn q4k_search<const LEVELS: bool>(
    x: &[f32],
    levels: &mut [u8; QK_K],
) -> ([f32; 8], [f32; 8]) {
    let xt: [V; 32] = transpose::<32>(x, 0);
    let zero = _mm256_setzero_ps();
    let mut sum_x2 = zero;
    for &v in &xt {
        sum_x2 = add(sum_x2, mul(v, v));
    }
    let av_x = _mm256_sqrt_ps(div(sum_x2, splat(32.0)));
    let w: [V; 32] = std::array::from_fn(|i| add(av_x, abs(xt[i])));
    let (mut min, mut max) = (xt[0], xt[0]);
    let mut sum_w = w[0];
    let mut sum_x = mul(sum_w, xt[0]);
    for i in 1..32 {
        // `if x < min { min = x }`: minps(x, min) is `x < min ? x : min`, as maxps for `>`
        min = _mm256_min_ps(xt[i], min);
        max = _mm256_max_ps(xt[i], max);
        sum_w = add(sum_w, w[i]);
        sum_x = add(sum_x, mul(w[i], xt[i]));
    }
    min = select(min, zero, gt(min, zero));
    // a flat sub-block keeps levels 0, scale 0 and its minimum
    let flat = _mm256_cmp_ps::<_CMP_EQ_OQ>(max, min);
    let flat_min = min;
    let nmax = splat(15.0);
    let iscale = div(nmax, sub(max, min));
    let mut scale = div(splat(1.0), iscale);
    let mut l = [zero; 32];
    let mut best = zero;
    for i in 0..32 {
        let q = level(mul(iscale, sub(xt[i], min)), 0, 15);
        if LEVELS {
            l[i] = q;
        }
        let diff = sub(add(mul(scale, q), min), xt[i]);
        best = add(best, mul(w[i], mul(diff, diff)));
    }
    let mut aux = [zero; 32];
    for is in 0..=20 {
        let iscale = div(splat(-1.0 + 0.1 * is as f32 + 15.0), sub(max, min));
        let (mut sum_l, mut sum_l2, mut sum_xl) = (zero, zero, zero);
        for i in 0..32 {
            let q = level(mul(iscale, sub(xt[i], min)), 0, 15);
            aux[i] = q;
            let wl = mul(w[i], q);
            sum_l = add(sum_l, wl);
            sum_l2 = add(sum_l2, mul(wl, q));
            sum_xl = add(sum_xl, mul(wl, xt[i]));
        }
        let det = sub(mul(sum_w, sum_l2), mul(sum_l, sum_l));
        let mut this_scale = div(sub(mul(sum_w, sum_xl), mul(sum_x, sum_l)), det);
        let mut this_min = div(sub(mul(sum_l2, sum_x), mul(sum_l, sum_xl)), det);
        let positive = gt(this_min, zero);
        this_min = select(this_min, zero, positive);
        this_scale = select(this_scale, div(sum_xl, sum_l2), positive);
        let mut cur = zero;
        for i in 0..32 {
            let diff = sub(add(mul(this_scale, aux[i]), this_min), xt[i]);
            cur = add(cur, mul(w[i], mul(diff, diff)));
        }
        let take = _mm256_and_ps(gt(det, zero), lt(cur, best));
        if LEVELS {
            for i in 0..32 {
                l[i] = select(l[i], aux[i], take);
            }
        }
        best = select(best, cur, take);
        scale = select(scale, this_scale, take);
        min = select(min, this_min, take);
    }
    if LEVELS {
        for v in l.iter_mut() {
            *v = select(*v, zero, flat);
        }
        store_levels::<32>(&l, levels);
    }
    let scale = select(scale, zero, flat);
    let min = select(min, flat_min, flat);
    (lanes(scale), lanes(_mm256_xor_ps(min, splat(-0.0))))
}

/// [`super::kquant::q6k_search`], sixteen sub-blocks as two groups of eight lanes:
/// `make_qx_quants(32, ...)` with weights `x²`.
///
/// `x` must hold at least 256 values (whole blocks).
#[target_feature(enable = "avx2")]
pub(super) fn q6k_search(x: &[f32], levels: &mut [u8; QK_K]) -> [f32; 16] {
    let mut scales = [0f32; 16];
    for group in 0..2 {
        let xt: [V; 16] = transpose::<16>(x, 8 * group);
        let zero = _mm256_setzero_ps();
        let (mut max, mut amax) = (zero, zero);
        for &v in &xt {
            let a = abs(v);
            let bigger = gt(a, amax);
            amax = select(amax, a, bigger);
            max = select(max, v, bigger);
        }
        let flat = lt(amax, splat(1e-15));
        let sums = |iscale: V, q: &mut [V; 16]| {
            let (mut sumlx, mut suml2) = (zero, zero);
            for i in 0..16 {
                q[i] = level(mul(iscale, xt[i]), -32, 31);
                let w = mul(xt[i], xt[i]);
                sumlx = add(sumlx, mul(mul(w, xt[i]), q[i]));
                suml2 = add(suml2, mul(mul(w, q[i]), q[i]));
            }
            (sumlx, suml2)
        };
        let mut l = [zero; 16];
        let (sumlx, suml2) = sums(div(splat(-32.0), max), &mut l);
        let nonzero = _mm256_cmp_ps::<_CMP_NEQ_UQ>(suml2, zero);
        let mut scale = select(zero, div(sumlx, suml2), nonzero);
        let mut best = mul(scale, sumlx);
        let mut q = [zero; 16];
        for is in (-9..=9).filter(|&i| i != 0) {
            let (sumlx, suml2) = sums(div(splat(-(32.0 + 0.1 * is as f32)), max), &mut q);
            let take = _mm256_and_ps(gt(suml2, zero), gt(mul(sumlx, sumlx), mul(best, suml2)));
            for i in 0..16 {
                l[i] = select(l[i], q[i], take);
            }
            scale = select(scale, div(sumlx, suml2), take);
            best = select(best, mul(scale, sumlx), take);
        }
        for v in l.iter_mut() {
            *v = select(add(*v, splat(32.0)), zero, flat);
        }
        store_levels::<16>(&l, &mut levels[128 * group..128 * group + 128]);
        scales[8 * group..8 * group + 8].copy_from_slice(&lanes(select(scale, zero, flat)));
    }
    scales
}
