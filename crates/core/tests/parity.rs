//! Parity with Hugging Face transformers: tiny seeded checkpoints of every architecture, greedy
//! tokens equal and logprobs within 1e-4 of the committed goldens (float32), including top-5
//! alternatives and prompt logprobs.

mod common;

use common::*;
use rserve_core::{EngineRequest, SamplingParams};

fn check_model(name: &str) {
    let tol = tolerance();
    let g = golden(name);
    assert_eq!(g.model, name);
    let h = start(name, |_| {});
    // all prompts at once: continuous batching must not change anything
    let streams: Vec<_> = g
        .cases
        .iter()
        .map(|c| {
            let mut p = SamplingParams::greedy(c.tokens.len());
            p.ignore_eos = true;
            p.logprobs = Some(5);
            p.prompt_logprobs = Some(1);
            h.submit(EngineRequest {
                prompt_token_ids: c.prompt.clone(),
                params: p,
                lora: None,
                cache_salt: None,
                mm: None,
            })
            .expect("submit")
        })
        .collect();
    for (case, s) in g.cases.iter().zip(streams) {
        let out = s.wait().expect("completes");
        let o = &out.outputs[0];
        assert_eq!(
            o.token_ids,
            case.tokens,
            "{name}: prompt of {} tokens",
            case.prompt.len()
        );
        let lps = o.logprobs.as_ref().expect("logprobs");
        for (i, (got, want)) in lps.iter().zip(&case.logprobs).enumerate() {
            assert!(
                (got.logprob - want).abs() < tol,
                "{name} step {i}: logprob {} vs {want}",
                got.logprob
            );
            let w = &case.top5[i];
            let distinct = |k: usize| {
                (k == 0 || (w[k - 1].1 - w[k].1).abs() > 1e-4)
                    && (k + 1 >= w.len() || (w[k].1 - w[k + 1].1).abs() > 1e-4)
            };
            assert_eq!(got.top.len(), 5);
            for (k, ((gt, gl), (wt, wl))) in got.top.iter().zip(w).enumerate() {
                if distinct(k) {
                    assert_eq!(gt, wt, "{name} step {i} top-{k}");
                }
                assert!(
                    (gl - wl).abs() < tol,
                    "{name} step {i} top-{k}: {gl} vs {wl}"
                );
            }
        }
        let pl = out.prompt_logprobs.as_ref().expect("prompt logprobs");
        assert_eq!(pl.len(), case.prompt.len(), "{name}: prompt logprob count");
        for (i, (got, want)) in pl.iter().zip(&case.prompt_logprobs).enumerate() {
            match (got, want) {
                (None, None) => {}
                (Some(g), Some(w)) => {
                    assert_eq!(g.token_id, case.prompt[i]);
                    assert!(
                        (g.logprob - w).abs() < tol,
                        "{name} prompt pos {i}: {} vs {w}",
                        g.logprob
                    );
                }
                _ => panic!("{name} prompt pos {i}: {got:?} vs {want:?}"),
            }
        }
    }
    assert_sound(&h);
}

#[test]
fn llama3_sharded_gqa_llama3_rope() {
    check_model("llama3");
}

#[test]
fn llama2_mqa_tied_linear_rope_explicit_head_dim() {
    check_model("llama2");
}

#[test]
fn mistral_sliding_window() {
    check_model("mistral");
}

#[test]
fn qwen2_biases_tied() {
    check_model("qwen2");
}

#[test]
fn qwen3_qk_norm() {
    check_model("qwen3");
}
