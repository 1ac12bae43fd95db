//! A dense linear layer `y = x W^T + b` over flattened tokens (`x`: `[num_tokens, in]`).

use crate::loader::LoadError;
use crate::weights::Weights;
use candle_core::{Result, Tensor};

#[derive(Debug, Clone)]
pub struct Linear {
    weight: Tensor,       // [out, in]
    bias: Option<Tensor>, // [out]
}

impl Linear {
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self { weight, bias }
    }

    /// Loads `weight` (and `bias` when `bias` is true) under `w`.
    pub fn load(
        w: &Weights,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
    ) -> std::result::Result<Self, LoadError> {
        let weight = w.get(&[out_dim, in_dim], "weight")?;
        let bias = if bias {
            Some(w.get(&[out_dim], "bias")?)
        } else {
            None
        };
        Ok(Self { weight, bias })
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// `x`: `[num_tokens, in]` -> `[num_tokens, out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = x.matmul(&self.weight.t()?)?;
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}
