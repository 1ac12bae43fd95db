//! The vision encoder of Qwen2.5-VL and of Qwen2-VL: patch embedding (a 3-D convolution whose
//! stride equals its kernel, so one matrix product over flattened patches), blocks of a norm,
//! attention with a 2-D rotary embedding and an MLP, then the merger that folds each 2x2 group of
//! patches into one token of the language model's width. Qwen2.5-VL's blocks use RMSNorm and a
//! gated SiLU MLP; Qwen2-VL's use LayerNorm and a two-layer QuickGELU MLP, and attend over whole
//! images in every block.
//!
//! Most Qwen2.5-VL blocks attend within windows of `window_size` pixels (8x8 patches for the
//! released models); `fullatt_block_indexes` attend over whole images. The patches are reordered
//! once so that each window is contiguous, the attention runs per segment (segments of one length
//! are batched into one product, which runs on tensor cores on a GPU), and the merger's output is
//! put back in the processor's order. Long segments are processed in query chunks to bound the
//! score matrix.

use super::layers::linear::Linear;
use super::layers::mlp::Mlp;
use super::layers::norm::RmsNorm;
use super::layers::vision::{LayerNorm, Profile, SegmentPlan, VitAct, VitMlp};
use crate::batch::LayerCtx;
use crate::load_error::LoadError;
use crate::weights::Weights;
use candle_core::{DType, Result, Tensor};
use serde::Deserialize;

/// `vision_config` of a Qwen2.5-VL checkpoint (defaults: the released 3B/7B/72B towers).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct VisionConfig {
    pub depth: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub out_hidden_size: usize,
    pub patch_size: usize,
    pub spatial_merge_size: usize,
    pub temporal_patch_size: usize,
    pub window_size: usize,
    pub fullatt_block_indexes: Vec<usize>,
    #[serde(alias = "in_channels")]
    pub in_chans: usize,
    pub hidden_act: String,
    /// Which tower the blocks are (not in the file: set from the architecture).
    #[serde(skip)]
    pub family: Family,
}

/// The two towers' blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Family {
    /// RMSNorm, gated SiLU MLP, windowed attention.
    #[default]
    Qwen25,
    /// LayerNorm, `fc1`/`fc2` MLP, full attention.
    Qwen2,
}

/// `vision_config` of a Qwen2-VL checkpoint (defaults: the released 7B tower). Its `hidden_size`
/// is the language model's width (the merger's output); the tower is `embed_dim` wide.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct Qwen2VisionConfig {
    pub depth: usize,
    pub embed_dim: usize,
    pub hidden_size: usize,
    pub mlp_ratio: f64,
    pub num_heads: usize,
    #[serde(alias = "in_channels")]
    pub in_chans: usize,
    pub patch_size: usize,
    pub spatial_merge_size: usize,
    pub temporal_patch_size: usize,
    pub hidden_act: String,
}

impl Default for Qwen2VisionConfig {
    fn default() -> Self {
        Self {
            depth: 32,
            embed_dim: 1280,
            hidden_size: 3584,
            mlp_ratio: 4.0,
            num_heads: 16,
            in_chans: 3,
            patch_size: 14,
            spatial_merge_size: 2,
            temporal_patch_size: 2,
            hidden_act: "quick_gelu".into(),
        }
    }
}

/// The most blocks a vision tower may have (the largest released towers have 32).
const MAX_DEPTH: usize = 256;

impl From<Qwen2VisionConfig> for VisionConfig {
    /// Every block attends over whole images (the windows are single merged groups, never used).
    fn from(c: Qwen2VisionConfig) -> Self {
        Self {
            depth: c.depth,
            hidden_size: c.embed_dim,
            // as transformers sizes it: int(embed_dim * mlp_ratio)
            intermediate_size: (c.embed_dim as f64 * c.mlp_ratio) as usize,
            num_heads: c.num_heads,
            out_hidden_size: c.hidden_size,
            patch_size: c.patch_size,
            spatial_merge_size: c.spatial_merge_size,
            temporal_patch_size: c.temporal_patch_size,
            // both from config.json: `validate` refuses what these bounds cut
            window_size: c.spatial_merge_size.saturating_mul(c.patch_size),
            fullatt_block_indexes: (0..c.depth.min(MAX_DEPTH + 1)).collect(),
            in_chans: c.in_chans,
            hidden_act: c.hidden_act,
            family: Family::Qwen2,
        }
    }
}

