//! `POST /v1/chat/completions`: messages -> chat template -> engine; JSON or SSE responses in
//! OpenAI's shape, logprobs as `choices[i].logprobs.content`.

use super::choices::{keep_best, prompt_logprobs_json};
use super::stream::{sse_response, usage_json, ChunkFormat};
use super::{parse_body, Shared};
use crate::openai::error::ApiError;
use crate::openai::media::chat_inputs;
use crate::openai::params::{
    check_text_fits, logprobs_count, requested_n, sampling_params, validate, TextLen,
};
use crate::openai::structured::{constraint, field_of};
use crate::openai::tool_choice::{self, call_id, ReplyStream, ToolMode};
use crate::openai::tools::{StreamEvent, ToolCall};
use crate::openai::types::{ChatCompletionRequest, ChatMessage};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use rserve_core::request::{CompletionDelta, FinishReason, TokenLogprob};
use rserve_core::tokenizer::Tokenizer;
use rserve_core::EngineRequest;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;

/// A token's text for logprobs: its decoded piece, or `token_id:N` when asked for.
pub fn token_text(tok: &Tokenizer, id: u32, as_ids: bool) -> String {
    if as_ids {
        return format!("token_id:{id}");
    }
    tok.decode(&[id], false).unwrap_or_default()
}

fn logprob_entry(tok: &Tokenizer, id: u32, lp: f32, as_ids: bool) -> Value {
    let t = token_text(tok, id, as_ids);
    let bytes: Vec<u8> = t.as_bytes().to_vec();
    json!({"token": t, "logprob": lp, "bytes": bytes})
}

fn logprobs_content(tok: &Tokenizer, lps: &[TokenLogprob], as_ids: bool) -> Value {
    let content: Vec<Value> = lps
        .iter()
        .map(|l| {
            let mut e = logprob_entry(tok, l.token_id, l.logprob, as_ids);
            e["top_logprobs"] = Value::Array(
                l.top
                    .iter()
                    .map(|&(id, lp)| logprob_entry(tok, id, lp, as_ids))
                    .collect(),
            );
            e
        })
        .collect();
    json!({ "content": content })
}

struct ChatFormat {
    id: String,
    created: u64,
    model: String,
    tokenizer: Arc<Tokenizer>,
    want_logprobs: bool,
    as_ids: bool,
    /// The text `echo` puts before the reply.
    echo: String,
    tools: ToolMode,
    /// Each streamed choice's reader of tool calls, and the ids it minted.
    replies: Mutex<HashMap<usize, (ReplyStream, Vec<String>)>>,
}

