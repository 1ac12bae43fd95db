//! `rserve bench grammar`: what structured output costs on the host for one model's vocabulary:
//! building the grammar engine's index of the vocabulary, compiling a JSON schema of `--fields`
//! fields (and the same schema again, from the cache), and computing the token mask at each step
//! of `--tokens` steps of an output that follows the schema (a seeded walk over allowed tokens).

use crate::cli::BenchGrammarArgs;
use anyhow::{Context, Result};
use rserve_core::sampler::SeqRng;
use rserve_core::structured::{Grammars, StructuredOutputs};
use rserve_core::tokenizer::Tokenizer;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Instant;

/// An object of `n` required fields cycling through integers, short strings, enums, booleans and
/// number lists.
fn schema(n: usize) -> Value {
    let mut props = serde_json::Map::new();
    for i in 0..n {
        let t = match i % 5 {
            0 => json!({"type": "integer"}),
            1 => json!({"type": "string", "maxLength": 24}),
            2 => json!({"enum": ["alpha", "beta", "gamma", "delta"]}),
            3 => json!({"type": "boolean"}),
            _ => json!({"type": "array", "items": {"type": "number"}, "maxItems": 3}),
        };
        props.insert(format!("field_{i}"), t);
    }
    let names: Vec<&String> = props.keys().collect();
    json!({"type": "object", "properties": props, "required": names, "additionalProperties": false})
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(((p * (v.len().max(1) - 1) as f64).round()) as usize)
        .copied()
        .unwrap_or(f64::NAN)
}

pub fn run(args: BenchGrammarArgs) -> Result<()> {
    let dir = rserve_core::hub::resolve_model(&args.model).context("resolving the model")?;
    let tok = Arc::new(
        Tokenizer::from_file(dir.join("tokenizer.json")).context("reading tokenizer.json")?,
    );
    let hf = rserve_core::loader::read_config(&dir)?;
    let vocab = rserve_core::models::decoder_config(&hf)?.vocab_size;
    let eos = rserve_core::loader::generation_defaults(&dir, &hf, vocab)?.eos_token_ids;
    let grammars = Grammars::new(tok, vocab, eos.clone());
    let spec = StructuredOutputs {
        json: Some(schema(args.fields)),
        ..StructuredOutputs::default()
    };
    // the first compile also indexes the vocabulary; a tiny grammar measures that alone
    let t0 = Instant::now();
    let warm = StructuredOutputs {
        regex: Some("x".into()),
        ..StructuredOutputs::default()
    };
    grammars
        .compile(&warm)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let index_s = t0.elapsed().as_secs_f64();
    let (g, first) = grammars
        .compile(&spec)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let (_, again) = grammars
        .compile(&spec)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut m = g.matcher();
    let mut mask = vec![0u32; m.words()];
    let mut rng = SeqRng::new(args.seed);
    let mut times = Vec::with_capacity(args.tokens);
    let mut allowed_total = 0usize;
    for _ in 0..args.tokens {
        let t = Instant::now();
        m.mask_into(&mut mask);
        times.push(t.elapsed().as_secs_f64() * 1e6);
        let allowed: Vec<u32> = (0..vocab as u32)
            .filter(|&t| (mask[t as usize / 32] >> (t % 32)) & 1 == 1 && !eos.contains(&t))
            .collect();
        allowed_total += allowed.len();
        let Some(&tok) = allowed.get((rng.next_u64() % allowed.len().max(1) as u64) as usize)
        else {
            break;
        };
        if m.advance(tok) {
            break;
        }
    }
    let steps = times.len();
    let mean = times.iter().sum::<f64>() / steps.max(1) as f64;
    let report = json!({
        "model": args.model, "vocab": vocab, "fields": args.fields, "steps": steps,
        "vocabulary_index_ms": index_s * 1e3,
        "compile_ms": first.seconds * 1e3, "compile_cached_ms": again.seconds * 1e3,
        "mask_us": {"mean": mean, "p50": pct(&mut times, 0.5), "p99": pct(&mut times, 0.99)},
        "mean_allowed_tokens": allowed_total as f64 / steps.max(1) as f64,
    });
    if args.json {
        println!("{report}");
    } else {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}