impl Default for VisionConfig {
    fn default() -> Self {
        Self {
            depth: 32,
            hidden_size: 1280,
            intermediate_size: 3420,
            num_heads: 16,
            out_hidden_size: 3584,
            patch_size: 14,
            spatial_merge_size: 2,
            temporal_patch_size: 2,
            window_size: 112,
            fullatt_block_indexes: vec![7, 15, 23, 31],
            in_chans: 3,
            hidden_act: "silu".into(),
            family: Family::Qwen25,
        }
    }
}

impl VisionConfig {
    fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads.max(1)
    }

    fn patch_dim(&self) -> usize {
        self.in_chans * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    pub fn validate(&self) -> std::result::Result<(), LoadError> {
        let bad = |reason: &str| LoadError::Config {
            field: "vision_config".into(),
            reason: reason.into(),
        };
        match self.family {
            Family::Qwen25 if self.hidden_act != "silu" => {
                return Err(bad("only a silu MLP is supported"));
            }
            Family::Qwen2 => {
                VitAct::parse(&self.hidden_act)?;
            }
            Family::Qwen25 => {}
        }
        if self.num_heads == 0 || !self.hidden_size.is_multiple_of(self.num_heads) {
            return Err(bad("hidden_size must be a multiple of num_heads"));
        }
        if !self.head_dim().is_multiple_of(4) {
            return Err(bad("the head size must be a multiple of 4 (2-D rotary)"));
        }
        if self.depth > MAX_DEPTH {
            return Err(bad(&format!("depth {} is past {MAX_DEPTH}", self.depth)));
        }
        let Some(unit) = self.spatial_merge_size.checked_mul(self.patch_size) else {
            return Err(bad("spatial_merge_size * patch_size overflows"));
        };
        if self.spatial_merge_size == 0 || unit == 0 || self.window_size < unit {
            return Err(bad(
                "window_size must cover at least one merged patch group",
            ));
        }
        Ok(())
    }
}

/// A block's (or the merger's) norm: RMSNorm (Qwen2.5-VL) or LayerNorm (Qwen2-VL), eps 1e-6.
enum Norm {
    Rms(RmsNorm),
    Layer(LayerNorm),
}

