//! A Hugging Face tokenizer rebuilt from a GGUF file's `tokenizer.ggml.*` metadata, as
//! transformers rebuilds it when it loads the file:
//! - byte-level BPE (`tokenizer.ggml.model` = `gpt2`, Llama 3 and Qwen): the vocabulary and merges
//!   as stored and the pre-tokenizer that `tokenizer.ggml.pre` names;
//! - SentencePiece BPE (`llama`, Llama 2 and Mistral): the vocabulary with byte fallback, a `▁`
//!   for each space and one before the text (`tokenizer.ggml.add_space_prefix`, on by default),
//!   and merges recovered from the scores: every split of a token into two tokens, the best
//!   score first, as transformers' `generate_merges` orders them. Text that starts with a space
//!   gets no second `▁`, and none follows an added token, as in transformers (llama.cpp and
//!   SentencePiece add one in both places).
//!
//! Both: control and unknown tokens as special added tokens, user-defined ones as plain added
//! tokens, and a BOS prepended when `tokenizer.ggml.add_bos_token` says so (an EOS appended
//! with `add_eos_token`); SentencePiece vocabularies prepend a BOS unless told not to. Unknown
//! tokenizer models and pre-tokenizers are refused with a pointer to `--tokenizer DIR`, rather
//! than tokenizing differently from the model's own tokenizer.

use super::file::{GgufFile, Value};
use crate::tokenizer::Tokenizer;
use serde_json::{json, Value as Json};
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
};

