//! The decoder-only transformer stack shared by every Llama-family architecture:
//! embedding -> N x (RMSNorm, attention, residual, RMSNorm, gated MLP, residual) -> RMSNorm -> LM head.
//! An architecture file only translates its `config.json` into a [`DecoderConfig`].

use super::attention::{Attention, AttentionSpec};
use super::embedding::Embedding;
use super::linear::Linear;
use super::mlp::Mlp;
use super::norm::RmsNorm;
use super::rotary::{RopeConfig, RotaryEmbedding};
use crate::batch::{ForwardBatch, LayerCtx};
use crate::kv_cache::KvCache;
use crate::load_error::LoadError;
use crate::models::Model;
use crate::parallel::{join_vocab, TpShard};
use crate::weights::Weights;
use candle_core::{DType, Result, Tensor};
use rserve_kernels::fp8::Fp8Rows;

/// Everything the stack needs to know, normalised from any supported `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct DecoderConfig {
    pub architecture: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope: RopeConfig,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub mlp_bias: bool,
    pub qk_norm: bool,
    /// Per layer: the sliding window, if that layer uses one.
    pub sliding_window: Vec<Option<usize>>,
    /// Qwen2-VL's M-RoPE sections (temporal, height, width frequencies), if the model uses it.
    pub mrope_section: Option<[usize; 3]>,
}

struct Layer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

/// A loaded decoder-only model.
pub struct Decoder {
    cfg: DecoderConfig,
    embed_tokens: Embedding, // [vocab, hidden]
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Linear, // [vocab, hidden]
    rotary: RotaryEmbedding,
    max_positions: usize,
    /// Under tensor parallelism: this rank's shard and its collectives (`embed_tokens` and
    /// `lm_head` then hold this rank's vocabulary rows, the layers its heads and MLP columns).
    tp: Option<TpShard>,
    /// KV heads of this rank's cache.
    kv_heads: usize,
}

impl Decoder {
    /// Loads the weights named as in transformers (`model.layers.{i}.self_attn.q_proj.weight`, ...).
    pub fn load(
        cfg: DecoderConfig,
        w: &Weights,
        max_positions: usize,
    ) -> std::result::Result<Self, LoadError> {
        Self::load_under(cfg, w, "model", max_positions)
    }

    /// [`Decoder::load`] with the stack under `prefix` instead of `model` (the output head stays
    /// at `lm_head`): multimodal checkpoints saved as `model.language_model.*`.
    pub fn load_under(
        cfg: DecoderConfig,
        w: &Weights,
        prefix: &str,
        max_positions: usize,
    ) -> std::result::Result<Self, LoadError> {
        let m = w.pp(prefix);
        let tp = w.tp().cloned();
        // the shapes this rank loads: its heads, MLP columns and vocabulary rows
        let local = match &tp {
            Some(t) => t.plan.local_config(&cfg),
            None => cfg.clone(),
        };
        let embed_tokens = Embedding::load(
            &m,
            [local.vocab_size, cfg.hidden_size],
            "embed_tokens.weight",
        )?;
        let layer = |i: usize| -> std::result::Result<Layer, LoadError> {
            let lw = m.pp("layers").pp(i);
            let spec = AttentionSpec {
                hidden_size: cfg.hidden_size,
                num_heads: local.num_heads,
                num_kv_heads: local.num_kv_heads,
                head_dim: cfg.head_dim,
                qkv_bias: cfg.qkv_bias,
                o_bias: cfg.o_bias,
                qk_norm: cfg.qk_norm,
                rms_norm_eps: cfg.rms_norm_eps,
                sliding_window: cfg.sliding_window.get(i).copied().flatten(),
            };
            Ok(Layer {
                input_layernorm: RmsNorm::load(
                    &lw.pp("input_layernorm"),
                    cfg.hidden_size,
                    cfg.rms_norm_eps,
                )?,
                self_attn: Attention::load(&lw.pp("self_attn"), spec)?,
                post_attention_layernorm: RmsNorm::load(
                    &lw.pp("post_attention_layernorm"),
                    cfg.hidden_size,
                    cfg.rms_norm_eps,
                )?,
                mlp: Mlp::load(
                    &lw.pp("mlp"),
                    cfg.hidden_size,
                    local.intermediate_size,
                    cfg.mlp_bias,
                )?,
            })
        };
        // On the CPU without adapters the layers load side by side: each layer's conversion and
        // quantization run on every core already, but what lies between them (concatenating
        // fused projections, repacking, allocating) runs on one, and another layer fills the
        // gaps. A GPU load streams through its staging buffers in order, and adapters register
        // their slots in order.
        let layers = if w.device().is_cpu() && w.lora().is_none() {
            use rayon::prelude::*;
            (0..cfg.num_layers)
                .into_par_iter()
                .map(layer)
                .collect::<std::result::Result<Vec<_>, _>>()?
        } else {
            (0..cfg.num_layers)
                .map(layer)
                .collect::<std::result::Result<Vec<_>, _>>()?
        };
        let norm = RmsNorm::load(&m.pp("norm"), cfg.hidden_size, cfg.rms_norm_eps)?;
        let lm_head = Linear::load_head(w, &embed_tokens, cfg.tie_word_embeddings)?;
        let rotary = RotaryEmbedding::new(
            cfg.head_dim,
            max_positions,
            &cfg.rope,
            w.dtype(),
            w.device(),
        )
        .and_then(|r| match cfg.mrope_section {
            Some(s) => r.with_mrope(s),
            None => Ok(r),
        })
        .map_err(|e| LoadError::Tensor {
            name: "rotary tables".into(),
            reason: e.to_string(),
        })?;
        Ok(Self {
            cfg,
            embed_tokens,
            layers,
            norm,
            lm_head,
            rotary,
            max_positions,
            tp,
            kv_heads: local.num_kv_heads,
        })
    }
}

