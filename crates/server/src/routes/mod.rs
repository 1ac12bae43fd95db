//! The HTTP surface: shared state, the router, auth, body and header limits, errors in OpenAI's
//! shape for every status, and the tracked output stream that feeds the latency metrics.
//! Endpoint handlers live in the sibling files, one per family.

pub mod chat;
pub mod choices;
pub mod completions;
pub mod lora;
pub mod misc;
pub mod openapi;
pub mod responses;
pub mod stream;

use crate::metrics::Metrics;
use crate::openai::error::ApiError;
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use rserve_core::lora::ResolvedLora;
use rserve_core::{EngineHandle, EngineRequest};
use serde::de::DeserializeOwned;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::Semaphore;

/// Request heads larger than this get a 431 (with the error body).
pub const MAX_HEADER_BYTES: usize = 64 * 1024;
/// Requests with more header fields than this get a 431.
pub const MAX_HEADER_FIELDS: usize = 100;
/// The body limit until the model is loaded and the default can be scaled to its context.
const PROVISIONAL_BODY_LIMIT: usize = 1 << 20;

/// The limits of the HTTP edge.
#[derive(Debug, Clone)]
pub struct EdgeConfig {
    /// Requests in flight beyond which new ones get a 503.
    pub max_pending: usize,
    /// Completions one request may ask for (prompts x `n`, or x `best_of`).
    pub max_choices: usize,
    /// The body limit in bytes; `None`: scaled to the context once the model is loaded.
    pub body_limit: Option<usize>,
    /// Threads that render chat templates and tokenize at once.
    pub prep_threads: usize,
    /// Serve `GET /tokenizer_info`.
    pub tokenizer_info: bool,
    /// With `--enable-auto-tool-choice`: how the model writes tool calls (`tool_choice: auto`).
    pub auto_tools: Option<crate::openai::tools::ToolParser>,
    /// Where images may come from and how many a prompt may hold.
    pub media: crate::openai::media::MediaConfig,
    /// `/v1/models`' `parent` of adapters given one by `--lora-modules` (`base_model_name`);
    /// others name the served model.
    pub lora_parents: std::collections::HashMap<String, String>,
}

impl Default for EdgeConfig {
    fn default() -> Self {
        Self {
            max_pending: 4096,
            max_choices: 256,
            body_limit: None,
            prep_threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            tokenizer_info: false,
            auto_tools: None,
            media: crate::openai::media::MediaConfig::default(),
            lora_parents: std::collections::HashMap::new(),
        }
    }
}

/// The default body limit for a context of `max_model_len` tokens of at most `token_chars`
/// characters each: what the longest prompt takes in UTF-8, plus 1 MiB for the rest of the
/// request, at most 512 MiB.
pub fn default_body_limit(max_model_len: usize, token_chars: usize) -> usize {
    max_model_len
        .saturating_mul(token_chars)
        .saturating_mul(4)
        .saturating_add(1 << 20)
        .min(512 << 20)
}

/// Everything the handlers share.
pub struct AppState {
    pub engine: OnceLock<EngineHandle>,
    pub served_model_name: String,
    pub api_key: Option<String>,
    pub metrics: Metrics,
    pub created: u64,
    /// Requests admitted and not finished; beyond `max_pending` new ones get a 503.
    pub pending: AtomicUsize,
    pub edge: EdgeConfig,
    /// `edge.lora_parents` as they stand: an unloaded adapter's entry goes with it, so an adapter
    /// loaded later under its name is the served model's child.
    lora_parents: std::sync::Mutex<std::collections::HashMap<String, String>>,
    body_limit: AtomicUsize,
    prep: Arc<Semaphore>,
    pub shutting_down: AtomicBool,
}

pub type Shared = Arc<AppState>;

