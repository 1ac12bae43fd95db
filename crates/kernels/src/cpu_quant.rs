//! Quantized matrix products on the CPU for GGML's `q8_0`, `q4_0` and `q5_0` weights (blocks of
//! 32 values with one f16 scale; llama.cpp's layout, bytes as stored).
//!
//! As ggml does, each activation row is quantized to `q8_0` blocks and every block product is an
//! integer dot product scaled by the two blocks' scales. The per-row work is written once and
//! compiled twice, for the baseline x86-64 and for AVX2+FMA; the AVX2 build is chosen at run
//! time, so one portable binary uses the vector units of the host it runs on. Rows of the
//! weight are spread over the rayon pool; each weight row is unpacked to bytes once and
//! multiplied with every activation row.
//!
//! Reference: the weight dequantized to f32 times the activations (tests here and in
//! `rserve-core`'s `quant::ggml`).

use half::f16;
use rayon::prelude::*;

/// Values per block.
pub const QK: usize = 32;

/// The weight formats these products take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QFormat {
    Q8_0,
    Q4_0,
    Q5_0,
}

impl QFormat {
    /// Bytes of one block of 32 values.
    pub fn block_bytes(self) -> usize {
        match self {
            QFormat::Q8_0 => 34,
            QFormat::Q4_0 => 18,
            QFormat::Q5_0 => 22,
        }
    }
}

/// One block of 32 weights as signed bytes, and its scale.
#[inline(always)]
fn unpack(format: QFormat, b: &[u8], out: &mut [i8; QK]) -> f32 {
    let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
    match format {
        QFormat::Q8_0 => {
            for (o, &q) in out.iter_mut().zip(&b[2..2 + QK]) {
                *o = q as i8;
            }
        }
        QFormat::Q4_0 => {
            let qs = &b[2..2 + QK / 2];
            for j in 0..QK / 2 {
                out[j] = (qs[j] & 0x0F) as i8 - 8;
                out[j + QK / 2] = (qs[j] >> 4) as i8 - 8;
            }
        }
        QFormat::Q5_0 => {
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let qs = &b[6..6 + QK / 2];
            for j in 0..QK / 2 {
                let h0 = (((qh >> j) << 4) & 0x10) as u8;
                let h1 = ((qh >> (j + 12)) & 0x10) as u8;
                out[j] = ((qs[j] & 0x0F) | h0) as i8 - 16;
                out[j + QK / 2] = ((qs[j] >> 4) | h1) as i8 - 16;
            }
        }
    }
    d
}

/// Activations quantized to `q8_0`: per block, a scale (rounded through f16 as ggml stores it)
/// and 32 signed bytes.
struct QuantizedRows {
    scales: Vec<f32>, // [m, k / 32]
    values: Vec<i8>,  // [m, k]
}

fn quantize_rows(x: &[f32], k: usize) -> QuantizedRows {
    let mut scales = Vec::with_capacity(x.len() / QK);
    let mut values = vec![0i8; x.len()];
    for (xb, qb) in x.chunks_exact(QK).zip(values.chunks_exact_mut(QK)) {
        let amax = xb.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        for (q, &v) in qb.iter_mut().zip(xb) {
            *q = (v * id).round() as i8;
        }
        scales.push(f16::from_f32(d).to_f32());
    }
    debug_assert_eq!(scales.len(), x.len() / k * (k / QK));
    QuantizedRows { scales, values }
}

#[inline(always)]
fn dot32(a: &[i8; QK], b: &[i8]) -> i32 {
    let mut s = 0i32;
    for (x, y) in a.iter().zip(b) {
        s += i32::from(*x) * i32::from(*y);
    }
    s
}

/// `out[i] = sum_b dw_b * da_ib * (w_b . a_ib)` for one weight row and every activation row.
#[inline(always)]
fn row_products(
    format: QFormat,
    w_row: &[u8],
    acts: &QuantizedRows,
    m: usize,
    k: usize,
    out: &mut [f32],
) {
    let nb = k / QK;
    let bb = format.block_bytes();
    let mut wq = [[0i8; QK]; 8];
    let mut dw = [0f32; 8];
    out.iter_mut().for_each(|o| *o = 0.0);
    // eight blocks of the weight at a time, against every activation row
    let mut b0 = 0;
    while b0 < nb {
        let cnt = (nb - b0).min(8);
        for t in 0..cnt {
            let at = (b0 + t) * bb;
            dw[t] = unpack(format, &w_row[at..at + bb], &mut wq[t]);
        }
        for (i, o) in out.iter_mut().enumerate().take(m) {
            let base = i * nb + b0;
            let mut acc = 0f32;
            for t in 0..cnt {
                let a = &acts.values[(base + t) * QK..(base + t + 1) * QK];
                acc += dw[t] * acts.scales[base + t] * dot32(&wq[t], a) as f32;
            }
            *o += acc;
        }
        b0 += cnt;
    }
}

/// [`row_products`] compiled for AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_products_avx2(
    format: QFormat,
    w_row: &[u8],
    acts: &QuantizedRows,
    m: usize,
    k: usize,
    out: &mut [f32],
) {
    row_products(format, w_row, acts, m, k, out)
}

