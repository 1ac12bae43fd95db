//! rserve-core: the engine library. Requests come in through [`engine::EngineHandle`]; the engine
//! thread schedules them with continuous batching over a paged KV cache, runs the model, samples
//! and streams [`request::RequestDelta`]s back. See the module docs for each part.

pub mod batch;
pub mod chat_template;
pub mod default_model;
pub mod device;
pub mod engine;
mod engine_error;
mod engine_types;
pub mod gguf;
pub mod host;
pub mod hub;
pub mod kv_cache;
pub mod load_error;
pub mod loader;
pub mod lora;
pub mod model_runner;
pub mod models;
pub mod multimodal;
mod output;
pub mod parallel;
pub mod quant;
pub mod request;
pub mod sampler;
pub mod scheduler;
pub mod sequence;
#[cfg(feature = "cuda")]
pub mod staging;
pub mod stop_strings;
pub mod stream;
pub mod structured;
pub mod tokenizer;
pub mod weights;

pub use engine::{Engine, EngineConfig, EngineError, EngineHandle, EngineInfo, KvBudget};
pub use request::{
    EngineRequest, FinishReason, RequestDelta, RequestId, RequestOutput, SamplingParams,
};
pub use stream::OutputStream;
