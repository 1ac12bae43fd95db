//! Command-line arguments (vLLM's flag names where they exist).

use clap::{Args, Parser, Subcommand};

fn parse_isq(s: &str) -> Result<rserve_core::quant::IsqFormat, String> {
    s.parse()
}

/// vLLM's `--quantization`: rserve takes `fp8` (quantized at load time, as `--isq fp8`).
fn parse_kv_cache_dtype(s: &str) -> Result<rserve_core::kv_cache::KvCacheDtype, String> {
    s.trim().to_ascii_lowercase().parse()
}

/// vLLM's `--structured-outputs-config`: a JSON object with `backend` (`auto`, `guidance` or
/// `llguidance`: the grammar engine rserve has) and `disable_any_whitespace` (default true:
/// compact JSON); returns whether JSON may hold free whitespace.
fn parse_structured_config(s: &str) -> Result<bool, String> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Config {
        #[serde(default)]
        backend: Option<String>,
        #[serde(default)]
        disable_any_whitespace: Option<bool>,
    }
    let c: Config = serde_json::from_str(s).map_err(|e| format!("not a valid config: {e}"))?;
    if let Some(b) = c.backend.as_deref() {
        if !matches!(b, "auto" | "guidance" | "llguidance") {
            return Err(format!(
                "backend `{b}` is not available: rserve's grammar engine is llguidance (`auto`)"
            ));
        }
    }
    Ok(!c.disable_any_whitespace.unwrap_or(true))
}

fn parse_tool_parser(s: &str) -> Result<crate::openai::tools::ToolParser, String> {
    crate::openai::tools::ToolParser::from_name(s.trim()).ok_or_else(|| {
        format!(
            "unknown tool call parser `{s}`; available: {}",
            crate::openai::tools::ToolParser::NAMES.join(", ")
        )
    })
}

fn parse_quantization(s: &str) -> Result<rserve_core::quant::IsqFormat, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "fp8" => Ok(rserve_core::quant::IsqFormat::Fp8),
        _ => Err(format!(
            "--quantization takes fp8 (quantized at load time, as --isq fp8); for GGML formats use --isq, got `{s}`"
        )),
    }
}

#[derive(Debug, Parser)]
#[command(name = "rserve", version, about = "A fast, small LLM serving engine")]
pub struct Cli {
    /// Log level: error, warn, info, debug, trace.
    #[arg(long, global = true, default_value = "warn")]
    pub log_level: String,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the OpenAI-compatible HTTP API.
    Serve(ServeArgs),
    /// Generate a completion for one prompt and print it.
    Generate(GenerateArgs),
    /// Benchmarks: `bench serve` (load against an OpenAI-compatible server) or in-process throughput.
    Bench(BenchCommand),
    /// LoRA adapter tools.
    #[command(subcommand)]
    Adapters(AdaptersCommand),
}

#[derive(Debug, Subcommand)]
pub enum AdaptersCommand {
    /// Print a PEFT adapter's configuration, targets, ranks and size, and check it against a base.
    Inspect(InspectArgs),
}