impl Norm {
    fn load(w: &Weights, dim: usize, family: Family) -> std::result::Result<Self, LoadError> {
        Ok(match family {
            Family::Qwen25 => Self::Rms(RmsNorm::load(w, dim, 1e-6)?),
            Family::Qwen2 => Self::Layer(LayerNorm::load(w, dim, 1e-6)?),
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Rms(n) => n.forward(x),
            Self::Layer(n) => n.forward(x),
        }
    }

    /// `(x + residual, norm(x + residual))` (one kernel for RMSNorm on GPUs).
    fn forward_add(&self, x: &Tensor, residual: &Tensor) -> Result<(Tensor, Tensor)> {
        match self {
            Self::Rms(n) => n.forward_add(x, residual),
            Self::Layer(n) => n.forward_add(x, residual),
        }
    }
}

/// A block's MLP: gated SiLU (Qwen2.5-VL) or `fc2(act(fc1(x)))` (Qwen2-VL).
enum BlockMlp {
    Gated(Mlp),
    Plain(VitMlp),
}

impl BlockMlp {
    fn forward(&self, x: &Tensor, ctx: &LayerCtx<'_>) -> Result<Tensor> {
        match self {
            Self::Gated(m) => m.forward(x, ctx),
            Self::Plain(m) => m.forward(x, ctx),
        }
    }
}

struct Block {
    norm1: Norm,
    qkv: Linear, // [3 * hidden, hidden]
    proj: Linear,
    norm2: Norm,
    mlp: BlockMlp,
    full: bool,
}

/// The loaded encoder.
pub struct Qwen25Vision {
    cfg: VisionConfig,
    patch_embed: Tensor, // [hidden, patch_dim]
    blocks: Vec<Block>,
    ln_q: Norm,
    merger_in: Linear,  // [4 * hidden, 4 * hidden]
    merger_out: Linear, // [out_hidden, 4 * hidden]
    inv_freq: Vec<f32>, // [head_dim / 4]
}

/// The host-side layout of one batch of images.
struct Layout {
    /// Patch rows in window order (indices into the processor's order).
    order: Vec<u32>,
    /// Merged tokens back from window order to the processor's order.
    unorder: Vec<u32>,
    /// Per patch in window order: the (h, w) rotary position.
    hw: Vec<(u32, u32)>,
    /// Segment bounds for the windowed and the full blocks.
    windows: Vec<usize>,
    images: Vec<usize>,
}

impl Qwen25Vision {
    pub fn load(cfg: VisionConfig, w: &Weights) -> std::result::Result<Self, LoadError> {
        cfg.validate()?;
        let hid = cfg.hidden_size;
        let patch = w.get(
            &[
                hid,
                cfg.in_chans,
                cfg.temporal_patch_size,
                cfg.patch_size,
                cfg.patch_size,
            ],
            "patch_embed.proj.weight",
        )?;
        let patch_embed = patch
            .reshape((hid, cfg.patch_dim()))
            .map_err(|e| LoadError::Tensor {
                name: w.name_of("patch_embed.proj.weight"),
                reason: e.to_string(),
            })?;
        let family = cfg.family;
        let mut blocks = Vec::with_capacity(cfg.depth);
        for i in 0..cfg.depth {
            let b = w.pp("blocks").pp(i);
            let inter = cfg.intermediate_size;
            let mlp = match family {
                // 3420 wide in the released towers: padded to whole 16-byte vectors
                Family::Qwen25 => {
                    BlockMlp::Gated(Mlp::load_padded(&b.pp("mlp"), hid, inter, true, 8)?)
                }
                Family::Qwen2 => {
                    let act = VitAct::parse(&cfg.hidden_act)?;
                    BlockMlp::Plain(VitMlp::load(&b.pp("mlp"), hid, inter, act)?)
                }
            };
            blocks.push(Block {
                norm1: Norm::load(&b.pp("norm1"), hid, family)?,
                qkv: Linear::load(&b.pp("attn").pp("qkv"), hid, 3 * hid, true)?,
                proj: Linear::load(&b.pp("attn").pp("proj"), hid, hid, true)?,
                norm2: Norm::load(&b.pp("norm2"), hid, family)?,
                mlp,
                full: cfg.fullatt_block_indexes.contains(&i),
            });
        }
        let m = w.pp("merger");
        let wide = hid * cfg.spatial_merge_size * cfg.spatial_merge_size;
        let quarter = cfg.head_dim() / 2;
        let inv_freq = (0..quarter / 2)
            .map(|i| 1.0 / 10000f32.powf((2 * i) as f32 / quarter as f32))
            .collect();
        Ok(Self {
            ln_q: Norm::load(&m.pp("ln_q"), hid, family)?,
            merger_in: Linear::load(&m.pp("mlp").pp(0), wide, wide, true)?,
            merger_out: Linear::load(&m.pp("mlp").pp(2), wide, cfg.out_hidden_size, true)?,
            cfg,
            patch_embed,
            blocks,
            inv_freq,
        })
    }

    pub fn config(&self) -> &VisionConfig {
        &self.cfg
    }

