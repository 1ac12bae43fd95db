//! `Qwen2_5_VLForConditionalGeneration` and `Qwen2VLForConditionalGeneration`: the Qwen2 decoder
//! (q/k/v biases, M-RoPE) behind the vision encoder of [`super::qwen2_5_vl_vision`] (the two
//! differ only in the encoder's blocks and config). The decoder is the shared one; this file maps
//! the config (flat as published, or with a nested `text_config`), loads the encoder from
//! `visual.*` and reads the processor settings from `preprocessor_config.json`.

use super::layers::decoder::Decoder;
use super::qwen2::qwen_windows;
use super::qwen2_5_vl_vision::{Qwen25Vision, Qwen2VisionConfig, VisionConfig};
use super::{DecoderConfig, HfConfig, ImageEncoder, Model, WithVision};
use crate::load_error::LoadError;
use crate::multimodal::qwen2_vl::Qwen2VlConfig;
use crate::multimodal::{ImageInput, ImageProcessor, Processor, DEFAULT_MAX_IMAGE_PIXELS};
use crate::weights::Weights;
use candle_core::{Result, Tensor};
use std::path::Path;

const ARCH: &str = "Qwen2_5_VLForConditionalGeneration";
const ARCH_QWEN2: &str = "Qwen2VLForConditionalGeneration";

/// The architecture of `c`: Qwen2-VL when it names that one (and not Qwen2.5-VL) first.
fn arch(c: &HfConfig) -> &'static str {
    let names = c.architectures.as_deref().unwrap_or_default();
    match names.iter().find(|n| *n == ARCH || *n == ARCH_QWEN2) {
        Some(n) if n == ARCH_QWEN2 => ARCH_QWEN2,
        _ => ARCH,
    }
}

pub fn config(c: &HfConfig) -> std::result::Result<DecoderConfig, LoadError> {
    let text = c.text()?;
    let mut d = text.base_decoder(arch(c))?;
    d.qkv_bias = true;
    d.sliding_window = qwen_windows(&text, d.num_layers);
    d.mrope_section = text.mrope_section()?;
    Ok(d)
}

fn vision_config(c: &HfConfig) -> std::result::Result<VisionConfig, LoadError> {
    let v = c.vision_config.clone().unwrap_or_default();
    let bad = |e: serde_json::Error| LoadError::Config {
        field: "vision_config".into(),
        reason: e.to_string(),
    };
    if arch(c) == ARCH_QWEN2 {
        let q: Qwen2VisionConfig = serde_json::from_value(v).map_err(bad)?;
        return Ok(q.into());
    }
    serde_json::from_value(v).map_err(bad)
}

/// The vision encoder (the decoder is the shared one, see [`WithVision`]).
pub struct Qwen25Vl {
    vision: Qwen25Vision,
    /// Pinned buffers the pixels go to the GPU through, made with the first image.
    #[cfg(feature = "cuda")]
    staging: crate::staging::Shared,
}

impl Qwen25Vl {
    fn new(vision: Qwen25Vision) -> Self {
        Self {
            vision,
            #[cfg(feature = "cuda")]
            staging: crate::staging::Shared::default(),
        }
    }

    /// The pixel rows of `images` (`cols` values each), one image after another, on `dev`. On
    /// a GPU through pinned buffers, in the encoder's dtype (rounded as the device rounds them,
    /// half the bytes of f32 for a 16-bit encoder): a copy from pageable memory would wait for
    /// the step in flight before it starts, and run slower.
    fn upload(
        &self,
        images: &[&ImageInput],
        cols: usize,
        dev: &candle_core::Device,
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(cuda) = dev {
            let rows: usize = images.iter().map(|i| i.shape[0]).sum();
            let parts: Vec<&[f32]> = images.iter().map(|i| i.pixels.as_slice()).collect();
            let dtype = self.vision.dtype();
            return self.staging.with(cuda, |s| {
                s.upload_f32_as(cuda, &parts, &[rows, cols], dtype)
            });
        }
        let parts = images
            .iter()
            .map(|img| Tensor::from_slice(&img.pixels, (img.shape[0], cols), dev))
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&parts, 0)
    }

    /// An index table of the encoder's pass on `dev`: on a GPU through the same pinned buffers
    /// as the pixels, for the same reason.
    fn upload_table(&self, v: &[u32], dev: &candle_core::Device) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(cuda) = dev {
            return self
                .staging
                .with(cuda, |s| s.upload_values(cuda, &[v], &[v.len()]));
        }
        Tensor::from_slice(v, v.len(), dev)
    }
}

pub fn build(
    c: &HfConfig,
    cfg: DecoderConfig,
    w: &Weights,
    max_positions: usize,
) -> std::result::Result<Box<dyn Model>, LoadError> {
    let vcfg = vision_config(c)?;
    if vcfg.out_hidden_size != cfg.hidden_size {
        return Err(LoadError::Config {
            field: "vision_config.out_hidden_size".into(),
            reason: format!(
                "{} differs from the language model's hidden_size {}",
                vcfg.out_hidden_size, cfg.hidden_size
            ),
        });
    }
    // published checkpoints: `model.*` and `visual.*`; transformers 5's own layout nests both
    let nested = w.contains("model.language_model.embed_tokens.weight");
    let (text, visual) = if nested {
        ("model.language_model", "model.visual")
    } else {
        ("model", "visual")
    };
    let vision = Qwen25Vision::load(vcfg, &w.pp(visual).dense())?;
    let decoder = Decoder::load_under(cfg, w, text, max_positions)?;
    Ok(Box::new(WithVision {
        decoder,
        encoder: Qwen25Vl::new(vision),
    }))
}

/// `preprocessor_config.json` (defaults where absent) and the placeholder token.
pub fn processor(c: &HfConfig, dir: &Path) -> std::result::Result<Processor, LoadError> {
    let mut cfg: Qwen2VlConfig = match super::read_preprocessor_config(dir)? {
        serde_json::Value::Null => Qwen2VlConfig::default(),
        v => serde_json::from_value(v).map_err(|e| LoadError::Json {
            file: dir.join("preprocessor_config.json"),
            reason: e.to_string(),
        })?,
    };
    let v = vision_config(c)?;
    cfg.patch_size = v.patch_size;
    cfg.merge_size = v.spatial_merge_size;
    cfg.temporal_patch_size = v.temporal_patch_size;
    let image_token_id = c.image_token_id.ok_or_else(|| LoadError::Config {
        field: "image_token_id".into(),
        reason: "missing".into(),
    })?;
    Ok(Processor {
        kind: ImageProcessor::Qwen2Vl(cfg),
        image_token_id,
        max_image_pixels: DEFAULT_MAX_IMAGE_PIXELS,
    })
}

impl ImageEncoder for Qwen25Vl {
    fn encode(&self, images: &[&ImageInput], dev: &candle_core::Device) -> Result<Vec<Tensor>> {
        let cols = images[0].shape[1];
        for img in images {
            if img.shape[1] != cols || img.pixels.len() != img.shape[0] * img.shape[1] {
                candle_core::bail!("image pixels of shape {:?} do not match", img.shape);
            }
        }
        let pixels = self.upload(images, cols, dev)?;
        let grids: Vec<[usize; 3]> = images.iter().map(|i| i.grid_thw).collect();
        let feats = self
            .vision
            .forward(&pixels, &grids, &|v| self.upload_table(v, dev))?;
        let mut out = Vec::with_capacity(images.len());
        let mut at = 0;
        for img in images {
            out.push(feats.narrow(0, at, img.num_tokens)?);
            at += img.num_tokens;
        }
        Ok(out)
    }
}
