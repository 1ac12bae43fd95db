//! Structured output end to end on a tiny random model: every completion that ends by the grammar
//! matches it (JSON schema, regex, choices), with `n > 1`, async scheduling, preemption and stop
//! strings; a structure cut by `max_tokens` ends by length; unconstrained requests in the same
//! batches are untouched; bad constraints are refused at submit.

mod common;

use common::*;
use rserve_core::request::{FinishReason, RequestOutput};
use rserve_core::structured::StructuredOutputs;
use rserve_core::{EngineError, EngineHandle, EngineRequest, KvBudget, SamplingParams};
use serde_json::{json, Value};
use std::sync::atomic::Ordering;

fn request(prompt: Vec<u32>, p: SamplingParams) -> EngineRequest {
    EngineRequest {
        prompt_token_ids: prompt,
        params: p,
        lora: None,
        cache_salt: None,
        mm: None,
    }
}

fn prompt(i: u32) -> Vec<u32> {
    (0..6 + i % 5)
        .map(|j| 20 + (i * 31 + j * 17) % 900)
        .collect()
}

fn sampled(s: StructuredOutputs, seed: u64, n: usize, max_tokens: usize) -> SamplingParams {
    SamplingParams {
        n,
        temperature: 1.0,
        seed: Some(seed),
        max_tokens: Some(max_tokens),
        structured_outputs: Some(s),
        ..SamplingParams::default()
    }
}

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 500},
            "kind": {"enum": ["a", "b", "c"]},
            "ok": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}
        },
        "required": ["id", "kind", "ok"],
        "additionalProperties": false
    })
}

fn json_spec() -> StructuredOutputs {
    StructuredOutputs {
        json: Some(schema()),
        ..StructuredOutputs::default()
    }
}

fn check_json(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!((0..=500).contains(&v["id"].as_i64().expect("id")), "{text}");
    assert!(["a", "b", "c"].contains(&v["kind"].as_str().expect("kind")));
    assert!(v["ok"].is_boolean());
    if let Some(t) = v.get("tags") {
        assert!(t.as_array().expect("tags").len() <= 3);
    }
    assert_eq!(serde_json::to_string(&v).expect("json"), text, "compact");
}

/// Submits every request at once and waits for all.
fn run_all(h: &EngineHandle, reqs: Vec<EngineRequest>) -> Vec<RequestOutput> {
    let streams: Vec<_> = reqs
        .into_iter()
        .map(|r| h.submit(r).expect("submitted"))
        .collect();
    streams
        .into_iter()
        .map(|s| s.wait().expect("finished"))
        .collect()
}

fn json_batch(h: &EngineHandle) -> Vec<RequestOutput> {
    let reqs = (0..6)
        .map(|i| request(prompt(i), sampled(json_spec(), 100 + u64::from(i), 4, 60)))
        .collect();
    run_all(h, reqs)
}

fn check_batch(outs: &[RequestOutput]) {
    let mut stopped = 0;
    for o in outs {
        for c in &o.outputs {
            if c.finish_reason == Some(FinishReason::Stop) {
                stopped += 1;
                check_json(&c.text);
            }
        }
    }
    assert!(
        stopped >= 20,
        "{stopped} of 24 completions ended by the grammar"
    );
}

#[test]
fn json_outputs_match_their_schema_with_and_without_lookahead() {
    let sync = start("qwen2", |c| c.async_scheduling = false);
    let a = json_batch(&sync);
    check_batch(&a);
    assert!(sync.stats().mask_rows.load(Ordering::Relaxed) > 0);
    assert_sound(&sync);
    let ahead = start("qwen2", |c| c.lookahead_on_host = true);
    let b = json_batch(&ahead);
    check_batch(&b);
    for (x, y) in a.iter().zip(&b) {
        for (p, q) in x.outputs.iter().zip(&y.outputs) {
            assert_eq!(
                p.token_ids, q.token_ids,
                "seeded outputs do not depend on lookahead"
            );
        }
    }
    assert_sound(&ahead);
}

