//! CLIP image preprocessing (LLaVA-1.5), as `CLIPImageProcessor` computes it: the shorter side is
//! resized to `shortest_edge` (the longer one keeps the aspect ratio, truncated), the center
//! `crop_size` square is cut out, and the pixels are rescaled and normalized channel-first.

use super::qwen2_vl::{CLIP_MEAN, CLIP_STD};
use super::resample::{resize_crop_rgb, Filter, Window};
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

    /// `[3, crop_size, crop_size]` pixel values. Only the crop is resampled (the same bytes as
    /// resizing the whole image and cutting it out), so a thin image whose resize would be
    /// millions of pixels long costs no more than a square one.
    pub fn preprocess(&self, img: &RgbImage) -> Result<Vec<f32>, ImageError> {
        let (rh, rw) = self.resized_size(img.height, img.width);
        let c = self.crop_size;
        if rh < c || rw < c {
            return Err(ImageError::Unsupported(format!(
                "a {}x{} image resizes to {rw}x{rh}, smaller than the {c}x{c} crop",
                img.width, img.height
            )));
        }
        let window = Window {
            x: (rw - c) / 2,
            y: (rh - c) / 2,
            width: c,
            height: c,
        };
        let data = resize_crop_rgb(
            &img.data,
            (img.width, img.height),
            (rw, rh),
            window,
            Filter::Bicubic,
        );
        let cropped = RgbImage::new(c, c, data)?;
        Ok(normalize_chw(&cropped, self.mean, self.std))
    }
}
