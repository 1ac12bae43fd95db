//! The block products of `mod.rs` in AVX2 intrinsics, over the grouped layout of `x8.rs`: one
//! 32-byte load holds four consecutive levels of each of eight weight rows, so every vector lane
//! belongs to one weight row from the load to the result and no horizontal sums are needed.
//!
//! Per group of four values: the levels (unsigned, below 64) times the activation's four bytes
//! broadcast to every lane (`maddubs`, pairwise into 16 bits), summed in 16 bits while the sums
//! cannot overflow, then into 32-bit lanes (`madd`, with ones or with the rows' sub-block
//! scales). Each 32-value activation block's integer sums are converted once and scaled by the
//! eight rows' f16 scales at once (F16C) and the activation block's scale. `q8_0`'s signed levels
//! go through the sign trick; the unsigned formats' offsets (`q4_0`'s 8, `q5_0`'s 16, `q6_K`'s 32)
//! and `q4_K`'s minimums are taken off through the activation blocks' sums. The integer sums equal
//! the portable code's exactly; up to four activation rows share each unpacked weight vector.

// the loops walk several per-row arrays (sums, accumulators, activation blocks) by one index
#![allow(clippy::needless_range_loop)]

use super::x8::{Group, Layout};
use super::{Acts, RowsOut, QK};
use crate::quantize::BlockType;
use std::arch::x86_64::*;

/// How far ahead of the blocks being multiplied the loops ask for the levels: 32 kilobytes, into
/// L2 rather than L1 (which a stream that far ahead would thrash). On the 2-core benchmark VM
/// (Zen 4, 32 GB/s for a plain two-thread read) the batch-1 products of a weight streamed from
/// memory went from 17-18 GB/s (eight kilobytes ahead into L1) to 27-28 GB/s for `q4_0` and
/// `q4_K` and 24 for `q6_K` (`cpu_quant_bench`, the 1B head).
pub(super) const AHEAD: usize = 32 * 1024;

/// Bytes of 8-bit activations a tile of prefill rows holds (a quarter of a core's L2 on current
/// x86 server parts).
const TILE_BYTES: usize = 128 * 1024;

/// Asks L2 for the `bytes` (a multiple of 64) at `p` (which need not be valid memory).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn prefetch(p: *const u8, bytes: usize) {
    for l in (0..bytes).step_by(64) {
        _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(l).cast());
    }
}

/// Asks the cache for block `b`'s share of group `g`'s bytes `AHEAD` of it. The group's regions
/// are one run of `g.share` bytes a block, so the blocks' asks cover the weight's stream without
/// gaps whatever its fields (asks made region by region, each `AHEAD` of its own region, left
/// a fifth of a `q6_K` stream to demand misses). Products of `R` activation rows spend `R` times
/// as long on each byte, so they ask `AHEAD / R` ahead.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn prefetch_block<const R: usize>(g: &Group, b: usize) {
    prefetch(g.region[0].wrapping_add(g.share * b + AHEAD / R), g.share);
}

/// Four activation bytes (values `4g..4g + 4` of the block at `p`) in every lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn bcast(p: *const i8, g: usize) -> __m256i {
    // SAFETY: the caller's block holds 32 bytes
    _mm256_set1_epi32(unsafe { p.add(4 * g).cast::<i32>().read_unaligned() })
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load(p: *const u8) -> __m256i {
    // SAFETY: 32 readable bytes (caller)
    unsafe { _mm256_loadu_si256(p.cast()) }
}

/// Eight f16 scales.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn scales8(p: *const u8) -> __m256 {
    // SAFETY: 16 readable bytes (caller)
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
}

/// Eight unsigned (`SIGNED` false) or signed byte scales, each as two equal 16-bit halves of
/// its lane (the multiplier of `madd`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn scale_pairs<const SIGNED: bool>(p: *const u8) -> __m256i {
    // SAFETY: 8 readable bytes (caller)
    let b = unsafe { _mm_loadl_epi64(p.cast()) };
    let x = if SIGNED {
        _mm256_and_si256(_mm256_cvtepi8_epi32(b), _mm256_set1_epi32(0xFFFF))
    } else {
        _mm256_cvtepu8_epi32(b)
    };
    _mm256_or_si256(x, _mm256_slli_epi32::<16>(x))
}

