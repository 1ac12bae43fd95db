//! Resizing 8-bit RGB images exactly as Pillow's `Image.resize` does (the Hugging Face image
//! processors resize through Pillow, so their pixel values are only reproduced bit for bit by the
//! same arithmetic): a separable convolution, horizontal pass first over the rows the vertical pass
//! needs, each output pixel a fixed-point weighted sum (22 fractional bits) rounded and clamped to
//! 8 bits between the passes. The filter's support widens with the downscaling factor
//! (antialiasing), as Pillow's does.

/// A resampling filter: its support (in source pixels at scale 1) and its kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    /// Pillow's `BICUBIC` (Keys' cubic, a = -0.5).
    Bicubic,
    /// Pillow's `BILINEAR` (the triangle filter).
    Bilinear,
}

impl Filter {
    fn support(self) -> f64 {
        match self {
            Filter::Bicubic => 2.0,
            Filter::Bilinear => 1.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        let x = x.abs();
        match self {
            Filter::Bicubic => {
                const A: f64 = -0.5;
                if x < 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * A
                } else {
                    0.0
                }
            }
            Filter::Bilinear => {
                if x < 1.0 {
                    1.0 - x
                } else {
                    0.0
                }
            }
        }
    }
}

const PRECISION_BITS: u32 = 32 - 8 - 2;

use std::ops::Range;

/// For each output position of a window: the first source index, the number of taps and their
/// fixed-point weights (`ksize` slots each).
struct Coeffs {
    bounds: Vec<(usize, usize)>,
    weights: Vec<i32>,
    ksize: usize,
}

impl Coeffs {
    /// The source positions the window's taps read: `(first, count)`.
    fn span(&self) -> (usize, usize) {
        let first = self.bounds.iter().map(|b| b.0).min().unwrap_or(0);
        let end = self.bounds.iter().map(|b| b.0 + b.1).max().unwrap_or(first);
        (first, end - first)
    }
}

/// The taps of output positions `window` of a resize from `in_size` to `out_size` (each position's
/// taps depend on it alone, so a window's are those of the whole resize).
fn coeffs(in_size: usize, out_size: usize, window: Range<usize>, filter: Filter) -> Coeffs {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = filter.support() * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let mut bounds = Vec::with_capacity(window.len());
    let mut weights = vec![0i32; window.len() * ksize];
    let mut k = vec![0f64; ksize];
    for (i, xx) in window.enumerate() {
        let center = (xx as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        // Pillow truncates toward zero after adding one half
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
        let n = xmax.saturating_sub(xmin).min(ksize);
        let mut ww = 0.0;
        for (x, kx) in k.iter_mut().enumerate().take(n) {
            let w = filter.weight(((x + xmin) as f64 - center + 0.5) * ss);
            *kx = w;
            ww += w;
        }
        let row = &mut weights[i * ksize..][..ksize];
        for (dst, &w) in row.iter_mut().zip(&k).take(n) {
            let w = if ww != 0.0 { w / ww } else { w };
            let fixed = w * f64::from(1u32 << PRECISION_BITS);
            *dst = if w < 0.0 {
                (-0.5 + fixed) as i32
            } else {
                (0.5 + fixed) as i32
            };
        }
        bounds.push((xmin, n));
    }
    Coeffs {
        bounds,
        weights,
        ksize,
    }
}

/// A fixed-point sum back to 8 bits. The sums fit an i32 as Pillow's do: 8-bit values times
/// weights of 22 fractional bits whose magnitudes sum to under 2 (the cubic's negative lobes).
fn clip8(v: i32) -> u8 {
    if v >= (1 << PRECISION_BITS << 8) {
        255
    } else if v <= 0 {
        0
    } else {
        (v >> PRECISION_BITS) as u8
    }
}

/// The rounding half that every fixed-point sum starts from.
const ROUND: i32 = 1 << (PRECISION_BITS - 1);

/// Output pixels from which a pass spreads its rows over threads (smaller images stay on the
/// caller's thread).
pub(crate) const PARALLEL_PIXELS: usize = 1 << 18;

/// Fills the `row_len`-element rows of `out` with `fill(row index, row)`, over threads when
/// `parallel`. Rows are independent, so the values are the same either way.
pub(crate) fn rows_of<T: Send>(
    out: &mut [T],
    row_len: usize,
    parallel: bool,
    fill: impl Fn(usize, &mut [T]) + Sync,
) {
    use rayon::prelude::*;
    if row_len == 0 {
        return;
    }
    if parallel {
        out.par_chunks_mut(row_len)
            .enumerate()
            .for_each(|(y, row)| fill(y, row));
    } else {
        for (y, row) in out.chunks_mut(row_len).enumerate() {
            fill(y, row);
        }
    }
}

/// One horizontal pass: `rows` rows of `src` (width `w`, its column 0 source column `col0`) from
/// row `first`, each resampled to the window of `c`.
fn horizontal(
    src: &[u8],
    (w, col0): (usize, usize),
    (first, rows): (usize, usize),
    c: &Coeffs,
    parallel: bool,
) -> Vec<u8> {
    let ow = c.bounds.len();
    let mut out = vec![0u8; ow * rows * 3];
    rows_of(&mut out, ow * 3, parallel, |y, row| {
        let line = &src[(y + first) * w * 3..][..w * 3];
        horizontal_row(row, line, col0, c);
    });
    out
}

/// One row of [`horizontal`]: `row`'s pixels from `line`'s (its column 0 source column `col0`).
fn horizontal_row(row: &mut [u8], line: &[u8], col0: usize, c: &Coeffs) {
    #[inline(always)]
    fn plain(row: &mut [u8], line: &[u8], col0: usize, c: &Coeffs) {
        let taps = c.bounds.iter().zip(c.weights.chunks_exact(c.ksize));
        for ((&(xmin, n), k), px) in taps.zip(row.chunks_exact_mut(3)) {
            let pixels = &line[(xmin - col0) * 3..][..n * 3];
            let mut ss = [ROUND; 3];
            for (p, &kx) in pixels.chunks_exact(3).zip(&k[..n]) {
                ss[0] += i32::from(p[0]) * kx;
                ss[1] += i32::from(p[1]) * kx;
                ss[2] += i32::from(p[2]) * kx;
            }
            px[0] = clip8(ss[0]);
            px[1] = clip8(ss[1]);
            px[2] = clip8(ss[2]);
        }
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        fn avx2(row: &mut [u8], line: &[u8], col0: usize, c: &Coeffs) {
            plain(row, line, col0, c)
        }
        if has_avx2() {
            // SAFETY: the CPU has AVX2 (checked above).
            return unsafe { avx2(row, line, col0, c) };
        }
    }
    plain(row, line, col0, c)
}

/// Whether the CPU has AVX2 (asked once).
#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVX2.get_or_init(|| is_x86_feature_detected!("avx2"))
}

