//! Sizing at start: the step's token budget and how many KV blocks fit (on a GPU, what
//! `gpu_memory_utilization` leaves after the weights, the measured activation peak of one step
//! and the decode graphs).

use super::{EngineConfig, EngineError, KvBudget};
use crate::kv_cache::KvCache;
#[cfg(feature = "cuda")]
use crate::model_runner::graphs::GraphPlan;
use crate::models::Model;
use crate::multimodal::ImageInput;
use candle_core::DType;
use candle_core::Device;

/// The step token budget when none is given, as vLLM's server chooses it: 8192 tokens on GPUs
/// of 70 GiB or more (H100, H200: fewer, larger prompt chunks keep the products at their
/// ceiling), 2048 elsewhere (smaller GPUs, the CPU).
pub fn default_batched_tokens(device: &Device) -> usize {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => match crate::device::gpu::memory(dev) {
            Ok(m) if m.total >= 70 << 30 => 8192,
            _ => 2048,
        },
        _ => 2048,
    }
}

/// Bytes of KV cache a GPU can hold: `gpu_memory_utilization` of the card, less what is in use
/// after loading (weights, context, other processes) and the activation peak of a step, measured
/// on the pool's high-water mark: a forward pass over `batched_tokens` tokens (the step budget)
/// and, for a vision model, the encoder over `images` (its largest batch) with its features
/// kept through the forward pass, as a step with new images keeps them.
#[cfg(feature = "cuda")]
pub(crate) fn gpu_kv_budget(
    cfg: &EngineConfig,
    batched_tokens: usize,
    (model, dtype): (&dyn Model, DType),
    device: &Device,
    (max_model_len, images): (usize, &[ImageInput]),
) -> Result<usize, EngineError> {
    use crate::device::gpu;
    let Device::Cuda(dev) = device else {
        return Err(EngineError::InvalidConfig("not a CUDA device".into()));
    };
    let err = |e: String| EngineError::Model(format!("sizing the KV cache: {e}"));
    let before = gpu::memory(dev).map_err(err)?;
    // the pool's high-water mark so far: the weights plus whatever loading held at once (16-bit
    // tensors on their way to ISQ, staging copies)
    let load_peak = gpu::peak(dev).map_err(err)?;
    gpu::reset_peak(dev).map_err(err)?;
    let tokens = batched_tokens.min(max_model_len.max(1));
    let rows = cfg.max_num_seqs.min(tokens);
    let scratch = crate::model_runner::profile_forward(
        model,
        cfg.kv_cache_dtype.storage(dtype),
        device,
        tokens,
        rows,
        cfg.block_size,
    )
    .map_err(|e| err(e.to_string()))?;
    let forward_peak = gpu::peak(dev)
        .map_err(err)?
        .saturating_sub(before.pool_used + scratch);
    let (encoder_peak, features) = if images.is_empty() {
        (0, 0)
    } else {
        gpu::reset_peak(dev).map_err(err)?;
        let refs: Vec<&ImageInput> = images.iter().collect();
        let feats = model
            .encode_images(&refs)
            .map_err(|e| err(format!("the vision encoder: {e}")))?;
        let bytes = feats
            .iter()
            .map(|f| f.elem_count() * f.dtype().size_in_bytes())
            .sum::<usize>();
        drop(feats);
        device.synchronize().map_err(|e| err(e.to_string()))?;
        let used = gpu::memory(dev).map_err(err)?.pool_used;
        (gpu::peak(dev).map_err(err)?.saturating_sub(used), bytes)
    };
    let peak = (forward_peak + features).max(encoder_peak);
    let in_use = before.total - before.free;
    let allowed = (before.total as f64 * cfg.gpu_memory_utilization) as usize;
    // decode graphs: the shared f32 logits buffer, the largest bucket's logits inside its graph
    // (model dtype, then f32) and its other activations
    let graphs = if cfg.enforce_eager {
        0
    } else {
        let largest = GraphPlan::new(cfg.max_num_seqs, max_model_len, cfg.block_size)
            .buckets
            .last()
            .copied()
            .unwrap_or(0);
        let logits = largest * model.config().vocab_size;
        let one = logits * (8 + dtype.size_in_bytes()) + forward_peak * largest / tokens.max(1);
        // a second set runs the steps with adapter rows
        if cfg.lora.is_some() {
            2 * one
        } else {
            one
        }
    };
    let budget = allowed.saturating_sub(in_use + peak + graphs);
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    let encoder = if images.is_empty() {
        String::new()
    } else {
        let image_tokens: usize = images.iter().map(|i| i.num_tokens).sum();
        format!(
            " (the vision encoder's {:.2} GiB for {} images of {image_tokens} tokens)",
            gib(encoder_peak),
            images.len()
        )
    };
    tracing::info!(
        "GPU memory: {:.2} GiB total, {:.2} GiB in use after loading (tensors {:.2} GiB, their peak while loading {:.2} GiB), activation peak {:.2} GiB for {tokens} tokens{encoder}, {:.2} GiB kept for decode graphs; KV cache budget {:.2} GiB at utilization {}",
        gib(before.total),
        gib(in_use),
        gib(before.pool_used),
        gib(load_peak),
        gib(peak),
        gib(graphs),
        gib(budget),
        cfg.gpu_memory_utilization
    );
    Ok(budget)
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn gpu_kv_budget(
    _cfg: &EngineConfig,
    _batched_tokens: usize,
    _model: (&dyn Model, DType),
    _device: &Device,
    _len_and_images: (usize, &[ImageInput]),
) -> Result<usize, EngineError> {
    Err(EngineError::InvalidConfig(
        "this build has no GPU support".into(),
    ))
}

/// The number of KV blocks for `cfg` (see [`KvBudget`]): never more than `max_num_seqs`
/// sequences of `max_model_len` tokens need. `images`: a vision model's largest encoder batch,
/// profiled with the forward pass on a GPU.
pub(crate) fn kv_blocks(
    cfg: &EngineConfig,
    (model, dtype): (&dyn Model, DType),
    device: &Device,
    batched_tokens: usize,
    (max_model_len, images): (usize, &[ImageInput]),
) -> Result<usize, EngineError> {
    let mc = model.config();
    let per_block = KvCache::bytes_per_block(
        mc.num_layers,
        cfg.block_size,
        model.cache_kv_heads(),
        mc.head_dim,
        cfg.kv_cache_dtype.storage(dtype),
    );
    let useful = cfg
        .max_num_seqs
        .saturating_mul(max_model_len.div_ceil(cfg.block_size));
    let num_blocks = match cfg.kv_cache {
        KvBudget::Bytes(b) => b / per_block,
        KvBudget::Blocks(n) => n,
        KvBudget::Auto if !device.is_cpu() => {
            let budget = gpu_kv_budget(
                cfg,
                batched_tokens,
                (model, dtype),
                device,
                (max_model_len, images),
            )?;
            (budget / per_block).min(useful)
        }
        KvBudget::Auto => ((1usize << 30) / per_block).min(useful),
    };
    if num_blocks == 0 {
        return Err(EngineError::InvalidConfig(format!(
            "the KV cache budget holds no block (one block of {} tokens takes {per_block} bytes)",
            cfg.block_size
        )));
    }
    Ok(num_blocks)
}

/// The context length the engine serves with a KV cache of `cache_tokens` tokens: one sequence
/// of `max_model_len` tokens must fit. A length the user asked for is refused when it does not;
/// the model's own is lowered to what fits, with a warning (a server that starts and then
/// refuses every long request helps nobody).
pub(super) fn fit_context(
    max_model_len: usize,
    explicit: bool,
    cache_tokens: usize,
) -> Result<usize, EngineError> {
    if max_model_len <= cache_tokens {
        return Ok(max_model_len);
    }
    if explicit {
        return Err(EngineError::InvalidConfig(format!(
            "max_model_len {max_model_len} does not fit the KV cache, which holds {cache_tokens} \
             tokens: lower --max-model-len to at most {cache_tokens}, or give the cache more \
             memory (--gpu-memory-utilization, --kv-cache-memory)"
        )));
    }
    tracing::warn!(
        "max_model_len lowered from the model's {max_model_len} to {cache_tokens}, what the KV \
         cache holds (give the cache more memory to serve longer sequences)"
    );
    Ok(cache_tokens)
}

#[cfg(test)]
mod tests {
    use super::fit_context;

    #[test]
    fn context_fits_the_cache() {
        assert_eq!(fit_context(256, true, 256).ok(), Some(256));
        assert_eq!(fit_context(512, false, 128).ok(), Some(128));
        let err = fit_context(256, true, 128).err().map(|e| e.to_string());
        let msg = err.unwrap_or_default();
        assert!(msg.contains("256") && msg.contains("128"), "{msg}");
    }
}
