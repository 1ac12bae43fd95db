//! Unit tests of the sampler: the policy's edits, greedy and seeded draws, distributions of
//! top-k / top-p / min-p, logprobs, and rows that hold their raw values again.

use super::*;
use std::collections::BTreeMap;

// The parameter-level entry points the tests drive: the policy, then the host executor.

/// Everything needed to pick one sequence's next token.
struct SampleInput<'a> {
    /// Raw model logits for this position, `[vocab]` (may be longer than the tokenizer's vocab).
    /// Used as scratch; holds its raw values again on return.
    logits: &'a mut [f32],
    params: &'a SamplingParams,
    /// Prompt and generated ids so far: the repetition penalty uses both, the presence and
    /// frequency penalties only the output.
    prompt_ids: &'a [u32],
    output_ids: &'a [u32],
    /// Ids forbidden at this step (EOS and stop ids while `min_tokens` is not reached).
    suppress: &'a [u32],
    rng: &'a mut SeqRng,
}

/// Picks one sequence's next token ([`row_sampling`] then [`sample_row`]); returns it with its
/// raw logprob and the raw top `params.logprobs` alternatives.
fn sample(input: SampleInput<'_>) -> TokenLogprob {
    let s = row_sampling(
        input.params,
        input.prompt_ids,
        input.output_ids,
        input.suppress,
        input.rng,
    );
    sample_row(input.logits, &s, input.params.logprobs.unwrap_or(0))
}

/// [`sample`] for every row, spread over rayon's pool when the batch is large.
fn sample_batch(inputs: Vec<SampleInput<'_>>) -> Vec<TokenLogprob> {
    let work: usize = inputs.iter().map(|i| i.logits.len()).sum();
    if inputs.len() > 1 && work >= PAR_MIN_WORK {
        inputs.into_par_iter().map(sample).collect()
    } else {
        inputs.into_iter().map(sample).collect()
    }
}

/// Raw log-probability of `next_token` given `logits`, with the top `k` alternatives.
fn prompt_logprob(logits: &[f32], next_token: u32, k: Option<usize>) -> TokenLogprob {
    let z = LogZ::of(logits);
    let logprob = logits
        .get(next_token as usize)
        .map_or(NEG_INF, |&x| z.logprob(x));
    let row: Vec<f32> = logits.iter().map(|&x| z.logprob(x)).collect();
    TokenLogprob {
        token_id: next_token,
        logprob,
        top: with_logprobs(logits, &z, k.unwrap_or(0)),
        rank: Some(rank_of(&row, logprob)),
    }
}

