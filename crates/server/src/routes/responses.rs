//! `POST /v1/responses`: the OpenAI Responses API for text. `input` (a string or message items)
//! and `instructions` go through the chat template; the reply is one `message` output item.
//! Streaming sends the typed events (`response.created`, `response.output_text.delta`, ...,
//! `response.completed`). Nothing is stored, so `previous_response_id` is refused.

use super::stream::Tracked;
use super::{parse_body, Shared};
use crate::openai::error::ApiError;
use crate::openai::params::{chat_prompt, check_text_fits, sampling_params, validate, TextLen};
use crate::openai::parse::parse_value;
use crate::openai::types::{ChatMessage, CommonFields};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use rserve_core::request::{FinishReason, RequestOutput};
use rserve_core::EngineRequest;
use serde::Deserialize;
use serde_json::{json, Value};
use std::convert::Infallible;
use utoipa::ToSchema;

/// `input`: a string (one user message) or a list of message items.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged, expecting = "a string or a list of input items")]
pub enum ResponsesInput {
    Text(String),
    Items(Vec<Value>),
}

/// `POST /v1/responses`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ResponsesRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub input: ResponsesInput,
    /// A system message placed before the input.
    #[serde(default)]
    pub instructions: Option<String>,
    #[serde(default)]
    #[schema(minimum = 1)]
    pub max_output_tokens: Option<i64>,
    #[serde(default)]
    #[schema(minimum = 0.0)]
    pub temperature: Option<f64>,
    #[serde(default)]
    #[schema(exclusive_minimum = 0.0, maximum = 1.0)]
    pub top_p: Option<f64>,
    #[serde(default)]
    pub stream: Option<bool>,
    /// vLLM's prefix-cache salt: requests share cached prompt blocks only with requests of the
    /// same salt (a non-empty string).
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// Not served: responses are not stored.
    #[serde(default)]
    pub previous_response_id: Option<String>,
    /// Accepted; nothing is stored either way (the response says `store: false`).
    #[serde(default)]
    pub store: Option<bool>,
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    /// `{"format": {"type": "text"}}` only.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub text: Option<Value>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub reasoning: Option<Value>,
    #[serde(default)]
    pub include: Option<Vec<String>>,
    #[serde(default)]
    pub background: Option<bool>,
    #[serde(default)]
    pub truncation: Option<String>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Value>,
    #[serde(default)]
    pub user: Option<String>,
}

fn refuse(field: &str, why: &str) -> ApiError {
    ApiError::bad_request(format!("`{field}` {why}")).with_param(field)
}

/// Refuses what is not served rather than dropping it.
fn refuse_unserved(r: &ResponsesRequest) -> Result<(), ApiError> {
    if r.previous_response_id.is_some() {
        return Err(refuse(
            "previous_response_id",
            "is not supported: responses are not stored; send the whole conversation as `input`",
        ));
    }
    if r.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(refuse("tools", "are not supported yet"));
    }
    if r.tool_choice
        .as_ref()
        .is_some_and(|c| !c.is_null() && c != "none" && c != "auto")
    {
        return Err(refuse(
            "tool_choice",
            "needs `tools`, which are not supported yet",
        ));
    }
    let format = r.text.as_ref().and_then(|t| t.get("format"));
    if let Some(kind) = format.map(|f| f.get("type").and_then(Value::as_str).unwrap_or("")) {
        if kind != "text" {
            return Err(refuse(
                "text",
                "formats other than `text` are not supported yet",
            ));
        }
    }
    if r.reasoning.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(refuse("reasoning", "is not supported by this model"));
    }
    if r.include.as_ref().is_some_and(|v| !v.is_empty()) {
        return Err(refuse("include", "is not supported"));
    }
    if r.background.unwrap_or(false) {
        return Err(refuse(
            "background",
            "is not supported: responses are not stored",
        ));
    }
    if r.truncation.as_deref().is_some_and(|t| t != "disabled") {
        return Err(refuse("truncation", "must be `disabled`"));
    }
    Ok(())
}

/// One input item -> a chat message.
fn item_message(i: usize, item: &Value) -> Result<ChatMessage, ApiError> {
    let bad = |why: String| ApiError::bad_request(format!("input[{i}]: {why}")).with_param("input");
    let kind = item
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("message");
    if kind != "message" {
        return Err(bad(format!("items of type `{kind}` are not supported")));
    }
    let role = item.get("role").and_then(Value::as_str).unwrap_or("");
    if !["user", "system", "developer", "assistant"].contains(&role) {
        return Err(bad(format!(
            "`role` must be user, system, developer or assistant, got `{role}`"
        )));
    }
    let content = match item.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for p in parts {
                let t = p.get("type").and_then(Value::as_str).unwrap_or("");
                match (t, p.get("text").and_then(Value::as_str)) {
                    ("input_text" | "output_text" | "text", Some(text)) => texts.push(text),
                    _ => {
                        return Err(bad(format!(
                            "content parts of type `{t}` are not supported"
                        )))
                    }
                }
            }
            texts.concat()
        }
        _ => {
            return Err(bad(
                "`content` must be a string or a list of text parts".into()
            ))
        }
    };
    let m = json!({"role": role, "content": content});
    parse_value(m)
}

