//! Public request and output types of the engine: what callers submit and what they get back.
//!
//! These are plain serde types shared by every way into the engine (HTTP, Python, CLI). They are
//! validated once, at the edge, by [`SamplingParams::validate`]; the engine only ever sees valid ones.
//! This file owns no engine state.

use crate::structured::StructuredOutputs;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// Identifier of one submitted request (unique per engine).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Per-request sampling and stopping parameters (vLLM's names and defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// Number of independent completions returned for the prompt.
    pub n: usize,
    /// 0 means greedy.
    pub temperature: f32,
    /// Nucleus sampling mass in (0, 1].
    pub top_p: f32,
    /// 0 (or -1 on the wire) disables top-k.
    pub top_k: usize,
    /// Minimum probability relative to the most likely token, in [0, 1].
    pub min_p: f32,
    /// Multiplicative penalty (> 0) on tokens already in the prompt or output; 1 disables.
    pub repetition_penalty: f32,
    /// Additive penalty in [-2, 2] on tokens already generated.
    pub presence_penalty: f32,
    /// Additive penalty in [-2, 2] scaled by how often a token was generated.
    pub frequency_penalty: f32,
    /// Token id -> bias added to its logit, each in [-100, 100].
    pub logit_bias: BTreeMap<u32, f32>,
    /// Seed for this request's random stream; `None` draws one from the engine.
    pub seed: Option<u64>,
    /// Maximum number of generated tokens; `None` means up to the context length.
    pub max_tokens: Option<usize>,
    /// Generation continues at least this long, suppressing EOS and stop tokens.
    pub min_tokens: usize,
    /// Strings that end generation; they are not part of the output unless `include_stop_str_in_output`.
    pub stop: Vec<String>,
    /// Token ids that end generation (in addition to EOS unless `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub include_stop_str_in_output: bool,
    pub skip_special_tokens: bool,
    /// Number of top alternatives returned with each generated token's logprob; `None` returns none.
    pub logprobs: Option<usize>,
    /// Number of top alternatives returned for each prompt position; `None` returns none.
    pub prompt_logprobs: Option<usize>,
    /// A JSON schema, regex, choice or grammar the output must match.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub structured_outputs: Option<StructuredOutputs>,
}

/// Largest number of alternatives one may ask for in `logprobs` / `prompt_logprobs`.
pub const MAX_LOGPROBS: usize = 20;
/// Largest `n`.
pub const MAX_N: usize = 128;
/// Most stop strings one request may give, and the longest one (bytes).
pub const MAX_STOP_STRINGS: usize = 128;
pub const MAX_STOP_STRING_BYTES: usize = 1024;
/// Most entries of `logit_bias` and of `stop_token_ids`.
pub const MAX_LOGIT_BIAS: usize = 1024;
pub const MAX_STOP_TOKEN_IDS: usize = 1024;

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            n: 1,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: BTreeMap::new(),
            seed: None,
            max_tokens: Some(16),
            min_tokens: 0,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            include_stop_str_in_output: false,
            skip_special_tokens: true,
            logprobs: None,
            prompt_logprobs: None,
            structured_outputs: None,
        }
    }
}

/// A sampling parameter that is out of range, naming the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct InvalidParam {
    pub field: &'static str,
    pub message: String,
}

fn invalid(field: &'static str, message: impl Into<String>) -> InvalidParam {
    InvalidParam {
        field,
        message: message.into(),
    }
}

/// A list field's length against its cap.
fn at_most(field: &'static str, what: &str, len: usize, max: usize) -> Result<(), InvalidParam> {
    if len > max {
        return Err(invalid(
            field,
            format!("at most {max} {what} are allowed, got {len}"),
        ));
    }
    Ok(())
}

impl SamplingParams {
    /// Greedy decoding of up to `max_tokens` tokens.
    pub fn greedy(max_tokens: usize) -> Self {
        Self {
            temperature: 0.0,
            max_tokens: Some(max_tokens),
            ..Self::default()
        }
    }

    /// True when sampling reduces to arg-max.
    pub fn is_greedy(&self) -> bool {
        self.temperature < 1e-5
    }

