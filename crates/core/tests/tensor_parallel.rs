//! Tensor parallelism on the CPU: each fixture model split over 2 and 4 ranks (threads joined by
//! the in-process collective) computes the logits of the whole model, for a prompt and for a
//! decode step after it: shards read from the checkpoint, KV heads split or replicated, biases
//! added once, vocabulary-parallel embedding and head.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{fixture_model, MODELS};
use rserve_core::batch::ForwardBatch;
use rserve_core::kv_cache::KvCache;
use rserve_core::loader::{load_model_with, LoadOptions};
use rserve_core::models::{decoder_config, Model};
use rserve_core::parallel::local::LocalComm;
use rserve_core::parallel::{TpPlan, TpShard};
use rserve_kernels::AttentionMetadata;
use std::sync::Arc;

const BLOCK: usize = 16;
const PROMPT: [u32; 11] = [1, 17, 204, 999, 3, 512, 77, 8, 640, 41, 250];

/// A step of `ids` at positions `start..` of one sequence in blocks 0.., every row a logit row.
fn batch(ids: &[u32], start: usize) -> candle_core::Result<ForwardBatch> {
    let dev = Device::Cpu;
    let t = ids.len();
    let end = start + t;
    let blocks = end.div_ceil(BLOCK);
    Ok(ForwardBatch {
        input_ids: Tensor::new(ids, &dev)?,
        positions: Tensor::from_vec((start as u32..end as u32).collect(), t, &dev)?,
        logits_indices: Tensor::from_vec((0..t as u32).collect(), t, &dev)?,
        attn: Arc::new(AttentionMetadata::new(
            (start as i64..end as i64).collect(),
            (0..blocks as u32).collect(),
            blocks,
            vec![end as u32],
            vec![0, t as u32],
            &dev,
        )?),
        adapter_slots: None,
        adapter_runs: Vec::new(),
        image_rows: Vec::new(),
        mrope_positions: None,
    })
}

/// The logits of the prompt's rows, then of one decode step (its greedy next token).
fn run(model: &dyn Model) -> candle_core::Result<(Vec<Vec<f32>>, Vec<Vec<f32>>)> {
    let mc = model.config();
    let kv = KvCache::new(
        mc.num_layers,
        4,
        BLOCK,
        model.cache_kv_heads(),
        mc.head_dim,
        DType::F32,
        &Device::Cpu,
    )?;
    let prefill = model.forward(&batch(&PROMPT, 0)?, &kv)?;
    let next = prefill.get(PROMPT.len() - 1)?.argmax(0)?.to_scalar::<u32>()?;
    let decode = model.forward(&batch(&[next], PROMPT.len())?, &kv)?;
    Ok((prefill.to_vec2()?, decode.to_vec2()?))
}

fn opts() -> LoadOptions {
    LoadOptions {
        max_positions: Some(64),
        ..LoadOptions::new("float32")
    }
}

fn sharded(name: &str, world: usize) -> Vec<(Vec<Vec<f32>>, Vec<Vec<f32>>)> {
    let dir = fixture_model(name);
    let cfg = decoder_config(&rserve_core::loader::read_config(&dir).expect("config")).expect("cfg");
    let comms = LocalComm::group(world);
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let (dir, cfg) = (dir.clone(), cfg.clone());
            std::thread::spawn(move || {
                let mut o = opts();
                o.tp = Some(TpShard {
                    plan: TpPlan::new(&cfg, rank, world).expect("splits"),
                    comm: Arc::new(comm),
                });
                let loaded = load_model_with(&dir, &o, &Device::Cpu).expect("loads");
                run(loaded.model.as_ref()).expect("runs")
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank")).collect()
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f32::max)
}

#[test]
fn every_rank_computes_the_whole_models_logits() {
    for name in MODELS {
        let whole = load_model_with(&fixture_model(name), &opts(), &Device::Cpu).expect("loads");
        let (want_prefill, want_decode) = run(whole.model.as_ref()).expect("runs");
        assert_eq!(want_prefill[0].len(), whole.model.config().vocab_size);
        for world in [2, 4] {
            for (rank, (prefill, decode)) in sharded(name, world).iter().enumerate() {
                let (dp, dd) = (max_diff(prefill, &want_prefill), max_diff(decode, &want_decode));
                assert!(dp < 1e-4 && dd < 1e-4, "{name} TP={world} rank {rank}: {dp} {dd}");
            }
        }
    }
}

#[test]
fn each_rank_holds_its_share() {
    let dir = fixture_model("llama3");
    let cfg = decoder_config(&rserve_core::loader::read_config(&dir).expect("config")).expect("cfg");
    // 4 query heads over 2 KV heads: 4 ranks replicate each KV head twice
    for (world, kv) in [(1, 2), (2, 1), (4, 1)] {
        let plan = TpPlan::new(&cfg, 0, world).expect("splits");
        assert_eq!(plan.local_kv_heads(), kv);
    }
    let e = TpPlan::new(&cfg, 0, 8).expect_err("8 ranks for 4 heads");
    assert!(e.contains("4 attention heads"), "{e}");
}
