//! rserve-server: every way into the engine. The `rserve` command (`serve`: the OpenAI-compatible
//! HTTP server; `generate`: one prompt from the command line; `bench`: throughput and load
//! measurements) and, behind the `python` feature, the `rserve._core` Python module. Both run the
//! same code: the wheel's console script calls [`main_with_args`].

pub mod adapters;
pub mod bench;
mod bench_dataset;
pub mod bench_grammar;
pub mod bench_serve;
pub mod bench_startup;
pub mod bench_vision;
pub mod cli;
mod listener;
pub mod metrics;
pub mod openai;
#[cfg(feature = "python")]
mod python;
#[cfg(feature = "python")]
mod python_http;
pub mod routes;
pub mod serve;

use anyhow::{Context, Result};
use clap::Parser;
use cli::{Cli, Command, EngineArgs, GenerateArgs};
use rserve_core::default_model::ensure_default_model;
use rserve_core::{Engine, EngineConfig, EngineRequest, KvBudget, SamplingParams};
use std::io::Write;
use std::path::PathBuf;

pub(crate) fn init_logging(level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(format!(
            "rserve={level},rserve_core={level},rserve_server={level}"
        ))
    });
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Resolves MODEL (a directory, or the embedded default when absent) into an engine config.
pub fn engine_config(args: &EngineArgs) -> Result<EngineConfig> {
    let dir: PathBuf = match &args.model {
        Some(m) => rserve_core::hub::resolve_model(m)?,
        None => ensure_default_model().context("preparing the embedded default model")?,
    };
    let mut cfg = EngineConfig::new(dir);
    cfg.dtype = args.dtype.clone();
    cfg.device = args.device.clone();
    cfg.max_model_len = args.max_model_len;
    cfg.max_num_seqs = args.max_num_seqs;
    cfg.max_num_batched_tokens = args.max_num_batched_tokens;
    cfg.block_size = args.block_size;
    cfg.tensor_parallel_size = args.tensor_parallel_size;
    cfg.seed = args.seed;
    cfg.gpu_memory_utilization = args.gpu_memory_utilization;
    cfg.kv_cache_dtype = args.kv_cache_dtype;
    cfg.enforce_eager = args.enforce_eager;
    cfg.async_scheduling = !args.no_async_scheduling;
    cfg.enable_prefix_caching = !args.no_enable_prefix_caching;
    cfg.json_any_whitespace = args.structured_outputs_config.unwrap_or(false);
    cfg.isq = match (args.isq, args.quantization) {
        (Some(a), Some(b)) if a != b => {
            anyhow::bail!("--isq {a} and --quantization {b} disagree; give one")
        }
        (a, b) => a.or(b),
    };
    cfg.isq_lm_head = args.isq_lm_head;
    if args.isq_lm_head && cfg.isq.is_none() {
        anyhow::bail!("--isq-lm-head needs --isq FORMAT");
    }
    cfg.tokenizer = args.tokenizer.as_ref().map(PathBuf::from);
    if !args.enable_lora && !args.lora_modules.is_empty() {
        anyhow::bail!("--lora-modules needs --enable-lora");
    }
    if args.enable_lora {
        cfg.lora = Some(rserve_core::lora::LoraOptions {
            max_loras: args.max_loras,
            max_rank: args.max_lora_rank,
            max_cpu_loras: args.max_cpu_loras.unwrap_or(args.max_loras),
        });
        cfg.lora_modules = args
            .lora_modules
            .iter()
            .map(|m| (m.name.clone(), PathBuf::from(&m.path)))
            .collect();
    }
    if let Some(b) = args.kv_cache_memory {
        cfg.kv_cache = KvBudget::Bytes(b);
    }
    Ok(cfg)
}

fn generate(args: GenerateArgs) -> Result<()> {
    let handle = Engine::start(engine_config(&args.engine)?)?;
    let info = handle.info().clone();
    let prompt_ids = info.tokenizer.encode(&args.prompt, true)?;
    let params = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        seed: args.sample_seed,
        max_tokens: Some(args.max_tokens),
        ignore_eos: args.ignore_eos,
        logprobs: args.json.then_some(args.logprobs),
        ..SamplingParams::default()
    };
    let mut stream = handle.submit(EngineRequest {
        prompt_token_ids: prompt_ids,
        params,
        lora: None,
        cache_salt: None,
        mm: None,
    })?;
    let mut stdout = std::io::stdout();
    while let Some(delta) = stream.blocking_next() {
        let delta = delta?;
        if !args.json {
            for c in delta.outputs.iter().filter(|c| c.index == 0) {
                write!(stdout, "{}", c.text)?;
            }
            stdout.flush()?;
        }
    }
    let out = stream.output();
    if !out.finished {
        anyhow::bail!("the engine stopped before the request finished");
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!();
    }
    handle.shutdown();
    Ok(())
}

/// Parses `args` (the first is the program name) and runs the command.
pub fn main_with_args<I, T>(args: I) -> Result<()>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    // vLLM's `-tp N`: a two-letter short flag, which the parser has no form for
    let args = args.into_iter().map(|a| {
        let a: std::ffi::OsString = a.into();
        match a.to_str() {
            Some("-tp") => "--tensor-parallel-size".into(),
            Some(s) if s.starts_with("-tp=") => {
                format!("--tensor-parallel-size={}", &s[4..]).into()
            }
            _ => a,
        }
    });
    let cli = match Cli::try_parse_from(args) {
        Ok(c) => c,
        Err(e) => {
            // --help and --version are not errors
            let code = e.exit_code();
            let _ = e.print();
            if code == 0 {
                return Ok(());
            }
            anyhow::bail!("invalid arguments");
        }
    };
    init_logging(&cli.log_level);
    match cli.command {
        Command::Serve(a) => serve::run(a),
        Command::Generate(a) => generate(a),
        Command::Bench(b) => match b.serve {
            Some(cli::BenchSub::Serve(a)) => bench_serve::run(a),
            Some(cli::BenchSub::Grammar(a)) => bench_grammar::run(a),
            Some(cli::BenchSub::Vision(a)) => bench_vision::run(a),
            Some(cli::BenchSub::Startup(a)) => bench_startup::run(a),
            None => bench::run(b.local),
        },
        Command::Adapters(cli::AdaptersCommand::Inspect(a)) => adapters::inspect(a),
    }
}