/// Whether the AVX2 build runs on this host.
pub fn uses_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn products(
    format: QFormat,
    avx2: bool,
    w_row: &[u8],
    acts: &QuantizedRows,
    m: usize,
    k: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: only called when the host has AVX2 and FMA (`uses_avx2`)
        unsafe { row_products_avx2(format, w_row, acts, m, k, out) };
        return;
    }
    let _ = avx2;
    row_products(format, w_row, acts, m, k, out)
}

/// `y = x W^T`: `x` `[m, k]` f32 row-major, `w` `[n, k]` as GGML blocks; returns `[m, n]`.
/// `k` must be a multiple of 32 and `w` exactly `n * k / 32` blocks.
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
    if k == 0 || !k.is_multiple_of(QK) {
        return Err(format!("rows of {k} values are not whole blocks of {QK}"));
    }
    let row_bytes = k / QK * format.block_bytes();
    if w.len() != n * row_bytes || x.len() != m * k {
        return Err(format!(
            "shapes do not match: {} weight bytes for [{n}, {k}], {} activations for [{m}, {k}]",
            w.len(),
            x.len()
        ));
    }
    let avx2 = avx2 && uses_avx2();
    let acts = quantize_rows(x, k);
    // out_t[j, i]: one weight row's products with every activation row
    let mut out_t = vec![0f32; n * m];
    let rows_per_task = (4096 / m.max(1)).clamp(1, 64);
    out_t
        .par_chunks_mut(rows_per_task * m)
        .enumerate()
        .for_each(|(c, chunk)| {
            for (r, out) in chunk.chunks_mut(m).enumerate() {
                let j = c * rows_per_task + r;
                let w_row = &w[j * row_bytes..(j + 1) * row_bytes];
                products(format, avx2, w_row, &acts, m, k, out);
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
    let mut out = vec![0f32; n * k];
    let bb = format.block_bytes();
    let blocks = w.chunks_exact(bb).take(n * k / QK).collect::<Vec<_>>();
    out.par_chunks_mut(QK * 256)
        .zip(blocks.par_chunks(256))
        .for_each(|(o, bs)| {
            let mut q = [0i8; QK];
            for (ob, b) in o.chunks_exact_mut(QK).zip(bs) {
                let d = unpack(format, b, &mut q);
                for (x, &v) in ob.iter_mut().zip(&q) {
                    *x = d * f32::from(v);
                }
            }
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> u64 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *seed >> 33
    }

    /// Random blocks: a positive scale and random payload bytes.
    fn blocks(format: QFormat, count: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        let mut w = Vec::with_capacity(count * format.block_bytes());
        for _ in 0..count {
            let d = f16::from_f32(0.001 + (lcg(&mut s) % 1000) as f32 * 1e-5);
            w.extend(d.to_le_bytes());
            for _ in 2..format.block_bytes() {
                w.push(lcg(&mut s) as u8);
            }
        }
        w
    }

    fn reference(w: &[f32], n: usize, k: usize, x: &[f32], m: usize) -> Vec<f32> {
        let mut y = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                y[i * n + j] = (0..k).map(|t| x[i * k + t] * w[j * k + t]).sum();
            }
        }
        y
    }

    #[test]
    fn products_match_the_dequantized_weight_on_both_code_paths() {
        let (n, k) = (70, 256);
        for format in [QFormat::Q8_0, QFormat::Q4_0, QFormat::Q5_0] {
            let w = blocks(format, n * k / QK, 3);
            let wf = dequantize(format, &w, n, k);
            for m in [1, 3, 17] {
                let mut s = 9;
                let x: Vec<f32> = (0..m * k)
                    .map(|_| (lcg(&mut s) % 2001) as f32 / 1000.0 - 1.0)
                    .collect();
                let want = reference(&wf, n, k, &x, m);
                let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
                let base = matmul_with(format, false, &w, n, k, &x, m).expect("baseline");
                let fast = matmul_with(format, true, &w, n, k, &x, m).expect("avx2");
                assert_eq!(base, fast, "{format:?} m={m}: the two builds differ");
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
        unpack(QFormat::Q4_0, &b, &mut q);
        assert_eq!((q[0], q[16]), (2, -5));
        // q5_0: bit j of qh is the fifth bit of value j, bit j + 16 that of value j + 16
        let mut b = vec![0u8; 22];
        b[..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        b[2..6].copy_from_slice(&(1u32 | (1 << 16)).to_le_bytes());
        b[6] = 0x21;
        unpack(QFormat::Q5_0, &b, &mut q);
        assert_eq!((q[0], q[16], q[1]), (0x11 - 16, 0x12 - 16, -16));
    }

    #[test]
    fn shapes_that_do_not_match_are_errors() {
        let w = blocks(QFormat::Q8_0, 2, 1);
        assert!(matmul(QFormat::Q8_0, &w, 2, 33, &[0.0; 33], 1).is_err());
        assert!(matmul(QFormat::Q8_0, &w, 3, 32, &[0.0; 32], 1).is_err());
    }
}
