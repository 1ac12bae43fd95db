//! `rserve bench vision MODEL`: what an image costs a vision model. On the host, decoding a PNG
//! and preprocessing it (per image, one thread); on the device, the vision encoder over one image
//! and over a batch (timed to the features' return, so synchronized). With
//! `RSERVE_VISION_PROFILE=1` the encoder also logs where its time goes.

use crate::cli::BenchVisionArgs;
use anyhow::{Context, Result};
use rserve_core::multimodal::{encode_png, test_pattern, ImageInput};
use rserve_core::Engine;
use serde_json::json;
use std::sync::Arc;
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

pub fn run(args: BenchVisionArgs) -> Result<()> {
    let cfg = crate::engine_config(&args.engine)?;
    let engine = Engine::start(cfg).context("starting the engine")?;
    let proc = engine
        .info()
        .processor
        .clone()
        .context("the model takes no images")?;
    let iters = args.iters.max(1);
    let png = |side: usize, seed: u64| encode_png(&test_pattern(side, side, seed));
    // host: decode + preprocess
    let mut host = Vec::new();
    let mut one: Option<ImageInput> = None;
    for i in 0..iters {
        let bytes = png(args.size, i as u64)?;
        let t = Instant::now();
        let img = proc.decode(&bytes)?;
        host.push(t.elapsed().as_secs_f64() * 1e3);
        one = Some(img);
    }
    let one = Arc::new(one.context("an image")?);
    // device: one image, then a batch
    let mut single = Vec::new();
    for i in 0..=iters {
        let t = Instant::now();
        engine.encode_images(vec![one.clone()])?;
        if i > 0 {
            single.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    let batch: Vec<Arc<ImageInput>> = (0..args.batch)
        .map(|i| {
            Ok(Arc::new(
                proc.decode(&png(args.batch_size, 100 + i as u64)?)?,
            ))
        })
        .collect::<Result<_>>()?;
    let mut batched = Vec::new();
    for i in 0..=iters {
        let t = Instant::now();
        engine.encode_images(batch.clone())?;
        if i > 0 {
            batched.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    let report = json!({
        "image_px": args.size,
        "image_tokens": one.num_tokens,
        "patches": one.shape[0],
        "host_decode_preprocess_ms": median(host),
        "encode_one_ms": median(single),
        "batch": args.batch,
        "batch_px": args.batch_size,
        "encode_batch_ms": median(batched.clone()),
        "encode_batch_ms_per_image": median(batched) / args.batch.max(1) as f64,
    });
    if args.json {
        println!("{report}");
    } else {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    engine.shutdown();
    Ok(())
}
