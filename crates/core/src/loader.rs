//! Loading a model directory in Hugging Face layout: `config.json`, safetensors weights (one file or
//! shards with `model.safetensors.index.json`, memory-mapped), `tokenizer.json`,
//! `tokenizer_config.json` / `chat_template.jinja` and `generation_config.json`.
//!
//! Every failure is a [`LoadError`] naming the file and the reason; nothing here panics on a bad
//! checkpoint.

use crate::chat_template::{load_chat_template, ChatTemplate};
use crate::gguf::{self, GgufFile};
use crate::lora::{LoraOptions, LoraSlots};
use crate::models::{decoder_config, HfConfig, Model};
use crate::quant::isq::{Isq, IsqReport};
use crate::quant::IsqFormat;
use crate::tokenizer::Tokenizer;
use crate::weights::Weights;
use candle_core::{DType, Device};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use crate::load_error::LoadError;

/// Parses a dtype flag; `auto` follows the checkpoint (`torch_dtype` / `dtype`), defaulting to f32,
/// except on the CPU, where `auto` is f32 (the CPU computes f32 several times faster than bf16).
pub fn parse_dtype_for(
    name: &str,
    checkpoint: Option<&str>,
    device: &Device,
) -> Result<DType, LoadError> {
    if name == "auto" && device.is_cpu() {
        return Ok(DType::F32);
    }
    parse_dtype(name, checkpoint)
}

/// Parses a dtype flag; `auto` follows the checkpoint (`torch_dtype` / `dtype`), defaulting to f32.
pub fn parse_dtype(name: &str, checkpoint: Option<&str>) -> Result<DType, LoadError> {
    let pick = |s: &str| -> Option<DType> {
        match s {
            "float32" | "float" | "f32" | "fp32" => Some(DType::F32),
            "bfloat16" | "bf16" => Some(DType::BF16),
            "float16" | "half" | "f16" | "fp16" => Some(DType::F16),
            _ => None,
        }
    };
    if name == "auto" {
        return Ok(checkpoint.and_then(pick).unwrap_or(DType::F32));
    }
    pick(name).ok_or_else(|| LoadError::Dtype(name.to_string()))
}

/// Reads and parses a JSON file.
pub fn read_json(path: &Path) -> Result<Value, LoadError> {
    let text = std::fs::read_to_string(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => LoadError::MissingFile(path.to_path_buf()),
        _ => LoadError::Io {
            file: path.to_path_buf(),
            reason: e.to_string(),
        },
    })?;
    serde_json::from_str(&text).map_err(|e| LoadError::Json {
        file: path.to_path_buf(),
        reason: e.to_string(),
    })
}

/// The safetensors files of a checkpoint, in shard order.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let v = read_json(&index)?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| LoadError::Json {
                file: index.clone(),
                reason: "no `weight_map` object".into(),
            })?;
        let mut files: Vec<String> = map
            .values()
            .filter_map(Value::as_str)
            .map(String::from)
            .collect();
        files.sort();
        files.dedup();
        if files.iter().any(|f| f.contains('/') || f.contains("..")) {
            return Err(LoadError::Json {
                file: index,
                reason: "shard names must be plain file names".into(),
            });
        }
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let mut shards: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| LoadError::Io {
            file: dir.to_path_buf(),
            reason: e.to_string(),
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    shards.sort();
    if shards.is_empty() {
        return Err(LoadError::MissingFile(single));
    }
    Ok(shards)
}

/// Defaults from `generation_config.json`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationDefaults {
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub repetition_penalty: Option<f32>,
}

