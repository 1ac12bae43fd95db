//! `rserve._core`: the engine for Python, in-process. `Engine` wraps the same [`EngineHandle`]
//! the HTTP server drives; `RequestStream` iterates a request's deltas (as JSON of
//! `RequestDelta`) or waits for its assembled output (`result`), with the GIL released, checking
//! for Ctrl-C while it waits. Parameters are
//! parsed by the server's own code (`openai::params`), so Python and HTTP accept and reject the
//! same input; user errors become `ValueError`.

use crate::openai::error::ApiError;
use crate::openai::media::{fetch, image_urls, MediaConfig};
use crate::openai::params::{chat_prompt, offline_params};
use crate::openai::types::ChatMessage;
use pyo3::exceptions::{PyRuntimeError, PyStopIteration, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use rserve_core::loader::GenerationDefaults;
use rserve_core::RequestId;
use rserve_core::{
    Engine, EngineConfig, EngineError, EngineHandle, EngineRequest, KvBudget, OutputStream,
    RequestOutput,
};
use std::sync::Mutex;
use std::time::Duration;

fn parse_messages(json: &str) -> PyResult<Vec<ChatMessage>> {
    serde_json::from_str(json).map_err(|e| PyValueError::new_err(format!("invalid messages: {e}")))
}

fn value_err(e: ApiError) -> PyErr {
    PyValueError::new_err(e.message)
}

fn engine_err(e: EngineError) -> PyErr {
    if e.is_user_error() {
        PyValueError::new_err(e.to_string())
    } else {
        PyRuntimeError::new_err(e.to_string())
    }
}

/// The package version.
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// Validates sampling parameters (JSON) with the server's parser; returns them unchanged.
#[pyfunction]
fn check_params(params_json: &str) -> PyResult<String> {
    offline_params(
        params_json,
        &GenerationDefaults::default(),
        u32::MAX as usize,
    )
    .map_err(value_err)?;
    Ok(params_json.to_string())
}

/// The embedded default model: its directory (written on first use) and its served name.
#[pyfunction]
fn default_model(py: Python<'_>) -> PyResult<(String, String)> {
    let dir = py
        .detach(rserve_core::default_model::ensure_default_model)
        .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
    Ok((
        dir.display().to_string(),
        rserve_core::default_model::DEFAULT_MODEL_NAME.to_string(),
    ))
}

/// Runs the `rserve` command line in-process (e.g. `["serve", MODEL, "--port", "8000"]`).
#[pyfunction]
fn serve(py: Python<'_>, argv: Vec<String>) -> PyResult<()> {
    let mut args = vec!["rserve".to_string()];
    args.extend(argv);
    py.detach(|| crate::main_with_args(args))
        .map_err(|e| PyRuntimeError::new_err(format!("{e:#}")))
}

#[pyclass(frozen, name = "Engine", module = "rserve._core")]
struct PyEngine {
    handle: EngineHandle,
    /// Where `chat`'s images may come from and how many a prompt may hold.
    media: MediaConfig,
}

#[pymethods]
impl PyEngine {
    #[new]
    #[pyo3(signature = (model, *, dtype = "auto".to_string(), device = "auto".to_string(), max_model_len = None, max_num_seqs = 256, max_num_batched_tokens = None, block_size = 16, kv_cache_memory = None, gpu_memory_utilization = 0.9, seed = 0, chat_template = None, enforce_eager = false, async_scheduling = true, isq = None, isq_lm_head = false, tokenizer = None, quantization = None, kv_cache_dtype = "auto".to_string(), enable_lora = false, max_loras = 1, max_lora_rank = 16, max_cpu_loras = None, enable_prefix_caching = true, tensor_parallel_size = 1, limit_mm_per_prompt = None, allowed_local_media_path = None, allowed_media_domains = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model: String,
        dtype: String,
        device: String,
        max_model_len: Option<usize>,
        max_num_seqs: usize,
        max_num_batched_tokens: Option<usize>,
        block_size: usize,
        kv_cache_memory: Option<usize>,
        gpu_memory_utilization: f64,
        seed: u64,
        chat_template: Option<String>,
        enforce_eager: bool,
        async_scheduling: bool,
        isq: Option<String>,
        isq_lm_head: bool,
        tokenizer: Option<String>,
        quantization: Option<String>,
        kv_cache_dtype: String,
        enable_lora: bool,
        max_loras: usize,
        max_lora_rank: usize,
        max_cpu_loras: Option<usize>,
        enable_prefix_caching: bool,
        tensor_parallel_size: usize,
        limit_mm_per_prompt: Option<usize>,
        allowed_local_media_path: Option<String>,
        allowed_media_domains: Option<Vec<String>>,
    ) -> PyResult<Self> {
        let mut media = MediaConfig::default();
        if let Some(n) = limit_mm_per_prompt {
            media.max_images = n;
        }
        media.allowed_local_path = allowed_local_media_path.map(std::path::PathBuf::from);
        media.allowed_domains = allowed_media_domains;
        let mut cfg = EngineConfig::new(model);
        cfg.dtype = dtype;
        cfg.device = device;
        cfg.max_model_len = max_model_len;
        cfg.max_num_seqs = max_num_seqs;
        cfg.gpu_memory_utilization = gpu_memory_utilization;
        cfg.kv_cache_dtype = kv_cache_dtype
            .trim()
            .to_ascii_lowercase()
            .parse()
            .map_err(PyValueError::new_err)?;
        cfg.max_num_batched_tokens = max_num_batched_tokens;
        cfg.block_size = block_size;
        cfg.seed = seed;
        cfg.chat_template = chat_template;
        cfg.enforce_eager = enforce_eager;
        cfg.async_scheduling = async_scheduling;
        cfg.enable_prefix_caching = enable_prefix_caching;
        cfg.tensor_parallel_size = tensor_parallel_size;
        cfg.isq = match isq {
            Some(s) => Some(
                s.parse::<rserve_core::quant::IsqFormat>()
                    .map_err(PyValueError::new_err)?,
            ),
            None => None,
        };
        if let Some(qz) = quantization {
            if !qz.trim().eq_ignore_ascii_case("fp8") {
                return Err(PyValueError::new_err(format!(
                    "quantization takes \"fp8\" (quantized at load time, as isq=\"fp8\"); for GGML formats use isq, got {qz:?}"
                )));
            }
            let fp8 = rserve_core::quant::IsqFormat::Fp8;
            if cfg.isq.is_some_and(|f| f != fp8) {
                return Err(PyValueError::new_err(
                    "isq and quantization disagree; give one",
                ));
            }
            cfg.isq = Some(fp8);
        }
        if isq_lm_head && cfg.isq.is_none() {
            return Err(PyValueError::new_err("isq_lm_head needs isq"));
        }
        cfg.isq_lm_head = isq_lm_head;
        cfg.tokenizer = tokenizer.map(std::path::PathBuf::from);
        if enable_lora {
            cfg.lora = Some(rserve_core::lora::LoraOptions {
                max_loras,
                max_rank: max_lora_rank,
                max_cpu_loras: max_cpu_loras.unwrap_or(max_loras),
            });
        }
        if let Some(b) = kv_cache_memory {
            cfg.kv_cache = KvBudget::Bytes(b);
        }
        let handle = py.detach(|| Engine::start(cfg)).map_err(|e| match e {
            EngineError::InvalidConfig(m) => PyValueError::new_err(m),
            other if other.is_user_error() => PyValueError::new_err(other.to_string()),
            other => PyRuntimeError::new_err(other.to_string()),
        })?;
        Ok(Self { handle, media })
    }

    #[getter]
    fn model_dir(&self) -> String {
        self.handle.info().model_dir.display().to_string()
    }

    #[getter]
    fn max_model_len(&self) -> usize {
        self.handle.info().max_model_len
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.handle.info().model_config.vocab_size
    }

    /// Tokens the KV cache holds.
    #[getter]
    fn kv_cache_tokens(&self) -> usize {
        let info = self.handle.info();
        info.num_blocks * info.block_size
    }

    /// What the KV cache stores: `auto` (the model's dtype) or `fp8_e4m3`.
    #[getter]
    fn kv_cache_dtype(&self) -> &'static str {
        self.handle.info().kv_cache_dtype.name()
    }

    #[pyo3(signature = (text, add_special_tokens = true))]
    fn encode(&self, text: &str, add_special_tokens: bool) -> PyResult<Vec<u32>> {
        self.handle
            .info()
            .tokenizer
            .encode(text, add_special_tokens)
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    #[pyo3(signature = (ids, skip_special_tokens = true))]
    fn decode(&self, ids: Vec<u32>, skip_special_tokens: bool) -> PyResult<String> {
        self.handle
            .info()
            .tokenizer
            .decode(&ids, skip_special_tokens)
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    #[pyo3(signature = (messages_json, add_generation_prompt = true, tools_json = None))]
    fn chat_prompt(
        &self,
        messages_json: &str,
        add_generation_prompt: bool,
        tools_json: Option<&str>,
    ) -> PyResult<Vec<u32>> {
        let msgs = parse_messages(messages_json)?;
        let tools: Option<Vec<serde_json::Value>> = tools_json
            .map(serde_json::from_str)
            .transpose()
            .map_err(|e| PyValueError::new_err(format!("invalid tools: {e}")))?;
        if let Some(t) = &tools {
            crate::openai::tool_choice::plan(Some(t), Some(&serde_json::json!("none")), None, None)
                .map_err(value_err)?;
        }
        let info = self.handle.info();
        Ok(
            chat_prompt(info, &msgs, add_generation_prompt, None, tools.as_deref())
                .map_err(value_err)?
                .1,
        )
    }

    /// The encoded images of a conversation's `image_url` parts (`data:` URIs or `http(s)`
    /// URLs), in order, for [`PyEngine::submit`]; ValueError for a bad URL, a failed fetch, too
    /// many images or a model that takes none.
    fn chat_images<'py>(
        &self,
        py: Python<'py>,
        messages_json: &str,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let msgs = parse_messages(messages_json)?;
        let urls = image_urls(&msgs).map_err(value_err)?;
        if !urls.is_empty() && self.handle.info().processor.is_none() {
            return Err(PyValueError::new_err("this model does not take images"));
        }
        if urls.len() > self.media.max_images {
            return Err(PyValueError::new_err(format!(
                "at most {} images may be given with one prompt (limit_mm_per_prompt)",
                self.media.max_images
            )));
        }
        let cfg = self.media.clone();
        let bytes: Vec<Vec<u8>> = py
            .detach(|| {
                urls.iter()
                    .map(|u| fetch(u, &cfg))
                    .collect::<Result<_, _>>()
            })
            .map_err(value_err)?;
        Ok(bytes.iter().map(|b| PyBytes::new(py, b)).collect())
    }

    /// Registers LoRA adapter `name` from `path` (read and checked now, the GIL released).
    fn load_lora(&self, py: Python<'_>, name: &str, path: &str) -> PyResult<u32> {
        let h = self.handle.clone();
        py.detach(|| h.load_lora(name, std::path::Path::new(path)))
            .map(|id| id.0)
            .map_err(engine_err)
    }

    /// Unregisters LoRA adapter `name` (requests using it finish with it).
    /// Forgets every cached prefix block; the number of blocks that were cached.
    fn reset_prefix_cache(&self, py: Python<'_>) -> PyResult<usize> {
        let h = self.handle.clone();
        py.detach(move || h.reset_prefix_cache())
            .map_err(engine_err)
    }

    fn unload_lora(&self, name: &str) -> PyResult<u32> {
        self.handle
            .unload_lora(name)
            .map(|id| id.0)
            .map_err(engine_err)
    }

    /// The registered LoRA adapters: (name, path).
    fn lora_adapters(&self) -> Vec<(String, String)> {
        self.handle.info().lora.as_ref().map_or_else(Vec::new, |r| {
            r.list()
                .into_iter()
                .map(|a| (a.name, a.path.display().to_string()))
                .collect()
        })
    }

    /// Submits a prompt (text or token ids) with sampling parameters (JSON), with the LoRA
    /// adapter registered as `lora` when given, and the prefix-cache salt `cache_salt`.
    #[pyo3(signature = (prompt, params_json, lora = None, images = None, *, cache_salt = None))]
    fn submit(
        &self,
        py: Python<'_>,
        prompt: &Bound<'_, PyAny>,
        params_json: &str,
        lora: Option<String>,
        images: Option<Vec<Bound<'_, PyBytes>>>,
        cache_salt: Option<String>,
    ) -> PyResult<PyRequestStream> {
        if cache_salt.as_deref() == Some("") {
            return Err(PyValueError::new_err(
                "cache_salt: must be a non-empty string",
            ));
        }
        let info = self.handle.info();
        let ids: Vec<u32> = if let Ok(text) = prompt.extract::<String>() {
            info.tokenizer
                .encode(&text, true)
                .map_err(|e| PyValueError::new_err(e.to_string()))?
        } else {
            prompt.extract::<Vec<u32>>().map_err(|_| {
                PyValueError::new_err("prompt must be a string or a list of token ids")
            })?
        };
        let params = offline_params(params_json, &info.generation, info.model_config.vocab_size)
            .map_err(value_err)?;
        let (ids, mm) = match images.filter(|v| !v.is_empty()) {
            None => (ids, None),
            Some(list) => {
                let proc = info
                    .processor
                    .clone()
                    .ok_or_else(|| PyValueError::new_err("this model does not take images"))?;
                if list.len() > self.media.max_images {
                    return Err(PyValueError::new_err(format!(
                        "at most {} images may be given with one prompt (limit_mm_per_prompt)",
                        self.media.max_images
                    )));
                }
                let raw: Vec<Vec<u8>> = list.iter().map(|b| b.as_bytes().to_vec()).collect();
                let decoded = py
                    .detach(|| {
                        raw.iter()
                            .map(|b| proc.decode(b))
                            .collect::<Result<Vec<_>, _>>()
                    })
                    .map_err(|e| PyValueError::new_err(format!("invalid image: {e}")))?;
                let (ids, mm) = proc
                    .expand(&ids, decoded)
                    .map_err(|e| PyValueError::new_err(e.to_string()))?;
                (ids, Some(std::sync::Arc::new(mm)))
            }
        };
        let stream = self
            .handle
            .submit(EngineRequest {
                prompt_token_ids: ids,
                params,
                lora,
                cache_salt,
                mm,
            })
            .map_err(engine_err)?;
        Ok(PyRequestStream {
            id: stream.request_id(),
            prompt: stream.output().prompt_token_ids.clone(),
            engine: self.handle.clone(),
            inner: Mutex::new(Some(stream)),
        })
    }

    /// The server's router over this engine (every OpenAI route), for a Python web framework to
    /// put in front of it.
    #[pyo3(signature = (served_model_name, *, api_key = None, tool_call_parser = None))]
    fn http_app(
        &self,
        served_model_name: String,
        api_key: Option<String>,
        tool_call_parser: Option<String>,
    ) -> PyResult<crate::python_http::PyHttpApp> {
        crate::python_http::PyHttpApp::new(
            self.handle.clone(),
            served_model_name,
            api_key,
            tool_call_parser.as_deref(),
            self.media.clone(),
        )
    }

    fn shutdown(&self, py: Python<'_>) {
        // waits for the engine thread to end, without holding the interpreter
        py.detach(|| self.handle.shutdown());
    }
}

