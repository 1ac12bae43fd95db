//! Continuous batching end to end on a tiny model: outputs do not depend on what else is in the
//! batch, on when requests arrive, on chunked prefill or on preemption; seeds, n > 1, stops,
//! aborts and bad input behave; the block pool is sound after every test.

mod common;

use common::*;
use rserve_core::request::{RequestOutput, StopReason};
use rserve_core::{
    EngineError, EngineHandle, EngineRequest, FinishReason, KvBudget, SamplingParams,
};
use std::sync::atomic::Ordering;

fn prompts() -> Vec<Vec<u32>> {
    (0..6u32)
        .map(|i| {
            (0..(3 + i * 7))
                .map(|j| 13 + (i * 31 + j * 17) % 900)
                .collect()
        })
        .collect()
}

fn greedy(n: usize) -> SamplingParams {
    let mut p = SamplingParams::greedy(n);
    p.ignore_eos = true;
    p
}

fn run_alone(h: &EngineHandle, prompt: &[u32], p: &SamplingParams) -> Vec<u32> {
    let s = h
        .submit(EngineRequest {
            prompt_token_ids: prompt.to_vec(),
            params: p.clone(),
            lora: None,
            cache_salt: None,
            mm: None,
        })
        .expect("submit");
    s.wait().expect("done").outputs[0].token_ids.clone()
}

#[test]
fn staggered_arrivals_with_chunked_prefill_match_solo_runs() {
    let solo_engine = start("qwen2", |_| {});
    let want: Vec<Vec<u32>> = prompts()
        .iter()
        .map(|p| run_alone(&solo_engine, p, &greedy(12)))
        .collect();
    assert_sound(&solo_engine);

    let h = start("qwen2", |c| c.max_num_batched_tokens = Some(9));
    let mut streams = Vec::new();
    for p in prompts() {
        let mut s = h
            .submit(EngineRequest {
                prompt_token_ids: p,
                params: greedy(12),
                lora: None,
                cache_salt: None,
                mm: None,
            })
            .expect("submit");
        // let the previous ones run a little before the next arrives
        if let Some(first) = s.blocking_next() {
            assert!(!first.expect("ok").finished);
        }
        streams.push(s);
    }
    for (i, s) in streams.into_iter().enumerate() {
        let out = s.wait().expect("done");
        assert_eq!(out.outputs[0].token_ids, want[i], "request {i}");
        assert_eq!(out.outputs[0].finish_reason, Some(FinishReason::Length));
    }
    assert_sound(&h);
}

/// Runs every prompt at once (greedy, with logprobs; prompt `i` for `8 + 3 * i` tokens) and
/// returns each one's tokens and logprobs.
fn run_together(h: &EngineHandle, prompts: &[Vec<u32>]) -> Vec<Vec<(u32, f32)>> {
    let params = |i: usize| {
        let mut p = greedy(8 + 3 * i);
        p.logprobs = Some(0);
        p
    };
    submit_all(h, prompts, params)
        .into_iter()
        .map(|out| {
            let lps = out.outputs[0].logprobs.clone().expect("logprobs asked for");
            lps.iter().map(|t| (t.token_id, t.logprob)).collect()
        })
        .collect()
}

/// Submits every prompt at once, prompt `i` with `params(i)`, and waits for each one's output.
fn submit_all(
    h: &EngineHandle,
    prompts: &[Vec<u32>],
    params: impl Fn(usize) -> SamplingParams,
) -> Vec<RequestOutput> {
    let streams: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, q)| {
            h.submit(EngineRequest {
                prompt_token_ids: q.clone(),
                params: params(i),
                lora: None,
                cache_salt: None,
                mm: None,
            })
            .expect("submit")
        })
        .collect();
    streams
        .into_iter()
        .map(|s| s.wait().expect("done"))
        .collect()
}

