//! Unit tests of the scheduler: exact budgets, chunking, limits, preemption and resume, forks and
//! aborts, with a pool-integrity check after every step.

use super::*;

pub(super) fn cfg(budget: usize, max_seqs: usize, blocks: usize, bs: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: max_seqs,
        max_num_batched_tokens: budget,
        max_model_len: 1024,
        block_size: bs,
        num_blocks: blocks,
        max_prompt_logprob_rows: 1 << 20,
        max_loras: usize::MAX,
        enable_prefix_caching: false,
        max_num_encoder_tokens: usize::MAX,
    }
}

pub(super) fn add(s: &mut Scheduler, id: u64, prompt_len: usize) {
    let prompt = (0..prompt_len as u32)
        .map(|t| t + 100 * id as u32)
        .collect();
    s.add(Sequence::new(SeqId(id), RequestId(id), prompt, 1));
}

pub(super) fn plan(out: &SchedulerOutput) -> Vec<(u64, usize, usize, bool)> {
    out.scheduled
        .iter()
        .map(|s| (s.seq_id.0, s.num_computed, s.num_new, s.samples))
        .collect()
}

/// Completes a step, appending token 7 to each sequence that sampled.
pub(super) fn finish_step(s: &mut Scheduler, out: &SchedulerOutput) {
    s.complete_step(out);
    for x in &out.scheduled {
        if x.samples {
            s.append_token(x.seq_id, 7);
        }
    }
    let errs = s.check_integrity();
    assert!(errs.is_empty(), "{errs:?}");
}

#[test]
fn one_budget_mixes_chunked_prefill_and_decode() {
    let mut s = Scheduler::new(cfg(16, 8, 64, 4));
    add(&mut s, 1, 10);
    add(&mut s, 2, 10);
    add(&mut s, 3, 10);
    let o = s.schedule();
    assert_eq!(plan(&o), vec![(1, 0, 10, true), (2, 0, 6, false)]);
    assert_eq!(o.num_batched_tokens, 16);
    assert_eq!(s.num_waiting(), 1);
    finish_step(&mut s, &o);
    let o = s.schedule();
    assert_eq!(
        plan(&o),
        vec![(1, 10, 1, true), (2, 6, 4, true), (3, 0, 10, true)]
    );
    assert_eq!(o.num_batched_tokens, 15);
    finish_step(&mut s, &o);
    let o = s.schedule();
    assert_eq!(
        plan(&o),
        vec![(1, 11, 1, true), (2, 10, 1, true), (3, 10, 1, true)]
    );
    finish_step(&mut s, &o);
    assert_eq!(s.kv().block_table(SeqId(1)).len(), 3); // 12 tokens computed, 13th pending
}

#[test]
fn max_num_seqs_limits_admission() {
    let mut s = Scheduler::new(cfg(100, 2, 64, 4));
    for id in 1..=3 {
        add(&mut s, id, 3);
    }
    let o = s.schedule();
    assert_eq!(plan(&o), vec![(1, 0, 3, true), (2, 0, 3, true)]);
    finish_step(&mut s, &o);
    s.finish(SeqId(1));
    let o = s.schedule();
    assert_eq!(plan(&o), vec![(2, 3, 1, true), (3, 0, 3, true)]);
    finish_step(&mut s, &o);
}

#[test]
fn admission_waits_for_blocks_fcfs() {
    let mut s = Scheduler::new(cfg(100, 8, 4, 4));
    add(&mut s, 1, 12); // 3 blocks
    add(&mut s, 2, 8); // 2 blocks: does not fit yet
    add(&mut s, 3, 2); // would fit, but FCFS keeps it behind 2
    let o = s.schedule();
    assert_eq!(plan(&o), vec![(1, 0, 12, true)]);
    finish_step(&mut s, &o);
    s.finish(SeqId(1));
    let o = s.schedule();
    assert_eq!(plan(&o), vec![(2, 0, 8, true), (3, 0, 2, true)]);
    finish_step(&mut s, &o);
}

