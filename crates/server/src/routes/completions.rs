//! `POST /v1/completions`: one or many prompts (text or token ids), `echo`, integer `logprobs`
//! in the legacy `{tokens, token_logprobs, top_logprobs, text_offset}` shape; JSON or SSE.

use super::chat::token_text;
use super::choices::{keep_best, prompt_logprobs_json};
use super::stream::{sse_response, usage_json, ChunkFormat, Tracked};
use super::{parse_body, Shared};
use crate::openai::error::ApiError;
use crate::openai::params::{
    check_prompts_fit, completion_prompts, logprobs_count, prompt_count, requested_n,
    sampling_params, validate,
};
use crate::openai::structured::{constraint, field_of};
use crate::openai::types::CompletionRequest;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use rserve_core::request::{CompletionDelta, TokenLogprob};
use rserve_core::tokenizer::Tokenizer;
use rserve_core::EngineRequest;
use serde_json::{json, Map, Value};
use std::sync::Arc;

/// Legacy logprobs for a run of tokens whose text starts at `offset` (in characters).
fn legacy_logprobs(
    tok: &Tokenizer,
    lps: &[Option<TokenLogprob>],
    ids: &[u32],
    offset: usize,
    as_ids: bool,
) -> Value {
    let mut tokens = Vec::new();
    let mut token_logprobs = Vec::new();
    let mut top = Vec::new();
    let mut offsets = Vec::new();
    let mut at = offset;
    for (i, &id) in ids.iter().enumerate() {
        let text = token_text(tok, id, as_ids);
        offsets.push(at);
        at += text.chars().count();
        tokens.push(Value::String(text));
        match lps.get(i).and_then(Option::as_ref) {
            Some(l) => {
                token_logprobs.push(json!(l.logprob));
                let mut m = Map::new();
                for &(t, lp) in &l.top {
                    m.insert(token_text(tok, t, as_ids), json!(lp));
                }
                top.push(Value::Object(m));
            }
            None => {
                token_logprobs.push(Value::Null);
                top.push(Value::Null);
            }
        }
    }
    json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets})
}

/// The tokens and logprobs of an echoed prompt (the first entry `None`; alternatives cut to the
/// `k` asked for), which a completion's then follow.
fn echoed_prompt(
    prompt_ids: &[u32],
    prompt_lps: &[Option<TokenLogprob>],
    k: usize,
) -> (Vec<u32>, Vec<Option<TokenLogprob>>) {
    let mut lps: Vec<Option<TokenLogprob>> = prompt_lps
        .iter()
        .take(prompt_ids.len())
        .map(|l| {
            l.clone().map(|mut l| {
                l.top.truncate(k);
                l
            })
        })
        .collect();
    lps.resize(prompt_ids.len(), None);
    (prompt_ids.to_vec(), lps)
}

/// An echoed prompt: its text, and its token ids (for `logprobs`).
struct Echo {
    text: String,
    ids: Vec<u32>,
}

struct CompletionFormat {
    id: String,
    created: u64,
    model: String,
    tokenizer: Arc<Tokenizer>,
    logprobs: bool,
    as_ids: bool,
    /// Per request: its prompt when echoing.
    echo: Vec<Option<Echo>>,
    /// The alternatives asked for by `logprobs`.
    legacy_k: usize,
    n: usize,
}

impl ChunkFormat for CompletionFormat {
    fn opening(&self, _index: usize) -> Option<Value> {
        None
    }

    fn content(
        &self,
        index: usize,
        out: &CompletionDelta,
        first: Option<&[Option<TokenLogprob>]>,
    ) -> Option<Value> {
        let new_lps = &out.logprobs;
        let request = index / self.n.max(1);
        let mut text = out.text.clone();
        // the first chunk of an echoing choice starts with the prompt, and its tokens
        let echoed = match (first, self.echo.get(request)) {
            (Some(prompt_lps), Some(Some(e))) => {
                text = format!("{}{text}", e.text);
                Some((e, prompt_lps))
            }
            _ => None,
        };
        let logprobs = if self.logprobs {
            let (mut ids, mut lps) = match echoed {
                Some((e, plps)) => echoed_prompt(&e.ids, plps, self.legacy_k),
                None => (Vec::new(), Vec::new()),
            };
            ids.extend(new_lps.iter().map(|l| l.token_id));
            lps.extend(new_lps.iter().cloned().map(Some));
            legacy_logprobs(&self.tokenizer, &lps, &ids, 0, self.as_ids)
        } else {
            Value::Null
        };
        Some(json!({
            "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
            "choices": [{
                "index": index, "text": text, "logprobs": logprobs,
                "finish_reason": out.finish_reason.map(|f| f.as_str()), "stop_reason": out.stop_reason,
            }],
        }))
    }

    fn usage(&self, usage: Value) -> Value {
        json!({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model, "choices": [], "usage": usage})
    }
}

