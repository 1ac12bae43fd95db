//! Tensor parallelism on one host: one thread per GPU, each holding its shard of the weights and
//! of the KV cache; rank 0 is the engine (it schedules, samples and streams) and the other ranks
//! run the same steps ([`workers`]); NCCL adds the partial sums and gathers the logits, and a
//! kernel of rserve's own adds the decode steps' small partial sums over peer access ([`peer`],
//! [`Collective`]).
//!
//! [`plan`] says what each rank holds (pure arithmetic, tested on the CPU).

pub mod local;
#[cfg(feature = "cuda")]
pub mod nccl;
#[cfg(feature = "cuda")]
pub mod peer;
pub mod plan;
#[cfg(feature = "cuda")]
pub mod workers;

use crate::engine::{EngineConfig, EngineError};
use crate::loader::LoadOptions;
use crate::model_runner::graphs::GraphPlan;
use crate::model_runner::Followers;
use crate::models::DecoderConfig;
use candle_core::{DType, Device, Result, Tensor};
pub use plan::{Split, TpPlan};
use std::path::Path;
use std::sync::Arc;

/// Ranks 1..N as the engine drives them through its start, then as [`Followers`] of its steps.
pub trait TpGroup: Followers {
    /// Waits until every other rank has loaded its shard.
    fn wait_loaded(&self) -> std::result::Result<(), EngineError>;
    /// The KV blocks every rank has room for: the other ranks' profiling passes run beside rank
    /// 0's (`own`), whose collectives they meet; the fewest blocks any rank fits.
    fn kv_blocks(
        &self,
        cfg: &EngineConfig,
        batched_tokens: usize,
        max_model_len: usize,
        own: &mut dyn FnMut() -> std::result::Result<usize, EngineError>,
    ) -> std::result::Result<usize, EngineError>;
    /// Allocates the other ranks' KV caches of `num_blocks` blocks and their runners.
    fn allocate(
        &self,
        num_blocks: usize,
        block_size: usize,
        kv_dtype: DType,
        graphs: Option<GraphPlan>,
    ) -> std::result::Result<(), EngineError>;
}

/// Why a configuration cannot run over `cfg.tensor_parallel_size` GPUs, if it cannot: the
/// shape must split ([`TpPlan::new`]), the ranks take GPUs 0..N-1, and the features that do not
/// shard yet (GGUF files, LoRA adapters, vision models) are refused rather than run wrong. In-situ
/// quantization shards: each rank quantizes its own rows and columns.
pub fn refusal(
    cfg: &EngineConfig,
    model: &DecoderConfig,
    gguf: bool,
    vision: bool,
) -> Option<String> {
    let n = cfg.tensor_parallel_size;
    let not_yet = |what: &str| {
        Some(format!(
            "{what} does not run with --tensor-parallel-size {n} yet; serve it on one GPU"
        ))
    };
    if n == 0 {
        return Some("tensor_parallel_size must be at least 1".into());
    }
    if n == 1 {
        return None;
    }
    match cfg.device.as_str() {
        "auto" | "cuda" | "gpu" | "cuda:0" => {}
        "cpu" => return Some("tensor parallelism runs on CUDA GPUs, not --device cpu".into()),
        other => {
            return Some(format!(
                "with tensor parallelism rank r runs on GPU r (0..{n}); pick the GPUs with CUDA_VISIBLE_DEVICES rather than --device {other}"
            ))
        }
    }
    if let Err(e) = TpPlan::new(model, 0, n) {
        return Some(e);
    }
    if gguf {
        return not_yet("a GGUF file");
    }
    if cfg.lora.is_some() {
        return not_yet("LoRA (--enable-lora)");
    }
    if vision {
        return not_yet("a vision model");
    }
    None
}