/// Activation blocks of 32 values to 8 bits, as `quantize_block` in `mod.rs` does (the same
/// levels, sums and scales: `vroundps` rounds ties to even as its portable rounding does).
///
/// # Safety
/// The host has AVX2, FMA and F16C; `x` and `q` hold `d.len()` and `half.len()` blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn quantize_blocks(
    x: &[f32],
    q: &mut [i8],
    d: &mut [f32],
    half: &mut [[i32; 2]],
) {
    assert!(x.len() == q.len() && x.len() == QK * d.len() && d.len() == half.len());
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    for b in 0..d.len() {
        // SAFETY: block `b` is within the slices (asserted)
        let v: [__m256; 4] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(x.as_ptr().add(QK * b + 8 * i)) });
        let m = _mm256_max_ps(
            _mm256_max_ps(_mm256_and_ps(v[0], abs), _mm256_and_ps(v[1], abs)),
            _mm256_max_ps(_mm256_and_ps(v[2], abs), _mm256_and_ps(v[3], abs)),
        );
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        let s = amax / 127.0;
        let id = _mm256_set1_ps(if s > 0.0 { 1.0 / s } else { 0.0 });
        let r: [__m256i; 4] = std::array::from_fn(|i| {
            _mm256_cvtps_epi32(_mm256_round_ps::<
                { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
            >(_mm256_mul_ps(v[i], id)))
        });
        // 32-bit lanes -> bytes in order (packs interleave the 128-bit halves; the permute undoes it)
        let p16 = [
            _mm256_packs_epi32(r[0], r[1]),
            _mm256_packs_epi32(r[2], r[3]),
        ];
        let p8 = _mm256_packs_epi16(p16[0], p16[1]);
        let p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: 32 bytes of block `b`
        unsafe { _mm256_storeu_si256(q.as_mut_ptr().add(QK * b).cast(), p8) };
        let sums = _mm256_madd_epi16(
            _mm256_maddubs_epi16(_mm256_set1_epi8(1), p8),
            _mm256_set1_epi16(1),
        );
        let mut lanes = [0i32; 8];
        // SAFETY: eight i32 values
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), sums) };
        half[b] = [lanes[..4].iter().sum(), lanes[4..].iter().sum()];
        d[b] = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT }>(
            _mm_set_ss(s),
        )));
    }
}

/// `acc[r] += (sum as f32) * dw * d_a` for activation block `blk` of row `r`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn scale_into(acc: &mut __m256, sum: __m256i, dw: __m256, da: f32) {
    *acc = _mm256_fmadd_ps(
        _mm256_cvtepi32_ps(sum),
        _mm256_mul_ps(dw, _mm256_set1_ps(da)),
        *acc,
    );
}

/// `acc += (sum - offset * (sum of the block's levels)) * dw * d_a` for activation block `blk`:
/// the products of unsigned levels stored `offset` above the signed ones.
///
/// # Safety
/// `blk` is below the activation blocks of `acts`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn offset_into(
    acc: &mut __m256,
    sum: __m256i,
    offset: i32,
    dw: __m256,
    acts: &Acts,
    blk: usize,
) {
    // SAFETY: the caller's
    let ([h0, h1], da) = unsafe { (*acts.half.get_unchecked(blk), *acts.d.get_unchecked(blk)) };
    let sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(offset * (h0 + h1)));
    scale_into(acc, sum, dw, da);
}

/// Super-block `sb` of a `q4_K` group: its eight rows' scales `d` and `dmin`, once the cache was
/// asked for the super-block's share of the group ([`prefetch_block`], for `R` activation rows).
///
/// # Safety
/// `sb` is below `g.nb`, `g` pointing into a live `q4_K` weight.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4k_super_block<const R: usize>(g: &Group, sb: usize) -> (__m256, __m256) {
    let [_, d, dmin, _, _] = g.region;
    prefetch_block::<R>(g, sb);
    // SAFETY: super-block `sb`'s scales (caller)
    unsafe { (scales8(d.add(16 * sb)), scales8(dmin.add(16 * sb))) }
}