/// `ss[i] += line[i] * k`, with AVX2 where the CPU has it (eight sums an instruction; the
/// portable build's SSE2 has no 32-bit multiply).
fn accumulate(ss: &mut [i32], line: &[u8], k: i32) {
    #[inline(always)]
    fn plain(ss: &mut [i32], line: &[u8], k: i32) {
        for (s, &p) in ss.iter_mut().zip(line) {
            *s += i32::from(p) * k;
        }
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        fn avx2(ss: &mut [i32], line: &[u8], k: i32) {
            plain(ss, line, k)
        }
        if has_avx2() {
            // SAFETY: the CPU has AVX2 (checked above).
            return unsafe { avx2(ss, line, k) };
        }
    }
    plain(ss, line, k)
}

/// One vertical pass over columns `cols` of `src` (width `w`) whose row 0 is source row `row0`,
/// to the window of `c`.
fn vertical(
    src: &[u8],
    w: usize,
    row0: usize,
    cols: Range<usize>,
    c: &Coeffs,
    parallel: bool,
) -> Vec<u8> {
    let oh = c.bounds.len();
    let ow = cols.len();
    let mut out = vec![0u8; ow * oh * 3];
    // a whole output row at a time, one source row (one tap) after another: each tap's sum runs
    // along contiguous bytes (vectorized), in the same order of taps as per pixel
    rows_of(&mut out, ow * 3, parallel, |yy, row| {
        let (ymin, n) = c.bounds[yy];
        let k = &c.weights[yy * c.ksize..][..n];
        let mut ss = vec![ROUND; row.len()];
        for (y, &ky) in k.iter().enumerate() {
            let line = &src[((y + ymin - row0) * w + cols.start) * 3..][..row.len()];
            accumulate(&mut ss, line, ky);
        }
        for (o, &s) in row.iter_mut().zip(&ss) {
            *o = clip8(s);
        }
    });
    out
}

/// Rows `rows` and columns `cols` of `src` (width `w`), copied.
fn cut(src: &[u8], w: usize, rows: Range<usize>, cols: Range<usize>) -> Vec<u8> {
    let mut out = Vec::with_capacity(rows.len() * cols.len() * 3);
    for y in rows {
        out.extend_from_slice(&src[(y * w + cols.start) * 3..(y * w + cols.end) * 3]);
    }
    out
}

/// The part of a resized image that is kept: `width` x `height` pixels from (`x`, `y`) of the
/// resized image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub x: usize,
    pub y: usize,
    pub width: usize,
    pub height: usize,
}

