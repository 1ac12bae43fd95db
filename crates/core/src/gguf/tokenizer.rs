//! A Hugging Face tokenizer rebuilt from a GGUF file's `tokenizer.ggml.*` metadata, for the
//! byte-level BPE tokenizers (`tokenizer.ggml.model` = `gpt2`) of Llama 3 and Qwen: the vocabulary
//! and merges as stored, the pre-tokenizer that `tokenizer.ggml.pre` names, control tokens as
//! special added tokens, and a BOS prepended when `tokenizer.ggml.add_bos_token` says so.
//! SentencePiece vocabularies (`llama`) and unknown pre-tokenizers are refused with a pointer to
//! `--tokenizer DIR`, rather than tokenizing differently from the model's own tokenizer.

use super::file::{GgufFile, Value};
use crate::tokenizer::Tokenizer;
use serde_json::{json, Value as Json};

/// Llama 3's split (`llama-bpe` in llama.cpp).
const REGEX_LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split: single digits.
const REGEX_QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GGUF token types (llama.cpp's `llama_token_type`).
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

fn strs<'a>(g: &'a GgufFile, key: &str) -> Result<&'a [String], String> {
    match g.meta(key) {
        Some(Value::Strs(v)) => Ok(v),
        Some(_) => Err(format!("`{key}` is not an array of strings")),
        None => Err(format!("no `{key}`")),
    }
}

fn split(regex: &str) -> Json {
    json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
    ]})
}

/// The `tokenizer.json` document the metadata describes.
pub fn tokenizer_json(g: &GgufFile) -> Result<Json, String> {
    let model = g
        .meta("tokenizer.ggml.model")
        .and_then(Value::as_str)
        .ok_or("no `tokenizer.ggml.model`")?;
    if model != "gpt2" {
        return Err(format!(
            "tokenizer model `{model}` is not rebuilt from GGUF metadata (byte-level BPE, \
             `gpt2`, is); pass the model's own tokenizer with --tokenizer DIR"
        ));
    }
    let tokens = strs(g, "tokenizer.ggml.tokens")?;
    let merges = strs(g, "tokenizer.ggml.merges")?;
    let pre = g
        .meta("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("default");
    let (normalizer, pre_tokenizer, ignore_merges) = match pre {
        "llama-bpe" | "llama3" | "smaug-bpe" => (Json::Null, split(REGEX_LLAMA3), true),
        "qwen2" | "deepseek-r1-qwen" => (json!({"type": "NFC"}), split(REGEX_QWEN2), false),
        "default" | "gpt2" => (
            Json::Null,
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}),
            false,
        ),
        other => {
            return Err(format!(
                "pre-tokenizer `{other}` is not known (llama-bpe, qwen2, gpt2); pass the \
                 model's own tokenizer with --tokenizer DIR"
            ))
        }
    };
    let ignore_merges = g
        .meta("tokenizer.ggml.ignore_merges")
        .and_then(Value::as_bool)
        .unwrap_or(ignore_merges);
    let types: &[i64] = match g.meta("tokenizer.ggml.token_type") {
        Some(Value::Ints(t)) => t,
        _ => &[],
    };
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, tok) in tokens.iter().enumerate() {
        vocab.insert(tok.clone(), json!(id));
        let ty = types.get(id).copied().unwrap_or(1);
        if ty == CONTROL || ty == USER_DEFINED {
            added.push(json!({
                "id": id, "content": tok, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": ty == CONTROL,
            }));
        }
    }
    let add_bos = g
        .meta("tokenizer.ggml.add_bos_token")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let bos = g
        .meta("tokenizer.ggml.bos_token_id")
        .and_then(Value::as_u64)
        .and_then(|id| Some((id, tokens.get(usize::try_from(id).ok()?)?)));
    let post_processor = match (add_bos, bos) {
        (true, Some((id, tok))) => json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": tok, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": tok, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": tok, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {tok.as_str(): {"id": tok, "ids": [id], "tokens": [tok]}},
        }),
        _ => {
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false})
        }
    };
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges,
        },
    }))
}

/// The tokenizer the metadata describes.
pub fn load(g: &GgufFile) -> Result<Tokenizer, String> {
    let doc = tokenizer_json(g)?;
    let bytes = serde_json::to_vec(&doc).map_err(|e| e.to_string())?;
    Tokenizer::from_bytes(&bytes).map_err(|e| e.to_string())
}