#[derive(Debug, Args)]
pub struct InspectArgs {
    /// The adapter: a PEFT directory or a hub id.
    pub path: String,
    /// The base model to check it against (a directory, hub id or GGUF file); default: the
    /// adapter's `base_model_name_or_path` when that resolves.
    #[arg(long)]
    pub base: Option<String>,
    /// The largest rank the server would take (`--max-lora-rank`).
    #[arg(long, default_value_t = 16)]
    pub max_lora_rank: usize,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// How to load and run the engine.
#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// A model directory in Hugging Face layout, a hub id, or a GGUF file; the embedded tiny
    /// model when omitted.
    pub model: Option<String>,
    /// auto (follow the checkpoint), float32, bfloat16 or float16.
    #[arg(long, default_value = "auto")]
    pub dtype: String,
    /// auto (the first GPU when this build has CUDA and one is present, else the CPU), cpu, cuda
    /// or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Maximum context length (prompt + completion); defaults to the model's.
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Maximum number of sequences in one step.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Token budget of one step (prefill chunks and decodes together); default 8192 on GPUs of
    /// 70 GiB or more, 2048 elsewhere.
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Split the model over this many GPUs of this host (tensor parallelism over NCCL, one
    /// thread per GPU; rank r on GPU r). `-tp N` works too.
    #[arg(long, visible_alias = "tp", default_value_t = 1)]
    pub tensor_parallel_size: usize,
    /// Bytes of KV cache (default: 1 GiB on the CPU; on a GPU what --gpu-memory-utilization leaves
    /// after the weights and the measured activation peak; capped by what max_num_seqs can use).
    #[arg(long)]
    pub kv_cache_memory: Option<usize>,
    /// What the KV cache stores: auto (the model's dtype) or fp8 / fp8_e4m3 (E4M3 bytes, one
    /// scale per layer for keys and one for values: twice the tokens in the same memory).
    #[arg(long, default_value = "auto", value_parser = parse_kv_cache_dtype)]
    pub kv_cache_dtype: rserve_core::kv_cache::KvCacheDtype,
    /// Fraction of GPU memory rserve may use for weights, activations and KV cache (ignored on the
    /// CPU).
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f64,
    /// Engine seed for requests without their own.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Run every step eagerly (on a GPU, decode steps otherwise replay CUDA graphs).
    #[arg(long)]
    pub enforce_eager: bool,
    /// Wait for each step's tokens before planning the next (on a GPU the next step is otherwise
    /// issued while the current one runs).
    #[arg(long)]
    pub no_async_scheduling: bool,
    /// Keep computed KV blocks by content and start each request from the longest cached prefix
    /// of its prompt (on by default; vLLM's flag).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    /// Compute every prompt in full: no prefix cache.
    #[arg(long, overrides_with = "enable_prefix_caching")]
    pub no_enable_prefix_caching: bool,
    /// Structured output settings, as JSON: `{"disable_any_whitespace": false}` lets JSON hold
    /// free whitespace (compact by default); `backend` may be `auto`.
    #[arg(long, value_parser = parse_structured_config, value_name = "JSON")]
    pub structured_outputs_config: Option<bool>,
    /// Quantize the decoder's projections while loading: q8_0, q4_0, q4k or q6k (GGML blocks;
    /// rows that do not fit a format's blocks fall back per tensor, as llama.cpp does) or fp8
    /// (E4M3, a scale per output channel; FP8 tensor cores on Hopper). The embeddings and
    /// lm_head stay in --dtype.
    #[arg(long, value_parser = parse_isq)]
    pub isq: Option<rserve_core::quant::IsqFormat>,
    /// vLLM's spelling of `--isq fp8`.
    #[arg(long, value_parser = parse_quantization)]
    pub quantization: Option<rserve_core::quant::IsqFormat>,
    /// With --isq, quantize the output head (lm_head) too: faster decoding of small models,
    /// whose head is a large part of their weights, at some cost in accuracy.
    #[arg(long)]
    pub isq_lm_head: bool,
    /// A directory with tokenizer.json (and tokenizer_config.json) used instead of the model's
    /// tokenizer, e.g. for a GGUF file whose vocabulary rserve does not rebuild.
    #[arg(long)]
    pub tokenizer: Option<String>,
    /// Serve LoRA adapters: requests name one by its name as `model`.
    #[arg(long)]
    pub enable_lora: bool,
    /// Adapters to serve from the start: `name=path` (a PEFT adapter directory or a hub id) or
    /// vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`; several may follow
    /// the flag.
    #[arg(long, num_args = 1.., value_parser = parse_lora_module)]
    pub lora_modules: Vec<LoraModuleArg>,
    /// Adapters resident on the device at once (and so the most distinct adapters in one step).
    #[arg(long, default_value_t = 1)]
    pub max_loras: usize,
    /// The largest LoRA rank served (device slots are sized for it).
    #[arg(long, default_value_t = 16)]
    pub max_lora_rank: usize,
    /// Adapters kept in host memory (default and minimum: --max-loras); others are read again
    /// from their directory when a request names them.
    #[arg(long)]
    pub max_cpu_loras: Option<usize>,
}

/// One `--lora-modules` value.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct LoraModuleArg {
    pub name: String,
    /// A PEFT adapter directory or a hub id.
    pub path: String,
    /// What `/v1/models` names as the adapter's `parent` (vLLM's field; default: the served
    /// model's name).
    #[serde(default)]
    pub base_model_name: Option<String>,
}

