//! `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (vLLM's runtime adapter
//! routes): served only when `RSERVE_ALLOW_RUNTIME_LORA_UPDATING` (or vLLM's
//! `VLLM_ALLOW_RUNTIME_LORA_UPDATING`) is `1` or `true`, behind `--api-key` like every `/v1`
//! route. Loading reads and checks the adapter on the blocking pool; requests already running
//! with an adapter that is unloaded finish with it.

use super::{parse_body, Shared};
use crate::openai::error::ApiError;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use serde::Deserialize;

/// Whether the environment allows loading and unloading adapters at runtime.
pub fn runtime_updates_allowed() -> bool {
    [
        "RSERVE_ALLOW_RUNTIME_LORA_UPDATING",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    ]
    .iter()
    .filter_map(|v| std::env::var(v).ok())
    .any(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true"))
}

fn check_allowed() -> Result<(), ApiError> {
    if runtime_updates_allowed() {
        return Ok(());
    }
    Err(ApiError::new(
        StatusCode::NOT_FOUND,
        "runtime LoRA updates are off; set RSERVE_ALLOW_RUNTIME_LORA_UPDATING=1 to enable them",
    ))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LoadRequest {
    lora_name: String,
    lora_path: String,
    /// vLLM's flag to replace an adapter of the same name; not supported.
    #[serde(default)]
    load_inplace: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct UnloadRequest {
    lora_name: String,
    /// vLLM's numeric id; the name decides here.
    #[serde(default)]
    #[allow(dead_code)]
    lora_int_id: Option<i64>,
}

/// `POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}`.
#[utoipa::path(
    post,
    path = "/v1/load_lora_adapter",
    responses(
        (status = 200, description = "The adapter is loaded"),
        (status = 400, description = "The adapter cannot be used or the name is taken"),
        (status = 404, description = "Runtime LoRA updates are off")
    )
)]
pub async fn load_lora_adapter(
    State(st): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Result<String, ApiError> {
    check_allowed()?;
    let req: LoadRequest = parse_body(body)?;
    if req.load_inplace {
        return Err(ApiError::bad_request(
            "load_inplace is not supported: unload the adapter first",
        )
        .with_param("load_inplace"));
    }
    if req.lora_name.trim().is_empty() || req.lora_name == st.served_model_name {
        return Err(ApiError::bad_request(format!(
            "`{}` cannot name a LoRA adapter",
            req.lora_name
        ))
        .with_param("lora_name"));
    }
    let engine = st.engine()?.clone();
    let name = req.lora_name.clone();
    st.blocking(move || {
        engine
            .load_lora(&name, std::path::Path::new(&req.lora_path))
            .map_err(ApiError::from)
    })
    .await?;
    tracing::info!("loaded LoRA adapter `{}`", req.lora_name);
    Ok(format!(
        "Success: LoRA adapter '{}' added successfully.",
        req.lora_name
    ))
}

/// `POST /v1/unload_lora_adapter` `{"lora_name"}`.
#[utoipa::path(
    post,
    path = "/v1/unload_lora_adapter",
    responses(
        (status = 200, description = "The adapter is unloaded"),
        (status = 404, description = "No such adapter, or runtime LoRA updates are off")
    )
)]
pub async fn unload_lora_adapter(
    State(st): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Result<String, ApiError> {
    check_allowed()?;
    let req: UnloadRequest = parse_body(body)?;
    st.engine()?.unload_lora(&req.lora_name)?;
    st.forget_lora_parent(&req.lora_name);
    tracing::info!("unloaded LoRA adapter `{}`", req.lora_name);
    Ok(format!(
        "Success: LoRA adapter '{}' removed successfully.",
        req.lora_name
    ))
}
