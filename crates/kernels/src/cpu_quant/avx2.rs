//! The block products of `mod.rs` in AVX2 intrinsics. Each 32-value block: the weight's levels
//! unpacked into 32 bytes, multiplied with the activation bytes pairwise into 16-bit sums
//! (`maddubs`, unsigned by signed: signed weights go through the sign trick), summed into eight
//! 32-bit lanes (`madd`, with ones or with per-16-value scales), converted to f32 and accumulated
//! with the blocks' scales by FMA. The integer sums equal the portable code's exactly. Up to four
//! activation rows share each unpacked weight block.

use super::{scale_min_k4, Acts, QFormat, QK};
use crate::quantize::BlockType;
use std::arch::x86_64::*;

/// An f16 scale, converted by F16C (every AVX2 host has it; checked with AVX2).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_at(b: &[u8]) -> f32 {
    let bits = u16::from_le_bytes([b[0], b[1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// Horizontal sum of eight f32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Bit `i` of `x` as byte `i` (0xFF where set), for 32 bits.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bytes_from_bits(x: u32) -> __m256i {
    let shuf = _mm256_set_epi64x(
        0x0303030303030303,
        0x0202020202020202,
        0x0101010101010101,
        0x0000000000000000,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x as i32), shuf);
    let bits = _mm256_set1_epi64x(0x8040201008040201u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bits), bits)
}