/// The generation settings of a checkpoint directory (`generation_config.json`, then `config.json`).
pub fn generation_defaults(
    dir: &Path,
    cfg: &HfConfig,
    vocab_size: usize,
) -> Result<GenerationDefaults, LoadError> {
    let path = dir.join("generation_config.json");
    let v = if path.is_file() {
        read_json(&path)?
    } else {
        Value::Null
    };
    let f = |k: &str| v.get(k).and_then(Value::as_f64).map(|x| x as f32);
    let config = dir.join("config.json");
    // generation_config.json first, config.json where it says nothing
    let ids = |key: &str, own: &Option<Value>| -> Result<Vec<u32>, LoadError> {
        let (file, raw) = match v.get(key).filter(|x| !x.is_null()) {
            Some(x) => (&path, Some(x.clone())),
            None => (&config, own.clone()),
        };
        special_token_ids(raw.as_ref(), vocab_size).map_err(|reason| LoadError::SpecialToken {
            file: file.clone(),
            reason: format!("{key}: {reason}"),
        })
    };
    let eos = ids("eos_token_id", &cfg.eos_token_id)?;
    let bos = ids("bos_token_id", &cfg.bos_token_id)?.first().copied();
    Ok(GenerationDefaults {
        eos_token_ids: eos,
        bos_token_id: bos,
        temperature: f("temperature"),
        top_p: f("top_p"),
        top_k: v.get("top_k").and_then(Value::as_u64).map(|x| x as usize),
        repetition_penalty: f("repetition_penalty"),
    })
}

/// A special-token id field (a number, a list of numbers or null) as ids the model has: each must
/// be a non-negative integer below `vocab_size`.
pub fn special_token_ids(v: Option<&Value>, vocab_size: usize) -> Result<Vec<u32>, String> {
    let items: Vec<&Value> = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a.iter().collect(),
        Some(x) => vec![x],
    };
    items
        .into_iter()
        .map(|x| match x.as_u64() {
            Some(id) if (id as u128) < vocab_size as u128 => Ok(id as u32),
            Some(id) => Err(format!(
                "token id {id} is out of the model's vocabulary (size {vocab_size})"
            )),
            None => Err(format!("{x} is not a token id")),
        })
        .collect()
}

/// Everything loaded from a model directory.
pub struct LoadedModel {
    pub dir: PathBuf,
    pub model: Box<dyn Model>,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    pub generation: GenerationDefaults,
    pub dtype: DType,
    pub hf_config: HfConfig,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// What in-situ quantization did, when asked for.
    pub isq: Option<IsqReport>,
    /// For a GGUF file: the GGML types its tensors are stored in, with their sizes.
    pub stored: Option<String>,
    /// The device slots of LoRA adapters, when enabled.
    pub lora: Option<Arc<LoraSlots>>,
    /// How a vision model's images are preprocessed (`None`: a text-only model).
    pub processor: Option<Arc<crate::multimodal::Processor>>,
}

/// How to load a model directory.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// `auto`, `float32`, `bfloat16` or `float16`.
    pub dtype: String,
    /// Rotary tables for this many positions (default: the model's).
    pub max_positions: Option<usize>,
    /// Quantize the decoder's projections while loading.
    pub isq: Option<IsqFormat>,
    /// Quantize the output head too (with `isq`).
    pub isq_lm_head: bool,
    /// A directory with `tokenizer.json` (and `tokenizer_config.json`) to use instead of the
    /// checkpoint's own (a GGUF file's metadata tokenizer).
    pub tokenizer: Option<PathBuf>,
    /// Give the decoder's projections LoRA slots (`--enable-lora`).
    pub lora: Option<LoraOptions>,
    /// Load one rank's shard (tensor parallelism).
    pub tp: Option<crate::parallel::TpShard>,
}

impl LoadOptions {
    /// `dtype`, and nothing else changed from the checkpoint.
    pub fn new(dtype: &str) -> Self {
        Self {
            dtype: dtype.to_string(),
            max_positions: None,
            isq: None,
            isq_lm_head: false,
            tokenizer: None,
            lora: None,
            tp: None,
        }
    }
}

