//! [`LoadError`]: why a model directory could not be loaded. Its own module so that the loader,
//! the weights and the model layers all name it without importing one another.

use std::path::PathBuf;

/// Why a model could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("model directory {0} does not exist")]
    NoDirectory(PathBuf),
    #[error("missing file {0}")]
    MissingFile(PathBuf),
    #[error("cannot read {file}: {reason}")]
    Io { file: PathBuf, reason: String },
    #[error("invalid JSON in {file}: {reason}")]
    Json { file: PathBuf, reason: String },
    #[error("config.json: {field}: {reason}")]
    Config { field: String, reason: String },
    #[error("unsupported architecture {found:?}; supported: {}", supported.join(", "))]
    UnsupportedArchitecture {
        found: Vec<String>,
        supported: Vec<String>,
    },
    #[error("unsupported dtype `{0}` (use auto, float32, bfloat16 or float16)")]
    Dtype(String),
    #[error("{file}: {reason}")]
    Safetensors { file: PathBuf, reason: String },
    #[error("tensor `{name}` not found in {files:?}")]
    MissingTensor { name: String, files: Vec<PathBuf> },
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    TensorShape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor `{name}`: {reason}")]
    Tensor { name: String, reason: String },
    #[error("{file}: {reason}")]
    Gguf { file: PathBuf, reason: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// A special-token id (EOS, BOS) that the model cannot produce or read.
    #[error("{file}: {reason}")]
    SpecialToken { file: PathBuf, reason: String },
}