/// The conversation a request stands for.
fn messages(r: &ResponsesRequest) -> Result<Vec<ChatMessage>, ApiError> {
    let mut out = Vec::new();
    if let Some(s) = &r.instructions {
        out.push(parse_value(json!({"role": "system", "content": s}))?);
    }
    match &r.input {
        ResponsesInput::Text(s) => out.push(parse_value(json!({"role": "user", "content": s}))?),
        ResponsesInput::Items(items) => {
            for (i, item) in items.iter().enumerate() {
                out.push(item_message(i, item)?);
            }
        }
    }
    Ok(out)
}

/// A finished response's text, finish and token counts.
struct Done<'a> {
    text: &'a str,
    finish: Option<FinishReason>,
    input: usize,
    output: usize,
    /// Input tokens found in the prefix cache.
    cached: usize,
}

impl<'a> Done<'a> {
    fn of(text: &'a str, out: &RequestOutput, input: usize) -> Self {
        let c = out.outputs.first();
        Self {
            text,
            finish: c.and_then(|c| c.finish_reason),
            input,
            output: out.num_generated_tokens(),
            cached: out.num_cached_tokens.unwrap_or(0),
        }
    }
}

/// The parts of the response object fixed at the start.
struct Head {
    id: String,
    msg_id: String,
    created: u64,
    model: String,
    request: Value,
}

impl Head {
    fn message(&self, text: &str, status: &str) -> Value {
        json!({
            "type": "message", "id": self.msg_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
        })
    }

    /// The response object, final once `done`.
    fn response(&self, done: Option<Done<'_>>) -> Value {
        let mut r = json!({
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": "in_progress", "output": [], "error": null, "incomplete_details": null,
            "parallel_tool_calls": false, "tool_choice": "none", "tools": [], "store": false,
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "usage": null,
        });
        for k in [
            "instructions",
            "max_output_tokens",
            "temperature",
            "top_p",
            "metadata",
            "user",
        ] {
            r[k] = self.request.get(k).cloned().unwrap_or(Value::Null);
        }
        if let Some(Done {
            text,
            finish,
            input,
            output,
            cached,
        }) = done
        {
            let cut = finish == Some(FinishReason::Length);
            let status = if cut { "incomplete" } else { "completed" };
            r["status"] = json!(status);
            if cut {
                r["incomplete_details"] = json!({"reason": "max_output_tokens"});
            }
            r["output"] = json!([self.message(text, status)]);
            r["usage"] = json!({
                "input_tokens": input, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": input + output,
            });
        }
        r
    }
}

/// `POST /v1/responses`.
#[utoipa::path(
    post,
    path = "/v1/responses",
    request_body = ResponsesRequest,
    responses(
        (status = 200, description = "A response object, or its events as server-sent events with `stream`"),
        (status = 400, description = "Invalid request"),
        (status = 404, description = "Unknown model")
    )
)]
pub async fn responses(
    State(st): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let raw: Value = parse_body(body)?;
    let req: ResponsesRequest = parse_value(raw.clone())?;
    let adapter = st.check_model(req.model.as_deref())?;
    let info = st.engine()?.info().clone();
    refuse_unserved(&req)?;
    if let Some(m) = req.max_output_tokens.filter(|&m| m < 1) {
        return Err(refuse(
            "max_output_tokens",
            &format!("must be at least 1, got {m}"),
        ));
    }
    let common = CommonFields {
        max_tokens: req.max_output_tokens,
        temperature: req.temperature,
        top_p: req.top_p,
        cache_salt: req.cache_salt.clone(),
        ..CommonFields::default()
    };
    let cache_salt = common.cache_salt()?;
    let params = sampling_params(&common, &info, None)?;
    validate(&params, &info)?;
    let msgs = messages(&req)?;
    check_text_fits(TextLen::of_messages(&msgs), &info, "input")?;
    let work = info.clone();
    let (_, prompt_ids) = st
        .blocking(move || chat_prompt(&work, &msgs, true, None, None))
        .await?;
    let tracked = st
        .submit(EngineRequest {
            prompt_token_ids: prompt_ids,
            params,
            lora: adapter.clone(),
            cache_salt,
            mm: None,
        })
        .await?;
    let head = Head {
        id: format!("resp_{}", super::misc::random_id()),
        msg_id: format!("msg_{}", super::misc::random_id()),
        created: super::misc::now(),
        model: st.response_model(&adapter),
        request: raw,
    };
    if req.stream.unwrap_or(false) {
        return Ok(stream_events(head, tracked));
    }
    let prompt_len = tracked.prompt_len;
    let out = tracked.finish().await?;
    let text = out.outputs.first().map_or("", |c| c.text.as_str());
    let done = Some(Done::of(text, &out, prompt_len));
    Ok(Json(head.response(done)).into_response())
}

