//! Quantized matrix products on the CPU for GGML's `q8_0`, `q4_0`, `q5_0`, `q4_K` and `q6_K`
//! weights. The weight is held in [`X8Weight`]'s layout (`x8.rs`: llama.cpp's blocks, rows in
//! groups of eight interleaved four bytes at a time), which gives back ggml's bytes exactly.
//!
//! As ggml does, each activation row is quantized to 8 bits, and every block product is an
//! integer dot product scaled by the blocks' scales. Activations are cut into blocks of 32 with
//! one scale each (ggml uses blocks of 256 against K-quants; 32 is at least as accurate and lets
//! one activation layout serve every format), and each block carries the sums of its two halves
//! for the K-quants' minimums and offsets.
//!
//! Three implementations of each block product: portable Rust over ggml's bytes (the reference
//! the tests hold the others to, exactly), hand-written AVX2 over the grouped layout (`avx2.rs`:
//! one vector lane per weight row, bytes multiplied pairwise into 16-bit sums, then into 32-bit
//! lanes, the scales applied in f32), and the same with AVX-512 VNNI's byte dot products on
//! 256-bit vectors (`vnni.rs`, the same bits as AVX2), chosen at run time, so one portable binary
//! or wheel uses the vector units of the host it runs on. Groups of rows are spread over the
//! rayon pool; each weight group is read once for every four activation rows, and over several
//! activation rows each task writes its columns of the result in place.
//!
//! Reference: the weight dequantized to f32 times the activations (tests here and in
//! `rserve-core`'s `quant::ggml`).

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod vnni;
mod x8;

pub use x8::{advise_huge_pages, X8Weight, ROWS};

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

/// `v` rounded to the nearest integer, ties to even (as `vroundps` rounds), for `|v| <= 2^22`.
fn round_even(v: f32) -> f32 {
    (v + 12582912.0) - 12582912.0
}

/// One 32-value block of activations: its levels, the sums of its halves and its scale.
fn quantize_block(xb: &[f32], qb: &mut [i8]) -> ([i32; 2], f32) {
    let amax = xb.iter().fold(0f32, |a, &v| a.max(v.abs()));
    let s = amax / 127.0;
    let id = if s > 0.0 { 1.0 / s } else { 0.0 };
    for (o, &v) in qb.iter_mut().zip(xb) {
        *o = round_even(v * id) as i8;
    }
    let sum = |r: &[i8]| r.iter().map(|&v| i32::from(v)).sum::<i32>();
    ([sum(&qb[..16]), sum(&qb[16..])], f16::from_f32(s).to_f32())
}

fn quantize_acts(x: &[f32]) -> Acts {
    let nb = x.len() / QK;
    let mut d = vec![0f32; nb];
    let mut half = vec![[0i32; 2]; nb];
    let mut q = vec![0i8; x.len()];
    // blocks of rows in parallel once there are many (prefill)
    let per_task = 256;
    #[cfg(target_arch = "x86_64")]
    let avx2 = uses_avx2();
    x.par_chunks(per_task * QK)
        .zip(q.par_chunks_mut(per_task * QK))
        .zip(
            d.par_chunks_mut(per_task)
                .zip(half.par_chunks_mut(per_task)),
        )
        .for_each(|((xc, qc), (dc, hc))| {
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                // SAFETY: AVX2, FMA and F16C are present; the chunks hold whole blocks
                unsafe { avx2::quantize_blocks(xc, qc, dc, hc) };
                return;
            }
            for (((xb, qb), db), hb) in xc
                .chunks_exact(QK)
                .zip(qc.chunks_exact_mut(QK))
                .zip(dc.iter_mut())
                .zip(hc.iter_mut())
            {
                (*hb, *db) = quantize_block(xb, qb);
            }
        });
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

/// The `[m, n]` row-major result of a product over several activation rows, written by the tasks
/// of the product in place: each task owns the columns of its groups of weight rows.
#[derive(Clone, Copy)]
pub(crate) struct RowsOut {
    ptr: *mut f32,
    n: usize,
    m: usize,
}

