//! [`EngineError`]: everything that can go wrong between a caller and the engine. Its own module
//! so that the handle, the streams and the output processor all name it without importing one
//! another.

use crate::load_error::LoadError;
use crate::request::InvalidParam;

/// Everything that can go wrong between a caller and the engine.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// A request the caller must fix (HTTP 400).
    #[error("{0}")]
    InvalidRequest(String),
    #[error("{field}: {message}")]
    InvalidParam { field: String, message: String },
    /// Prompt plus completion exceed the context (HTTP 400, vLLM's wording).
    #[error("This model's maximum context length is {max} tokens. However, you requested {} tokens ({prompt} in the messages, {completion} in the completion). Please reduce the length of the messages or completion.", prompt.saturating_add(*completion))]
    ContextLength {
        max: usize,
        prompt: usize,
        completion: usize,
    },
    /// A LoRA adapter that cannot be used or loaded as asked (HTTP 400).
    #[error("{0}")]
    Lora(String),
    /// A model or adapter name that is not served (HTTP 404).
    #[error("{0}")]
    NotFound(String),
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    #[error("failed to load the model: {0}")]
    Load(String),
    #[error("model error: {0}")]
    Model(String),
    #[error("the engine has stopped")]
    Stopped,
}

impl From<LoadError> for EngineError {
    fn from(e: LoadError) -> Self {
        EngineError::Load(e.to_string())
    }
}

impl From<InvalidParam> for EngineError {
    fn from(e: InvalidParam) -> Self {
        EngineError::InvalidParam {
            field: e.field.to_string(),
            message: e.message,
        }
    }
}

impl EngineError {
    /// True when the caller's input caused the error (a 400, a `ValueError`).
    pub fn is_user_error(&self) -> bool {
        matches!(
            self,
            EngineError::InvalidRequest(_)
                | EngineError::InvalidParam { .. }
                | EngineError::ContextLength { .. }
                | EngineError::Lora(_)
                | EngineError::NotFound(_)
        )
    }
}
