//! Turns a scheduler step into one forward pass: builds the flattened [`ForwardBatch`] (token ids,
//! positions, slot mapping, block tables, sequence lengths, which rows need logits), applies
//! copy-on-write block copies, and runs the model.
//!
//! Owns the model and the KV tensors. Does not decide what runs (the scheduler does) nor what is
//! sampled (the engine does). Row order of the logits equals the order of [`LogitRow`]s returned
//! by [`ModelRunner::prepare`].

use crate::kv_cache::KvCache;
use crate::models::Model;
use crate::scheduler::{Scheduler, SchedulerOutput};
use crate::sequence::SeqId;
use candle_core::{Device, Result, Tensor};
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
}

/// What one row of the returned logits is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRow {
    /// Sample the next token of this sequence.
    Sample(SeqId),
    /// The distribution at prompt position `pos`, scoring prompt token `pos + 1`.
    PromptLogprob { seq: SeqId, pos: usize },
}

/// Runs models over the paged cache.
pub struct ModelRunner {
    model: Box<dyn Model>,
    kv: KvCache,
    device: Device,
}

impl ModelRunner {
    pub fn new(model: Box<dyn Model>, kv: KvCache, device: Device) -> Self {
        Self { model, kv, device }
    }

    pub fn model(&self) -> &dyn Model {
        self.model.as_ref()
    }

    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Builds the batch for `out`. `wants_prompt_logprobs(seq)` says whether a sequence asked for
    /// prompt logprobs (rows for every prompt position in its chunk are then added).
    pub fn prepare(
        &self,
        sched: &Scheduler,
        out: &SchedulerOutput,
        wants_prompt_logprobs: impl Fn(SeqId) -> bool,
    ) -> Result<(ForwardBatch, Vec<LogitRow>)> {
        let bs = sched.kv().block_size();
        let n = out.scheduled.len();
        let mut input_ids = Vec::with_capacity(out.num_batched_tokens);
        let mut positions = Vec::with_capacity(out.num_batched_tokens);
        let mut slots = Vec::with_capacity(out.num_batched_tokens);
        let mut seq_lens = Vec::with_capacity(n);
        let mut qsl = Vec::with_capacity(n + 1);
        qsl.push(0u32);
        let mut rows = Vec::new();
        let mut logit_idx = Vec::new();
        let width = out
            .scheduled
            .iter()
            .map(|s| sched.kv().block_table(s.seq_id).len())
            .max()
            .unwrap_or(1)
            .max(1);
        let mut tables = vec![0u32; n * width];
        for (i, s) in out.scheduled.iter().enumerate() {
            let seq = sched.seq(s.seq_id).ok_or_else(|| {
                candle_core::Error::Msg(format!("scheduled unknown sequence {}", s.seq_id))
            })?;
            let table = sched.kv().block_table(s.seq_id);
            for (j, b) in table.iter().enumerate() {
                tables[i * width + j] = b.0;
            }
            let start = input_ids.len();
            for p in s.num_computed..s.num_computed + s.num_new {
                let tok = *seq.tokens.get(p).ok_or_else(|| {
                    candle_core::Error::Msg(format!("sequence {} has no token {p}", s.seq_id))
                })?;
                input_ids.push(tok);
                positions.push(p as u32);
                let block = table.get(p / bs).ok_or_else(|| {
                    candle_core::Error::Msg(format!(
                        "sequence {} has no block for position {p}",
                        s.seq_id
                    ))
                })?;
                slots.push((block.0 as usize * bs + p % bs) as i64);
            }
            if wants_prompt_logprobs(s.seq_id) {
                let end = (s.num_computed + s.num_new).min(seq.prompt_len.saturating_sub(1));
                for p in s.num_computed..end {
                    rows.push(LogitRow::PromptLogprob {
                        seq: s.seq_id,
                        pos: p,
                    });
                    logit_idx.push((start + p - s.num_computed) as u32);
                }
            }
            if s.samples {
                rows.push(LogitRow::Sample(s.seq_id));
                logit_idx.push((input_ids.len() - 1) as u32);
            }
            seq_lens.push((s.num_computed + s.num_new) as u32);
            qsl.push(input_ids.len() as u32);
        }
        let d = &self.device;
        let t = input_ids.len();
        let batch = ForwardBatch {
            input_ids: Tensor::from_vec(input_ids, t, d)?,
            positions: Tensor::from_vec(positions, t, d)?,
            // a step of prompt chunks only has no logit rows; an empty tensor stays on the host
            // (a GPU launch over zero elements is an error)
            logits_indices: if logit_idx.is_empty() {
                Tensor::zeros(0, candle_core::DType::U32, &Device::Cpu)?
            } else {
                Tensor::from_vec(logit_idx.clone(), logit_idx.len(), d)?
            },
            attn: Arc::new(AttentionMetadata::new(
                slots, tables, width, seq_lens, qsl, d,
            )?),
        };
        Ok((batch, rows))
    }

    /// Applies the step's block copies and runs the model; f32 logits `[rows, vocab]`.
    pub fn execute(&self, out: &SchedulerOutput, batch: &ForwardBatch) -> Result<Tensor> {
        if !out.block_copies.is_empty() {
            let pairs: Vec<(usize, usize)> = out
                .block_copies
                .iter()
                .map(|(s, d)| (s.0 as usize, d.0 as usize))
                .collect();
            self.kv.copy_blocks(&pairs)?;
        }
        self.model.forward(batch, &self.kv)
    }
}

/// Runs one forward pass over a synthetic prompt of `tokens` tokens with `rows` logit rows, on a
/// scratch cache just large enough, to measure the activation peak; returns the scratch cache's
/// bytes (to be subtracted from the peak).
pub fn profile_forward(
    model: &dyn Model,
    dtype: candle_core::DType,
    device: &Device,
    tokens: usize,
    rows: usize,
    block_size: usize,
) -> Result<usize> {
    let mc = model.config();
    let blocks = tokens.div_ceil(block_size).max(1);
    let kv = KvCache::new(
        mc.num_layers,
        blocks,
        block_size,
        mc.num_kv_heads,
        mc.head_dim,
        dtype,
        device,
    )?;
    let ids: Vec<u32> = (0..tokens as u32)
        .map(|i| i % mc.vocab_size as u32)
        .collect();
    let positions: Vec<u32> = (0..tokens as u32).collect();
    let logit_rows: Vec<u32> = (tokens - rows.min(tokens)..tokens)
        .map(|i| i as u32)
        .collect();
    let batch = ForwardBatch {
        input_ids: Tensor::from_vec(ids, tokens, device)?,
        positions: Tensor::from_vec(positions, tokens, device)?,
        logits_indices: Tensor::from_vec(logit_rows.clone(), logit_rows.len(), device)?,
        attn: Arc::new(AttentionMetadata::new(
            (0..tokens as i64).collect(),
            (0..blocks as u32).collect(),
            blocks,
            vec![tokens as u32],
            vec![0, tokens as u32],
            device,
        )?),
    };
    let logits = model.forward(&batch, &kv)?;
    drop(logits);
    device.synchronize()?;
    Ok(KvCache::bytes_per_block(
        mc.num_layers,
        block_size,
        mc.num_kv_heads,
        mc.head_dim,
        dtype,
    ) * blocks)
}
