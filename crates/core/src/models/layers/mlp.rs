//! The gated MLP of Llama-family models: `down(silu(gate(x)) * up(x))`.

use super::linear::Linear;
use crate::loader::LoadError;
use crate::weights::Weights;
use candle_core::{Result, Tensor};

#[derive(Debug, Clone)]
pub struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
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
            gate_proj: Linear::load(&w.pp("gate_proj"), hidden, intermediate, bias)?,
            up_proj: Linear::load(&w.pp("up_proj"), hidden, intermediate, bias)?,
            down_proj: Linear::load(&w.pp("down_proj"), intermediate, hidden, bias)?,
        })
    }

    /// `x`: `[num_tokens, hidden]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let g = candle_nn::ops::silu(&self.gate_proj.forward(x)?)?;
        self.down_proj.forward(&(g * self.up_proj.forward(x)?)?)
    }
}
