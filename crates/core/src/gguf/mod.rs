//! Pre-quantized GGUF checkpoints (llama.cpp's single-file format) for the Llama (and Mistral,
//! which llama.cpp files as `llama`), Qwen2 and Qwen3 architectures.
//!
//! - [`file`]: the container: metadata, tensor directory, bytes from a memory map.
//! - This module: the model's config from the metadata (as a [`HfConfig`], so one decoder
//!   serves both layouts), the tensor names, llama.cpp's row order of Llama's q/k projections,
//!   generation defaults and the chat template.
//! - [`tokenizer`]: a Hugging Face tokenizer rebuilt from `tokenizer.ggml.*`.
//!
//! Tensors keep the GGML type they are stored in: the decoder's projections are served by the
//! quantized kernels as they are, norms and embeddings are dequantized once at load.

pub mod file;
pub mod tokenizer;

use crate::load_error::LoadError;
use crate::loader::GenerationDefaults;
use crate::models::HfConfig;
pub use file::{is_gguf, GgufError, GgufFile, SharedBytes, TensorInfo, Value};
use serde_json::json;

/// `general.architecture` values rserve serves, with the Hugging Face architecture each maps to.
pub const ARCHITECTURES: &[(&str, &str)] = &[
    ("llama", "LlamaForCausalLM"),
    ("qwen2", "Qwen2ForCausalLM"),
    ("qwen3", "Qwen3ForCausalLM"),
];

fn bad(g: &GgufFile, reason: impl Into<String>) -> LoadError {
    LoadError::Gguf {
        file: g.path.clone(),
        reason: reason.into(),
    }
}

/// The file's `general.architecture`.
pub fn architecture(g: &GgufFile) -> Result<&str, LoadError> {
    let arch = g
        .meta("general.architecture")
        .and_then(Value::as_str)
        .ok_or_else(|| bad(g, "no `general.architecture` in the metadata"))?;
    if !ARCHITECTURES.iter().any(|(a, _)| *a == arch) {
        let names: Vec<&str> = ARCHITECTURES.iter().map(|(a, _)| *a).collect();
        return Err(bad(
            g,
            format!(
                "architecture `{arch}` is not supported (GGUF architectures: {})",
                names.join(", ")
            ),
        ));
    }
    Ok(arch)
}

/// The model's config from the metadata, as `config.json` would give it.
pub fn hf_config(g: &GgufFile) -> Result<HfConfig, LoadError> {
    let arch = architecture(g)?;
    let hf_arch = ARCHITECTURES
        .iter()
        .find(|(a, _)| *a == arch)
        .map(|(_, h)| *h)
        .unwrap_or_default();
    let key = |k: &str| format!("{arch}.{k}");
    let uint = |k: &str| -> Result<Option<usize>, LoadError> {
        match g.meta(&key(k)) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| bad(g, format!("`{}` is not a count: {v:?}", key(k)))),
        }
    };
    let float = |k: &str| g.meta(&key(k)).and_then(Value::as_f64);
    let need = |k: &str| -> Result<usize, LoadError> {
        uint(k)?.ok_or_else(|| bad(g, format!("no `{}` in the metadata", key(k))))
    };
    let vocab_size = match g.meta("tokenizer.ggml.tokens") {
        Some(Value::Strs(t)) => t.len(),
        _ => g
            .header
            .tensors
            .get("token_embd.weight")
            .and_then(|t| t.dims.get(1).copied())
            .ok_or_else(|| bad(g, "neither `tokenizer.ggml.tokens` nor `token_embd.weight`"))?,
    };
    let rope_scaling = match g.meta(&key("rope.scaling.type")).and_then(Value::as_str) {
        None | Some("none") => None,
        Some("linear") => Some(json!({
            "rope_type": "linear",
            "factor": float("rope.scaling.factor").unwrap_or(1.0),
        })),
        Some(other) => {
            return Err(bad(
                g,
                format!("rope scaling `{other}` is not supported (none, linear)"),
            ))
        }
    };
    let rope_freq_factors = match g.tensor("rope_freqs.weight") {
        None => None,
        Some((t, bytes)) if t.dtype == candle_core::quantized::GgmlDType::F32 => Some(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        ),
        Some((t, _)) => {
            return Err(bad(
                g,
                format!("`rope_freqs.weight` is {:?}, expected f32", t.dtype),
            ))
        }
    };
    let sliding = uint("attention.sliding_window")?;
    Ok(HfConfig {
        architectures: Some(vec![hf_arch.to_string()]),
        model_type: Some(arch.to_string()),
        vocab_size: Some(vocab_size),
        hidden_size: Some(need("embedding_length")?),
        intermediate_size: Some(need("feed_forward_length")?),
        num_hidden_layers: Some(need("block_count")?),
        num_attention_heads: Some(need("attention.head_count")?),
        num_key_value_heads: uint("attention.head_count_kv")?,
        head_dim: uint("attention.key_length")?,
        rms_norm_eps: float("attention.layer_norm_rms_epsilon"),
        rope_theta: float("rope.freq_base"),
        rope_scaling,
        max_position_embeddings: uint("context_length")?,
        tie_word_embeddings: Some(!g.header.tensors.contains_key("output.weight")),
        sliding_window: sliding.map(|w| json!(w)),
        use_sliding_window: sliding.map(|_| true),
        dtype: Some("bfloat16".into()),
        rope_freq_factors,
        ..HfConfig::default()
    })
}