/// Llama 3's split (`llama-bpe` in llama.cpp).
const REGEX_LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split: single digits.
const REGEX_QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GGUF token types (llama.cpp's `llama_token_type`).
const UNKNOWN: i64 = 2;
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// SentencePiece's word boundary.
const SPACE: &str = "\u{2581}";

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

/// What the metadata describes: the tokenizer's parts as `tokenizer.json` writes them, except the
/// BPE model's vocabulary and merges, which are built directly (a JSON round trip of 150k tokens
/// and merges took most of a 0.7 s load).
struct Spec {
    normalizer: Json,
    pre_tokenizer: Json,
    decoder: Json,
    post_processor: Json,
    merges: Vec<(String, String)>,
    /// `fuse_unk`, `byte_fallback`, `ignore_merges`.
    flags: [bool; 3],
}

fn spec(g: &GgufFile) -> Result<(Spec, &[String]), String> {
    let model = g
        .meta("tokenizer.ggml.model")
        .and_then(Value::as_str)
        .ok_or("no `tokenizer.ggml.model`")?;
    let tokens = strs(g, "tokenizer.ggml.tokens")?;
    let flag = |key: &str| g.meta(key).and_then(Value::as_bool);
    let (mut spec, bos_default) = match model {
        "gpt2" => (byte_level(g)?, false),
        "llama" => (
            sentencepiece(
                g,
                tokens,
                flag("tokenizer.ggml.add_space_prefix").unwrap_or(true),
            )?,
            true,
        ),
        other => {
            return Err(format!(
                "tokenizer model `{other}` is not rebuilt from GGUF metadata (byte-level BPE, \
                 `gpt2`, and SentencePiece, `llama`, are); pass the model's own tokenizer with \
                 --tokenizer DIR"
            ))
        }
    };
    let token = |key: &str| {
        let id = g.meta(key).and_then(Value::as_u64)?;
        Some((id, tokens.get(usize::try_from(id).ok()?)?.as_str()))
    };
    let bos = token("tokenizer.ggml.bos_token_id")
        .filter(|_| flag("tokenizer.ggml.add_bos_token").unwrap_or(bos_default));
    let eos = token("tokenizer.ggml.eos_token_id")
        .filter(|_| flag("tokenizer.ggml.add_eos_token").unwrap_or(false));
    if bos.is_some() || eos.is_some() {
        spec.post_processor = template(bos, eos);
    }
    Ok((spec, tokens))
}

/// Control and unknown tokens as special added tokens, user-defined ones as plain ones.
fn added_tokens(g: &GgufFile, tokens: &[String]) -> Vec<AddedToken> {
    let types: &[i64] = match g.meta("tokenizer.ggml.token_type") {
        Some(Value::Ints(t)) => t,
        _ => &[],
    };
    let mut added = Vec::new();
    for (id, tok) in tokens.iter().enumerate() {
        let ty = types.get(id).copied().unwrap_or(1);
        if ty == UNKNOWN || ty == CONTROL || ty == USER_DEFINED {
            added.push(
                AddedToken::from(tok.clone(), ty != USER_DEFINED)
                    .single_word(false)
                    .lstrip(false)
                    .rstrip(false)
                    .normalized(false),
            );
        }
    }
    added
}

/// BOS before each sequence and EOS after it, where given.
fn template(bos: Option<(u64, &str)>, eos: Option<(u64, &str)>) -> Json {
    let special = |t: &str, type_id: u32| json!({"SpecialToken": {"id": t, "type_id": type_id}});
    let seq = |id: &str, type_id: u32| json!({"Sequence": {"id": id, "type_id": type_id}});
    let wrap = |id: &str, type_id: u32| {
        let mut v = Vec::new();
        v.extend(bos.map(|(_, t)| special(t, type_id)));
        v.push(seq(id, type_id));
        v.extend(eos.map(|(_, t)| special(t, type_id)));
        v
    };
    let mut specials = serde_json::Map::new();
    for (id, t) in bos.into_iter().chain(eos) {
        specials.insert(t.to_owned(), json!({"id": t, "ids": [id], "tokens": [t]}));
    }
    let pair = [wrap("A", 0), wrap("B", 1)].concat();
    json!({
        "type": "TemplateProcessing",
        "single": wrap("A", 0),
        "pair": pair,
        "special_tokens": specials,
    })
}

fn byte_level(g: &GgufFile) -> Result<Spec, String> {
    let merges = strs(g, "tokenizer.ggml.merges")?
        .iter()
        .enumerate()
        .map(|(rank, m)| match m.split(' ').collect::<Vec<_>>()[..] {
            [a, b] => Ok((a.to_owned(), b.to_owned())),
            _ => Err(format!("merge {} (`{m}`) is not two tokens", rank + 1)),
        })
        .collect::<Result<Vec<_>, String>>()?;
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
    Ok(Spec {
        normalizer,
        pre_tokenizer,
        decoder: json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
        post_processor: json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}),
        merges,
        flags: [false, false, ignore_merges],
    })
}

fn sentencepiece(g: &GgufFile, tokens: &[String], prefix: bool) -> Result<Spec, String> {
    let scores: &[f64] = match g.meta("tokenizer.ggml.scores") {
        Some(Value::Floats(s)) if s.len() == tokens.len() => s,
        Some(_) => return Err("`tokenizer.ggml.scores` is not one float per token".into()),
        None => {
            return Err("no `tokenizer.ggml.scores` (a SentencePiece vocabulary needs them)".into())
        }
    };
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": SPACE}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    Ok(Spec {
        normalizer: Json::Null,
        pre_tokenizer: json!({"type": "Metaspace", "replacement": SPACE,
               "prepend_scheme": if prefix { "first" } else { "never" }, "split": false}),
        decoder: json!({"type": "Sequence", "decoders": decoders}),
        post_processor: Json::Null,
        merges: merges_from_scores(tokens, scores)
            .into_iter()
            .map(|[a, b]| (a, b))
            .collect(),
        flags: [true, true, false],
    })
}

