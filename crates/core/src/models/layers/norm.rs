//! RMSNorm as in Llama: `x / sqrt(mean(x^2) + eps) * weight`, computed in f32.

use crate::load_error::LoadError;
use crate::weights::Weights;
use candle_core::{Result, Tensor};

#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor, // [dim]
    eps: f32,
}

impl RmsNorm {
    pub fn load(w: &Weights, dim: usize, eps: f64) -> std::result::Result<Self, LoadError> {
        Ok(Self {
            weight: w.get(&[dim], "weight")?,
            eps: eps as f32,
        })
    }

    /// Normalises over the last dimension.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        candle_nn::ops::rms_norm(&x.contiguous()?, &self.weight, self.eps)
    }

    /// `(x + residual, norm(x + residual))` in one op on GPUs.
    pub fn forward_add(&self, x: &Tensor, residual: &Tensor) -> Result<(Tensor, Tensor)> {
        rserve_kernels::add_rms_norm(x, residual, &self.weight, f64::from(self.eps))
    }

    /// [`RmsNorm::forward_add`] with the normed rows' FP8 form, for an FP8 product that would
    /// quantize them itself (one kernel on GPUs).
    pub fn forward_add_fp8(
        &self,
        x: &Tensor,
        residual: &Tensor,
    ) -> Result<(Tensor, Tensor, rserve_kernels::fp8::Fp8Rows)> {
        rserve_kernels::fp8::add_rms_norm_rows(x, residual, &self.weight, f64::from(self.eps))
    }

    /// [`RmsNorm::forward_add`] of a row-parallel layer's partial output `x`, summed over the
    /// ranks of `comm` first (in one kernel where `comm` has one).
    pub fn forward_reduce_add(
        &self,
        x: &Tensor,
        residual: &Tensor,
        comm: &dyn crate::parallel::Collective,
    ) -> Result<(Tensor, Tensor)> {
        comm.all_reduce_add_rms_norm(x, residual, &self.weight, f64::from(self.eps))
    }
}
