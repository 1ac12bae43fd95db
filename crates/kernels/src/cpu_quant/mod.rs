//! Quantized matrix products on the CPU for GGML's `q8_0`, `q4_0`, `q5_0`, `q4_K` and `q6_K`
//! weights (llama.cpp's block layouts, bytes as stored).
//!
//! As ggml does, each activation row is quantized to 8 bits, and every block product is an
//! integer dot product scaled by the blocks' scales. Activations are cut into blocks of 32 with
//! one scale each (ggml uses blocks of 256 against K-quants; 32 is at least as accurate and lets
//! one activation layout serve every format), and each block carries the sums of its two halves
//! for the K-quants' minimums and offsets.
//!
//! Two implementations of each block product: portable Rust (the reference the tests hold the
//! other to, exactly), and hand-written AVX2 (`avx2.rs`: bytes multiplied pairwise into 16-bit
//! sums, then into 32-bit lanes, with the scales applied in f32), chosen at run time, so one
//! portable binary or wheel uses the vector units of the host it runs on. Rows of the weight are
//! spread over the rayon pool; each weight row is read once for every activation row.
//!
//! Reference: the weight dequantized to f32 times the activations (tests here and in
//! `rserve-core`'s `quant::ggml`).

#[cfg(target_arch = "x86_64")]
mod avx2;

use crate::quantize::BlockType;
use half::f16;
use rayon::prelude::*;

/// Values per activation block.
pub const QK: usize = 32;

/// The weight formats these products take.
pub type QFormat = BlockType;

/// Activations quantized to 8 bits in blocks of 32: per block a scale (rounded through f16 as
/// ggml stores it), the sums of its two halves, and 32 signed bytes.
pub(crate) struct Acts {
    pub d: Vec<f32>,         // [m * k / 32]
    pub half: Vec<[i32; 2]>, // [m * k / 32]
    pub q: Vec<i8>,          // [m * k]
}

fn quantize_acts(x: &[f32]) -> Acts {
    let nb = x.len() / QK;
    let mut d = Vec::with_capacity(nb);
    let mut half = Vec::with_capacity(nb);
    let mut q = vec![0i8; x.len()];
    for (xb, qb) in x.chunks_exact(QK).zip(q.chunks_exact_mut(QK)) {
        let amax = xb.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let s = amax / 127.0;
        let id = if s > 0.0 { 1.0 / s } else { 0.0 };
        for (o, &v) in qb.iter_mut().zip(xb) {
            *o = (v * id).round() as i8;
        }
        let sum = |r: &[i8]| r.iter().map(|&v| i32::from(v)).sum::<i32>();
        half.push([sum(&qb[..16]), sum(&qb[16..])]);
        d.push(f16::from_f32(s).to_f32());
    }
    Acts { d, half, q }
}