/// Starts ranks 1..`world` (one thread per GPU) loading their shards of `model`, and forms the
/// NCCL group with rank 0 on `device`: the group and rank 0's shard, to load with.
#[cfg(feature = "cuda")]
pub fn start_group(
    model: &Path,
    opts: &LoadOptions,
    cfg: &DecoderConfig,
    world: usize,
    device: &Device,
) -> std::result::Result<(Box<dyn TpGroup>, TpShard), EngineError> {
    let (w, shard) = workers::Workers::start(model.to_path_buf(), opts, cfg, world, device)?;
    Ok((Box::new(w), shard))
}

/// Without CUDA there is no tensor parallelism.
#[cfg(not(feature = "cuda"))]
pub fn start_group(
    _model: &Path,
    _opts: &LoadOptions,
    _cfg: &DecoderConfig,
    _world: usize,
    _device: &Device,
) -> std::result::Result<(Box<dyn TpGroup>, TpShard), EngineError> {
    Err(EngineError::InvalidConfig(
        "tensor parallelism needs a CUDA build (make cuda) and as many GPUs".into(),
    ))
}

/// The collectives a sharded model calls, on its rank's device and stream.
pub trait Collective: Send + Sync + std::fmt::Debug {
    /// The element-wise sum of `x` over every rank (same shape on every rank).
    fn all_reduce(&self, x: &Tensor) -> Result<Tensor>;
    /// Every rank's `x` stacked: `[world, ..x's shape]`.
    fn all_gather(&self, x: &Tensor) -> Result<Tensor>;
    /// Writes rank 0's `x` over every rank's `x`, in place (same shape on every rank; u32 or
    /// f32, contiguous).
    fn broadcast_from_first(&self, x: &Tensor) -> Result<()> {
        let _ = x;
        candle_core::bail!("this group cannot broadcast")
    }
    /// What follows a row-parallel layer: `sum = all_reduce(x) + residual` and
    /// `rms_norm(sum) * weight`, both `[tokens, hidden]`; in one kernel where the communicator
    /// has one.
    fn all_reduce_add_rms_norm(
        &self,
        x: &Tensor,
        residual: &Tensor,
        weight: &Tensor,
        eps: f64,
    ) -> Result<(Tensor, Tensor)> {
        reduce_then_add_rms_norm(self, x, residual, weight, eps)
    }
}

/// [`Collective::all_reduce_add_rms_norm`] as two steps: `comm`'s all-reduce, then the fused
/// residual add and RMS norm of one device.
pub fn reduce_then_add_rms_norm<C: Collective + ?Sized>(
    comm: &C,
    x: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    rserve_kernels::add_rms_norm(&comm.all_reduce(x)?, residual, weight, eps)
}

/// A rank's part of a model: which shard it loads and how it talks to the others.
#[derive(Debug, Clone)]
pub struct TpShard {
    pub plan: TpPlan,
    pub comm: Arc<dyn Collective>,
}

/// The vocabulary-parallel embedding lookup of one rank: rows of its own ids (`ids` in
/// `[start, start + rows)`) from its `table` `[rows, hidden]`, zeros for the others; summed over
/// the ranks by the caller.
pub fn embed_shard(table: &Tensor, ids: &Tensor, start: usize) -> Result<Tensor> {
    let rows = table.dim(0)?;
    // ids fit f32 exactly (vocabularies are far below 2^24)
    let local = (ids.to_dtype(candle_core::DType::F32)? - start as f64)?;
    let inside = local
        .ge(0f64)?
        .mul(&local.lt(rows as f64)?)?
        .to_dtype(table.dtype())?;
    let idx = local
        .clamp(0f64, (rows.max(1) - 1) as f64)?
        .to_dtype(candle_core::DType::U32)?;
    table
        .index_select(&idx, 0)?
        .broadcast_mul(&inside.unsqueeze(1)?)
}

