//! Wire requests -> validated engine inputs: sampling parameters with each endpoint's defaults,
//! chat messages -> the chat template's input, prompts -> token ids. The single validation path
//! for HTTP and Python; the engine only ever sees what passes here.

use super::error::ApiError;
use super::types::{ChatMessage, CommonFields, Prompt};
use rserve_core::loader::GenerationDefaults;
use rserve_core::request::MAX_LOGPROBS;
use rserve_core::{EngineInfo, SamplingParams};
use serde_json::{json, Value};
use std::collections::BTreeMap;

fn range_err(field: &str, msg: String) -> ApiError {
    ApiError::bad_request(format!("{field}: {msg}")).with_param(field)
}

fn non_negative(field: &str, v: i64) -> Result<usize, ApiError> {
    usize::try_from(v).map_err(|_| range_err(field, format!("must be non-negative, got {v}")))
}

/// Fills `SamplingParams` from the fields both endpoints share. `default_max_tokens` is the
/// endpoint's default (`None`: the rest of the context). Model generation defaults apply where
/// the request is silent.
pub fn sampling_params(
    c: &CommonFields,
    info: &EngineInfo,
    default_max_tokens: Option<usize>,
) -> Result<SamplingParams, ApiError> {
    sampling_params_with(c, &info.generation, default_max_tokens)
}

/// [`sampling_params`] with explicit generation defaults (no engine needed).
pub fn sampling_params_with(
    c: &CommonFields,
    g: &GenerationDefaults,
    default_max_tokens: Option<usize>,
) -> Result<SamplingParams, ApiError> {
    let mut p = SamplingParams {
        temperature: g.temperature.unwrap_or(1.0),
        top_p: g.top_p.unwrap_or(1.0),
        top_k: g.top_k.unwrap_or(0),
        repetition_penalty: g.repetition_penalty.unwrap_or(1.0),
        max_tokens: default_max_tokens,
        ..SamplingParams::default()
    };
    if let Some(t) = c.temperature {
        p.temperature = t as f32;
    }
    if let Some(t) = c.top_p {
        p.top_p = t as f32;
    }
    if let Some(k) = c.top_k {
        p.top_k = if k == -1 {
            0
        } else {
            non_negative("top_k", k)?
        };
    }
    if let Some(m) = c.min_p {
        p.min_p = m as f32;
    }
    if let Some(r) = c.repetition_penalty {
        p.repetition_penalty = r as f32;
    }
    if let Some(x) = c.presence_penalty {
        p.presence_penalty = x as f32;
    }
    if let Some(x) = c.frequency_penalty {
        p.frequency_penalty = x as f32;
    }
    p.n = samples(c)?;
    if c.stream_options.is_some() && !c.stream.unwrap_or(false) {
        // vLLM refuses them too: they would be silently ignored
        return Err(ApiError::bad_request(
            "`stream_options` can only be given when `stream` is true",
        )
        .with_param("stream_options"));
    }
    if let Some(k) = c.prompt_logprobs {
        if c.stream.unwrap_or(false) {
            return Err(ApiError::bad_request(
                "`prompt_logprobs` are not available when `stream` is true",
            )
            .with_param("prompt_logprobs"));
        }
        p.prompt_logprobs = Some(logprobs_count("prompt_logprobs", k)?);
    }
    if let Some(m) = c.max_tokens {
        if m < 1 {
            return Err(range_err(
                "max_tokens",
                format!("must be at least 1, got {m}"),
            ));
        }
        p.max_tokens = Some(m as usize);
    }
    if let Some(m) = c.min_tokens {
        p.min_tokens = non_negative("min_tokens", m)?;
    }
    if let Some(s) = c.seed {
        p.seed = Some(s as u64);
    }
    if let Some(stop) = c.stop.clone() {
        p.stop = stop.into_vec();
    }
    if let Some(ids) = &c.stop_token_ids {
        p.stop_token_ids = ids
            .iter()
            .map(|&t| {
                u32::try_from(t)
                    .map_err(|_| range_err("stop_token_ids", format!("invalid token id {t}")))
            })
            .collect::<Result<_, _>>()?;
    }
    if let Some(b) = &c.logit_bias {
        let mut m = BTreeMap::new();
        for (k, v) in b {
            let id: u32 = k.trim().parse().map_err(|_| {
                range_err("logit_bias", format!("keys must be token ids, got `{k}`"))
            })?;
            m.insert(id, *v as f32);
        }
        p.logit_bias = m;
    }
    p.ignore_eos = c.ignore_eos.unwrap_or(false);
    p.skip_special_tokens = c.skip_special_tokens.unwrap_or(true);
    p.include_stop_str_in_output = c.include_stop_str_in_output.unwrap_or(false);
    p.structured_outputs = super::structured::constraint(c, None)?;
    Ok(p)
}

