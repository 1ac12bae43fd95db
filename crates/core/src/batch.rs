//! [`ForwardBatch`]: one step's tokens as the model sees them (ids, positions, the attention
//! metadata, which rows want logits). Built by the model runner, read by every layer; its own
//! module so that models and the runner depend on it and not on each other.

use candle_core::Tensor;
use rserve_kernels::lora::{LoraRows, LoraRun};
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
    /// The adapter slot of each token left to the gathered LoRA kernels (`None`: none is).
    pub adapter_slots: Option<Tensor>, // [num_tokens] u32
    /// How many leading adapter slots hold every row's adapter (0: not known, all of them):
    /// products that read every slot's `A` rows read only these.
    pub adapter_slots_covered: usize,
    /// Runs of prompt rows sharing an adapter, multiplied as a whole (empty without adapters).
    pub adapter_runs: Vec<LoraRun>,
    /// In a step with runs, the rows of `adapter_slots` that have an adapter and their slots
    /// (`[rows]` u32 each, [`rserve_kernels::lora::listed_rows`]): the gathered kernels launch
    /// over these only.
    pub adapter_listed: Option<(Tensor, Tensor)>,
    /// Image features written over placeholder rows: (first row, `[rows, hidden]`).
    pub image_rows: Vec<(usize, Tensor)>,
    /// The (temporal, height, width) rotary positions of every token, when a row of the step
    /// is an image token of a model with M-RoPE (`positions` then holds the temporal row).
    pub mrope_positions: Option<Tensor>, // [3, num_tokens] u32
}

impl ForwardBatch {
    /// The context of this batch's token rows, for the layers.
    pub fn layer_ctx(&self) -> LayerCtx<'_> {
        LayerCtx {
            lora: LoraRows {
                slots: self.adapter_slots.as_ref(),
                runs: &self.adapter_runs,
                listed: self
                    .adapter_listed
                    .as_ref()
                    .map(|(rows, slots)| (rows, slots)),
            },
            lora_slots_covered: self.adapter_slots_covered,
        }
    }
}

/// What a layer may need of the rows it transforms beyond the rows themselves: which adapter each
/// row uses (a LoRA wrapper of a [`crate::models::layers::linear::Linear`] reads it; empty
/// when the batch uses no adapter). Image spans join it with vision models.
#[derive(Debug, Clone, Copy, Default)]
pub struct LayerCtx<'a> {
    pub lora: LoraRows<'a>,
    /// The leading adapter slots that hold every row's adapter (0: all); see
    /// [`ForwardBatch::adapter_slots_covered`].
    pub lora_slots_covered: usize,
}