    /// The window order, rotary positions and segments of images with patch grids `grids`.
    fn layout(&self, grids: &[[usize; 3]]) -> Layout {
        let m = self.cfg.spatial_merge_size;
        let unit = m * m;
        let win = self.cfg.window_size / m / self.cfg.patch_size; // merged groups per window side
        let mut l = Layout {
            order: Vec::new(),
            unorder: Vec::new(),
            hw: Vec::new(),
            windows: vec![0],
            images: vec![0],
        };
        let mut merged_order: Vec<usize> = Vec::new();
        let mut base = 0; // merged groups of earlier images
        for &[gt, gh, gw] in grids {
            let (lh, lw) = (gh / m, gw / m);
            let (nh, nw) = (lh.div_ceil(win), lw.div_ceil(win));
            for t in 0..gt {
                for wy in 0..nh {
                    for wx in 0..nw {
                        let mut n = 0;
                        for y in wy * win..((wy + 1) * win).min(lh) {
                            for x in wx * win..((wx + 1) * win).min(lw) {
                                merged_order.push(base + (t * lh + y) * lw + x);
                                n += 1;
                            }
                        }
                        if n > 0 {
                            l.windows
                                .push(l.windows.last().copied().unwrap_or(0) + n * unit);
                        }
                    }
                }
                l.images
                    .push(l.images.last().copied().unwrap_or(0) + gh * gw);
            }
            base += gt * lh * lw;
        }
        // a merged group's patches are contiguous in the processor's order: group g (row y,
        // column x of its frame's merged grid) holds patches m*m*g.., at (m*y + i/m, m*x + i%m)
        let mut geo = Vec::with_capacity(base); // per merged group: (y, x)
        for &[gt, gh, gw] in grids {
            let (lh, lw) = (gh / m, gw / m);
            for _ in 0..gt {
                for y in 0..lh {
                    for x in 0..lw {
                        geo.push((y, x));
                    }
                }
            }
        }
        for &g in &merged_order {
            let (y, x) = geo.get(g).copied().unwrap_or((0, 0));
            for i in 0..unit {
                l.order.push((g * unit + i) as u32);
                l.hw.push(((y * m + i / m) as u32, (x * m + i % m) as u32));
            }
        }
        l.unorder = vec![0; merged_order.len()];
        for (pos, &g) in merged_order.iter().enumerate() {
            if let Some(slot) = l.unorder.get_mut(g) {
                *slot = pos as u32;
            }
        }
        l
    }

