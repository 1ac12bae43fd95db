//! A prompt with images, as the engine receives it: each image preprocessed for the model's
//! encoder ([`ImageInput`]), where its placeholder tokens lie in the prompt ([`ImageSpan`]) and,
//! for Qwen2-VL's M-RoPE, the 3-D rotary position of every prompt token ([`MropePositions`]).
//!
//! [`Processor`] is what an edge (HTTP, Python) asks to turn decoded images and a tokenized
//! prompt into these: it expands each placeholder token into the image's tokens as the Hugging
//! Face processor does. Pure data and arithmetic; the encoder itself is in `models/`.

use super::clip::ClipConfig;
use super::qwen2_vl::Qwen2VlConfig;
use super::{ImageError, RgbImage};
use std::sync::Arc;

/// One image ready for the model's vision encoder.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageInput {
    /// The processor's `pixel_values` for this image, row-major `[shape[0], shape[1]]`:
    /// Qwen2-VL `[patches, 3 * temporal_patch * patch^2]`, CLIP `[3, size * size]`.
    pub pixels: Vec<f32>,
    pub shape: [usize; 2],
    /// The encoder's patch grid (t, h, w).
    pub grid_thw: [usize; 3],
    /// Placeholder tokens the image takes in the prompt.
    pub num_tokens: usize,
    /// Content hash of the decoded image (its pixels, however encoded).
    pub hash: [u8; 32],
}

/// Where one image's tokens lie in the prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageSpan {
    pub offset: usize,
    pub len: usize,
}

impl ImageSpan {
    pub fn end(&self) -> usize {
        self.offset + self.len
    }
}

/// Each prompt token's (temporal, height, width) rotary positions, and the shift of every later
/// token's position from its index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MropePositions {
    pub t: Vec<u32>,
    pub h: Vec<u32>,
    pub w: Vec<u32>,
    /// Position of a token at index `i >= prompt_len`: `i + delta` on all three axes.
    pub delta: i64,
}

impl MropePositions {
    /// The three positions of token `i` of a sequence whose prompt these are.
    pub fn at(&self, i: usize) -> [u32; 3] {
        match (self.t.get(i), self.h.get(i), self.w.get(i)) {
            (Some(&t), Some(&h), Some(&w)) => [t, h, w],
            _ => {
                let p = (i as i64 + self.delta).max(0) as u32;
                [p, p, p]
            }
        }
    }
}

/// The images of one prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct MmPrompt {
    pub images: Vec<Arc<ImageInput>>,
    /// One per image, in prompt order.
    pub spans: Vec<ImageSpan>,
    /// For models with M-RoPE.
    pub mrope: Option<MropePositions>,
}

impl MmPrompt {
    /// `(image, span)` of each image whose tokens meet `[start, end)`.
    pub fn images_in(
        &self,
        start: usize,
        end: usize,
    ) -> impl Iterator<Item = (usize, ImageSpan)> + '_ {
        self.spans
            .iter()
            .copied()
            .enumerate()
            .filter(move |(_, s)| s.offset < end && s.end() > start)
    }
}

/// How a model's images are preprocessed and laid into the prompt.
#[derive(Debug, Clone, PartialEq)]
pub enum ImageProcessor {
    /// Qwen2-VL / Qwen2.5-VL: dynamic resolution, M-RoPE positions.
    Qwen2Vl(Qwen2VlConfig),
    /// LLaVA-1.5: CLIP's resize and crop, a fixed number of tokens per image (one per patch,
    /// plus the class token when `keep_cls`).
    Clip {
        config: ClipConfig,
        patch_size: usize,
        keep_cls: bool,
    },
}

/// Turns images and a tokenized prompt into the model's inputs.
#[derive(Debug, Clone, PartialEq)]
pub struct Processor {
    pub kind: ImageProcessor,
    /// The placeholder token the chat template writes once per image and the processor
    /// repeats for each of the image's tokens.
    pub image_token_id: u32,
    /// Largest decoded image accepted, in pixels.
    pub max_image_pixels: u64,
}

