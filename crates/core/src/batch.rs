//! [`ForwardBatch`]: one step's tokens as the model sees them (ids, positions, the attention
//! metadata, which rows want logits). Built by the model runner, read by every layer; its own
//! module so that models and the runner depend on it and not on each other.

use candle_core::Tensor;
use rserve_kernels::AttentionMetadata;
use std::sync::Arc;

/// The device-side description of one step's tokens.
#[derive(Debug, Clone)]
pub struct ForwardBatch {
    pub input_ids: Tensor,      // [num_tokens] u32
    pub positions: Tensor,      // [num_tokens] u32
    pub logits_indices: Tensor, // [num_logit_rows] u32
    /// Slot mapping, block tables, sequence lengths and query starts, shared by every layer.
    pub attn: Arc<AttentionMetadata>,
    /// The adapter slot of each token (`None`: no adapters in this batch).
    pub adapter_slots: Option<Tensor>, // [num_tokens] u32
}

impl ForwardBatch {
    /// The context of this batch's token rows, for the layers.
    pub fn layer_ctx(&self) -> LayerCtx<'_> {
        LayerCtx {
            adapter_slots: self.adapter_slots.as_ref(),
        }
    }
}

/// What a layer may need of the rows it transforms beyond the rows themselves: which adapter each
/// row uses (a LoRA wrapper of a [`crate::models::layers::linear::Linear`] reads it; `None`
/// when the batch uses no adapter). Image spans join it with vision models.
#[derive(Debug, Clone, Copy, Default)]
pub struct LayerCtx<'a> {
    pub adapter_slots: Option<&'a Tensor>, // [rows] u32, one per row of the layer's input
}