/// The merges a SentencePiece BPE vocabulary implies: each token cut in two at every character
/// where both halves are tokens, ordered by the token's score (best first), then by the halves'
/// lengths (longer first); ties keep the vocabulary's order, each token's cuts ordered by their
/// halves' ids. (transformers' `generate_merges`.)
pub fn merges_from_scores(tokens: &[String], scores: &[f64]) -> Vec<[String; 2]> {
    use std::collections::HashMap;
    let ids: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    // (left id, right id, score, left chars, right chars)
    let mut merges: Vec<(usize, usize, f64, usize, usize)> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (tok, &score) in tokens.iter().zip(scores) {
        if !seen.insert(tok.as_str()) {
            continue; // a repeated token counts once, at its first place
        }
        let score = ids.get(tok.as_str()).map_or(score, |&i| scores[i]);
        let mut local: Vec<_> = tok
            .char_indices()
            .skip(1)
            .filter_map(|(at, _)| {
                let (l, r) = tok.split_at(at);
                Some((
                    *ids.get(l)?,
                    *ids.get(r)?,
                    score,
                    l.chars().count(),
                    r.chars().count(),
                ))
            })
            .collect();
        local.sort_by_key(|&(l, r, ..)| (l, r));
        merges.extend(local);
    }
    merges.sort_by(|a, b| b.2.total_cmp(&a.2).then(b.3.cmp(&a.3)).then(b.4.cmp(&a.4)));
    merges
        .into_iter()
        .map(|(l, r, ..)| [tokens[l].clone(), tokens[r].clone()])
        .collect()
}

/// One part of the tokenizer from its `tokenizer.json` form (`None` for null).
fn part<T: serde::de::DeserializeOwned>(what: &str, v: Json) -> Result<Option<T>, String> {
    if v.is_null() {
        return Ok(None);
    }
    serde_json::from_value(v)
        .map(Some)
        .map_err(|e| format!("{what}: {e}"))
}

/// The tokenizer the metadata describes.
pub fn load(g: &GgufFile) -> Result<Tokenizer, String> {
    let (spec, tokens) = spec(g)?;
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.clone(), id as u32))
        .collect();
    // a repeated token keeps its last id, as in a `tokenizer.json` vocabulary
    let ids: Vec<(&str, u32)> = tokens
        .iter()
        .enumerate()
        .filter(|&(id, t)| vocab.get(t) == Some(&(id as u32)))
        .map(|(id, t)| (t.as_str(), id as u32))
        .collect();
    let [fuse_unk, byte_fallback, ignore_merges] = spec.flags;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, spec.merges)
        .fuse_unk(fuse_unk)
        .byte_fallback(byte_fallback)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| e.to_string())?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner
        .with_normalizer(part::<NormalizerWrapper>("normalizer", spec.normalizer)?)
        .map_err(|e| e.to_string())?;
    inner.with_pre_tokenizer(part::<PreTokenizerWrapper>(
        "pre-tokenizer",
        spec.pre_tokenizer,
    )?);
    inner.with_decoder(part::<DecoderWrapper>("decoder", spec.decoder)?);
    inner.with_post_processor(part::<PostProcessorWrapper>(
        "post-processor",
        spec.post_processor,
    )?);
    inner
        .add_tokens(added_tokens(g, tokens))
        .map_err(|e| e.to_string())?;
    Ok(Tokenizer::with_vocab(inner, ids.into_iter()))
}

#[cfg(test)]
mod tests {
    use super::merges_from_scores;

    /// The order transformers' `generate_merges` gives for the same vocabulary (a repeated token
    /// takes its last score and id, at its first place).
    #[test]
    fn merges_follow_the_scores_then_the_halves_lengths() {
        let tokens: Vec<String> = ["a", "b", "c", "ab", "bc", "abc", "bc"]
            .iter()
            .map(|t| t.to_string())
            .collect();
        let scores = [0.0, 0.0, 0.0, -1.0, -2.0, -0.5, -3.0];
        let got = merges_from_scores(&tokens, &scores);
        let want = [["ab", "c"], ["a", "bc"], ["a", "b"], ["b", "c"]];
        assert_eq!(got, want.map(|[l, r]| [l.to_string(), r.to_string()]));
    }
}
