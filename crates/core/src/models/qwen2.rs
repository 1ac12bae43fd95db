//! `Qwen2ForCausalLM` (Qwen2, Qwen2.5): biases on q/k/v (not o), usually tied embeddings; sliding
//! windows only when `use_sliding_window` is set, on the layers `layer_types` (or
//! `max_window_layers`) marks.

use super::{DecoderConfig, HfConfig};
use crate::load_error::LoadError;

/// Per-layer windows as transformers assigns them for Qwen-family configs.
pub fn qwen_windows(c: &HfConfig, num_layers: usize) -> Vec<Option<usize>> {
    let window = c.sliding_window_size();
    if let Some(types) = &c.layer_types {
        return (0..num_layers)
            .map(|i| match types.get(i).map(String::as_str) {
                Some("sliding_attention") => window,
                _ => None,
            })
            .collect();
    }
    if !c.use_sliding_window.unwrap_or(false) {
        return vec![None; num_layers];
    }
    let first = c.max_window_layers.unwrap_or(num_layers);
    (0..num_layers)
        .map(|i| if i >= first { window } else { None })
        .collect()
}

pub fn config(c: &HfConfig) -> Result<DecoderConfig, LoadError> {
    let mut d = c.base_decoder("Qwen2ForCausalLM")?;
    d.qkv_bias = true;
    d.sliding_window = qwen_windows(c, d.num_layers);
    Ok(d)
}
