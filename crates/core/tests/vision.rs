//! Qwen2.5-VL, Qwen2-VL and LLaVA parity with transformers (`tests/fixtures/make_vl_models.py`):
//! the prompt rserve builds from a conversation with images (chat template, tokenizer,
//! placeholder expansion) equals the processor's `input_ids`, the M-RoPE positions equal
//! `get_rope_index`'s, the encoder's features match, and greedy decoding gives the same tokens
//! with logprobs within 1e-4, for prompts with 0, 1 and 2 images alone, together, and prefilled in
//! chunks that end inside images.

mod common;

use common::*;
use rserve_core::multimodal::{MmPrompt, Processor};
use rserve_core::{EngineHandle, EngineRequest, SamplingParams};
use serde::Deserialize;
use std::sync::Arc;

const MODELS: [&str; 3] = ["qwen2_5_vl", "qwen2_vl", "llava"];

#[derive(Deserialize)]
struct VlGolden {
    cases: Vec<VlCase>,
}

#[derive(Deserialize)]
struct VlCase {
    name: String,
    images: Vec<String>,
    text: String,
    rendered: String,
    input_ids: Vec<u32>,
    #[serde(default)]
    positions: Option<Vec<Vec<u32>>>,
    #[serde(default)]
    rope_delta: Option<i64>,
    #[serde(default)]
    image0_features: Option<Vec<f32>>,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
}

fn load_golden(name: &str) -> VlGolden {
    let p = repo()
        .join("tests/fixtures/goldens")
        .join(format!("{name}.json"));
    let text = std::fs::read_to_string(&p).expect("golden");
    serde_json::from_str(&text).expect("golden parses")
}

fn messages(c: &VlCase) -> Vec<serde_json::Value> {
    let content = if c.images.is_empty() {
        serde_json::json!(c.text)
    } else {
        let mut parts: Vec<serde_json::Value> = c
            .images
            .iter()
            .map(|_| serde_json::json!({"type": "image"}))
            .collect();
        parts.push(serde_json::json!({"type": "text", "text": c.text}));
        serde_json::Value::Array(parts)
    };
    vec![serde_json::json!({"role": "user", "content": content})]
}

/// The prompt ids and images of a case, built the way an edge builds them.
fn prompt(h: &EngineHandle, c: &VlCase) -> (Vec<u32>, Option<Arc<MmPrompt>>) {
    let info = h.info();
    let tpl = info.chat_template.as_ref().expect("chat template");
    let text = tpl.render(&messages(c), true, None, None).expect("renders");
    assert_eq!(text, c.rendered, "{}: rendered prompt", c.name);
    let ids = info.tokenizer.encode(&text, false).expect("tokenizes");
    let proc: &Processor = info.processor.as_deref().expect("a vision model");
    let images = c
        .images
        .iter()
        .map(|n| {
            let bytes = std::fs::read(repo().join(format!("tests/fixtures/vision/{n}.png")))
                .expect("image");
            proc.decode(&bytes).expect("decodes")
        })
        .collect();
    let (ids, mm) = proc.expand(&ids, images).expect("expands");
    let mm = (!mm.images.is_empty()).then(|| Arc::new(mm));
    (ids, mm)
}

fn request(ids: Vec<u32>, mm: Option<Arc<MmPrompt>>, n: usize) -> EngineRequest {
    let mut p = SamplingParams::greedy(n);
    p.ignore_eos = true;
    p.logprobs = Some(1);
    EngineRequest {
        prompt_token_ids: ids,
        params: p,
        lora: None,
        cache_salt: None,
        mm,
    }
}

fn check(h: &EngineHandle, g: &VlGolden, with_text_only: bool) {
    let tol = tolerance();
    let mut streams = Vec::new();
    for c in &g.cases {
        let (ids, mm) = prompt(h, c);
        streams.push(h.submit(request(ids, mm, c.tokens.len())).expect("submit"));
        if with_text_only {
            // a text-only request between the image ones
            let ids: Vec<u32> = (20..60).collect();
            streams.push(h.submit(request(ids, None, 4)).expect("submit"));
        }
    }
    let mut outs = streams.into_iter().map(|s| s.wait().expect("completes"));
    for c in &g.cases {
        let out = outs.next().expect("an output");
        let o = &out.outputs[0];
        assert_eq!(o.token_ids, c.tokens, "{}", c.name);
        let lps = o.logprobs.as_ref().expect("logprobs");
        for (i, (got, want)) in lps.iter().zip(&c.logprobs).enumerate() {
            assert!(
                (got.logprob - want).abs() < tol,
                "{} step {i}: {} vs {want}",
                c.name,
                got.logprob
            );
        }
        assert_eq!(out.prompt_token_ids.len(), c.input_ids.len(), "{}", c.name);
        if with_text_only {
            outs.next().expect("the text-only output");
        }
    }
    assert_sound(h);
}