/// The completions asked for per prompt (`n`, at least 1).
pub fn requested_n(c: &CommonFields) -> Result<usize, ApiError> {
    match c.n {
        None => Ok(1),
        Some(n) if n >= 1 => Ok(non_negative("n", n)?),
        Some(n) => Err(range_err("n", format!("must be at least 1, got {n}"))),
    }
}

/// The completions sampled per prompt: `best_of` when given (at least `n`; not with `stream`
/// unless equal to `n`), else `n`. The `n` best by cumulative log-probability are returned.
pub fn samples(c: &CommonFields) -> Result<usize, ApiError> {
    let n = requested_n(c)?;
    let Some(b) = c.best_of else {
        return Ok(n);
    };
    let b = non_negative("best_of", b)?;
    if b < n {
        return Err(range_err(
            "best_of",
            format!("must be at least n ({n}), got {b}"),
        ));
    }
    if b > n && c.stream.unwrap_or(false) {
        return Err(ApiError::bad_request(
            "`best_of` greater than `n` is not available when `stream` is true",
        )
        .with_param("best_of"));
    }
    Ok(b)
}

/// Checks the range of a logprobs count.
pub fn logprobs_count(field: &str, v: i64) -> Result<usize, ApiError> {
    let k = non_negative(field, v)?;
    if k > MAX_LOGPROBS {
        return Err(range_err(
            field,
            format!("must be at most {MAX_LOGPROBS}, got {k}"),
        ));
    }
    Ok(k)
}

/// Validates the parameters against the model and turns core errors into 400s.
pub fn validate(p: &SamplingParams, info: &EngineInfo) -> Result<(), ApiError> {
    validate_for_vocab(p, info.model_config.vocab_size)
}

/// [`validate`] for a given vocabulary size.
pub fn validate_for_vocab(p: &SamplingParams, vocab: usize) -> Result<(), ApiError> {
    p.validate(vocab)
        .map_err(|e| ApiError::bad_request(e.to_string()).with_param(e.field))
}

/// The offline (Python) parameter set: the shared fields (`prompt_logprobs` among them) plus
/// integer `logprobs`, as `rserve.SamplingParams` sends them.
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct OfflineParams {
    #[serde(flatten)]
    pub common: CommonFields,
    #[serde(default)]
    pub logprobs: Option<i64>,
}

/// Parses and validates offline parameters (vocabulary checks need `vocab`).
pub fn offline_params(
    json: &str,
    g: &GenerationDefaults,
    vocab: usize,
) -> Result<SamplingParams, ApiError> {
    let o: OfflineParams = super::parse::parse_json(json.as_bytes())?;
    if o.common
        .best_of
        .is_some_and(|b| Some(b) != o.common.n.or(Some(1)))
    {
        return Err(
            ApiError::bad_request("`best_of` is served by the HTTP server only")
                .with_param("best_of"),
        );
    }
    let mut p = sampling_params_with(&o.common, g, Some(16))?;
    if let Some(k) = o.logprobs {
        p.logprobs = Some(logprobs_count("logprobs", k)?);
    }
    validate_for_vocab(&p, vocab)?;
    Ok(p)
}

const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

