//! The K-quant formats, `q4k` and `q6k`: ggml's scale searches in scalar code (the reference,
//! and the path on hosts without AVX2), the choice of the vector searches in `avx2.rs`,
//! and the steps both share (the scales' packing, the final levels, the bytes).
//!
//! A block of 256 values is cut into sub-blocks (8 of 32 for `q4k`, 16 of 16 for `q6k`), and
//! each sub-block's scale is searched over 21 (`q4k`) or 19 (`q6k`) trial scales, a pass over
//! its values each: nearly all the quantizers' time.

#[cfg(target_arch = "x86_64")]
use super::has_avx2;
use super::{f16_at, nearest_int, put_f16, scale_min_k4, QK_K};

/// ggml's `make_qkx2_quants`: an asymmetric scale and minimum for `x` with levels `0..=nmax`
/// under `weights`, searching `nstep + 1` scales around the range's. Writes the levels to `l`
/// and returns `(scale, -min)`.
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l: &mut [u8],
    (rmin, rdelta, nstep): (f32, f32, i32),
) -> (f32, f32) {
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.iter_mut().for_each(|v| *v = 0);
        return (0.0, -min);
    }
    let nmaxf = nmax as f32;
    let mut iscale = nmaxf / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l[i] = q as u8;
        let diff = scale * q as f32 + min - x[i];
        best_error += weights[i] * (diff * diff);
    }
    let mut aux = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmaxf) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            aux[i] = q as u8;
            let w = weights[i];
            let lf = q as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..n {
                let diff = this_scale * aux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * (diff * diff);
            }
            if cur_error < best_error {
                l[..n].copy_from_slice(&aux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// The scalar `q4k` search: each sub-block's `(scale, -min)` (weights `rms + |x|`), its levels
/// written to `levels`.
pub(super) fn q4k_search(x: &[f32], levels: &mut [u8; QK_K]) -> ([f32; 8], [f32; 8]) {
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    let mut weights = [0f32; 32];
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        (scales[j], mins[j]) = make_qkx2_quants(
            15,
            xs,
            &weights,
            &mut levels[32 * j..32 * j + 32],
            (-1.0, 0.1, 20),
        );
    }
    (scales, mins)
}

/// `q4k`: `d`, `dmin` (f16), 12 bytes of packed 6-bit scales and minimums for 8 sub-blocks of
/// 32, then 128 bytes of 4-bit levels.
pub(super) fn q4k_block(x: &[f32], out: &mut [u8]) {
    let mut levels = [0u8; QK_K];
    #[cfg(target_arch = "x86_64")]
    let (scales, mins) = if has_avx2() {
        // SAFETY: the host has AVX2 (checked above); `x` holds a whole block.
        unsafe { super::avx2::q4k_search::<false>(x, &mut levels) }
    } else {
        q4k_search(x, &mut levels)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let (scales, mins) = q4k_search(x, &mut levels);
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..8 {
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let sc = &mut out[4..16];
    sc.iter_mut().for_each(|b| *b = 0);
    for j in 0..8 {
        // ggml stores the rounded value in a byte before clamping it
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            sc[j - 4] |= (ls >> 4) << 6;
            sc[j] |= (lm >> 4) << 6;
        }
    }
    put_f16(&mut out[0..2], max_scale / 63.0);
    put_f16(&mut out[2..4], max_min / 63.0);
    let (d_all, dmin_all) = (f16_at(&out[0..2]), f16_at(&out[2..4]));
    // a sub-block whose stored scale is 0 keeps the search's levels, which the vector search
    // leaves out: searched again with them (rare: a sub-block ~126x smaller than the largest)
    #[cfg(target_arch = "x86_64")]
    if has_avx2() && (0..8).any(|j| d_all * f32::from(scale_min_k4(j, &out[4..16]).0) == 0.0) {
        // SAFETY: the host has AVX2 (checked above); `x` holds a whole block.
        unsafe { super::avx2::q4k_search::<true>(x, &mut levels) };
    }
    for j in 0..8 {
        let (s, m) = scale_min_k4(j, &out[4..16]);
        let d = d_all * f32::from(s);
        if d == 0.0 {
            continue;
        }
        let dm = dmin_all * f32::from(m);
        for (l, &v) in levels[32 * j..32 * j + 32]
            .iter_mut()
            .zip(&x[32 * j..32 * j + 32])
        {
            *l = nearest_int((v + dm) / d).clamp(0, 15) as u8;
        }
    }
    let qs = &mut out[16..144];
    for (c, chunk) in levels.chunks_exact(64).enumerate() {
        for l in 0..32 {
            qs[32 * c + l] = chunk[l] | (chunk[l + 32] << 4);
        }
    }
}

/// ggml's `make_qx_quants` with `rmse_type` 1 (weights `x²`) and no importance: a symmetric scale
/// for levels `-nmax..nmax-1`, searched over 18 scales around the range's. Writes the levels
/// plus `nmax` to `l` and returns the scale.
fn make_qx_quants(nmax: i32, x: &[f32], l: &mut [u8]) -> f32 {
    let (mut max, mut amax) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < 1e-15 {
        l.iter_mut().for_each(|v| *v = 0);
        return 0.0;
    }
    let level = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0f32, 0f32);
        for &v in x {
            let q = level(iscale, v) as f32;
            let w = v * v;
            sumlx += w * v * q;
            suml2 += w * q * q;
        }
        (sumlx, suml2)
    };
    let iscale = -(nmax as f32) / max;
    for (o, &v) in l.iter_mut().zip(x) {
        *o = (level(iscale, v) + nmax) as u8;
    }
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in (-9..=9).filter(|&i| i != 0) {
        let iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (o, &v) in l.iter_mut().zip(x) {
                *o = (level(iscale, v) + nmax) as u8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// The scalar `q6k` search: each 16-value sub-block's scale, its levels (plus 32) written to
/// `levels`.
pub(super) fn q6k_search(x: &[f32], levels: &mut [u8; QK_K]) -> [f32; 16] {
    let mut scales = [0f32; 16];
    for (ib, s) in scales.iter_mut().enumerate() {
        *s = make_qx_quants(
            32,
            &x[16 * ib..16 * ib + 16],
            &mut levels[16 * ib..16 * ib + 16],
        );
    }
    scales
}

/// `q6k`: 128 bytes of the low 4 bits, 64 bytes of the high 2 bits, 16 signed 8-bit scales of
/// sub-blocks of 16, then `d` (f16).
pub(super) fn q6k_block(x: &[f32], out: &mut [u8]) {
    let mut levels = [0u8; QK_K];
    #[cfg(target_arch = "x86_64")]
    let scales = if has_avx2() {
        // SAFETY: the host has AVX2 (checked above); `x` holds a whole block.
        unsafe { super::avx2::q6k_search(x, &mut levels) }
    } else {
        q6k_search(x, &mut levels)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let scales = q6k_search(x, &mut levels);
    let (mut max_scale, mut max_abs_scale) = (0f32, 0f32);
    for &s in &scales {
        if s.abs() > max_abs_scale {
            max_abs_scale = s.abs();
            max_scale = s;
        }
    }
    if max_abs_scale < 1e-15 {
        out.iter_mut().for_each(|b| *b = 0);
        return;
    }
    let iscale = -128.0 / max_scale;
    put_f16(&mut out[208..210], 1.0 / iscale);
    let d_all = f16_at(&out[208..210]);
    let mut sc = [0i8; 16];
    for (s, &v) in sc.iter_mut().zip(&scales) {
        *s = nearest_int(iscale * v).min(127) as i8;
    }
    for j in 0..16 {
        let d = d_all * f32::from(sc[j]);
        if d == 0.0 {
            continue;
        }
        for (l, &v) in levels[16 * j..16 * j + 16]
            .iter_mut()
            .zip(&x[16 * j..16 * j + 16])
        {
            *l = (nearest_int(v / d).clamp(-32, 31) + 32) as u8;
        }
    }
    for (o, s) in out[192..208].iter_mut().zip(&sc) {
        *o = *s as u8;
    }
    let (ql, rest) = out.split_at_mut(128);
    let qh = &mut rest[..64];
    for half in 0..2 {
        let lv = &levels[128 * half..128 * half + 128];
        let ql = &mut ql[64 * half..64 * half + 64];
        let qh = &mut qh[32 * half..32 * half + 32];
        for l in 0..32 {
            let (a, b, c, d) = (lv[l], lv[l + 32], lv[l + 64], lv[l + 96]);
            ql[l] = (a & 0xF) | ((c & 0xF) << 4);
            ql[l + 32] = (b & 0xF) | ((d & 0xF) << 4);
            qh[l] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((d >> 4) << 6);
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::quantize::test_values;

    /// Blocks that take every branch of the searches: random values at several scales, constant
    /// sub-blocks (zero, positive, negative), one-signed sub-blocks, tiny values, lone spikes and
    /// non-finite values.
    fn blocks() -> Vec<Vec<f32>> {
        let mut out = Vec::new();
        for (seed, scale) in [(1u64, 1.0f32), (2, 0.02), (3, 1e-3), (4, 300.0), (5, 1e-20)] {
            for b in test_values(QK_K * 64, seed).chunks_exact(QK_K) {
                out.push(b.iter().map(|v| v * scale).collect());
            }
        }
        let r = test_values(QK_K, 9);
        let mut mixed = r.clone();
        mixed[..16].fill(0.0);
        mixed[16..32].fill(0.25);
        mixed[32..48].fill(-0.5);
        mixed[48..64].fill(-0.0);
        for v in &mut mixed[64..96] {
            *v = v.abs();
        }
        for v in &mut mixed[96..128] {
            *v = -v.abs();
        }
        mixed[200] = 40.0;
        out.push(mixed);
        out.push(vec![0.0; QK_K]);
        out.push(vec![-1.5; QK_K]);
        out.push(vec![2.0; QK_K]);
        out.push((0..QK_K).map(|i| (i % 7) as f32 - 3.0).collect());
        let mut odd = r;
        odd[3] = f32::NAN;
        odd[40] = f32::INFINITY;
        odd[77] = f32::NEG_INFINITY;
        odd[100] = 1e-40;
        odd[180] = f32::NAN;
        odd[181] = -f32::INFINITY;
        out.push(odd);
        out
    }

    #[test]
    fn the_vector_q4k_search_gives_the_scalar_bits() {
        if !has_avx2() {
            return;
        }
        for (n, x) in blocks().iter().enumerate() {
            let (mut a, mut b) = ([0u8; QK_K], [0u8; QK_K]);
            let (sa, ma) = q4k_search(x, &mut a);
            // SAFETY: AVX2 checked above; a whole block
            let (sb, mb) = unsafe { crate::quantize::avx2::q4k_search::<true>(x, &mut b) };
            let bits = |v: [f32; 8]| v.map(f32::to_bits);
            let mut c = [0u8; QK_K];
            // SAFETY: as above
            let (sc, mc) = unsafe { crate::quantize::avx2::q4k_search::<false>(x, &mut c) };
            assert_eq!(
                (bits(sc), bits(mc)),
                (bits(sb), bits(mb)),
                "block {n}: no levels"
            );
            assert_eq!(bits(sa), bits(sb), "block {n}: scales");
            assert_eq!(bits(ma), bits(mb), "block {n}: minimums");
            assert_eq!(a, b, "block {n}: levels");
        }
    }

    #[test]
    fn the_vector_q6k_search_gives_the_scalar_bits() {
        if !has_avx2() {
            return;
        }
        for (n, x) in blocks().iter().enumerate() {
            let (mut a, mut b) = ([0u8; QK_K], [0u8; QK_K]);
            let sa = q6k_search(x, &mut a);
            // SAFETY: AVX2 checked above; a whole block
            let sb = unsafe { crate::quantize::avx2::q6k_search(x, &mut b) };
            assert_eq!(
                sa.map(f32::to_bits),
                sb.map(f32::to_bits),
                "block {n}: scales"
            );
            assert_eq!(a, b, "block {n}: levels");
        }
    }
}
