//! `rserve serve`: binds the port at once (so `/health` answers 503 while the model loads), loads
//! the engine in the background, serves the OpenAI API, and on SIGTERM/SIGINT stops accepting,
//! lets in-flight requests finish within a deadline, then exits.

use crate::cli::ServeArgs;
use crate::listener::ConnLimits;
use crate::routes::{router, AppState, EdgeConfig};
use anyhow::{Context, Result};
use rserve_core::default_model::DEFAULT_MODEL_NAME;
use rserve_core::Engine;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

async fn shutdown_signal(state: Arc<AppState>, grace: Duration) {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!(
        "shutting down: finishing in-flight requests (at most {} s)",
        grace.as_secs()
    );
    state.shutting_down.store(true, Ordering::Relaxed);
    tokio::spawn(async move {
        tokio::time::sleep(grace).await;
        tracing::warn!("shutdown deadline reached; exiting");
        std::process::exit(0);
    });
}

pub fn run(args: ServeArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(serve(args))
}

async fn serve(args: ServeArgs) -> Result<()> {
    let name = args.served_model_name.clone().unwrap_or_else(|| {
        args.engine
            .model
            .clone()
            .unwrap_or_else(|| DEFAULT_MODEL_NAME.to_string())
    });
    let api_key = args.api_key.clone().filter(|k| !k.is_empty());
    let seconds = |flag: &str, v: f64| {
        // a value too large for a `Duration` (over ~5.8e11 years) is refused, not a panic; one
        // under a nanosecond would be no time at all
        match Duration::try_from_secs_f64(v) {
            Ok(d) if d > Duration::ZERO => Ok(d),
            _ => Err(anyhow::anyhow!(
                "{flag} must be a positive number of seconds, got {v}"
            )),
        }
    };
    let limits = ConnLimits {
        header_read_timeout: seconds("--header-read-timeout", args.header_read_timeout)?,
        keep_alive: seconds("--timeout-keep-alive", args.timeout_keep_alive)?,
        max_head_bytes: 1 << 20,
        max_headers: 1024,
    };
    if limits.keep_alive > limits.header_read_timeout {
        // the wait for the next request's head is bounded by both clocks
        anyhow::bail!(
            "--timeout-keep-alive ({} s) must not exceed --header-read-timeout ({} s)",
            args.timeout_keep_alive,
            args.header_read_timeout
        );
    }
    if args.max_choices_per_request == 0 {
        anyhow::bail!("--max-choices-per-request must be positive");
    }
    let mut edge = EdgeConfig {
        max_pending: args.max_pending,
        max_choices: args.max_choices_per_request.min(args.max_pending.max(1)),
        body_limit: args.max_body_bytes,
        tokenizer_info: args.enable_tokenizer_info_endpoint,
        auto_tools: args
            .tool_call_parser
            .filter(|_| args.enable_auto_tool_choice),
        ..EdgeConfig::default()
    };
    if let Some(t) = args.tokenizer_threads {
        edge.prep_threads = t.max(1);
    }
    if let Some(n) = args.limit_mm_per_prompt {
        edge.media.max_images = n;
    }
    edge.media.allowed_domains = args.allowed_media_domains.clone();
    if let Some(m) = args.engine.lora_modules.iter().find(|m| m.name == name) {
        anyhow::bail!(
            "--lora-modules: the adapter name `{}` is the served model's name; requests could not tell them apart",
            m.name
        );
    }
    edge.lora_parents = args
        .engine
        .lora_modules
        .iter()
        .filter_map(|m| Some((m.name.clone(), m.base_model_name.clone()?)))
        .collect();
    edge.media.allowed_local_path = args.allowed_local_media_path.clone();
    edge.media.fetch_timeout = seconds("--media-fetch-timeout", args.media_fetch_timeout)?;
    let state = Arc::new(AppState::new(name.clone(), api_key, edge));
    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    tracing::info!(
        "startup: runtime and listener {:.3} s after process start",
        rserve_core::engine::since_process_start()
    );
    tracing::info!("listening on http://{addr} (model loading)");
    let mut cfg = crate::engine_config(&args.engine)?;
    if let Some(t) = &args.chat_template {
        let p = std::path::Path::new(t);
        cfg.chat_template = Some(if p.is_file() {
            std::fs::read_to_string(p).with_context(|| format!("reading {t}"))?
        } else {
            t.clone()
        });
    }
    let load_state = state.clone();
    let started = std::time::Instant::now();
    let loader = tokio::task::spawn_blocking(move || Engine::start(cfg));
    let app = router(state.clone());
    let server = crate::listener::serve(
        listener,
        app,
        limits,
        shutdown_signal(state.clone(), Duration::from_secs(args.shutdown_timeout)),
    );
    let serving = tokio::spawn(server);
    let handle = match loader.await.context("model loader")? {
        Ok(h) => h,
        Err(e) => {
            // nothing to serve: exit with the reason rather than answer 503 forever
            return Err(e).context("loading the model");
        }
    };
    let info = handle.info().clone();
    tracing::info!(
        "serving `{name}` ({} from {}, {:?}, max_model_len {}) on http://{addr}",
        info.model_config.architecture,
        info.model_dir.display(),
        info.dtype,
        info.max_model_len
    );
    if let Some(r) = &info.isq {
        eprintln!("rserve: {}", r.summary());
    }
    if let Some(s) = &info.stored {
        eprintln!("rserve: {s}");
    }
    let kv_tokens = info.num_blocks * info.block_size;
    eprintln!(
        "rserve: serving `{name}` on http://{addr} ({}, {:?}, loaded in {:.1}s; KV cache {kv_tokens} tokens{}, {:.1} sequences of {} tokens at once)",
        info.device,
        info.dtype,
        started.elapsed().as_secs_f64(),
        match info.kv_cache_dtype {
            rserve_core::kv_cache::KvCacheDtype::Auto => String::new(),
            other => format!(" in {}", other.name()),
        },
        kv_tokens as f64 / info.max_model_len as f64,
        info.max_model_len
    );
    tracing::info!(
        "startup: ready {:.3} s after process start",
        rserve_core::engine::since_process_start()
    );
    load_state.set_engine(handle);
    serving.await.context("server task")??;
    if let Some(h) = state.engine.get() {
        h.shutdown();
    }
    Ok(())
}