/// Group `t` of sub-blocks `2c` and `2c + 1` of super-block `sb` of a `q4_K` group: the low and
/// the high nibbles of one 32-byte load.
///
/// # Safety
/// As [`q4k_super_block`], `c < 4`, `t < 8`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4k_nibbles(g: &Group, sb: usize, c: usize, t: usize) -> (__m256i, __m256i) {
    let m4 = _mm256_set1_epi8(0x0F);
    // SAFETY: within the super-block's levels (caller)
    let v = unsafe { load(g.region[0].add(1024 * sb + 256 * c + 32 * t)) };
    (
        _mm256_and_si256(v, m4),
        _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4),
    )
}

/// The eight rows' minimums of sub-block `sub` of super-block `sb` of a `q4_K` group, in f32.
///
/// # Safety
/// As [`q4k_super_block`], `sub < 8`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4k_mins(g: &Group, sb: usize, sub: usize) -> __m256 {
    // SAFETY: the sub-block's minimums (caller)
    let mins = unsafe { _mm_loadl_epi64(g.region[4].add(64 * sb + 8 * sub).cast()) };
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mins))
}

/// A `q4_K` sub-block into `acc`: `sum`, the integer sums of its levels with activation block
/// `blk` already times the sub-block scales, scaled by `dv` and the activation's scale, less the
/// sub-block's minimums `mins` times `dmv` and the activation's sum.
///
/// # Safety
/// `blk` is below the activation blocks of `acts`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4k_sub_block(
    acc: &mut __m256,
    sum: __m256i,
    (dv, dmv): (__m256, __m256),
    mins: __m256,
    acts: &Acts,
    blk: usize,
) {
    // SAFETY: the activation block (caller)
    let ([h0, h1], da) = unsafe { (*acts.half.get_unchecked(blk), *acts.d.get_unchecked(blk)) };
    scale_into(acc, sum, dv, da);
    let m = _mm256_mul_ps(dmv, _mm256_set1_ps(da * (h0 + h1) as f32));
    *acc = _mm256_fnmadd_ps(mins, m, *acc);
}

