//! `GET /openapi.json`: the OpenAPI document, generated from the request types and the handlers'
//! route annotations.

use crate::openai::types::{
    ChatCompletionRequest, ChatMessage, CommonFields, CompletionRequest, DetokenizeRequest, Prompt,
    StreamOptions, StringOrList, TokenizeRequest,
};
use crate::routes::responses::{ResponsesInput, ResponsesRequest};
use axum::Json;
use utoipa::OpenApi;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "rserve",
        description = "An OpenAI-compatible LLM server (vLLM's dialect)."
    ),
    paths(
        super::chat::chat_completions,
        super::completions::completions,
        super::responses::responses,
        super::misc::models,
        super::misc::model,
        super::lora::load_lora_adapter,
        super::lora::unload_lora_adapter,
        super::misc::tokenize,
        super::misc::detokenize,
        super::misc::tokenizer_info,
        super::misc::reset_prefix_cache,
        super::misc::health,
        super::misc::metrics,
        super::misc::version,
    ),
    components(schemas(
        ChatCompletionRequest,
        ChatMessage,
        CommonFields,
        CompletionRequest,
        Prompt,
        StringOrList,
        StreamOptions,
        TokenizeRequest,
        DetokenizeRequest,
        ResponsesRequest,
        ResponsesInput,
    ))
)]
pub struct ApiDoc;

/// The document, with the server's version.
pub fn document() -> utoipa::openapi::OpenApi {
    let mut doc = ApiDoc::openapi();
    doc.info.version = env!("CARGO_PKG_VERSION").to_string();
    doc
}

pub async fn openapi_json() -> Json<utoipa::openapi::OpenApi> {
    Json(document())
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_route_is_documented() {
        let doc = super::document();
        for p in [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/responses",
            "/v1/models",
            "/v1/models/{model}",
            "/tokenize",
            "/detokenize",
            "/tokenizer_info",
            "/health",
            "/metrics",
            "/version",
        ] {
            assert!(doc.paths.paths.contains_key(p), "{p} is missing");
        }
        let schemas = doc.components.map(|c| c.schemas).unwrap_or_default();
        assert!(schemas.contains_key("ChatCompletionRequest"));
    }
}
