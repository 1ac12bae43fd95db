//! Small endpoints: `/v1/models`, `/v1/models/{model}`, `/tokenize`, `/detokenize`,
//! `/tokenizer_info`, `/health`, `/metrics`, `/version`.

use super::{parse_body, Shared};
use crate::openai::error::ApiError;
use crate::openai::media::chat_inputs;
use crate::openai::params::{check_text_fits, token_ids, TextLen};
use crate::openai::types::{DetokenizeRequest, TokenizeRequest};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
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

/// The served model's card.
fn model_card(st: &Shared) -> Result<Value, ApiError> {
    let engine = st.engine()?;
    Ok(json!({
        "id": st.served_model_name,
        "object": "model",
        "created": st.created,
        "owned_by": "rserve",
        "root": engine.info().model_dir.display().to_string(),
        "parent": null,
        "max_model_len": engine.info().max_model_len,
    }))
}

/// The cards of the registered LoRA adapters (`parent`: the base model), by name.
fn adapter_cards(st: &Shared) -> Result<Vec<Value>, ApiError> {
    let engine = st.engine()?;
    let Some(registry) = &engine.info().lora else {
        return Ok(Vec::new());
    };
    Ok(registry
        .list()
        .into_iter()
        .map(|a| {
            json!({
                "id": a.name,
                "object": "model",
                "created": a.created,
                "owned_by": "rserve",
                "root": a.path.display().to_string(),
                "parent": st.lora_parent(&a.name),
                "max_model_len": engine.info().max_model_len,
            })
        })
        .collect())
}

/// `GET /v1/models`: the base model, then each LoRA adapter.
#[utoipa::path(get, path = "/v1/models", responses((status = 200, description = "The served models")))]
pub async fn models(State(st): State<Shared>) -> Result<Json<Value>, ApiError> {
    let mut data = vec![model_card(&st)?];
    data.extend(adapter_cards(&st)?);
    Ok(Json(json!({"object": "list", "data": data})))
}

/// `GET /v1/models/{model}`: one model's card, or a 404.
#[utoipa::path(
    get,
    path = "/v1/models/{model}",
    params(("model" = String, Path, description = "A served model name")),
    responses((status = 200, description = "The model"), (status = 404, description = "No such model"))
)]
pub async fn model(
    State(st): State<Shared>,
    Path(model): Path<String>,
) -> Result<Json<Value>, ApiError> {
    match st.check_model(Some(&model))? {
        None => Ok(Json(model_card(&st)?)),
        Some(name) => adapter_cards(&st)?
            .into_iter()
            .find(|c| c["id"] == name.as_str())
            .map(Json)
            .ok_or_else(|| ApiError::not_found_model(&model)),
    }
}

/// `GET /tokenizer_info` (with `--enable-tokenizer-info-endpoint`): the tokenizer's
/// configuration, so clients can tokenize as the server does.
#[utoipa::path(
    get,
    path = "/tokenizer_info",
    responses((status = 200, description = "The tokenizer's configuration"), (status = 404, description = "Not enabled"))
)]
pub async fn tokenizer_info(State(st): State<Shared>) -> Result<Json<Value>, ApiError> {
    if !st.edge.tokenizer_info {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "Not found: start the server with --enable-tokenizer-info-endpoint",
        ));
    }
    let info = st.engine()?.info().clone();
    let path = info.model_dir.join("tokenizer_config.json");
    let mut cfg = match std::fs::read(&path) {
        Ok(bytes) => match serde_json::from_slice::<Value>(&bytes) {
            Ok(Value::Object(m)) => m,
            _ => serde_json::Map::new(),
        },
        Err(_) => serde_json::Map::new(),
    };
    cfg.entry("tokenizer_class")
        .or_insert_with(|| json!("PreTrainedTokenizerFast"));
    cfg.insert("model_max_length".into(), json!(info.max_model_len));
    cfg.insert("vocab_size".into(), json!(info.tokenizer.vocab_size()));
    match &info.chat_template {
        Some(t) => cfg.insert("chat_template".into(), json!(t.source())),
        None => cfg.remove("chat_template"),
    };
    Ok(Json(Value::Object(cfg)))
}