#[test]
fn prompts_and_positions_match_the_processor() {
    for name in MODELS {
        let g = load_golden(name);
        let h = start(name, |_| {});
        for c in &g.cases {
            let (ids, mm) = prompt(&h, c);
            assert_eq!(ids, c.input_ids, "{name} {}: input_ids", c.name);
            let Some(mm) = mm else {
                assert!(c.images.is_empty());
                continue;
            };
            match (&mm.mrope, &c.positions) {
                (Some(pos), Some(want)) => {
                    assert_eq!(
                        [&pos.t, &pos.h, &pos.w],
                        [&want[0], &want[1], &want[2]],
                        "{}",
                        c.name
                    );
                    assert_eq!(Some(pos.delta), c.rope_delta, "{}", c.name);
                }
                (None, None) => {}
                other => panic!("{name} {}: positions {other:?}", c.name),
            }
        }
    }
}

#[test]
fn greedy_decoding_matches_transformers_alone_and_mixed_with_text() {
    for name in MODELS {
        let g = load_golden(name);
        let h = start(name, |_| {});
        for c in &g.cases {
            let (ids, mm) = prompt(&h, c);
            let out = h
                .submit(request(ids, mm, c.tokens.len()))
                .expect("submit")
                .wait()
                .expect("completes");
            assert_eq!(
                out.outputs[0].token_ids, c.tokens,
                "{name} {} alone",
                c.name
            );
        }
        check(&h, &g, true);
    }
}

#[test]
fn chunked_prefill_splits_images_and_keeps_their_encodings() {
    for name in MODELS {
        let g = load_golden(name);
        // chunks of 7 tokens end inside every image of the goldens
        let h = start(name, |cfg| {
            cfg.max_num_batched_tokens = Some(7);
            cfg.enable_prefix_caching = false;
        });
        check(&h, &g, false);
        // each image once, though its tokens span several chunks
        let images: usize = g.cases.iter().map(|c| c.images.len()).sum();
        let encoded = h
            .stats()
            .images_encoded
            .load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(encoded, images as u64, "{name}");
    }
}

#[test]
fn the_encoders_match_transformers_features() {
    for name in MODELS {
        let g = load_golden(name);
        let h = start(name, |_| {});
        let c = g
            .cases
            .iter()
            .find(|c| c.image0_features.is_some())
            .expect("a case");
        let (_, mm) = prompt(&h, c);
        let mm = mm.expect("images");
        let want = c.image0_features.as_ref().expect("features");
        let got = h
            .encode_images(vec![mm.images[0].clone()])
            .expect("encodes");
        assert_eq!(got[0].len(), want.len(), "{name}");
        let worst = got[0]
            .iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-4, "{name}: largest feature difference {worst}");
    }
}

/// The blank batch the GPU start profiles the encoder with (at the encoder budget) is one the
/// encoders take: one near-square Qwen2-VL image, or as many CLIP crops as fit.
#[test]
fn the_encoders_take_their_profile_batch() {
    for name in MODELS {
        let h = start(name, |_| {});
        let proc = h.info().processor.clone().expect("processor");
        let hidden = h.info().model_config.hidden_size;
        let per = proc.max_image_tokens();
        assert!(per > 0, "{name}");
        for tokens in [1, 45, 3 * per] {
            let images = proc.profile_images(tokens);
            let total: usize = images.iter().map(|i| i.num_tokens).sum();
            assert!(
                !images.is_empty() && total <= tokens.max(per),
                "{name}: {total} for {tokens}"
            );
            let feats = h
                .encode_images(images.iter().cloned().map(Arc::new).collect())
                .expect("encodes");
            for (f, img) in feats.iter().zip(&images) {
                assert_eq!(f.len(), img.num_tokens * hidden, "{name}");
            }
        }
    }
}

#[test]
fn the_prefix_cache_keys_blocks_by_image_content() {
    let g = load_golden("qwen2_5_vl");
    let h = start("qwen2_5_vl", |cfg| cfg.block_size = 4);
    let c = g
        .cases
        .iter()
        .find(|c| c.name == "one_image")
        .expect("a case");
    let (ids, mm) = prompt(&h, c);
    let span = mm.as_ref().expect("images").spans[0];
    let run = |mm: Option<Arc<MmPrompt>>, n: usize| {
        h.submit(request(ids.clone(), mm, n))
            .expect("submit")
            .wait()
            .expect("completes")
    };
    let first = run(mm.clone(), c.tokens.len());
    let again = run(mm.clone(), c.tokens.len());
    assert_eq!(first.outputs[0].token_ids, c.tokens);
    assert_eq!(again.outputs[0].token_ids, c.tokens);
    // the same image again: every full block of the prompt is cached
    let cached = again.num_cached_tokens.unwrap_or(0);
    assert!(
        cached + 4 > ids.len() - 1,
        "{cached} of {} cached",
        ids.len()
    );
    // another image of the same size in the same place: only the blocks before it are shared
    let proc = h.info().processor.clone().expect("processor");
    let other = std::fs::read(repo().join("tests/fixtures/vision/grey_64x64.png")).expect("image");
    let img = proc.decode(&other).expect("image");
    assert_eq!(img.num_tokens, span.len, "a same-size image");
    let text = h.info().tokenizer.encode(&c.rendered, false).expect("ids");
    let (ids2, mm2) = proc.expand(&text, vec![img]).expect("expands");
    assert_eq!(ids2, ids, "the same token ids");
    let out = run(Some(Arc::new(mm2)), 2);
    let shared = out.num_cached_tokens.unwrap_or(0);
    assert!(
        shared <= span.offset,
        "{shared} cached tokens reach into the image at {}",
        span.offset
    );
    assert_sound(&h);
}

