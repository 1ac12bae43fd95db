//! The vision encoder's budget: images a step encodes fit `max_num_encoder_tokens` (the step's
//! first image always runs), chunks are cut before the image that would pass it, and an image a
//! prefix-cache hit starts inside is counted when its sequence is admitted.

use super::tests::{add, add_tokens, cfg, finish_step, plan};
use super::*;
use crate::multimodal::{ImageInput, ImageSpan, MmPrompt};
use crate::sequence::RequestMeta;
use std::sync::Arc;

/// A sequence of request `id` whose prompt holds images at `spans` (offset, length); every image
/// is the same blank one (equal content hashes).
fn add_images(s: &mut Scheduler, id: u64, prompt: Vec<u32>, spans: &[(usize, usize)]) {
    add_images_with(s, id, prompt, spans, RequestMeta::default());
}

/// [`add_images`] with more request facts.
fn add_images_with(
    s: &mut Scheduler,
    id: u64,
    prompt: Vec<u32>,
    spans: &[(usize, usize)],
    meta: RequestMeta,
) {
    let image = |len: usize| {
        Arc::new(ImageInput {
            pixels: Vec::new(),
            shape: [0, 0],
            grid_thw: [1, 1, 1],
            num_tokens: len,
            hash: [0; 32],
        })
    };
    let mm = MmPrompt {
        images: spans.iter().map(|&(_, len)| image(len)).collect(),
        spans: spans
            .iter()
            .map(|&(offset, len)| ImageSpan { offset, len })
            .collect(),
        mrope: None,
    };
    let meta = RequestMeta {
        mm: Some(Arc::new(mm)),
        ..meta
    };
    add_tokens(s, id, &prompt, meta);
}

fn prompt(id: u64, len: usize) -> Vec<u32> {
    (0..len as u32).map(|t| t + 1000 * id as u32).collect()
}

fn with_encoder(budget: usize, encoder: usize, caching: bool) -> Scheduler {
    let mut c = cfg(budget, 8, 64, 4);
    c.max_num_encoder_tokens = encoder;
    c.enable_prefix_caching = caching;
    Scheduler::new(c)
}

#[test]
fn an_image_past_the_budget_waits_for_the_next_step() {
    let mut s = with_encoder(100, 10, false);
    add_images(&mut s, 1, prompt(1, 20), &[(2, 8)]);
    add_images(&mut s, 2, prompt(2, 20), &[(5, 8)]);
    add(&mut s, 3, 6); // text only: never held back by the encoder
    let o = s.schedule();
    // 8 + 8 image tokens pass 10: the second request stops before its image; the third, with
    // no image, is admitted after it
    assert_eq!(
        plan(&o),
        vec![(1, 0, 20, true), (2, 0, 5, false), (3, 0, 6, true)]
    );
    finish_step(&mut s, &o);
    let o = s.schedule();
    assert_eq!(
        plan(&o),
        vec![(1, 20, 1, true), (2, 5, 15, true), (3, 6, 1, true)]
    );
    finish_step(&mut s, &o);
}

#[test]
fn the_steps_first_image_runs_even_past_the_budget() {
    let mut s = with_encoder(100, 4, false);
    add_images(&mut s, 1, prompt(1, 12), &[(0, 8)]);
    add_images(&mut s, 2, prompt(2, 12), &[(3, 2)]);
    let o = s.schedule();
    assert_eq!(plan(&o), vec![(1, 0, 12, true), (2, 0, 3, false)]);
    finish_step(&mut s, &o);
    let o = s.schedule();
    assert_eq!(plan(&o), vec![(1, 12, 1, true), (2, 3, 9, true)]);
    finish_step(&mut s, &o);
}

#[test]
fn a_running_chunk_is_cut_before_an_image_and_a_started_one_is_not_counted_again() {
    let mut s = with_encoder(12, 6, false);
    // a chunk of 12 tokens would start both images (4 + 4 > 6): it ends before the second
    add_images(&mut s, 1, prompt(1, 30), &[(2, 4), (7, 4), (14, 16)]);
    let o = s.schedule();
    assert_eq!(plan(&o), vec![(1, 0, 7, false)]);
    finish_step(&mut s, &o);
    // [7, 19): the second image (4) starts here; the third (16) would pass the budget
    let o = s.schedule();
    assert_eq!(plan(&o), vec![(1, 7, 7, false)]);
    finish_step(&mut s, &o);
    let o = s.schedule();
    assert_eq!(plan(&o), vec![(1, 14, 12, false)]);
    finish_step(&mut s, &o);
    // the third image, past the budget alone, ran as its step's first; the rest of it costs
    // the encoder nothing, so the next request's image fits beside it
    add_images(&mut s, 2, prompt(2, 8), &[(1, 6)]);
    let o = s.schedule();
    assert_eq!(plan(&o), vec![(1, 26, 4, true), (2, 0, 8, true)]);
    finish_step(&mut s, &o);
}

#[test]
fn a_prefix_hit_inside_an_image_counts_the_image() {
    let mut s = with_encoder(100, 8, true);
    let p = prompt(1, 12);
    add_images(&mut s, 1, p.clone(), &[(2, 8)]);
    let o = s.schedule();
    assert_eq!(plan(&o), vec![(1, 0, 12, true)]);
    finish_step(&mut s, &o);
    s.finish(SeqId(1));
    // the same prompt and image: blocks [0, 8) are cached, so the chunk starts inside the
    // image, which must be encoded again; a third request's image then waits
    add_images(&mut s, 2, p, &[(2, 8)]);
    add_images(&mut s, 3, prompt(3, 12), &[(4, 8)]);
    let o = s.schedule();
    assert_eq!(plan(&o), vec![(2, 8, 4, true), (3, 0, 4, false)]);
    finish_step(&mut s, &o);
}

#[test]
fn a_chunk_cut_by_its_prompt_logprob_rows_takes_no_encoder_budget_for_what_it_left() {
    let mut c = cfg(100, 8, 64, 4);
    c.max_num_encoder_tokens = 8;
    c.max_prompt_logprob_rows = 3;
    let mut s = Scheduler::new(c);
    // three rows cut the first chunk to three tokens, before its image: the second request's
    // image has the whole encoder budget
    let logprobs = RequestMeta {
        prompt_logprobs: Some(1),
        ..RequestMeta::default()
    };
    add_images_with(&mut s, 1, prompt(1, 20), &[(10, 8)], logprobs);
    add_images(&mut s, 2, prompt(2, 20), &[(2, 8)]);
    let o = s.schedule();
    assert_eq!(plan(&o), vec![(1, 0, 3, false), (2, 0, 20, true)]);
    finish_step(&mut s, &o);
}
