//! Quantizers for GGML's block formats, bit for bit those of llama.cpp's reference quantizers
//! (`quantize_row_*_ref` in ggml), so that a model quantized by rserve holds the same bytes as the
//! same weights quantized by llama.cpp without an importance matrix, and llama.cpp's quality
//! tables apply to it.
//!
//! Every step is one IEEE f32 operation in ggml's order (no fused multiply-adds), rounding is
//! ggml's (`round` half away from zero where ggml calls `roundf`, the magic-number
//! round-half-to-even where it calls `nearest_int`), and scales go through f16 with
//! round-to-nearest-even, as `GGML_FP32_TO_FP16` does. Rows are quantized in parallel; rows are
//! independent, so the result does not depend on the number of threads. The K-quants' scale
//! searches, nearly all of their time, run one sub-block per AVX2 lane where the host has it
//! (`quantize/avx2.rs`, the same bits as the scalar searches in `quantize/kquant.rs`).
//!
//! Reference: the llama.cpp goldens in `tests/fixtures/quant/` (made by llama.cpp itself from
//! the same values; see `crates/core/tests/gguf.rs`).

#[cfg(target_arch = "x86_64")]
mod avx2;
mod kquant;

use half::f16;
use kquant::{q4k_block, q6k_block};
use rayon::prelude::*;

/// The GGML block formats rserve writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockType {
    Q8_0,
    Q4_0,
    Q5_0,
    Q4K,
    Q6K,
}

/// Values per K-quant super-block.
pub const QK_K: usize = 256;

impl BlockType {
    /// Every format, in the order the tests go through them.
    pub const ALL: [BlockType; 5] = [
        BlockType::Q8_0,
        BlockType::Q4_0,
        BlockType::Q5_0,
        BlockType::Q4K,
        BlockType::Q6K,
    ];

    /// Values per block.
    pub fn block_values(self) -> usize {
        match self {
            BlockType::Q8_0 | BlockType::Q4_0 | BlockType::Q5_0 => 32,
            BlockType::Q4K | BlockType::Q6K => QK_K,
        }
    }

    /// Bytes per block, in ggml's layout.
    pub fn block_bytes(self) -> usize {
        match self {
            BlockType::Q8_0 => 34,
            BlockType::Q4_0 => 18,
            BlockType::Q5_0 => 22,
            BlockType::Q4K => 144,
            BlockType::Q6K => 210,
        }
    }

    /// Bytes of a row of `cols` values (`cols` a multiple of the block).
    pub fn row_bytes(self, cols: usize) -> usize {
        cols / self.block_values() * self.block_bytes()
    }
}

/// Quantizes `x`, `rows` rows of `cols` values, to `t`; `cols` must be a multiple of the block.
pub fn quantize(t: BlockType, x: &[f32], cols: usize) -> Result<Vec<u8>, String> {
    if cols == 0 || !x.len().is_multiple_of(cols) {
        return Err(format!("{} values are not whole rows of {cols}", x.len()));
    }
    check_cols(t, cols)?;
    let rb = t.row_bytes(cols);
    let mut out = vec![0u8; x.len() / cols * rb];
    out.par_chunks_mut(rb)
        .zip(x.par_chunks(cols))
        .for_each(|(o, r)| quantize_row(t, r, o));
    Ok(out)
}

/// Quantizes `rows` rows of `cols` values to `t`, row `r`'s values written by `fill(r, buf)`
/// into a buffer of `cols` first: a checkpoint's rows converted as they are read, with no
/// full-size f32 copy of the tensor. Rows in parallel; `cols` must be a multiple of the block.
pub fn quantize_rows(
    t: BlockType,
    rows: usize,
    cols: usize,
    fill: impl Fn(usize, &mut [f32]) + Sync,
) -> Result<Vec<u8>, String> {
    check_cols(t, cols)?;
    let rb = t.row_bytes(cols);
    let mut out = vec![0u8; rows * rb];
    out.par_chunks_mut(rb).enumerate().for_each_init(
        || vec![0f32; cols],
        |buf, (r, o)| {
            fill(r, buf);
            quantize_row(t, buf, o);
        },
    );
    Ok(out)
}

fn check_cols(t: BlockType, cols: usize) -> Result<(), String> {
    let bv = t.block_values();
    if cols == 0 || !cols.is_multiple_of(bv) {
        return Err(format!(
            "{t:?} needs rows that are a multiple of {bv} values; got rows of {cols}"
        ));
    }
    Ok(())
}

