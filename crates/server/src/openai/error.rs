//! The OpenAI error shape `{"error": {"message", "type", "param", "code"}}` and its HTTP statuses.
//! Every user mistake is a 4xx; 5xx is reserved for faults of the server itself.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use rserve_core::EngineError;
use serde_json::json;

/// An error answered to a client.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
            retry_after: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn not_found_model(model: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            format!("The model `{model}` does not exist."),
        )
        .with_param("model")
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::SERVICE_UNAVAILABLE, message);
        e.retry_after = Some(1);
        e
    }

    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::BAD_REQUEST
            | StatusCode::PAYLOAD_TOO_LARGE
            | StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE => "BadRequestError",
            StatusCode::METHOD_NOT_ALLOWED => "MethodNotAllowedError",
            StatusCode::UNAUTHORIZED => "AuthenticationError",
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::TOO_MANY_REQUESTS => "RateLimitError",
            StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
            _ => "InternalServerError",
        }
    }

    /// The JSON body (also used for errors inside a stream).
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind(),
            "param": self.param,
            "code": self.status.as_u16(),
        }})
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match &e {
            EngineError::InvalidParam { field, .. } => {
                ApiError::bad_request(e.to_string()).with_param(field.clone())
            }
            EngineError::InvalidRequest(_)
            | EngineError::ContextLength { .. }
            | EngineError::Lora(_) => ApiError::bad_request(e.to_string()),
            EngineError::NotFound(m) => ApiError::new(StatusCode::NOT_FOUND, m.clone()),
            EngineError::Stopped => ApiError::unavailable("the engine is shutting down"),
            _ => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        r
    }
}