/// `POST /tokenize`: a prompt or chat messages -> token ids.
#[utoipa::path(post, path = "/tokenize", request_body = TokenizeRequest, responses((status = 200, description = "The token ids")))]
pub async fn tokenize(
    State(st): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let req: TokenizeRequest = parse_body(body)?;
    st.check_model(req.model.as_deref())?;
    let info = st.engine()?.info().clone();
    match (&req.prompt, &req.messages) {
        (Some(p), None) => check_text_fits(TextLen::of_text(p), &info, "prompt")?,
        (None, Some(m)) => check_text_fits(TextLen::of_messages(m), &info, "messages")?,
        _ => {
            return Err(ApiError::bad_request(
                "give exactly one of `prompt` or `messages`",
            ))
        }
    }
    let work = info.clone();
    let media = st.edge.media.clone();
    let tokens = st
        .blocking(move || match (req.prompt, req.messages) {
            (Some(p), _) => work
                .tokenizer
                .encode(&p, req.add_special_tokens.unwrap_or(true))
                .map_err(|e| ApiError::bad_request(e.to_string())),
            (None, m) => {
                let m = m.unwrap_or_default();
                let add = req.add_generation_prompt.unwrap_or(true);
                // image tokens count as the engine will see them
                Ok(chat_inputs(&work, &m, add, None, None, &media)?.0)
            }
        })
        .await?;
    Ok(Json(
        json!({"count": tokens.len(), "tokens": tokens, "max_model_len": info.max_model_len}),
    ))
}

/// `POST /detokenize`: token ids -> text.
#[utoipa::path(post, path = "/detokenize", request_body = DetokenizeRequest, responses((status = 200, description = "The text")))]
pub async fn detokenize(
    State(st): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let req: DetokenizeRequest = parse_body(body)?;
    st.check_model(req.model.as_deref())?;
    let info = st.engine()?.info().clone();
    let ids = token_ids(&req.tokens, &info, "tokens")?;
    let text = st
        .blocking(move || {
            info.tokenizer
                .decode(&ids, false)
                .map_err(|e| ApiError::bad_request(e.to_string()))
        })
        .await?;
    Ok(Json(json!({ "prompt": text })))
}

/// `GET /health`: 200 once the model is loaded, 503 before and during shutdown.
#[utoipa::path(get, path = "/health", responses((status = 200, description = "Serving"), (status = 503, description = "Loading or shutting down")))]
pub async fn health(State(st): State<Shared>) -> Response {
    match st.engine() {
        Ok(_) => StatusCode::OK.into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /metrics`: Prometheus text (vLLM's metric names).
#[utoipa::path(get, path = "/metrics", responses((status = 200, description = "Prometheus metrics", content_type = "text/plain")))]
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

/// `GET /version`.
#[utoipa::path(get, path = "/version", responses((status = 200, description = "The server's version")))]
pub async fn version() -> Json<Value> {
    Json(json!({ "version": env!("CARGO_PKG_VERSION") }))
}

/// `POST /reset_prefix_cache`: forgets every cached prefix block (requests in flight keep the
/// blocks they hold); 200 with the number of blocks forgotten.
#[utoipa::path(post, path = "/reset_prefix_cache", responses((status = 200, description = "The prefix cache is empty")))]
pub async fn reset_prefix_cache(State(st): State<Shared>) -> Result<Response, ApiError> {
    let engine = st.engine()?.clone();
    let blocks = st
        .blocking(move || engine.reset_prefix_cache().map_err(ApiError::from))
        .await?;
    Ok(Json(json!({ "reset": true, "cached_blocks": blocks })).into_response())
}
