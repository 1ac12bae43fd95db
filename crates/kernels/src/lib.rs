//! Tensor kernels of rserve: the paged-attention family, the cache writes that feed it, the
//! fused element-wise ops of the decoder layer, and quantized products on the CPU.
//!
//! This crate knows tensors and nothing of requests. Every op here has a CPU implementation that is
//! also the reference the CUDA kernels are tested against; callers pass candle tensors and get candle
//! tensors back, so the engine never sees which backend ran.
//!
//! Shapes used throughout:
//! - `q`: `[num_tokens, num_heads, head_dim]` (all scheduled tokens of a step, flattened)
//! - `k_cache`, `v_cache`: `[num_blocks, block_size, num_kv_heads, head_dim]`, of the model's
//!   dtype or FP8 E4M3 bytes (`U8`, see [`cache`])
//! - [`AttentionMetadata`] carries the step's layout, once per step for every layer:
//! - `block_tables`: `[num_seqs, max_blocks_per_seq]` u32
//! - `seq_lens`: `[num_seqs]` u32, the context length of each sequence after this step's tokens
//! - `query_start_loc`: `[num_seqs + 1]` u32, cumulative query token counts
//! - `slot_mapping`: `[num_tokens]` i64, flat cache slot (`block * block_size + offset`) per token, -1 to skip

/// Whether the comparison switch `name` (an environment variable) is on: unless it is `0`.
pub(crate) fn switch_on(name: &str) -> bool {
    !matches!(std::env::var(name).as_deref().map(str::trim), Ok("0"))
}

pub mod activation;
#[cfg(feature = "cuda")]
pub mod allreduce;
pub mod bias;
pub mod cache;
#[cfg(feature = "cuda")]
pub mod candle_sass;
pub mod cpu_quant;
#[cfg(feature = "cuda")]
mod cublaslt;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod elem;
pub mod fp8;
#[cfg(feature = "cuda")]
pub mod fp8_gemm;
pub mod fused;
pub mod gemv;
pub mod ggml;
#[cfg(feature = "cuda")]
pub mod graph;
pub mod graph_shape;
pub mod layer_norm;
pub mod lora;
#[cfg(feature = "cuda")]
mod lora_blas;
pub mod lora_gemv;
pub mod metadata;
pub mod paged_attention;
pub mod quantize;
pub mod sampling;
pub mod segment_attention;

pub use bias::{add_bias, linear_bias};
pub use cache::{
    copy_blocks, is_fp8_cache, reshape_and_cache, reshape_and_cache_scaled, CacheScales,
    FP8_CACHE_DTYPE,
};
pub use fused::{add_rms_norm, rotary_qk_, rotary_qk_cache_, silu_and_mul, to_f32, to_f32_into};
pub use gemv::{linear_rows, silu_glu_rows};
pub use metadata::{AttentionMetadata, DeviceArrays};
pub use paged_attention::{paged_attention, reference_attention, PagedAttentionParams};
