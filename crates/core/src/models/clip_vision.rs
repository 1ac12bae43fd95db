//! CLIP's vision transformer (LLaVA-1.5's tower): patch embedding (a convolution whose stride is
//! its kernel: one product over flattened patches), a class token and learned positions,
//! pre-LayerNorm, then blocks of LayerNorm, bidirectional attention (q/k/v with biases) and a
//! two-layer MLP. LLaVA reads the hidden states after block `vision_feature_layer` (counted from
//! the end when negative), so later blocks are not loaded.

use super::layers::linear::Linear;
use super::layers::vision::{LayerNorm, SegmentPlan, VitAct, VitMlp};
use crate::batch::LayerCtx;
use crate::load_error::LoadError;
use crate::weights::Weights;
use candle_core::{Result, Tensor};
use serde::Deserialize;

/// `vision_config` of a CLIP vision tower (defaults: ViT-L/14 at 336 pixels, LLaVA-1.5's).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct ClipVisionConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub image_size: usize,
    pub patch_size: usize,
    pub num_channels: usize,
    pub layer_norm_eps: f64,
    pub hidden_act: String,
}

impl Default for ClipVisionConfig {
    fn default() -> Self {
        Self {
            hidden_size: 1024,
            intermediate_size: 4096,
            num_hidden_layers: 24,
            num_attention_heads: 16,
            image_size: 336,
            patch_size: 14,
            num_channels: 3,
            layer_norm_eps: 1e-5,
            hidden_act: "quick_gelu".into(),
        }
    }
}

impl ClipVisionConfig {
    /// Patches per side.
    pub fn side(&self) -> usize {
        self.image_size / self.patch_size.max(1)
    }
}

struct Block {
    layer_norm1: LayerNorm,
    qkv: Linear, // [3 * hidden, hidden]: q, k, v rows
    out_proj: Linear,
    layer_norm2: LayerNorm,
    mlp: VitMlp,
}

/// The tower up to the block LLaVA reads.
pub struct ClipVision {
    cfg: ClipVisionConfig,
    patch_embedding: Tensor,    // [hidden, channels * patch^2]
    class_embedding: Tensor,    // [1, hidden]
    position_embedding: Tensor, // [patches + 1, hidden]
    pre_layrnorm: LayerNorm,
    blocks: Vec<Block>,
}

impl ClipVision {
    /// Loads the embeddings and the first `layers` blocks.
    pub fn load(
        cfg: ClipVisionConfig,
        w: &Weights,
        layers: usize,
    ) -> std::result::Result<Self, LoadError> {
        let bad = |reason: String| LoadError::Config {
            field: "vision_config".into(),
            reason,
        };
        let act = VitAct::parse(&cfg.hidden_act)?;
        let (d, p, c) = (cfg.hidden_size, cfg.patch_size, cfg.num_channels);
        if cfg.num_attention_heads == 0 || !d.is_multiple_of(cfg.num_attention_heads) {
            return Err(bad(
                "hidden_size must be a multiple of num_attention_heads".into()
            ));
        }
        if p == 0 || cfg.image_size < p {
            return Err(bad("the image must hold at least one patch".into()));
        }
        let e = w.pp("embeddings");
        let reshape = |t: Tensor, shape: (usize, usize), name: &str| {
            t.reshape(shape).map_err(|err| LoadError::Tensor {
                name: e.name_of(name),
                reason: err.to_string(),
            })
        };
        let patch = e.get(&[d, c, p, p], "patch_embedding.weight")?;
        let patch_embedding = reshape(patch, (d, c * p * p), "patch_embedding.weight")?;
        let class_embedding = reshape(e.get(&[d], "class_embedding")?, (1, d), "class_embedding")?;
        let n = cfg.side() * cfg.side() + 1;
        let position_embedding = e.get(&[n, d], "position_embedding.weight")?;
        let eps = cfg.layer_norm_eps;
        let mut blocks = Vec::with_capacity(layers);
        for i in 0..layers {
            let b = w.pp("encoder").pp("layers").pp(i);
            let a = b.pp("self_attn");
            blocks.push(Block {
                layer_norm1: LayerNorm::load(&b.pp("layer_norm1"), d, eps)?,
                qkv: Linear::load_fused(
                    &[
                        (&a.pp("q_proj"), d),
                        (&a.pp("k_proj"), d),
                        (&a.pp("v_proj"), d),
                    ],
                    d,
                    true,
                )?,
                out_proj: Linear::load(&a.pp("out_proj"), d, d, true)?,
                layer_norm2: LayerNorm::load(&b.pp("layer_norm2"), d, eps)?,
                mlp: VitMlp::load(&b.pp("mlp"), d, cfg.intermediate_size, act)?,
            });
        }
        Ok(Self {
            pre_layrnorm: LayerNorm::load(&w.pp("pre_layrnorm"), d, eps)?,
            cfg,
            patch_embedding,
            class_embedding,
            position_embedding,
            blocks,
        })
    }

    pub fn config(&self) -> &ClipVisionConfig {
        &self.cfg
    }

    /// `patches`: `[images * side^2, channels * patch^2]` (each image's patches row-major, each
    /// patch channel-first); the hidden states after the loaded blocks, `[images, side^2 + 1,
    /// hidden]` with the class token first.
    pub fn forward(&self, patches: &Tensor, images: usize) -> Result<Tensor> {
        let d = self.cfg.hidden_size;
        let per = self.cfg.side() * self.cfg.side() + 1;
        let dtype = self.patch_embedding.dtype();
        let x = patches
            .to_dtype(dtype)?
            .matmul(&self.patch_embedding.t()?)?; // [B * P, d]
        let x = x.reshape((images, per - 1, d))?;
        let cls = self
            .class_embedding
            .unsqueeze(0)?
            .broadcast_as((images, 1, d))?;
        let x =
            Tensor::cat(&[&cls.contiguous()?, &x], 1)?.broadcast_add(&self.position_embedding)?;
        let mut x = self.pre_layrnorm.forward(&x.reshape((images * per, d))?)?;
        let heads = self.cfg.num_attention_heads;
        let bounds: Vec<usize> = (0..=images).map(|i| i * per).collect();
        let plan = SegmentPlan::new(&bounds, images * per, patches.device(), dtype, d / heads)?;
        let ctx = LayerCtx::default();
        // each residual add is fused with the norm after it (layer_norm2, and the next block's
        // layer_norm1)
        let mut h = match self.blocks.first() {
            Some(b) => b.layer_norm1.forward(&x)?,
            None => return x.reshape((images, per, d)),
        };
        for (i, b) in self.blocks.iter().enumerate() {
            let qkv = b
                .qkv
                .forward(&h, &ctx)?
                .reshape((images * per, 3 * heads, d / heads))?;
            let a = plan.attend(&qkv, heads)?;
            let (x1, h2) = b
                .layer_norm2
                .forward_add(&b.out_proj.forward(&a, &ctx)?, &x)?;
            let m = b.mlp.forward(&h2, &ctx)?;
            (x, h) = match self.blocks.get(i + 1) {
                Some(nb) => nb.layer_norm1.forward_add(&m, &x1)?,
                None => ((x1 + m)?, h2),
            };
        }
        x.reshape((images, per, d))
    }
}