/// Low nibbles of 16 bytes as values 0..16, high nibbles as 16..32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn nibbles(p: &[u8]) -> __m256i {
    debug_assert!(p.len() >= 16);
    // SAFETY: 16 readable bytes (the caller passes a whole block)
    let lo = unsafe { _mm_loadu_si128(p.as_ptr().cast()) };
    let hi = _mm_srli_epi16(lo, 4);
    _mm256_and_si256(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(0x0F))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load32(p: &[u8]) -> __m256i {
    debug_assert!(p.len() >= 32);
    // SAFETY: 32 readable bytes (checked above in debug builds; callers pass whole blocks)
    unsafe { _mm256_loadu_si256(p.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load_act(acts: &Acts, b: usize) -> __m256i {
    let q = &acts.q[b * QK..(b + 1) * QK];
    // SAFETY: 32 readable bytes
    unsafe { _mm256_loadu_si256(q.as_ptr().cast()) }
}

/// One weight row times the activation rows starting at blocks `a0[r]`, each weight block
/// unpacked once for all `R` rows.
///
/// # Safety
/// The host must have AVX2 and FMA; `w` holds whole blocks of `format` and `acts` the matching
/// activation blocks from each `a0[r]` on.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows_dot<const R: usize>(
    format: QFormat,
    w: &[u8],
    acts: &Acts,
    a0: [usize; R],
) -> [f32; R] {
    match format {
        BlockType::Q8_0 | BlockType::Q4_0 | BlockType::Q5_0 => legacy(format, w, acts, a0),
        BlockType::Q4K => q4k(w, acts, a0),
        BlockType::Q6K => q6k(w, acts, a0),
    }
}

/// Bytes ahead of each weight row's current block that [`legacy_rows8`] asks the cache for.
const PREFETCH_AHEAD: usize = 256;

/// Eight weight rows times the one activation row starting at block `a0` (batch-1 decode). Each
/// block's eight integer dot products are reduced together into one vector, one lane per row
/// (`hadd`), scaled by the eight rows' scales at once and accumulated, so the per-row costs of
/// converting, scaling and summing shrink eightfold; the rows are read as eight streams.
/// `q4_0` and `q5_0` levels enter unsigned and their offset is taken off through the activation
/// block's sum.
///
/// # Safety
/// As [`rows_dot`], for every row of `w`; `format` is `q8_0`, `q4_0` or `q5_0`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn legacy_rows8(
    format: QFormat,
    w: [&[u8]; 8],
    acts: &Acts,
    a0: usize,
) -> [f32; 8] {
    let nb = w[0].len() / format.block_bytes();
    assert!(w.iter().all(|r| r.len() == w[0].len()) && acts.d.len() >= a0 + nb);
    let rows = w.map(|r| r.as_ptr());
    // SAFETY: every row holds `nb` whole blocks and the activations `nb` blocks from `a0`
    // (asserted above); the format is one of the three
    unsafe {
        match format {
            BlockType::Q8_0 => rows8::<0>(rows, nb, acts, a0),
            BlockType::Q4_0 => rows8::<1>(rows, nb, acts, a0),
            _ => rows8::<2>(rows, nb, acts, a0),
        }
    }
}

/// [`legacy_rows8`] for one format (`F`: 0 `q8_0`, 1 `q4_0`, 2 `q5_0`), over raw row pointers.
///
/// # Safety
/// Each of `rows` points at `nb` whole blocks; `acts` holds `nb` blocks from `a0`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows8<const F: u8>(rows: [*const u8; 8], nb: usize, acts: &Acts, a0: usize) -> [f32; 8] {
    let bb = [34, 18, 22][F as usize];
    let offset = [0, 8, 16][F as usize];
    let ones = _mm256_set1_epi16(1);
    let m4 = _mm256_set1_epi8(0x0F);
    let mut acc = _mm256_setzero_ps();
    let aq = acts.q.as_ptr().wrapping_add(a0 * QK);
    for b in 0..nb {
        // SAFETY (the loads): within the row's `nb` blocks and the activations' (caller)
        let a = unsafe { _mm256_loadu_si256(aq.add(b * QK).cast()) };
        let mut p = [_mm256_setzero_si256(); 8];
        let mut d = [0u16; 8];
        for r in 0..8 {
            let blk = unsafe { rows[r].add(b * bb) };
            _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH_AHEAD).cast());
            d[r] = unsafe { blk.cast::<u16>().read_unaligned() };
            p[r] = if F == 0 {
                let wv = unsafe { _mm256_loadu_si256(blk.add(2).cast()) };
                let sy = _mm256_sign_epi8(a, wv);
                _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), sy), ones)
            } else {
                let q = unsafe { _mm_loadu_si128(blk.add(if F == 1 { 2 } else { 6 }).cast()) };
                let mut v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m4);
                if F == 2 {
                    let qh = unsafe { blk.add(2).cast::<u32>().read_unaligned() };
                    let hi = _mm256_and_si256(bytes_from_bits(qh), _mm256_set1_epi8(0x10));
                    v = _mm256_or_si256(v, hi);
                }
                _mm256_madd_epi16(_mm256_maddubs_epi16(v, a), ones)
            };
        }
        let t0 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
        let t1 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
        let mut tot = _mm256_add_epi32(
            _mm256_permute2x128_si256(t0, t1, 0x20),
            _mm256_permute2x128_si256(t0, t1, 0x31),
        );
        if offset != 0 {
            let [h0, h1] = acts.half[a0 + b];
            tot = _mm256_sub_epi32(tot, _mm256_set1_epi32(offset * (h0 + h1)));
        }
        let dw = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(d.as_ptr().cast()) });
        let scale = _mm256_mul_ps(dw, _mm256_set1_ps(acts.d[a0 + b]));
        acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(tot), acc);
    }
    let mut out = [0f32; 8];
    // SAFETY: eight f32 values
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc) };
    out
}

