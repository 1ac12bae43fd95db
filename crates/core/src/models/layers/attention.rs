//! Multi-head attention over the paged KV cache, with GQA/MQA, optional q/k/v/o biases, optional
//! per-head q/k RMSNorm (Qwen3) and an optional sliding window (Mistral).
//!
//! Per call: project, normalise, rotate, write this step's K/V into the cache by slot mapping,
//! then attend through the block tables (`rserve_kernels::paged_attention`).

use super::linear::Linear;
use super::norm::RmsNorm;
use super::rotary::StepRope;
use crate::batch::ForwardBatch;
use crate::kv_cache::LayerKv;
use crate::load_error::LoadError;
use crate::weights::Weights;
use candle_core::{Result, Tensor};
use rserve_kernels::{paged_attention, CacheScales, PagedAttentionParams};

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
    qkv_proj: Linear, // [(heads + 2 * kv_heads) * head_dim, hidden]: q rows, k rows, v rows
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    spec: AttentionSpec,
    /// The checkpoint's FP8 KV-cache scales, when it has them.
    kv_scales: Option<CacheScales>,
}

/// A checkpoint's FP8 KV-cache scales for one attention layer, when it has any: `k_scale` and
/// `v_scale` (vLLM's and llm-compressor's names), or `k_proj.output_scale` and
/// `v_proj.output_scale` (AutoFP8's); a missing one is 1. Each must be finite and positive.
fn load_kv_scales(w: &Weights) -> std::result::Result<Option<CacheScales>, LoadError> {
    let mut found = false;
    let mut one = |names: [&str; 2]| -> std::result::Result<f32, LoadError> {
        for name in names {
            if let Some(v) = w.scalar_opt(name)? {
                if !(v.is_finite() && v > 0.0) {
                    return Err(LoadError::Tensor {
                        name: w.name_of(name),
                        reason: format!("a KV-cache scale of {v} (must be finite and positive)"),
                    });
                }
                found = true;
                return Ok(v);
            }
        }
        Ok(1.0)
    };
    let k = one(["k_scale", "k_proj.output_scale"])?;
    let v = one(["v_scale", "v_proj.output_scale"])?;
    Ok(found.then_some(CacheScales { k, v }))
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
            qkv_proj: Linear::load_fused(
                &[
                    (&w.pp("q_proj"), q_out),
                    (&w.pp("k_proj"), kv_out),
                    (&w.pp("v_proj"), kv_out),
                ],
                h,
                spec.qkv_bias,
            )?,
            o_proj: Linear::load(&w.pp("o_proj"), q_out, h, spec.o_bias)?,
            q_norm,
            k_norm,
            spec,
            kv_scales: load_kv_scales(w)?,
        })
    }

    /// The checkpoint's FP8 KV-cache scales for this layer, when it has them.
    pub fn kv_scales(&self) -> Option<CacheScales> {
        self.kv_scales
    }

    /// Whether the q/k/v product would take `x`'s rows in FP8 form.
    pub fn takes_fp8_rows(&self, x: &Tensor) -> bool {
        self.qkv_proj.takes_fp8_rows(x)
    }

    /// `x`: `[num_tokens, hidden]`; `cache`: this layer's keys and values, each
    /// `[num_blocks, block_size, kv_heads, head_dim]` (an FP8 cache's key scale joins the score
    /// scale and its value scale multiplies the output).
    pub fn forward(
        &self,
        x: &Tensor,
        rope: &StepRope,
        batch: &ForwardBatch,
        cache: &LayerKv,
    ) -> Result<Tensor> {
        self.forward_with(x, None, rope, batch, cache)
    }

    /// [`Attention::forward`] of `x`, whose FP8 form `rows` may come with it.
    pub fn forward_with(
        &self,
        x: &Tensor,
        rows: Option<&rserve_kernels::fp8::Fp8Rows>,
        rope: &StepRope,
        batch: &ForwardBatch,
        cache: &LayerKv,
    ) -> Result<Tensor> {
        let s = &self.spec;
        let t = x.dim(0)?;
        let (h, kvh) = (s.num_heads, s.num_kv_heads);
        // [T, heads + 2 * kv_heads, head_dim]
        let ctx = batch.layer_ctx();
        let mut qkv =
            self.qkv_proj
                .forward_with(x, rows, &ctx)?
                .reshape((t, h + 2 * kvh, s.head_dim))?;
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            let q = qn.forward(&qkv.narrow(1, 0, h)?)?;
            let k = kn.forward(&qkv.narrow(1, h, kvh)?)?;
            qkv = Tensor::cat(&[q, k, qkv.narrow(1, h + kvh, kvh)?], 1)?;
        }
        let qkv = qkv.contiguous()?;
        rope.rotate_and_cache_(&qkv, (h, kvh), cache, &batch.attn)?;
        let q = qkv.narrow(1, 0, h)?;
        let fp8 = rserve_kernels::is_fp8_cache(&cache.k);
        let params = PagedAttentionParams {
            scale: (s.head_dim as f32).sqrt().recip() * if fp8 { cache.scales.k } else { 1.0 },
            sliding_window: s.sliding_window,
        };
        let mut o = paged_attention(&q, &cache.k, &cache.v, &batch.attn, &params)?;
        if fp8 && cache.scales.v != 1.0 {
            o = (o * f64::from(cache.scales.v))?;
        }
        self.o_proj
            .forward(&o.reshape((t, s.num_heads * s.head_dim))?, &ctx)
    }
}