#[test]
fn preempts_newest_and_resumes_by_recompute() {
    // 4 blocks of 2 tokens; two sequences of 3 tokens take 2 blocks each
    let mut s = Scheduler::new(cfg(100, 8, 4, 2));
    add(&mut s, 1, 3);
    add(&mut s, 2, 3);
    let o = s.schedule();
    assert_eq!(plan(&o), vec![(1, 0, 3, true), (2, 0, 3, true)]);
    finish_step(&mut s, &o); // both have 4 tokens, 3 computed; next decode fits in block 2
    let o = s.schedule();
    assert_eq!(plan(&o), vec![(1, 3, 1, true), (2, 3, 1, true)]);
    finish_step(&mut s, &o); // 5 tokens, 4 computed: the 5th needs a third block each
    let o = s.schedule();
    assert_eq!(o.preempted, vec![SeqId(2)]);
    assert_eq!(plan(&o), vec![(1, 4, 1, true)]);
    assert_eq!(s.seq(SeqId(2)).unwrap().num_computed_tokens, 0);
    assert_eq!(s.num_waiting(), 1);
    finish_step(&mut s, &o);
    let out1: Vec<u32> = s.seq(SeqId(1)).unwrap().output_tokens().to_vec();
    assert_eq!(out1, vec![7, 7, 7]);
    s.finish(SeqId(1));
    // seq 2 resumes: recomputes prompt + its 2 generated tokens, then samples its 3rd
    let o = s.schedule();
    assert_eq!(plan(&o), vec![(2, 0, 5, true)]);
    finish_step(&mut s, &o);
    assert_eq!(s.seq(SeqId(2)).unwrap().output_tokens(), &[7, 7, 7]);
    assert_eq!(s.seq(SeqId(2)).unwrap().num_preemptions, 1);
}

#[test]
fn a_lone_sequence_that_cannot_grow_preempts_itself_without_looping() {
    let mut s = Scheduler::new(cfg(100, 8, 1, 2));
    add(&mut s, 1, 2);
    let o = s.schedule();
    finish_step(&mut s, &o);
    let o = s.schedule();
    assert_eq!(o.preempted, vec![SeqId(1)]);
    assert!(o.scheduled.is_empty());
    assert!(s.check_integrity().is_empty());
}

#[test]
fn abort_frees_everything_at_any_moment() {
    let mut s = Scheduler::new(cfg(6, 8, 16, 4));
    add(&mut s, 1, 10);
    add(&mut s, 2, 3);
    let o = s.schedule(); // seq 1 mid-prefill
    finish_step(&mut s, &o);
    assert_eq!(s.abort_request(RequestId(1)), vec![SeqId(1)]);
    assert_eq!(s.abort_request(RequestId(2)), vec![SeqId(2)]);
    assert_eq!(s.kv().num_free_blocks(), 16);
    assert!(!s.has_work());
    assert!(s.check_integrity().is_empty());
    assert!(s.abort_request(RequestId(9)).is_empty());
}

#[test]
fn forked_samples_share_the_prompt_and_copy_on_write() {
    let mut s = Scheduler::new(cfg(100, 8, 16, 4));
    s.add(Sequence::new(
        SeqId(1),
        RequestId(1),
        vec![1, 2, 3, 4, 5, 6],
        3,
    ));
    let o = s.schedule();
    assert_eq!(plan(&o), vec![(1, 0, 6, true)]);
    s.complete_step(&o);
    assert_eq!(s.seq(SeqId(1)).unwrap().pending_forks, 2);
    s.fork(SeqId(1), &[SeqId(2), SeqId(3)]);
    for (id, tok) in [(1, 10), (2, 20), (3, 30)] {
        s.append_token(SeqId(id), tok);
    }
    assert!(s.check_integrity().is_empty());
    assert_eq!(s.kv().pool().ref_count(BlockId(0)), 3);
    assert_eq!(s.kv().pool().ref_count(BlockId(1)), 3);
    assert_eq!(s.seq(SeqId(3)).unwrap().index, 2);
    let o = s.schedule();
    assert_eq!(
        plan(&o),
        vec![(1, 6, 1, true), (2, 6, 1, true), (3, 6, 1, true)]
    );
    // the partial block 1 is copied for two of the three holders; the last one keeps it
    assert_eq!(
        o.block_copies,
        vec![(BlockId(1), BlockId(2)), (BlockId(1), BlockId(3))]
    );
    assert_eq!(s.kv().pool().ref_count(BlockId(1)), 1);
    finish_step(&mut s, &o);
    for id in 1..=3 {
        s.finish(SeqId(id));
    }
    assert_eq!(s.kv().num_free_blocks(), 16);
    assert!(s.check_integrity().is_empty());
}

