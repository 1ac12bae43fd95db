//! Model architectures: the [`Model`] trait the runner calls, and the registry that picks an
//! architecture from `config.json`'s `architectures`. Each architecture is a thin file that maps
//! its config onto the shared decoder in `layers/`.

pub mod clip_vision;
pub mod hf_config;
pub mod layers;
pub mod llama;
pub mod llava;
pub mod mistral;
pub mod qwen2;
pub mod qwen2_5_vl;
pub mod qwen2_5_vl_vision;
pub mod qwen3;

use crate::batch::ForwardBatch;
use crate::kv_cache::KvCache;
use crate::load_error::LoadError;
use crate::multimodal::{ImageInput, Processor};
use crate::weights::Weights;
use candle_core::{Result, Tensor};
pub use hf_config::HfConfig;
pub use layers::decoder::{Decoder, DecoderConfig};
use std::path::Path;

/// A loaded model that computes logits for a flattened batch over the paged cache.
pub trait Model: Send {
    fn config(&self) -> &DecoderConfig;
    /// Positions the model can encode (its rotary table's length); the runner checks every
    /// step's positions against it.
    fn max_positions(&self) -> usize;
    /// KV heads this model's cache holds (a tensor-parallel shard holds its own share).
    fn cache_kv_heads(&self) -> usize {
        self.config().num_kv_heads
    }
    /// The input embeddings of `input_ids` `[T]`: `[T, hidden]`. A model with other inputs
    /// (image features) writes them into these rows before [`Model::forward_embeds`].
    fn embed(&self, input_ids: &Tensor) -> Result<Tensor>;
    /// Runs every token of `batch` from its input embeddings `[T, hidden]`, writing K/V into
    /// `kv`; returns f32 logits `[batch.logits_indices.len(), vocab]` for the selected rows.
    fn forward_embeds(&self, embeds: &Tensor, batch: &ForwardBatch, kv: &KvCache)
        -> Result<Tensor>;
    /// [`Model::forward_embeds`] of the embeddings of `batch.input_ids`, with the image
    /// features of `batch.image_rows` written over their placeholder rows.
    fn forward(&self, batch: &ForwardBatch, kv: &KvCache) -> Result<Tensor> {
        let embeds = self.embed(&batch.input_ids)?;
        for (row, feats) in &batch.image_rows {
            embeds.slice_set(&feats.to_dtype(embeds.dtype())?, 0, *row)?;
        }
        self.forward_embeds(&embeds, batch, kv)
    }
    /// Runs the vision encoder over `images` (batched): per image, the `[num_tokens, hidden]`
    /// features its placeholder rows take.
    fn encode_images(&self, images: &[&ImageInput]) -> Result<Vec<Tensor>> {
        let _ = images;
        candle_core::bail!("this model takes no images")
    }
    /// [`Model::forward`] with the logits written into the first rows of `logits` (contiguous
    /// f32, such as a buffer a CUDA graph owns).
    fn forward_into(&self, batch: &ForwardBatch, kv: &KvCache, logits: &Tensor) -> Result<()> {
        logits.slice_set(&self.forward(batch, kv)?, 0, 0)
    }
    /// Per layer, the FP8 KV-cache scales the checkpoint gives (`None`: unit scales).
    fn kv_cache_scales(&self) -> Vec<Option<rserve_kernels::CacheScales>> {
        Vec::new()
    }
    /// Writes rank 0's token ids `ids` over every rank's (a tensor-parallel step whose tokens
    /// rank 0 sampled on its device); nothing to do on one device.
    fn share_token_ids(&self, ids: &Tensor) -> Result<()> {
        let _ = ids;
        Ok(())
    }
}

/// A vision encoder in front of the shared decoder: per image, the `[num_tokens, hidden]`
/// features its placeholder rows take, computed on `dev`.
pub trait ImageEncoder: Send {
    fn encode(&self, images: &[&ImageInput], dev: &candle_core::Device) -> Result<Vec<Tensor>>;
}

/// A vision-language model: the shared decoder and an [`ImageEncoder`]; everything but the
/// images is the decoder's.
pub struct WithVision<E> {
    pub decoder: Decoder,
    pub encoder: E,
}

impl<E: ImageEncoder> Model for WithVision<E> {
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

    fn share_token_ids(&self, ids: &Tensor) -> Result<()> {
        self.decoder.share_token_ids(ids)
    }

    fn encode_images(&self, images: &[&ImageInput]) -> Result<Vec<Tensor>> {
        if images.is_empty() {
            return Ok(Vec::new());
        }
        self.encoder.encode(images, self.decoder.device())
    }
}

