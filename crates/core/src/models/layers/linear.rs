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

    /// Several projections of the same input as one: the weights (and biases) of `parts` (each a
    /// prefix and its output width) stacked along the output dimension, in order.
    pub fn load_fused(
        parts: &[(&Weights, usize)],
        in_dim: usize,
        bias: bool,
    ) -> std::result::Result<Self, LoadError> {
        let loaded = parts
            .iter()
            .map(|(w, out)| Self::load(w, in_dim, *out, bias))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        if loaded.len() == 1 {
            return Ok(loaded.into_iter().next().expect("one part"));
        }
        let fuse = |ts: Vec<&Tensor>| {
            Tensor::cat(&ts, 0).map_err(|e| LoadError::Tensor {
                name: "fused projection".into(),
                reason: e.to_string(),
            })
        };
        let weight = fuse(loaded.iter().map(|l| &l.weight).collect())?;
        let bias = if bias {
            Some(fuse(
                loaded.iter().filter_map(|l| l.bias.as_ref()).collect(),
            )?)
        } else {
            None
        };
        Ok(Self { weight, bias })
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// For a fused gate-up projection (gate rows, then up rows): `silu(gate) * up`,
    /// `[num_tokens, out / 2]` (one kernel for decode batches on CUDA when there is no bias).
    pub fn forward_silu_glu(&self, x: &Tensor) -> Result<Tensor> {
        match &self.bias {
            None => rserve_kernels::silu_glu_rows(x, &self.weight),
            Some(_) => rserve_kernels::silu_and_mul(&self.forward(x)?),
        }
    }

    /// `x`: `[num_tokens, in]` -> `[num_tokens, out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = rserve_kernels::linear_rows(x, &self.weight)?;
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}