#[test]
fn decode_graphs_match_eager_steps() {
    // on a GPU the default engine replays CUDA graphs for decode steps (batch buckets 8, 4, 2, 1
    // here, as requests finish at different lengths); the eager engine never does
    let prompts = prompts();
    let eager = start("qwen2", |c| c.enforce_eager = true);
    let want = run_together(&eager, &prompts);
    assert_sound(&eager);
    let graphs = start("qwen2", |c| c.max_num_seqs = 8);
    for round in 0..2 {
        let got = run_together(&graphs, &prompts);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let ids = |v: &[(u32, f32)]| v.iter().map(|x| x.0).collect::<Vec<_>>();
            assert_eq!(ids(g), ids(w), "round {round}, prompt {i}");
            for (a, b) in g.iter().zip(w) {
                assert!(
                    (a.1 - b.1).abs() <= tolerance(),
                    "round {round}, prompt {i}: {a:?} vs {b:?}"
                );
            }
        }
        // one request alone: the batch-1 bucket
        let solo = run_together(&graphs, &prompts[..1]);
        assert_eq!(
            solo[0].iter().map(|x| x.0).collect::<Vec<_>>(),
            want[0].iter().map(|x| x.0).collect::<Vec<_>>()
        );
    }
    assert_sound(&graphs);
}

#[test]
fn a_prompt_alone_in_many_chunks_matches_one_pass() {
    // steps that carry only a prompt chunk produce no logit rows at all
    let prompt = prompts()
        .into_iter()
        .max_by_key(|p| p.len())
        .expect("prompts");
    let whole = start("llama3", |_| {});
    let want = run_alone(&whole, &prompt, &greedy(8));
    let chunked = start("llama3", |c| c.max_num_batched_tokens = Some(7));
    assert_eq!(run_alone(&chunked, &prompt, &greedy(8)), want);
    assert_sound(&chunked);
}

#[test]
fn preemption_under_a_tiny_kv_budget_changes_no_output() {
    let solo = start("llama3", |_| {});
    let want: Vec<Vec<u32>> = prompts()
        .iter()
        .map(|p| run_alone(&solo, p, &greedy(16)))
        .collect();
    let h = start("llama3", |c| {
        c.block_size = 4;
        c.kv_cache = KvBudget::Blocks(24); // 96 tokens for ~230 needed
    });
    let streams: Vec<_> = prompts()
        .into_iter()
        .map(|p| {
            h.submit(EngineRequest {
                prompt_token_ids: p,
                params: greedy(16),
                lora: None,
                cache_salt: None,
                mm: None,
            })
            .expect("submit")
        })
        .collect();
    for (i, s) in streams.into_iter().enumerate() {
        assert_eq!(
            s.wait().expect("done").outputs[0].token_ids,
            want[i],
            "request {i}"
        );
    }
    assert!(
        h.stats().preemptions.load(Ordering::Relaxed) > 0,
        "the budget must force preemption"
    );
    assert_sound(&h);
}

#[test]
fn seeded_sampling_is_reproducible_and_independent_of_the_batch() {
    let h = start("qwen3", |_| {});
    let mut p = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 50,
        seed: Some(42),
        max_tokens: Some(10),
        ..Default::default()
    };
    p.ignore_eos = true;
    let prompt = prompts()[2].clone();
    let alone = run_alone(&h, &prompt, &p);
    // same request amid other traffic
    let noise: Vec<_> = prompts()
        .into_iter()
        .map(|q| {
            let mut np = p.clone();
            np.seed = None;
            h.submit(EngineRequest {
                prompt_token_ids: q,
                params: np,
                lora: None,
                cache_salt: None,
                mm: None,
            })
            .expect("submit")
        })
        .collect();
    let busy = run_alone(&h, &prompt, &p);
    drop(noise);
    assert_eq!(alone, busy);
    let mut other = p.clone();
    other.seed = Some(7);
    assert_ne!(run_alone(&h, &prompt, &other), alone);
    assert_sound(&h);
}

