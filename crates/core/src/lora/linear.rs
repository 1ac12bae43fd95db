//! The LoRA linear method: a base method (dense, quantized, FP8: any [`LinearMethod`]) plus the
//! LoRA term of each row's adapter, read from the projection's device slots. A batch without
//! adapters (no rows in the [`LayerCtx`]'s `lora`) runs the base method alone, its fused
//! kernels included, so serving without adapters costs nothing. Decode batches over a dense base
//! take the fused products of [`rserve_kernels::lora_gemv`] where they apply.

use super::slots::ProjectionSlots;
use crate::batch::LayerCtx;
use crate::models::layers::linear::LinearMethod;
use candle_core::{Result, Tensor};
use rserve_kernels::lora::{lora_add, lora_add_silu_glu, LoraStack};
use rserve_kernels::lora_gemv::{
    linear_rows_lora, linear_rows_lora_runs, linear_rows_lora_stacked,
};
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

    fn stack(&self) -> LoraStack<'_> {
        LoraStack {
            a: &self.slots.a,
            b: &self.slots.b,
            parts: &self.slots.widths,
        }
    }

    /// The product with the LoRA term in one of the fused forms of a dense base on CUDA, or
    /// `None`: for decode rows, the two-launch product for a few rows and the product over the
    /// weight stored above the slots for more; for steps with prompt runs, the runs' terms
    /// first and the product added onto them.
    fn fused(&self, x: &Tensor, ctx: &LayerCtx<'_>, glu: bool) -> Result<Option<Tensor>> {
        let Some(w) = self.base.dense_weight() else {
            return Ok(None);
        };
        let stack = self.stack();
        let (Some(slots), true) = (ctx.lora.slots, ctx.lora.runs.is_empty()) else {
            return linear_rows_lora_runs(x, w, &stack, &ctx.lora, glu);
        };
        if let Some(y) = linear_rows_lora(x, w, &stack, slots, glu)? {
            return Ok(Some(y));
        }
        match &self.slots.stacked {
            Some(w_ext) => {
                linear_rows_lora_stacked(x, w_ext, &stack, slots, glu, ctx.lora_slots_covered)
            }
            None => Ok(None),
        }
    }
}

impl LinearMethod for LoraLinear {
    fn matmul(&self, x: &Tensor, ctx: &LayerCtx<'_>) -> Result<Tensor> {
        if let Some(y) = self.fused(x, ctx, false)? {
            return Ok(y);
        }
        let y = self.base.matmul(x, ctx)?;
        if !ctx.lora.any() {
            return Ok(y);
        }
        // y is this call's own product: the term may be added in place
        lora_add(&y, x, &self.stack(), &ctx.lora)
    }

    fn matmul_silu_glu(&self, x: &Tensor, ctx: &LayerCtx<'_>) -> Result<Tensor> {
        if !ctx.lora.any() {
            return self.base.matmul_silu_glu(x, ctx);
        }
        if let Some(y) = self.fused(x, ctx, true)? {
            return Ok(y);
        }
        let y = self.base.matmul(x, ctx)?;
        lora_add_silu_glu(&y, x, &self.stack(), &ctx.lora)
    }

    fn shape(&self) -> (usize, usize) {
        self.base.shape()
    }
}