    /// Per patch (window order): rotary cos and sin `[N, head_dim / 2]`, the height position's
    /// frequencies, then the width position's. The tables are computed once per position value
    /// (in f32, up to the largest grid side `side`) on the host and gathered per patch on the
    /// device by the patches' positions `hs` and `ws`.
    fn rotary(
        &self,
        side: usize,
        (hs, ws): (&Tensor, &Tensor),
        dtype: DType,
    ) -> Result<(Tensor, Tensor)> {
        let q = self.inv_freq.len();
        let mut cos = Vec::with_capacity(side * q);
        let mut sin = Vec::with_capacity(side * q);
        for p in 0..side {
            for f in &self.inv_freq {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        let gather = |table: Vec<f32>| -> Result<Tensor> {
            let t = Tensor::from_vec(table, (side, q), hs.device())?.to_dtype(dtype)?;
            Tensor::cat(&[t.index_select(hs, 0)?, t.index_select(ws, 0)?], 1)
        };
        Ok((gather(cos)?, gather(sin)?))
    }

    /// The encoder's dtype (the pixels are taken in it).
    pub fn dtype(&self) -> DType {
        self.patch_embed.dtype()
    }

    /// Encodes the patches of several images: `pixels` `[N, patch_dim]` (the processor's rows,
    /// images one after another) with their grids; returns `[N / merge^2, out_hidden]` in the
    /// processor's order. The pass's index tables (window order, rotary positions, the merger's
    /// order back) go to the device in one call of `upload`: on a GPU through pinned buffers, as
    /// a copy from pageable memory this large waits for the work in flight (the step before) and
    /// the device would then idle while the host issues the encoder.
    pub fn forward(
        &self,
        pixels: &Tensor,
        grids: &[[usize; 3]],
        upload: &dyn Fn(&[u32]) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let dev = pixels.device().clone();
        let profile = Profile::from_env(&dev);
        let dtype = self.dtype();
        let l = self.layout(grids);
        let n = l.order.len();
        if pixels.dim(0)? != n {
            candle_core::bail!("{} patch rows for grids totalling {n}", pixels.dim(0)?);
        }
        let merged = l.unorder.len();
        let mut tables: Vec<u32> = Vec::with_capacity(4 * n + merged);
        tables.extend_from_slice(&l.order);
        tables.extend(l.hw.iter().map(|&(h, _)| h));
        tables.extend(l.hw.iter().map(|&(_, w)| w));
        tables.extend(0..n as u32);
        tables.extend_from_slice(&l.unorder);
        let side =
            l.hw.iter()
                .map(|&(h, w)| h.max(w) as usize + 1)
                .max()
                .unwrap_or(0);
        let tables = upload(&tables)?;
        let order = tables.narrow(0, 0, n)?;
        let hs = tables.narrow(0, n, n)?;
        let ws = tables.narrow(0, 2 * n, n)?;
        let positions = tables.narrow(0, 3 * n, n)?;
        let unorder = tables.narrow(0, 4 * n, merged)?;
        let (cos, sin) = self.rotary(side, (&hs, &ws), dtype)?;
        let (heads, hd) = (self.cfg.num_heads, self.cfg.head_dim());
        let windows = SegmentPlan::new(&l.windows, n, &dev, dtype, hd)?;
        let images = SegmentPlan::new(&l.images, n, &dev, dtype, hd)?;
        let ctx = LayerCtx::default();
        profile.mark("layout and tables")?;
        let x = pixels.to_dtype(dtype)?.index_select(&order, 0)?;
        let mut x = x.matmul(&self.patch_embed.t()?)?; // [N, hidden]
        profile.mark("patch embedding")?;
        // each residual add is fused with the norm after it (norm2, the next block's norm1,
        // and the merger's ln_q after the last block)
        let mut h = match self.blocks.first() {
            Some(b) => b.norm1.forward(&x)?,
            None => self.ln_q.forward(&x)?,
        };
        for (i, b) in self.blocks.iter().enumerate() {
            let qkv = b
                .qkv
                .forward(&h, &ctx)?
                .reshape((n, 3 * heads, hd))?
                .contiguous()?;
            // one fused kernel; tables in the model's dtype (f32 tables in unfused ops cost
            // more than they bring: see benchmarks/gpu-notes.md)
            rserve_kernels::rotary_qk_(&qkv, &positions, &cos, &sin, 2 * heads)?;
            profile.mark("qkv + rotary")?;
            let plan = if b.full { &images } else { &windows };
            let a = plan.attend(&qkv, heads)?; // [N, hidden]
            profile.mark(if b.full {
                "full attention"
            } else {
                "window attention"
            })?;
            let (x1, h2) = b.norm2.forward_add(&b.proj.forward(&a, &ctx)?, &x)?;
            profile.mark("proj + add + norm")?;
            let next = match self.blocks.get(i + 1) {
                Some(nb) => &nb.norm1,
                None => &self.ln_q,
            };
            (x, h) = next.forward_add(&b.mlp.forward(&h2, &ctx)?, &x1)?;
            profile.mark("MLP + add + norm")?;
        }
        let wide = self.merger_in.shape().1;
        let y = h.reshape((n * self.cfg.hidden_size / wide, wide))?;
        let y = self.merger_in.forward(&y, &ctx)?.gelu_erf()?;
        let y = self.merger_out.forward(&y, &ctx)?;
        let y = y.index_select(&unorder, 0)?;
        profile.mark("merger")?;
        profile.report(n);
        Ok(y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Numbers from config.json that no tower has are load errors, not an allocation of
    /// `depth` entries or an overflow.
    #[test]
    fn out_of_range_qwen2_configs_are_errors() {
        let ok = VisionConfig::from(Qwen2VisionConfig::default());
        assert!(ok.validate().is_ok());
        assert_eq!(ok.fullatt_block_indexes.len(), 32);
        for c in [
            Qwen2VisionConfig {
                depth: usize::MAX,
                ..Default::default()
            },
            Qwen2VisionConfig {
                spatial_merge_size: usize::MAX,
                patch_size: 3,
                ..Default::default()
            },
            Qwen2VisionConfig {
                spatial_merge_size: 0,
                ..Default::default()
            },
        ] {
            let v = VisionConfig::from(c.clone());
            assert!(v.validate().is_err(), "{c:?}");
            assert!(v.fullatt_block_indexes.len() <= MAX_DEPTH + 1);
        }
    }
}
