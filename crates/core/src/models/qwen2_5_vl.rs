//! `Qwen2_5_VLForConditionalGeneration`: the Qwen2 decoder (q/k/v biases, M-RoPE) behind the
//! vision encoder of [`super::qwen2_5_vl_vision`]. The decoder is the shared one; this file maps
//! the config (flat as published, or with a nested `text_config`), loads the encoder from
//! `visual.*` and reads the processor settings from `preprocessor_config.json`.

use super::layers::decoder::Decoder;
use super::qwen2::qwen_windows;
use super::qwen2_5_vl_vision::{Qwen25Vision, VisionConfig};
use super::{DecoderConfig, HfConfig, Model};
use crate::batch::ForwardBatch;
use crate::kv_cache::KvCache;
use crate::load_error::LoadError;
use crate::multimodal::qwen2_vl::Qwen2VlConfig;
use crate::multimodal::{ImageInput, ImageProcessor, Processor, DEFAULT_MAX_IMAGE_PIXELS};
use crate::weights::Weights;
use candle_core::{Result, Tensor};
use std::path::Path;

const ARCH: &str = "Qwen2_5_VLForConditionalGeneration";

pub fn config(c: &HfConfig) -> std::result::Result<DecoderConfig, LoadError> {
    let text = c.text()?;
    let mut d = text.base_decoder(ARCH)?;
    d.qkv_bias = true;
    d.sliding_window = qwen_windows(&text, d.num_layers);
    d.mrope_section = text.mrope_section()?;
    Ok(d)
}

fn vision_config(c: &HfConfig) -> std::result::Result<VisionConfig, LoadError> {
    let v = c.vision_config.clone().unwrap_or_default();
    serde_json::from_value(v).map_err(|e| LoadError::Config {
        field: "vision_config".into(),
        reason: e.to_string(),
    })
}

/// The decoder and its vision encoder.
pub struct Qwen25Vl {
    decoder: Decoder,
    vision: Qwen25Vision,
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
    let vision = Qwen25Vision::load(vcfg, &w.pp("visual").dense())?;
    let decoder = Decoder::load(cfg, w, max_positions)?;
    Ok(Box::new(Qwen25Vl { decoder, vision }))
}

/// `preprocessor_config.json` (defaults where absent) and the placeholder token.
pub fn processor(c: &HfConfig, dir: &Path) -> std::result::Result<Processor, LoadError> {
    let path = dir.join("preprocessor_config.json");
    let mut cfg: Qwen2VlConfig = if path.is_file() {
        let text = std::fs::read_to_string(&path).map_err(|e| LoadError::Io {
            file: path.clone(),
            reason: e.to_string(),
        })?;
        serde_json::from_str(&text).map_err(|e| LoadError::Json {
            file: path.clone(),
            reason: e.to_string(),
        })?
    } else {
        Qwen2VlConfig::default()
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

impl Model for Qwen25Vl {
    fn config(&self) -> &DecoderConfig {
        self.decoder.config()
    }

    fn max_positions(&self) -> usize {
        self.decoder.max_positions()
    }

    fn embed(&self, input_ids: &Tensor) -> Result<Tensor> {
        self.decoder.embed(input_ids)
    }

    fn forward_embeds(
        &self,
        embeds: &Tensor,
        batch: &ForwardBatch,
        kv: &KvCache,
    ) -> Result<Tensor> {
        self.decoder.forward_embeds(embeds, batch, kv)
    }

    fn forward_into(&self, batch: &ForwardBatch, kv: &KvCache, logits: &Tensor) -> Result<()> {
        self.decoder.forward_into(batch, kv, logits)
    }

    fn kv_cache_scales(&self) -> Vec<Option<rserve_kernels::CacheScales>> {
        self.decoder.kv_cache_scales()
    }

    fn encode_images(&self, images: &[&ImageInput]) -> Result<Vec<Tensor>> {
        if images.is_empty() {
            return Ok(Vec::new());
        }
        let dev = self.vision_device();
        let cols = images[0].shape[1];
        let mut rows = Vec::with_capacity(images.len());
        for img in images {
            if img.shape[1] != cols || img.pixels.len() != img.shape[0] * img.shape[1] {
                candle_core::bail!("image pixels of shape {:?} do not match", img.shape);
            }
            rows.push(Tensor::from_slice(&img.pixels, (img.shape[0], cols), &dev)?);
        }
        let pixels = Tensor::cat(&rows, 0)?;
        let grids: Vec<[usize; 3]> = images.iter().map(|i| i.grid_thw).collect();
        let feats = self.vision.forward(&pixels, &grids)?;
        let mut out = Vec::with_capacity(images.len());
        let mut at = 0;
        for img in images {
            out.push(feats.narrow(0, at, img.num_tokens)?);
            at += img.num_tokens;
        }
        Ok(out)
    }
}

impl Qwen25Vl {
    fn vision_device(&self) -> candle_core::Device {
        self.decoder.device().clone()
    }
}