/// The logits of every rank's vocabulary shard, gathered (`[world, rows, per_rank]`), as
/// `[rows, vocab]` without the padding rows.
pub fn join_vocab(gathered: &Tensor, vocab: usize) -> Result<Tensor> {
    let (world, rows, per) = gathered.dims3()?;
    gathered
        .transpose(0, 1)?
        .contiguous()?
        .reshape((rows, world * per))?
        .narrow(1, 0, vocab)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn configurations_that_do_not_shard_are_refused() {
        let model = crate::models::llama::config(
            &serde_json::from_value(serde_json::json!({
                "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
                "num_key_value_heads": 2, "max_position_embeddings": 64
            }))
            .expect("config"),
        )
        .expect("llama");
        let mut cfg = EngineConfig::new("m");
        assert_eq!(refusal(&cfg, &model, true, true), None); // one GPU: nothing changes
        cfg.tensor_parallel_size = 2;
        assert_eq!(refusal(&cfg, &model, false, false), None);
        cfg.tensor_parallel_size = 0;
        assert!(refusal(&cfg, &model, false, false).is_some());
        cfg.tensor_parallel_size = 16;
        assert!(
            refusal(&cfg, &model, false, false).is_some_and(|m| m.contains("8 attention heads"))
        );
        cfg.tensor_parallel_size = 2;
        let why = |cfg: &EngineConfig, gguf, vision| {
            refusal(cfg, &model, gguf, vision).unwrap_or_default()
        };
        assert!(why(&cfg, true, false).contains("GGUF"));
        assert!(why(&cfg, false, true).contains("vision"));
        let mut c = cfg.clone();
        c.isq = Some(crate::quant::IsqFormat::Fp8);
        assert_eq!(refusal(&c, &model, false, false), None);
        let mut c = cfg.clone();
        c.lora = Some(crate::lora::LoraOptions {
            max_loras: 1,
            max_rank: 8,
            max_cpu_loras: 1,
        });
        assert!(why(&c, false, false).contains("LoRA"));
        let mut c = cfg.clone();
        c.device = "cpu".into();
        assert!(why(&c, false, false).contains("CUDA"));
        c.device = "cuda:1".into();
        assert!(why(&c, false, false).contains("CUDA_VISIBLE_DEVICES"));
    }

    #[test]
    fn sharded_embedding_sums_to_the_whole_lookup() -> Result<()> {
        let dev = Device::Cpu;
        let (vocab, hidden, world) = (10usize, 3usize, 3usize);
        let table =
            Tensor::arange(0f32, (vocab * hidden) as f32, &dev)?.reshape((vocab, hidden))?;
        let ids = Tensor::new(&[0u32, 9, 4, 3, 7], &dev)?;
        let per = vocab.div_ceil(world);
        let mut sum = Tensor::zeros((5, hidden), DType::F32, &dev)?;
        for r in 0..world {
            let start = r * per;
            let len = per.min(vocab - start);
            let mut shard = table.narrow(0, start, len)?;
            if len < per {
                shard = Tensor::cat(
                    &[shard, Tensor::zeros((per - len, hidden), DType::F32, &dev)?],
                    0,
                )?;
            }
            sum = (sum + embed_shard(&shard, &ids, start)?)?;
        }
        assert_eq!(
            sum.to_vec2::<f32>()?,
            table.index_select(&ids, 0)?.to_vec2::<f32>()?
        );
        Ok(())
    }

    #[test]
    fn gathered_vocab_shards_join_in_order() -> Result<()> {
        let dev = Device::Cpu;
        let (rows, vocab, world) = (2usize, 7usize, 2usize);
        let full = Tensor::arange(0f32, (rows * vocab) as f32, &dev)?.reshape((rows, vocab))?;
        let per = vocab.div_ceil(world);
        let pad = Tensor::zeros((rows, world * per - vocab), DType::F32, &dev)?;
        let padded = Tensor::cat(&[full.clone(), pad], 1)?;
        let shards: Vec<Tensor> = (0..world)
            .map(|r| padded.narrow(1, r * per, per))
            .collect::<Result<_>>()?;
        let gathered = Tensor::stack(&shards, 0)?;
        assert_eq!(
            join_vocab(&gathered, vocab)?.to_vec2::<f32>()?,
            full.to_vec2::<f32>()?
        );
        Ok(())
    }
}
