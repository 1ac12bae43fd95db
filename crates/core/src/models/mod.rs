//! Model architectures: the [`Model`] trait the runner calls, and the registry that picks an
//! architecture from `config.json`'s `architectures`. Each architecture is a thin file that maps
//! its config onto the shared decoder in `layers/`.

pub mod hf_config;
pub mod layers;
pub mod llama;
pub mod mistral;
pub mod qwen2;
pub mod qwen3;

use crate::kv_cache::KvCache;
use crate::loader::LoadError;
use crate::model_runner::ForwardBatch;
use candle_core::{Result, Tensor};
pub use hf_config::HfConfig;
pub use layers::decoder::{Decoder, DecoderConfig};

/// A loaded model that computes logits for a flattened batch over the paged cache.
pub trait Model: Send {
    fn config(&self) -> &DecoderConfig;
    /// Runs every token of `batch`, writing K/V into `kv`; returns f32 logits
    /// `[batch.logits_indices.len(), vocab]` for the selected rows.
    fn forward(&self, batch: &ForwardBatch, kv: &KvCache) -> Result<Tensor>;
    /// [`Model::forward`] with the logits written into the first rows of `logits` (contiguous
    /// f32, such as a buffer a CUDA graph owns).
    fn forward_into(&self, batch: &ForwardBatch, kv: &KvCache, logits: &Tensor) -> Result<()> {
        logits.slice_set(&self.forward(batch, kv)?, 0, 0)
    }
}

/// An architecture: its `architectures` name and how to read its config.
pub struct Architecture {
    pub name: &'static str,
    pub config: fn(&HfConfig) -> std::result::Result<DecoderConfig, LoadError>,
}

/// Every supported architecture.
pub const REGISTRY: &[Architecture] = &[
    Architecture {
        name: "LlamaForCausalLM",
        config: llama::config,
    },
    Architecture {
        name: "MistralForCausalLM",
        config: mistral::config,
    },
    Architecture {
        name: "Qwen2ForCausalLM",
        config: qwen2::config,
    },
    Architecture {
        name: "Qwen3ForCausalLM",
        config: qwen3::config,
    },
];

/// Names of the supported architectures, for error messages.
pub fn supported() -> Vec<&'static str> {
    REGISTRY.iter().map(|a| a.name).collect()
}

/// Normalises a parsed `config.json` through its architecture's mapping.
pub fn decoder_config(cfg: &HfConfig) -> std::result::Result<DecoderConfig, LoadError> {
    let names = cfg.architectures.clone().unwrap_or_default();
    for n in &names {
        if let Some(a) = REGISTRY.iter().find(|a| a.name == n) {
            return (a.config)(cfg);
        }
    }
    Err(LoadError::UnsupportedArchitecture {
        found: names,
        supported: supported().into_iter().map(String::from).collect(),
    })
}