fn f16_at(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// One 32-value block of a `q8_0`, `q4_0` or `q5_0` weight as signed bytes, and its scale.
fn unpack_legacy(format: QFormat, b: &[u8], out: &mut [i8; QK]) -> f32 {
    match format {
        BlockType::Q8_0 => {
            for (o, &q) in out.iter_mut().zip(&b[2..2 + QK]) {
                *o = q as i8;
            }
        }
        BlockType::Q4_0 => {
            for j in 0..QK / 2 {
                out[j] = (b[2 + j] & 0x0F) as i8 - 8;
                out[j + QK / 2] = (b[2 + j] >> 4) as i8 - 8;
            }
        }
        _ => {
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for j in 0..QK / 2 {
                let h0 = (((qh >> j) << 4) & 0x10) as u8;
                let h1 = ((qh >> (j + 12)) & 0x10) as u8;
                out[j] = ((b[6 + j] & 0x0F) | h0) as i8 - 16;
                out[j + QK / 2] = ((b[6 + j] >> 4) | h1) as i8 - 16;
            }
        }
    }
    f16_at(b)
}

fn dot<A: Copy + Into<i32>>(w: &[A], a: &[i8]) -> i32 {
    w.iter()
        .zip(a)
        .map(|(&x, &y)| x.into() * i32::from(y))
        .sum()
}

/// The 6-bit scale and minimum of sub-block `j` of a `q4_K` block.
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// One weight row times one activation row (`a_blocks`: the row's first activation block), in
/// portable Rust.
fn row_dot(format: QFormat, w: &[u8], acts: &Acts, a0: usize) -> f32 {
    let act = |b: usize| &acts.q[(a0 + b) * QK..(a0 + b + 1) * QK];
    let mut acc = 0f32;
    match format {
        BlockType::Q8_0 | BlockType::Q4_0 | BlockType::Q5_0 => {
            let mut q = [0i8; QK];
            for (b, blk) in w.chunks_exact(format.block_bytes()).enumerate() {
                let d = unpack_legacy(format, blk, &mut q);
                acc += d * acts.d[a0 + b] * dot(&q, act(b)) as f32;
            }
        }
        BlockType::Q4K => {
            for (sb, blk) in w.chunks_exact(144).enumerate() {
                let (d, dmin) = (f16_at(&blk[0..2]), f16_at(&blk[2..4]));
                for c in 0..4 {
                    let qs = &blk[16 + 32 * c..48 + 32 * c];
                    for (half, nib) in [(0, 0u8), (1, 4)] {
                        let j = 2 * c + half;
                        let b = 8 * sb + j;
                        let (sc, mn) = scale_min_k4(j, &blk[4..16]);
                        let mut lv = [0u8; QK];
                        for (o, v) in lv.iter_mut().zip(qs) {
                            *o = (v >> nib) & 0xF;
                        }
                        let bsum = acts.half[a0 + b][0] + acts.half[a0 + b][1];
                        acc += acts.d[a0 + b]
                            * (d * f32::from(sc) * dot(&lv, act(b)) as f32
                                - dmin * f32::from(mn) * bsum as f32);
                    }
                }
            }
        }
        BlockType::Q6K => {
            for (sb, blk) in w.chunks_exact(210).enumerate() {
                let d = f16_at(&blk[208..210]);
                for h in 0..2 {
                    let ql = &blk[64 * h..64 * h + 64];
                    let qh = &blk[128 + 32 * h..160 + 32 * h];
                    for c in 0..4 {
                        let b = 8 * sb + 4 * h + c;
                        let mut lv = [0i32; QK];
                        for (l, o) in lv.iter_mut().enumerate() {
                            let lo = (ql[l + 32 * (c & 1)] >> (4 * (c >> 1))) & 0xF;
                            let hi = (qh[l] >> (2 * c)) & 3;
                            *o = i32::from(lo | (hi << 4)) - 32;
                        }
                        let s0 = f32::from(blk[192 + 8 * h + 2 * c] as i8);
                        let s1 = f32::from(blk[193 + 8 * h + 2 * c] as i8);
                        let a = act(b);
                        let p0 = lv[..16]
                            .iter()
                            .zip(&a[..16])
                            .map(|(x, &y)| x * i32::from(y));
                        let p1 = lv[16..]
                            .iter()
                            .zip(&a[16..])
                            .map(|(x, &y)| x * i32::from(y));
                        acc += acts.d[a0 + b]
                            * d
                            * (s0 * p0.sum::<i32>() as f32 + s1 * p1.sum::<i32>() as f32);
                    }
                }
            }
        }
    }
    acc
}

/// Whether the AVX2 build runs on this host.
pub fn uses_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// One weight row times every activation row, into `out` (`m` values).
fn row_products(
    format: QFormat,
    avx2: bool,
    w_row: &[u8],
    acts: &Acts,
    nb: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY (each call): `avx2` is only true when the host has AVX2, FMA and F16C
        // (`uses_avx2`), and the slices hold whole blocks (checked by `matmul_with`)
        let mut i = 0;
        while i < out.len() {
            let g = (out.len() - i).min(4);
            let a = |r: usize| (i + r) * nb;
            let o = &mut out[i..i + g];
            match g {
                4 => o.copy_from_slice(&unsafe {
                    avx2::rows_dot(format, w_row, acts, [a(0), a(1), a(2), a(3)])
                }),
                3 => o.copy_from_slice(&unsafe {
                    avx2::rows_dot(format, w_row, acts, [a(0), a(1), a(2)])
                }),
                2 => {
                    o.copy_from_slice(&unsafe { avx2::rows_dot(format, w_row, acts, [a(0), a(1)]) })
                }
                _ => o.copy_from_slice(&unsafe { avx2::rows_dot(format, w_row, acts, [a(0)]) }),
            }
            i += g;
        }
        return;
    }
    let _ = avx2;
    for (i, o) in out.iter_mut().enumerate() {
        *o = row_dot(format, w_row, acts, i * nb);
    }
}

/// `y = x W^T`: `x` `[m, k]` f32 row-major, `w` `[n, k]` as GGML blocks; returns `[m, n]`.
/// `k` must be a multiple of the format's block and `w` exactly `n` rows of blocks.
pub fn matmul(
    format: QFormat,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
) -> Result<Vec<f32>, String> {
    matmul_with(format, uses_avx2(), w, n, k, x, m)
}