/// The eight rows of group `g` times activation rows starting at blocks `a0[r]`: one vector per
/// activation row, lane `j` the product with weight row `j`.
///
/// # Safety
/// The host has AVX2, FMA and F16C; `g` points into a live weight of `format` whose rows hold
/// `g.nb` blocks, and `acts` holds the matching blocks from each `a0[r]` on.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn group_dot<const R: usize>(
    format: BlockType,
    g: &Group,
    acts: &Acts,
    a0: [usize; R],
) -> [__m256; R] {
    let per_row = g.nb * format.block_values() / QK;
    assert!(a0.iter().all(|&a| acts.d.len() >= a + per_row));
    // SAFETY: the activation blocks are in bounds (asserted); the weight's (caller)
    unsafe {
        match format {
            BlockType::Q8_0 if super::vnni::available() => super::vnni::q8_0(g, acts, a0),
            BlockType::Q8_0 => q8_0(g, acts, a0),
            BlockType::Q4_0 if super::vnni::available() => {
                super::vnni::q4_0::<false, R>(g, acts, a0)
            }
            BlockType::Q4_0 => q4_0::<false, R>(g, acts, a0),
            BlockType::Q5_0 if super::vnni::available() => {
                super::vnni::q4_0::<true, R>(g, acts, a0)
            }
            BlockType::Q5_0 => q4_0::<true, R>(g, acts, a0),
            BlockType::Q4K if super::vnni::available() => super::vnni::q4k(g, acts, a0),
            BlockType::Q4K => q4k(g, acts, a0),
            BlockType::Q6K if super::vnni::available() => super::vnni::q6k(g, acts, a0),
            BlockType::Q6K => q6k(g, acts, a0),
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q8_0<const R: usize>(g: &Group, acts: &Acts, a0: [usize; R]) -> [__m256; R] {
    let [qs, d, ..] = g.region;
    let ones = _mm256_set1_epi16(1);
    let aq = acts.q.as_ptr();
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..g.nb {
        // SAFETY (the pointer arithmetic and loads): block `b` of the group's regions, and
        // activation block `a0[r] + b` (caller)
        let w = unsafe { qs.add(256 * b) };
        prefetch_block::<R>(g, b);
        let mut sum = [_mm256_setzero_si256(); R];
        for gi in 0..8 {
            let wv = unsafe { load(w.add(32 * gi)) };
            let aw = _mm256_sign_epi8(wv, wv);
            for r in 0..R {
                let ap = unsafe { aq.add((a0[r] + b) * QK) };
                let sa = _mm256_sign_epi8(unsafe { bcast(ap, gi) }, wv);
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sa), ones);
                sum[r] = _mm256_add_epi32(sum[r], p);
            }
        }
        let dw = unsafe { scales8(d.add(16 * b)) };
        for r in 0..R {
            scale_into(&mut acc[r], sum[r], dw, unsafe {
                *acts.d.get_unchecked(a0[r] + b)
            });
        }
    }
    acc
}

/// The fifth bits of group `gi`'s four levels per row, at bit 4 of each byte (`x8`'s
/// permutation puts value `4g + i`'s bit at `8i + g`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fifth_bits(qh: __m256i, gi: usize) -> __m256i {
    let v = match gi {
        0 => _mm256_slli_epi32::<4>(qh),
        1 => _mm256_slli_epi32::<3>(qh),
        2 => _mm256_slli_epi32::<2>(qh),
        3 => _mm256_slli_epi32::<1>(qh),
        4 => qh,
        5 => _mm256_srli_epi32::<1>(qh),
        6 => _mm256_srli_epi32::<2>(qh),
        _ => _mm256_srli_epi32::<3>(qh),
    };
    _mm256_and_si256(v, _mm256_set1_epi8(0x10))
}