impl AppState {
    pub fn new(served_model_name: String, api_key: Option<String>, mut edge: EdgeConfig) -> Self {
        let lora_parents = std::sync::Mutex::new(std::mem::take(&mut edge.lora_parents));
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
            body_limit: AtomicUsize::new(edge.body_limit.unwrap_or(PROVISIONAL_BODY_LIMIT)),
            prep: Arc::new(Semaphore::new(edge.prep_threads.max(1))),
            edge,
            lora_parents,
            shutting_down: AtomicBool::new(false),
        }
    }

    /// `/v1/models`' `parent` of the adapter `name`.
    pub fn lora_parent(&self, name: &str) -> String {
        let parents = self
            .lora_parents
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        parents.get(name).unwrap_or(&self.served_model_name).clone()
    }

    /// Forgets the `parent` of an unloaded adapter.
    pub fn forget_lora_parent(&self, name: &str) {
        self.lora_parents
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(name);
    }

    /// Installs the loaded engine (and the body limit scaled to its context).
    pub fn set_engine(&self, handle: EngineHandle) {
        if self.edge.body_limit.is_none() {
            let info = handle.info();
            let mut limit =
                default_body_limit(info.max_model_len, info.tokenizer.max_token_chars());
            if info.processor.is_some() {
                // base64 images: 4 characters per 3 bytes
                let m = &self.edge.media;
                let images = m.max_images.saturating_mul(m.max_bytes / 3 * 4 + 4);
                limit = limit.saturating_add(images).min(1 << 30);
            }
            self.body_limit.store(limit, Ordering::Relaxed);
        }
        let _ = self.engine.set(handle);
    }

    /// The largest request body accepted now, in bytes.
    pub fn body_limit(&self) -> usize {
        self.body_limit.load(Ordering::Relaxed)
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

    /// Checks `model` against the served name (absent means the served model) and the
    /// registered LoRA adapters; the adapter's name when it names one.
    pub fn check_model(&self, model: Option<&str>) -> Result<Option<String>, ApiError> {
        match model {
            None => Ok(None),
            Some(m) if m == self.served_model_name => Ok(None),
            Some(m) => {
                let registry = self.engine()?.info().lora.clone();
                match registry {
                    Some(r) if r.contains(m) => Ok(Some(m.to_owned())),
                    _ => Err(ApiError::not_found_model(m)),
                }
            }
        }
    }

    /// The name responses report for a request of `adapter` (the adapter's, else the model's).
    pub fn response_model(&self, adapter: &Option<String>) -> String {
        adapter
            .clone()
            .unwrap_or_else(|| self.served_model_name.clone())
    }

    /// Refuses a request for more than `max_choices` completions; `param` names the field
    /// that multiplies them.
    pub fn check_choices(
        &self,
        prompts: usize,
        samples: usize,
        param: &str,
    ) -> Result<(), ApiError> {
        let total = prompts.saturating_mul(samples);
        let cap = self.edge.max_choices;
        if total > cap {
            return Err(ApiError::bad_request(format!(
                "this request asks for {total} completions ({prompts} prompt(s) x {samples}); at \
                 most {cap} are served per request (--max-choices-per-request)"
            ))
            .with_param(param));
        }
        Ok(())
    }

    /// Runs `f` (template rendering, tokenizing: work in the size of the input) on the bounded
    /// blocking pool, off the async workers, so a huge input cannot stall other clients.
    pub async fn blocking<T, F>(&self, f: F) -> Result<T, ApiError>
    where
        T: Send + 'static,
        F: FnOnce() -> Result<T, ApiError> + Send + 'static,
    {
        let permit = self
            .prep
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ApiError::unavailable("the server is shutting down"))?;
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            f()
        })
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
    }

    /// Compiles a request's structured-output constraint on the blocking pool (a large schema takes
    /// a while), so `submit` finds it in the cache; an invalid one is a 400 naming `field`.
    pub async fn compile_grammar(
        &self,
        params: &rserve_core::SamplingParams,
        field: &'static str,
    ) -> Result<(), ApiError> {
        if params.structured_outputs.is_none() {
            return Ok(());
        }
        let engine = self.engine()?.clone();
        let p = params.clone();
        self.blocking(move || {
            engine
                .compile_grammar(&p)
                .map(|_| ())
                .map_err(|e| ApiError::from(e).with_param(field))
        })
        .await
    }

    /// Submits validated requests, all or none: refused with 503 when they would take the
    /// pending count past `max_pending`.
    pub async fn submit_all(
        self: &Arc<Self>,
        reqs: Vec<EngineRequest>,
    ) -> Result<Vec<stream::Tracked>, ApiError> {
        let engine = self.engine()?;
        let k = reqs.len();
        let before = self.pending.fetch_add(k, Ordering::AcqRel);
        if before + k > self.edge.max_pending {
            self.pending.fetch_sub(k, Ordering::AcqRel);
            return Err(ApiError::unavailable(
                "the server is at capacity; retry later",
            ));
        }
        // the places are held from here (given back on any error below), so a request turned away
        // at capacity reads no adapter from disk
        let mut slots = stream::Slots::new(self.clone(), k);
        let mut adapters: Vec<(String, ResolvedLora)> = Vec::new();
        for name in reqs.iter().filter_map(|r| r.lora.as_ref()) {
            if !adapters.iter().any(|(n, _)| n == name) {
                let resolved = self.resolve_adapter(name.clone()).await?;
                adapters.push((name.clone(), resolved));
            }
        }
        let mut out = Vec::with_capacity(k);
        for req in reqs {
            let prompt_len = req.prompt_token_ids.len();
            let resolved = adapters
                .iter()
                .find(|(n, _)| Some(n) == req.lora.as_ref())
                .map(|(_, r)| r.clone());
            let s = engine.submit_resolved(req, resolved)?;
            out.push(slots.take(s, prompt_len));
        }
        Ok(out)
    }

    /// The adapter `name`: at once when its matrices are in host memory, else read from its
    /// directory on the blocking pool (`--max-cpu-loras` dropped it), never on this thread.
    async fn resolve_adapter(self: &Arc<Self>, name: String) -> Result<ResolvedLora, ApiError> {
        let engine = self.engine()?.clone();
        if let Some(held) = engine.resolve_lora_in_memory(&name)? {
            return Ok(held);
        }
        self.blocking(move || engine.resolve_lora(&name).map_err(ApiError::from))
            .await
    }

    /// [`AppState::submit_all`] for one request.
    pub async fn submit(self: &Arc<Self>, req: EngineRequest) -> Result<stream::Tracked, ApiError> {
        let mut v = self.submit_all(vec![req]).await?;
        v.pop()
            .ok_or_else(|| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "nothing submitted"))
    }
}