#[test]
fn regex_and_choices_under_preemption() {
    // a cache of 12 blocks of 16 tokens for 8 requests of up to ~60 tokens: some are preempted
    let h = start("qwen2", |c| c.kv_cache = KvBudget::Blocks(12));
    let rx = StructuredOutputs {
        regex: Some("[a-d]{3,9}(-[0-9]{2}){1,3}".into()),
        ..StructuredOutputs::default()
    };
    let choices = vec!["red".to_string(), "green".into(), "blue \"b\"".into()];
    let ch = StructuredOutputs {
        choice: Some(choices.clone()),
        ..StructuredOutputs::default()
    };
    let reqs = (0..8)
        .map(|i| {
            let s = if i % 2 == 0 { rx.clone() } else { ch.clone() };
            request(prompt(i), sampled(s, u64::from(i), 2, 40))
        })
        .collect();
    for (i, o) in run_all(&h, reqs).iter().enumerate() {
        for c in &o.outputs {
            assert_eq!(c.finish_reason, Some(FinishReason::Stop), "{c:?}");
            if i % 2 == 0 {
                let ok = c.text.split('-').enumerate().all(|(k, part)| {
                    if k == 0 {
                        (3..=9).contains(&part.len())
                            && part.chars().all(|x| ('a'..='d').contains(&x))
                    } else {
                        part.len() == 2 && part.chars().all(|x| x.is_ascii_digit())
                    }
                });
                assert!(ok && c.text.contains('-'), "{:?}", c.text);
            } else {
                assert!(choices.contains(&c.text), "{:?}", c.text);
            }
        }
    }
    assert_sound(&h);
}

#[test]
fn unconstrained_rows_are_untouched_and_cut_structures_end_by_length() {
    let h = start("qwen2", |_| {});
    let mut plain = SamplingParams::greedy(24);
    plain.ignore_eos = true;
    let alone = run_all(&h, vec![request(prompt(40), plain.clone())]);
    let mut reqs = vec![request(prompt(40), plain)];
    reqs.extend((0..4).map(|i| request(prompt(i), sampled(json_spec(), u64::from(i), 1, 60))));
    let long = StructuredOutputs {
        json: Some(json!({"type": "array", "items": {"type": "integer"}, "minItems": 40})),
        ..StructuredOutputs::default()
    };
    reqs.push(request(prompt(9), sampled(long, 9, 1, 6)));
    let mixed = run_all(&h, reqs);
    assert_eq!(alone[0].outputs[0].token_ids, mixed[0].outputs[0].token_ids);
    let cut = &mixed[5].outputs[0];
    assert_eq!(cut.finish_reason, Some(FinishReason::Length));
    assert_eq!(cut.token_ids.len(), 6);
    assert!(cut.text.starts_with('['));
    assert_sound(&h);
}

#[test]
fn stop_strings_end_a_constrained_output() {
    let h = start("qwen2", |_| {});
    let s = StructuredOutputs {
        regex: Some("abc(d|e)+xyz".into()),
        ..StructuredOutputs::default()
    };
    let mut p = sampled(s, 3, 1, 40);
    p.stop = vec!["d".into(), "e".into()];
    let out = run_all(&h, vec![request(prompt(1), p)]);
    let c = &out[0].outputs[0];
    assert_eq!(c.finish_reason, Some(FinishReason::Stop));
    assert_eq!(c.text, "abc");
    assert_sound(&h);
}

#[test]
fn bad_constraints_are_refused_at_submit() {
    let h = start("qwen2", |_| {});
    let bad = [
        StructuredOutputs::default(),
        StructuredOutputs {
            regex: Some("(open".into()),
            ..StructuredOutputs::default()
        },
        StructuredOutputs {
            json: Some(json!({"type": "object", "properties": {"a": {"type": "nope"}}})),
            ..StructuredOutputs::default()
        },
        StructuredOutputs {
            grammar: Some("start: missing".into()),
            ..StructuredOutputs::default()
        },
    ];
    for s in bad {
        match h.submit(request(prompt(0), sampled(s.clone(), 0, 1, 8))) {
            Err(EngineError::InvalidParam { field, message }) => {
                assert_eq!(field, "structured_outputs");
                assert!(!message.is_empty());
            }
            Err(e) => panic!("{s:?}: {e}"),
            Ok(_) => panic!("{s:?} accepted"),
        }
    }
    // the engine still serves
    let ok = run_all(&h, vec![request(prompt(0), sampled(json_spec(), 1, 1, 60))]);
    assert_eq!(ok[0].outputs.len(), 1);
    assert_sound(&h);
}