/// The weight levels of one `q8_0`, `q4_0` or `q5_0` block as signed bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn legacy_levels(format: QFormat, blk: &[u8]) -> __m256i {
    match format {
        BlockType::Q8_0 => load32(&blk[2..34]),
        BlockType::Q4_0 => _mm256_sub_epi8(nibbles(&blk[2..18]), _mm256_set1_epi8(8)),
        _ => {
            let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
            let hi = _mm256_and_si256(bytes_from_bits(qh), _mm256_set1_epi8(0x10));
            let v = _mm256_or_si256(nibbles(&blk[6..22]), hi);
            _mm256_sub_epi8(v, _mm256_set1_epi8(16))
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sums<const R: usize>(acc: [__m256; R], minus: [f32; R]) -> [f32; R] {
    let mut out = [0f32; R];
    for r in 0..R {
        out[r] = hsum(acc[r]) - minus[r];
    }
    out
}

#[target_feature(enable = "avx2,fma,f16c")]
fn legacy<const R: usize>(format: QFormat, w: &[u8], acts: &Acts, a0: [usize; R]) -> [f32; R] {
    let mut acc = [_mm256_setzero_ps(); R];
    for (b, blk) in w.chunks_exact(format.block_bytes()).enumerate() {
        let wv = legacy_levels(format, blk);
        let dw = f16_at(blk);
        let ax = _mm256_sign_epi8(wv, wv);
        for r in 0..R {
            let sy = _mm256_sign_epi8(load_act(acts, a0[r] + b), wv);
            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1));
            let d = _mm256_set1_ps(dw * acts.d[a0[r] + b]);
            acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), acc[r]);
        }
    }
    sums(acc, [0.0; R])
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q4k<const R: usize>(w: &[u8], acts: &Acts, a0: [usize; R]) -> [f32; R] {
    let mut acc = [_mm256_setzero_ps(); R];
    let mut mins = [0f32; R];
    let ones = _mm256_set1_epi16(1);
    let mask = _mm256_set1_epi8(0x0F);
    for (sb, blk) in w.chunks_exact(144).enumerate() {
        let (d, dmin) = (f16_at(&blk[0..2]), f16_at(&blk[2..4]));
        for c in 0..4 {
            let q = load32(&blk[16 + 32 * c..48 + 32 * c]);
            let lv = [
                _mm256_and_si256(q, mask),
                _mm256_and_si256(_mm256_srli_epi16(q, 4), mask),
            ];
            for (half, l) in lv.into_iter().enumerate() {
                let j = 2 * c + half;
                let (sc, mn) = scale_min_k4(j, &blk[4..16]);
                let (dsc, dmn) = (d * f32::from(sc), dmin * f32::from(mn));
                for r in 0..R {
                    let b = a0[r] + 8 * sb + j;
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(l, load_act(acts, b)), ones);
                    let da = acts.d[b];
                    let f = _mm256_set1_ps(da * dsc);
                    acc[r] = _mm256_fmadd_ps(f, _mm256_cvtepi32_ps(p), acc[r]);
                    let bsum = acts.half[b][0] + acts.half[b][1];
                    mins[r] += da * dmn * bsum as f32;
                }
            }
        }
    }
    sums(acc, mins)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q6k<const R: usize>(w: &[u8], acts: &Acts, a0: [usize; R]) -> [f32; R] {
    let mut acc = [_mm256_setzero_ps(); R];
    let mut offsets = [0f32; R];
    let m4 = _mm256_set1_epi8(0x0F);
    let m2 = _mm256_set1_epi8(3);
    for (sb, blk) in w.chunks_exact(210).enumerate() {
        let d = f16_at(&blk[208..210]);
        for h in 0..2 {
            let ql0 = load32(&blk[64 * h..64 * h + 32]);
            let ql1 = load32(&blk[64 * h + 32..64 * h + 64]);
            let qh = load32(&blk[128 + 32 * h..160 + 32 * h]);
            let high = [
                _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4),
            ];
            let chunks = [
                _mm256_or_si256(_mm256_and_si256(ql0, m4), high[0]),
                _mm256_or_si256(_mm256_and_si256(ql1, m4), high[1]),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), high[2]),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), high[3]),
            ];
            for (c, lv) in chunks.into_iter().enumerate() {
                let s0 = i16::from(blk[192 + 8 * h + 2 * c] as i8);
                let s1 = i16::from(blk[193 + 8 * h + 2 * c] as i8);
                let scales = _mm256_set_m128i(_mm_set1_epi16(s1), _mm_set1_epi16(s0));
                for r in 0..R {
                    let b = a0[r] + 8 * sb + 4 * h + c;
                    let p16 = _mm256_maddubs_epi16(lv, load_act(acts, b));
                    let p = _mm256_madd_epi16(p16, scales);
                    let f = acts.d[b] * d;
                    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(f), _mm256_cvtepi32_ps(p), acc[r]);
                    let [h0, h1] = acts.half[b];
                    offsets[r] +=
                        f * 32.0 * (f32::from(s0) * h0 as f32 + f32::from(s1) * h1 as f32);
                }
            }
        }
    }
    sums(acc, offsets)
}