/// `ids` = [prompt, output, suppress]; also checks the row is restored.
fn run(x: &[f32], params: &SamplingParams, ids: [&[u32]; 3], rng: &mut SeqRng) -> TokenLogprob {
    let mut row = x.to_vec();
    let [prompt_ids, output_ids, suppress] = ids;
    let logits = &mut row;
    let r = sample(SampleInput {
        logits,
        params,
        prompt_ids,
        output_ids,
        suppress,
        rng,
    });
    assert_eq!(format!("{row:?}"), format!("{x:?}"));
    r
}
const NO: [&[u32]; 3] = [&[], &[], &[]];
const L: [f32; 6] = [2.0, 1.5, 1.0, 0.5, 0.0, -1.0];
type Ids = &'static [u32];
type Case = (&'static [f32], SamplingParams, Ids, Ids, u32);

fn with(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
    let mut p = SamplingParams::default();
    f(&mut p);
    p
}

fn softmax(x: &[f32], t: f64) -> Vec<f64> {
    let e: Vec<f64> = x.iter().map(|&v| (f64::from(v) / t).exp()).collect();
    e.iter().map(|v| v / e.iter().sum::<f64>()).collect()
}

fn renorm(p: &[f64], keep: impl Fn(usize) -> bool) -> Vec<f64> {
    let s: f64 = (0..p.len()).filter(|&i| keep(i)).map(|i| p[i]).sum();
    (0..p.len())
        .map(|i| if keep(i) { p[i] / s } else { 0.0 })
        .collect()
}

/// Length of the shortest prefix whose cumulative mass reaches `target`.
fn nucleus_len(p: &[f64], target: f64) -> usize {
    let cum = p
        .iter()
        .scan(0.0, |c, &q| Some(std::mem::replace(c, *c + q)));
    cum.take_while(|&c| c < target).count()
}

/// 20k draws from `L`; every frequency within 5 sigma, tokens outside the kept set never drawn.
fn assert_dist(p: &SamplingParams, expected: &[f64]) {
    const N: usize = 20_000;
    let mut rng = SeqRng::new(7);
    let mut counts = [0usize; L.len()];
    for _ in 0..N {
        counts[run(&L, p, NO, &mut rng).token_id as usize] += 1;
    }
    for (i, (&c, &q)) in counts.iter().zip(expected).enumerate() {
        let (mean, msg) = (N as f64 * q, format!("token {i}: {c} draws, p = {q}"));
        assert!(q > 0.0 || c == 0, "{msg}");
        assert!(
            (c as f64 - mean).abs() <= 5.0 * (mean * (1.0 - q)).sqrt() + 1.0,
            "{msg}"
        );
    }
}

#[test]
fn rng_reference_and_ranges() {
    let mut r = SeqRng { s: [1, 2, 3, 4] };
    assert_eq!(r.next_u64(), 41_943_041); // xoshiro256++ reference output
    let mut r = SeqRng::new(1);
    let (mut s32, mut s64) = (0.0, 0.0);
    for _ in 0..10_000 {
        let (a, b) = (r.next_f32(), r.next_f64());
        assert!((0.0..1.0).contains(&a) && (0.0..1.0).contains(&b));
        (s32, s64) = (s32 + f64::from(a), s64 + b);
    }
    assert!((s32 / 1e4 - 0.5).abs() < 0.02 && (s64 / 1e4 - 0.5).abs() < 0.02);
    assert_eq!(SeqRng::for_sample(9, 0), SeqRng::new(9));
    assert_ne!(SeqRng::for_sample(9, 1), SeqRng::for_sample(9, 2));
}

#[test]
fn greedy_argmax_ties_and_no_draw() {
    let p = SamplingParams::greedy(4);
    let mut rng = SeqRng::new(3);
    let before = rng.clone();
    assert_eq!(run(&[0.1, 2.0, -1.0, 2.0], &p, NO, &mut rng).token_id, 1);
    assert_eq!(run(&[5.0, 5.0], &p, NO, &mut rng).token_id, 0);
    assert_eq!(rng, before, "greedy must not draw");
}

#[test]
fn logprobs_match_hand_computation() {
    // ln(e^1 + e^2 + e^3 + e^0.5) = 3.460773489156851
    let logits = [1.0, 2.0, 3.0, 0.5];
    let close = |a: f32, b: f32| (a - b).abs() < 1e-6;
    let p = with(|p| (p.temperature, p.logprobs) = (0.0, Some(2)));
    let r = run(&logits, &p, NO, &mut SeqRng::new(0));
    assert_eq!(
        (r.token_id, r.top.len(), r.top[0].0, r.top[1].0),
        (2, 2, 2, 1)
    );
    assert!(close(r.logprob, -0.460_773_5) && close(r.top[1].1, -1.460_773_5));
    let pl = prompt_logprob(&logits, 1, Some(1));
    assert!(close(pl.logprob, -1.460_773_5) && pl.top[0].0 == 2);
    assert_eq!(prompt_logprob(&logits, 99, None).logprob, NEG_INF);
    // The chosen token's logprob comes from the raw row even when a bias picked it.
    let mut p = p;
    p.logit_bias.insert(3, 10.0);
    let r = run(&logits, &p, NO, &mut SeqRng::new(0));
    assert!(r.token_id == 3 && close(r.logprob, 0.5 - 3.460_773_5));
}

#[test]
fn top_alternatives_order() {
    let ids = |t: Vec<(u32, f32)>| t.into_iter().map(|t| t.0).collect::<Vec<_>>();
    let top = |k| ids(prompt_logprob(&[1.0, 3.0, 2.0, 3.0, 2.0], 0, Some(k)).top);
    assert_eq!(
        (top(4), top(0), top(10)),
        (vec![1, 3, 2, 4], vec![], vec![1, 3, 2, 4, 0])
    );
    let big: Vec<f32> = (0..200).map(|i| (i % 7) as f32).collect();
    let mut brute: Vec<(u32, f32)> = (0..200).map(|i| (i, big[i as usize])).collect();
    brute.sort_by(rank);
    assert_eq!(top_n(&big, 40), brute[..40]);
}

#[test]
fn seeded_determinism_and_batch_independence() {
    let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.1).collect();
    let p = SamplingParams::default();
    let seq = |seed| {
        let mut rng = SeqRng::new(seed);
        let mut next = || run(&logits, &p, NO, &mut rng).token_id;
        (0..50).map(|_| next()).collect::<Vec<_>>()
    };
    assert_eq!(seq(1), seq(1));
    assert_ne!(seq(1), seq(2));

    // 64 x 4096 logits takes the parallel path; mixed params in one batch.
    let mut gen = SeqRng::new(99);
    let rows: Vec<Vec<f32>> = (0..64)
        .map(|_| (0..4096).map(|_| gen.next_f32() * 4.0).collect())
        .collect();
    let kinds = [
        p.clone(),
        with(|p| (p.top_k, p.top_p) = (50, 0.9)),
        SamplingParams::greedy(1),
    ];
    let batch = |which: &[usize]| {
        let mut copies: Vec<Vec<f32>> = which.iter().map(|&i| rows[i].clone()).collect();
        let mut rngs: Vec<SeqRng> = which.iter().map(|&i| SeqRng::for_sample(5, i)).collect();
        let rows = copies.iter_mut().zip(&mut rngs).zip(which);
        let inputs = rows.map(|((logits, rng), &i)| {
            let (params, prompt_ids, output_ids, suppress) = (&kinds[i % 3], &[], &[], &[]);
            SampleInput {
                logits,
                params,
                prompt_ids,
                output_ids,
                suppress,
                rng,
            }
        });
        let out = sample_batch(inputs.collect());
        out.into_iter().map(|r| r.token_id).collect::<Vec<_>>()
    };
    let full = batch(&(0..64).collect::<Vec<_>>());
    let odd: Vec<usize> = (1..64).step_by(2).collect();
    assert_eq!(
        batch(&odd),
        odd.iter().map(|&i| full[i]).collect::<Vec<_>>()
    );
    assert_eq!(batch(&[10]), [full[10]]);
}