/// Submits `(prompt, params)` pairs at once; each one's tokens.
fn run_batch(h: &EngineHandle, reqs: Vec<(Vec<u32>, SamplingParams)>) -> Vec<Vec<u32>> {
    let streams: Vec<_> = reqs
        .into_iter()
        .map(|(prompt_token_ids, params)| {
            h.submit(EngineRequest {
                prompt_token_ids,
                params,
                lora: None,
                cache_salt: None,
                mm: None,
            })
            .expect("submit")
        })
        .collect();
    streams
        .into_iter()
        .map(|s| s.wait().expect("done").outputs[0].token_ids.clone())
        .collect()
}

#[test]
fn seeded_rows_draw_alike_on_either_sampler_and_beside_logprob_requests() {
    // A request that asks for top-N logprobs is sampled on the host, the others on the device
    // when there is one; the choice is made per row and both samplers draw with the same counter
    // hash, so a seeded request's tokens depend neither on its neighbours nor on where it ran.
    let h = start("llama3", |_| {});
    let prompts = prompts();
    let seeded = |seed: u64| SamplingParams {
        temperature: 0.8,
        seed: Some(seed),
        max_tokens: Some(12),
        ignore_eos: true,
        ..Default::default()
    };
    let alone: Vec<Vec<u32>> = (0..3)
        .map(|i| run_alone(&h, &prompts[i], &seeded(40 + i as u64)))
        .collect();
    // beside requests that take the host sampler
    let mut reqs: Vec<(Vec<u32>, SamplingParams)> = (0..3)
        .map(|i| (prompts[i].clone(), seeded(40 + i as u64)))
        .collect();
    for (i, p) in prompts.iter().enumerate().skip(3) {
        let mut lp = seeded(i as u64);
        lp.logprobs = Some(3);
        reqs.push((p.clone(), lp));
    }
    let mixed = run_batch(&h, reqs);
    assert_eq!(mixed[..3], alone[..]);
    // the same seeded requests on the host sampler (they ask for logprobs) draw the same tokens
    let on_host: Vec<Vec<u32>> = (0..3)
        .map(|i| {
            let mut p = seeded(40 + i as u64);
            p.logprobs = Some(0);
            run_alone(&h, &prompts[i], &p)
        })
        .collect();
    assert_eq!(on_host, alone);
    // and with top-k, top-p and min-p thresholds, alone and beside logprob requests
    let filtered = |seed: u64| SamplingParams {
        top_k: 40,
        top_p: 0.9,
        min_p: 0.01,
        ..seeded(seed)
    };
    let want = run_alone(&h, &prompts[1], &filtered(5));
    let mut lp = filtered(9);
    lp.logprobs = Some(1);
    let got = run_batch(
        &h,
        vec![(prompts[1].clone(), filtered(5)), (prompts[4].clone(), lp)],
    );
    assert_eq!(got[0], want);
    assert_sound(&h);
}

#[test]
fn n_samples_fork_share_the_prompt_and_are_reproducible() {
    let h = start("llama2", |c| c.block_size = 4);
    let mut p = SamplingParams {
        n: 4,
        temperature: 1.0,
        seed: Some(3),
        max_tokens: Some(8),
        ..Default::default()
    };
    p.ignore_eos = true;
    let prompt = prompts()[3].clone();
    let run = || {
        h.submit(EngineRequest {
            prompt_token_ids: prompt.clone(),
            params: p.clone(),
            lora: None,
            cache_salt: None,
            mm: None,
        })
        .expect("submit")
        .wait()
        .expect("done")
    };
    let a = run();
    let b = run();
    assert_eq!(a.outputs.len(), 4);
    for (x, y) in a.outputs.iter().zip(&b.outputs) {
        assert_eq!(x.token_ids, y.token_ids);
        assert_eq!(x.token_ids.len(), 8);
    }
    let distinct: std::collections::HashSet<_> =
        a.outputs.iter().map(|o| o.token_ids.clone()).collect();
    assert!(
        distinct.len() > 1,
        "independent samples should differ: {distinct:?}"
    );
    // greedy n > 1: every sample equals the single greedy answer
    let mut g = greedy(8);
    g.n = 3;
    let single = run_alone(&h, &prompt, &greedy(8));
    let out = h
        .submit(EngineRequest {
            prompt_token_ids: prompt.clone(),
            params: g,
            lora: None,
            cache_salt: None,
            mm: None,
        })
        .expect("submit")
        .wait()
        .expect("done");
    for o in &out.outputs {
        assert_eq!(o.token_ids, single);
    }
    assert_sound(&h);
}