/// The levels of block `b` of a `q4_0` group, or of a `q5_0` group when `FIVE` (the fifth bits
/// from their own region), as bytes in groups of four per row, and the eight rows' scales, once
/// the cache was asked for the block's share of the group ([`prefetch_block`], for `R` rows).
///
/// # Safety
/// `b` is below `g.nb`, `g` pointing into a live weight of that format.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4_0_levels<const FIVE: bool, const R: usize>(
    g: &Group,
    b: usize,
) -> ([__m256i; 8], __m256) {
    prefetch_block::<R>(g, b);
    let qs = g.region[0];
    let (qh, d) = if FIVE {
        (g.region[1], g.region[2])
    } else {
        (g.region[1], g.region[1])
    };
    let m4 = _mm256_set1_epi8(0x0F);
    // SAFETY (the pointer arithmetic and loads): block `b` of the group's regions (caller)
    let w = unsafe { qs.add(128 * b) };
    let mut lv = [_mm256_setzero_si256(); 8];
    for t in 0..4 {
        let v = unsafe { load(w.add(32 * t)) };
        lv[t] = _mm256_and_si256(v, m4);
        lv[t + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
    }
    if FIVE {
        let h = unsafe { load(qh.add(32 * b)) };
        for (gi, l) in lv.iter_mut().enumerate() {
            *l = _mm256_or_si256(*l, fifth_bits(h, gi));
        }
    }
    (lv, unsafe { scales8(d.add(16 * b)) })
}

/// `q4_0`, and `q5_0` when `FIVE`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4_0<const FIVE: bool, const R: usize>(
    g: &Group,
    acts: &Acts,
    a0: [usize; R],
) -> [__m256; R] {
    let offset = if FIVE { 16 } else { 8 };
    let ones = _mm256_set1_epi16(1);
    let aq = acts.q.as_ptr();
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..g.nb {
        // SAFETY (the pointer arithmetic and loads): block `b` of the group's regions, and
        // activation block `a0[r] + b` (caller)
        let (lv, dw) = unsafe { q4_0_levels::<FIVE, R>(g, b) };
        for r in 0..R {
            let blk = a0[r] + b;
            let ap = unsafe { aq.add(blk * QK) };
            // 16-bit sums: four groups of 5-bit levels, eight of 4-bit ones, cannot overflow
            let mut s = [_mm256_setzero_si256(); 2];
            for (gi, l) in lv.iter().enumerate() {
                let p = _mm256_maddubs_epi16(*l, unsafe { bcast(ap, gi) });
                let h = if FIVE { gi / 4 } else { 0 };
                s[h] = _mm256_add_epi16(s[h], p);
            }
            let mut s32 = _mm256_madd_epi16(s[0], ones);
            if FIVE {
                s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(s[1], ones));
            }
            unsafe { offset_into(&mut acc[r], s32, offset, dw, acts, blk) };
        }
    }
    acc
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4k<const R: usize>(g: &Group, acts: &Acts, a0: [usize; R]) -> [__m256; R] {
    let sc = g.region[3];
    let aq = acts.q.as_ptr();
    let mut acc = [_mm256_setzero_ps(); R];
    for sb in 0..g.nb {
        // SAFETY (the pointer arithmetic and loads): super-block `sb` of the group's regions,
        // and activation blocks `a0[r] + 8 sb + (0..8)` (caller)
        let scales = unsafe { q4k_super_block::<R>(g, sb) };
        for c in 0..4 {
            let mut s = [[_mm256_setzero_si256(); 2]; R];
            for t in 0..8 {
                let (lo, hi) = unsafe { q4k_nibbles(g, sb, c, t) };
                for r in 0..R {
                    let ap = unsafe { aq.add((a0[r] + 8 * sb + 2 * c) * QK) };
                    let p0 = _mm256_maddubs_epi16(lo, unsafe { bcast(ap, t) });
                    let p1 = _mm256_maddubs_epi16(hi, unsafe { bcast(ap.add(QK), t) });
                    s[r][0] = _mm256_add_epi16(s[r][0], p0);
                    s[r][1] = _mm256_add_epi16(s[r][1], p1);
                }
            }
            for h in 0..2 {
                let sub = 2 * c + h;
                let scp = unsafe { scale_pairs::<false>(sc.add(64 * sb + 8 * sub)) };
                let mins = unsafe { q4k_mins(g, sb, sub) };
                for r in 0..R {
                    let sum = _mm256_madd_epi16(s[r][h], scp);
                    let blk = a0[r] + 8 * sb + sub;
                    unsafe { q4k_sub_block(&mut acc[r], sum, scales, mins, acts, blk) };
                }
            }
        }
    }
    acc
}

/// The 6-bit levels of activation block `q` (values `32q..32q + 32` of a half) for group `t`:
/// low bits from the nibbles of `ql`, high bits from `qh`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q6_levels(ql: __m256i, qh: __m256i, q: usize) -> __m256i {
    let m4 = _mm256_set1_epi8(0x0F);
    let lo = if q < 2 {
        _mm256_and_si256(ql, m4)
    } else {
        _mm256_and_si256(_mm256_srli_epi16::<4>(ql), m4)
    };
    let hi = match q {
        0 => _mm256_slli_epi16::<4>(qh),
        1 => _mm256_slli_epi16::<2>(qh),
        2 => qh,
        _ => _mm256_srli_epi16::<2>(qh),
    };
    _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)))
}

/// The 6-bit levels of group `t` of the four activation blocks of a half super-block (`lsrc`:
/// its low bits, 512 bytes; `hsrc`: its high bits, 256 bytes), per block.
///
/// # Safety
/// `lsrc` and `hsrc` point at a half super-block of a group's regions.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q6_group(lsrc: *const u8, hsrc: *const u8, t: usize) -> [__m256i; 4] {
    // SAFETY: within the half super-block (caller)
    let (la, lb, hv) = unsafe {
        (
            load(lsrc.add(32 * t)),
            load(lsrc.add(256 + 32 * t)),
            load(hsrc.add(32 * t)),
        )
    };
    [
        q6_levels(la, hv, 0),
        q6_levels(lb, hv, 1),
        q6_levels(la, hv, 2),
        q6_levels(lb, hv, 3),
    ]
}