/// Chat messages -> the JSON the template sees. For a text model (`vision` false) text parts
/// are joined and other parts refused; a vision model's templates get the list of parts, each
/// image as `{"type": "image"}` (the form Hugging Face templates test for).
pub fn template_messages(messages: &[ChatMessage], vision: bool) -> Result<Vec<Value>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_request("messages must not be empty").with_param("messages"));
    }
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        if !ROLES.contains(&m.role.as_str()) {
            return Err(ApiError::bad_request(format!(
                "messages[{i}].role: `{}` is not one of {}",
                m.role,
                ROLES.join(", ")
            ))
            .with_param("messages"));
        }
        let content = match &m.content {
            None | Some(Value::Null) => Value::Null,
            Some(Value::String(s)) => Value::String(s.clone()),
            Some(Value::Array(parts)) => {
                let mut texts = Vec::new();
                let mut listed = Vec::new();
                for part in parts {
                    match part.get("type").and_then(Value::as_str) {
                        Some("image_url") if vision => listed.push(json!({"type": "image"})),
                        Some("text") => match part.get("text").and_then(Value::as_str) {
                            Some(t) => {
                                texts.push(t.to_string());
                                listed.push(json!({"type": "text", "text": t}));
                            }
                            None => {
                                return Err(ApiError::bad_request(format!("messages[{i}]: a text part needs a `text` string")).with_param("messages"))
                            }
                        },
                        Some(other) => {
                            return Err(ApiError::bad_request(format!(
                                "messages[{i}]: content parts of type `{other}` are not supported by this model"
                            ))
                            .with_param("messages"))
                        }
                        None => return Err(ApiError::bad_request(format!("messages[{i}]: content part without a type")).with_param("messages")),
                    }
                }
                if vision {
                    Value::Array(listed)
                } else {
                    Value::String(texts.join("\n"))
                }
            }
            Some(_) => {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}].content must be a string or a list of parts"
                ))
                .with_param("messages"))
            }
        };
        let mut v = json!({"role": m.role, "content": content});
        if let Some(n) = &m.name {
            v["name"] = json!(n);
        }
        if let Some(t) = &m.tool_calls {
            v["tool_calls"] = template_tool_calls(t);
        }
        if let Some(t) = &m.tool_call_id {
            v["tool_call_id"] = json!(t);
        }
        out.push(v);
    }
    Ok(out)
}

/// An assistant message's `tool_calls` as chat templates read them: each call's `arguments`
/// (a JSON string on the wire) as the object it holds, as Hugging Face templates expect.
fn template_tool_calls(calls: &Value) -> Value {
    let mut calls = calls.clone();
    if let Some(list) = calls.as_array_mut() {
        for c in list {
            let args = c.pointer("/function/arguments").and_then(Value::as_str);
            if let Some(parsed) = args.and_then(|a| serde_json::from_str::<Value>(a).ok()) {
                c["function"]["arguments"] = parsed;
            }
        }
    }
    calls
}

/// Refuses at once a text that cannot fit the context: more characters than `max_model_len`
/// tokens of the longest token can hold. Cheap next to tokenizing it (no pass over a text whose
/// byte length already fits).
pub fn check_text_fits(text_len: TextLen, info: &EngineInfo, field: &str) -> Result<(), ApiError> {
    let per_token = info.tokenizer.max_token_chars();
    let limit = info.max_model_len.saturating_mul(per_token);
    if text_len.bytes() <= limit {
        return Ok(());
    }
    let chars = text_len.chars();
    if chars <= limit {
        return Ok(());
    }
    Err(ApiError::bad_request(format!(
        "This model's maximum context length is {} tokens. However, your {field} has {chars} \
         characters, more than {} tokens can hold (a token stands for at most {per_token} \
         characters). Please reduce the length of the {field}.",
        info.max_model_len, info.max_model_len
    ))
    .with_param(field))
}

