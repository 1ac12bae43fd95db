//! Prefix caching end to end on a tiny model: shared prompt prefixes are computed once and the
//! outputs do not change with the cache on or off (alone, batched, under preemption, with n > 1
//! samples); other salts never hit; prompt-logprob requests compute every position; a reset
//! forgets everything; the block pool is sound after every test.

mod common;

use common::*;
use rserve_core::request::RequestOutput;
use rserve_core::{EngineHandle, EngineRequest, KvBudget, SamplingParams};
use std::sync::atomic::Ordering;

/// 40 shared tokens (two and a half blocks of 16), then a suffix of `3 + i` tokens of its own.
fn prompt(i: u32) -> Vec<u32> {
    let mut p: Vec<u32> = (0..40).map(|j| 11 + (j * 37) % 900).collect();
    p.extend((0..3 + i).map(|j| 500 + (i * 53 + j * 19) % 400));
    p
}

fn params(max_tokens: usize) -> SamplingParams {
    let mut p = SamplingParams::greedy(max_tokens);
    p.ignore_eos = true;
    p.logprobs = Some(2);
    p
}

fn submit(
    h: &EngineHandle,
    prompt: Vec<u32>,
    p: SamplingParams,
    salt: Option<&str>,
) -> RequestOutput {
    h.submit(EngineRequest {
        prompt_token_ids: prompt,
        params: p,
        lora: None,
        cache_salt: salt.map(str::to_owned),
        mm: None,
    })
    .expect("submitted")
    .wait()
    .expect("finished")
}

/// Runs prompt 0 alone, then prompts 1..count at once; every output.
fn run(h: &EngineHandle, count: u32, p: &SamplingParams) -> Vec<RequestOutput> {
    let mut outs = vec![submit(h, prompt(0), p.clone(), None)];
    outs.extend(together(h, 1..count, p));
    outs
}

/// The prompts `ids` submitted at once; every output.
fn together(h: &EngineHandle, ids: std::ops::Range<u32>, p: &SamplingParams) -> Vec<RequestOutput> {
    let streams: Vec<_> = ids
        .map(|i| {
            h.submit(EngineRequest {
                prompt_token_ids: prompt(i),
                params: p.clone(),
                lora: None,
                cache_salt: None,
                mm: None,
            })
            .expect("submitted")
        })
        .collect();
    streams
        .into_iter()
        .map(|s| s.wait().expect("finished"))
        .collect()
}

fn assert_same(on: &[RequestOutput], off: &[RequestOutput]) {
    let tol = tolerance();
    for (i, (a, b)) in on.iter().zip(off).enumerate() {
        assert_eq!(a.outputs.len(), b.outputs.len());
        for (x, y) in a.outputs.iter().zip(&b.outputs) {
            assert_eq!(
                x.token_ids, y.token_ids,
                "request {i} completion {}",
                x.index
            );
            let (lx, ly) = (x.logprobs.as_ref(), y.logprobs.as_ref());
            for (p, q) in lx.into_iter().flatten().zip(ly.into_iter().flatten()) {
                assert!(
                    (p.logprob - q.logprob).abs() <= tol,
                    "request {i}: {p:?} vs {q:?}"
                );
            }
        }
    }
}

/// Requests sharing a prefix that arrive together with nothing cached: the first admitted
/// computes the shared blocks and every other starts from them, whether admitted in the same
/// step (the blocks are registered when the step is planned) or later; outputs are the cache
/// off's.
#[test]
fn requests_arriving_together_start_from_the_prefix_the_first_computes() {
    let off = start("llama3", |c| c.enable_prefix_caching = false);
    let want = together(&off, 0..6, &params(8));
    let on = start("llama3", |_| {});
    let got = together(&on, 0..6, &params(8));
    assert_same(&got, &want);
    let cached: Vec<_> = got.iter().map(|o| o.num_cached_tokens).collect();
    assert_eq!(cached[0], Some(0), "{cached:?}");
    assert!(cached[1..].iter().all(|&c| c == Some(32)), "{cached:?}");
    assert_sound(&on);
}

/// Shared prefixes computed over small steps (prompts split into chunks beside decode rows), with
/// the async bookkeeping on the host (the next step planned before this one's tokens are known):
/// the same outputs as the cache off, and later prompts start from cached blocks.
#[test]
fn small_steps_and_lookahead_change_no_output() {
    let config = |on: bool| {
        move |c: &mut rserve_core::EngineConfig| {
            c.enable_prefix_caching = on;
            c.max_num_batched_tokens = Some(9);
            c.lookahead_on_host = true;
        }
    };
    let want = together(&start("llama3", config(false)), 0..6, &params(8));
    let on = start("llama3", config(true));
    let got = together(&on, 0..6, &params(8));
    assert_same(&got, &want);
    let cached: Vec<_> = got
        .iter()
        .map(|o| o.num_cached_tokens.unwrap_or(0))
        .collect();
    assert!(cached[1..].iter().any(|&c| c > 0), "{cached:?}");
    assert_sound(&on);
}

