//! Qwen2-VL and Qwen2.5-VL image preprocessing, as `Qwen2VLImageProcessor` computes it: the image
//! is resized so each side is a multiple of `patch_size * merge_size` and the area lies within
//! `[min_pixels, max_pixels]` (`smart_resize`), normalized with CLIP's mean and std, repeated to
//! `temporal_patch_size` frames and cut into patches ordered so that each `merge_size x
//! merge_size` group of patches is contiguous (the merger folds them into one token).

use super::resample::{rows_of, Filter, PARALLEL_PIXELS};
use super::{ImageError, Normalizer, RgbImage};
use serde::Deserialize;

/// CLIP's normalization, which Qwen2-VL keeps.
pub const CLIP_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
pub const CLIP_STD: [f32; 3] = [0.268_629_54, 0.261_302_6, 0.275_777_1];

/// The processor's settings (`preprocessor_config.json`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct Qwen2VlConfig {
    pub min_pixels: usize,
    pub max_pixels: usize,
    pub patch_size: usize,
    pub merge_size: usize,
    pub temporal_patch_size: usize,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
    /// Newer configs give the pixel bounds here (`shortest_edge` is the minimum area,
    /// `longest_edge` the maximum).
    pub size: Option<SizeBounds>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct SizeBounds {
    pub shortest_edge: Option<usize>,
    pub longest_edge: Option<usize>,
}

impl Default for Qwen2VlConfig {
    fn default() -> Self {
        Self {
            min_pixels: 56 * 56,
            max_pixels: 28 * 28 * 1280,
            patch_size: 14,
            merge_size: 2,
            temporal_patch_size: 2,
            image_mean: CLIP_MEAN,
            image_std: CLIP_STD,
            size: None,
        }
    }
}

/// One image ready for the vision encoder.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen2VlPixels {
    /// `[grid_t * grid_h * grid_w, 3 * temporal_patch_size * patch_size^2]`, row-major.
    pub pixel_values: Vec<f32>,
    /// (t, h, w) in patches.
    pub grid_thw: [usize; 3],
}

impl Qwen2VlPixels {
    /// The placeholder tokens the image takes in the prompt.
    pub fn num_tokens(&self, merge_size: usize) -> usize {
        self.grid_thw.iter().product::<usize>() / (merge_size * merge_size).max(1)
    }
}

impl Qwen2VlConfig {
    fn bounds(&self) -> (usize, usize) {
        let min = self
            .size
            .as_ref()
            .and_then(|s| s.shortest_edge)
            .unwrap_or(self.min_pixels);
        let max = self
            .size
            .as_ref()
            .and_then(|s| s.longest_edge)
            .unwrap_or(self.max_pixels);
        (min, max)
    }

    /// Most placeholder tokens an image can take: the largest area the resize allows, in
    /// merged patches.
    pub fn max_tokens(&self) -> usize {
        let factor = (self.patch_size * self.merge_size).max(1);
        (self.bounds().1 / (factor * factor)).max(1)
    }

    /// The size (height, width) an image of `height` x `width` is resized to.
    pub fn smart_resize(&self, height: usize, width: usize) -> Result<(usize, usize), ImageError> {
        let factor = (self.patch_size * self.merge_size) as f64;
        let (min_pixels, max_pixels) = self.bounds();
        let (h, w) = (height as f64, width as f64);
        if h.max(w) / h.min(w).max(1.0) > 200.0 {
            return Err(ImageError::Unsupported(format!(
                "the aspect ratio of a {width}x{height} image exceeds 200"
            )));
        }
        // Python's round: halves to even
        let mut h_bar = ((h / factor).round_ties_even() * factor).max(factor);
        let mut w_bar = ((w / factor).round_ties_even() * factor).max(factor);
        if h_bar * w_bar > max_pixels as f64 {
            let beta = (h * w / max_pixels as f64).sqrt();
            h_bar = factor.max((h / beta / factor).floor() * factor);
            w_bar = factor.max((w / beta / factor).floor() * factor);
        } else if h_bar * w_bar < min_pixels as f64 {
            let beta = (min_pixels as f64 / (h * w)).sqrt();
            h_bar = (h * beta / factor).ceil() * factor;
            w_bar = (w * beta / factor).ceil() * factor;
        }
        Ok((h_bar as usize, w_bar as usize))
    }

    /// The encoder's input for one image: the resized image's bytes normalized straight into
    /// the patch layout, merged groups of rows over threads for large images.
    pub fn preprocess(&self, img: &RgbImage) -> Result<Qwen2VlPixels, ImageError> {
        let (rh, rw) = self.smart_resize(img.height, img.width)?;
        let resized = img.resized(rw, rh, Filter::Bicubic);
        let norm = Normalizer::new(self.image_mean, self.image_std);
        let (p, m, t) = (
            self.patch_size,
            self.merge_size,
            self.temporal_patch_size.max(1),
        );
        let (gh, gw) = (rh / p, rw / p);
        let row = 3 * t * p * p;
        let mut out = vec![0f32; gh * gw * row];
        let src = &resized.data;
        // patch order: (h / m, w / m, m, m); inside a patch: (channel, frame, py, px); one band
        // of `m` patch rows at a time
        let band = (gw / m.max(1)) * m * m * row;
        rows_of(&mut out, band, rh * rw >= PARALLEL_PIXELS, |bh, dst| {
            for (g, patch) in dst.chunks_exact_mut(row).enumerate() {
                let (bw, mh, mw) = (g / (m * m), g / m % m, g % m);
                let (py0, px0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                for (c, planes) in patch.chunks_exact_mut(t * p * p).enumerate() {
                    let (first, repeats) = planes.split_at_mut(p * p);
                    for (y, out) in first.chunks_exact_mut(p).enumerate() {
                        let line = &src[((py0 + y) * rw + px0) * 3..][..3 * p];
                        for (o, px) in out.iter_mut().zip(line.chunks_exact(3)) {
                            *o = norm.value(c, px[c]);
                        }
                    }
                    // the image repeated as every frame
                    for frame in repeats.chunks_exact_mut(p * p) {
                        frame.copy_from_slice(first);
                    }
                }
            }
        });
        Ok(Qwen2VlPixels {
            pixel_values: out,
            grid_thw: [1, gh, gw],
        })
    }
}