/// `src` (`w` x `h` RGB, row-major, 3 bytes a pixel) resized to `ow` x `oh` with `filter`. The
/// passes run in Pillow's (13) order: horizontal first, unless the height shrinks by more than
/// twice what the width does.
pub fn resize_rgb(src: &[u8], w: usize, h: usize, ow: usize, oh: usize, filter: Filter) -> Vec<u8> {
    let all = Window {
        x: 0,
        y: 0,
        width: ow,
        height: oh,
    };
    resize_crop_rgb(src, (w, h), (ow, oh), all, filter)
}

/// The `window` of [`resize_rgb`]'s result, the same bytes, computing only the pixels in it (and
/// the intermediate ones they read), so a crop of a huge resize costs what the crop does. The
/// window must lie inside `ow` x `oh`.
pub fn resize_crop_rgb(
    src: &[u8],
    (w, h): (usize, usize),
    (ow, oh): (usize, usize),
    window: Window,
    filter: Filter,
) -> Vec<u8> {
    let pixels = (window.width.saturating_mul(window.height)).max(w.saturating_mul(h));
    resize_rgb_on(
        src,
        (w, h),
        (ow, oh),
        window,
        filter,
        pixels >= PARALLEL_PIXELS,
    )
}

/// [`resize_crop_rgb`], its passes over threads or not.
fn resize_rgb_on(
    src: &[u8],
    (w, h): (usize, usize),
    (ow, oh): (usize, usize),
    win: Window,
    filter: Filter,
    parallel: bool,
) -> Vec<u8> {
    let (xs, ys) = (win.x..win.x + win.width, win.y..win.y + win.height);
    if w == 0 || h == 0 || xs.is_empty() || ys.is_empty() {
        return vec![0; win.width * win.height * 3];
    }
    let shrink_h = h as i64 - oh as i64;
    let horizontal_first = !(shrink_h > 0 && shrink_h > (w as i64 - ow as i64) * 2);
    // a dimension kept at its size is not resampled (as Pillow skips that pass), only cut
    let vert = (oh != h).then(|| coeffs(h, oh, ys.clone(), filter));
    let horiz = (ow != w).then(|| coeffs(w, ow, xs.clone(), filter));
    if horizontal_first {
        // only the rows the vertical pass reads
        let (first, rows) = vert.as_ref().map_or((ys.start, ys.len()), Coeffs::span);
        let tmp = match &horiz {
            Some(c) => horizontal(src, (w, 0), (first, rows), c, parallel),
            None => cut(src, w, first..first + rows, xs.clone()),
        };
        match &vert {
            Some(c) => vertical(&tmp, xs.len(), first, 0..xs.len(), c, parallel),
            None => tmp,
        }
    } else {
        // only the columns the horizontal pass reads
        let (col0, cols) = horiz.as_ref().map_or((xs.start, xs.len()), Coeffs::span);
        let tmp = match &vert {
            Some(c) => vertical(src, w, 0, col0..col0 + cols, c, parallel),
            None => cut(src, w, ys.clone(), col0..col0 + cols),
        };
        match &horiz {
            Some(c) => horizontal(&tmp, (cols, col0), (0, ys.len()), c, parallel),
            None => tmp,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_sum_to_one_in_fixed_point() {
        for (i, o) in [(70, 28), (28, 70), (337, 336), (1000, 14)] {
            let c = coeffs(i, o, 0..o, Filter::Bicubic);
            for (xx, &(_, n)) in c.bounds.iter().enumerate() {
                let s: i64 = c.weights[xx * c.ksize..][..n]
                    .iter()
                    .map(|&k| i64::from(k))
                    .sum();
                assert!(
                    (s - (1 << PRECISION_BITS)).abs() <= n as i64,
                    "{i}->{o} at {xx}: {s}"
                );
            }
        }
    }

    #[test]
    fn a_flat_image_stays_flat_and_sizes_are_kept() {
        let src = vec![77u8; 13 * 9 * 3];
        let out = resize_rgb(&src, 13, 9, 28, 5, Filter::Bicubic);
        assert_eq!(out.len(), 28 * 5 * 3);
        assert!(out.iter().all(|&v| v == 77));
        assert_eq!(resize_rgb(&src, 13, 9, 13, 9, Filter::Bicubic), src);
    }

    /// Every pixel of a window is the resized image's.
    fn window_of(src: &[u8], (w, h): (usize, usize), (ow, oh): (usize, usize), win: Window) {
        let whole = resize_rgb(src, w, h, ow, oh, Filter::Bicubic);
        let part = resize_crop_rgb(src, (w, h), (ow, oh), win, Filter::Bicubic);
        let rows = win.y..win.y + win.height;
        assert_eq!(
            part,
            cut(&whole, ow, rows, win.x..win.x + win.width),
            "{w}x{h} -> {ow}x{oh}, {win:?}"
        );
    }

    #[test]
    fn a_window_of_a_resize_is_that_part_of_the_whole_resize() {
        let (w, h) = (53, 41);
        let src: Vec<u8> = (0..w * h * 3).map(|i| (i * 97 % 253) as u8).collect();
        // both pass orders, up and down, one dimension kept, the whole image as the window
        for (ow, oh) in [
            (80, 60),
            (20, 90),
            (53, 10),
            (90, 41),
            (53, 41),
            (30, 30),
            (7, 3),
        ] {
            for (x, y) in [(0, 0), (ow / 3, oh / 4), (ow - ow / 2, oh - oh / 2)] {
                let win = Window {
                    x,
                    y,
                    width: (ow - x).min(ow / 2 + 1),
                    height: (oh - y).min(oh / 2 + 1),
                };
                window_of(&src, (w, h), (ow, oh), win);
            }
            let all = Window {
                x: 0,
                y: 0,
                width: ow,
                height: oh,
            };
            window_of(&src, (w, h), (ow, oh), all);
        }
    }

    /// The resize computed pixel by pixel in i64, both passes over whole images in Pillow's order
    /// (horizontal first unless the height shrinks by more than twice the width).
    fn per_pixel(
        src: &[u8],
        (w, h): (usize, usize),
        (ow, oh): (usize, usize),
        f: Filter,
    ) -> Vec<u8> {
        let clip = |v: i64| (v >> PRECISION_BITS).clamp(0, 255) as u8;
        let round = 1i64 << (PRECISION_BITS - 1);
        let pass = |src: &[u8], (w, h): (usize, usize), out_len: usize, across: bool| {
            let (n_in, n_out, lines) = if across {
                (w, out_len, h)
            } else {
                (h, out_len, w)
            };
            let c = coeffs(n_in, n_out, 0..n_out, f);
            let mut out = vec![0u8; n_out * lines * 3];
            for line in 0..lines {
                for (o, &(first, n)) in c.bounds.iter().enumerate() {
                    for ch in 0..3 {
                        let mut s = round;
                        for t in 0..n {
                            let i = first + t;
                            let at = if across { line * w + i } else { i * w + line };
                            s +=
                                i64::from(src[at * 3 + ch]) * i64::from(c.weights[o * c.ksize + t]);
                        }
                        let at = if across {
                            line * n_out + o
                        } else {
                            o * w + line
                        };
                        out[at * 3 + ch] = clip(s);
                    }
                }
            }
            out
        };
        // a pass only where the size changes
        let step = |t: Vec<u8>, dims: (usize, usize), to: usize, across: bool| {
            let from = if across { dims.0 } else { dims.1 };
            if to != from {
                pass(&t, dims, to, across)
            } else {
                t
            }
        };
        let shrink_h = h as i64 - oh as i64;
        if !(shrink_h > 0 && shrink_h > (w as i64 - ow as i64) * 2) {
            step(step(src.to_vec(), (w, h), ow, true), (ow, h), oh, false)
        } else {
            step(step(src.to_vec(), (w, h), oh, false), (w, oh), ow, true)
        }
    }

    #[test]
    fn the_passes_are_the_per_pixel_sums() {
        let (w, h) = (61, 47);
        // extremes next to each other, so the cubic's lobes over- and undershoot
        let src: Vec<u8> = (0..w * h * 3)
            .map(|i| {
                if (i * 7919) % 5 < 2 {
                    255
                } else {
                    (i * 31 % 7) as u8
                }
            })
            .collect();
        for (ow, oh) in [(60, 46), (122, 94), (20, 47), (61, 13), (9, 70), (200, 30)] {
            for f in [Filter::Bicubic, Filter::Bilinear] {
                assert_eq!(
                    resize_rgb(&src, w, h, ow, oh, f),
                    per_pixel(&src, (w, h), (ow, oh), f),
                    "{ow}x{oh} {f:?}"
                );
            }
        }
    }

    #[test]
    fn threads_give_the_same_bytes() {
        let (w, h) = (97, 61);
        let src: Vec<u8> = (0..w * h * 3).map(|i| (i * 37 % 251) as u8).collect();
        for (ow, oh) in [(150, 40), (40, 150), (97, 30), (60, 61)] {
            let win = Window {
                x: 1,
                y: 2,
                width: ow - 3,
                height: oh - 2,
            };
            for filter in [Filter::Bicubic, Filter::Bilinear] {
                assert_eq!(
                    resize_rgb_on(&src, (w, h), (ow, oh), win, filter, true),
                    resize_rgb_on(&src, (w, h), (ow, oh), win, filter, false),
                    "{ow}x{oh} {filter:?}"
                );
            }
        }
    }
}