/// `POST /v1/completions`.
#[utoipa::path(
    post,
    path = "/v1/completions",
    request_body = CompletionRequest,
    responses(
        (status = 200, description = "A completion, or its chunks as server-sent events with `stream`"),
        (status = 400, description = "Invalid request"),
        (status = 404, description = "Unknown model"),
        (status = 503, description = "Loading or at capacity")
    )
)]
pub async fn completions(
    State(st): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_body(body)?;
    let adapter = st.check_model(req.common.model.as_deref())?;
    let engine = st.engine()?;
    let info = engine.info().clone();
    if req.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::bad_request("suffix is not supported").with_param("suffix"));
    }
    let mut params = sampling_params(&req.common, &info, Some(16))?;
    params.structured_outputs = constraint(&req.common, req.response_format.as_ref())?;
    let n = requested_n(&req.common)?;
    let prompts = prompt_count(&req.prompt);
    let by = if prompts > st.edge.max_choices {
        "prompt"
    } else if params.n > n {
        "best_of"
    } else {
        "n"
    };
    st.check_choices(prompts, params.n, by)?;
    let echo = req.echo.unwrap_or(false);
    let want_prompt_logprobs = params.prompt_logprobs.is_some();
    if let Some(k) = req.logprobs {
        let k = logprobs_count("logprobs", k)?;
        params.logprobs = Some(k);
        if echo {
            params.prompt_logprobs = Some(params.prompt_logprobs.unwrap_or(0).max(k));
        }
    }
    validate(&params, &info)?;
    let cache_salt = req.common.cache_salt()?;
    check_prompts_fit(&req.prompt, &info)?;
    st.compile_grammar(&params, field_of(&req.common, req.response_format.as_ref()))
        .await?;
    let work = info.clone();
    let prompt = req.prompt;
    let prompts = st
        .blocking(move || completion_prompts(&prompt, &work))
        .await?;
    let samples = params.n;
    let mut echoes = Vec::with_capacity(prompts.len());
    let mut reqs = Vec::with_capacity(prompts.len());
    for (p, text) in prompts {
        echoes.push(match (echo, text) {
            (false, _) => None,
            (true, Some(text)) => Some(Echo {
                text,
                ids: p.clone(),
            }),
            (true, None) => Some(Echo {
                text: info
                    .tokenizer
                    .decode(&p, false)
                    .map_err(|e| ApiError::bad_request(e.to_string()))?,
                ids: p.clone(),
            }),
        });
        reqs.push(EngineRequest {
            prompt_token_ids: p,
            params: params.clone(),
            lora: adapter.clone(),
            cache_salt: cache_salt.clone(),
            mm: None,
        });
    }
    let tracked: Vec<(Tracked, usize, usize)> = st
        .submit_all(reqs)
        .await?
        .into_iter()
        .enumerate()
        .map(|(i, t)| (t, i * samples, samples))
        .collect();
    let legacy_k = req.logprobs.map_or(0, |k| k.max(0) as usize);
    let fmt = CompletionFormat {
        id: format!("cmpl-{}", super::misc::random_id()),
        created: super::misc::now(),
        model: st.response_model(&adapter),
        tokenizer: info.tokenizer.clone(),
        logprobs: params.logprobs.is_some(),
        as_ids: req.common.return_tokens_as_token_ids.unwrap_or(false),
        echo: echoes,
        legacy_k,
        n: samples,
    };
    if req.common.stream.unwrap_or(false) {
        let include_usage = req
            .common
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage);
        return Ok(sse_response(fmt, tracked, include_usage));
    }
    let mut choices = Vec::new();
    let (mut prompt_tokens, mut completion_tokens, mut cached) = (0usize, 0usize, 0usize);
    for (pi, (t, _, _)) in tracked.into_iter().enumerate() {
        prompt_tokens += t.prompt_len;
        let mut out = t.finish().await?;
        completion_tokens += out.num_generated_tokens();
        cached += out.num_cached_tokens.unwrap_or(0);
        keep_best(&mut out, n);
        let echo_prefix = fmt
            .echo
            .get(pi)
            .and_then(Option::as_ref)
            .map(|e| e.text.as_str());
        let prompt_lps = want_prompt_logprobs.then(|| {
            prompt_logprobs_json(
                &fmt.tokenizer,
                &out.prompt_token_ids,
                out.prompt_logprobs.as_deref(),
                fmt.as_ids,
            )
        });
        for c in &out.outputs {
            let text = format!("{}{}", echo_prefix.unwrap_or(""), c.text);
            let logprobs = if fmt.logprobs {
                let (mut ids, mut lps) = if echo_prefix.is_some() {
                    let plps = out.prompt_logprobs.as_deref().unwrap_or_default();
                    echoed_prompt(&out.prompt_token_ids, plps, legacy_k)
                } else {
                    (Vec::new(), Vec::new())
                };
                ids.extend(&c.token_ids);
                lps.extend(c.logprobs.clone().unwrap_or_default().into_iter().map(Some));
                legacy_logprobs(&fmt.tokenizer, &lps, &ids, 0, fmt.as_ids)
            } else {
                Value::Null
            };
            choices.push(json!({
                "index": pi * n + c.index, "text": text, "logprobs": logprobs,
                "finish_reason": c.finish_reason.map(|f| f.as_str()), "stop_reason": c.stop_reason,
                "prompt_logprobs": prompt_lps.clone().unwrap_or(Value::Null),
            }));
        }
    }
    Ok(Json(json!({
        "id": fmt.id, "object": "text_completion", "created": fmt.created, "model": fmt.model,
        "choices": choices, "usage": usage_json(prompt_tokens, completion_tokens, cached),
    }))
    .into_response())
}
