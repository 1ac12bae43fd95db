//! The fields of a Hugging Face `config.json` that Llama-family architectures use, all optional,
//! with the common defaults and the mapping onto [`DecoderConfig`] that architectures refine.
//! Understands both the legacy `rope_theta` + `rope_scaling` and the newer `rope_parameters`.

use super::layers::decoder::DecoderConfig;
use super::layers::rotary::{RopeConfig, RopeScaling};
use crate::load_error::LoadError;
use serde::Deserialize;
use serde_json::Value;

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct HfConfig {
    pub architectures: Option<Vec<String>>,
    pub model_type: Option<String>,
    pub vocab_size: Option<usize>,
    pub hidden_size: Option<usize>,
    pub intermediate_size: Option<usize>,
    pub num_hidden_layers: Option<usize>,
    pub num_attention_heads: Option<usize>,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub rms_norm_eps: Option<f64>,
    pub rope_theta: Option<f64>,
    pub rope_scaling: Option<Value>,
    pub rope_parameters: Option<Value>,
    pub max_position_embeddings: Option<usize>,
    pub tie_word_embeddings: Option<bool>,
    pub attention_bias: Option<bool>,
    pub mlp_bias: Option<bool>,
    pub hidden_act: Option<String>,
    pub sliding_window: Option<Value>,
    pub use_sliding_window: Option<bool>,
    pub max_window_layers: Option<usize>,
    pub layer_types: Option<Vec<String>>,
    pub torch_dtype: Option<String>,
    pub dtype: Option<String>,
    pub bos_token_id: Option<Value>,
    pub eos_token_id: Option<Value>,
    /// Per-frequency divisors of the rotary frequencies, as a GGUF file stores Llama 3.1's
    /// scaling (`rope_freqs.weight`); never in `config.json`.
    #[serde(skip)]
    pub rope_freq_factors: Option<Vec<f32>>,
    /// A multimodal model's language model, when its fields are nested (transformers 5's
    /// layout); [`HfConfig::text`] folds it into the top level.
    pub text_config: Option<Value>,
    /// A multimodal model's vision tower, read by its architecture.
    pub vision_config: Option<Value>,
    /// The placeholder token of one image patch group (Qwen2-VL's `<|image_pad|>`).
    pub image_token_id: Option<u32>,
    /// LLaVA's name for the placeholder token.
    pub image_token_index: Option<u32>,
    /// LLaVA: the tower block whose hidden states are read (negative: from the end).
    pub vision_feature_layer: Option<Value>,
    /// LLaVA: `default` drops the class token, `full` keeps it.
    pub vision_feature_select_strategy: Option<String>,
    pub projector_hidden_act: Option<String>,
    pub multimodal_projector_bias: Option<bool>,
}

fn bad(field: &str, reason: impl Into<String>) -> LoadError {
    LoadError::Config {
        field: field.to_string(),
        reason: reason.into(),
    }
}

fn req(v: Option<usize>, field: &str) -> Result<usize, LoadError> {
    match v {
        Some(0) => Err(bad(field, "must be positive")),
        Some(x) => Ok(x),
        None => Err(bad(field, "missing")),
    }
}

fn num(v: &Value, key: &str) -> Option<f32> {
    v.get(key).and_then(Value::as_f64).map(|x| x as f32)
}

impl HfConfig {
    /// The config with a nested `text_config`'s fields at the top level (where the top level
    /// does not set them), as published checkpoints of multimodal models also write them.
    pub fn text(&self) -> Result<HfConfig, LoadError> {
        let Some(Value::Object(text)) = &self.text_config else {
            return Ok(self.clone());
        };
        let mut inner: HfConfig = serde_json::from_value(Value::Object(text.clone()))
            .map_err(|e| bad("text_config", e.to_string()))?;
        macro_rules! keep {
            ($($f:ident),*) => { $( if self.$f.is_some() { inner.$f = self.$f.clone(); } )* };
        }
        keep!(
            architectures,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            rope_parameters,
            max_position_embeddings,
            tie_word_embeddings,
            torch_dtype,
            dtype,
            bos_token_id,
            eos_token_id,
            vision_config,
            image_token_id,
            image_token_index
        );
        inner.text_config = None;
        Ok(inner)
    }

