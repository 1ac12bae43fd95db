//! The engine's public face: configuration, errors, the facts callers need at the edge
//! ([`EngineInfo`]), live counters ([`EngineStats`]), and [`EngineHandle`], through which every
//! caller (async or blocking) submits requests and gets an [`OutputStream`] of their outputs.
//!
//! `submit` validates a request against the model (vocabulary, context length, KV capacity)
//! before it reaches the engine thread, so bad input is an [`EngineError`] and never a panic
//! or a request that cannot finish.

use crate::chat_template::ChatTemplate;
pub use crate::engine_error::EngineError;
use crate::loader::GenerationDefaults;
use crate::lora::{AdapterId, LoraRegistry, ResolvedLora};
use crate::models::DecoderConfig;
use crate::request::{EngineRequest, FinishReason, RequestId, SamplingParams};
use crate::stream::{OutputStream, Sink};
use crate::structured::{CompiledGrammar, GrammarError};
use crate::tokenizer::Tokenizer;
use candle_core::DType;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};

/// How much memory the KV cache gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvBudget {
    /// 1 GiB on the CPU; on a GPU what `gpu_memory_utilization` leaves after the weights and the
    /// measured activation peak. Never more than `max_num_seqs` full-length sequences need.
    Auto,
    Bytes(usize),
    Blocks(usize),
}

/// Engine settings (vLLM's names).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    pub model: PathBuf,
    /// `auto`, `float32`, `bfloat16` or `float16`.
    pub dtype: String,
    pub device: String,
    pub max_model_len: Option<usize>,
    pub max_num_seqs: usize,
    /// Token budget of one step; `None`: [`crate::engine::default_batched_tokens`] for the device.
    pub max_num_batched_tokens: Option<usize>,
    pub block_size: usize,
    pub kv_cache: KvBudget,
    /// What the KV cache stores (`--kv-cache-dtype`).
    pub kv_cache_dtype: crate::kv_cache::KvCacheDtype,
    /// Fraction of GPU memory rserve may use in all (weights, activations, KV cache).
    pub gpu_memory_utilization: f64,
    pub seed: u64,
    /// A chat template (Jinja source) replacing the model's own.
    pub chat_template: Option<String>,
    /// Quantize the decoder's projections to this format while loading (`--isq`).
    pub isq: Option<crate::quant::IsqFormat>,
    /// With `isq`, quantize the output head too (`--isq-lm-head`).
    pub isq_lm_head: bool,
    /// A directory whose `tokenizer.json` replaces the checkpoint's tokenizer (`--tokenizer`).
    pub tokenizer: Option<std::path::PathBuf>,
    /// Run every step eagerly: no CUDA graphs of decode steps.
    pub enforce_eager: bool,
    /// Plan and issue step N+1 while the device runs step N, its sampled tokens fed to it on the
    /// device (GPU, device-sampled steps without penalties); off: every step waits for the last.
    pub async_scheduling: bool,
    /// With `async_scheduling`, plan ahead of host-sampled steps too (as a GPU does with its
    /// device-sampled ones). It buys nothing on a CPU, where every step waits for the forward
    /// pass anyway; it exists so that tests run the async bookkeeping (placeholders, tokens fed
    /// to the next step, rows computed past a stop) without a GPU.
    pub lookahead_on_host: bool,
    /// Serve LoRA adapters with these limits (`--enable-lora`); `None`: no adapters.
    pub lora: Option<crate::lora::LoraOptions>,
    /// Adapters registered at start: (name, directory or hub id) (`--lora-modules`).
    pub lora_modules: Vec<(String, PathBuf)>,
    /// Keep computed KV blocks by content and start requests from the longest cached prefix
    /// (`--enable-prefix-caching`, on by default).
    pub enable_prefix_caching: bool,
    /// JSON constrained by a schema may hold free whitespace when a request does not say
    /// (`disable_any_whitespace`); off: compact JSON.
    pub json_any_whitespace: bool,
    /// GPUs the model is split over (tensor parallelism, one thread per GPU); 1: none.
    pub tensor_parallel_size: usize,
}

impl EngineConfig {
    pub fn new(model: impl Into<PathBuf>) -> Self {
        Self {
            model: model.into(),
            dtype: "auto".into(),
            device: "auto".into(),
            max_model_len: None,
            max_num_seqs: 256,
            max_num_batched_tokens: None,
            block_size: 16,
            kv_cache: KvBudget::Auto,
            kv_cache_dtype: crate::kv_cache::KvCacheDtype::Auto,
            gpu_memory_utilization: 0.9,
            seed: 0,
            isq: None,
            isq_lm_head: false,
            tokenizer: None,
            chat_template: None,
            enforce_eager: false,
            async_scheduling: true,
            lookahead_on_host: false,
            lora: None,
            lora_modules: Vec::new(),
            enable_prefix_caching: true,
            json_any_whitespace: false,
            tensor_parallel_size: 1,
        }
    }
}