/// One row `x` into its blocks `o`.
fn quantize_row(t: BlockType, x: &[f32], o: &mut [u8]) {
    for (ob, xb) in o
        .chunks_exact_mut(t.block_bytes())
        .zip(x.chunks_exact(t.block_values()))
    {
        match t {
            BlockType::Q8_0 => q8_0_block(xb, ob),
            BlockType::Q4_0 => q4_0_block(xb, ob),
            BlockType::Q5_0 => q5_0_block(xb, ob),
            BlockType::Q4K => q4k_block(xb, ob),
            BlockType::Q6K => q6k_block(xb, ob),
        }
    }
}

fn put_f16(out: &mut [u8], v: f32) {
    out.copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

fn f16_at(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// ggml's `nearest_int`: round half to even through the float adder (|v| < 2^22).
#[inline(always)]
fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12582912.0f32).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// Whether the vector paths can run (AVX2, asked once).
#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVX2.get_or_init(|| is_x86_feature_detected!("avx2"))
}

/// How a block's scaled values `v * id` become levels.
#[derive(Debug, Clone, Copy)]
enum Cast {
    /// `round` (half away from zero), as ggml's `roundf`.
    Round,
    /// `+ offset`, truncated toward zero, as ggml's `(int8_t)` cast of a positive value.
    Offset(f32),
}

/// The levels of a 32-value block: `x * id` cast as `cast` says, then to i8 as Rust's `as i8`
/// casts (saturating, NaN to 0). On AVX2 hosts 8 values at a time, the same bits.
fn casts(x: &[f32], id: f32, cast: Cast) -> [i8; 32] {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the host has AVX2 (checked above).
        return unsafe { avx2::casts(x, id, cast) };
    }
    casts_scalar(x, id, cast)
}

fn casts_scalar(x: &[f32], id: f32, cast: Cast) -> [i8; 32] {
    let mut out = [0i8; 32];
    for (o, &v) in out.iter_mut().zip(x) {
        *o = match cast {
            Cast::Round => (v * id).round() as i8,
            Cast::Offset(off) => (v * id + off) as i8,
        };
    }
    out
}

/// The largest magnitude in a block (NaN ignored, as `f32::max` ignores it).
fn abs_max(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the host has AVX2 (checked above).
        return unsafe { avx2::abs_max(x) };
    }
    x.iter().fold(0f32, |a, &v| a.max(v.abs()))
}

fn q8_0_block(x: &[f32], out: &mut [u8]) {
    let amax = abs_max(x);
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(&mut out[..2], d);
    for (o, q) in out[2..].iter_mut().zip(casts(x, id, Cast::Round)) {
        *o = q as u8;
    }
}

/// The value of largest magnitude (the first such, as ggml scans; 0 when every value is zero).
fn signed_max(x: &[f32]) -> f32 {
    let amax = abs_max(x);
    if amax == 0.0 {
        return 0.0;
    }
    x.iter().copied().find(|v| v.abs() == amax).unwrap_or(0.0)
}

fn q4_0_block(x: &[f32], out: &mut [u8]) {
    let d = signed_max(x) / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(&mut out[..2], d);
    out[2..18].copy_from_slice(&pack_q4_0(&casts(x, id, Cast::Offset(8.5))));
}

/// `q4_0`'s 16 bytes of levels: level `j` (clamped to 15 as ggml's `MIN(15, ...)`) in the low
/// nibble of byte `j`, level `16 + j` in its high nibble. On AVX2 hosts 16 at a time, the same
/// bytes.
fn pack_q4_0(q: &[i8; 32]) -> [u8; 16] {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the host has AVX2 (checked above).
        return unsafe { avx2::pack_q4_0(q) };
    }
    pack_q4_0_scalar(q)
}

fn pack_q4_0_scalar(q: &[i8; 32]) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        let q0 = q[j].min(15) as u8;
        let q1 = q[16 + j].min(15) as u8;
        *o = q0 | (q1 << 4);
    }
    out
}

fn q5_0_block(x: &[f32], out: &mut [u8]) {
    let d = signed_max(x) / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(&mut out[..2], d);
    let (qh, low) = pack_q5_0(&casts(x, id, Cast::Offset(16.5)));
    out[2..6].copy_from_slice(&qh.to_le_bytes());
    out[6..22].copy_from_slice(&low);
}

/// `q5_0`'s fifth bits (bit `j` of level `j`, clamped to 31) and 16 bytes of low nibbles, laid
/// out as `q4_0`'s. On AVX2 hosts 32 at a time, the same bits.
fn pack_q5_0(q: &[i8; 32]) -> (u32, [u8; 16]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the host has AVX2 (checked above).
        return unsafe { avx2::pack_q5_0(q) };
    }
    pack_q5_0_scalar(q)
}

