//! `Qwen3ForCausalLM`: per-head RMSNorm on queries and keys before rotary, `head_dim` independent
//! of hidden size and heads, optional attention bias.

use super::qwen2::qwen_windows;
use super::{DecoderConfig, HfConfig};
use crate::load_error::LoadError;

pub fn config(c: &HfConfig) -> Result<DecoderConfig, LoadError> {
    let mut d = c.base_decoder("Qwen3ForCausalLM")?;
    let bias = c.attention_bias.unwrap_or(false);
    d.qkv_bias = bias;
    d.o_bias = bias;
    d.qk_norm = true;
    d.sliding_window = qwen_windows(c, d.num_layers);
    Ok(d)
}
