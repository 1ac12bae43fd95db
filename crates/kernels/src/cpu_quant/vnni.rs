//! `q8_0`, `q4_0`, `q5_0`, `q4_K` and `q6_K` products with AVX-512 VNNI on 256-bit vectors (`vpdpbusd`), where the host
//! has it: the same grouped layout, levels and activation blocks as `avx2.rs`, but each group of
//! four levels times four activation bytes is summed straight into 32-bit lanes, one instruction
//! where AVX2 takes a `maddubs`, an add and (per sub-block or pair) a `madd`; the sub-block scales
//! then multiply the 32-bit sums. The integer sums equal AVX2's, so the results are the same bits.

#![allow(clippy::needless_range_loop)]

use super::avx2::{
    bcast, offset_into, prefetch_block, q4_0_levels, q4k_mins, q4k_nibbles, q4k_sub_block,
    q4k_super_block, q6_group, q6_super_block, scale_into, scale_pairs, scales8,
};
use super::x8::Group;
use super::{Acts, QK};
use std::arch::x86_64::*;
use std::sync::OnceLock;

/// Whether the host has AVX-512 VNNI on 256-bit vectors (and the AVX2 path's features), unless
/// `RSERVE_CPU_VNNI=0` turns it off.
pub(super) fn available() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("RSERVE_CPU_VNNI").map_or(true, |v| v.trim() != "0")
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("avx512vl")
            && super::uses_avx2()
    })
}

/// Eight unsigned byte scales as 32-bit lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
unsafe fn scales_u32(p: *const u8) -> __m256i {
    // SAFETY: 8 readable bytes (caller)
    _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(p.cast()) })
}

/// Eight signed byte scales as 32-bit lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
unsafe fn scales_i32(p: *const u8) -> __m256i {
    // SAFETY: 8 readable bytes (caller)
    _mm256_cvtepi8_epi32(unsafe { _mm_loadl_epi64(p.cast()) })
}

/// `avx2::q8_0` with VNNI: the signed levels offset by 128 (a flip of the top bit) are unsigned
/// for `vpdpbusd`, and 128 times the activation block's sum is taken off again.
///
/// # Safety
/// As `avx2::group_dot`, on a host where [`available`] holds.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
pub(super) unsafe fn q8_0<const R: usize>(g: &Group, acts: &Acts, a0: [usize; R]) -> [__m256; R] {
    let [qs, d, ..] = g.region;
    let flip = _mm256_set1_epi8(-128);
    let aq = acts.q.as_ptr();
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..g.nb {
        // SAFETY (the pointer arithmetic and loads): block `b` of the group's regions, and
        // activation block `a0[r] + b` (caller)
        let w = unsafe { qs.add(256 * b) };
        prefetch_block::<R>(g, b);
        let mut sum = [_mm256_setzero_si256(); R];
        for gi in 0..8 {
            let wv = _mm256_xor_si256(unsafe { _mm256_loadu_si256(w.add(32 * gi).cast()) }, flip);
            for r in 0..R {
                let ap = unsafe { aq.add((a0[r] + b) * QK) };
                sum[r] = _mm256_dpbusd_epi32(sum[r], wv, unsafe { bcast(ap, gi) });
            }
        }
        let dw = unsafe { scales8(d.add(16 * b)) };
        for r in 0..R {
            unsafe { offset_into(&mut acc[r], sum[r], 128, dw, acts, a0[r] + b) };
        }
    }
    acc
}

/// `avx2::q4_0` (and `q5_0` when `FIVE`) with VNNI.
///
/// # Safety
/// As `avx2::group_dot`, on a host where [`available`] holds.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
pub(super) unsafe fn q4_0<const FIVE: bool, const R: usize>(
    g: &Group,
    acts: &Acts,
    a0: [usize; R],
) -> [__m256; R] {
    let offset = if FIVE { 16 } else { 8 };
    let aq = acts.q.as_ptr();
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..g.nb {
        // SAFETY (the pointer arithmetic and loads): block `b` of the group's regions, and
        // activation block `a0[r] + b` (caller)
        let (lv, dw) = unsafe { q4_0_levels::<FIVE, R>(g, b) };
        for r in 0..R {
            let blk = a0[r] + b;
            let ap = unsafe { aq.add(blk * QK) };
            let mut s = _mm256_setzero_si256();
            for (gi, l) in lv.iter().enumerate() {
                s = _mm256_dpbusd_epi32(s, *l, unsafe { bcast(ap, gi) });
            }
            unsafe { offset_into(&mut acc[r], s, offset, dw, acts, blk) };
        }
    }
    acc
}