#[test]
fn stop_tokens_stop_strings_and_min_tokens() {
    let h = start("qwen2", |_| {});
    let prompt = prompts()[4].clone();
    let full = h
        .submit(EngineRequest {
            prompt_token_ids: prompt.clone(),
            params: greedy(12),
            lora: None,
            cache_salt: None,
            mm: None,
        })
        .expect("submit")
        .wait()
        .expect("done");
    let toks = full.outputs[0].token_ids.clone();
    let text = full.outputs[0].text.clone();
    // stop token: the 4th generated token
    let mut p = greedy(12);
    p.stop_token_ids = vec![toks[3]];
    let first = toks.iter().position(|&t| t == toks[3]).unwrap_or(3);
    let o = run_req(&h, &prompt, p.clone());
    assert_eq!(o.token_ids, toks[..=first].to_vec());
    assert_eq!(o.finish_reason, Some(FinishReason::Stop));
    assert_eq!(o.stop_reason, Some(StopReason::Token(toks[3])));
    // min_tokens suppresses it
    p.min_tokens = 12;
    let o = run_req(&h, &prompt, p);
    assert_eq!(o.token_ids.len(), 12);
    assert!(!o.token_ids.contains(&toks[3]));
    // stop string: a piece from the middle of the text
    let chars: Vec<char> = text.chars().collect();
    if chars.len() > 6 {
        let stop: String = chars[3..6].iter().collect();
        let cut = text.find(&stop).expect("present");
        let mut p = greedy(12);
        p.stop = vec![stop.clone()];
        let o = run_req(&h, &prompt, p.clone());
        assert_eq!(o.text, text[..cut]);
        assert_eq!(o.stop_reason, Some(StopReason::Text(stop.clone())));
        p.include_stop_str_in_output = true;
        let o = run_req(&h, &prompt, p.clone());
        assert_eq!(o.text, text[..cut + stop.len()]);
        // before min_tokens a stop string is ordinary text: all 12 tokens and their whole text
        p.include_stop_str_in_output = false;
        p.min_tokens = 12;
        let o = run_req(&h, &prompt, p);
        assert_eq!((o.token_ids.len(), o.text.as_str()), (12, text.as_str()));
        assert_eq!(o.finish_reason, Some(FinishReason::Length));
    }
    assert_sound(&h);
}

fn run_req(
    h: &EngineHandle,
    prompt: &[u32],
    p: SamplingParams,
) -> rserve_core::request::CompletionOutput {
    let out = h
        .submit(EngineRequest {
            prompt_token_ids: prompt.to_vec(),
            params: p,
            lora: None,
            cache_salt: None,
            mm: None,
        })
        .expect("submit")
        .wait()
        .expect("done");
    out.outputs[0].clone()
}