#[test]
fn images_that_do_not_match_their_placeholders_are_refused() {
    let g = load_golden("qwen2_5_vl");
    let h = start("qwen2_5_vl", |_| {});
    let c = g
        .cases
        .iter()
        .find(|c| c.images.len() == 1)
        .expect("a case");
    let (mut ids, mm) = prompt(&h, c);
    let span = mm.as_ref().expect("images").spans[0];
    ids[span.offset] = 5; // a placeholder overwritten
    let err = h.submit(request(ids, mm, 2)).err().expect("refused");
    assert!(err.to_string().contains("placeholder"), "{err}");
    // more images than placeholders
    let proc = h.info().processor.clone().expect("processor");
    let (ids, _) = prompt(&h, c);
    let bytes = std::fs::read(repo().join("tests/fixtures/vision/rgb_50x70.png")).expect("image");
    let imgs = vec![
        proc.decode(&bytes).expect("image"),
        proc.decode(&bytes).expect("image"),
    ];
    let err = proc
        .expand(&ids, imgs)
        .expect_err("two images, one placeholder");
    assert!(err.to_string().contains("placeholders"), "{err}");
}

#[test]
fn a_text_model_refuses_images() {
    let vl = start("qwen2_5_vl", |_| {});
    let g = load_golden("qwen2_5_vl");
    let c = g
        .cases
        .iter()
        .find(|c| c.images.len() == 1)
        .expect("a case");
    let (ids, mm) = prompt(&vl, c);
    let text = start("qwen2", |_| {});
    assert!(text.info().processor.is_none());
    let ids: Vec<u32> = ids.into_iter().map(|t| t.min(900)).collect();
    let err = text.submit(request(ids, mm, 2)).err().expect("refused");
    assert!(err.to_string().contains("does not take images"), "{err}");
}

/// Pixels staged in 16 bits are the bits the device's own conversion of the f32 values gives
/// (round to nearest, ties to even), across parts that end inside and past staging buffers; the
/// encoder's index tables staged as u32 arrive unchanged.
#[cfg(feature = "cuda")]
#[test]
fn staged_pixels_round_as_the_device_does() {
    use candle_core::{DType, Device, Tensor};
    if test_device() != "cuda" {
        return;
    }
    let Ok(Device::Cuda(cuda)) = Device::new_cuda(0) else {
        panic!("a CUDA device");
    };
    let dev = Device::Cuda(cuda.clone());
    // bf16 ties (the dropped half exactly 0x8000), signed zeros, subnormals, the largest
    // finite values, infinities, then seeded values over the pixel range and beyond
    let mut special: Vec<f32> = vec![0.0, -0.0, 1e-40, -1e-40, f32::MAX, f32::MIN, f32::INFINITY];
    special.extend((0..64u32).map(|i| f32::from_bits(0x3f80_8000 + (i << 16))));
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0
    };
    // 13 M values a buffer of bf16 holds 16 M of: parts end inside buffers and span them
    let parts: Vec<Vec<f32>> = [special.len(), 5_000_001, 9_000_000, 1, 3_333_333]
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            if i == 0 {
                special.clone()
            } else {
                (0..n).map(|_| next()).collect()
            }
        })
        .collect();
    let refs: Vec<&[f32]> = parts.iter().map(Vec::as_slice).collect();
    let all: Vec<f32> = parts.concat();
    let mut staging = rserve_core::staging::Staging::new(&cuda).expect("staging");
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let got = staging
            .upload_f32_as(&cuda, &refs, &[all.len()], dtype)
            .expect("upload");
        let want = Tensor::from_slice(&all, all.len(), &dev)
            .and_then(|t| t.to_dtype(dtype))
            .expect("device conversion");
        let bits = |t: &Tensor| -> Vec<u32> {
            t.to_dtype(DType::F32)
                .and_then(|t| t.to_vec1::<f32>())
                .expect("read back")
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        assert_eq!(got.dtype(), dtype);
        assert!(bits(&got) == bits(&want), "{dtype:?} staged values differ");
    }
    let table: Vec<u32> = (0..300_000u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    let got = staging
        .upload_values(&cuda, &[&table], &[table.len()])
        .and_then(|t| t.to_vec1::<u32>())
        .expect("u32 upload");
    assert!(got == table);
}
