//! Rotary position embeddings (rotate-half layout) with Hugging Face's frequency rules: default,
//! `linear` and `llama3` scaling. Tables are precomputed in f32 exactly as transformers does, then
//! gathered per token by position so any mix of positions runs in one call.
//!
//! Qwen2-VL's M-RoPE splits the frequencies into three sections that follow a token's temporal,
//! height and width positions: a step with image tokens gathers per-token tables once
//! ([`RotaryEmbedding::for_step`]) and the same kernel rotates by them. Text tokens have three
//! equal positions, so steps without image tokens take the plain path.

use crate::batch::ForwardBatch;
use crate::kv_cache::LayerKv;
use candle_core::{DType, Device, Result, Tensor};

/// How the base frequencies are rescaled for long contexts.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// Llama 3.1's frequency-dependent scaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: f32,
    },
    /// Each frequency divided by its own factor (llama.cpp's `rope_freqs`).
    Factors(Vec<f32>),
}

/// Rotary settings of a model.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f32,
    pub scaling: RopeScaling,
}

/// The inverse frequencies (`[head_dim / 2]`) as transformers computes them in f32.
pub fn inv_freq(head_dim: usize, cfg: &RopeConfig) -> Vec<f32> {
    let base: Vec<f32> = (0..head_dim / 2)
        .map(|i| 1.0 / cfg.theta.powf((2 * i) as f32 / head_dim as f32))
        .collect();
    match cfg.scaling {
        RopeScaling::None => base,
        RopeScaling::Factors(ref factors) => base
            .into_iter()
            .zip(factors.iter().chain(std::iter::repeat(&1.0)))
            .map(|(f, d)| f / d)
            .collect(),
        RopeScaling::Linear { factor } => base.into_iter().map(|f| f / factor).collect(),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: old,
        } => {
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            base.into_iter()
                .map(|f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    let scaled = if wavelen > low_wavelen { f / factor } else { f };
                    let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                    if medium {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * scaled / factor + smooth * scaled
                    } else {
                        scaled
                    }
                })
                .collect()
        }
    }
}

#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    cos: Tensor, // [max_positions, head_dim / 2]
    sin: Tensor, // [max_positions, head_dim / 2]
    /// M-RoPE: the frequencies following the temporal, height and width positions.
    mrope: Option<[usize; 3]>,
}

/// One step's rotary tables and the row of each token in them.
#[derive(Debug, Clone)]
pub struct StepRope {
    cos: Tensor,       // [rows, head_dim / 2]
    sin: Tensor,       // [rows, head_dim / 2]
    positions: Tensor, // [num_tokens] u32: each token's row
}

impl StepRope {
    /// Rotates the q and k heads of `qkv` (`[num_tokens, heads + 2 * kv_heads, head_dim]`,
    /// contiguous) in place and writes its k and v heads into this layer's cache at the step's
    /// slots (one kernel on CUDA).
    pub fn rotate_and_cache_(
        &self,
        qkv: &Tensor,
        heads: (usize, usize),
        cache: &LayerKv,
        meta: &rserve_kernels::AttentionMetadata,
    ) -> Result<()> {
        rserve_kernels::rotary_qk_cache_(
            qkv,
            &self.positions,
            &self.cos,
            &self.sin,
            heads,
            &cache.k,
            &cache.v,
            meta,
            cache.scales,
        )
    }
}