/// `avx2::q4k` with VNNI: the eight rows of group `g` times activation rows from blocks `a0[r]`.
///
/// # Safety
/// As `avx2::group_dot`, on a host where [`available`] holds.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
pub(super) unsafe fn q4k<const R: usize>(g: &Group, acts: &Acts, a0: [usize; R]) -> [__m256; R] {
    let sc = g.region[3];
    let aq = acts.q.as_ptr();
    let mut acc = [_mm256_setzero_ps(); R];
    for sb in 0..g.nb {
        // SAFETY (the pointer arithmetic and loads): super-block `sb` of the group's regions,
        // and activation blocks `a0[r] + 8 sb + (0..8)` (caller)
        let scales = unsafe { q4k_super_block::<R>(g, sb) };
        for c in 0..4 {
            // sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles)
            let mut s = [[_mm256_setzero_si256(); 2]; R];
            for t in 0..8 {
                let (lo, hi) = unsafe { q4k_nibbles(g, sb, c, t) };
                for r in 0..R {
                    let ap = unsafe { aq.add((a0[r] + 8 * sb + 2 * c) * QK) };
                    s[r][0] = _mm256_dpbusd_epi32(s[r][0], lo, unsafe { bcast(ap, t) });
                    s[r][1] = _mm256_dpbusd_epi32(s[r][1], hi, unsafe { bcast(ap.add(QK), t) });
                }
            }
            for h in 0..2 {
                let sub = 2 * c + h;
                let m = unsafe { scales_u32(sc.add(64 * sb + 8 * sub)) };
                let mins = unsafe { q4k_mins(g, sb, sub) };
                for r in 0..R {
                    let sum = _mm256_mullo_epi32(s[r][h], m);
                    let blk = a0[r] + 8 * sb + sub;
                    unsafe { q4k_sub_block(&mut acc[r], sum, scales, mins, acts, blk) };
                }
            }
        }
    }
    acc
}

/// The sums of groups `t0..t0 + 4` of a `q6_K` half super-block (`lsrc`, `hsrc` as for
/// `q6_group`) against activation blocks `blocks[r] + q`, per block `q` and row `r`: one call per
/// sub-block half, so that every accumulator is a register (indexing one array by `t / 4` kept
/// them on the stack).
///
/// # Safety
/// As `q6_group`; activation blocks `blocks[r] + (0..4)` exist.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
unsafe fn q6_sums<const R: usize>(
    lsrc: *const u8,
    hsrc: *const u8,
    t0: usize,
    aq: *const i8,
    blocks: [usize; R],
) -> [[__m256i; R]; 4] {
    let mut s = [[_mm256_setzero_si256(); R]; 4];
    for t in t0..t0 + 4 {
        // SAFETY: within the half super-block and the activation blocks (caller)
        let lv = unsafe { q6_group(lsrc, hsrc, t) };
        for q in 0..4 {
            for r in 0..R {
                let a = unsafe { bcast(aq.add((blocks[r] + q) * QK), t) };
                s[q][r] = _mm256_dpbusd_epi32(s[q][r], lv[q], a);
            }
        }
    }
    s
}