fn pack_q5_0_scalar(q: &[i8; 32]) -> (u32, [u8; 16]) {
    let mut low = [0u8; 16];
    let mut qh = 0u32;
    for (j, o) in low.iter_mut().enumerate() {
        let q0 = q[j].min(31) as u8;
        let q1 = q[16 + j].min(31) as u8;
        *o = (q0 & 0x0F) | ((q1 & 0x0F) << 4);
        qh |= u32::from((q0 & 0x10) >> 4) << j;
        qh |= u32::from((q1 & 0x10) >> 4) << (j + 16);
    }
    (qh, low)
}

/// The 6-bit scale and minimum of sub-block `j` of a `q4k` block.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Dequantizes `data` (whole blocks of `t`) to f32, following ggml's
/// `dequantize_row_*`: the reference the quantizers' round trips are checked with.
pub fn dequantize(t: BlockType, data: &[u8]) -> Vec<f32> {
    let bv = t.block_values();
    let n = data.len() / t.block_bytes() * bv;
    let mut out = vec![0f32; n];
    out.par_chunks_mut(bv)
        .zip(data.par_chunks(t.block_bytes()))
        .for_each(|(o, b)| dequantize_block(t, b, o));
    out
}

/// [`dequantize`] into `out` (`data`'s values), on the calling thread.
pub fn dequantize_into(t: BlockType, data: &[u8], out: &mut [f32]) {
    for (o, b) in out
        .chunks_exact_mut(t.block_values())
        .zip(data.chunks_exact(t.block_bytes()))
    {
        dequantize_block(t, b, o);
    }
}

fn dequantize_block(t: BlockType, b: &[u8], o: &mut [f32]) {
    match t {
        BlockType::Q8_0 => {
            let d = f16_at(b);
            for (v, &q) in o.iter_mut().zip(&b[2..34]) {
                *v = d * f32::from(q as i8);
            }
        }
        BlockType::Q4_0 => {
            let d = f16_at(b);
            for j in 0..16 {
                o[j] = d * f32::from((b[2 + j] & 0xF) as i8 - 8);
                o[j + 16] = d * f32::from((b[2 + j] >> 4) as i8 - 8);
            }
        }
        BlockType::Q5_0 => {
            let d = f16_at(b);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for j in 0..16 {
                let h0 = (((qh >> j) << 4) & 0x10) as u8;
                let h1 = ((qh >> (j + 12)) & 0x10) as u8;
                o[j] = d * f32::from(((b[6 + j] & 0xF) | h0) as i8 - 16);
                o[j + 16] = d * f32::from(((b[6 + j] >> 4) | h1) as i8 - 16);
            }
        }
        BlockType::Q4K => {
            let (d, dmin) = (f16_at(&b[0..2]), f16_at(&b[2..4]));
            let qs = &b[16..144];
            for c in 0..4 {
                let (s0, m0) = scale_min_k4(2 * c, &b[4..16]);
                let (s1, m1) = scale_min_k4(2 * c + 1, &b[4..16]);
                let (d0, dm0) = (d * f32::from(s0), dmin * f32::from(m0));
                let (d1, dm1) = (d * f32::from(s1), dmin * f32::from(m1));
                for l in 0..32 {
                    let q = qs[32 * c + l];
                    o[64 * c + l] = d0 * f32::from(q & 0xF) - dm0;
                    o[64 * c + 32 + l] = d1 * f32::from(q >> 4) - dm1;
                }
            }
        }
        BlockType::Q6K => {
            let d = f16_at(&b[208..210]);
            for half in 0..2 {
                let ql = &b[64 * half..64 * half + 64];
                let qh = &b[128 + 32 * half..128 + 32 * half + 32];
                let sc = &b[192 + 8 * half..192 + 8 * half + 8];
                let o = &mut o[128 * half..128 * half + 128];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32;
                    let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                    let s = |k: usize| d * f32::from(sc[is + k] as i8);
                    o[l] = s(0) * f32::from(q1);
                    o[l + 32] = s(2) * f32::from(q2);
                    o[l + 64] = s(4) * f32::from(q3);
                    o[l + 96] = s(6) * f32::from(q4);
                }
            }
        }
    }
}