impl Processor {
    /// Preprocesses one decoded image (on the media threads, see
    /// [`super::on_media_threads`]).
    pub fn image(&self, img: &RgbImage) -> Result<ImageInput, ImageError> {
        super::on_media_threads(|| self.preprocess(img))
    }

    fn preprocess(&self, img: &RgbImage) -> Result<ImageInput, ImageError> {
        match &self.kind {
            ImageProcessor::Qwen2Vl(cfg) => {
                // the hash beside the preprocessing, on another thread
                let (hash, px) = rayon::join(|| img.content_hash(), || cfg.preprocess(img));
                let px = px?;
                let rows = px.grid_thw.iter().product::<usize>();
                Ok(ImageInput {
                    shape: [rows, px.pixel_values.len() / rows.max(1)],
                    num_tokens: px.num_tokens(cfg.merge_size),
                    grid_thw: px.grid_thw,
                    pixels: px.pixel_values,
                    hash,
                })
            }
            ImageProcessor::Clip {
                config,
                patch_size,
                keep_cls,
            } => {
                let (hash, pixels) = rayon::join(|| img.content_hash(), || config.preprocess(img));
                let (side, num_tokens) = clip_grid(config, *patch_size, *keep_cls);
                Ok(ImageInput {
                    shape: [3, config.crop_size * config.crop_size],
                    grid_thw: [1, side, side],
                    num_tokens,
                    pixels: pixels?,
                    hash,
                })
            }
        }
    }

    /// Most placeholder tokens one image can take: Qwen2-VL's at the largest area its resize
    /// allows, CLIP's fixed count.
    pub fn max_image_tokens(&self) -> usize {
        match &self.kind {
            ImageProcessor::Qwen2Vl(cfg) => cfg.max_tokens(),
            ImageProcessor::Clip {
                config,
                patch_size,
                keep_cls,
            } => clip_grid(config, *patch_size, *keep_cls).1,
        }
    }

    /// Blank images of at most `tokens` placeholder tokens in all (at least one image), none
    /// larger than [`Processor::max_image_tokens`]: the encoder's largest batch, for the memory
    /// profile at start. Qwen2-VL: near-square grids; CLIP: as many crops as fit.
    pub fn profile_images(&self, tokens: usize) -> Vec<ImageInput> {
        let blank = |shape: [usize; 2], grid_thw: [usize; 3], num_tokens: usize| ImageInput {
            pixels: vec![0.0; shape[0] * shape[1]],
            shape,
            grid_thw,
            num_tokens,
            hash: [0; 32],
        };
        match &self.kind {
            ImageProcessor::Qwen2Vl(cfg) => {
                let (p, m, t) = (
                    cfg.patch_size,
                    cfg.merge_size.max(1),
                    cfg.temporal_patch_size.max(1),
                );
                let per = self.max_image_tokens();
                let mut out = Vec::new();
                let mut left = tokens.max(1);
                while left > 0 {
                    let n = left.min(per);
                    let a = (n as f64).sqrt().floor().max(1.0) as usize;
                    let b = (n / a).max(1);
                    out.push(blank(
                        [m * m * a * b, 3 * t * p * p],
                        [1, m * a, m * b],
                        a * b,
                    ));
                    left -= n;
                }
                out
            }
            ImageProcessor::Clip {
                config,
                patch_size,
                keep_cls,
            } => {
                let (side, per) = clip_grid(config, *patch_size, *keep_cls);
                let shape = [3, config.crop_size * config.crop_size];
                (0..(tokens / per.max(1)).max(1))
                    .map(|_| blank(shape, [1, side, side], per))
                    .collect()
            }
        }
    }

    /// Decodes and preprocesses an encoded image (on the media threads).
    pub fn decode(&self, bytes: &[u8]) -> Result<ImageInput, ImageError> {
        super::on_media_threads(|| self.preprocess(&super::decode(bytes, self.max_image_pixels)?))
    }

