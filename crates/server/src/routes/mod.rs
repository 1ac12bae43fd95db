//! The HTTP surface: shared state, the router, auth, body parsing into typed requests, and the
//! tracked output stream that feeds the latency metrics. Endpoint handlers live in the sibling
//! files, one per family.

pub mod chat;
pub mod completions;
pub mod misc;
pub mod stream;

use crate::metrics::Metrics;
use crate::openai::error::ApiError;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use rserve_core::{EngineHandle, EngineRequest};
use serde::de::DeserializeOwned;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

/// Everything the handlers share.
pub struct AppState {
    pub engine: OnceLock<EngineHandle>,
    pub served_model_name: String,
    pub api_key: Option<String>,
    pub metrics: Metrics,
    pub created: u64,
    /// Requests admitted and not finished; beyond `max_pending` new ones get a 503.
    pub pending: AtomicUsize,
    pub max_pending: usize,
    pub shutting_down: AtomicBool,
}

pub type Shared = Arc<AppState>;

impl AppState {
    pub fn new(served_model_name: String, api_key: Option<String>, max_pending: usize) -> Self {
        Self {
            engine: OnceLock::new(),
            served_model_name,
            api_key,
            metrics: Metrics::default(),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            pending: AtomicUsize::new(0),
            max_pending,
            shutting_down: AtomicBool::new(false),
        }
    }

    /// The engine, or a 503 while it loads or after shutdown began.
    pub fn engine(&self) -> Result<&EngineHandle, ApiError> {
        if self.shutting_down.load(Ordering::Relaxed) {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        self.engine
            .get()
            .ok_or_else(|| ApiError::unavailable("the model is still loading"))
    }

    /// Checks `model` against the served name (absent means the served model).
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            None => Ok(()),
            Some(m) if m == self.served_model_name => Ok(()),
            Some(m) => Err(ApiError::not_found_model(m)),
        }
    }

    /// Submits a validated request, refusing with 503 when too many are pending.
    pub fn submit(self: &Arc<Self>, req: EngineRequest) -> Result<stream::Tracked, ApiError> {
        let engine = self.engine()?;
        if self.pending.load(Ordering::Relaxed) >= self.max_pending {
            return Err(ApiError::unavailable(
                "the server is at capacity; retry later",
            ));
        }
        let prompt_len = req.prompt_token_ids.len();
        let s = engine.submit(req)?;
        Ok(stream::Tracked::new(s, self.clone(), prompt_len))
    }
}

/// Parses a JSON body into `T`; malformed JSON and wrong types are 400s, oversize bodies 413.
pub fn parse_body<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let bytes = body.map_err(|e| ApiError::new(e.status(), e.body_text()))?;
    serde_json::from_slice(&bytes).map_err(|e| {
        let kind = if e.is_syntax() || e.is_eof() {
            "Invalid JSON"
        } else {
            "Invalid request"
        };
        ApiError::bad_request(format!("{kind}: {e}"))
    })
}

async fn require_key(
    State(st): State<Shared>,
    req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    if let Some(key) = &st.api_key {
        let ok = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|k| k.trim() == key);
        if !ok {
            // read the body so the connection stays usable for the client's next request
            let _ = axum::body::to_bytes(req.into_body(), 1 << 20).await;
            return Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "Unauthorized: a valid API key is required",
            ));
        }
    }
    Ok(next.run(req).await)
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "Not found")
}

/// The full router; `max_body` bytes per request body.
pub fn router(state: Shared, max_body: usize) -> Router {
    let v1 = Router::new()
        .route("/chat/completions", post(chat::chat_completions))
        .route("/completions", post(completions::completions))
        .route("/models", get(misc::models))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key));
    Router::new()
        .nest("/v1", v1)
        .route("/tokenize", post(misc::tokenize))
        .route("/detokenize", post(misc::detokenize))
        .route("/health", get(misc::health))
        .route("/metrics", get(misc::metrics))
        .route("/version", get(misc::version))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(state)
}

#[cfg(test)]
mod tests;