#[test]
fn streaming_deltas_concatenate_to_the_text() {
    let h = start("mistral", |_| {});
    let mut s = h
        .submit(EngineRequest {
            prompt_token_ids: prompts()[5].clone(),
            params: greedy(20),
            lora: None,
            cache_salt: None,
            mm: None,
        })
        .expect("submit");
    let mut acc = String::new();
    let mut deltas: Vec<String> = Vec::new();
    let mut tokens: Vec<u32> = Vec::new();
    while let Some(o) = s.blocking_next() {
        let o = o.expect("ok");
        for c in &o.outputs {
            acc.push_str(&c.text);
            deltas.push(c.text.clone());
            tokens.extend(&c.token_ids);
        }
    }
    let last = s.output().clone();
    assert!(last.finished);
    assert_eq!(acc, last.outputs[0].text);
    assert_eq!(tokens, last.outputs[0].token_ids);
    let decoded = h
        .info()
        .tokenizer
        .decode(&last.outputs[0].token_ids, true)
        .expect("decode");
    assert_eq!(acc, decoded);
    // a random model may emit invalid UTF-8; otherwise no delta shows a replacement character
    if !decoded.contains('\u{FFFD}') {
        assert!(deltas.iter().all(|d| !d.contains('\u{FFFD}')), "{deltas:?}");
    }
}

#[test]
fn dropping_a_stream_aborts_and_frees_its_blocks() {
    let h = start("qwen3", |_| {});
    let mut p = greedy(400);
    p.ignore_eos = true;
    let mut s = h
        .submit(EngineRequest {
            prompt_token_ids: prompts()[1].clone(),
            params: p,
            lora: None,
            cache_salt: None,
            mm: None,
        })
        .expect("submit");
    for _ in 0..3 {
        s.blocking_next();
    }
    let id = s.request_id();
    drop(s);
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(
        h.stats().running.load(Ordering::Relaxed),
        0,
        "request {id} still running"
    );
    assert_sound(&h);
    // explicit abort of a queued request
    let s = h
        .submit(EngineRequest {
            prompt_token_ids: vec![0, 5, 9],
            params: greedy(300),
            lora: None,
            cache_salt: None,
            mm: None,
        })
        .expect("submit");
    h.abort(s.request_id());
    let out = s.wait().expect("final output");
    assert_eq!(out.outputs[0].finish_reason, Some(FinishReason::Abort));
    assert_sound(&h);
}

#[test]
fn bad_requests_are_errors_not_panics() {
    let h = start("llama2", |c| c.max_model_len = Some(64));
    let sub = |prompt: Vec<u32>, p: SamplingParams| {
        h.submit(EngineRequest {
            prompt_token_ids: prompt,
            params: p,
            lora: None,
            cache_salt: None,
            mm: None,
        })
        .err()
    };
    assert!(matches!(
        sub(vec![], greedy(4)),
        Some(EngineError::InvalidRequest(_))
    ));
    assert!(matches!(
        sub(vec![5000], greedy(4)),
        Some(EngineError::InvalidRequest(_))
    ));
    let e = sub(vec![1; 60], greedy(10)).expect("too long");
    assert_eq!(
        e.to_string(),
        "This model's maximum context length is 64 tokens. However, you requested 70 tokens (60 in the messages, 10 in the completion). Please reduce the length of the messages or completion."
    );
    assert!(e.is_user_error());
    // an absurd max_tokens is a context-length error, not an overflow
    let e = sub(vec![1, 2], greedy(usize::MAX)).expect("too long");
    assert!(matches!(e, EngineError::ContextLength { .. }), "{e}");
    assert!(e.to_string().contains("maximum context length"), "{e}");
    // caps on stop strings and logit_bias, named in the errors
    let many_stops = SamplingParams {
        stop: (0..200).map(|i| format!("s{i}")).collect(),
        ..greedy(4)
    };
    let long_stop = SamplingParams {
        stop: vec!["x".repeat(5000)],
        ..greedy(4)
    };
    let big_bias = SamplingParams {
        logit_bias: (0..2000).map(|t| (t, 1.0)).collect(),
        ..greedy(4)
    };
    for (p, field, limit) in [
        (many_stops, "stop", "128"),
        (long_stop, "stop", "1024"),
        (big_bias, "logit_bias", "1024"),
    ] {
        match sub(vec![1, 2], p) {
            Some(EngineError::InvalidParam { field: f, message }) => {
                assert!(f == field && message.contains(limit), "{f}: {message}")
            }
            other => panic!("{other:?}"),
        }
    }
    let bad = SamplingParams {
        top_p: 0.0,
        ..greedy(4)
    };
    assert!(matches!(
        sub(vec![1, 2], bad),
        Some(EngineError::InvalidParam { .. })
    ));
    // default max_tokens (None) fills the rest of the context
    let p = SamplingParams {
        max_tokens: None,
        ignore_eos: true,
        ..greedy(1)
    };
    let out = run_req(&h, &[0, 1, 2, 3], p);
    assert_eq!(out.token_ids.len(), 60);
    assert_eq!(out.finish_reason, Some(FinishReason::Length));
    assert_sound(&h);
}

