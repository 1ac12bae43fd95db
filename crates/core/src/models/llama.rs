//! `LlamaForCausalLM` (Llama 2, 3, 3.1, 3.2): optional attention/MLP biases, GQA/MQA, tied or
//! untied embeddings, explicit `head_dim`, `linear` and `llama3` rope scaling.

use super::{DecoderConfig, HfConfig};
use crate::load_error::LoadError;

pub fn config(c: &HfConfig) -> Result<DecoderConfig, LoadError> {
    let mut d = c.base_decoder("LlamaForCausalLM")?;
    let bias = c.attention_bias.unwrap_or(false);
    d.qkv_bias = bias;
    d.o_bias = bias;
    d.mlp_bias = c.mlp_bias.unwrap_or(false);
    d.rms_norm_eps = c.rms_norm_eps.unwrap_or(1e-6);
    Ok(d)
}