impl ChatFormat {
    fn chunk(&self, choices: Value) -> Value {
        json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model, "choices": choices})
    }

    /// A streamed delta's content and `tool_calls` entries (text held back by a tool-call reader
    /// comes later), and whether this choice called a tool.
    fn reply_delta(&self, index: usize, text: &str, finishing: bool) -> (String, Vec<Value>, bool) {
        if self.tools == ToolMode::Off {
            return (text.to_owned(), Vec::new(), false);
        }
        let Ok(mut replies) = self.replies.lock() else {
            return (text.to_owned(), Vec::new(), false);
        };
        let (reader, ids) = replies
            .entry(index)
            .or_insert_with(|| (self.tools.streamer(), Vec::new()));
        let mut events = reader.push(text);
        if finishing {
            events.extend(reader.finish());
        }
        let (mut content, mut calls) = (String::new(), Vec::new());
        for e in events {
            match e {
                StreamEvent::Content(c) => content.push_str(&c),
                StreamEvent::CallStart { index, name } => {
                    let id = call_id();
                    ids.push(id.clone());
                    calls.push(json!({"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}));
                }
                StreamEvent::Arguments { index, text } => {
                    calls.push(json!({"index": index, "function": {"arguments": text}}));
                }
            }
        }
        (content, calls, reader.called())
    }
}

/// A finished call as OpenAI's `tool_calls` entry.
fn tool_call_json(c: &ToolCall) -> Value {
    json!({"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}})
}

/// The finish reason a reply reports: `tool_calls` when it called tools and ended by itself.
fn finish_reason(
    tools: &ToolMode,
    called: bool,
    reason: Option<FinishReason>,
) -> Option<&'static str> {
    match reason {
        Some(FinishReason::Stop) if called && tools.reports_tool_calls() => Some("tool_calls"),
        r => r.map(|f| f.as_str()),
    }
}

impl ChunkFormat for ChatFormat {
    fn opening(&self, index: usize) -> Option<Value> {
        Some(self.chunk(json!([{"index": index, "delta": {"role": "assistant", "content": self.echo}, "logprobs": null, "finish_reason": null}])))
    }

    fn content(
        &self,
        index: usize,
        out: &CompletionDelta,
        _first: Option<&[Option<TokenLogprob>]>,
    ) -> Option<Value> {
        let new_lps = &out.logprobs;
        let logprobs = if self.want_logprobs {
            logprobs_content(&self.tokenizer, new_lps, self.as_ids)
        } else {
            Value::Null
        };
        let finishing = out.finish_reason.is_some();
        let (text, calls, called) = self.reply_delta(index, &out.text, finishing);
        if text.is_empty() && calls.is_empty() && !finishing && new_lps.is_empty() {
            return None;
        }
        let mut delta = json!({});
        if !text.is_empty() || (calls.is_empty() && !finishing) {
            delta["content"] = json!(text);
        }
        if !calls.is_empty() {
            delta["tool_calls"] = Value::Array(calls);
        }
        Some(self.chunk(json!([{
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason(&self.tools, called, out.finish_reason),
            "stop_reason": out.stop_reason,
        }])))
    }

    fn usage(&self, usage: Value) -> Value {
        let mut c = self.chunk(json!([]));
        c["usage"] = usage;
        c
    }
}

/// Refuses the fields this server does not serve (rather than dropping them).
fn refuse_unserved(req: &ChatCompletionRequest) -> Result<(), ApiError> {
    for (field, v) in [
        ("functions", &req.functions),
        ("function_call", &req.function_call),
    ] {
        if v.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(ApiError::bad_request(format!(
                "`{field}` (legacy function calling) is not supported"
            ))
            .with_param(field));
        }
    }
    if req.chat_template.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(ApiError::bad_request(
            "`chat_template` in a request is not served: the chat template is the server's \
             (`--chat-template` at start)",
        )
        .with_param("chat_template"));
    }
    if let Some(m) = req
        .modalities
        .as_ref()
        .and_then(|m| m.iter().find(|m| *m != "text"))
    {
        return Err(ApiError::bad_request(format!(
            "modalities: only `text` output is served, not `{m}`"
        ))
        .with_param("modalities"));
    }
    Ok(())
}

/// The text `echo` repeats: the last message's, when it is the assistant's.
fn echo_text(req: &ChatCompletionRequest) -> String {
    let last: Option<&ChatMessage> = req.messages.last();
    match last {
        Some(m) if req.echo.unwrap_or(false) && m.role == "assistant" => match &m.content {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n"),
            _ => String::new(),
        },
        _ => String::new(),
    }
}

/// `POST /v1/chat/completions`.
#[utoipa::path(
    post,
    path = "/v1/chat/completions",
    request_body = ChatCompletionRequest,
    responses(
        (status = 200, description = "A chat completion, or its chunks as server-sent events with `stream`"),
        (status = 400, description = "Invalid request"),
        (status = 404, description = "Unknown model"),
        (status = 503, description = "Loading or at capacity")
    )
)]
pub async fn chat_completions(
    State(st): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: ChatCompletionRequest = parse_body(body)?;
    let adapter = st.check_model(req.common.model.as_deref())?;
    let engine = st.engine()?;
    let info = engine.info().clone();
    refuse_unserved(&req)?;
    let tools = tool_choice::plan(
        req.tools.as_deref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
        st.edge.auto_tools,
    )?;
    let mut params = sampling_params(&req.common, &info, None)?;
    params.structured_outputs = constraint(&req.common, req.response_format.as_ref())?;
    let mut grammar_field = field_of(&req.common, req.response_format.as_ref());
    if let Some(c) = tools.constraint.clone() {
        if params.structured_outputs.is_some() {
            return Err(ApiError::bad_request(format!(
                "`{grammar_field}` cannot be combined with a required or named tool_choice"
            ))
            .with_param("tool_choice"));
        }
        params.structured_outputs = Some(c);
        grammar_field = "tools";
    }
    if let ToolMode::Auto { parser, .. } = &tools.mode {
        // their markers are special tokens: the parser has to see them
        if !matches!(parser, crate::openai::tools::ToolParser::Hermes) {
            params.skip_special_tokens = false;
        }
    }
    let n = requested_n(&req.common)?;
    let by = if params.n > n { "best_of" } else { "n" };
    st.check_choices(1, params.n, by)?;
    if let Some(m) = req.max_completion_tokens {
        if m < 1 {
            return Err(ApiError::bad_request(format!(
                "max_completion_tokens: must be at least 1, got {m}"
            ))
            .with_param("max_completion_tokens"));
        }
        params.max_tokens = Some(m as usize);
    }
    let want_logprobs = req.logprobs.unwrap_or(false);
    match (want_logprobs, req.top_logprobs) {
        (true, k) => params.logprobs = Some(logprobs_count("top_logprobs", k.unwrap_or(0))?),
        (false, Some(k)) if k > 0 => {
            return Err(
                ApiError::bad_request("top_logprobs requires logprobs to be true")
                    .with_param("top_logprobs"),
            );
        }
        _ => {}
    }
    validate(&params, &info)?;
    let cache_salt = req.common.cache_salt()?;
    check_text_fits(TextLen::of_messages(&req.messages), &info, "messages")?;
    let add_gen =
        req.add_generation_prompt.unwrap_or(true) && !req.continue_final_message.unwrap_or(false);
    let echo = echo_text(&req);
    let fmt = ChatFormat {
        id: format!("chatcmpl-{}", super::misc::random_id()),
        created: super::misc::now(),
        model: st.response_model(&adapter),
        tokenizer: info.tokenizer.clone(),
        want_logprobs,
        as_ids: req.common.return_tokens_as_token_ids.unwrap_or(false),
        echo,
        tools: tools.mode.clone(),
        replies: Mutex::new(HashMap::new()),
    };
    let stream = req.common.stream.unwrap_or(false);
    let include_usage = req
        .common
        .stream_options
        .as_ref()
        .is_some_and(|o| o.include_usage);
    let want_prompt_logprobs = params.prompt_logprobs.is_some();
    st.compile_grammar(&params, grammar_field).await?;
    let (messages, kwargs) = (req.messages, req.chat_template_kwargs);
    let work = info.clone();
    let template_tools = tools.template_tools;
    let media = st.edge.media.clone();
    let (prompt_ids, mm) = st
        .blocking(move || {
            chat_inputs(
                &work,
                &messages,
                add_gen,
                kwargs.as_ref(),
                template_tools.as_deref(),
                &media,
            )
        })
        .await?;
    let samples = params.n;
    let tracked = st
        .submit(EngineRequest {
            prompt_token_ids: prompt_ids,
            params,
            lora: adapter.clone(),
            cache_salt,
            mm,
        })
        .await?;
    if stream {
        return Ok(sse_response(
            fmt,
            vec![(tracked, 0, samples)],
            include_usage,
        ));
    }
    let prompt_len = tracked.prompt_len;
    let mut out = tracked.finish().await?;
    let completion: usize = out.num_generated_tokens();
    keep_best(&mut out, n);
    let choices: Vec<Value> = out
        .outputs
        .iter()
        .map(|c| {
            let reply = fmt.tools.reply(&c.text);
            let content = reply.content.map(|t| format!("{}{t}", fmt.echo));
            let mut message = json!({"role": "assistant", "content": content});
            if !reply.calls.is_empty() {
                message["tool_calls"] = reply.calls.iter().map(tool_call_json).collect();
            }
            json!({
                "index": c.index,
                "message": message,
                "logprobs": if want_logprobs { logprobs_content(&fmt.tokenizer, c.logprobs.as_deref().unwrap_or(&[]), fmt.as_ids) } else { Value::Null },
                "finish_reason": finish_reason(&fmt.tools, !reply.calls.is_empty(), c.finish_reason),
                "stop_reason": c.stop_reason,
            })
        })
        .collect();
    let prompt_logprobs = if want_prompt_logprobs {
        prompt_logprobs_json(
            &fmt.tokenizer,
            &out.prompt_token_ids,
            out.prompt_logprobs.as_deref(),
            fmt.as_ids,
        )
    } else {
        Value::Null
    };
    Ok(Json(json!({
        "id": fmt.id,
        "object": "chat.completion",
        "created": fmt.created,
        "model": fmt.model,
        "choices": choices,
        "usage": usage_json(prompt_len, completion, out.num_cached_tokens.unwrap_or(0)),
        "prompt_logprobs": prompt_logprobs,
    }))
    .into_response())
}
