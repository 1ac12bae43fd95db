//! rserve-core: the engine library. Requests come in through [`engine::EngineHandle`]; the engine
//! thread schedules them with continuous batching over a paged KV cache, runs the model, samples
//! and streams [`request::RequestOutput`]s back. See the module docs for each part.

pub mod chat_template;
pub mod default_model;
pub mod device;
pub mod engine;
mod engine_types;
pub mod hub;
pub mod kv_cache;
pub mod loader;
pub mod model_runner;
pub mod models;
pub mod request;
pub mod sampler;
pub mod scheduler;
pub mod sequence;
pub mod tokenizer;
pub mod weights;

pub use engine::{
    Engine, EngineConfig, EngineError, EngineHandle, EngineInfo, KvBudget, OutputStream,
};
pub use request::{EngineRequest, FinishReason, RequestId, RequestOutput, SamplingParams};
