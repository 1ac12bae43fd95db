//! Small endpoints: `/v1/models`, `/tokenize`, `/detokenize`, `/health`, `/metrics`, `/version`.

use super::{parse_body, Shared};
use crate::openai::error::ApiError;
use crate::openai::params::{chat_prompt, token_ids};
use crate::openai::types::{DetokenizeRequest, TokenizeRequest};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds since the epoch.
pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A unique hex id for responses.
pub fn random_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let c = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut x =
        t ^ c.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ u64::from(std::process::id()).rotate_left(32);
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    format!("{x:016x}{c:08x}")
}

pub async fn models(State(st): State<Shared>) -> Result<Json<Value>, ApiError> {
    let engine = st.engine()?;
    Ok(Json(json!({
        "object": "list",
        "data": [{
            "id": st.served_model_name,
            "object": "model",
            "created": st.created,
            "owned_by": "rserve",
            "root": engine.info().model_dir.display().to_string(),
            "parent": null,
            "max_model_len": engine.info().max_model_len,
        }],
    })))
}

pub async fn tokenize(
    State(st): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let req: TokenizeRequest = parse_body(body)?;
    st.check_model(req.model.as_deref())?;
    let info = st.engine()?.info().clone();
    let tokens = match (&req.prompt, &req.messages) {
        (Some(p), None) => info
            .tokenizer
            .encode(p, req.add_special_tokens.unwrap_or(true))
            .map_err(|e| ApiError::bad_request(e.to_string()))?,
        (None, Some(m)) => {
            chat_prompt(&info, m, req.add_generation_prompt.unwrap_or(true), None)?.1
        }
        _ => {
            return Err(ApiError::bad_request(
                "give exactly one of `prompt` or `messages`",
            ))
        }
    };
    Ok(Json(
        json!({"count": tokens.len(), "tokens": tokens, "max_model_len": info.max_model_len}),
    ))
}

pub async fn detokenize(
    State(st): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let req: DetokenizeRequest = parse_body(body)?;
    st.check_model(req.model.as_deref())?;
    let info = st.engine()?.info().clone();
    let ids = token_ids(&req.tokens, &info, "tokens")?;
    let text = info
        .tokenizer
        .decode(&ids, false)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(Json(json!({ "prompt": text })))
}

pub async fn health(State(st): State<Shared>) -> Response {
    match st.engine() {
        Ok(_) => StatusCode::OK.into_response(),
        Err(e) => e.into_response(),
    }
}

pub async fn metrics(State(st): State<Shared>) -> Response {
    let stats = st.engine.get().map(|e| e.stats().clone());
    let text = st.metrics.render(&st.served_model_name, stats.as_deref());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

pub async fn version() -> Json<Value> {
    Json(json!({ "version": env!("CARGO_PKG_VERSION") }))
}