    /// Qwen2-VL's M-RoPE: how many rotary frequencies follow the temporal, height and width
    /// positions (`mrope_section` of `rope_scaling` or `rope_parameters`).
    pub fn mrope_section(&self) -> Result<Option<[usize; 3]>, LoadError> {
        let params = [&self.rope_parameters, &self.rope_scaling];
        let Some(v) = params
            .into_iter()
            .flatten()
            .find_map(|p| p.get("mrope_section"))
        else {
            return Ok(None);
        };
        let s: Vec<usize> = serde_json::from_value(v.clone())
            .map_err(|e| bad("rope_scaling.mrope_section", e.to_string()))?;
        match s[..] {
            [t, h, w] => Ok(Some([t, h, w])),
            _ => Err(bad("rope_scaling.mrope_section", "needs three sizes")),
        }
    }

    /// The checkpoint's dtype name (`torch_dtype` or `dtype`), if any.
    pub fn dtype_name(&self) -> Option<&str> {
        self.dtype.as_deref().or(self.torch_dtype.as_deref())
    }

    /// The sliding window size if set to a number.
    pub fn sliding_window_size(&self) -> Option<usize> {
        self.sliding_window
            .as_ref()
            .and_then(Value::as_u64)
            .map(|x| x as usize)
    }

    fn rope(&self) -> Result<RopeConfig, LoadError> {
        let params = self.rope_parameters.as_ref().filter(|v| v.is_object());
        let scaling = params.or(self.rope_scaling.as_ref().filter(|v| v.is_object()));
        let theta = params
            .and_then(|p| num(p, "rope_theta"))
            .or(self.rope_theta.map(|t| t as f32))
            .unwrap_or(10000.0);
        let kind = scaling
            .and_then(|s| s.get("rope_type").or_else(|| s.get("type")))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let get = |k: &str| -> Result<f32, LoadError> {
            scaling
                .and_then(|s| num(s, k))
                .ok_or_else(|| bad(&format!("rope_scaling.{k}"), "missing"))
        };
        let scaling = match kind {
            _ if self.rope_freq_factors.is_some() => {
                RopeScaling::Factors(self.rope_freq_factors.clone().unwrap_or_default())
            }
            "default" | "mrope" => RopeScaling::None,
            "linear" => RopeScaling::Linear {
                factor: get("factor")?,
            },
            "llama3" => RopeScaling::Llama3 {
                factor: get("factor")?,
                low_freq_factor: get("low_freq_factor")?,
                high_freq_factor: get("high_freq_factor")?,
                original_max_position_embeddings: get("original_max_position_embeddings")?,
            },
            other => {
                return Err(bad(
                    "rope_scaling.rope_type",
                    format!("`{other}` is not supported (default, linear, llama3)"),
                ))
            }
        };
        Ok(RopeConfig { theta, scaling })
    }

    /// The fields every Llama-family model shares; architectures adjust the rest.
    pub fn base_decoder(&self, architecture: &str) -> Result<DecoderConfig, LoadError> {
        if let Some(act) = &self.hidden_act {
            if act != "silu" {
                return Err(bad(
                    "hidden_act",
                    format!("`{act}` is not supported (silu)"),
                ));
            }
        }
        let hidden_size = req(self.hidden_size, "hidden_size")?;
        let num_heads = req(self.num_attention_heads, "num_attention_heads")?;
        let num_kv_heads = req(
            self.num_key_value_heads.or(Some(num_heads)),
            "num_key_value_heads",
        )?;
        if num_heads % num_kv_heads != 0 {
            return Err(bad(
                "num_key_value_heads",
                format!("{num_kv_heads} does not divide {num_heads} heads"),
            ));
        }
        let head_dim = match self.head_dim {
            Some(d) => req(Some(d), "head_dim")?,
            None if hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => {
                return Err(bad(
                    "head_dim",
                    "missing and hidden_size is not a multiple of the heads",
                ))
            }
        };
        if head_dim % 2 != 0 {
            return Err(bad("head_dim", "must be even for rotary embeddings"));
        }
        let num_layers = req(self.num_hidden_layers, "num_hidden_layers")?;
        Ok(DecoderConfig {
            architecture: architecture.to_string(),
            vocab_size: req(self.vocab_size, "vocab_size")?,
            hidden_size,
            intermediate_size: req(self.intermediate_size, "intermediate_size")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: self.rms_norm_eps.unwrap_or(1e-6),
            rope: self.rope()?,
            max_position_embeddings: self.max_position_embeddings.unwrap_or(4096),
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(false),
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            qk_norm: false,
            sliding_window: vec![None; num_layers],
            mrope_section: None,
        })
    }
}