/// Submits every prompt at once, prompt `i` with `params(i)`, and returns each one's tokens and
/// finish reason.
fn run_mixed(
    h: &EngineHandle,
    prompts: &[Vec<u32>],
    params: impl Fn(usize) -> SamplingParams,
) -> Vec<(Vec<u32>, Option<FinishReason>)> {
    submit_all(h, prompts, params)
        .into_iter()
        .map(|out| {
            let c = &out.outputs[0];
            (c.token_ids.clone(), c.finish_reason)
        })
        .collect()
}

#[test]
fn async_scheduling_matches_waiting_for_every_step() {
    // On a GPU the next step is issued before this step's tokens are read back (they reach its
    // token ids on the device); on the CPU `lookahead_on_host` runs the same bookkeeping with
    // host-sampled tokens. Tokens and where each completion stops must not change. Small steps
    // mix prompt chunks with decode rows waiting for tokens; length limits, stop tokens, stop
    // strings, seeded sampling and a penalty (which turns the lookahead off for its steps) all
    // occur.
    let prompts = prompts();
    let sync = start("llama3", |c| {
        c.async_scheduling = false;
        c.max_num_batched_tokens = Some(16);
    });
    let plain = |i: usize| {
        let mut p = greedy(6 + 3 * i);
        if i % 3 == 2 {
            p.temperature = 0.9;
            p.seed = Some(7 + i as u64);
        }
        p
    };
    let first = run_mixed(&sync, &prompts, plain);
    // stop on a token the first request really produces mid-way, and on the text of a token
    // the last one produces
    let stop = first[1].0[3];
    let stop_text = sync
        .info()
        .tokenizer
        .decode(&first[5].0[4..5], true)
        .expect("decode");
    let params = |i: usize| {
        let mut p = plain(i);
        if i % 3 == 1 {
            p.ignore_eos = false;
            p.stop_token_ids = vec![stop];
        }
        if i == 4 {
            p.repetition_penalty = 1.3;
        }
        if i == 5 {
            p.stop = vec![stop_text.clone()];
        }
        p
    };
    let want = run_mixed(&sync, &prompts, params);
    assert_eq!(want[1].1, Some(FinishReason::Stop));
    assert!(want[1].0.len() <= 4, "the stop token ends request 1 early");
    if !stop_text.trim().is_empty() {
        assert_eq!(want[5].1, Some(FinishReason::Stop));
        assert!(want[5].0.len() <= 5, "the stop string ends request 5 early");
    }
    assert_sound(&sync);
    let lookahead = start("llama3", |c| {
        c.max_num_batched_tokens = Some(16);
        c.lookahead_on_host = true;
    });
    for round in 0..2 {
        assert_eq!(
            run_mixed(&lookahead, &prompts, params),
            want,
            "round {round}"
        );
        assert_eq!(
            run_mixed(&lookahead, &prompts, plain),
            first,
            "round {round}"
        );
    }
    assert!(lookahead.stats().steps_ahead.load(Ordering::Relaxed) > 10);
    assert_eq!(sync.stats().steps_ahead.load(Ordering::Relaxed), 0);
    assert_sound(&lookahead);
}