// SAFETY: the tasks that share a `RowsOut` write disjoint columns (`put`'s contract), and the
// buffer outlives them (the product waits for every task)
unsafe impl Send for RowsOut {}
unsafe impl Sync for RowsOut {}

impl RowsOut {
    fn new(y: &mut [f32], m: usize) -> Self {
        Self {
            ptr: y.as_mut_ptr(),
            n: y.len() / m.max(1),
            m,
        }
    }

    pub fn rows(&self) -> usize {
        self.m
    }

    /// Row `i`'s columns `col..col + 8` (those below n) take `v`.
    ///
    /// # Safety
    /// `i < m`; no other thread writes these columns meanwhile.
    #[inline]
    pub unsafe fn put(&self, i: usize, col: usize, v: &[f32; 8]) {
        let cols = self.n.saturating_sub(col).min(8);
        // SAFETY: row i of m rows of n values, columns col..col + cols (caller)
        unsafe {
            std::ptr::copy_nonoverlapping(v.as_ptr(), self.ptr.add(i * self.n + col), cols);
        }
    }
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

impl X8Weight {
    /// `y = x W^T`: `x` `[m, k]` f32 row-major; returns `[m, n]`.
    pub fn matmul(&self, x: &[f32], m: usize) -> Result<Vec<f32>, String> {
        self.matmul_with(uses_avx2(), x, m)
    }

    /// [`Self::matmul`] with the code path chosen by the caller (`avx2` is ignored where the host
    /// lacks it): AVX2 over the grouped layout, or the portable block products over each group's
    /// rows in ggml's bytes.
    pub fn matmul_with(&self, avx2: bool, x: &[f32], m: usize) -> Result<Vec<f32>, String> {
        let (n, k) = self.shape();
        if x.len() != m * k {
            return Err(format!(
                "{} activations do not make rows of {k} values",
                x.len()
            ));
        }
        if m == 0 || n == 0 {
            return Ok(Vec::new());
        }
        let avx2 = avx2 && uses_avx2();
        let acts = quantize_acts(x);
        let nb = k / QK;
        let format = self.format();
        let rb = format.row_bytes(k);
        let groups = self.groups();
        // several tasks per thread; over many activation rows, few enough groups per task that
        // their weight bytes stay in L2 while tiles of activation rows pass over them
        let cap = if m > 4 {
            (256 * 1024 / self.group_bytes()).clamp(1, 32)
        } else {
            32
        };
        let per_task = groups
            .div_ceil(8 * rayon::current_num_threads())
            .clamp(1, cap);
        let layout = self.layout();
        #[cfg(target_arch = "x86_64")]
        if avx2 && m > 1 {
            // every task writes its groups' columns of y in place
            let mut y = vec![0f32; m * n];
            let out = RowsOut::new(&mut y, m);
            (0..groups.div_ceil(per_task))
                .into_par_iter()
                .for_each(|c| {
                    let tg = c * per_task..((c + 1) * per_task).min(groups);
                    // SAFETY: AVX2, FMA and F16C are present (`uses_avx2`); the groups are this
                    // weight's, `acts` holds `m` rows of `k` values, and the tasks' groups (so
                    // their columns of y) are disjoint
                    unsafe { avx2::products_rows(format, &layout, tg, &acts, nb, out) };
                });
            return Ok(y);
        }
        // out_t[row, i]: one weight row's products with every activation row
        let mut out_t = vec![0f32; groups * ROWS * m];
        out_t
            .par_chunks_mut(per_task * ROWS * m)
            .enumerate()
            .for_each(|(c, chunk)| {
                let first = c * per_task;
                #[cfg(target_arch = "x86_64")]
                if avx2 {
                    let groups = first..first + chunk.len() / ROWS;
                    // SAFETY: AVX2, FMA and F16C are present (`uses_avx2`); the groups are this
                    // weight's and `acts` holds one row of `k` values
                    unsafe { avx2::products_one(format, &layout, groups, &acts, nb, chunk) };
                    return;
                }
                let mut buf = Vec::new();
                for (i, out) in chunk.chunks_mut(ROWS * m).enumerate() {
                    self.group_to_ggml(first + i, &mut buf);
                    for (j, row) in buf.chunks_exact(rb).enumerate() {
                        for (a, o) in out[j * m..(j + 1) * m].iter_mut().enumerate() {
                            *o = row_dot(format, row, &acts, a * nb);
                        }
                    }
                }
            });
        if m == 1 {
            out_t.truncate(n);
            return Ok(out_t);
        }
        // y = out_t^T, in parallel over bands of 16 rows of y: each band reads one cache line of
        // every row of out_t and writes its own rows
        const BAND: usize = 16;
        let mut y = vec![0f32; m * n];
        y.par_chunks_mut(BAND * n)
            .enumerate()
            .for_each(|(c, band)| {
                let i0 = c * BAND;
                let rows = band.len() / n;
                for j in 0..n {
                    let src = &out_t[j * m + i0..j * m + i0 + rows];
                    for (ii, &v) in src.iter().enumerate() {
                        band[ii * n + j] = v;
                    }
                }
            });
        Ok(y)
    }