#[pyclass(frozen, name = "RequestStream", module = "rserve._core")]
struct PyRequestStream {
    id: RequestId,
    /// Aborts go straight to the engine, never through the stream's lock (held while waiting).
    engine: EngineHandle,
    prompt: Vec<u32>,
    inner: Mutex<Option<OutputStream>>,
}

impl PyRequestStream {
    /// One wait of at most `timeout`: Ok(Some(json)), Ok(None) on timeout, StopIteration at the end.
    fn wait_once(&self, py: Python<'_>, timeout: Duration) -> PyResult<Option<String>> {
        let r = py.detach(|| -> PyResult<_> {
            let mut g = self
                .inner
                .lock()
                .map_err(|_| PyRuntimeError::new_err("stream lock poisoned"))?;
            match g.as_mut() {
                None => Ok(Ok(None)),
                Some(s) => Ok(s.next_timeout(timeout)),
            }
        })?;
        match r {
            Err(()) => Ok(None),
            Ok(None) => {
                if let Ok(mut g) = self.inner.lock() {
                    g.take();
                }
                Err(PyStopIteration::new_err(()))
            }
            Ok(Some(Err(e))) => Err(engine_err(e)),
            Ok(Some(Ok(out))) => serde_json::to_string(&out)
                .map(Some)
                .map_err(|e| PyRuntimeError::new_err(e.to_string())),
        }
    }
}