/// Reads and validates `config.json` (or a GGUF file's metadata) without touching the weights.
pub fn read_config(dir: &Path) -> Result<HfConfig, LoadError> {
    if gguf::is_gguf(dir) {
        return gguf::hf_config(&open_gguf(dir)?);
    }
    if !dir.is_dir() {
        return Err(LoadError::NoDirectory(dir.to_path_buf()));
    }
    let path = dir.join("config.json");
    let v = read_json(&path)?;
    serde_json::from_value(v).map_err(|e| LoadError::Json {
        file: path,
        reason: e.to_string(),
    })
}

/// Loads a model directory for `max_positions` positions (at least the model's context length).
pub fn load_model(
    dir: &Path,
    dtype: &str,
    device: &Device,
    max_positions: Option<usize>,
) -> Result<LoadedModel, LoadError> {
    let opts = LoadOptions {
        max_positions,
        ..LoadOptions::new(dtype)
    };
    load_model_with(dir, &opts, device)
}

/// [`load_model`] with every option.
pub fn load_model_with(
    dir: &Path,
    opts: &LoadOptions,
    device: &Device,
) -> Result<LoadedModel, LoadError> {
    if gguf::is_gguf(dir) {
        return load_gguf(dir, opts, device);
    }
    let max_positions = opts.max_positions;
    let hf = read_config(dir)?;
    let dcfg = decoder_config(&hf)?;
    let dtype = parse_dtype_for(&opts.dtype, hf.dtype_name(), device)?;
    let tokenizer_dir = opts.tokenizer.as_deref().unwrap_or(dir);
    let tokenizer = Tokenizer::from_file(tokenizer_dir.join("tokenizer.json"))
        .map_err(|e| LoadError::Tokenizer(e.to_string()))?;
    let generation = generation_defaults(dir, &hf.text()?, dcfg.vocab_size)?;
    if dcfg.vocab_size > tokenizer.vocab_size() {
        tracing::warn!(
            "the model has {} token ids and its tokenizer {}: ids the tokenizer lacks decode to nothing",
            dcfg.vocab_size,
            tokenizer.vocab_size()
        );
    }
    let files = weight_files(dir)?;
    let isq = opts.isq.map(|f| Isq::new(f, opts.isq_lm_head));
    let lora = lora_slots(opts, dtype, device);
    let weights = Weights::open_with(&files, dtype, device, isq.clone())?
        .with_lora(lora.clone())
        .with_tp(opts.tp.clone());
    let positions = max_positions.unwrap_or(dcfg.max_position_embeddings).max(1);
    let model = crate::models::build(&hf, &weights, positions)?;
    // the weights' copies run on this thread's stream: done before anyone else uses them
    device.synchronize().map_err(|e| LoadError::Tensor {
        name: "weights".into(),
        reason: e.to_string(),
    })?;
    let processor = crate::models::processor(&hf, dir)?.map(Arc::new);
    let source = load_chat_template(dir).map_err(|e| LoadError::ChatTemplate(e.to_string()))?;
    let (template, bos_token, eos_token) = match source {
        Some(s) => (s.template, s.bos_token, s.eos_token),
        None => (None, None, None),
    };
    let chat_template = compile_template(&template, &bos_token, &eos_token)?;
    Ok(LoadedModel {
        dir: dir.to_path_buf(),
        model,
        tokenizer,
        chat_template,
        generation,
        dtype,
        hf_config: hf,
        bos_token,
        eos_token,
        isq: isq.map(|q| q.report()),
        stored: None,
        lora,
        processor,
    })
}

/// The (empty) LoRA slots the options ask for.
fn lora_slots(opts: &LoadOptions, dtype: DType, device: &Device) -> Option<Arc<LoraSlots>> {
    opts.lora
        .map(|l| Arc::new(LoraSlots::new(l.max_loras, l.max_rank, dtype, device)))
}

fn compile_template(
    template: &Option<String>,
    bos: &Option<String>,
    eos: &Option<String>,
) -> Result<Option<ChatTemplate>, LoadError> {
    template
        .as_ref()
        .map(|t| {
            ChatTemplate::new(t, bos.clone(), eos.clone())
                .map_err(|e| LoadError::ChatTemplate(e.to_string()))
        })
        .transpose()
}