#[test]
fn a_placeholder_lets_the_next_step_be_planned_before_the_token_arrives() {
    let mut s = Scheduler::new(cfg(16, 8, 64, 4));
    add(&mut s, 1, 3);
    add(&mut s, 2, 5);
    let o = s.schedule();
    s.complete_step(&o);
    // tokens are being sampled on the device: sequence 1 goes on, sequence 2 is not planned past
    s.reserve_token(SeqId(1));
    let o = s.schedule();
    assert_eq!(plan(&o), vec![(1, 3, 1, true)]);
    let (host, _) =
        crate::model_runner::ModelRunner::host_batch(&s, &o, usize::MAX).expect("host batch");
    assert_eq!(host.input_ids, vec![PENDING_TOKEN]);
    assert_eq!(host.pending, vec![(0, SeqId(1), 3)]);
    s.complete_step(&o);
    s.reserve_token(SeqId(1));
    // the first step's tokens arrive: written where the placeholder is, or appended
    s.set_token(SeqId(1), 3, 41);
    s.set_token(SeqId(2), 5, 42);
    assert_eq!(
        s.seq(SeqId(1)).map(|q| q.tokens[3..].to_vec()),
        Some(vec![41, PENDING_TOKEN])
    );
    assert_eq!(
        s.seq(SeqId(2)).map(|q| q.tokens[5..].to_vec()),
        Some(vec![42])
    );
    let o = s.schedule();
    assert_eq!(plan(&o), vec![(1, 4, 1, true), (2, 5, 1, true)]);
    let (host, _) =
        crate::model_runner::ModelRunner::host_batch(&s, &o, usize::MAX).expect("host batch");
    assert_eq!(host.input_ids, vec![PENDING_TOKEN, 42]);
    assert_eq!(host.pending, vec![(0, SeqId(1), 4)]);
    assert!(s.check_integrity().is_empty());
}

#[test]
fn prompt_logprob_rows_are_bounded_per_step() {
    use crate::sequence::RequestMeta;
    use std::sync::Arc;
    let mut c = cfg(64, 8, 64, 4);
    c.max_prompt_logprob_rows = 10;
    let mut s = Scheduler::new(c);
    let meta = Arc::new(RequestMeta {
        prompt_logprobs: Some(1),
        ..RequestMeta::default()
    });
    // two 16-token prompts wanting prompt logprobs (15 rows each), one plain 8-token prompt
    for id in 1..=2 {
        let prompt = (0..16).collect();
        s.add(Sequence::new(SeqId(id), RequestId(id), prompt, 1).with_meta(meta.clone()));
    }
    add(&mut s, 3, 8);
    let out = s.schedule();
    // 10 rows: the first prompt's first 10 positions; the second waits (FCFS), so does the third
    assert_eq!(plan(&out), vec![(1, 0, 10, false)]);
    finish_step(&mut s, &out);
    let out = s.schedule();
    // 5 rows finish the first prompt (its last token produces none), 5 start the second, and the
    // plain prompt needs no rows
    assert_eq!(
        plan(&out),
        vec![(1, 10, 6, true), (2, 0, 5, false), (3, 0, 8, true)]
    );
    finish_step(&mut s, &out);
    let out = s.schedule();
    assert_eq!(
        plan(&out),
        vec![(1, 16, 1, true), (2, 5, 11, true), (3, 8, 1, true)]
    );
}

#[test]
fn placeholders_resolve_in_order_and_known_tokens_exclude_them() {
    let mut s = Scheduler::new(cfg(64, 8, 16, 4));
    add(&mut s, 1, 3);
    let out = s.schedule();
    s.complete_step(&out);
    s.reserve_token(SeqId(1));
    s.reserve_token(SeqId(1));
    let seq = s.seq(SeqId(1)).expect("seq");
    assert_eq!((seq.num_tokens(), seq.known_tokens().len()), (5, 3));
    s.set_token(SeqId(1), 3, 9);
    assert_eq!(
        s.seq(SeqId(1)).expect("seq").known_tokens(),
        &[100, 101, 102, 9]
    );
    s.set_token(SeqId(1), 4, 8);
    let seq = s.seq(SeqId(1)).expect("seq");
    assert_eq!((seq.num_pending, seq.known_tokens().len()), (0, 5));
}

