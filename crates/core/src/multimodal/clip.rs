//! CLIP image preprocessing (LLaVA-1.5), as `CLIPImageProcessor` computes it: the shorter side is
//! resized to `shortest_edge` (the longer one keeps the aspect ratio, truncated), the center
//! `crop_size` square is cut out, and the pixels are rescaled and normalized channel-first.

use super::qwen2_vl::{CLIP_MEAN, CLIP_STD};
use super::resample::Filter;
use super::{normalize_chw, ImageError, RgbImage};

/// The processor's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClipConfig {
    pub shortest_edge: usize,
    pub crop_size: usize,
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

impl Default for ClipConfig {
    fn default() -> Self {
        Self {
            shortest_edge: 336,
            crop_size: 336,
            mean: CLIP_MEAN,
            std: CLIP_STD,
        }
    }
}

impl ClipConfig {
    /// The size (height, width) before the crop.
    pub fn resized_size(&self, height: usize, width: usize) -> (usize, usize) {
        let s = self.shortest_edge;
        if height <= width {
            (s, (s as f64 * width as f64 / height as f64) as usize)
        } else {
            ((s as f64 * height as f64 / width as f64) as usize, s)
        }
    }

    /// `[3, crop_size, crop_size]` pixel values.
    pub fn preprocess(&self, img: &RgbImage) -> Result<Vec<f32>, ImageError> {
        let (rh, rw) = self.resized_size(img.height, img.width);
        let resized = img.resized(rw, rh, Filter::Bicubic);
        let c = self.crop_size;
        if rh < c || rw < c {
            return Err(ImageError::Unsupported(format!(
                "a {}x{} image resizes to {rw}x{rh}, smaller than the {c}x{c} crop",
                img.width, img.height
            )));
        }
        let (top, left) = ((rh - c) / 2, (rw - c) / 2);
        let mut data = Vec::with_capacity(c * c * 3);
        for y in top..top + c {
            data.extend_from_slice(&resized.data[(y * rw + left) * 3..][..c * 3]);
        }
        let cropped = RgbImage::new(c, c, data)?;
        Ok(normalize_chw(&cropped, self.mean, self.std))
    }
}