fn open_gguf(path: &Path) -> Result<GgufFile, LoadError> {
    GgufFile::open(path).map_err(|e| LoadError::Gguf {
        file: path.to_path_buf(),
        reason: e.to_string(),
    })
}

/// Loads a GGUF file: config, tokenizer (unless `opts.tokenizer`), chat template and generation
/// defaults from its metadata; tensors stored quantized stay quantized.
fn load_gguf(path: &Path, opts: &LoadOptions, device: &Device) -> Result<LoadedModel, LoadError> {
    let file = Arc::new(open_gguf(path)?);
    let hf = gguf::hf_config(&file)?;
    let dcfg = decoder_config(&hf)?;
    let dtype = parse_dtype_for(&opts.dtype, hf.dtype_name(), device)?;
    // the metadata's tokenizer is built on its own thread while the weights load
    let metadata_tokenizer = opts.tokenizer.is_none().then(|| {
        let file = file.clone();
        std::thread::spawn(move || gguf::tokenizer::load(&file))
    });
    let tokenizer_error = |reason: String| LoadError::Gguf {
        file: path.to_path_buf(),
        reason: format!("tokenizer: {reason}"),
    };
    let (tokenizer, template, bos_token, eos_token) = match &opts.tokenizer {
        Some(dir) => {
            let t = Tokenizer::from_file(dir.join("tokenizer.json"))
                .map_err(|e| LoadError::Tokenizer(e.to_string()))?;
            let src =
                load_chat_template(dir).map_err(|e| LoadError::ChatTemplate(e.to_string()))?;
            let (from_file, b, e) = gguf::chat_template(&file);
            match src {
                Some(s) => (
                    Some(t),
                    s.template.or(from_file),
                    s.bos_token.or(b),
                    s.eos_token.or(e),
                ),
                None => (Some(t), from_file, b, e),
            }
        }
        None => {
            let (template, b, e) = gguf::chat_template(&file);
            (None, template, b, e)
        }
    };
    let generation = gguf::generation_defaults(&file, dcfg.vocab_size);
    let chat_template = compile_template(&template, &bos_token, &eos_token)?;
    let stored = stored_types(&file);
    let isq = opts.isq.map(|f| Isq::new(f, opts.isq_lm_head));
    let lora = lora_slots(opts, dtype, device);
    let weights = Weights::from_gguf(file, dtype, device, isq.clone()).with_lora(lora.clone());
    let positions = opts
        .max_positions
        .unwrap_or(dcfg.max_position_embeddings)
        .max(1);
    let model = crate::models::build(&hf, &weights, positions)?;
    let tokenizer = match (tokenizer, metadata_tokenizer) {
        (Some(t), _) => t,
        (None, Some(thread)) => thread
            .join()
            .map_err(|_| tokenizer_error("the tokenizer builder panicked".into()))?
            .map_err(tokenizer_error)?,
        (None, None) => return Err(tokenizer_error("no tokenizer".into())),
    };
    Ok(LoadedModel {
        dir: path.to_path_buf(),
        model,
        tokenizer,
        chat_template,
        generation,
        dtype,
        hf_config: hf,
        bos_token,
        eos_token,
        isq: isq.map(|q| q.report()),
        stored: Some(stored),
        lora,
        processor: None,
    })
}

/// The GGML types of a GGUF file's tensors with their sizes, for the startup log.
fn stored_types(file: &GgufFile) -> String {
    let mut by_type: std::collections::BTreeMap<&str, (usize, usize)> = Default::default();
    for t in file.header.tensors.values() {
        let e = by_type.entry(crate::quant::ggml_name(t.dtype)).or_default();
        e.0 += 1;
        e.1 += t.len;
    }
    let parts: Vec<String> = by_type
        .iter()
        .map(|(k, (n, b))| format!("{n} {k} ({:.1} MiB)", *b as f64 / (1 << 20) as f64))
        .collect();
    format!("GGUF tensors stored as {}", parts.join(", "))
}
