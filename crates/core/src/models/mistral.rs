//! `MistralForCausalLM`: Llama's stack with sliding-window attention on every layer when
//! `sliding_window` is set.

use super::{DecoderConfig, HfConfig};
use crate::load_error::LoadError;

pub fn config(c: &HfConfig) -> Result<DecoderConfig, LoadError> {
    let mut d = c.base_decoder("MistralForCausalLM")?;
    d.sliding_window = vec![c.sliding_window_size(); d.num_layers];
    Ok(d)
}