    /// Expands each placeholder of `prompt` into its image's tokens (one placeholder per image,
    /// in order) and lays out the images' spans and, for Qwen2-VL, the 3-D positions.
    pub fn expand(
        &self,
        prompt: &[u32],
        images: Vec<ImageInput>,
    ) -> Result<(Vec<u32>, MmPrompt), ImageError> {
        let marks = prompt.iter().filter(|&&t| t == self.image_token_id).count();
        if marks != images.len() {
            return Err(ImageError::Unsupported(format!(
                "the prompt has {marks} image placeholders for {} images",
                images.len()
            )));
        }
        let extra: usize = images.iter().map(|i| i.num_tokens.saturating_sub(1)).sum();
        let mut ids = Vec::with_capacity(prompt.len() + extra);
        let mut spans = Vec::with_capacity(images.len());
        let mut next = images.iter();
        for &t in prompt {
            if t == self.image_token_id {
                let n = next.next().map_or(1, |i| i.num_tokens);
                spans.push(ImageSpan {
                    offset: ids.len(),
                    len: n,
                });
                ids.extend(std::iter::repeat_n(t, n));
            } else {
                ids.push(t);
            }
        }
        let mrope = match &self.kind {
            ImageProcessor::Qwen2Vl(cfg) => {
                let grids: Vec<[usize; 3]> = images.iter().map(|i| i.grid_thw).collect();
                Some(mrope_positions(ids.len(), &spans, &grids, cfg.merge_size))
            }
            ImageProcessor::Clip { .. } => None,
        };
        let images = images.into_iter().map(Arc::new).collect();
        Ok((
            ids,
            MmPrompt {
                images,
                spans,
                mrope,
            },
        ))
    }
}

/// CLIP's patch grid side and the tokens an image takes (one per patch, plus the class token
/// when `keep_cls`).
fn clip_grid(config: &ClipConfig, patch_size: usize, keep_cls: bool) -> (usize, usize) {
    let side = config.crop_size / patch_size.max(1);
    (side, side * side + usize::from(keep_cls))
}

/// Qwen2-VL's `get_rope_index` for one prompt of `len` tokens: text tokens count up on all three
/// axes; an image's tokens take its merged grid's (t, h, w) offset by the position where it
/// starts, and the text after it resumes at that start plus the larger side of the grid.
pub fn mrope_positions(
    len: usize,
    spans: &[ImageSpan],
    grids: &[[usize; 3]],
    merge: usize,
) -> MropePositions {
    let merge = merge.max(1);
    let mut pos = MropePositions {
        t: Vec::with_capacity(len),
        h: Vec::with_capacity(len),
        w: Vec::with_capacity(len),
        delta: 0,
    };
    let mut current = 0u32;
    let text_until = |to: usize, pos: &mut MropePositions, current: &mut u32| {
        while pos.t.len() < to.min(len) {
            pos.t.push(*current);
            pos.h.push(*current);
            pos.w.push(*current);
            *current += 1;
        }
    };
    for (span, grid) in spans.iter().zip(grids) {
        text_until(span.offset, &mut pos, &mut current);
        let (gt, gh, gw) = (grid[0], grid[1] / merge, grid[2] / merge);
        let cells =
            (0..gt).flat_map(|i| (0..gh).flat_map(move |y| (0..gw).map(move |x| (i, y, x))));
        for (i, y, x) in cells.take(span.len) {
            pos.t.push(current + i as u32);
            pos.h.push(current + y as u32);
            pos.w.push(current + x as u32);
        }
        current += gh.max(gw) as u32;
    }
    text_until(len, &mut pos, &mut current);
    let max = pos
        .t
        .iter()
        .chain(&pos.h)
        .chain(&pos.w)
        .copied()
        .max()
        .map_or(-1, i64::from);
    pos.delta = max + 1 - len as i64;
    pos
}