/// One `--lora-modules` value: `name=path` or `{"name": ..., "path": ..., "base_model_name": ...}`.
pub fn parse_lora_module(s: &str) -> Result<LoraModuleArg, String> {
    let s = s.trim();
    if s.starts_with('{') {
        return serde_json::from_str(s).map_err(|e| format!("--lora-modules: {e}"));
    }
    match s.split_once('=') {
        Some((n, p)) if !n.trim().is_empty() && !p.trim().is_empty() => Ok(LoraModuleArg {
            name: n.trim().to_owned(),
            path: p.trim().to_owned(),
            base_model_name: None,
        }),
        _ => Err(format!(
            "--lora-modules takes name=path or a JSON object with name and path, got `{s}`"
        )),
    }
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Address to bind (0.0.0.0 in the container images).
    #[arg(long, env = "RSERVE_HOST", default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, env = "RSERVE_PORT", default_value_t = 8000)]
    pub port: u16,
    /// The model name clients use (defaults to MODEL as given).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Require `Authorization: Bearer KEY` on /v1/*.
    #[arg(long, env = "RSERVE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// A chat template file (or inline Jinja) replacing the model's own.
    #[arg(long)]
    pub chat_template: Option<String>,
    /// Requests in flight beyond which new ones get 503 with Retry-After.
    #[arg(long, default_value_t = 4096)]
    pub max_pending: usize,
    /// Largest accepted request body in bytes (larger ones get 413). Default: what the longest
    /// prompt the context can hold takes, plus 1 MiB.
    #[arg(long)]
    pub max_body_bytes: Option<usize>,
    /// Completions one request may ask for: prompts x `n` (or x `best_of`); more is a 400.
    #[arg(long, default_value_t = 256)]
    pub max_choices_per_request: usize,
    /// Seconds an idle keep-alive connection stays open.
    #[arg(long, env = "RSERVE_HTTP_TIMEOUT_KEEP_ALIVE", default_value_t = 5.0)]
    pub timeout_keep_alive: f64,
    /// Seconds a client has to send a request's headers once the server waits for them.
    #[arg(long, default_value_t = 10.0)]
    pub header_read_timeout: f64,
    /// Threads that render chat templates and tokenize prompts (default: one per core).
    #[arg(long)]
    pub tokenizer_threads: Option<usize>,
    /// Serve `GET /tokenizer_info` (the tokenizer's configuration).
    #[arg(long)]
    pub enable_tokenizer_info_endpoint: bool,
    /// Seconds in-flight requests get to finish after SIGTERM/SIGINT.
    #[arg(long, default_value_t = 30)]
    pub shutdown_timeout: u64,
    /// Let the model decide when to call tools (`tool_choice: "auto"`, the default when a request
    /// has tools); needs --tool-call-parser.
    #[arg(long, requires = "tool_call_parser")]
    pub enable_auto_tool_choice: bool,
    /// How the model writes tool calls: hermes (Hermes, Qwen2.5 and Qwen3's `<tool_call>`),
    /// llama3_json (Llama 3.1/3.2) or mistral (`[TOOL_CALLS]`).
    #[arg(long, value_parser = parse_tool_parser)]
    pub tool_call_parser: Option<crate::openai::tools::ToolParser>,
    /// Images one prompt may hold: `image=N` or `{"image": N}` (default 8).
    #[arg(long, value_parser = crate::openai::media::parse_limit)]
    pub limit_mm_per_prompt: Option<usize>,
    /// Hosts image URLs may be fetched from, comma-separated (default: any).
    #[arg(long, value_delimiter = ',')]
    pub allowed_media_domains: Option<Vec<String>>,
    /// A directory whose images `file://` URLs may name (default: no file URLs).
    #[arg(long)]
    pub allowed_local_media_path: Option<std::path::PathBuf>,
    /// Seconds allowed to fetch one image over HTTP.
    #[arg(long, default_value_t = 5.0)]
    pub media_fetch_timeout: f64,
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// The prompt text.
    #[arg(long)]
    pub prompt: String,
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Seed of this request's sampling.
    #[arg(long)]
    pub sample_seed: Option<u64>,
    /// Keep generating after end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print the full output (token ids, logprobs) as JSON.
    #[arg(long)]
    pub json: bool,
    /// Top alternatives per token in --json output.
    #[arg(long, default_value_t = 0)]
    pub logprobs: usize,
}

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchCommand {
    #[command(subcommand)]
    pub serve: Option<BenchSub>,
    #[command(flatten)]
    pub local: BenchArgs,
}