#[test]
fn positions_past_the_rotary_table_are_errors_when_the_batch_is_built() {
    let mut s = Scheduler::new(cfg(64, 8, 16, 4));
    add(&mut s, 1, 10);
    let o = s.schedule();
    assert!(crate::model_runner::ModelRunner::host_batch(&s, &o, 10).is_ok());
    let err = crate::model_runner::ModelRunner::host_batch(&s, &o, 9).expect_err("position 9");
    assert!(err.to_string().contains("position 9"), "{err}");
}

/// A sequence of request `id` using adapter `adapter` (a stand-in with no matrices).
fn add_with_adapter(s: &mut Scheduler, id: u64, prompt_len: usize, adapter: u32) {
    use crate::lora::{AdapterId, LoraAdapter, ResolvedLora};
    use crate::sequence::RequestMeta;
    let lora = ResolvedLora {
        id: AdapterId(adapter),
        adapter: std::sync::Arc::new(LoraAdapter::empty(&format!("a{adapter}"))),
    };
    let meta = RequestMeta {
        adapter: Some(lora),
        ..RequestMeta::default()
    };
    let prompt = vec![1; prompt_len];
    s.add(Sequence::new(SeqId(id), RequestId(id), prompt, 1).with_meta(std::sync::Arc::new(meta)));
}

#[test]
fn at_most_max_loras_adapters_run_and_later_sequences_of_running_ones_pass() {
    let mut c = cfg(100, 8, 64, 4);
    c.max_loras = 2;
    let mut s = Scheduler::new(c);
    add_with_adapter(&mut s, 1, 4, 10);
    add_with_adapter(&mut s, 2, 4, 20);
    add_with_adapter(&mut s, 3, 4, 30); // a third adapter: held back
    add_with_adapter(&mut s, 4, 4, 10); // passes it: adapter 10 runs
    add(&mut s, 5, 4); // no adapter: passes too
    let out = s.schedule();
    assert_eq!(
        plan(&out).iter().map(|p| p.0).collect::<Vec<_>>(),
        vec![1, 2, 4, 5]
    );
    finish_step(&mut s, &out);
    // 3 waits until an adapter's sequences are all done
    let out = s.schedule();
    assert_eq!(out.scheduled.len(), 4);
    finish_step(&mut s, &out);
    s.finish(SeqId(2));
    let out = s.schedule();
    assert!(out.scheduled.iter().any(|x| x.seq_id == SeqId(3)));
    finish_step(&mut s, &out);
}

#[test]
fn a_sequence_held_back_by_the_adapter_limit_is_not_starved() {
    let mut c = cfg(1000, 64, 512, 4);
    c.max_loras = 1;
    let mut s = Scheduler::new(c);
    add_with_adapter(&mut s, 1, 4, 10);
    add_with_adapter(&mut s, 2, 4, 20);
    let mut admitted_2 = false;
    let mut started: Vec<(SeqId, usize)> = Vec::new();
    for step in 0..(LORA_PASS_STEPS + 40) {
        // a steady stream of requests for the running adapter, each running for two steps, so
        // that adapter never stops running
        add_with_adapter(&mut s, 3 + step as u64, 4, 10);
        let out = s.schedule();
        if out.scheduled.iter().any(|x| x.seq_id == SeqId(2)) {
            admitted_2 = true;
            assert!(step >= LORA_PASS_STEPS, "admitted at step {step}");
            break;
        }
        finish_step(&mut s, &out);
        for x in &out.scheduled {
            if !started.iter().any(|(id, _)| *id == x.seq_id) {
                started.push((x.seq_id, step));
            }
        }
        for &(id, at) in &started {
            if at + 1 == step {
                s.finish(id);
            }
        }
    }
    assert!(admitted_2, "the held-back sequence never ran");
}

/// A sequence of request `id` with the given prompt and request facts.
pub(super) fn add_tokens(
    s: &mut Scheduler,
    id: u64,
    prompt: &[u32],
    meta: crate::sequence::RequestMeta,
) {
    let seq = Sequence::new(SeqId(id), RequestId(id), prompt.to_vec(), 1);
    s.add(seq.with_meta(std::sync::Arc::new(meta)));
}

fn caching(budget: usize, blocks: usize, bs: usize) -> Scheduler {
    let mut c = cfg(budget, 8, blocks, bs);
    c.enable_prefix_caching = true;
    Scheduler::new(c)
}

