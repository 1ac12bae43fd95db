//! `LlavaForConditionalGeneration` (LLaVA-1.5): a CLIP vision tower, a two-layer projector and a
//! Llama decoder (the shared one). Each image becomes `(image_size / patch_size)^2` tokens (the
//! class token dropped, `vision_feature_select_strategy: default`) read from the hidden states
//! of block `vision_feature_layer`. Weights are found in the published layout
//! (`vision_tower.vision_model.*`, `language_model.model.*`) or transformers 5's.

use super::clip_vision::{ClipVision, ClipVisionConfig};
use super::layers::decoder::Decoder;
use super::layers::linear::Linear;
use super::{DecoderConfig, HfConfig, ImageEncoder, Model, WithVision};
use crate::batch::LayerCtx;
use crate::load_error::LoadError;
use crate::multimodal::clip::ClipConfig;
use crate::multimodal::qwen2_vl::{CLIP_MEAN, CLIP_STD};
use crate::multimodal::{ImageInput, ImageProcessor, Processor, DEFAULT_MAX_IMAGE_PIXELS};
use crate::weights::Weights;
use candle_core::{Result, Tensor};
use serde_json::Value;
use std::path::Path;

const ARCH: &str = "LlavaForConditionalGeneration";

fn bad(field: &str, reason: impl Into<String>) -> LoadError {
    LoadError::Config {
        field: field.into(),
        reason: reason.into(),
    }
}

pub fn config(c: &HfConfig) -> std::result::Result<DecoderConfig, LoadError> {
    let mut text = c.text()?;
    // LLaVA-1.5 configs give only what differs from LlamaConfig's defaults
    text.hidden_size = text.hidden_size.or(Some(4096));
    text.intermediate_size = text.intermediate_size.or(Some(11008));
    text.num_hidden_layers = text.num_hidden_layers.or(Some(32));
    text.num_attention_heads = text.num_attention_heads.or(Some(32));
    text.vocab_size = text.vocab_size.or(Some(32000));
    text.max_position_embeddings = text.max_position_embeddings.or(Some(2048));
    text.base_decoder(ARCH)
}

/// LLaVA's settings beside the two sub-configs.
struct LlavaConfig {
    vision: ClipVisionConfig,
    /// Blocks of the tower whose output is read.
    layers: usize,
    keep_cls: bool,
    projector_bias: bool,
}

fn llava_config(c: &HfConfig) -> std::result::Result<LlavaConfig, LoadError> {
    let vision: ClipVisionConfig =
        serde_json::from_value(c.vision_config.clone().unwrap_or_default())
            .map_err(|e| bad("vision_config", e.to_string()))?;
    let n = vision.num_hidden_layers as i64;
    let layer = c
        .vision_feature_layer
        .as_ref()
        .map_or(Some(-2), Value::as_i64)
        .ok_or_else(|| bad("vision_feature_layer", "only one layer is supported"))?;
    // hidden_states[0] is the embeddings: layer k is the output of block k
    let layers = if layer < 0 { n + 1 + layer } else { layer };
    if !(0..=n).contains(&layers) {
        return Err(bad(
            "vision_feature_layer",
            format!("{layer} is out of range"),
        ));
    }
    let keep_cls = match c
        .vision_feature_select_strategy
        .as_deref()
        .unwrap_or("default")
    {
        "default" => false,
        "full" => true,
        s => return Err(bad("vision_feature_select_strategy", format!("`{s}`"))),
    };
    let act = c.projector_hidden_act.as_deref().unwrap_or("gelu");
    if act != "gelu" {
        return Err(bad("projector_hidden_act", format!("`{act}` (gelu)")));
    }
    Ok(LlavaConfig {
        vision,
        layers: layers as usize,
        keep_cls,
        projector_bias: c.multimodal_projector_bias.unwrap_or(true),
    })
}

/// The tower and the projector (the decoder is the shared one, see [`WithVision`]).
pub struct Llava {
    vision: ClipVision,
    linear_1: Linear, // [text hidden, vision hidden]
    linear_2: Linear, // [text hidden, text hidden]
    keep_cls: bool,
}

/// The first of `candidates` under which `probe` exists.
fn prefix_of<'a>(w: &Weights, candidates: &[&'a str], probe: &str) -> &'a str {
    candidates
        .iter()
        .copied()
        .find(|p| w.contains(&format!("{p}.{probe}")))
        .unwrap_or(candidates[0])
}

