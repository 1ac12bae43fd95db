//! The embedded default model: a tiny Llama-architecture model that rserve builds itself, so that
//! `rserve` runs offline with no model given. Its tokenizer (a small byte-level BPE) and chat
//! template ship inside the binary; its weights are seeded random values written once to a cache
//! directory and then loaded through the normal loader. It produces fluent-looking nonsense: it
//! exists to exercise the whole serving path, not to answer questions.

use crate::load_error::LoadError;
use crate::sampler::SeqRng;
use candle_core::{Device, Tensor};
use serde_json::json;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The name the default model is served under.
pub const DEFAULT_MODEL_NAME: &str = "rserve-tiny";
const TOKENIZER: &str = include_str!("../assets/tokenizer.json");
const CHAT_TEMPLATE: &str = include_str!("../assets/chat_template.jinja");
const VERSION: &str = "v1";

const HIDDEN: usize = 128;
const INTERMEDIATE: usize = 384;
const LAYERS: usize = 4;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const MAX_POS: usize = 2048;

fn vocab_size() -> Result<usize, LoadError> {
    let t = crate::tokenizer::Tokenizer::from_bytes(TOKENIZER.as_bytes())
        .map_err(|e| LoadError::Tokenizer(e.to_string()))?;
    Ok(t.vocab_size())
}

/// Where the default model lives: `$RSERVE_CACHE` or `~/.cache/rserve`, then `rserve-tiny-v1`.
pub fn default_model_dir() -> PathBuf {
    let base = std::env::var_os("RSERVE_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|p| PathBuf::from(p).join("rserve")))
        .or_else(|| {
            std::env::var_os("HOME").map(|p| PathBuf::from(p).join(".cache").join("rserve"))
        })
        .unwrap_or_else(|| std::env::temp_dir().join("rserve"));
    base.join(format!("{DEFAULT_MODEL_NAME}-{VERSION}"))
}

fn io(file: &Path, e: impl std::fmt::Display) -> LoadError {
    LoadError::Io {
        file: file.to_path_buf(),
        reason: e.to_string(),
    }
}

fn random(rng: &mut SeqRng, shape: &[usize], scale: f32, offset: f32) -> Result<Tensor, LoadError> {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n)
        .map(|_| offset + scale * (2.0 * rng.next_f32() - 1.0))
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).map_err(|e| LoadError::Tensor {
        name: "default model".into(),
        reason: e.to_string(),
    })
}

/// Writes the default model into `dir` (config, tokenizer, template, seeded weights).
pub fn write_default_model(dir: &Path) -> Result<(), LoadError> {
    let vocab = vocab_size()?;
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let head_dim = HIDDEN / HEADS;
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": true,
        "bos_token_id": 0,
        "eos_token_id": [1, 6],
        "torch_dtype": "float32",
    });
    let files: [(&str, String); 4] = [
        ("config.json", config.to_string()),
        ("tokenizer.json", TOKENIZER.to_string()),
        ("chat_template.jinja", CHAT_TEMPLATE.to_string()),
        (
            "tokenizer_config.json",
            json!({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "tokenizer_class": "PreTrainedTokenizerFast"}).to_string(),
        ),
    ];
    for (name, text) in files {
        let p = dir.join(name);
        std::fs::write(&p, text).map_err(|e| io(&p, e))?;
    }
    let gen = dir.join("generation_config.json");
    std::fs::write(
        &gen,
        json!({"bos_token_id": 0, "eos_token_id": [1, 6]}).to_string(),
    )
    .map_err(|e| io(&gen, e))?;
    let mut rng = SeqRng::new(0x5eed);
    let mut t: HashMap<String, Tensor> = HashMap::new();
    t.insert(
        "model.embed_tokens.weight".into(),
        random(&mut rng, &[vocab, HIDDEN], 0.5, 0.0)?,
    );
    t.insert(
        "model.norm.weight".into(),
        random(&mut rng, &[HIDDEN], 0.1, 1.0)?,
    );
    let mat = 1.0 / (HIDDEN as f32).sqrt();
    for i in 0..LAYERS {
        let p = |n: &str| format!("model.layers.{i}.{n}");
        let shapes: [(&str, Vec<usize>, f32); 7] = [
            (
                "self_attn.q_proj.weight",
                vec![HEADS * head_dim, HIDDEN],
                mat,
            ),
            (
                "self_attn.k_proj.weight",
                vec![KV_HEADS * head_dim, HIDDEN],
                mat,
            ),
            (
                "self_attn.v_proj.weight",
                vec![KV_HEADS * head_dim, HIDDEN],
                mat,
            ),
            (
                "self_attn.o_proj.weight",
                vec![HIDDEN, HEADS * head_dim],
                mat,
            ),
            ("mlp.gate_proj.weight", vec![INTERMEDIATE, HIDDEN], mat),
            ("mlp.up_proj.weight", vec![INTERMEDIATE, HIDDEN], mat),
            (
                "mlp.down_proj.weight",
                vec![HIDDEN, INTERMEDIATE],
                1.0 / (INTERMEDIATE as f32).sqrt(),
            ),
        ];
        for (name, shape, scale) in shapes {
            t.insert(p(name), random(&mut rng, &shape, scale * 1.7, 0.0)?);
        }
        t.insert(
            p("input_layernorm.weight"),
            random(&mut rng, &[HIDDEN], 0.1, 1.0)?,
        );
        t.insert(
            p("post_attention_layernorm.weight"),
            random(&mut rng, &[HIDDEN], 0.1, 1.0)?,
        );
    }
    let tmp = dir.join("model.safetensors.partial");
    candle_core::safetensors::save(&t, &tmp).map_err(|e| io(&tmp, e))?;
    let fin = dir.join("model.safetensors");
    std::fs::rename(&tmp, &fin).map_err(|e| io(&fin, e))
}

/// The default model's directory, written first if it is missing or incomplete.
pub fn ensure_default_model() -> Result<PathBuf, LoadError> {
    let dir = default_model_dir();
    if !dir.join("model.safetensors").is_file() || !dir.join("config.json").is_file() {
        write_default_model(&dir)?;
    }
    Ok(dir)
}
