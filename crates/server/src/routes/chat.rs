//! `POST /v1/chat/completions`: messages -> chat template -> engine; JSON or SSE responses in
//! OpenAI's shape, logprobs as `choices[i].logprobs.content`.

use super::choices::{keep_best, prompt_logprobs_json};
use super::stream::{sse_response, usage_json, ChunkFormat};
use super::{parse_body, Shared};
use crate::openai::error::ApiError;
use crate::openai::params::{
    chat_prompt, check_text_fits, logprobs_count, requested_n, sampling_params, text_format,
    validate, TextLen,
};
use crate::openai::types::{ChatCompletionRequest, ChatMessage};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use rserve_core::request::{CompletionDelta, TokenLogprob};
use rserve_core::tokenizer::Tokenizer;
use rserve_core::EngineRequest;
use serde_json::{json, Value};
use std::sync::Arc;

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
}

impl ChatFormat {
    fn chunk(&self, choices: Value) -> Value {
        json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model, "choices": choices})
    }
}

impl ChunkFormat for ChatFormat {
    fn opening(&self, index: usize) -> Option<Value> {
        Some(self.chunk(json!([{"index": index, "delta": {"role": "assistant", "content": self.echo}, "logprobs": null, "finish_reason": null}])))
    }

    fn content(&self, index: usize, out: &CompletionDelta, _first: bool) -> Value {
        let new_lps = &out.logprobs;
        let logprobs = if self.want_logprobs {
            logprobs_content(&self.tokenizer, new_lps, self.as_ids)
        } else {
            Value::Null
        };
        let delta = if out.text.is_empty() && out.finish_reason.is_some() {
            json!({})
        } else {
            json!({"content": out.text})
        };
        self.chunk(json!([{
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason.map(|f| f.as_str()),
            "stop_reason": out.stop_reason,
        }]))
    }

    fn usage(&self, usage: Value) -> Value {
        let mut c = self.chunk(json!([]));
        c["usage"] = usage;
        c
    }
}

/// Refuses the fields this server does not serve (rather than dropping them).
fn refuse_unserved(req: &ChatCompletionRequest) -> Result<(), ApiError> {
    text_format(req.response_format.as_ref())?;
    let has_tools = req.tools.as_ref().is_some_and(|t| !t.is_empty());
    if has_tools {
        return Err(ApiError::bad_request("tools are not supported yet").with_param("tools"));
    }
    if req
        .tool_choice
        .as_ref()
        .is_some_and(|c| !c.is_null() && c != "none")
    {
        return Err(
            ApiError::bad_request("When using `tool_choice`, `tools` must be set.")
                .with_param("tool_choice"),
        );
    }
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
    let mut params = sampling_params(&req.common, &info, None)?;
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
    };
    let stream = req.common.stream.unwrap_or(false);
    let include_usage = req
        .common
        .stream_options
        .as_ref()
        .is_some_and(|o| o.include_usage);
    let want_prompt_logprobs = params.prompt_logprobs.is_some();
    let (messages, kwargs) = (req.messages, req.chat_template_kwargs);
    let work = info.clone();
    let (_, prompt_ids) = st
        .blocking(move || chat_prompt(&work, &messages, add_gen, kwargs.as_ref()))
        .await?;
    let samples = params.n;
    let tracked = st.submit(EngineRequest {
        prompt_token_ids: prompt_ids,
        params,
        lora: adapter.clone(),
        cache_salt,
    })?;
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
            json!({
                "index": c.index,
                "message": {"role": "assistant", "content": format!("{}{}", fmt.echo, c.text)},
                "logprobs": if want_logprobs { logprobs_content(&fmt.tokenizer, c.logprobs.as_deref().unwrap_or(&[]), fmt.as_ids) } else { Value::Null },
                "finish_reason": c.finish_reason.map(|f| f.as_str()),
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