pub fn build(
    c: &HfConfig,
    cfg: DecoderConfig,
    w: &Weights,
    max_positions: usize,
) -> std::result::Result<Box<dyn Model>, LoadError> {
    let lc = llava_config(c)?;
    let tower = prefix_of(
        w,
        &[
            "vision_tower.vision_model",
            "vision_tower",
            "model.vision_tower.vision_model",
            "model.vision_tower",
        ],
        "embeddings.class_embedding",
    );
    let proj = prefix_of(
        w,
        &["multi_modal_projector", "model.multi_modal_projector"],
        "linear_1.weight",
    );
    let dense = w.dense();
    let vision = ClipVision::load(lc.vision.clone(), &dense.pp(tower), lc.layers)?;
    let p = dense.pp(proj);
    let (vh, th) = (lc.vision.hidden_size, cfg.hidden_size);
    let linear_1 = Linear::load(&p.pp("linear_1"), vh, th, lc.projector_bias)?;
    let linear_2 = Linear::load(&p.pp("linear_2"), th, th, lc.projector_bias)?;
    let decoder = if w.contains("language_model.model.embed_tokens.weight") {
        Decoder::load_under(cfg, &w.pp("language_model"), "model", max_positions)?
    } else {
        Decoder::load_under(cfg, w, "model.language_model", max_positions)?
    };
    Ok(Box::new(WithVision {
        decoder,
        encoder: Llava {
            vision,
            linear_1,
            linear_2,
            keep_cls: lc.keep_cls,
        },
    }))
}

/// CLIP preprocessing from `preprocessor_config.json` (`size.shortest_edge`, `crop_size`) and
/// the `<image>` placeholder.
pub fn processor(c: &HfConfig, dir: &Path) -> std::result::Result<Processor, LoadError> {
    let lc = llava_config(c)?;
    let pre = super::read_preprocessor_config(dir)?;
    let side = lc.vision.image_size;
    let edge = |v: Option<&Value>, key: &str| -> Option<usize> {
        v.and_then(|v| v.as_u64().or_else(|| v.get(key).and_then(Value::as_u64)))
            .map(|x| x as usize)
    };
    let three = |key: &str, default: [f32; 3]| -> [f32; 3] {
        pre.get(key)
            .and_then(|v| serde_json::from_value::<[f32; 3]>(v.clone()).ok())
            .unwrap_or(default)
    };
    let config = ClipConfig {
        shortest_edge: edge(pre.get("size"), "shortest_edge").unwrap_or(side),
        crop_size: edge(pre.get("crop_size"), "height").unwrap_or(side),
        mean: three("image_mean", CLIP_MEAN),
        std: three("image_std", CLIP_STD),
    };
    if config.crop_size != side {
        return Err(bad(
            "crop_size",
            format!(
                "{} differs from the tower's image_size {side}",
                config.crop_size
            ),
        ));
    }
    let image_token_id = c
        .image_token_index
        .or(c.image_token_id)
        .ok_or_else(|| bad("image_token_index", "missing"))?;
    Ok(Processor {
        kind: ImageProcessor::Clip {
            config,
            patch_size: lc.vision.patch_size,
            keep_cls: lc.keep_cls,
        },
        image_token_id,
        max_image_pixels: DEFAULT_MAX_IMAGE_PIXELS,
    })
}

impl ImageEncoder for Llava {
    fn encode(&self, images: &[&ImageInput], dev: &candle_core::Device) -> Result<Vec<Tensor>> {
        let cfg = self.vision.config();
        let (s, p, c) = (cfg.image_size, cfg.patch_size, cfg.num_channels);
        let side = cfg.side();
        let row = c * p * p;
        let mut rows = Vec::with_capacity(images.len() * side * side * row);
        for img in images {
            if img.pixels.len() != c * s * s {
                candle_core::bail!("image pixels of shape {:?} do not match", img.shape);
            }
            // patches row-major, each channel-first like the convolution's weight
            for py in 0..side {
                for px in 0..side {
                    for ch in 0..c {
                        for y in 0..p {
                            let at = ch * s * s + (py * p + y) * s + px * p;
                            rows.extend_from_slice(&img.pixels[at..at + p]);
                        }
                    }
                }
            }
        }
        let n = images.len();
        let patches = Tensor::from_vec(rows, (n * side * side, row), dev)?;
        let h = self.vision.forward(&patches, n)?; // [n, side^2 + 1, hidden]
        let h = if self.keep_cls {
            h
        } else {
            h.narrow(1, 1, side * side)?
        };
        let per = h.dim(1)?;
        let h = h.reshape((n * per, cfg.hidden_size))?;
        let ctx = LayerCtx::default();
        let y = self.linear_1.forward(&h, &ctx)?.gelu_erf()?;
        let y = self.linear_2.forward(&y, &ctx)?;
        (0..n).map(|i| y.narrow(0, i * per, per)).collect()
    }
}