/// Super-block `sb` of a `q6_K` group: its eight rows' scales `d`, once the cache was asked for
/// the super-block's share of the group ([`prefetch_block`], for `R` activation rows).
///
/// # Safety
/// `sb` is below `g.nb`, `g` pointing into a live `q6_K` weight.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q6_super_block<const R: usize>(g: &Group, sb: usize) -> __m256 {
    let [.., d, _] = g.region;
    prefetch_block::<R>(g, sb);
    // SAFETY: super-block `sb`'s scales (caller)
    unsafe { scales8(d.add(16 * sb)) }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q6k<const R: usize>(g: &Group, acts: &Acts, a0: [usize; R]) -> [__m256; R] {
    let [ql, qh, sc, _, _] = g.region;
    let aq = acts.q.as_ptr();
    let mut acc = [_mm256_setzero_ps(); R];
    for sb in 0..g.nb {
        // SAFETY (the pointer arithmetic and loads): super-block `sb` of the group's regions,
        // and activation blocks `a0[r] + 8 sb + (0..8)` (caller)
        let dv = unsafe { q6_super_block::<R>(g, sb) };
        // the 16 sub-blocks' scales of the eight rows, as `madd` multipliers
        let mut scp = [_mm256_setzero_si256(); 16];
        for (s, v) in scp.iter_mut().enumerate() {
            *v = unsafe { scale_pairs::<true>(sc.add(128 * sb + 8 * s)) };
        }
        for h in 0..2 {
            let lsrc = unsafe { ql.add(1024 * sb + 512 * h) };
            let hsrc = unsafe { qh.add(512 * sb + 256 * h) };
            // values 128h + 32q + (0..32): activation block 4h + q; sub-block 8h + 2q + t / 4
            let mut s = [[_mm256_setzero_si256(); R]; 4];
            for tp in 0..4 {
                let mut p16 = [[_mm256_setzero_si256(); R]; 4];
                for t in [2 * tp, 2 * tp + 1] {
                    let lv = unsafe { q6_group(lsrc, hsrc, t) };
                    for q in 0..4 {
                        for r in 0..R {
                            let ap = unsafe { aq.add((a0[r] + 8 * sb + 4 * h + q) * QK) };
                            // two groups of 6-bit levels fit 16 bits
                            let p = _mm256_maddubs_epi16(lv[q], unsafe { bcast(ap, t) });
                            p16[q][r] = _mm256_add_epi16(p16[q][r], p);
                        }
                    }
                }
                for q in 0..4 {
                    let m = scp[8 * h + 2 * q + tp / 2];
                    for r in 0..R {
                        s[q][r] = _mm256_add_epi32(s[q][r], _mm256_madd_epi16(p16[q][r], m));
                    }
                }
            }
            for q in 0..4 {
                let s0 = 8 * h + 2 * q;
                for r in 0..R {
                    let blk = a0[r] + 8 * sb + 4 * h + q;
                    // the offset 32: 32 (sc0 * sum of values 0..16 + sc1 * sum of 16..32)
                    let [h0, h1] = unsafe { *acts.half.get_unchecked(blk) };
                    let off = _mm256_add_epi32(
                        _mm256_madd_epi16(scp[s0], _mm256_set1_epi32(h0 & 0xFFFF)),
                        _mm256_madd_epi16(scp[s0 + 1], _mm256_set1_epi32(h1 & 0xFFFF)),
                    );
                    let sum = _mm256_sub_epi32(s[q][r], _mm256_slli_epi32::<5>(off));
                    scale_into(&mut acc[r], sum, dv, unsafe { *acts.d.get_unchecked(blk) });
                }
            }
        }
    }
    acc
}

/// [`group_dot`] for `R` activation rows, stored into `v[..R]`.
///
/// # Safety
/// As [`group_dot`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_into<const R: usize>(
    format: BlockType,
    g: &Group,
    acts: &Acts,
    a0: [usize; R],
    v: &mut [[f32; 8]; 4],
) {
    // SAFETY: the caller's guarantees; eight f32 values per store
    for (o, x) in v.iter_mut().zip(unsafe { group_dot(format, g, acts, a0) }) {
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), x) };
    }
}