#[test]
fn temperature_and_top_k_distributions() {
    assert_dist(&with(|p| p.temperature = 0.5), &softmax(&L, 0.5));
    let top3 = renorm(&softmax(&L, 1.0), |i| i < 3);
    assert_dist(&with(|p| p.top_k = 3), &top3);
}

#[test]
fn top_p_distribution() {
    let probs = softmax(&L, 1.0);
    let kept = nucleus_len(&probs, 0.7);
    assert!(kept > 1 && kept < L.len());
    assert_dist(&with(|p| p.top_p = 0.7), &renorm(&probs, |i| i < kept));
    // top-p applies to the renormalised top-k set, after temperature.
    let probs = renorm(&softmax(&L, 2.0), |i| i < 4);
    let kept = nucleus_len(&probs, 0.8);
    let p = with(|p| (p.temperature, p.top_k, p.top_p) = (2.0, 4, 0.8));
    assert_dist(&p, &renorm(&probs, |i| i < kept));
}

#[test]
fn min_p_distribution() {
    let probs = softmax(&L, 1.0);
    let keep = |i: usize| probs[i] >= 0.3 * probs[0];
    assert_eq!((0..6).filter(|&i| keep(i)).count(), 3);
    assert_dist(&with(|p| p.min_p = 0.3), &renorm(&probs, keep));
}

#[test]
fn nucleus_matches_full_sort() {
    let mut gen = SeqRng::new(4);
    let mut full: Vec<(u32, f32)> = (0..5000).map(|i| (i, gen.next_f32() * 8.0)).collect();
    let w = |x: f32| f64::from((x - 8.0).exp());
    let target = 0.9 * full.iter().map(|c| w(c.1)).sum::<f64>();
    let mut cands = full.clone();
    let n = nucleus(&mut cands, &w, target);
    full.sort_by(rank);
    let expect = nucleus_len(&full.iter().map(|c| w(c.1)).collect::<Vec<_>>(), target);
    assert!(n > 256, "exercises several widenings");
    assert_eq!((n, &cands[..n]), (expect, &full[..expect]));
}

#[test]
fn penalties_and_bias_move_argmax() {
    let rep = |r| with(|p| p.repetition_penalty = r);
    let pres = |r| with(|p| p.presence_penalty = r);
    let freq = with(|p| p.frequency_penalty = 0.1);
    let bias = with(|p| p.logit_bias = BTreeMap::from([(2, 5.0), (77, 1.0)]));
    let cases: [Case; 11] = [
        (&[2.0, 1.9, -1.0], rep(1.2), &[], &[], 0),
        (&[2.0, 1.9, -1.0], rep(1.2), &[0], &[], 1),
        (&[-0.5, -0.6], rep(2.0), &[], &[0], 1),
        (&[2.0, 1.6], rep(1.2), &[0, 0, 0], &[0], 0), // once per distinct token
        (&[1.0, 0.8], pres(0.15), &[], &[0, 0, 0], 0), // once, not per occurrence
        (&[1.0, 0.8], pres(0.5), &[0], &[0], 1),
        (&[1.0, 0.8], pres(0.5), &[0], &[], 0), // the prompt does not count
        (&[1.0, 0.8], freq.clone(), &[], &[0], 0),
        (&[1.0, 0.8], freq, &[], &[0, 0, 0], 1),
        (&[1.0, 0.0, 0.0], bias, &[], &[99], 2),
        (&[1.0, 0.0, 0.0], SamplingParams::default(), &[], &[], 0),
    ];
    for (i, (logits, mut p, prompt, out, want)) in cases.into_iter().enumerate() {
        p.temperature = 0.0;
        let got = run(logits, &p, [prompt, out, &[]], &mut SeqRng::new(0)).token_id;
        assert_eq!(got, want, "case {i}");
    }
}