/// Parses a JSON body into `T`; malformed JSON and wrong types are 400s naming the field.
pub fn parse_body<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let bytes = body.map_err(|e| ApiError::new(e.status(), e.body_text()))?;
    crate::openai::parse::parse_json(&bytes)
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

/// Header limits (431 with the error body), and a declared body length over the limit (413),
/// before anything else.
async fn head_limits(
    State(st): State<Shared>,
    req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let headers = req.headers();
    let head_bytes: usize = headers
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len() + 4)
        .sum::<usize>()
        + req.uri().to_string().len();
    if headers.len() > MAX_HEADER_FIELDS || head_bytes > MAX_HEADER_BYTES {
        return Err(ApiError::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            format!(
                "request headers too large: at most {MAX_HEADER_FIELDS} fields and \
                 {MAX_HEADER_BYTES} bytes are accepted"
            ),
        ));
    }
    let limit = st.body_limit();
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large(limit));
    }
    Ok(next.run(req).await)
}

fn too_large(limit: usize) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("request body too large: at most {limit} bytes are accepted (--max-body-bytes)"),
    )
}

/// Reads the body up to the current limit (413 beyond it); runs after the API key is checked.
async fn read_body(
    State(st): State<Shared>,
    req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    if req.method() == Method::GET || req.method() == Method::HEAD {
        return Ok(next.run(req).await);
    }
    let limit = st.body_limit();
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, limit).await {
        Ok(b) => b,
        Err(e) => {
            let over = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            return Err(if over {
                too_large(limit)
            } else {
                ApiError::bad_request(format!("reading the request body: {e}"))
            });
        }
    };
    Ok(next
        .run(Request::from_parts(parts, Body::from(bytes)))
        .await)
}

/// Gives framework answers without a body (405) the error body every other error has.
async fn error_bodies(req: Request, next: Next) -> Response {
    let resp = next.run(req).await;
    if resp.status() != StatusCode::METHOD_NOT_ALLOWED {
        return resp;
    }
    let allow = resp
        .headers()
        .get(header::ALLOW)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let mut out = ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("Method not allowed; this path accepts {allow}"),
    )
    .into_response();
    if let Ok(v) = header::HeaderValue::from_str(&allow) {
        out.headers_mut().insert(header::ALLOW, v);
    }
    out
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "Not found")
}

/// The full router.
pub fn router(state: Shared) -> Router {
    let keyed = Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/models", get(misc::models))
        .route("/v1/load_lora_adapter", post(lora::load_lora_adapter))
        .route("/v1/unload_lora_adapter", post(lora::unload_lora_adapter))
        .route("/v1/models/{*model}", get(misc::model))
        .route("/tokenize", post(misc::tokenize))
        .route("/detokenize", post(misc::detokenize))
        .route("/tokenizer_info", get(misc::tokenizer_info))
        .route("/reset_prefix_cache", post(misc::reset_prefix_cache))
        .route_layer(middleware::from_fn_with_state(state.clone(), read_body))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key));
    Router::new()
        .merge(keyed)
        .route("/health", get(misc::health))
        .route("/metrics", get(misc::metrics))
        .route("/version", get(misc::version))
        .route("/openapi.json", get(openapi::openapi_json))
        .fallback(not_found)
        .layer(middleware::from_fn(error_bodies))
        .layer(middleware::from_fn_with_state(state.clone(), head_limits))
        .layer(DefaultBodyLimit::disable())
        .with_state(state)
}

#[cfg(test)]
mod tests;
