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

/// The logits of a prompt's rows and of the decode step after it.
type Logits = (Vec<Vec<f32>>, Vec<Vec<f32>>);
const PROMPT: [u32; 11] = [1, 17, 204, 999, 3, 512, 77, 8, 640, 41, 250];

/// A step of `ids` at positions `start..` of one sequence in blocks 0.., every row a logit row.
fn batch(ids: &[u32], start: usize, dev: &Device) -> candle_core::Result<ForwardBatch> {
    let t = ids.len();
    let end = start + t;
    let blocks = end.div_ceil(BLOCK);
    Ok(ForwardBatch {
        input_ids: Tensor::new(ids, dev)?,
        positions: Tensor::from_vec((start as u32..end as u32).collect(), t, dev)?,
        logits_indices: Tensor::from_vec((0..t as u32).collect(), t, dev)?,
        attn: Arc::new(AttentionMetadata::new(
            (start as i64..end as i64).collect(),
            (0..blocks as u32).collect(),
            blocks,
            vec![end as u32],
            vec![0, t as u32],
            dev,
        )?),
        adapter_slots: None,
        adapter_slots_covered: 0,
        adapter_runs: Vec::new(),
        adapter_listed: None,
        image_rows: Vec::new(),
        mrope_positions: None,
    })
}

/// The logits of the prompt's rows, then of one decode step (its greedy next token).
fn run(model: &dyn Model, dev: &Device) -> candle_core::Result<Logits> {
    let mc = model.config();
    let kv = KvCache::new(
        mc.num_layers,
        4,
        BLOCK,
        model.cache_kv_heads(),
        mc.head_dim,
        DType::F32,
        dev,
    )?;
    let prefill = model.forward(&batch(&PROMPT, 0, dev)?, &kv)?;
    let next = prefill
        .get(PROMPT.len() - 1)?
        .argmax(0)?
        .to_scalar::<u32>()?;
    let decode = model.forward(&batch(&[next], PROMPT.len(), dev)?, &kv)?;
    Ok((prefill.to_vec2()?, decode.to_vec2()?))
}

fn opts() -> LoadOptions {
    LoadOptions {
        max_positions: Some(64),
        ..LoadOptions::new("float32")
    }
}

fn sharded(name: &str, world: usize) -> Vec<Logits> {
    sharded_with(name, world, opts())
}