#[test]
fn suppressed_ids_never_chosen() {
    let mut rng = SeqRng::new(11);
    let mut tok = |p: &SamplingParams, sup| {
        run(&[3.0, 2.9, 0.0, -0.5], p, [&[], &[], sup], &mut rng).token_id
    };
    assert_eq!(tok(&SamplingParams::greedy(1), &[0, 1000]), 1);
    let p = with(|p| p.logit_bias = BTreeMap::from([(0, 50.0)]));
    for _ in 0..2000 {
        assert!(tok(&p, &[0, 1]) >= 2);
    }
    assert_eq!(tok(&p, &[0, 1, 2, 3]), 0);
}

#[test]
fn nan_and_inf_do_not_panic() {
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    let g = with(|p| (p.temperature, p.logprobs) = (0.0, Some(3)));
    let s = with(|p| (p.logprobs, p.top_k, p.top_p, p.min_p) = (Some(3), 2, 0.5, 0.1));
    let mut rng = SeqRng::new(2);
    for p in [&g, &s, &SamplingParams::default()] {
        let r = run(&[nan, 1.0, nan], p, NO, &mut rng);
        assert_eq!((r.token_id, r.logprob), (1, 0.0));
        for row in [&[nan, nan][..], &[NEG_INF; 3], &[]] {
            let r = run(row, p, [&[1], &[0], &[]], &mut rng);
            assert_eq!((r.token_id, r.logprob), (0, NEG_INF));
        }
        let r = run(&[0.0, inf, 1.0, inf], p, NO, &mut rng);
        assert!(r.token_id == 1 || r.token_id == 3);
        assert!((r.logprob - -std::f32::consts::LN_2).abs() < 1e-6);
    }
    assert_eq!(prompt_logprob(&[nan, nan], 0, Some(2)).logprob, NEG_INF);
}

#[test]
fn uniforms_are_the_device_samplers_counter_hash() {
    // (h >> 40) of splitmix64(seed ^ splitmix64(i)), as csrc/sampling.cu computes it
    assert_eq!(uniform(1, 0), (570_621.0 + 0.5) / 16_777_216.0);
    assert_eq!(uniform(42, 7), (7_252_870.0 + 0.5) / 16_777_216.0);
    assert!((0..10_000).all(|i| {
        let u = uniform(9, i);
        u > 0.0 && u < 1.0
    }));
}

#[test]
fn the_policy_turns_parameters_into_one_edit_per_token() {
    let p = with(|p| {
        p.temperature = 0.7;
        p.repetition_penalty = 1.5;
        p.presence_penalty = 0.5;
        p.frequency_penalty = 0.25;
        p.logit_bias = BTreeMap::from([(4, 2.0), (9, -1.0)]);
    });
    let mut rng = SeqRng::new(3);
    let before = rng.clone();
    let s = row_sampling(&p, &[4, 5], &[5, 5, 6], &[9], &mut rng);
    assert_ne!(rng, before, "a random row takes one draw for its seed");
    let by: BTreeMap<u32, &LogitEdit> = s.edits.iter().map(|e| (e.token, e)).collect();
    assert_eq!(by.keys().copied().collect::<Vec<_>>(), vec![4, 5, 6, 9]);
    assert_eq!(
        (by[&4].bias, by[&4].repetition_penalty, by[&4].subtract),
        (2.0, 1.5, 0.0)
    );
    assert_eq!(by[&5].subtract, 0.5 + 0.25 * 2.0);
    assert_eq!(by[&6].subtract, 0.5 + 0.25);
    assert_eq!((by[&9].bias, by[&9].subtract), (-1.0, f32::INFINITY));
    assert_eq!(s.temperature, 0.7);
    let mut rng = SeqRng::new(3);
    let g = row_sampling(&SamplingParams::greedy(1), &[1], &[], &[], &mut rng);
    assert_eq!((g.temperature, g.seed), (0.0, 0));
    assert_eq!(rng, SeqRng::new(3), "a greedy row takes no draw");
}
