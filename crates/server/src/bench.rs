//! `rserve bench`: prefill and decode throughput of the in-process engine on random token ids with
//! fixed lengths (`ignore_eos`), reporting medians. A benchmark, not a test: it measures and prints.

use crate::cli::BenchArgs;
use anyhow::{Context, Result};
use rserve_core::{Engine, EngineHandle, EngineRequest, SamplingParams};
use std::time::Instant;

fn prompt(len: usize, salt: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 7919 + salt * 104729 + 13) % (vocab - 20) + 20) as u32)
        .collect()
}

fn params(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        ..SamplingParams::default()
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Seconds to process one prompt and sample one token.
fn prefill(h: &EngineHandle, len: usize, salt: usize) -> Result<f64> {
    let vocab = h.info().model_config.vocab_size;
    let t = Instant::now();
    h.submit(EngineRequest {
        prompt_token_ids: prompt(len, salt, vocab),
        params: params(1),
        lora: None,
        cache_salt: None,
        mm: None,
    })?
    .wait()?;
    Ok(t.elapsed().as_secs_f64())
}

/// Decode tokens per second for `batch` sequences (time after every first token arrived).
fn decode(
    h: &EngineHandle,
    batch: usize,
    prompt_len: usize,
    out_len: usize,
    salt: usize,
) -> Result<f64> {
    let vocab = h.info().model_config.vocab_size;
    let mut streams = Vec::new();
    for b in 0..batch {
        streams.push(h.submit(EngineRequest {
            prompt_token_ids: prompt(prompt_len, salt * 1000 + b, vocab),
            params: params(out_len),
            lora: None,
            cache_salt: None,
            mm: None,
        })?);
    }
    let mut first = Vec::new();
    for s in &mut streams {
        s.blocking_next().context("no first token")??;
        first.push(Instant::now());
    }
    let start = first.into_iter().max().context("empty batch")?;
    let mut tokens = 0usize;
    for s in streams {
        let out = s.wait()?;
        tokens += out.outputs[0].token_ids.len().saturating_sub(1);
    }
    Ok(tokens as f64 / start.elapsed().as_secs_f64())
}

pub fn run(args: BenchArgs) -> Result<()> {
    let cfg = crate::engine_config(&args.engine)?;
    let t = Instant::now();
    let h = Engine::start(cfg)?;
    let load_s = t.elapsed().as_secs_f64();
    let mc = h.info().model_config.clone();
    // warm-up
    decode(&h, 1, 8, 4, 999)?;
    let reps = args.reps.max(1);
    let prefill_s = median(
        (0..reps)
            .map(|r| prefill(&h, args.prefill_len, r))
            .collect::<Result<Vec<_>>>()?,
    );
    let mut rows = Vec::new();
    for &b in &args.batch {
        let tps = median(
            (0..reps)
                .map(|r| decode(&h, b, args.prompt_len, args.output_len, r + 1))
                .collect::<Result<Vec<_>>>()?,
        );
        rows.push((b, tps));
    }
    let threads = rayon::current_num_threads();
    if args.json {
        let v = serde_json::json!({
            "model": h.info().model_dir.display().to_string(),
            "architecture": mc.architecture,
            "dtype": format!("{:?}", h.info().dtype),
            "threads": threads,
            "load_s": load_s,
            "prefill_len": args.prefill_len,
            "prefill_tok_s": args.prefill_len as f64 / prefill_s,
            "decode": rows.iter().map(|(b, t)| serde_json::json!({"batch": b, "tok_s": t})).collect::<Vec<_>>(),
        });
        println!("{v}");
    } else {
        println!(
            "model {} ({}, {:?}, {threads} threads), loaded in {load_s:.2} s",
            h.info().model_dir.display(),
            mc.architecture,
            h.info().dtype
        );
        println!(
            "prefill {} tokens: {:.1} tok/s",
            args.prefill_len,
            args.prefill_len as f64 / prefill_s
        );
        for (b, tps) in rows {
            println!("decode batch {b:>3}: {tps:.1} tok/s");
        }
    }
    h.shutdown();
    Ok(())
}