/// The same tokens under two adapters (and the base) never share blocks: each computes its
/// prompt, and the outputs are the cache off's.
#[test]
fn the_same_prompt_under_other_adapters_shares_nothing() {
    use rserve_core::lora::LoraOptions;
    let dir = repo().join("adapters/fixtures");
    let config = |on: bool| {
        let dir = dir.clone();
        move |c: &mut rserve_core::EngineConfig| {
            c.enable_prefix_caching = on;
            c.lora = Some(LoraOptions {
                max_loras: 2,
                max_rank: 16,
                max_cpu_loras: 2,
            });
            c.lora_modules = vec![
                ("a".into(), dir.join("llama3-r8-qv")),
                ("b".into(), dir.join("llama3-r4-all")),
            ];
        }
    };
    let ask = |h: &EngineHandle, lora: Option<&str>| {
        h.submit(EngineRequest {
            prompt_token_ids: prompt(1),
            params: params(6),
            lora: lora.map(str::to_owned),
            cache_salt: None,
            mm: None,
        })
        .expect("submitted")
        .wait()
        .expect("finished")
    };
    let order = [None, Some("a"), Some("b"), Some("a")];
    let off = start("llama3", config(false));
    let want: Vec<_> = order.iter().map(|&l| ask(&off, l)).collect();
    let on = start("llama3", config(true));
    let got: Vec<_> = order.iter().map(|&l| ask(&on, l)).collect();
    assert_same(&got, &want);
    let cached: Vec<_> = got.iter().map(|o| o.num_cached_tokens).collect();
    // only the second request of adapter `a` finds blocks: two full blocks of its prompt
    assert_eq!(cached, [Some(0), Some(0), Some(0), Some(32)]);
    assert_sound(&on);
}

#[test]
fn shared_prefixes_are_computed_once_and_change_no_output() {
    let off = start("llama3", |c| c.enable_prefix_caching = false);
    let want = run(&off, 6, &params(10));
    assert!(want.iter().all(|o| o.num_cached_tokens == Some(0)));
    assert_eq!(off.stats().prefix_cache_hits.load(Ordering::Relaxed), 0);
    assert_sound(&off);

    let on = start("llama3", |_| {});
    let got = run(&on, 6, &params(10));
    assert_same(&got, &want);
    assert_eq!(got[0].num_cached_tokens, Some(0));
    // the two full blocks of the shared 40 tokens come from the cache
    for o in &got[1..] {
        assert_eq!(o.num_cached_tokens, Some(32), "{:?}", o.prompt_token_ids);
    }
    let stats = on.stats();
    assert_eq!(stats.prefix_cache_hits.load(Ordering::Relaxed), 5 * 32);
    let queried: usize = (0..6).map(|i| prompt(i).len()).sum();
    assert_eq!(
        stats.prefix_cache_queries.load(Ordering::Relaxed),
        queried as u64
    );
    // the same prompt again (finished requests' blocks stay cached): its first two blocks hit;
    // the third is full too but holds the last token, whose logits must be computed
    let again = submit(&on, prompt(5), params(10), None);
    assert_eq!(again.num_cached_tokens, Some(32));
    assert_same(&[again], &want[5..]);
    // one token longer, all three blocks hit
    let mut longer = prompt(5);
    longer.push(7);
    assert_eq!(
        submit(&on, longer, params(1), None).num_cached_tokens,
        Some(48)
    );
    assert_sound(&on);
}

#[test]
fn preemption_and_forked_samples_change_no_output() {
    let mut sampled = SamplingParams::greedy(12);
    sampled.n = 3;
    sampled.temperature = 0.9;
    sampled.seed = Some(7);
    sampled.ignore_eos = true;
    let tight = |c: &mut rserve_core::EngineConfig| {
        c.block_size = 4;
        c.kv_cache = KvBudget::Blocks(40); // 160 tokens for ~8 x 60 asked for
    };
    let off = start("llama3", |c| {
        tight(c);
        c.enable_prefix_caching = false;
    });
    let want = run(&off, 8, &sampled);
    assert_sound(&off);
    let on = start("llama3", tight);
    let got = run(&on, 8, &sampled);
    assert_same(&got, &want);
    assert!(
        on.stats().preemptions.load(Ordering::Relaxed) > 0,
        "the budget must force preemption"
    );
    assert!(on.stats().prefix_cache_hits.load(Ordering::Relaxed) > 0);
    assert_sound(&on);
}

#[test]
fn salts_keep_tenants_apart_and_a_reset_forgets_everything() {
    let h = start("llama3", |_| {});
    let p = prompt(1);
    assert_eq!(
        submit(&h, p.clone(), params(2), Some("a")).num_cached_tokens,
        Some(0)
    );
    assert_eq!(
        submit(&h, p.clone(), params(2), None).num_cached_tokens,
        Some(0)
    );
    assert_eq!(
        submit(&h, p.clone(), params(2), Some("b")).num_cached_tokens,
        Some(0)
    );
    assert_eq!(
        submit(&h, p.clone(), params(2), Some("a")).num_cached_tokens,
        Some(32)
    );
    assert_eq!(
        submit(&h, p.clone(), params(2), None).num_cached_tokens,
        Some(32)
    );
    assert!(h.reset_prefix_cache().expect("engine alive") >= 6);
    assert_eq!(
        submit(&h, p.clone(), params(2), None).num_cached_tokens,
        Some(0)
    );
    assert_sound(&h);
}

#[test]
fn prompt_logprob_requests_compute_every_position() {
    let h = start("llama3", |_| {});
    let p = prompt(2);
    let first = teacher_forced(&h, &p);
    // cached now, but a prompt-logprob request needs every position's logits
    let mut lp = params(1);
    lp.prompt_logprobs = Some(0);
    let out = submit(&h, p.clone(), lp, None);
    assert_eq!(out.num_cached_tokens, Some(0));
    let again: Vec<f32> = out.prompt_logprobs.expect("asked for")[1..]
        .iter()
        .map(|l| l.as_ref().expect("a logprob").logprob)
        .collect();
    assert_eq!(first, again);
    // and its blocks serve the next plain request
    assert_eq!(submit(&h, p, params(1), None).num_cached_tokens, Some(32));
    assert_sound(&h);
}
