//! Images for vision models: decoding (PNG, JPEG, WebP, GIF's first frame) with a pixel limit
//! checked from the header before any pixel is decoded, conversion to RGB as the Hugging Face
//! processors do it (transparency composited onto white with Pillow's arithmetic), a content hash for cache keys, and each architecture's preprocessing
//! exactly as its Hugging Face processor computes it ([`qwen2_vl`], [`clip`]).
//!
//! Pure functions over bytes and vectors; no tensors, no model state.

pub mod clip;
pub mod prompt;
pub mod qwen2_vl;
pub mod resample;

pub use prompt::{ImageInput, ImageProcessor, ImageSpan, MmPrompt, MropePositions, Processor};

use sha2::{Digest, Sha256};
use std::io::Cursor;
use std::sync::OnceLock;

/// Runs `f` (an image's decoding and preprocessing) on the media threads: a rayon pool of their
/// own, so that a burst of requests with images never queues the engine's parallel host work
/// (staging a step's pixels for the device, sampling on the host) behind their resizes in
/// rayon's global pool. Without such a pool (it could not be made), on the caller's.
pub(crate) fn on_media_threads<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    let pool = POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .thread_name(|i| format!("rserve-media-{i}"))
            .build()
            .map_err(|e| {
                tracing::warn!("no media threads ({e}): images preprocess in the shared pool")
            })
            .ok()
    });
    match pool {
        Some(p) => p.install(f),
        None => f(),
    }
}

/// Largest image accepted by default, in pixels (a decompression bomb is refused from its header).
pub const DEFAULT_MAX_IMAGE_PIXELS: u64 = 64 * 1024 * 1024;

/// An 8-bit RGB image, row-major, 3 bytes a pixel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    pub width: usize,
    pub height: usize,
    pub data: Vec<u8>,
}

/// Why an image was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImageError {
    #[error("the data is not an image in a supported format (PNG, JPEG, WebP, GIF)")]
    UnknownFormat,
    #[error("the image could not be decoded: {0}")]
    Decode(String),
    #[error("the image is {width}x{height} pixels, more than the limit of {limit} pixels")]
    TooLarge { width: u32, height: u32, limit: u64 },
    #[error("the image has no pixels")]
    Empty,
    #[error("{0}")]
    Unsupported(String),
}

impl RgbImage {
    /// The RGB image of `data` (row-major, 3 bytes a pixel).
    pub fn new(width: usize, height: usize, data: Vec<u8>) -> Result<Self, ImageError> {
        if width == 0 || height == 0 {
            return Err(ImageError::Empty);
        }
        if data.len() != width * height * 3 {
            return Err(ImageError::Decode(format!(
                "{} bytes for {width}x{height} RGB",
                data.len()
            )));
        }
        Ok(Self {
            width,
            height,
            data,
        })
    }

    /// SHA-256 of the size and the pixels: equal images, however encoded, hash alike.
    pub fn content_hash(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update((self.width as u64).to_le_bytes());
        h.update((self.height as u64).to_le_bytes());
        h.update(&self.data);
        h.finalize().into()
    }

    /// The image resized with Pillow's arithmetic.
    pub fn resized(&self, width: usize, height: usize, filter: resample::Filter) -> RgbImage {
        RgbImage {
            width,
            height,
            data: resample::resize_rgb(&self.data, self.width, self.height, width, height, filter),
        }
    }
}

/// Decodes an encoded image into RGB. The size is read from the header first: more than
/// `max_pixels` pixels is refused before decoding. Transparency (an alpha channel or a palette's
/// transparent entries) is composited onto white, as the Hugging Face processors'
/// `convert_to_rgb` does; grey is replicated, palettes are expanded; 16-bit channels become 8
/// bits as Pillow makes them (16-bit grey saturates at 255, colour and alpha keep their high
/// byte).
pub fn decode(bytes: &[u8], max_pixels: u64) -> Result<RgbImage, ImageError> {
    let reader = image::ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| ImageError::Decode(e.to_string()))?;
    if reader.format().is_none() {
        return Err(ImageError::UnknownFormat);
    }
    let (width, height) = reader
        .into_dimensions()
        .map_err(|e| ImageError::Decode(e.to_string()))?;
    if width == 0 || height == 0 {
        return Err(ImageError::Empty);
    }
    if u64::from(width) * u64::from(height) > max_pixels {
        return Err(ImageError::TooLarge {
            width,
            height,
            limit: max_pixels,
        });
    }
    let mut reader = image::ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| ImageError::Decode(e.to_string()))?;
    let mut limits = image::Limits::default();
    limits.max_image_width = Some(width);
    limits.max_image_height = Some(height);
    limits.max_alloc = Some(max_pixels.saturating_mul(16));
    reader.limits(limits);
    // a decoder bug on malformed data must not take the caller down
    let img = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| reader.decode()))
        .map_err(|_| ImageError::Decode("the decoder failed on malformed data".into()))?
        .map_err(|e| ImageError::Decode(e.to_string()))?;
    let (w, h) = (img.width() as usize, img.height() as usize);
    let data = match &img {
        // 16-bit channels as Pillow reads them: grey alone is its `I;16` mode, whose values
        // saturate at 255 on the way to RGB; with colour or alpha the high byte is kept
        image::DynamicImage::ImageLuma16(g) => g
            .as_raw()
            .iter()
            .flat_map(|&v| [v.min(255) as u8; 3])
            .collect(),
        image::DynamicImage::ImageLumaA16(g) => g
            .as_raw()
            .chunks_exact(2)
            .flat_map(|p| {
                let (l, a) = ((p[0] >> 8) as u8, (p[1] >> 8) as u8);
                over_white(&[l, l, l, a])
            })
            .collect(),
        image::DynamicImage::ImageRgb16(c) => c.as_raw().iter().map(|&v| (v >> 8) as u8).collect(),
        image::DynamicImage::ImageRgba16(c) => c
            .as_raw()
            .chunks_exact(4)
            .flat_map(|p| {
                let high = |i: usize| (p[i] >> 8) as u8;
                over_white(&[high(0), high(1), high(2), high(3)])
            })
            .collect(),
        _ if img.color().has_alpha() => img
            .to_rgba8()
            .into_raw()
            .chunks_exact(4)
            .flat_map(over_white)
            .collect(),
        _ => img.to_rgb8().into_raw(),
    };
    RgbImage::new(w, h, data)
}