impl Decoder {
    /// The device the weights are on.
    pub fn device(&self) -> &candle_core::Device {
        self.embed_tokens.device()
    }
}

impl Model for Decoder {
    fn config(&self) -> &DecoderConfig {
        &self.cfg
    }

    fn max_positions(&self) -> usize {
        self.max_positions
    }

    fn kv_cache_scales(&self) -> Vec<Option<rserve_kernels::CacheScales>> {
        self.layers
            .iter()
            .map(|l| l.self_attn.kv_scales())
            .collect()
    }

    fn cache_kv_heads(&self) -> usize {
        self.kv_heads
    }

    fn share_token_ids(&self, ids: &Tensor) -> Result<()> {
        match &self.tp {
            None => Ok(()),
            Some(t) => t.comm.broadcast_from_first(ids),
        }
    }

    fn embed(&self, input_ids: &Tensor) -> Result<Tensor> {
        self.embed_tokens.forward(input_ids, self.tp.as_ref())
    }

    fn forward_embeds(
        &self,
        embeds: &Tensor,
        batch: &ForwardBatch,
        kv: &KvCache,
    ) -> Result<Tensor> {
        match self.lm_head_rows(embeds.clone(), batch, kv)? {
            Some(raw) => rserve_kernels::to_f32(&raw),
            // prompt chunks only: the cache is written, no logits are wanted
            None => Tensor::zeros(
                (0, self.cfg.vocab_size),
                DType::F32,
                &candle_core::Device::Cpu,
            ),
        }
    }

    fn forward_into(&self, batch: &ForwardBatch, kv: &KvCache, logits: &Tensor) -> Result<()> {
        let embeds = self.embed(&batch.input_ids)?;
        match self.lm_head_rows(embeds, batch, kv)? {
            Some(raw) => rserve_kernels::to_f32_into(&raw, logits),
            None => Ok(()),
        }
    }
}

impl Decoder {
    /// Runs the layers over every token of `batch` from its input embeddings `[T, hidden]`
    /// (writing K/V into `kv`) and the LM head over the logit rows, in the model's dtype; `None`
    /// when the batch wants no logits.
    fn lm_head_rows(
        &self,
        embeds: Tensor,
        batch: &ForwardBatch,
        kv: &KvCache,
    ) -> Result<Option<Tensor>> {
        let ctx = batch.layer_ctx();
        let rope = self.rotary.for_step(batch)?;
        // the residual stream and the last sub-layer's output (a rank's partial sum under tensor
        // parallelism), reduced and added lazily by the next norm
        let mut residual = embeds; // [T, hidden]
        let mut out: Option<Tensor> = None;
        for (layer, cache) in self.layers.iter().zip(&kv.layers) {
            // each norm also hands an FP8 product the normed rows in FP8 form when it wants them
            let (h, rows) = match out.take() {
                None => (layer.input_layernorm.forward(&residual)?, None),
                Some(o) => {
                    let fp8 = layer.self_attn.takes_fp8_rows(&o);
                    let (sum, normed, rows) =
                        self.add_norm(&layer.input_layernorm, &o, &residual, fp8)?;
                    residual = sum;
                    (normed, rows)
                }
            };
            let a = layer
                .self_attn
                .forward_with(&h, rows.as_ref(), &rope, batch, cache)?;
            let fp8 = layer.mlp.takes_fp8_rows(&a);
            let (sum, h, rows) =
                self.add_norm(&layer.post_attention_layernorm, &a, &residual, fp8)?;
            residual = sum;
            out = Some(layer.mlp.forward_with(&h, rows.as_ref(), &ctx)?);
        }
        let out = out.map(|o| self.reduced(o)).transpose()?;
        let x = match out {
            Some(o) => (o + residual)?,
            None => residual,
        };
        if batch.logits_indices.dim(0)? == 0 {
            return Ok(None);
        }
        let x = x.index_select(&batch.logits_indices, 0)?; // [L, hidden]
        let x = self.norm.forward(&x)?;
        // the logit rows are a subset of the batch's: no per-token context applies to them
        let logits = self.lm_head.forward(&x, &LayerCtx::default())?;
        match &self.tp {
            None => Ok(Some(logits)),
            Some(t) => join_vocab(&t.comm.all_gather(&logits)?, self.cfg.vocab_size).map(Some),
        }
    }

    /// `norm`'s [`RmsNorm::forward_add`] of a row-parallel layer's output `x` (summed over the
    /// ranks first under tensor parallelism), with the normed rows' FP8 form when `fp8` asks
    /// for it (not under tensor parallelism, whose norm is fused with the all-reduce).
    fn add_norm(
        &self,
        norm: &RmsNorm,
        x: &Tensor,
        residual: &Tensor,
        fp8: bool,
    ) -> Result<(Tensor, Tensor, Option<Fp8Rows>)> {
        match &self.tp {
            None if fp8 => {
                let (sum, normed, rows) = norm.forward_add_fp8(x, residual)?;
                Ok((sum, normed, Some(rows)))
            }
            None => norm.forward_add(x, residual).map(|(s, n)| (s, n, None)),
            Some(t) => norm
                .forward_reduce_add(x, residual, t.comm.as_ref())
                .map(|(s, n)| (s, n, None)),
        }
    }

    /// A row-parallel layer's output summed over the ranks (as is without tensor parallelism).
    fn reduced(&self, partial: Tensor) -> Result<Tensor> {
        match &self.tp {
            None => Ok(partial),
            Some(t) => t.comm.all_reduce(&partial),
        }
    }
}