/// [`matmul`] with the code path chosen by the caller (`avx2` is ignored where the host lacks it).
pub fn matmul_with(
    format: QFormat,
    avx2: bool,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
) -> Result<Vec<f32>, String> {
    let bv = format.block_values();
    if k == 0 || !k.is_multiple_of(bv) {
        return Err(format!("rows of {k} values are not whole blocks of {bv}"));
    }
    let row_bytes = format.row_bytes(k);
    if w.len() != n * row_bytes || x.len() != m * k {
        return Err(format!(
            "shapes do not match: {} weight bytes for [{n}, {k}], {} activations for [{m}, {k}]",
            w.len(),
            x.len()
        ));
    }
    let avx2 = avx2 && uses_avx2();
    let acts = quantize_acts(x);
    let nb = k / QK;
    // out_t[j, i]: one weight row's products with every activation row
    let mut out_t = vec![0f32; n * m];
    let rows_per_task = (4096 / m.max(1)).clamp(1, 64);
    out_t
        .par_chunks_mut(rows_per_task * m)
        .enumerate()
        .for_each(|(c, chunk)| {
            let row = |j: usize| &w[j * row_bytes..(j + 1) * row_bytes];
            let first = c * rows_per_task;
            #[cfg(target_arch = "x86_64")]
            if avx2 && m == 1 && format.block_values() == QK {
                // batch-1 decode of the 32-value formats: eight weight rows at a time
                let done = chunk.len() / 8 * 8;
                let mut octs = chunk.chunks_exact_mut(8);
                for (q, out) in (&mut octs).enumerate() {
                    let j = first + 8 * q;
                    let rows = std::array::from_fn(|r| row(j + r));
                    // SAFETY: AVX2, FMA and F16C are present (`uses_avx2`); whole blocks
                    out.copy_from_slice(&unsafe { avx2::legacy_rows8(format, rows, &acts, 0) });
                }
                for (r, out) in octs.into_remainder().chunks_mut(1).enumerate() {
                    row_products(format, avx2, row(first + done + r), &acts, nb, out);
                }
                return;
            }
            for (r, out) in chunk.chunks_mut(m).enumerate() {
                row_products(format, avx2, row(first + r), &acts, nb, out);
            }
        });
    if m == 1 {
        return Ok(out_t);
    }
    let mut y = vec![0f32; m * n];
    for j in 0..n {
        for i in 0..m {
            y[i * n + j] = out_t[j * m + i];
        }
    }
    Ok(y)
}

/// The weight dequantized to f32, `[n, k]`: the reference, and the operand of products over many
/// rows (prefill), where an f32 matrix product beats integer block products.
pub fn dequantize(format: QFormat, w: &[u8], n: usize, k: usize) -> Vec<f32> {
    let bytes = n * format.row_bytes(k);
    crate::quantize::dequantize(format, &w[..bytes.min(w.len())])
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::quantize::test_values as values;

    fn reference(w: &[f32], n: usize, k: usize, x: &[f32], m: usize) -> Vec<f32> {
        let mut y = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                y[i * n + j] = (0..k).map(|t| x[i * k + t] * w[j * k + t]).sum();
            }
        }
        y
    }

    const ALL: [QFormat; 5] = BlockType::ALL;

    #[test]
    fn products_match_the_dequantized_weight_on_both_code_paths() {
        let (n, k) = (70, 512);
        let wf0 = values(n * k, 3);
        for format in ALL {
            let w = crate::quantize::quantize(format, &wf0, k).expect("quantize");
            let wf = dequantize(format, &w, n, k);
            for m in [1, 3, 17] {
                let x = values(m * k, 9 + m as u64);
                let want = reference(&wf, n, k, &x, m);
                let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
                let base = matmul_with(format, false, &w, n, k, &x, m).expect("baseline");
                let fast = matmul_with(format, true, &w, n, k, &x, m).expect("avx2");
                for (b, f) in base.iter().zip(&fast) {
                    // the same integer sums; only the order of the f32 sums differs
                    assert!(
                        (b - f).abs() <= 1e-5 * scale,
                        "{format:?} m={m}: {b} vs {f}"
                    );
                }
                let err = base
                    .iter()
                    .zip(&want)
                    .fold(0f32, |a, (g, r)| a.max((g - r).abs()));
                // activations are quantized to 8 bits per block
                assert!(err <= 0.02 * scale, "{format:?} m={m}: {err} vs {scale}");
            }
        }
    }

    #[test]
    fn q4_0_and_q5_0_unpack_as_ggml_lays_them_out() {
        // q4_0: low nibbles are values 0..16, high nibbles 16..32, offset 8
        let mut b = vec![0u8; 18];
        b[..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        b[2] = 0x3A; // value 0 = 0xA - 8 = 2, value 16 = 0x3 - 8 = -5
        let mut q = [0i8; QK];
        unpack_legacy(BlockType::Q4_0, &b, &mut q);
        assert_eq!((q[0], q[16]), (2, -5));
        // q5_0: bit j of qh is the fifth bit of value j, bit j + 16 that of value j + 16
        let mut b = vec![0u8; 22];
        b[..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        b[2..6].copy_from_slice(&(1u32 | (1 << 16)).to_le_bytes());
        b[6] = 0x21;
        unpack_legacy(BlockType::Q5_0, &b, &mut q);
        assert_eq!((q[0], q[16], q[1]), (0x11 - 16, 0x12 - 16, -16));
    }

    #[test]
    fn shapes_that_do_not_match_are_errors() {
        let w = vec![0u8; 68];
        assert!(matmul(BlockType::Q8_0, &w, 2, 33, &[0.0; 33], 1).is_err());
        assert!(matmul(BlockType::Q8_0, &w, 3, 32, &[0.0; 32], 1).is_err());
        assert!(matmul(BlockType::Q4K, &w, 1, 32, &[0.0; 32], 1).is_err());
    }
}
