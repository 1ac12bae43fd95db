//! The LoRA linear method: a base method (dense, quantized, FP8: any [`LinearMethod`]) plus the
//! LoRA term of each row's adapter, read from the projection's device slots. A batch without
//! adapters (no `adapter_slots` in the [`LayerCtx`]) runs the base method alone, its fused
//! kernels included, so serving without adapters costs nothing.

use super::slots::ProjectionSlots;
use crate::batch::LayerCtx;
use crate::models::layers::linear::LinearMethod;
use candle_core::{Result, Tensor};
use rserve_kernels::lora::{lora_add, LoraStack};
use std::sync::Arc;

/// A projection whose rows may carry an adapter.
#[derive(Debug)]
pub struct LoraLinear {
    base: Arc<dyn LinearMethod>,
    slots: Arc<ProjectionSlots>,
}

impl LoraLinear {
    pub fn new(base: Arc<dyn LinearMethod>, slots: Arc<ProjectionSlots>) -> Self {
        Self { base, slots }
    }

    fn with_term(&self, y: Tensor, x: &Tensor, slots: &Tensor) -> Result<Tensor> {
        let stack = LoraStack {
            a: &self.slots.a,
            b: &self.slots.b,
            parts: &self.slots.widths,
        };
        lora_add(&y, x, &stack, slots)
    }
}

impl LinearMethod for LoraLinear {
    fn matmul(&self, x: &Tensor, ctx: &LayerCtx<'_>) -> Result<Tensor> {
        let y = self.base.matmul(x, ctx)?;
        match ctx.adapter_slots {
            Some(s) => self.with_term(y, x, s),
            None => Ok(y),
        }
    }

    fn matmul_silu_glu(&self, x: &Tensor, ctx: &LayerCtx<'_>) -> Result<Tensor> {
        match ctx.adapter_slots {
            None => self.base.matmul_silu_glu(x, ctx),
            Some(_) => rserve_kernels::silu_and_mul(&self.matmul(x, ctx)?),
        }
    }

    fn shape(&self) -> (usize, usize) {
        self.base.shape()
    }
}