impl RotaryEmbedding {
    pub fn new(
        head_dim: usize,
        max_positions: usize,
        cfg: &RopeConfig,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let inv = inv_freq(head_dim, cfg);
        let half = inv.len();
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        for p in 0..max_positions {
            for f in &inv {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        let cos = Tensor::from_vec(cos, (max_positions, half), device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (max_positions, half), device)?.to_dtype(dtype)?;
        Ok(Self {
            cos,
            sin,
            mrope: None,
        })
    }

    /// The same tables rotating by M-RoPE with these section sizes (which must sum to
    /// `head_dim / 2`).
    pub fn with_mrope(mut self, section: [usize; 3]) -> Result<Self> {
        let half = self.cos.dim(1)?;
        if section.iter().sum::<usize>() != half {
            candle_core::bail!("mrope_section {section:?} does not sum to head_dim / 2 = {half}");
        }
        self.mrope = Some(section);
        Ok(self)
    }

    /// The tables of `batch`: the whole tables indexed by `batch.positions`, or, with M-RoPE
    /// and 3-D positions in the batch, one gathered row per token.
    pub fn for_step(&self, batch: &ForwardBatch) -> Result<StepRope> {
        let (Some(section), Some(pos3)) = (self.mrope, batch.mrope_positions.as_ref()) else {
            return Ok(StepRope {
                cos: self.cos.clone(),
                sin: self.sin.clone(),
                positions: batch.positions.clone(),
            });
        };
        let t = pos3.dim(1)?; // [3, T]
        let gather = |table: &Tensor| -> Result<Tensor> {
            let mut parts = Vec::with_capacity(3);
            let mut off = 0;
            for (k, &n) in section.iter().enumerate() {
                let pos = pos3.get(k)?;
                parts.push(
                    table
                        .narrow(1, off, n)?
                        .contiguous()?
                        .index_select(&pos, 0)?,
                );
                off += n;
            }
            Tensor::cat(&parts, 1)?.contiguous()
        };
        Ok(StepRope {
            cos: gather(&self.cos)?,
            sin: gather(&self.sin)?,
            positions: Tensor::arange(0u32, t as u32, pos3.device())?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_scaling_keeps_high_and_scales_low_frequencies() {
        let plain = inv_freq(
            16,
            &RopeConfig {
                theta: 500000.0,
                scaling: RopeScaling::None,
            },
        );
        let cfg = RopeConfig {
            theta: 500000.0,
            scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 32.0,
            },
        };
        let scaled = inv_freq(16, &cfg);
        assert_eq!(scaled[0], plain[0]); // wavelength 2*pi < 8
        assert!((scaled[7] - plain[7] / 8.0).abs() < 1e-12); // longest wavelength
                                                             // a GGUF file stores the same scaling as one divisor per frequency (`rope_freqs`)
        let factors: Vec<f32> = plain.iter().zip(&scaled).map(|(p, s)| p / s).collect();
        let from_file = inv_freq(
            16,
            &RopeConfig {
                theta: 500000.0,
                scaling: RopeScaling::Factors(factors),
            },
        );
        for (a, b) in from_file.iter().zip(&scaled) {
            assert!((a - b).abs() <= 1e-6 * b.abs(), "{a} vs {b}");
        }
    }

    #[test]
    fn rotation_matches_rotate_half() -> Result<()> {
        let dev = Device::Cpu;
        let cfg = RopeConfig {
            theta: 10000.0,
            scaling: RopeScaling::None,
        };
        let r = RotaryEmbedding::new(4, 8, &cfg, DType::F32, &dev)?;
        let x = Tensor::new(&[[[1f32, 2., 3., 4.]]], &dev)?; // [1 token, 1 head, 4]
        rserve_kernels::rotary_qk_(&x, &Tensor::new(&[3u32], &dev)?, &r.cos, &r.sin, 1)?;
        let y = x.flatten_all()?.to_vec1::<f32>()?;
        let f = inv_freq(4, &cfg);
        let (a0, a1) = (3.0 * f[0], 3.0 * f[1]);
        let want = [
            1. * a0.cos() - 3. * a0.sin(),
            2. * a1.cos() - 4. * a1.sin(),
            3. * a0.cos() + 1. * a0.sin(),
            4. * a1.cos() + 2. * a1.sin(),
        ];
        for (g, w) in y.iter().zip(want) {
            assert!((g - w).abs() < 1e-5, "{y:?} vs {want:?}");
        }
        Ok(())
    }
}