/// Groups `groups` of the weight times one activation row, into `out[8 (g - groups.start) + j]`
/// (weight row `8g + j`).
///
/// # Safety
/// As [`group_dot`], for every group in `groups`; `out` holds 8 values per group.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn products_one(
    format: BlockType,
    layout: &Layout,
    groups: std::ops::Range<usize>,
    acts: &Acts,
    nb: usize,
    out: &mut [f32],
) {
    // the first groups' bytes are asked for at once: the loops ask for each block's only once
    // they run, `AHEAD` bytes before it
    let (start, len) = layout.span(groups.clone());
    prefetch(start, len.min(AHEAD));
    // batch-1 decode: the lanes are the outputs
    let one: unsafe fn(&Group, &Acts, [usize; 1]) -> [__m256; 1] = match format {
        BlockType::Q8_0 if super::vnni::available() => super::vnni::q8_0::<1>,
        BlockType::Q8_0 => q8_0::<1>,
        BlockType::Q4_0 if super::vnni::available() => super::vnni::q4_0::<false, 1>,
        BlockType::Q4_0 => q4_0::<false, 1>,
        BlockType::Q5_0 if super::vnni::available() => super::vnni::q4_0::<true, 1>,
        BlockType::Q5_0 => q4_0::<true, 1>,
        BlockType::Q4K if super::vnni::available() => super::vnni::q4k::<1>,
        BlockType::Q4K => q4k::<1>,
        BlockType::Q6K if super::vnni::available() => super::vnni::q6k::<1>,
        BlockType::Q6K => q6k::<1>,
    };
    assert!(acts.d.len() >= nb && out.len() >= 8 * groups.len());
    for (o, g) in out.chunks_exact_mut(8).zip(groups) {
        // SAFETY: the caller's guarantees; eight f32 values
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), one(&layout.group(g), acts, [0])[0]) };
    }
}

/// Groups `groups` of the weight times all `y.rows()` activation rows (each `nb` blocks), four
/// activation rows at a time, into the columns `8 groups.start..8 groups.end` of `y`.
///
/// # Safety
/// As [`group_dot`], for every group in `groups`; `acts` holds `y.rows()` rows; no other thread
/// writes these columns of `y` meanwhile.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn products_rows(
    format: BlockType,
    layout: &Layout,
    groups: std::ops::Range<usize>,
    acts: &Acts,
    nb: usize,
    y: RowsOut,
) {
    let m = y.rows();
    let (start, len) = layout.span(groups.clone());
    prefetch(start, len.min(AHEAD));
    // activation rows in tiles that stay in the core's L2 while every group of the task passes
    // over them (each group's weight bytes stay in L1 for the tile's rows)
    let tile = (TILE_BYTES / (nb * QK)).max(4) / 4 * 4;
    for t0 in (0..m).step_by(tile) {
        let t1 = (t0 + tile).min(m);
        for g in groups.clone() {
            let grp = layout.group(g);
            let mut i = t0;
            while i < t1 {
                let rows = (t1 - i).min(4);
                let a = |r: usize| (i + r) * nb;
                let mut v = [[0f32; 8]; 4];
                // SAFETY: the caller's guarantees
                unsafe {
                    match rows {
                        4 => dot_into(format, &grp, acts, [a(0), a(1), a(2), a(3)], &mut v),
                        3 => dot_into(format, &grp, acts, [a(0), a(1), a(2)], &mut v),
                        2 => dot_into(format, &grp, acts, [a(0), a(1)], &mut v),
                        _ => dot_into(format, &grp, acts, [a(0)], &mut v),
                    }
                }
                for (r, vr) in v.iter().take(rows).enumerate() {
                    // SAFETY: row i + r < m; these columns are this task's (caller)
                    unsafe { y.put(i + r, 8 * g, vr) };
                }
                i += rows;
            }
        }
    }
}
