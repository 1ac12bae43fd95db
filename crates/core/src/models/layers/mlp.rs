//! The gated MLP of Llama-family models: `down(silu(gate(x)) * up(x))`, with gate and up as one
//! projection and SiLU-and-multiply as one op.

use super::linear::Linear;
use crate::batch::LayerCtx;
use crate::load_error::LoadError;
use crate::weights::Weights;
use candle_core::{Result, Tensor};

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

    /// `x`: `[num_tokens, hidden]`.
    pub fn forward(&self, x: &Tensor, ctx: &LayerCtx<'_>) -> Result<Tensor> {
        let h = self.gate_up_proj.forward_silu_glu(x, ctx)?;
        self.down_proj.forward(&h, ctx)
    }
}