/// Some text whose length is checked: its bytes first, its characters only when needed.
#[derive(Debug, Clone, Copy)]
pub enum TextLen<'a> {
    Text(&'a str),
    /// The text content of chat messages (strings and text parts).
    Messages(&'a [ChatMessage]),
}

impl<'a> TextLen<'a> {
    pub fn of_text(s: &'a str) -> Self {
        Self::Text(s)
    }

    pub fn of_messages(m: &'a [ChatMessage]) -> Self {
        Self::Messages(m)
    }

    fn total(&self, len: impl Fn(&str) -> usize) -> usize {
        match self {
            Self::Text(t) => len(t),
            Self::Messages(m) => m.iter().flat_map(content_texts).map(&len).sum(),
        }
    }

    fn bytes(&self) -> usize {
        self.total(str::len)
    }

    fn chars(&self) -> usize {
        self.total(|t| t.chars().count())
    }
}

/// The texts of a message's content: the string, or each text part.
fn content_texts(m: &ChatMessage) -> impl Iterator<Item = &str> {
    let (one, parts) = match &m.content {
        Some(Value::String(s)) => (Some(s.as_str()), None),
        Some(Value::Array(p)) => (None, Some(p)),
        _ => (None, None),
    };
    one.into_iter().chain(
        parts
            .into_iter()
            .flatten()
            .filter_map(|p| p.get("text").and_then(Value::as_str)),
    )
}

/// Renders the chat template and tokenizes the result (no extra special tokens, as vLLM does).
/// Costs time in the length of the messages: run it off the async workers.
pub fn chat_prompt(
    info: &EngineInfo,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    extra: Option<&serde_json::Map<String, Value>>,
    tools: Option<&[Value]>,
) -> Result<(String, Vec<u32>), ApiError> {
    let msgs = template_messages(messages, info.processor.is_some())?;
    let tpl = info.chat_template.as_ref().ok_or_else(|| {
        ApiError::bad_request(
            "this model has no chat template; pass --chat-template or use /v1/completions",
        )
    })?;
    let text = tpl
        .render(&msgs, add_generation_prompt, tools, extra)
        .map_err(|e| ApiError::bad_request(format!("chat template: {e}")).with_param("messages"))?;
    check_text_fits(TextLen::of_text(&text), info, "messages")?;
    let ids = info
        .tokenizer
        .encode(&text, false)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok((text, ids))
}

/// Token ids from the wire, checked against the vocabulary.
pub fn token_ids(v: &[i64], info: &EngineInfo, field: &str) -> Result<Vec<u32>, ApiError> {
    let vocab = info.model_config.vocab_size;
    v.iter()
        .map(|&t| {
            u32::try_from(t)
                .ok()
                .filter(|&x| (x as usize) < vocab)
                .ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "{field}: token id {t} is out of vocabulary (size {vocab})"
                    ))
                    .with_param(field)
                })
        })
        .collect()
}

/// A prompt as token ids, with its original text when it was given as text.
pub type PromptInput = (Vec<u32>, Option<String>);

/// Checks that every text prompt of a completions request can fit (see [`check_text_fits`]).
pub fn check_prompts_fit(prompt: &Prompt, info: &EngineInfo) -> Result<(), ApiError> {
    match prompt {
        Prompt::Text(s) => check_text_fits(TextLen::of_text(s), info, "prompt"),
        Prompt::Texts(v) => v
            .iter()
            .try_for_each(|s| check_text_fits(TextLen::of_text(s), info, "prompt")),
        Prompt::Tokens(_) | Prompt::TokenLists(_) => Ok(()),
    }
}

/// The number of prompts of a completions request.
pub fn prompt_count(prompt: &Prompt) -> usize {
    match prompt {
        Prompt::Text(_) | Prompt::Tokens(_) => 1,
        Prompt::Texts(v) => v.len(),
        Prompt::TokenLists(v) => v.len(),
    }
}

/// Every prompt of a completions request as token ids (text is tokenized with special tokens),
/// with its original text when it was given as text. Costs time in the length of the prompts:
/// run it off the async workers.
pub fn completion_prompts(
    prompt: &Prompt,
    info: &EngineInfo,
) -> Result<Vec<PromptInput>, ApiError> {
    let enc = |s: &str| -> Result<PromptInput, ApiError> {
        let ids = info
            .tokenizer
            .encode(s, true)
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        Ok((ids, Some(s.to_string())))
    };
    let out: Vec<PromptInput> = match prompt {
        Prompt::Text(s) => vec![enc(s)?],
        Prompt::Texts(v) => v.iter().map(|s| enc(s)).collect::<Result<_, _>>()?,
        Prompt::Tokens(t) => vec![(token_ids(t, info, "prompt")?, None)],
        Prompt::TokenLists(l) => l
            .iter()
            .map(|t| Ok((token_ids(t, info, "prompt")?, None)))
            .collect::<Result<_, ApiError>>()?,
    };
    if out.is_empty() || out.iter().any(|(ids, _)| ids.is_empty()) {
        return Err(ApiError::bad_request("prompt must not be empty").with_param("prompt"));
    }
    Ok(out)
}