/// A noisy gradient image (benchmarks): every pixel differs from its neighbours, as in a photo.
pub fn test_pattern(width: usize, height: usize, seed: u64) -> RgbImage {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut data = Vec::with_capacity(width * height * 3);
    for y in 0..height {
        for x in 0..width {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let base = (x * 255 / width.max(1) + y * 97 / height.max(1)) as u64;
            for c in 0..3u64 {
                data.push(((base * (c + 1) + (state >> (8 * c)) % 64) & 0xff) as u8);
            }
        }
    }
    RgbImage {
        width,
        height,
        data,
    }
}

/// The image as a PNG file.
pub fn encode_png(img: &RgbImage) -> Result<Vec<u8>, ImageError> {
    let buf = image::RgbImage::from_raw(img.width as u32, img.height as u32, img.data.clone())
        .ok_or(ImageError::Empty)?;
    let mut out = Cursor::new(Vec::new());
    image::DynamicImage::ImageRgb8(buf)
        .write_to(&mut out, image::ImageFormat::Png)
        .map_err(|e| ImageError::Decode(e.to_string()))?;
    Ok(out.into_inner())
}

/// One RGBA pixel composited onto opaque white, as Pillow's `alpha_composite` computes it
/// (7 fractional bits, divisions by 255 rounded).
fn over_white(p: &[u8]) -> [u8; 3] {
    let a = u32::from(p[3]);
    if a == 0 {
        return [255; 3];
    }
    const BITS: u32 = 7;
    let div255 = |x: u32| ((x >> 8) + x) >> 8;
    let out_a = a * 255 + 255 * (255 - a);
    let coef1 = a * 255 * 255 * (1 << BITS) / out_a;
    let coef2 = 255 * (1 << BITS) - coef1;
    let mix = |c: u8| (div255(u32::from(c) * coef1 + 255 * coef2 + (0x80 << BITS)) >> BITS) as u8;
    [mix(p[0]), mix(p[1]), mix(p[2])]
}

/// `x * scale` as f32 then `(x - mean) / std` per channel, in f32, as the Hugging Face
/// processors rescale and normalize, tabulated for the 256 values of each channel (the same bits
/// as the arithmetic per pixel).
#[derive(Debug, Clone)]
pub struct Normalizer {
    table: [[f32; 256]; 3],
}

impl Normalizer {
    pub fn new(mean: [f32; 3], std: [f32; 3]) -> Self {
        let mut table = [[0f32; 256]; 3];
        for (c, row) in table.iter_mut().enumerate() {
            for (v, out) in row.iter_mut().enumerate() {
                let x = (v as f64 * (1.0 / 255.0)) as f32;
                *out = (x - mean[c]) / std[c];
            }
        }
        Self { table }
    }

    /// The normalized value of byte `v` of channel `c` (0, 1 or 2).
    #[inline]
    pub fn value(&self, c: usize, v: u8) -> f32 {
        self.table[c % 3][usize::from(v)]
    }
}

/// The normalized image channel-first (`[3, height, width]`).
pub fn normalize_chw(img: &RgbImage, mean: [f32; 3], std: [f32; 3]) -> Vec<f32> {
    let norm = Normalizer::new(mean, std);
    let plane = img.width * img.height;
    let mut out = vec![0f32; 3 * plane];
    for (i, px) in img.data.chunks_exact(3).enumerate() {
        for (c, &v) in px.iter().enumerate() {
            out[c * plane + i] = norm.value(c, v);
        }
    }
    out
}

#[cfg(test)]
mod tests;