    /// The weight dequantized to f32, `[n, k]`: the reference, and the operand of products over
    /// many rows (prefill), where an f32 matrix product beats integer block products.
    pub fn dequantize(&self) -> Vec<f32> {
        let (n, k) = self.shape();
        let format = self.format();
        let rb = format.row_bytes(k);
        let mut out = vec![0f32; n * k];
        out.par_chunks_mut(ROWS * k).enumerate().for_each(|(g, o)| {
            let mut buf = Vec::new();
            self.group_to_ggml(g, &mut buf);
            let rows = o.len() / k;
            crate::quantize::dequantize_into(format, &buf[..rows * rb], o);
        });
        out
    }
}

/// `y = x W^T` with `w` in ggml's bytes, `[n, k]` (laid out for the products first; callers that
/// multiply the same weight again keep an [`X8Weight`]).
pub fn matmul(
    format: QFormat,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
) -> Result<Vec<f32>, String> {
    X8Weight::from_ggml(format, w, n, k)?.matmul(x, m)
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
            let q = crate::quantize::quantize(format, &wf0, k).expect("quantize");
            let w = X8Weight::from_ggml(format, &q, n, k).expect("layout");
            let wf = w.dequantize();
            assert_eq!(wf, crate::quantize::dequantize(format, &q), "{format:?}");
            // 300 rows: more than one tile of activation rows (256 of 512 values)
            for m in [1, 3, 4, 6, 17, 300] {
                let x = values(m * k, 9 + m as u64);
                let want = reference(&wf, n, k, &x, m);
                let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
                let base = w.matmul_with(false, &x, m).expect("baseline");
                let fast = w.matmul_with(true, &x, m).expect("avx2");
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
    fn activations_quantize_alike_on_both_code_paths() {
        // ties (0.5 steps of the level), zeros, a block of zeros, extremes
        let mut x = values(64 * QK, 5);
        x[..QK].fill(0.0);
        for (i, v) in x[QK..2 * QK].iter_mut().enumerate() {
            *v = (i as f32 - 16.0) * 0.5 * (127.0 / 16.0) / 127.0 * 8.0;
        }
        x[2 * QK] = 1e30;
        let nb = x.len() / QK;
        let mut q = vec![0i8; x.len()];
        let (mut d, mut half) = (vec![0f32; nb], vec![[0i32; 2]; nb]);
        for (b, (xb, qb)) in x.chunks_exact(QK).zip(q.chunks_exact_mut(QK)).enumerate() {
            (half[b], d[b]) = quantize_block(xb, qb);
        }
        let acts = quantize_acts(&x);
        assert_eq!((acts.q, acts.d, acts.half), (q, d, half));
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
        assert!(matmul(BlockType::Q8_0, &w, 2, 32, &[0.0; 31], 1).is_err());
        assert_eq!(matmul(BlockType::Q8_0, &w, 2, 32, &[], 0), Ok(Vec::new()));
    }
}