/// Seeded values in [-1, 1] for the tests and benchmarks of this crate's quantized code.
#[doc(hidden)]
pub fn test_values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        test_values(n, seed)
    }

    const ALL: [BlockType; 5] = BlockType::ALL;

    #[test]
    fn nearest_int_rounds_half_to_even() {
        assert_eq!(nearest_int(0.5), 0);
        assert_eq!(nearest_int(1.5), 2);
        assert_eq!(nearest_int(-2.5), -2);
        assert_eq!(nearest_int(2.49), 2);
        assert_eq!(nearest_int(-7.6), -8);
    }

    /// Round trips stay within each format's step for values in [-1, 1].
    #[test]
    fn round_trips_stay_within_the_format_step() {
        let x = values(4 * 512, 3);
        for (t, bound) in [
            (BlockType::Q8_0, 1.0 / 127.0),
            (BlockType::Q6K, 2.0 / 31.0),
            (BlockType::Q5_0, 1.0 / 15.0),
            (BlockType::Q4K, 2.0 / 15.0),
            (BlockType::Q4_0, 1.0 / 7.0),
        ] {
            let q = quantize(t, &x, 512).expect("quantize");
            assert_eq!(q.len(), 4 * t.row_bytes(512));
            let d = dequantize(t, &q);
            let err = x
                .iter()
                .zip(&d)
                .fold(0f32, |a, (u, v)| a.max((u - v).abs()));
            assert!(err <= bound, "{t:?}: round-trip error {err} > {bound}");
        }
    }

    /// The AVX2 levels and magnitudes of the 32-value formats are the scalar code's, ties,
    /// saturation and non-finite values included.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_vector_block_casts_give_the_scalar_bits() {
        if !has_avx2() {
            return;
        }
        let special = [
            0.0,
            -0.0,
            0.5,
            -0.5,
            1.5,
            -1.5,
            2.5,
            -2.5,
            126.5,
            127.5,
            -127.5,
            -128.5,
            300.0,
            -300.0,
            0.49999997,
            -0.49999997,
            8388607.5,
            1e30,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            1e-40,
            -1e-40,
            7.5,
            -8.5,
            15.49,
            16.5,
            -16.5,
            31.9,
            3.0,
            -3.0,
            0.25,
        ];
        let mut blocks: Vec<Vec<f32>> = vec![special.to_vec()];
        blocks.extend(values(32 * 200, 7).chunks_exact(32).map(|b| b.to_vec()));
        blocks.push(vec![0.0; 32]);
        blocks.push(vec![-0.0; 32]);
        blocks.push(vec![f32::NAN; 32]);
        for b in &blocks {
            let want = b.iter().fold(0f32, |a, &v| a.max(v.abs()));
            // SAFETY: AVX2 checked above
            let got = unsafe { avx2::abs_max(b) };
            assert_eq!(got.to_bits(), want.to_bits(), "{b:?}");
            for id in [1.0f32, 127.0, -8.0, 16.0 / 3.0, 0.0, 1e20] {
                for cast in [Cast::Round, Cast::Offset(8.5), Cast::Offset(16.5)] {
                    // SAFETY: AVX2 checked above
                    let got = unsafe { avx2::casts(b, id, cast) };
                    assert_eq!(got, casts_scalar(b, id, cast), "{cast:?} x {id}: {b:?}");
                }
            }
        }
    }

    /// Rows filled one at a time quantize to the bytes of the whole tensor at once.
    #[test]
    fn rows_filled_one_at_a_time_give_the_tensors_bytes() {
        let (rows, cols) = (37, 512);
        let x = values(rows * cols, 11);
        for t in ALL {
            let whole = quantize(t, &x, cols).expect("quantize");
            let by_rows = quantize_rows(t, rows, cols, |r, buf| {
                buf.copy_from_slice(&x[r * cols..(r + 1) * cols])
            })
            .expect("rows");
            assert_eq!(whole, by_rows, "{t:?}");
        }
        assert!(quantize_rows(BlockType::Q4K, 2, 128, |_, _| {}).is_err());
    }

    /// The AVX2 packing of `q4_0` and `q5_0` levels is the scalar packing, for every level a
    /// cast can give (negative and above the format's top included).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_vector_packing_gives_the_scalar_bytes() {
        if !has_avx2() {
            return;
        }
        let mut s = 5u64;
        for _ in 0..2000 {
            let q: [i8; 32] = std::array::from_fn(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
                (s >> 56) as i8
            });
            // SAFETY: AVX2 checked above
            assert_eq!(
                unsafe { avx2::pack_q4_0(&q) },
                pack_q4_0_scalar(&q),
                "{q:?}"
            );
            // SAFETY: AVX2 checked above
            assert_eq!(
                unsafe { avx2::pack_q5_0(&q) },
                pack_q5_0_scalar(&q),
                "{q:?}"
            );
        }
    }

    #[test]
    fn zero_blocks_and_bad_shapes() {
        for t in ALL {
            let q = quantize(t, &[0.0; 512], 512).expect("zeros");
            assert!(dequantize(t, &q).iter().all(|v| *v == 0.0), "{t:?}");
        }
        assert!(quantize(BlockType::Q4K, &[0.0; 128], 128).is_err());
        assert!(quantize(BlockType::Q8_0, &[0.0; 48], 48).is_err());
        assert!(quantize(BlockType::Q8_0, &[0.0; 40], 32).is_err());
    }
}
