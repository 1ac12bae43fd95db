//! Public request and output types of the engine: what callers submit and what they get back.
//!
//! These are plain serde types shared by every way into the engine (HTTP, Python, CLI). They are
//! validated once, at the edge, by [`SamplingParams::validate`]; the engine only ever sees valid ones.
//! This file owns no engine state.

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
}

/// Largest number of alternatives one may ask for in `logprobs` / `prompt_logprobs`.
pub const MAX_LOGPROBS: usize = 20;
/// Largest `n`.
pub const MAX_N: usize = 128;

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
        if self.stop.iter().any(|s| s.is_empty()) {
            return Err(invalid("stop", "stop strings must not be empty"));
        }
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
}

/// What a request is asked to do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineRequest {
    pub prompt_token_ids: Vec<u32>,
    pub params: SamplingParams,
}

/// One completion's state, as reported in a [`RequestOutput`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionOutput {
    pub index: usize,
    /// All text generated so far (stop strings removed unless asked for).
    pub text: String,
    /// Text added since the previous output of this completion.
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

/// A snapshot of a request's progress, streamed to the caller after each engine step that changed it.
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
}

impl RequestOutput {
    pub fn num_generated_tokens(&self) -> usize {
        self.outputs.iter().map(|o| o.token_ids.len()).sum()
    }
}