/// The GGUF name of a tensor rserve asks for by its Hugging Face name.
pub fn tensor_name(hf: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, suffix) = rest.rsplit_once('.')?;
    let part = match module {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{part}.{suffix}"))
}

/// llama.cpp stores Llama's q and k projections with each head's rotary halves interleaved
/// (its rotary pairs neighbours; Hugging Face's pairs halves). For a tensor with `rows` rows
/// of `heads` heads, the file row holding Hugging Face row `r`: `order[r]`.
pub fn unpermuted_rows(rows: usize, heads: usize) -> Option<Vec<usize>> {
    if heads == 0 || !rows.is_multiple_of(heads) || !(rows / heads).is_multiple_of(2) {
        return None;
    }
    let hd = rows / heads;
    let half = hd / 2;
    Some(
        (0..rows)
            .map(|r| {
                let (h, within) = (r / hd, r % hd);
                let (j, i) = (within / half, within % half);
                h * hd + 2 * i + j
            })
            .collect(),
    )
}

/// Heads a tensor's rows are permuted over in the file, if any (Llama's q and k).
pub fn permuted_heads(g: &GgufFile, gguf_name: &str) -> Option<usize> {
    if g.meta("general.architecture").and_then(Value::as_str) != Some("llama") {
        return None;
    }
    let heads = |k: &str| {
        g.meta(&format!("llama.attention.{k}"))
            .and_then(Value::as_u64)
            .and_then(|v| usize::try_from(v).ok())
    };
    let q = heads("head_count")?;
    if gguf_name.contains(".attn_q.") {
        Some(q)
    } else if gguf_name.contains(".attn_k.") {
        heads("head_count_kv").or(Some(q))
    } else {
        None
    }
}

/// Generation defaults from the metadata: end-of-sequence (and end-of-turn) ids and the BOS.
pub fn generation_defaults(g: &GgufFile, vocab_size: usize) -> GenerationDefaults {
    let id = |k: &str| {
        g.meta(&format!("tokenizer.ggml.{k}"))
            .and_then(Value::as_u64)
            .filter(|&v| (v as u128) < vocab_size as u128)
            .map(|v| v as u32)
    };
    let mut eos: Vec<u32> = ["eos_token_id", "eot_token_id", "eom_token_id"]
        .iter()
        .filter_map(|k| id(k))
        .collect();
    eos.dedup();
    GenerationDefaults {
        eos_token_ids: eos,
        bos_token_id: id("bos_token_id"),
        ..GenerationDefaults::default()
    }
}

/// The chat template, BOS and EOS strings from the metadata.
pub fn chat_template(g: &GgufFile) -> (Option<String>, Option<String>, Option<String>) {
    let tokens = match g.meta("tokenizer.ggml.tokens") {
        Some(Value::Strs(t)) => Some(t),
        _ => None,
    };
    let token = |k: &str| {
        let id = g.meta(&format!("tokenizer.ggml.{k}"))?.as_u64()?;
        tokens?.get(usize::try_from(id).ok()?).cloned()
    };
    let template = g
        .meta("tokenizer.chat_template")
        .and_then(Value::as_str)
        .map(String::from);
    (template, token("bos_token_id"), token("eos_token_id"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_onto_llama_cpp_names() {
        assert_eq!(
            tensor_name("model.layers.3.self_attn.q_proj.weight").as_deref(),
            Some("blk.3.attn_q.weight")
        );
        assert_eq!(
            tensor_name("model.layers.0.self_attn.k_proj.bias").as_deref(),
            Some("blk.0.attn_k.bias")
        );
        assert_eq!(
            tensor_name("model.layers.11.mlp.down_proj.weight").as_deref(),
            Some("blk.11.ffn_down.weight")
        );
        assert_eq!(
            tensor_name("model.embed_tokens.weight").as_deref(),
            Some("token_embd.weight")
        );
        assert_eq!(tensor_name("model.layers.0.mystery.weight"), None);
    }

    /// The inverse of the converter's permutation: reshape each head's rows `(2, hd / 2)`,
    /// swap the two axes.
    #[test]
    fn llama_rows_are_unpermuted() {
        let order = unpermuted_rows(8, 2).expect("fits");
        // head_dim 4: HF rows (0,1 | 2,3) are file rows (0,2 | 1,3)
        assert_eq!(order, vec![0, 2, 1, 3, 4, 6, 5, 7]);
        // the converter's permutation, applied to HF rows, then undone
        let hf: Vec<usize> = (0..8).collect();
        let mut file = [0; 8];
        for (r, &f) in order.iter().enumerate() {
            file[f] = hf[r];
        }
        let back: Vec<usize> = order.iter().map(|&f| file[f]).collect();
        assert_eq!(back, hf);
        assert!(unpermuted_rows(6, 4).is_none());
    }
}