/// Numbers events in order.
struct Events {
    seq: u64,
    out: Vec<Event>,
}

impl Events {
    fn push(&mut self, kind: &str, mut v: Value) {
        v["type"] = json!(kind);
        v["sequence_number"] = json!(self.seq);
        self.seq += 1;
        self.out
            .push(Event::default().event(kind).data(v.to_string()));
    }
}

struct Progress {
    head: Head,
    tracked: Tracked,
    text: String,
    seq: u64,
    started: bool,
    ended: bool,
}

fn stream_events(head: Head, tracked: Tracked) -> Response {
    let init = Progress {
        head,
        tracked,
        text: String::new(),
        seq: 0,
        started: false,
        ended: false,
    };
    let s = stream::unfold(init, |mut p| async move {
        if p.ended {
            return None;
        }
        let mut ev = Events {
            seq: p.seq,
            out: Vec::new(),
        };
        let part = json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []});
        let at = json!({"item_id": p.head.msg_id, "output_index": 0, "content_index": 0});
        if !p.started {
            p.started = true;
            let r = p.head.response(None);
            ev.push("response.created", json!({"response": r}));
            ev.push("response.in_progress", json!({"response": r}));
            let item = json!({"type": "message", "id": p.head.msg_id, "status": "in_progress", "role": "assistant", "content": []});
            ev.push(
                "response.output_item.added",
                json!({"output_index": 0, "item": item}),
            );
            let mut v = at.clone();
            v["part"] = part.clone();
            ev.push("response.content_part.added", v);
        }
        match p.tracked.next().await {
            Some(Ok(delta)) => {
                if let Some(c) = delta.outputs.iter().find(|c| c.index == 0) {
                    if !c.text.is_empty() {
                        p.text.push_str(&c.text);
                        let mut v = at.clone();
                        v["delta"] = json!(c.text);
                        v["logprobs"] = json!([]);
                        ev.push("response.output_text.delta", v);
                    }
                    if let Some(f) = c.finish_reason {
                        p.ended = true;
                        finish(&mut ev, &p, &at, Some(f));
                    }
                }
            }
            Some(Err(e)) => {
                p.ended = true;
                let e = ApiError::from(e);
                ev.push(
                    "error",
                    json!({"code": e.status.as_u16().to_string(), "message": e.message, "param": e.param}),
                );
            }
            None => {
                // the stream ended without a finish: the engine stopped
                p.ended = true;
                let message = "the engine stopped before the response was complete";
                ev.push(
                    "error",
                    json!({"code": "503", "message": message, "param": null}),
                );
                let mut r = p.head.response(None);
                r["status"] = json!("failed");
                r["error"] = json!({"code": "server_error", "message": message});
                ev.push("response.failed", json!({"response": r}));
            }
        }
        p.seq = ev.seq;
        Some((ev.out, p))
    });
    let body = s.flat_map(|v| stream::iter(v.into_iter().map(Ok::<Event, Infallible>)));
    Sse::new(body).into_response()
}

/// The closing events: text done, part done, item done, then the response.
fn finish(ev: &mut Events, p: &Progress, at: &Value, f: Option<FinishReason>) {
    let status = if f == Some(FinishReason::Length) {
        "incomplete"
    } else {
        "completed"
    };
    let mut v = at.clone();
    v["text"] = json!(p.text);
    v["logprobs"] = json!([]);
    ev.push("response.output_text.done", v);
    let mut v = at.clone();
    v["part"] = json!({"type": "output_text", "text": p.text, "annotations": [], "logprobs": []});
    ev.push("response.content_part.done", v);
    let item = p.head.message(&p.text, status);
    ev.push(
        "response.output_item.done",
        json!({"output_index": 0, "item": item}),
    );
    let mut done = Done::of(&p.text, p.tracked.output(), p.tracked.prompt_len);
    done.finish = f;
    let r = p.head.response(Some(done));
    let kind = if status == "incomplete" {
        "response.incomplete"
    } else {
        "response.completed"
    };
    ev.push(kind, json!({"response": r}));
}