fn sharded_with(name: &str, world: usize, base: LoadOptions) -> Vec<Logits> {
    let dir = fixture_model(name);
    let cfg =
        decoder_config(&rserve_core::loader::read_config(&dir).expect("config")).expect("cfg");
    let comms = LocalComm::group(world);
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let (dir, cfg, mut o) = (dir.clone(), cfg.clone(), base.clone());
            std::thread::spawn(move || {
                o.tp = Some(TpShard {
                    plan: TpPlan::new(&cfg, rank, world).expect("splits"),
                    comm: Arc::new(comm),
                });
                let loaded = load_model_with(&dir, &o, &Device::Cpu).expect("loads");
                run(loaded.model.as_ref(), &Device::Cpu).expect("runs")
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank"))
        .collect()
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
        let (want_prefill, want_decode) = run(whole.model.as_ref(), &Device::Cpu).expect("runs");
        assert_eq!(want_prefill[0].len(), whole.model.config().vocab_size);
        for world in [2, 4] {
            for (rank, (prefill, decode)) in sharded(name, world).iter().enumerate() {
                let (dp, dd) = (
                    max_diff(prefill, &want_prefill),
                    max_diff(decode, &want_decode),
                );
                assert!(
                    dp < 1e-4 && dd < 1e-4,
                    "{name} TP={world} rank {rank}: {dp} {dd}"
                );
            }
        }
    }
}

/// In-situ quantization on shards: each rank quantizes its own rows (and, for o and down, its own
/// columns, split on block boundaries), so the split model computes what the quantized whole
/// model does.
#[test]
fn quantized_shards_compute_the_quantized_models_logits() {
    use rserve_core::quant::IsqFormat;
    for (name, isq) in [
        ("llama3", IsqFormat::Q8_0),
        ("qwen2", IsqFormat::Q8_0),
        ("llama3", IsqFormat::Fp8),
    ] {
        let o = LoadOptions {
            isq: Some(isq),
            ..opts()
        };
        let whole = load_model_with(&fixture_model(name), &o, &Device::Cpu).expect("loads");
        let (want_p, want_d) = run(whole.model.as_ref(), &Device::Cpu).expect("runs");
        let exact = load_model_with(&fixture_model(name), &opts(), &Device::Cpu).expect("loads");
        let (f32_p, _) = run(exact.model.as_ref(), &Device::Cpu).expect("runs");
        let whole_err = max_diff(&want_p, &f32_p);
        for (rank, (p, d)) in sharded_with(name, 2, o).iter().enumerate() {
            if isq == IsqFormat::Fp8 {
                // fp8 scales each shard by its own values: another rounding of the weights, as
                // close to the unquantized model as the whole model's
                let err = max_diff(p, &f32_p);
                assert!(
                    err < 1.5 * whole_err + 0.02,
                    "{name} fp8 rank {rank}: {err} vs {whole_err}"
                );
                continue;
            }
            let (dp, dd) = (max_diff(p, &want_p), max_diff(d, &want_d));
            assert!(
                dp < 1e-3 && dd < 1e-3,
                "{name} {isq:?} rank {rank}: {dp} {dd}"
            );
        }
    }
}

#[test]
fn each_rank_holds_its_share() {
    let dir = fixture_model("llama3");
    let cfg =
        decoder_config(&rserve_core::loader::read_config(&dir).expect("config")).expect("cfg");
    // 4 query heads over 2 KV heads: 4 ranks replicate each KV head twice
    for (world, kv) in [(1, 2), (2, 1), (4, 1)] {
        let plan = TpPlan::new(&cfg, 0, world).expect("splits");
        assert_eq!(plan.local_kv_heads(), kv);
    }
    let e = TpPlan::new(&cfg, 0, 8).expect_err("8 ranks for 4 heads");
    assert!(e.contains("4 attention heads"), "{e}");
}

/// On GPUs (`RSERVE_TEST_DEVICE=cuda`): each fixture model split over every visible GPU (at most
/// 4; a group of one where there is one GPU, which still runs every collective through NCCL)
/// computes the whole model's logits, and the engine serves it with the same greedy tokens.
#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use rserve_core::parallel::nccl::{unique_id, NcclComm};

    fn gpus() -> usize {
        candle_core::cuda_backend::cudarc::driver::CudaContext::device_count()
            .map_or(0, |n| n.max(0) as usize)
    }

    fn on_gpus(name: &str, world: usize) -> Vec<Logits> {
        let dir = fixture_model(name);
        let cfg =
            decoder_config(&rserve_core::loader::read_config(&dir).expect("config")).expect("cfg");
        let id = unique_id().expect("NCCL id");
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (dir, cfg) = (dir.clone(), cfg.clone());
                std::thread::spawn(move || {
                    let dev =
                        rserve_core::device::parse_device(&format!("cuda:{rank}")).expect("GPU");
                    let Device::Cuda(d) = &dev else {
                        panic!("not CUDA")
                    };
                    let comm = NcclComm::join(d, rank, world, id).expect("NCCL");
                    let mut o = opts();
                    o.tp = Some(TpShard {
                        plan: TpPlan::new(&cfg, rank, world).expect("splits"),
                        comm: Arc::new(comm),
                    });
                    let loaded = load_model_with(&dir, &o, &dev).expect("loads");
                    run(loaded.model.as_ref(), &dev).expect("runs")
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank"))
            .collect()
    }

    #[test]
    fn nccl_ranks_compute_the_whole_models_logits() {
        if common::test_device() != "cuda" {
            return;
        }
        let world = gpus().clamp(1, 4);
        let dev = rserve_core::device::parse_device("cuda:0").expect("GPU");
        for name in MODELS {
            let whole = load_model_with(&fixture_model(name), &opts(), &dev).expect("loads");
            let (want_p, want_d) = run(whole.model.as_ref(), &dev).expect("runs");
            for (rank, (p, d)) in on_gpus(name, world).iter().enumerate() {
                let (dp, dd) = (max_diff(p, &want_p), max_diff(d, &want_d));
                assert!(
                    dp < 1e-3 && dd < 1e-3,
                    "{name} TP={world} rank {rank}: {dp} {dd}"
                );
            }
        }
    }

    /// A decode step replayed from a CUDA graph, its collectives captured in it, gives the logits
    /// of the whole model's eager step.
    #[test]
    fn collectives_replay_in_decode_graphs() {
        use rserve_core::model_runner::graphs::GraphPlan;
        use rserve_core::model_runner::{HostBatch, ModelRunner, PreparedStep};
        if common::test_device() != "cuda" {
            return;
        }
        let dev = rserve_core::device::parse_device("cuda:0").expect("GPU");
        let Device::Cuda(d) = &dev else {
            panic!("not CUDA")
        };
        let name = "qwen2";
        let whole = load_model_with(&fixture_model(name), &opts(), &dev).expect("loads");
        let (_, want) = run(whole.model.as_ref(), &dev).expect("runs");
        let cfg = whole.model.config().clone();
        let comm = NcclComm::join(d, 0, 1, unique_id().expect("id")).expect("NCCL");
        let mut o = opts();
        o.tp = Some(TpShard {
            plan: TpPlan::new(&cfg, 0, 1).expect("plan"),
            comm: Arc::new(comm),
        });
        let model = load_model_with(&fixture_model(name), &o, &dev)
            .expect("loads")
            .model;
        let kv = KvCache::new(
            cfg.num_layers,
            4,
            BLOCK,
            model.cache_kv_heads(),
            cfg.head_dim,
            DType::F32,
            &dev,
        )
        .expect("kv");
        let mut runner = ModelRunner::new(
            model,
            kv,
            dev.clone(),
            Some(GraphPlan::new(4, 64, BLOCK)),
            Vec::new(),
        );
        assert!(runner.capture_graphs().expect("captures") > 0);
        let n = PROMPT.len();
        let host = |ids: Vec<u32>, start: usize| {
            let end = start + ids.len();
            HostBatch {
                positions: (start as u32..end as u32).collect(),
                slots: (start as i64..end as i64).collect(),
                block_tables: (0..4).collect(),
                width: 4,
                seq_lens: vec![end as u32],
                query_start_loc: vec![0, ids.len() as u32],
                logits_indices: vec![ids.len() as u32 - 1],
                input_ids: ids,
                ..HostBatch::default()
            }
        };
        let step = runner
            .prepare_host(host(PROMPT.to_vec(), 0), Vec::new())
            .expect("prepares");
        assert!(matches!(step, PreparedStep::Eager(_)));
        let last = runner.execute_after(&[], &step).expect("prefill");
        let next = last
            .get(0)
            .and_then(|r| r.argmax(0))
            .and_then(|t| t.to_scalar::<u32>())
            .expect("token");
        let step = runner
            .prepare_host(host(vec![next], n), Vec::new())
            .expect("prepares");
        assert!(matches!(step, PreparedStep::Graph { .. }), "{step:?}");
        let got = runner
            .execute_after(&[], &step)
            .expect("decode")
            .to_vec2::<f32>()
            .expect("logits");
        let diff = max_diff(&got, &want);
        assert!(diff < 1e-3, "graph replay with collectives: {diff}");
    }

    #[test]
    fn engine_greedy_tokens_match_one_gpu() {
        let world = gpus().min(4);
        if common::test_device() != "cuda" || world < 2 {
            return;
        }
        let prompt: Vec<u32> = PROMPT.to_vec();
        for name in MODELS {
            let mut outs = Vec::new();
            // async scheduling (the default) has rank 0 share the tokens it sampled on its GPU
            let runs = [
                (1, false, true),
                (world, false, true),
                (world, true, true),
                (world, false, false),
            ];
            for (tp, eager, ahead) in runs {
                let h = common::start(name, |c| {
                    c.dtype = "float32".into();
                    c.tensor_parallel_size = tp;
                    c.enforce_eager = eager;
                    c.async_scheduling = ahead;
                });
                let out = common::greedy(&h, &prompt, 24, 0);
                outs.push(out.outputs[0].token_ids.clone());
                h.shutdown();
            }
            assert_eq!(outs[0], outs[1], "{name}: TP={world} with graphs");
            assert_eq!(outs[0], outs[2], "{name}: TP={world} eager");
            assert_eq!(
                outs[0], outs[3],
                "{name}: TP={world} without async scheduling"
            );
        }
    }
}
