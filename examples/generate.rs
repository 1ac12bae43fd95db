//! Generating with the rserve engine from Rust, in-process.
//!
//! Run from the repository root with
//! `cargo run --release -p rserve-server --example generate -- tests/fixtures/models/qwen2`.

use rserve_core::{Engine, EngineConfig, EngineRequest, SamplingParams};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "tests/fixtures/models/qwen2".into());
    let engine = Engine::start(EngineConfig::new(model))?;
    let tok = engine.info().tokenizer.clone();
    let prompt_token_ids = tok.encode("The quick brown fox", true)?;
    let params = SamplingParams {
        temperature: 0.8,
        seed: Some(7),
        max_tokens: Some(24),
        ..Default::default()
    };
    let mut stream = engine.submit(EngineRequest {
        prompt_token_ids,
        params,
        lora: None,
        cache_salt: None,
        mm: None,
    })?;
    // each item is a delta: the text and tokens that are new since the last one
    while let Some(delta) = stream.blocking_next() {
        for c in delta?.outputs {
            print!("{}", c.text);
        }
    }
    println!();
    Ok(())
}