/// A vision model's `preprocessor_config.json` (`Null` when the directory has none).
pub fn read_preprocessor_config(dir: &Path) -> std::result::Result<serde_json::Value, LoadError> {
    let path = dir.join("preprocessor_config.json");
    if !path.is_file() {
        return Ok(serde_json::Value::Null);
    }
    let text = std::fs::read_to_string(&path).map_err(|e| LoadError::Io {
        file: path.clone(),
        reason: e.to_string(),
    })?;
    serde_json::from_str(&text).map_err(|e| LoadError::Json {
        file: path,
        reason: e.to_string(),
    })
}

/// How an architecture builds its model from its config, the weights and the number of positions
/// to support. A plain decoder uses [`build_decoder`]; an architecture that is not one (a vision
/// encoder in front, another layout) brings its own.
pub type BuildFn =
    fn(&HfConfig, DecoderConfig, &Weights, usize) -> std::result::Result<Box<dyn Model>, LoadError>;

/// How a vision architecture's images are preprocessed, from its config and directory.
pub type ProcessorFn = fn(&HfConfig, &Path) -> std::result::Result<Processor, LoadError>;

/// An architecture: its `architectures` name, how to read its config and how to build it.
pub struct Architecture {
    pub name: &'static str,
    pub config: fn(&HfConfig) -> std::result::Result<DecoderConfig, LoadError>,
    pub build: BuildFn,
    /// Vision models only.
    pub processor: Option<ProcessorFn>,
}

/// The shared decoder stack.
pub fn build_decoder(
    _: &HfConfig,
    cfg: DecoderConfig,
    w: &Weights,
    max_positions: usize,
) -> std::result::Result<Box<dyn Model>, LoadError> {
    Ok(Box::new(Decoder::load(cfg, w, max_positions)?))
}

/// Every supported architecture.
pub const REGISTRY: &[Architecture] = &[
    Architecture {
        name: "LlamaForCausalLM",
        config: llama::config,
        build: build_decoder,
        processor: None,
    },
    Architecture {
        name: "MistralForCausalLM",
        config: mistral::config,
        build: build_decoder,
        processor: None,
    },
    Architecture {
        name: "Qwen2ForCausalLM",
        config: qwen2::config,
        build: build_decoder,
        processor: None,
    },
    Architecture {
        name: "Qwen3ForCausalLM",
        config: qwen3::config,
        build: build_decoder,
        processor: None,
    },
    Architecture {
        name: "LlavaForConditionalGeneration",
        config: llava::config,
        build: llava::build,
        processor: Some(llava::processor),
    },
    Architecture {
        name: "Qwen2_5_VLForConditionalGeneration",
        config: qwen2_5_vl::config,
        build: qwen2_5_vl::build,
        processor: Some(qwen2_5_vl::processor),
    },
    Architecture {
        name: "Qwen2VLForConditionalGeneration",
        config: qwen2_5_vl::config,
        build: qwen2_5_vl::build,
        processor: Some(qwen2_5_vl::processor),
    },
];

/// Names of the supported architectures, for error messages.
pub fn supported() -> Vec<&'static str> {
    REGISTRY.iter().map(|a| a.name).collect()
}

/// The architecture `config.json` names.
pub fn architecture(cfg: &HfConfig) -> std::result::Result<&'static Architecture, LoadError> {
    let names = cfg.architectures.clone().unwrap_or_default();
    for n in &names {
        if let Some(a) = REGISTRY.iter().find(|a| a.name == n) {
            return Ok(a);
        }
    }
    Err(LoadError::UnsupportedArchitecture {
        found: names,
        supported: supported().into_iter().map(String::from).collect(),
    })
}

/// Normalises a parsed `config.json` through its architecture's mapping.
pub fn decoder_config(cfg: &HfConfig) -> std::result::Result<DecoderConfig, LoadError> {
    (architecture(cfg)?.config)(cfg)
}

/// Builds the model `config.json` names from `weights`, for `max_positions` positions.
pub fn build(
    cfg: &HfConfig,
    weights: &Weights,
    max_positions: usize,
) -> std::result::Result<Box<dyn Model>, LoadError> {
    let arch = architecture(cfg)?;
    (arch.build)(cfg, (arch.config)(cfg)?, weights, max_positions)
}

/// The image processor of a vision model (`None`: a text-only model).
pub fn processor(cfg: &HfConfig, dir: &Path) -> std::result::Result<Option<Processor>, LoadError> {
    match architecture(cfg)?.processor {
        Some(f) => f(cfg, dir).map(Some),
        None => Ok(None),
    }
}