    /// Checks every range; the one validation path shared by HTTP, Python and the CLI.
    pub fn validate(&self, vocab_size: usize) -> Result<(), InvalidParam> {
        if self.n == 0 || self.n > MAX_N {
            return Err(invalid(
                "n",
                format!("must be in [1, {MAX_N}], got {}", self.n),
            ));
        }
        if !self.temperature.is_finite() || self.temperature < 0.0 || self.temperature > 100.0 {
            return Err(invalid(
                "temperature",
                format!("must be in [0, 100], got {}", self.temperature),
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(invalid(
                "top_p",
                format!("must be in (0, 1], got {}", self.top_p),
            ));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(invalid(
                "min_p",
                format!("must be in [0, 1], got {}", self.min_p),
            ));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty <= 100.0) {
            return Err(invalid(
                "repetition_penalty",
                format!("must be in (0, 100], got {}", self.repetition_penalty),
            ));
        }
        for (field, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(invalid(field, format!("must be in [-2, 2], got {v}")));
            }
        }
        at_most(
            "logit_bias",
            "entries",
            self.logit_bias.len(),
            MAX_LOGIT_BIAS,
        )?;
        for (&tok, &bias) in &self.logit_bias {
            if tok as usize >= vocab_size {
                return Err(invalid(
                    "logit_bias",
                    format!("token id {tok} is out of vocabulary (size {vocab_size})"),
                ));
            }
            if !(-100.0..=100.0).contains(&bias) {
                return Err(invalid(
                    "logit_bias",
                    format!("bias must be in [-100, 100], got {bias}"),
                ));
            }
        }
        if let Some(m) = self.max_tokens {
            if m == 0 {
                return Err(invalid("max_tokens", "must be at least 1"));
            }
            if self.min_tokens > m {
                return Err(invalid(
                    "min_tokens",
                    format!("must be at most max_tokens ({m}), got {}", self.min_tokens),
                ));
            }
        }
        at_most("stop", "stop strings", self.stop.len(), MAX_STOP_STRINGS)?;
        if self.stop.iter().any(|s| s.is_empty()) {
            return Err(invalid("stop", "stop strings must not be empty"));
        }
        if let Some(s) = self.stop.iter().find(|s| s.len() > MAX_STOP_STRING_BYTES) {
            return Err(invalid(
                "stop",
                format!(
                    "a stop string may have at most {MAX_STOP_STRING_BYTES} bytes, got {}",
                    s.len()
                ),
            ));
        }
        at_most(
            "stop_token_ids",
            "ids",
            self.stop_token_ids.len(),
            MAX_STOP_TOKEN_IDS,
        )?;
        for &t in &self.stop_token_ids {
            if t as usize >= vocab_size {
                return Err(invalid(
                    "stop_token_ids",
                    format!("token id {t} is out of vocabulary (size {vocab_size})"),
                ));
            }
        }
        for (field, v) in [
            ("logprobs", self.logprobs),
            ("prompt_logprobs", self.prompt_logprobs),
        ] {
            if let Some(k) = v {
                if k > MAX_LOGPROBS {
                    return Err(invalid(
                        field,
                        format!("must be at most {MAX_LOGPROBS}, got {k}"),
                    ));
                }
            }
        }
        if let Some(s) = &self.structured_outputs {
            s.validate()?;
        }
        Ok(())
    }
}

/// Why a completion ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS, a stop token or a stop string.
    Stop,
    /// `max_tokens` or the model's context length.
    Length,
    /// Aborted by the caller.
    Abort,
}

impl FinishReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// The log-probability of one token plus the top alternatives at that position.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub token_id: u32,
    pub logprob: f32,
    /// Top alternatives, most likely first: (token id, logprob).
    pub top: Vec<(u32, f32)>,
    /// 1 + the number of tokens more likely than this one, where it was computed (prompt
    /// logprobs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<u32>,
}

/// What a request is asked to do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineRequest {
    pub prompt_token_ids: Vec<u32>,
    pub params: SamplingParams,
    /// The LoRA adapter to apply, by its registered name (`None`: the base model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<String>,
    /// Keeps the request's cached prefix blocks apart from other salts' (vLLM's `cache_salt`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_salt: Option<String>,
    /// The prompt's images, preprocessed, with their placeholder spans in
    /// `prompt_token_ids` (see [`crate::multimodal::Processor::expand`]).
    #[serde(skip)]
    pub mm: Option<std::sync::Arc<crate::multimodal::MmPrompt>>,
}

/// One completion's state, as reported in a [`RequestOutput`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionOutput {
    pub index: usize,
    /// All text generated so far (stop strings removed unless asked for).
    pub text: String,
    /// The text the last [`RequestDelta`] applied added.
    pub delta: String,
    pub token_ids: Vec<u32>,
    pub cumulative_logprob: f32,
    /// One entry per generated token when `logprobs` was asked for.
    pub logprobs: Option<Vec<TokenLogprob>>,
    pub finish_reason: Option<FinishReason>,
    /// The stop string or stop token id that ended the completion, if any.
    pub stop_reason: Option<StopReason>,
}

/// What exactly stopped a completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum StopReason {
    Token(u32),
    Text(String),
}

/// What engine steps added to one completion since the last [`RequestDelta`] its reader took.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionDelta {
    pub index: usize,
    /// New text (stop strings removed unless asked for).
    pub text: String,
    /// New token ids.
    pub token_ids: Vec<u32>,
    /// One entry per new token when `logprobs` was asked for, else empty.
    pub logprobs: Vec<TokenLogprob>,
    /// Of every token so far.
    pub cumulative_logprob: f32,
    pub finish_reason: Option<FinishReason>,
    pub stop_reason: Option<StopReason>,
}