#[test]
fn a_shared_prefix_is_computed_once() {
    use crate::sequence::RequestMeta;
    let mut s = caching(100, 32, 4);
    let prompt: Vec<u32> = (1..=10).collect();
    add_tokens(&mut s, 1, &prompt, RequestMeta::default());
    let o = s.schedule();
    assert_eq!(plan(&o), vec![(1, 0, 10, true)]);
    finish_step(&mut s, &o);
    // the same prompt: its two full blocks are cached, the partial third is computed
    add_tokens(&mut s, 2, &prompt, RequestMeta::default());
    // a longer prompt sharing the first block only
    let mut other = prompt[..4].to_vec();
    other.extend([50, 51, 52, 53, 54]);
    add_tokens(&mut s, 3, &other, RequestMeta::default());
    let o = s.schedule();
    assert_eq!(
        plan(&o),
        vec![(1, 10, 1, true), (2, 8, 2, true), (3, 4, 5, true)]
    );
    let t1 = s.kv().block_table(SeqId(1)).to_vec();
    assert_eq!(s.kv().block_table(SeqId(2))[..2], t1[..2]);
    assert_eq!(s.kv().block_table(SeqId(3))[0], t1[0]);
    assert_ne!(s.kv().block_table(SeqId(3))[1], t1[1]);
    assert_eq!(s.seq(SeqId(2)).and_then(|q| q.num_cached_tokens), Some(8));
    assert_eq!(s.seq(SeqId(3)).and_then(|q| q.num_cached_tokens), Some(4));
    let counts = s.prefix_cache_counts();
    assert_eq!((counts.queries, counts.hits), (10 + 10 + 9, 12));
    finish_step(&mut s, &o);
    // finished sequences leave their blocks cached: a later request still hits them
    for id in 1..=3 {
        s.finish(SeqId(id));
    }
    assert_eq!(s.kv().num_free_blocks(), 32);
    add_tokens(&mut s, 4, &prompt, RequestMeta::default());
    let o = s.schedule();
    assert_eq!(plan(&o), vec![(4, 8, 2, true)]);
    finish_step(&mut s, &o);
}

#[test]
fn sequences_admitted_in_one_step_share_the_blocks_it_computes() {
    use crate::sequence::RequestMeta;
    let mut s = caching(100, 32, 4);
    let prompt: Vec<u32> = (1..=10).collect();
    let mut other = prompt[..6].to_vec();
    other.extend([50, 51, 52]);
    add_tokens(&mut s, 1, &prompt, RequestMeta::default());
    add_tokens(&mut s, 2, &prompt, RequestMeta::default());
    add_tokens(&mut s, 3, &other, RequestMeta::default());
    let o = s.schedule();
    // 1 computes the blocks; 2 and 3, admitted after it in the same step, start from them
    assert_eq!(
        plan(&o),
        vec![(1, 0, 10, true), (2, 8, 2, true), (3, 4, 5, true)]
    );
    let t1 = s.kv().block_table(SeqId(1)).to_vec();
    assert_eq!(s.kv().block_table(SeqId(2))[..2], t1[..2]);
    assert_eq!(s.kv().block_table(SeqId(3))[0], t1[0]);
    assert_ne!(s.kv().block_table(SeqId(3))[1], t1[1]);
    let counts = s.prefix_cache_counts();
    assert_eq!((counts.queries, counts.hits), (10 + 10 + 9, 8 + 4));
    finish_step(&mut s, &o);
    // a prompt split over steps: the next step starts from the blocks its first chunk filled
    let mut s = caching(6, 32, 4);
    add_tokens(&mut s, 1, &prompt, RequestMeta::default());
    let o = s.schedule();
    assert_eq!(plan(&o), vec![(1, 0, 6, false)]);
    finish_step(&mut s, &o);
    add_tokens(&mut s, 2, &prompt, RequestMeta::default());
    let o = s.schedule();
    // 1's second chunk fills its second block in this step: 2 starts from both
    assert_eq!(plan(&o), vec![(1, 6, 4, true), (2, 8, 2, true)]);
    finish_step(&mut s, &o);
}

#[test]
fn counters_count_only_sequences_that_look_their_prompt_up() {
    use crate::sequence::RequestMeta;
    let prompt: Vec<u32> = (1..=10).collect();
    let mut off = Scheduler::new(cfg(100, 8, 32, 4));
    add_tokens(&mut off, 1, &prompt, RequestMeta::default());
    let o = off.schedule();
    finish_step(&mut off, &o);
    assert_eq!(off.prefix_cache_counts(), PrefixCacheCounts::default());
    let mut s = caching(100, 32, 4);
    add_tokens(
        &mut s,
        1,
        &prompt,
        RequestMeta {
            prompt_logprobs: Some(1),
            ..RequestMeta::default()
        },
    );
    let o = s.schedule();
    finish_step(&mut s, &o);
    assert_eq!(s.prefix_cache_counts(), PrefixCacheCounts::default());
}