#[pymethods]
impl PyRequestStream {
    #[getter]
    fn request_id(&self) -> u64 {
        self.id.0
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<String> {
        loop {
            if let Some(s) = self.wait_once(py, Duration::from_millis(100))? {
                return Ok(s);
            }
            py.check_signals()?;
        }
    }

    fn next_timeout(&self, py: Python<'_>, timeout_s: f64) -> PyResult<Option<String>> {
        if timeout_s.is_nan() {
            return Err(PyValueError::new_err(
                "timeout_s must be a number of seconds, got nan",
            ));
        }
        let t = Duration::from_secs_f64(timeout_s.clamp(0.0, 3600.0));
        self.wait_once(py, t)
    }

    fn abort(&self) {
        self.engine.abort(self.id);
    }

    #[getter]
    fn prompt_token_ids(&self) -> Vec<u32> {
        self.prompt.clone()
    }

    /// Waits for the end (GIL released, Ctrl-C checked) and returns the assembled output as
    /// JSON: one conversion however long the output.
    fn result(&self, py: Python<'_>) -> PyResult<String> {
        loop {
            let r = py.detach(|| -> PyResult<Option<Result<RequestOutput, EngineError>>> {
                let mut g = self
                    .inner
                    .lock()
                    .map_err(|_| PyRuntimeError::new_err("stream lock poisoned"))?;
                let Some(s) = g.as_mut() else {
                    return Err(PyRuntimeError::new_err("the stream was consumed"));
                };
                match s.next_timeout(Duration::from_millis(100)) {
                    Err(()) => Ok(None),
                    Ok(Some(Err(e))) => Ok(Some(Err(e))),
                    Ok(Some(Ok(_))) => Ok(None),
                    Ok(None) => Ok(Some(match g.take() {
                        Some(s) if s.output().finished => Ok(s.into_output()),
                        _ => Err(EngineError::Stopped),
                    })),
                }
            })?;
            match r {
                Some(Ok(out)) => {
                    return serde_json::to_string(&out)
                        .map_err(|e| PyRuntimeError::new_err(e.to_string()))
                }
                Some(Err(e)) => return Err(engine_err(e)),
                None => py.check_signals()?,
            }
        }
    }
}

#[pymodule]
#[pyo3(name = "_core")]
fn core_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // the engine's logs go to stderr when RUST_LOG asks for them (as `rserve serve` does)
    if std::env::var_os("RUST_LOG").is_some() {
        crate::init_logging("warn");
    }
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(check_params, m)?)?;
    m.add_function(wrap_pyfunction!(serve, m)?)?;
    m.add_function(wrap_pyfunction!(default_model, m)?)?;
    m.add_class::<PyEngine>()?;
    m.add_class::<PyRequestStream>()?;
    m.add_class::<crate::python_http::PyHttpApp>()?;
    m.add_class::<crate::python_http::PyHttpResponse>()?;
    Ok(())
}
