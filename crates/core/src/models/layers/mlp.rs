//! The gated MLP of Llama-family models: `down(silu(gate(x)) * up(x))`, with gate and up as one
//! projection and SiLU-and-multiply as one op.

use super::linear::Linear;
use crate::batch::LayerCtx;
use crate::load_error::LoadError;
use crate::weights::Weights;
use candle_core::{Result, Tensor};

/// Zero rows (`dim` 0) or columns (`dim` 1) appended to `t` until that dimension is `to`.
fn pad_with_zeros(t: Tensor, dim: usize, to: usize) -> Result<Tensor> {
    let have = t.dim(dim)?;
    if have >= to {
        return Ok(t);
    }
    let mut shape = t.dims().to_vec();
    shape[dim] = to - have;
    let zeros = Tensor::zeros(shape, t.dtype(), t.device())?;
    Tensor::cat(&[&t, &zeros], dim)
}

#[derive(Debug, Clone)]
pub struct Mlp {
    gate_up_proj: Linear, // [2 * intermediate, hidden]: gate rows, then up rows
    down_proj: Linear,
}

impl Mlp {
    pub fn load(
        w: &Weights,
        hidden: usize,
        intermediate: usize,
        bias: bool,
    ) -> std::result::Result<Self, LoadError> {
        Ok(Self {
            gate_up_proj: Linear::load_fused(
                &[
                    (&w.pp("gate_proj"), intermediate),
                    (&w.pp("up_proj"), intermediate),
                ],
                hidden,
                bias,
            )?,
            down_proj: Linear::load(&w.pp("down_proj"), intermediate, hidden, bias)?,
        })
    }

    /// [`Self::load`] with the intermediate width padded with zeros to a multiple of `multiple`
    /// (for dense, unadapted weights: a vision tower's). The padded units compute `silu(0) * 0`
    /// and meet zero columns of `down_proj`, so the output is the same; rows of a width that is a
    /// whole number of 16-byte vectors keep the products and the SiLU on their fast paths
    /// (Qwen2.5-VL's 3420 is not).
    pub fn load_padded(
        w: &Weights,
        hidden: usize,
        intermediate: usize,
        bias: bool,
        multiple: usize,
    ) -> std::result::Result<Self, LoadError> {
        let padded = intermediate.next_multiple_of(multiple.max(1));
        if padded == intermediate {
            return Self::load(w, hidden, intermediate, bias);
        }
        let err = |e: candle_core::Error| LoadError::Tensor {
            name: w.name_of("mlp (padded)"),
            reason: e.to_string(),
        };
        let part = |name: &str| -> std::result::Result<(Tensor, Option<Tensor>), LoadError> {
            let (weight, b) = Linear::load_parts(&w.pp(name), hidden, intermediate, bias)?;
            let pad = |t: Tensor| pad_with_zeros(t, 0, padded).map_err(err);
            Ok((pad(weight)?, b.map(pad).transpose()?))
        };
        let (gate, gate_b) = part("gate_proj")?;
        let (up, up_b) = part("up_proj")?;
        let gate_up_bias = match (gate_b, up_b) {
            (Some(g), Some(u)) => Some(Tensor::cat(&[&g, &u], 0).map_err(err)?),
            _ => None,
        };
        let (down_weight, down_bias) =
            Linear::load_parts(&w.pp("down_proj"), intermediate, hidden, bias)?;
        let down_weight = pad_with_zeros(down_weight, 1, padded).map_err(err)?;
        Ok(Self {
            gate_up_proj: Linear::new(Tensor::cat(&[&gate, &up], 0).map_err(err)?, gate_up_bias),
            down_proj: Linear::new(down_weight, down_bias),
        })
    }

    /// `x`: `[num_tokens, hidden]`.
    pub fn forward(&self, x: &Tensor, ctx: &LayerCtx<'_>) -> Result<Tensor> {
        self.forward_with(x, None, ctx)
    }

    /// Whether the gate-up product would take `x`'s rows in FP8 form.
    pub fn takes_fp8_rows(&self, x: &Tensor) -> bool {
        self.gate_up_proj.takes_fp8_rows(x)
    }

    /// [`Mlp::forward`] of `x`, whose FP8 form `rows` may come with it. An FP8 gate-up product
    /// hands the down product its activations in FP8 form as well.
    pub fn forward_with(
        &self,
        x: &Tensor,
        rows: Option<&rserve_kernels::fp8::Fp8Rows>,
        ctx: &LayerCtx<'_>,
    ) -> Result<Tensor> {
        let (h, h_rows) = self.gate_up_proj.forward_silu_glu_rows(x, rows, ctx)?;
        let h_rows = h_rows.filter(|_| self.down_proj.takes_fp8_rows(&h));
        self.down_proj.forward_with(&h, h_rows.as_ref(), ctx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn padding_the_intermediate_width_keeps_the_output() -> Result<()> {
        let dev = Device::Cpu;
        let (h, i) = (8, 5);
        let mut t = std::collections::HashMap::new();
        for (name, shape) in [
            ("gate_proj.weight", vec![i, h]),
            ("up_proj.weight", vec![i, h]),
            ("down_proj.weight", vec![h, i]),
            ("gate_proj.bias", vec![i]),
            ("up_proj.bias", vec![i]),
            ("down_proj.bias", vec![h]),
        ] {
            t.insert(name.to_string(), Tensor::randn(0f32, 1.0, shape, &dev)?);
        }
        let path = std::env::temp_dir().join(format!("rserve-mlp-pad-{}.st", std::process::id()));
        candle_core::safetensors::save(&t, &path)?;
        let w = Weights::open(std::slice::from_ref(&path), DType::F32, &dev)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let load = |multiple: usize| {
            Mlp::load_padded(&w, h, i, true, multiple)
                .map_err(|e| candle_core::Error::Msg(e.to_string()))
        };
        let (plain, padded) = (load(1)?, load(8)?);
        assert_eq!(padded.gate_up_proj.shape(), (16, h));
        assert_eq!(padded.down_proj.shape(), (h, 8));
        let x = Tensor::randn(0f32, 1.0, (3, h), &dev)?;
        let ctx = LayerCtx::default();
        let d = (plain.forward(&x, &ctx)? - padded.forward(&x, &ctx)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        let _ = std::fs::remove_file(&path);
        assert!(d < 1e-5, "max diff {d}");
        Ok(())
    }
}
