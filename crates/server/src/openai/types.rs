//! Request types of the OpenAI endpoints with vLLM's extensions. Unknown fields are ignored;
//! wrong types fail to parse (a 400 naming the field, see `parse`). Ranges are checked in
//! `params`. The OpenAPI document is generated from these types.

use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;
use utoipa::ToSchema;

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged, expecting = "a string or a list of strings")]
pub enum StringOrList {
    One(String),
    Many(Vec<String>),
}

impl StringOrList {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StringOrList::One(s) => vec![s],
            StringOrList::Many(v) => v,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling fields shared by chat and completions.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct CommonFields {
    /// The served model name (absent: the served model).
    pub model: Option<String>,
    #[schema(minimum = 1)]
    pub max_tokens: Option<i64>,
    #[schema(minimum = 0.0)]
    pub temperature: Option<f64>,
    #[schema(exclusive_minimum = 0.0, maximum = 1.0)]
    pub top_p: Option<f64>,
    /// Completions per prompt.
    #[schema(minimum = 1)]
    pub n: Option<i64>,
    /// vLLM's `best_of`: sample this many completions per prompt, return the `n` with the highest
    /// cumulative log-probability. Not with `stream`.
    #[schema(minimum = 1)]
    pub best_of: Option<i64>,
    pub stop: Option<StringOrList>,
    pub seed: Option<i64>,
    #[schema(minimum = -2.0, maximum = 2.0)]
    pub presence_penalty: Option<f64>,
    #[schema(minimum = -2.0, maximum = 2.0)]
    pub frequency_penalty: Option<f64>,
    /// Token id (as a string) -> bias added to its logit.
    pub logit_bias: Option<BTreeMap<String, f64>>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub user: Option<String>,
    // vLLM extensions
    /// -1 or 0: no top-k.
    #[schema(minimum = -1)]
    pub top_k: Option<i64>,
    #[schema(minimum = 0.0, maximum = 1.0)]
    pub min_p: Option<f64>,
    #[schema(exclusive_minimum = 0.0)]
    pub repetition_penalty: Option<f64>,
    #[schema(minimum = 0)]
    pub min_tokens: Option<i64>,
    pub ignore_eos: Option<bool>,
    pub stop_token_ids: Option<Vec<i64>>,
    pub skip_special_tokens: Option<bool>,
    pub include_stop_str_in_output: Option<bool>,
    pub return_tokens_as_token_ids: Option<bool>,
    /// vLLM's prompt logprobs: the top alternatives at each prompt position (0 to 20), returned as
    /// `prompt_logprobs` (per choice on completions, top-level on chat). Not with `stream`.
    #[schema(minimum = 0, maximum = 20)]
    pub prompt_logprobs: Option<i64>,
    /// Structured output, vLLM's older fields: a JSON schema (an object or a string holding one).
    #[schema(value_type = Option<Object>)]
    pub guided_json: Option<Value>,
    /// A regular expression the whole output matches.
    pub guided_regex: Option<String>,
    /// The output is exactly one of these strings.
    pub guided_choice: Option<Vec<String>>,
    /// A Lark grammar.
    pub guided_grammar: Option<String>,
    /// Structured output, vLLM's object: exactly one of `json`, `regex`, `choice`, `grammar`,
    /// `json_object`, and `disable_any_whitespace` (JSON is compact unless false).
    #[schema(value_type = Option<Object>)]
    pub structured_outputs: Option<rserve_core::structured::StructuredOutputs>,
    /// vLLM's prefix-cache salt: requests share cached prompt blocks only with requests of the
    /// same salt (a non-empty string).
    pub cache_salt: Option<String>,
}

impl CommonFields {
    /// The checked `cache_salt`.
    pub fn cache_salt(&self) -> Result<Option<String>, crate::openai::error::ApiError> {
        match &self.cache_salt {
            Some(s) if s.is_empty() => Err(crate::openai::error::ApiError::bad_request(
                "cache_salt must be a non-empty string",
            )
            .with_param("cache_salt")),
            other => Ok(other.clone()),
        }
    }
}

/// One chat message; `content` is a string or a list of content parts.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ChatMessage {
    /// system, developer, user, assistant or tool.
    pub role: String,
    /// A string, or a list of `{"type": "text", "text": ...}` parts.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub content: Option<Value>,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub tool_calls: Option<Value>,
    #[serde(default)]
    pub tool_call_id: Option<String>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ChatCompletionRequest {
    #[schema(min_items = 1)]
    pub messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub common: CommonFields,
    #[serde(default)]
    #[schema(minimum = 1)]
    pub max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    #[schema(minimum = 0, maximum = 20)]
    pub top_logprobs: Option<i64>,
    /// `{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema", "json_schema":
    /// {"name", "schema", "strict"}}`.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub response_format: Option<Value>,
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    /// Whether a `required` tool choice may make several calls (default true).
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    /// Legacy function calling: refused.
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub functions: Option<Value>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub function_call: Option<Value>,
    /// Output modalities: only `text`.
    #[serde(default)]
    pub modalities: Option<Vec<String>>,
    /// vLLM's chat `echo`: the reply starts with the last message's content when that message is
    /// the assistant's (a continued message).
    #[serde(default)]
    pub echo: Option<bool>,
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    #[serde(default)]
    pub continue_final_message: Option<bool>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// A template sent with the request: refused (vLLM refuses it too unless told to trust
    /// clients' templates); the server's template is set at start (`--chat-template`).
    #[serde(default)]
    #[schema(value_type = Option<String>)]
    pub chat_template: Option<Value>,
}

/// `prompt` of completions: text, texts, token ids or lists of token ids.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(
    untagged,
    expecting = "a string, a list of strings, a list of token ids or a list of lists of token ids"
)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<i64>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<i64>>),
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    #[serde(flatten)]
    pub common: CommonFields,
    /// Top alternatives per generated token (0 to 20), in the legacy shape.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 20)]
    pub logprobs: Option<i64>,
    #[serde(default)]
    pub echo: Option<bool>,
    #[serde(default)]
    pub suffix: Option<String>,
    /// As chat's: `text`, `json_object` or `json_schema`.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub response_format: Option<Value>,
}

/// `/tokenize`: a prompt or chat messages.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct TokenizeRequest {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub prompt: Option<String>,
    #[serde(default)]
    pub messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
}

/// `/detokenize`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct DetokenizeRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub tokens: Vec<i64>,
}