/// What the engine reports of a request: only what is new. Deltas a slow reader has not taken
/// yet are merged into one ([`RequestDelta::merge`]), so a request's queue never holds more than
/// its own output; [`RequestOutput::apply`] assembles them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestDelta {
    pub request_id: RequestId,
    /// New entries of the prompt logprobs (the first entry of all is `None`).
    pub prompt_logprobs: Vec<Option<TokenLogprob>>,
    /// The completions that changed, by `index`.
    pub outputs: Vec<CompletionDelta>,
    pub finished: bool,
    /// Seconds from arrival to the first scheduled step (once known).
    pub queue_time: Option<f64>,
    /// Prompt tokens found in the prefix cache (sent with the first scheduled step).
    #[serde(default)]
    pub num_cached_tokens: Option<usize>,
}

impl RequestDelta {
    /// Appends `later` to this delta.
    pub fn merge(&mut self, later: RequestDelta) {
        self.prompt_logprobs.extend(later.prompt_logprobs);
        for c in later.outputs {
            match self.outputs.iter_mut().find(|o| o.index == c.index) {
                Some(o) => {
                    o.text.push_str(&c.text);
                    o.token_ids.extend(c.token_ids);
                    o.logprobs.extend(c.logprobs);
                    o.cumulative_logprob = c.cumulative_logprob;
                    o.finish_reason = c.finish_reason.or(o.finish_reason);
                    if c.stop_reason.is_some() {
                        o.stop_reason = c.stop_reason;
                    }
                }
                None => self.outputs.push(c),
            }
        }
        self.finished |= later.finished;
        self.queue_time = self.queue_time.or(later.queue_time);
        self.num_cached_tokens = self.num_cached_tokens.or(later.num_cached_tokens);
    }

    pub fn num_new_tokens(&self) -> usize {
        self.outputs.iter().map(|o| o.token_ids.len()).sum()
    }
}

/// A request's progress assembled from its deltas.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestOutput {
    pub request_id: RequestId,
    pub prompt_token_ids: Vec<u32>,
    /// Logprobs of each prompt token given its prefix (the first entry is `None`).
    pub prompt_logprobs: Option<Vec<Option<TokenLogprob>>>,
    pub outputs: Vec<CompletionOutput>,
    pub finished: bool,
    /// Seconds from arrival to the first scheduled step.
    pub queue_time: Option<f64>,
    /// Prompt tokens that were found in the prefix cache instead of computed.
    #[serde(default)]
    pub num_cached_tokens: Option<usize>,
}

impl RequestOutput {
    /// A request with nothing generated yet.
    pub fn new(request_id: RequestId, prompt_token_ids: Vec<u32>, params: &SamplingParams) -> Self {
        Self {
            request_id,
            prompt_token_ids,
            prompt_logprobs: params.prompt_logprobs.map(|_| Vec::new()),
            outputs: (0..params.n)
                .map(|index| CompletionOutput {
                    index,
                    text: String::new(),
                    delta: String::new(),
                    token_ids: Vec::new(),
                    cumulative_logprob: 0.0,
                    logprobs: params.logprobs.map(|_| Vec::new()),
                    finish_reason: None,
                    stop_reason: None,
                })
                .collect(),
            finished: false,
            queue_time: None,
            num_cached_tokens: None,
        }
    }

    /// Adds a delta: text and tokens are appended, and each completion's `delta` becomes the text
    /// this delta added to it.
    pub fn apply(&mut self, d: &RequestDelta) {
        if let Some(p) = self.prompt_logprobs.as_mut() {
            p.extend(d.prompt_logprobs.iter().cloned());
        }
        for o in &mut self.outputs {
            o.delta.clear();
        }
        for c in &d.outputs {
            let Some(o) = self.outputs.get_mut(c.index) else {
                continue;
            };
            o.text.push_str(&c.text);
            o.delta.push_str(&c.text);
            o.token_ids.extend_from_slice(&c.token_ids);
            if let Some(l) = o.logprobs.as_mut() {
                l.extend(c.logprobs.iter().cloned());
            }
            o.cumulative_logprob = c.cumulative_logprob;
            o.finish_reason = c.finish_reason.or(o.finish_reason);
            if c.stop_reason.is_some() {
                o.stop_reason = c.stop_reason.clone();
            }
        }
        self.finished |= d.finished;
        self.queue_time = self.queue_time.or(d.queue_time);
        self.num_cached_tokens = self.num_cached_tokens.or(d.num_cached_tokens);
    }

    pub fn num_generated_tokens(&self) -> usize {
        self.outputs.iter().map(|o| o.token_ids.len()).sum()
    }
}
