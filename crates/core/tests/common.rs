//! Helpers shared by the engine's integration tests: fixture paths, goldens and engine start-up.
#![allow(dead_code)]

use rserve_core::{
    Engine, EngineConfig, EngineHandle, EngineRequest, KvBudget, RequestOutput, SamplingParams,
};
use serde::Deserialize;
use std::path::PathBuf;

/// The repository root: `RSERVE_REPO` (test binaries run from another checkout), else the source tree.
pub fn repo() -> PathBuf {
    std::env::var_os("RSERVE_REPO")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.."))
}

pub fn fixture_model(name: &str) -> PathBuf {
    repo().join("tests/fixtures/models").join(name)
}

pub const MODELS: &[&str] = &["llama3", "llama2", "mistral", "qwen2", "qwen3"];

#[derive(Debug, Deserialize)]
pub struct Golden {
    pub model: String,
    pub cases: Vec<Case>,
}

#[derive(Debug, Deserialize)]
pub struct Case {
    pub prompt: Vec<u32>,
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub top5: Vec<Vec<(u32, f32)>>,
    pub margins: Vec<f32>,
    pub prompt_logprobs: Vec<Option<f32>>,
}

pub fn golden(name: &str) -> Golden {
    let p = repo()
        .join("tests/fixtures/goldens")
        .join(format!("{name}.json"));
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).expect("golden parses")
}

/// The device the engine tests run on: `RSERVE_TEST_DEVICE` (default `cpu`; `cuda` on a GPU build).
pub fn test_device() -> String {
    std::env::var("RSERVE_TEST_DEVICE").unwrap_or_else(|_| "cpu".into())
}

/// Tolerance of logprob comparisons with the goldens: `RSERVE_TEST_TOL`, default 1e-4.
pub fn tolerance() -> f32 {
    std::env::var("RSERVE_TEST_TOL")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1e-4)
}

pub fn start(name: &str, f: impl FnOnce(&mut EngineConfig)) -> EngineHandle {
    log_from_env();
    let mut cfg = EngineConfig::new(fixture_model(name));
    cfg.device = test_device();
    cfg.kv_cache = KvBudget::Blocks(256);
    f(&mut cfg);
    Engine::start(cfg).expect("engine starts")
}

/// The engine's log on stderr when `RUST_LOG` is set (once per test binary).
pub fn log_from_env() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
}

pub fn assert_sound(h: &EngineHandle) {
    // let the engine finish processing aborts and frees
    std::thread::sleep(std::time::Duration::from_millis(20));
    let errs = h.check_integrity().expect("engine alive");
    assert!(errs.is_empty(), "pool integrity: {errs:?}");
    let free_all = h.stats().running.load(std::sync::atomic::Ordering::Relaxed) == 0;
    assert!(free_all, "requests still running");
}

/// The prompt logprobs of `ids` (one per position after the first): the model's log-probability
/// of each token given the ones before it.
pub fn teacher_forced(h: &EngineHandle, ids: &[u32]) -> Vec<f32> {
    teacher_forced_with(h, ids, None)
}

/// [`teacher_forced`] with the LoRA adapter registered as `lora`.
pub fn teacher_forced_with(h: &EngineHandle, ids: &[u32], lora: Option<&str>) -> Vec<f32> {
    let mut p = SamplingParams::greedy(1);
    p.prompt_logprobs = Some(0);
    let out = h
        .submit(EngineRequest {
            prompt_token_ids: ids.to_vec(),
            params: p,
            lora: lora.map(str::to_owned),
            cache_salt: None,
            mm: None,
        })
        .expect("submitted")
        .wait()
        .expect("finished");
    out.prompt_logprobs
        .expect("prompt logprobs")
        .into_iter()
        .skip(1)
        .map(|l| l.expect("a logprob").logprob)
        .collect()
}

/// `n` greedy tokens after `prompt` (end tokens ignored) with `logprobs` alternatives each.
pub fn greedy(h: &EngineHandle, prompt: &[u32], n: usize, logprobs: usize) -> RequestOutput {
    let mut p = SamplingParams::greedy(n);
    p.ignore_eos = true;
    p.logprobs = Some(logprobs);
    h.submit(EngineRequest {
        prompt_token_ids: prompt.to_vec(),
        params: p,
        lora: None,
        cache_salt: None,
        mm: None,
    })
    .expect("submitted")
    .wait()
    .expect("finished")
}