#[derive(Debug, Subcommand)]
pub enum BenchSub {
    /// Load an OpenAI-compatible server like `vllm bench serve` and report latency percentiles.
    Serve(BenchServeArgs),
    /// Structured output's host cost for a model's vocabulary: grammar compile time and the
    /// time to compute each token mask.
    Grammar(BenchGrammarArgs),
    /// A vision model's cost per image: host decode and preprocessing, the encoder on one image
    /// and on a batch.
    Vision(BenchVisionArgs),
    /// Process start to `/health` and to the first token of a short completion, over fresh
    /// server processes (arguments after `--` go to `rserve serve`).
    Startup(BenchStartupArgs),
}

#[derive(Debug, Args)]
pub struct BenchStartupArgs {
    /// A model directory, hub id or GGUF file (default: the embedded model).
    pub model: Option<String>,
    /// Fresh server processes to time.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Tokens in the completion.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    /// Drop the page cache before each run (needs root).
    #[arg(long)]
    pub cold: bool,
    /// The server binary (default: this one).
    #[arg(long)]
    pub binary: Option<std::path::PathBuf>,
    /// Seconds to wait for a run before giving up.
    #[arg(long, default_value_t = 600)]
    pub timeout: u64,
    /// Print each run as one JSON line.
    #[arg(long)]
    pub json: bool,
    /// Arguments for `rserve serve`, after `--`.
    #[arg(last = true)]
    pub serve_args: Vec<String>,
}