/// `avx2::q6k` with VNNI: the eight rows of group `g` times activation rows from blocks `a0[r]`.
///
/// # Safety
/// As `avx2::group_dot`, on a host where [`available`] holds.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
pub(super) unsafe fn q6k<const R: usize>(g: &Group, acts: &Acts, a0: [usize; R]) -> [__m256; R] {
    let [ql, qh, sc, _, _] = g.region;
    let aq = acts.q.as_ptr();
    let mut acc = [_mm256_setzero_ps(); R];
    for sb in 0..g.nb {
        // SAFETY (the pointer arithmetic and loads): super-block `sb` of the group's regions,
        // and activation blocks `a0[r] + 8 sb + (0..8)` (caller)
        let dv = unsafe { q6_super_block::<R>(g, sb) };
        for h in 0..2 {
            let lsrc = unsafe { ql.add(1024 * sb + 512 * h) };
            let hsrc = unsafe { qh.add(512 * sb + 256 * h) };
            // values 128h + 32q + (0..32): activation block 4h + q; its sub-blocks 8h + 2q and
            // 8h + 2q + 1 hold groups t < 4 and t >= 4
            let blocks = a0.map(|b| b + 8 * sb + 4 * h);
            let (lo, hi) = unsafe {
                (
                    q6_sums(lsrc, hsrc, 0, aq, blocks),
                    q6_sums(lsrc, hsrc, 4, aq, blocks),
                )
            };
            for q in 0..4 {
                let s0 = 8 * h + 2 * q;
                let (m0, m1) = unsafe {
                    (
                        scales_i32(sc.add(128 * sb + 8 * s0)),
                        scales_i32(sc.add(128 * sb + 8 * (s0 + 1))),
                    )
                };
                let (p0, p1) = unsafe {
                    (
                        scale_pairs::<true>(sc.add(128 * sb + 8 * s0)),
                        scale_pairs::<true>(sc.add(128 * sb + 8 * (s0 + 1))),
                    )
                };
                for r in 0..R {
                    let blk = a0[r] + 8 * sb + 4 * h + q;
                    let scaled = _mm256_add_epi32(
                        _mm256_mullo_epi32(lo[q][r], m0),
                        _mm256_mullo_epi32(hi[q][r], m1),
                    );
                    // the offset 32: 32 (sc0 * sum of values 0..16 + sc1 * sum of 16..32)
                    let [h0, h1] = unsafe { *acts.half.get_unchecked(blk) };
                    let off = _mm256_add_epi32(
                        _mm256_madd_epi16(p0, _mm256_set1_epi32(h0 & 0xFFFF)),
                        _mm256_madd_epi16(p1, _mm256_set1_epi32(h1 & 0xFFFF)),
                    );
                    let sum = _mm256_sub_epi32(scaled, _mm256_slli_epi32::<5>(off));
                    scale_into(&mut acc[r], sum, dv, unsafe { *acts.d.get_unchecked(blk) });
                }
            }
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::super::{avx2, quantize_acts, X8Weight};
    use crate::quantize::{quantize, test_values as values, BlockType};
    use std::arch::x86_64::*;

    fn lanes(v: __m256) -> [f32; 8] {
        let mut o = [0f32; 8];
        // SAFETY: eight f32 values
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), v) };
        o
    }

    type Kernel<const R: usize> = unsafe fn(&super::Group, &super::Acts, [usize; R]) -> [__m256; R];

    /// The VNNI kernel of `format` gives AVX2's bits for one and for four activation rows.
    fn gives_the_avx2_bits(format: BlockType, one: [Kernel<1>; 2], four: [Kernel<4>; 2]) {
        if !super::available() {
            eprintln!("no AVX-512 VNNI here: skipped");
            return;
        }
        let (n, k) = (70, 1024);
        let q = quantize(format, &values(n * k, 4), k).expect("quantize");
        let w = X8Weight::from_ggml(format, &q, n, k).expect("layout");
        let layout = w.layout();
        let nb = k / super::QK;
        let acts = quantize_acts(&values(4 * k, 11));
        for g in 0..w.groups() {
            let grp = layout.group(g);
            let rows = [0, nb, 2 * nb, 3 * nb];
            // SAFETY: the host has the features (checked above); the group and the four
            // activation rows are this weight's shape
            let (o, f) = unsafe {
                (
                    [one[0](&grp, &acts, [0]), one[1](&grp, &acts, [0])],
                    [four[0](&grp, &acts, rows), four[1](&grp, &acts, rows)],
                )
            };
            assert_eq!(
                lanes(o[0][0]),
                lanes(o[1][0]),
                "{format:?} group {g}, one row"
            );
            for r in 0..4 {
                assert_eq!(
                    lanes(f[0][r]),
                    lanes(f[1][r]),
                    "{format:?} group {g}, row {r} of four"
                );
            }
        }
    }

    #[test]
    fn q8_0_gives_the_avx2_bits() {
        gives_the_avx2_bits(
            BlockType::Q8_0,
            [avx2::q8_0::<1>, super::q8_0::<1>],
            [avx2::q8_0::<4>, super::q8_0::<4>],
        );
    }

    #[test]
    fn q4_0_and_q5_0_give_the_avx2_bits() {
        gives_the_avx2_bits(
            BlockType::Q4_0,
            [avx2::q4_0::<false, 1>, super::q4_0::<false, 1>],
            [avx2::q4_0::<false, 4>, super::q4_0::<false, 4>],
        );
        gives_the_avx2_bits(
            BlockType::Q5_0,
            [avx2::q4_0::<true, 1>, super::q4_0::<true, 1>],
            [avx2::q4_0::<true, 4>, super::q4_0::<true, 4>],
        );
    }

    #[test]
    fn q4k_gives_the_avx2_bits() {
        gives_the_avx2_bits(
            BlockType::Q4K,
            [avx2::q4k::<1>, super::q4k::<1>],
            [avx2::q4k::<4>, super::q4k::<4>],
        );
    }

    #[test]
    fn q6k_gives_the_avx2_bits() {
        gives_the_avx2_bits(
            BlockType::Q6K,
            [avx2::q6k::<1>, super::q6k::<1>],
            [avx2::q6k::<4>, super::q6k::<4>],
        );
    }
}