/// Facts about the loaded model that callers need at the edge.
#[derive(Debug)]
pub struct EngineInfo {
    pub model_dir: PathBuf,
    pub model_config: DecoderConfig,
    pub tokenizer: Arc<Tokenizer>,
    pub chat_template: Option<Arc<ChatTemplate>>,
    pub generation: GenerationDefaults,
    /// What in-situ quantization did, when the config asked for it.
    pub isq: Option<crate::quant::isq::IsqReport>,
    /// For a GGUF file: the GGML types its tensors are stored in.
    pub stored: Option<String>,
    pub max_model_len: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub dtype: DType,
    /// What the KV cache stores.
    pub kv_cache_dtype: crate::kv_cache::KvCacheDtype,
    /// `cpu` or `cuda:N`.
    pub device: String,
    /// The LoRA adapters callers can name, when adapters are enabled.
    pub lora: Option<Arc<LoraRegistry>>,
    /// Compiles requests' structured-output constraints (and keeps them by their text).
    pub grammars: Arc<crate::structured::Grammars>,
    /// Preprocesses a vision model's images and lays them into prompts (`None`: text only).
    pub processor: Option<Arc<crate::multimodal::Processor>>,
    /// The timed phases of the start (set once the engine is ready).
    pub startup: std::sync::OnceLock<Vec<crate::engine::StartupPhase>>,
}

/// Live counters the engine thread publishes after each step.
#[derive(Debug, Default)]
pub struct EngineStats {
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    /// KV usage in parts per million.
    pub kv_usage_ppm: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub finished_stop: AtomicU64,
    pub finished_length: AtomicU64,
    pub finished_abort: AtomicU64,
    pub preemptions: AtomicU64,
    /// Steps planned and issued before the previous step's tokens were taken in (async
    /// scheduling).
    pub steps_ahead: AtomicU64,
    /// The adapters of running and waiting requests (adapters enabled).
    pub lora: std::sync::Mutex<Option<LoraActivity>>,
    /// Prompt tokens looked up in the prefix cache, and those found.
    pub prefix_cache_queries: AtomicU64,
    pub prefix_cache_hits: AtomicU64,
    /// Structured-output token masks computed, and the host time spent on them (microseconds,
    /// the grammar engine's work plus gathering the rows).
    pub mask_rows: AtomicU64,
    pub mask_micros: AtomicU64,
    /// Images the vision encoder has run on (once per image of a request: a prompt chunk that
    /// ends inside an image keeps its encoding for the next chunk).
    pub images_encoded: AtomicU64,
}

/// Which LoRA adapters requests use now (vLLM's `lora_requests_info`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoraActivity {
    pub max_loras: usize,
    pub running: Vec<String>,
    pub waiting: Vec<String>,
}

impl EngineStats {
    /// Counts `rows` structured-output masks computed in `took`.
    pub fn record_masks(&self, rows: usize, took: std::time::Duration) {
        self.mask_rows.fetch_add(rows as u64, Ordering::Relaxed);
        self.mask_micros
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn record_finish(&self, r: FinishReason) {
        let c = match r {
            FinishReason::Stop => &self.finished_stop,
            FinishReason::Length => &self.finished_length,
            FinishReason::Abort => &self.finished_abort,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }
}

pub(crate) enum Command {
    Submit {
        id: RequestId,
        req: Box<EngineRequest>,
        lora: Option<ResolvedLora>,
        grammar: Option<Box<CompiledGrammar>>,
        sink: Sink,
    },
    Abort(RequestId),
    Check(mpsc::Sender<Vec<String>>),
    ResetPrefixCache(mpsc::Sender<usize>),
    /// Runs the vision encoder alone (tests, benchmarks): per image, its features row-major.
    EncodeImages(
        Vec<Arc<crate::multimodal::ImageInput>>,
        mpsc::Sender<Result<Vec<Vec<f32>>, String>>,
    ),
    Shutdown,
}

/// The cloneable way into the engine.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    info: Arc<EngineInfo>,
    stats: Arc<EngineStats>,
    next_id: Arc<AtomicU64>,
    /// Disconnects when the engine thread has ended and dropped everything it held (the
    /// first [`EngineHandle::shutdown`] takes it and waits).
    ended: Arc<std::sync::Mutex<Option<mpsc::Receiver<()>>>>,
}

/// How long [`EngineHandle::shutdown`] waits for the engine thread to end.
const SHUTDOWN_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

impl EngineHandle {
    /// `ended` disconnects when the engine thread is gone.
    pub(crate) fn new(
        tx: mpsc::Sender<Command>,
        info: Arc<EngineInfo>,
        stats: Arc<EngineStats>,
        ended: mpsc::Receiver<()>,
    ) -> Self {
        Self {
            tx,
            info,
            stats,
            next_id: Arc::new(AtomicU64::new(1)),
            ended: Arc::new(std::sync::Mutex::new(Some(ended))),
        }
    }