#[derive(Debug, Args)]
pub struct BenchVisionArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Side of the square image timed alone, in pixels.
    #[arg(long, default_value_t = 1024)]
    pub size: usize,
    /// Images encoded together in the batch measurement.
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// Side of each image of the batch, in pixels.
    #[arg(long, default_value_t = 512)]
    pub batch_size: usize,
    #[arg(long, default_value_t = 5)]
    pub iters: usize,
    /// Print the results as one JSON line.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct BenchGrammarArgs {
    /// A model directory or hub id (its tokenizer and config are read; no weights).
    pub model: String,
    /// Fields of the JSON schema compiled.
    #[arg(long, default_value_t = 50)]
    pub fields: usize,
    /// Steps of the walk whose masks are timed.
    #[arg(long, default_value_t = 512)]
    pub tokens: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print the results as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct BenchServeArgs {
    /// The server's OpenAI base URL.
    #[arg(long, default_value = "http://127.0.0.1:8000/v1")]
    pub base_url: String,
    /// The model name to request.
    #[arg(long)]
    pub model: String,
    /// LoRA adapter names requested in turn instead of --model (a uniform mix, as with vLLM's
    /// `--lora-modules`).
    #[arg(long, value_delimiter = ',')]
    pub lora_modules: Vec<String>,
    #[arg(long, default_value_t = 100)]
    pub num_prompts: usize,
    #[arg(long, default_value_t = 16)]
    pub max_concurrency: usize,
    #[arg(long, default_value_t = 1024)]
    pub random_input_len: usize,
    #[arg(long, default_value_t = 128)]
    pub random_output_len: usize,
    /// `random` (fixed-length random prompts), `prefix_repetition` (vLLM's shared-prefix set:
    /// each prompt is one of `--prefix-repetition-num-prefixes` random prefixes followed by a
    /// random suffix of its own, in shuffled order) or `random-mm` (chat messages of random
    /// images and `--random-input-len` random words, sent to `/chat/completions`).
    #[arg(long, default_value = "random", value_parser = ["random", "prefix_repetition", "random-mm"])]
    pub dataset_name: String,
    /// `random-mm`: images in each request.
    #[arg(long, default_value_t = 1)]
    pub random_mm_base_items_per_request: usize,
    /// `random-mm`: image sizes and their weights, as vLLM writes them:
    /// `{(height, width, frames): probability, ...}` (images only: one frame).
    #[arg(long, default_value = "{(256, 256, 1): 0.5, (720, 1280, 1): 0.5}")]
    pub random_mm_bucket_config: String,
    #[arg(long, default_value_t = 256)]
    pub prefix_repetition_prefix_len: usize,
    #[arg(long, default_value_t = 256)]
    pub prefix_repetition_suffix_len: usize,
    #[arg(long, default_value_t = 10)]
    pub prefix_repetition_num_prefixes: usize,
    #[arg(long, default_value_t = 128)]
    pub prefix_repetition_output_len: usize,
    /// Requests per second (Poisson arrivals); all at once when omitted.
    #[arg(long)]
    pub request_rate: Option<f64>,
    /// Random prompt token ids are drawn from [min, max).
    #[arg(long, default_value_t = 20)]
    pub token_id_min: u32,
    #[arg(long, default_value_t = 900)]
    pub token_id_max: u32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Constrain every output: `json_schema` asks for a JSON array of records (an integer, a
    /// short string, an enum, a boolean, a list of numbers) long enough that each output runs to
    /// its length, as the unconstrained ones do with `ignore_eos`.
    #[arg(long, value_parser = ["json_schema"])]
    pub structured_output: Option<String>,
    /// Print the results as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Prompt length of the prefill measurement.
    #[arg(long, default_value_t = 512)]
    pub prefill_len: usize,
    /// Prompt length of the decode measurement.
    #[arg(long, default_value_t = 32)]
    pub prompt_len: usize,
    /// Tokens generated per sequence in the decode measurement.
    #[arg(long, default_value_t = 64)]
    pub output_len: usize,
    /// Batch sizes of the decode measurement.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    pub batch: Vec<usize>,
    /// Repetitions (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Print the results as JSON.
    #[arg(long)]
    pub json: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn parses_lora_flags() {
        let c = Cli::try_parse_from([
            "rserve",
            "serve",
            "m",
            "--enable-lora",
            "--lora-modules",
            "a=/x/a",
            r#"{"name": "b", "path": "org/b", "base_model_name": "m"}"#,
            "--max-loras",
            "4",
        ])
        .unwrap();
        let Command::Serve(s) = c.command else {
            panic!("wrong subcommand")
        };
        assert!(s.engine.enable_lora);
        let module = |name: &str, path: &str, base: Option<&str>| LoraModuleArg {
            name: name.into(),
            path: path.into(),
            base_model_name: base.map(Into::into),
        };
        assert_eq!(
            s.engine.lora_modules,
            vec![module("a", "/x/a", None), module("b", "org/b", Some("m"))]
        );
        assert_eq!((s.engine.max_loras, s.engine.max_lora_rank), (4, 16));
        assert!(parse_lora_module("nopath").is_err());
        assert!(parse_lora_module("{\"name\": 1}").is_err());
    }

    #[test]
    fn parses_generate_flags() {
        let c = Cli::try_parse_from([
            "rserve",
            "generate",
            "m",
            "--prompt",
            "hi",
            "--max-tokens",
            "3",
            "--dtype",
            "float32",
        ])
        .unwrap();
        match c.command {
            Command::Generate(g) => {
                assert_eq!(g.engine.model.as_deref(), Some("m"));
                assert_eq!(g.max_tokens, 3);
                assert_eq!(g.engine.dtype, "float32");
            }
            _ => panic!("wrong subcommand"),
        }
    }
}