#[test]
fn a_fully_cached_prompt_computes_its_last_token_again() {
    use crate::sequence::RequestMeta;
    let mut s = caching(100, 32, 4);
    let prompt: Vec<u32> = (1..=8).collect();
    add_tokens(&mut s, 1, &prompt, RequestMeta::default());
    let o = s.schedule();
    finish_step(&mut s, &o);
    add_tokens(&mut s, 2, &prompt, RequestMeta::default());
    let o = s.schedule();
    // both blocks are cached, but the last token needs its logits: the second block is
    // recomputed into a block of its own
    assert_eq!(plan(&o), vec![(1, 8, 1, true), (2, 4, 4, true)]);
    let (t1, t2) = (s.kv().block_table(SeqId(1)), s.kv().block_table(SeqId(2)));
    assert_eq!(t1[0], t2[0]);
    assert_ne!(t1[1], t2[1]);
    finish_step(&mut s, &o);
}

#[test]
fn other_adapters_salts_and_prompt_logprobs_do_not_hit() {
    use crate::lora::{AdapterId, LoraAdapter, ResolvedLora};
    use crate::sequence::RequestMeta;
    let mut s = caching(100, 64, 4);
    let prompt: Vec<u32> = (1..=9).collect();
    let adapter = |id: u32| {
        Some(ResolvedLora {
            id: AdapterId(id),
            adapter: std::sync::Arc::new(LoraAdapter::empty("a")),
        })
    };
    let salted = |salt: &str| RequestMeta {
        cache_salt: Some(salt.into()),
        ..RequestMeta::default()
    };
    add_tokens(&mut s, 1, &prompt, RequestMeta::default());
    add_tokens(
        &mut s,
        2,
        &prompt,
        RequestMeta {
            adapter: adapter(1),
            ..RequestMeta::default()
        },
    );
    add_tokens(&mut s, 3, &prompt, salted("tenant-a"));
    let o = s.schedule();
    finish_step(&mut s, &o);
    let metas = [
        RequestMeta {
            adapter: adapter(2),
            ..RequestMeta::default()
        },
        salted("tenant-b"),
        RequestMeta {
            prompt_logprobs: Some(1),
            ..RequestMeta::default()
        },
        // the same adapter and the same salt do hit
        RequestMeta {
            adapter: adapter(1),
            ..RequestMeta::default()
        },
        salted("tenant-a"),
    ];
    for (i, m) in metas.into_iter().enumerate() {
        add_tokens(&mut s, 10 + i as u64, &prompt, m);
    }
    let o = s.schedule();
    let new: Vec<_> = plan(&o).into_iter().filter(|p| p.0 >= 10).collect();
    assert_eq!(
        new,
        vec![
            (10, 0, 9, true),
            (11, 0, 9, true),
            (12, 0, 9, true),
            (13, 8, 1, true),
            (14, 8, 1, true)
        ]
    );
    finish_step(&mut s, &o);
}

#[test]
fn a_preempted_sequence_resumes_from_its_cached_blocks() {
    use crate::sequence::RequestMeta;
    // 6 blocks of 4: two sequences of 12 tokens fill them, the second is preempted on growth
    let mut s = caching(100, 6, 4);
    let a: Vec<u32> = (1..=12).collect();
    let b: Vec<u32> = (101..=111).collect();
    add_tokens(&mut s, 1, &a, RequestMeta::default());
    add_tokens(&mut s, 2, &b, RequestMeta::default());
    let o = s.schedule();
    assert_eq!(plan(&o), vec![(1, 0, 12, true), (2, 0, 11, true)]);
    finish_step(&mut s, &o);
    let o = s.schedule();
    // 1 needs a fourth block: 2 is preempted, its blocks stay cached
    assert_eq!(o.preempted, vec![SeqId(2)]);
    finish_step(&mut s, &o);
    s.finish(SeqId(1));
    let o = s.schedule();
    // 2 had 12 tokens (11 + the one it sampled): two full blocks of them are found again
    assert_eq!(plan(&o), vec![(2, 8, 4, true)]);
    finish_step(&mut s, &o);
}
