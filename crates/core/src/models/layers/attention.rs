//! Multi-head attention over the paged KV cache, with GQA/MQA, optional q/k/v/o biases, optional
//! per-head q/k RMSNorm (Qwen3) and an optional sliding window (Mistral).
//!
//! Per call: project, normalise, rotate, write this step's K/V into the cache by slot mapping,
//! then attend through the block tables (`rserve_kernels::paged_attention`).

use super::linear::Linear;
use super::norm::RmsNorm;
use super::rotary::RotaryEmbedding;
use crate::loader::LoadError;
use crate::model_runner::ForwardBatch;
use crate::weights::Weights;
use candle_core::{Result, Tensor};
use rserve_kernels::{paged_attention, reshape_and_cache, PagedAttentionParams};

/// Shape and options of one attention layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionSpec {
    pub hidden_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub qk_norm: bool,
    pub rms_norm_eps: f64,
    pub sliding_window: Option<usize>,
}

#[derive(Debug, Clone)]
pub struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    spec: AttentionSpec,
}

impl Attention {
    pub fn load(w: &Weights, spec: AttentionSpec) -> std::result::Result<Self, LoadError> {
        let (h, d) = (spec.hidden_size, spec.head_dim);
        let (q_out, kv_out) = (spec.num_heads * d, spec.num_kv_heads * d);
        let (q_norm, k_norm) = if spec.qk_norm {
            (
                Some(RmsNorm::load(&w.pp("q_norm"), d, spec.rms_norm_eps)?),
                Some(RmsNorm::load(&w.pp("k_norm"), d, spec.rms_norm_eps)?),
            )
        } else {
            (None, None)
        };
        Ok(Self {
            q_proj: Linear::load(&w.pp("q_proj"), h, q_out, spec.qkv_bias)?,
            k_proj: Linear::load(&w.pp("k_proj"), h, kv_out, spec.qkv_bias)?,
            v_proj: Linear::load(&w.pp("v_proj"), h, kv_out, spec.qkv_bias)?,
            o_proj: Linear::load(&w.pp("o_proj"), q_out, h, spec.o_bias)?,
            q_norm,
            k_norm,
            spec,
        })
    }

    /// `x`: `[num_tokens, hidden]`; `cos`/`sin`: `[num_tokens, head_dim / 2]`;
    /// `cache`: this layer's (k, v), each `[num_blocks, block_size, kv_heads, head_dim]`.
    pub fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        batch: &ForwardBatch,
        cache: &(Tensor, Tensor),
    ) -> Result<Tensor> {
        let s = &self.spec;
        let t = x.dim(0)?;
        let q = self
            .q_proj
            .forward(x)?
            .reshape((t, s.num_heads, s.head_dim))?;
        let k = self
            .k_proj
            .forward(x)?
            .reshape((t, s.num_kv_heads, s.head_dim))?;
        let v = self
            .v_proj
            .forward(x)?
            .reshape((t, s.num_kv_heads, s.head_dim))?;
        let q = match &self.q_norm {
            Some(n) => n.forward(&q)?,
            None => q,
        };
        let k = match &self.k_norm {
            Some(n) => n.forward(&k)?,
            None => k,
        };
        let q = RotaryEmbedding::apply(&q, cos, sin)?;
        let k = RotaryEmbedding::apply(&k, cos, sin)?;
        reshape_and_cache(&k, &v, &cache.0, &cache.1, &batch.slot_mapping)?;
        let params = PagedAttentionParams {
            scale: 1.0 / (s.head_dim as f32).sqrt(),
            sliding_window: s.sliding_window,
        };
        let o = paged_attention(
            &q,
            &cache.0,
            &cache.1,
            &batch.block_tables,
            &batch.seq_lens,
            &batch.query_start_loc,
            &params,
        )?;
        self.o_proj
            .forward(&o.reshape((t, s.num_heads * s.head_dim))?)
    }
}