    pub fn info(&self) -> &Arc<EngineInfo> {
        &self.info
    }

    pub fn stats(&self) -> &Arc<EngineStats> {
        &self.stats
    }

    /// Checks a request against the model's limits.
    pub fn validate(&self, req: &EngineRequest) -> Result<(), EngineError> {
        let vocab = self.info.model_config.vocab_size;
        req.params.validate(vocab)?;
        let prompt = req.prompt_token_ids.len();
        if prompt == 0 {
            return Err(EngineError::InvalidRequest("the prompt is empty".into()));
        }
        if let Some(bad) = req.prompt_token_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {bad} is out of vocabulary (size {vocab})"
            )));
        }
        if let Some(mm) = &req.mm {
            let Some(proc) = &self.info.processor else {
                return Err(EngineError::InvalidParam {
                    field: "messages".into(),
                    message: "this model does not take images".into(),
                });
            };
            let ok = mm.spans.len() == mm.images.len()
                && mm.spans.iter().zip(&mm.images).all(|(s, i)| {
                    s.len == i.num_tokens
                        && req
                            .prompt_token_ids
                            .get(s.offset..s.end())
                            .is_some_and(|t| t.iter().all(|&x| x == proc.image_token_id))
                })
                && mm.mrope.as_ref().is_none_or(|m| m.t.len() == prompt);
            if !ok {
                return Err(EngineError::InvalidRequest(
                    "the images do not match their placeholder tokens in the prompt".into(),
                ));
            }
        }
        let max = self.info.max_model_len;
        let completion = req.params.max_tokens.unwrap_or(0);
        if prompt >= max || prompt.saturating_add(completion) > max {
            return Err(EngineError::ContextLength {
                max,
                prompt,
                completion,
            });
        }
        let total = match req.params.max_tokens {
            Some(m) => prompt.saturating_add(m),
            None => max,
        };
        let blocks = total.div_ceil(self.info.block_size);
        if blocks > self.info.num_blocks {
            return Err(EngineError::InvalidRequest(format!(
                "the request needs up to {total} tokens of KV cache but the cache holds {} tokens",
                self.info.num_blocks * self.info.block_size
            )));
        }
        Ok(())
    }

    /// The adapter a request names, ready for the engine (read again from disk if it left host
    /// memory). An unknown name is [`EngineError::NotFound`].
    pub fn resolve_lora(&self, name: &str) -> Result<ResolvedLora, EngineError> {
        self.registry_for(name)?.resolve(name)
    }

    /// [`Self::resolve_lora`] when that reads nothing from disk: `None` for an adapter that left
    /// host memory (an async caller then resolves it on a blocking thread).
    pub fn resolve_lora_in_memory(&self, name: &str) -> Result<Option<ResolvedLora>, EngineError> {
        self.registry_for(name)?.resolve_in_memory(name)
    }

    /// The registry that may hold adapter `name`: without adapters every name is unknown.
    fn registry_for(&self, name: &str) -> Result<&Arc<LoraRegistry>, EngineError> {
        self.info
            .lora
            .as_ref()
            .ok_or_else(|| EngineError::NotFound(format!("The model `{name}` does not exist.")))
    }

    /// The adapter registry, or an error saying adapters are off.
    pub fn lora_registry(&self) -> Result<&Arc<LoraRegistry>, EngineError> {
        self.info.lora.as_ref().ok_or_else(|| {
            EngineError::Lora("LoRA adapters are not enabled (start with --enable-lora)".into())
        })
    }

    /// Registers adapter `name` from `path` (a PEFT directory or a hub id), read and checked now.
    pub fn load_lora(&self, name: &str, path: &std::path::Path) -> Result<AdapterId, EngineError> {
        self.lora_registry()?.load(name, path)
    }

    /// Unregisters adapter `name`; requests already using it finish with it.
    pub fn unload_lora(&self, name: &str) -> Result<AdapterId, EngineError> {
        self.lora_registry()?.unload(name)
    }

    /// Validates and queues a request; its outputs arrive on the returned stream. The adapter it
    /// names is resolved here, which may read it from disk ([`Self::submit_resolved`] takes it
    /// resolved).
    pub fn submit(&self, req: EngineRequest) -> Result<OutputStream, EngineError> {
        self.submit_resolved(req, None)
    }

    /// [`Self::submit`] with the adapter the request names already resolved (by
    /// [`Self::resolve_lora`]); `None` resolves it here.
    pub fn submit_resolved(
        &self,
        req: EngineRequest,
        resolved: Option<ResolvedLora>,
    ) -> Result<OutputStream, EngineError> {
        self.validate(&req)?;
        let lora = match (&req.lora, resolved) {
            (None, _) => None,
            (Some(_), Some(r)) => Some(r),
            (Some(name), None) => Some(self.resolve_lora(name)?),
        };
        let grammar = self.compile_grammar(&req.params)?;
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let commands = self.tx.clone();
        let abort = move |id| {
            let _ = commands.send(Command::Abort(id));
        };
        let (sink, stream) = crate::stream::channel(id, &req, Arc::new(abort));
        self.tx
            .send(Command::Submit {
                id,
                req: Box::new(req),
                lora,
                grammar: grammar.map(Box::new),
                sink,
            })
            .map_err(|_| EngineError::Stopped)?;
        Ok(stream)
    }

    /// The compiled constraint of a request's `structured_outputs` (from the cache when the same
    /// text was compiled before); an invalid one is an [`EngineError::InvalidParam`].
    pub fn compile_grammar(
        &self,
        params: &SamplingParams,
    ) -> Result<Option<CompiledGrammar>, EngineError> {
        let Some(spec) = &params.structured_outputs else {
            return Ok(None);
        };
        match self.info.grammars.compile(spec) {
            Ok((g, how)) => {
                if !how.cached {
                    tracing::debug!("grammar compiled in {:.1} ms", how.seconds * 1e3);
                }
                Ok(Some(g))
            }
            Err(GrammarError::Invalid(e)) => Err(e.into()),
            Err(e @ GrammarError::Unavailable(_)) => {
                Err(EngineError::InvalidRequest(e.to_string()))
            }
        }
    }

    /// Aborts a request; its blocks are freed at the engine's next turn.
    pub fn abort(&self, id: RequestId) {
        let _ = self.tx.send(Command::Abort(id));
    }

    /// Asks the engine thread for every inconsistency in its scheduler and KV pool.
    pub fn check_integrity(&self) -> Result<Vec<String>, EngineError> {
        let (tx, rx) = mpsc::channel();
        self.tx
            .send(Command::Check(tx))
            .map_err(|_| EngineError::Stopped)?;
        rx.recv().map_err(|_| EngineError::Stopped)
    }

    /// Forgets every cached prefix block (requests in flight keep theirs); returns how many
    /// blocks were cached. Waits for the engine thread to take it between steps.
    pub fn reset_prefix_cache(&self) -> Result<usize, EngineError> {
        let (tx, rx) = mpsc::channel();
        self.tx
            .send(Command::ResetPrefixCache(tx))
            .map_err(|_| EngineError::Stopped)?;
        rx.recv().map_err(|_| EngineError::Stopped)
    }

    /// Runs the model's vision encoder over `images` (one batch) on the engine thread: per
    /// image, its `[num_tokens, hidden]` features row-major in f32.
    pub fn encode_images(
        &self,
        images: Vec<Arc<crate::multimodal::ImageInput>>,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let (tx, rx) = mpsc::channel();
        self.tx
            .send(Command::EncodeImages(images, tx))
            .map_err(|_| EngineError::Stopped)?;
        rx.recv()
            .map_err(|_| EngineError::Stopped)?
            .map_err(EngineError::Model)
    }

    /// Stops the engine thread once its queue is drained of commands, and waits (up to two
    /// minutes) until it has ended and let go of its devices: an engine started next on the same
    /// GPUs never meets this one's teardown.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
        let ended = match self.ended.lock() {
            Ok(mut g) => g.take(),
            Err(p) => p.into_inner().take(),
        };
        if let Some(rx) = ended {
            if let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(SHUTDOWN_WAIT) {
                tracing::warn!("the engine thread did not end within {SHUTDOWN_WAIT:?}");
            }
        }
    }
}
