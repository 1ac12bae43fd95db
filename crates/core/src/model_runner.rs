//! Turns a scheduler step into one forward pass: builds the flattened [`ForwardBatch`] (token ids,
//! positions, slot mapping, block tables, sequence lengths, which rows need logits), applies
//! copy-on-write block copies, and runs the model.
//!
//! On a GPU, a step of decode rows only replays a CUDA graph captured for the smallest batch
//! bucket that holds it ([`graphs`]): its inputs are written into the bucket's tensors, padding
//! rows are inert, and one driver call issues the whole forward pass.
//!
//! Owns the model and the KV tensors. Does not decide what runs (the scheduler does) nor what is
//! sampled (the engine does). Row order of the logits equals the order of [`LogitRow`]s returned
//! by [`ModelRunner::prepare`].

pub mod graphs;

pub use crate::batch::ForwardBatch;
use crate::kv_cache::KvCache;
use crate::lora::AdapterId;
use crate::models::Model;
use crate::multimodal::ImageInput;
use crate::scheduler::{Scheduler, SchedulerOutput};
use crate::sequence::{SeqId, PENDING_TOKEN};
use candle_core::{Device, Result, Tensor};
use graphs::{lora_graph_set, DecodeGraphs, GraphPlan};
use rserve_kernels::lora::{list_gathered_rows, listed_rows, min_run, split_runs, NO_ADAPTER};
use rserve_kernels::lora_gemv::slots_covered;
use rserve_kernels::AttentionMetadata;
use std::collections::HashMap;
use std::sync::Arc;

/// One step's inputs as host arrays, before they go to the device.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HostBatch {
    pub input_ids: Vec<u32>,
    pub positions: Vec<u32>,
    pub slots: Vec<i64>,
    /// `[seqs, width]` block ids.
    pub block_tables: Vec<u32>,
    pub width: usize,
    pub seq_lens: Vec<u32>,
    pub query_start_loc: Vec<u32>,
    pub logits_indices: Vec<u32>,
    /// Rows whose token is still being sampled on the device ([`PENDING_TOKEN`] in `input_ids`):
    /// the row, its sequence and the token's position.
    pub pending: Vec<(u32, SeqId, usize)>,
    /// The adapter slot of each token ([`NO_ADAPTER`] for base rows); empty when no row of the
    /// step uses an adapter.
    pub adapter_slots: Vec<u32>,
    /// The image tokens of the step, one run per image met.
    pub images: Vec<ImageRun>,
    /// `[3, num_tokens]` M-RoPE positions when the step has image tokens of a model using them
    /// (empty otherwise: `positions` says everything).
    pub mrope: Vec<u32>,
}

/// Consecutive rows of the step that take image `image` of sequence `seq`'s prompt, from its
/// token `from` on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageRun {
    pub row: usize,
    pub seq: SeqId,
    pub image: usize,
    pub from: usize,
    pub len: usize,
    /// Whether the run reaches the image's last token.
    pub last: bool,
}

impl HostBatch {
    /// Whether every sequence has exactly one query token and each token is a logit row of its
    /// own, in order: a step a decode graph can run.
    pub fn is_plain_decode(&self) -> bool {
        let n = self.seq_lens.len();
        n > 0
            && self.input_ids.len() == n
            && self
                .query_start_loc
                .iter()
                .zip(0u32..)
                .all(|(&q, j)| q == j)
            && self.logits_indices.len() == n
            && self.logits_indices.iter().zip(0u32..).all(|(&i, j)| i == j)
    }

    /// Uploads the arrays as a [`ForwardBatch`] on `device`; its adapters lie in the first
    /// `adapter_slots_covered` slots ([`slots_covered`] of `adapter_slots`).
    fn upload(self, adapter_slots_covered: usize, device: &Device) -> Result<ForwardBatch> {
        let t = self.input_ids.len();
        let rows = self.logits_indices.len();
        // prompt chunks of one adapter go to the run products, the rest to the gathered kernels
        let mut slots = self.adapter_slots;
        let adapter_runs = split_runs(&mut slots, min_run());
        let (adapter_slots, adapter_listed) = if slots.iter().all(|&s| s == NO_ADAPTER) {
            (None, None)
        } else {
            // beside runs the gathered rows are a few decode rows: the CUDA kernels launch over
            // those rows only (the CPU path groups rows by slot and has no use for the list)
            let listed = if adapter_runs.is_empty() || !device.is_cuda() || !list_gathered_rows() {
                None
            } else {
                let (rows, listed) = listed_rows(&slots);
                let n = rows.len();
                Some((
                    Tensor::from_vec(rows, n, device)?,
                    Tensor::from_vec(listed, n, device)?,
                ))
            };
            (Some(Tensor::from_vec(slots, t, device)?), listed)
        };
        let mrope_positions = if self.mrope.is_empty() {
            None
        } else {
            Some(Tensor::from_vec(self.mrope, (3, t), device)?)
        };
        Ok(ForwardBatch {
            input_ids: Tensor::from_vec(self.input_ids, t, device)?,
            positions: Tensor::from_vec(self.positions, t, device)?,
            // a step of prompt chunks only has no logit rows; an empty tensor stays on the host
            // (a GPU launch over zero elements is an error)
            logits_indices: if rows == 0 {
                Tensor::zeros(0, candle_core::DType::U32, &Device::Cpu)?
            } else {
                Tensor::from_vec(self.logits_indices, rows, device)?
            },
            attn: Arc::new(AttentionMetadata::new(
                self.slots,
                self.block_tables,
                self.width,
                self.seq_lens,
                self.query_start_loc,
                device,
            )?),
            adapter_slots,
            adapter_slots_covered,
            adapter_runs,
            adapter_listed,
            image_rows: Vec::new(),
            mrope_positions,
        })
    }
}

/// A step ready to run: uploaded for an eager forward pass, or written into a graph bucket.
#[derive(Debug)]
pub enum PreparedStep {
    Eager(ForwardBatch),
    /// Replay the graph of `bucket` (rows past `rows` are padding), of LoRA graph set `lora`
    /// (steps with adapter rows) or of the plain set.
    Graph {
        bucket: usize,
        rows: usize,
        lora: Option<usize>,
    },
}

/// A prepared step, the meaning of each logit row, and the rows whose token is still on the device.
pub type Prepared = (PreparedStep, Vec<LogitRow>, Vec<(u32, SeqId, usize)>);

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
    graphs: Option<DecodeGraphs>,
    /// The decode graphs of steps with adapter rows (a model with LoRA slots), one set for each
    /// number of leading slots its products cover, ascending.
    lora_graphs: Vec<DecodeGraphs>,
    /// The slots each of `lora_graphs` covers.
    lora_covers: Vec<usize>,
    /// Encoder outputs of images whose tokens are not all computed yet (a prompt chunk may end
    /// inside an image): `[num_tokens, hidden]` by sequence and image.
    encoder_cache: HashMap<(SeqId, usize), Tensor>,
    /// Images encoded so far (each image of a request once, however its prompt is chunked).
    images_encoded: u64,
    /// Under tensor parallelism: the other ranks, which run every step this one runs.
    followers: Option<Box<dyn Followers>>,
}

/// The other ranks of a tensor-parallel group, as rank 0's runner drives them: each runs the
/// same steps on its shard, in the same order (their collectives meet rank 0's).
pub trait Followers: Send {
    /// Runs the step of `host` after the block copies `copies`.
    fn step(&self, host: &HostBatch, copies: &[(usize, usize)]) -> Result<()>;
    /// Captures the decode graphs (at the same time as rank 0: the capture runs collectives).
    fn capture(&self) -> Result<()>;
    /// Stops the group: rank 0 failed a step the other ranks were already running, so its
    /// collectives and theirs no longer pair up.
    fn fail(&self, why: String);
}

impl ModelRunner {
    /// A runner; `graphs` plans the decode graphs (`None`: every step runs eagerly), with a set
    /// of LoRA graphs for each of `lora_covers` (slot counts, ascending, the last all the
    /// slots; empty without adapters: see [`graphs::lora_graph_covers`]). Graphs are used on
    /// CUDA devices only.
    pub fn new(
        model: Box<dyn Model>,
        kv: KvCache,
        device: Device,
        graphs: Option<GraphPlan>,
        lora_covers: Vec<usize>,
    ) -> Self {
        let plan = graphs.filter(|_| device.is_cuda());
        let vocab = model.config().vocab_size;
        let lora_graphs = match &plan {
            Some(p) => lora_covers
                .iter()
                .map(|&c| DecodeGraphs::new(p.clone(), vocab, Some(c)))
                .collect(),
            None => Vec::new(),
        };
        Self {
            graphs: plan.map(|p| DecodeGraphs::new(p, vocab, None)),
            lora_graphs,
            lora_covers,
            model,
            kv,
            device,
            encoder_cache: HashMap::new(),
            images_encoded: 0,
            followers: None,
        }
    }

    /// This runner as rank 0 of a tensor-parallel group whose other ranks are `followers`.
    pub fn with_followers(mut self, followers: Option<Box<dyn Followers>>) -> Self {
        self.followers = followers;
        self
    }

    /// Captures every decode graph not captured yet (see [`DecodeGraphs::capture_all`]); the
    /// number of graphs ready, 0 without graphs.
    pub fn capture_graphs(&mut self) -> Result<usize> {
        if let Some(f) = &self.followers {
            f.capture()?;
        }
        let mut n = 0;
        // one logits buffer for every set: steps run one at a time
        let mut logits: Option<Tensor> = None;
        for g in self.graphs.iter_mut().chain(self.lora_graphs.iter_mut()) {
            match &logits {
                Some(l) => g.share_logits(l),
                None => logits = Some(g.logits(&self.device)?),
            }
            n += g.capture_all(self.model.as_ref(), &self.kv, &self.device)?;
        }
        Ok(n)
    }

    /// The graph set of steps without adapter rows (`None`) or LoRA set `lora`.
    fn graph_set(&mut self, lora: Option<usize>) -> Option<&mut DecodeGraphs> {
        match lora {
            Some(i) => self.lora_graphs.get_mut(i),
            None => self.graphs.as_mut(),
        }
    }

    /// The graph set a step runs in, with its index for [`PreparedStep::Graph`]: the plain set,
    /// or for a step with adapter rows the smallest LoRA set that covers its `covered` slots;
    /// `None` where there is none (the step runs eagerly).
    fn graph_set_for(
        &mut self,
        lora_rows: bool,
        covered: usize,
    ) -> Option<(Option<usize>, &mut DecodeGraphs)> {
        let set = match lora_rows {
            true => Some(lora_graph_set(&self.lora_covers, covered)?),
            false => None,
        };
        self.graph_set(set).map(|g| (set, g))
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

    /// Builds the host arrays for `out`. A sequence whose request asks for prompt logprobs
    /// ([`crate::sequence::RequestMeta`]) gets a row for every prompt position in its chunk.
    /// Every position is checked against the model's rotary table here, once per step, so no
    /// kernel reads past it.
    pub fn host_batch(
        sched: &Scheduler,
        out: &SchedulerOutput,
        max_positions: usize,
    ) -> Result<(HostBatch, Vec<LogitRow>)> {
        let bs = sched.kv().block_size();
        let n = out.scheduled.len();
        let tokens = out.num_batched_tokens;
        let width = out
            .scheduled
            .iter()
            .map(|s| sched.kv().block_table(s.seq_id).len())
            .max()
            .unwrap_or(1)
            .max(1);
        let mut h = HostBatch {
            input_ids: Vec::with_capacity(tokens),
            positions: Vec::with_capacity(tokens),
            slots: Vec::with_capacity(tokens),
            block_tables: vec![0u32; n * width],
            width,
            seq_lens: Vec::with_capacity(n),
            query_start_loc: Vec::with_capacity(n + 1),
            logits_indices: Vec::new(),
            pending: Vec::new(),
            adapter_slots: Vec::new(),
            images: Vec::new(),
            mrope: Vec::new(),
        };
        h.query_start_loc.push(0);
        let mut rows = Vec::new();
        for (i, s) in out.scheduled.iter().enumerate() {
            let seq = sched.seq(s.seq_id).ok_or_else(|| {
                candle_core::Error::Msg(format!("scheduled unknown sequence {}", s.seq_id))
            })?;
            let table = sched.kv().block_table(s.seq_id);
            for (j, b) in table.iter().enumerate() {
                h.block_tables[i * width + j] = b.0;
            }
            let start = h.input_ids.len();
            let end = s.num_computed + s.num_new;
            let mrope = seq.meta.mm.as_ref().and_then(|m| m.mrope.as_ref());
            if let Some(mm) = &seq.meta.mm {
                for (image, span) in mm.images_in(s.num_computed, end) {
                    let from = span.offset.max(s.num_computed);
                    let to = span.end().min(end);
                    h.images.push(ImageRun {
                        row: start + from - s.num_computed,
                        seq: s.seq_id,
                        image,
                        from: from - span.offset,
                        len: to - from,
                        last: to == span.end(),
                    });
                }
            }
            if end > max_positions {
                candle_core::bail!(
                    "sequence {} reaches position {} but the model has {max_positions}",
                    s.seq_id,
                    end - 1
                );
            }
            for p in s.num_computed..end {
                let tok = *seq.tokens.get(p).ok_or_else(|| {
                    candle_core::Error::Msg(format!("sequence {} has no token {p}", s.seq_id))
                })?;
                if tok == PENDING_TOKEN {
                    h.pending.push((h.input_ids.len() as u32, s.seq_id, p));
                }
                h.input_ids.push(tok);
                h.positions.push(mrope.map_or(p as u32, |m| m.at(p)[0]));
                let block = table.get(p / bs).ok_or_else(|| {
                    candle_core::Error::Msg(format!(
                        "sequence {} has no block for position {p}",
                        s.seq_id
                    ))
                })?;
                h.slots.push((block.0 as usize * bs + p % bs) as i64);
            }
            if seq.meta.prompt_logprobs.is_some() {
                let end = end.min(seq.prompt_len.saturating_sub(1));
                for p in s.num_computed..end {
                    rows.push(LogitRow::PromptLogprob {
                        seq: s.seq_id,
                        pos: p,
                    });
                    h.logits_indices.push((start + p - s.num_computed) as u32);
                }
            }
            if s.samples {
                rows.push(LogitRow::Sample(s.seq_id));
                h.logits_indices.push((h.input_ids.len() - 1) as u32);
            }
            h.seq_lens.push((s.num_computed + s.num_new) as u32);
            h.query_start_loc.push(h.input_ids.len() as u32);
        }
        // only image tokens have three different positions: other steps need `positions` alone
        if !h.images.is_empty() {
            h.mrope = Self::mrope_rows(sched, out);
        }
        Ok((h, rows))
    }

    /// `[3, num_tokens]` positions of a step's tokens (all three equal for a sequence without
    /// M-RoPE), for steps with image tokens.
    fn mrope_rows(sched: &Scheduler, out: &SchedulerOutput) -> Vec<u32> {
        let mut rows = [Vec::new(), Vec::new(), Vec::new()];
        for s in &out.scheduled {
            let mrope = sched
                .seq(s.seq_id)
                .and_then(|q| q.meta.mm.as_ref())
                .and_then(|m| m.mrope.as_ref());
            for p in s.num_computed..s.num_computed + s.num_new {
                let p3 = mrope.map_or([p as u32; 3], |m| m.at(p));
                for (row, v) in rows.iter_mut().zip(p3) {
                    row.push(v);
                }
            }
        }
        rows.concat()
    }

    /// Builds the step for `out`: written into a decode graph's inputs when one applies, else
    /// uploaded for an eager pass (see [`ModelRunner::host_batch`]). Also returns
    /// [`HostBatch::pending`]: the rows whose token the caller writes on the device into
    /// [`ModelRunner::token_ids`] before [`ModelRunner::execute`].
    ///
    /// `adapters` gives the device slot of each adapter the step's sequences use (`None`: none
    /// does); such a step replays a graph of the adapter set.
    pub fn prepare(
        &mut self,
        sched: &Scheduler,
        out: &SchedulerOutput,
        adapters: Option<&HashMap<AdapterId, u32>>,
    ) -> Result<Prepared> {
        let max_positions = self.model.max_positions();
        let (mut host, rows) = Self::host_batch(sched, out, max_positions)?;
        if let Some(slot_of) = adapters {
            host.adapter_slots = Self::adapter_slots(sched, out, slot_of)?;
        }
        let pending = std::mem::take(&mut host.pending);
        let image_rows = self.image_rows(sched, &std::mem::take(&mut host.images))?;
        // the other ranks get the step once rank 0 has it ready: a step rank 0 cannot run
        // never reaches their collectives. They learn which rows wait for tokens sampled on
        // rank 0 ([`ModelRunner::share_tokens`]).
        let shared = self.followers.as_ref().map(|_| HostBatch {
            pending: pending.clone(),
            ..host.clone()
        });
        let step = self.prepare_host(host, image_rows)?;
        if let (Some(f), Some(host)) = (&self.followers, shared) {
            f.step(&host, &block_pairs(out))?;
        }
        Ok((step, rows, pending))
    }

    /// Writes a step's host arrays into a graph bucket, or uploads them for an eager pass.
    pub fn prepare_host(
        &mut self,
        host: HostBatch,
        image_rows: Vec<(usize, Tensor)>,
    ) -> Result<PreparedStep> {
        let covered = slots_covered(&host.adapter_slots);
        let (num_blocks, bs) = (self.kv.num_blocks, self.kv.block_size);
        let device = self.device.clone();
        let lora_rows = !host.adapter_slots.is_empty();
        if let Some((lora, g)) = self.graph_set_for(lora_rows, covered) {
            if let Some(bucket) = g.bucket_for(&host) {
                let n = host.seq_lens.len();
                g.write_inputs(bucket, &host, num_blocks, bs, &device)?;
                return Ok(PreparedStep::Graph {
                    bucket,
                    rows: n,
                    lora,
                });
            }
        }
        let mut batch = host.upload(covered, &self.device)?;
        batch.image_rows = image_rows;
        Ok(PreparedStep::Eager(batch))
    }

    /// Runs the vision encoder over `images` alone: per image, its features row-major in f32.
    pub fn encode_images(&self, images: &[Arc<ImageInput>]) -> Result<Vec<Vec<f32>>> {
        let refs: Vec<&ImageInput> = images.iter().map(Arc::as_ref).collect();
        let feats = self.model.encode_images(&refs)?;
        feats
            .iter()
            .map(|f| {
                f.to_dtype(candle_core::DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()
            })
            .collect()
    }

    /// Images the encoder has run on so far.
    pub fn images_encoded(&self) -> u64 {
        self.images_encoded
    }

    /// The image features of the step's image runs: each image is encoded once, when its first
    /// tokens are scheduled (all such images of the step in one encoder call), and kept until
    /// its last token is.
    fn image_rows(&mut self, sched: &Scheduler, runs: &[ImageRun]) -> Result<Vec<(usize, Tensor)>> {
        self.encoder_cache
            .retain(|(seq, _), _| sched.seq(*seq).is_some());
        if runs.is_empty() {
            return Ok(Vec::new());
        }
        let mut todo: Vec<((SeqId, usize), Arc<ImageInput>)> = Vec::new();
        for r in runs {
            let key = (r.seq, r.image);
            if self.encoder_cache.contains_key(&key) || todo.iter().any(|(k, _)| *k == key) {
                continue;
            }
            let img = sched
                .seq(r.seq)
                .and_then(|s| s.meta.mm.as_ref())
                .and_then(|m| m.images.get(r.image))
                .ok_or_else(|| {
                    candle_core::Error::Msg(format!("sequence {} has no image {}", r.seq, r.image))
                })?;
            todo.push((key, img.clone()));
        }
        if !todo.is_empty() {
            let imgs: Vec<&ImageInput> = todo.iter().map(|(_, i)| i.as_ref()).collect();
            let feats = self.model.encode_images(&imgs)?;
            self.images_encoded += imgs.len() as u64;
            for ((key, _), f) in todo.into_iter().zip(feats) {
                self.encoder_cache.insert(key, f);
            }
        }
        let mut out = Vec::with_capacity(runs.len());
        for r in runs {
            let key = (r.seq, r.image);
            let f = self.encoder_cache.get(&key).ok_or_else(|| {
                candle_core::Error::Msg(format!(
                    "image {} of sequence {} was not encoded",
                    r.image, r.seq
                ))
            })?;
            out.push((r.row, f.narrow(0, r.from, r.len)?));
            if r.last {
                self.encoder_cache.remove(&key);
            }
        }
        Ok(out)
    }

    /// The adapter slot of each token of the step: its sequence's adapter's slot in `slot_of`,
    /// or [`NO_ADAPTER`].
    fn adapter_slots(
        sched: &Scheduler,
        out: &SchedulerOutput,
        slot_of: &HashMap<AdapterId, u32>,
    ) -> Result<Vec<u32>> {
        let mut v = Vec::with_capacity(out.num_batched_tokens);
        for s in &out.scheduled {
            let seq = sched.seq(s.seq_id).ok_or_else(|| {
                candle_core::Error::Msg(format!("scheduled unknown sequence {}", s.seq_id))
            })?;
            let slot = match seq.meta.adapter_id() {
                Some(a) => *slot_of.get(&a).ok_or_else(|| {
                    candle_core::Error::Msg(format!("adapter {a} has no device slot"))
                })?,
                None => NO_ADAPTER,
            };
            v.extend(std::iter::repeat_n(slot, s.num_new));
        }
        Ok(v)
    }

    /// The token ids a prepared step reads (a graph bucket's input or the eager batch's).
    pub fn token_ids(&self, step: &PreparedStep) -> Result<Tensor> {
        match step {
            PreparedStep::Eager(batch) => Ok(batch.input_ids.clone()),
            PreparedStep::Graph { bucket, lora, .. } => match lora {
                Some(i) => self.lora_graphs.get(*i),
                None => self.graphs.as_ref(),
            }
            .and_then(|g| g.input_ids(*bucket))
            .ok_or_else(|| candle_core::Error::Msg(format!("no graph bucket {bucket}"))),
        }
    }

    /// Under tensor parallelism, stops the group after rank 0 failed a step it had handed to
    /// the other ranks ([`ModelRunner::prepare`] returned it); nothing to do on one device.
    pub fn stop_followers(&self, why: &str) {
        if let Some(f) = &self.followers {
            f.fail(format!("rank 0 failed a step: {why}"));
        }
    }

    /// Under tensor parallelism, writes rank 0's token ids of `step` over every rank's: a step
    /// with rows whose tokens rank 0 sampled on its device (async scheduling) calls this on
    /// every rank once rank 0 has written them, before [`ModelRunner::execute`].
    pub fn share_tokens(&self, step: &PreparedStep) -> Result<()> {
        self.model.share_token_ids(&self.token_ids(step)?)
    }

    /// Applies the step's block copies and runs the model; f32 logits `[rows, vocab]`.
    pub fn execute(&mut self, out: &SchedulerOutput, step: &PreparedStep) -> Result<Tensor> {
        self.execute_after(&block_pairs(out), step)
    }

    /// [`ModelRunner::execute`] after the block copies `copies` (source, destination).
    pub fn execute_after(
        &mut self,
        copies: &[(usize, usize)],
        step: &PreparedStep,
    ) -> Result<Tensor> {
        if !copies.is_empty() {
            self.kv.copy_blocks(copies)?;
        }
        match step {
            PreparedStep::Eager(batch) if self.device.is_cpu() => {
                let (model, kv) = (&mut *self.model, &self.kv);
                crate::host::in_pool(move || model.forward(batch, kv))
            }
            PreparedStep::Eager(batch) => self.model.forward(batch, &self.kv),
            PreparedStep::Graph { bucket, rows, lora } => {
                let g = match lora {
                    Some(i) => self.lora_graphs.get_mut(*i),
                    None => self.graphs.as_mut(),
                };
                let g = g.ok_or_else(|| {
                    candle_core::Error::Msg("a graph step without decode graphs".into())
                })?;
                g.run(*bucket, *rows, self.model.as_ref(), &self.kv, &self.device)
            }
        }
    }
}

impl Drop for ModelRunner {
    fn drop(&mut self) {
        // graphs hold work of the model's collectives: they go before the model (and its
        // communicator), and the other ranks before rank 0's communicator
        self.graphs.take();
        self.lora_graphs.clear();
        self.followers.take();
    }
}

/// The step's copy-on-write block copies as (source, destination) block ids.
fn block_pairs(out: &SchedulerOutput) -> Vec<(usize, usize)> {
    out.block_copies
        .iter()
        .map(|(s, d)| (s.0 as usize, d.0 as usize))
        .collect()
}

/// Runs one forward pass over a synthetic prompt of `tokens` tokens with `rows` logit rows, on a
/// scratch cache (of `cache_dtype`) just large enough, to measure the activation peak; returns the
/// scratch cache's bytes (to be subtracted from the peak).
pub fn profile_forward(
    model: &dyn Model,
    cache_dtype: candle_core::DType,
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
        model.cache_kv_heads(),
        mc.head_dim,
        cache_dtype,
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
        adapter_slots: None,
        adapter_slots_covered: 0,
        adapter_runs: Vec::new(),
        adapter_listed: None,
        image_rows: Vec::new(),
        mrope_positions: None,
    };
    let logits = model.forward(&batch, &kv)?;
    drop(logits);
    device.synchronize()?;
    Ok(KvCache::bytes_per_block(
        mc.num_layers,
        block_size,
        model.cache_kv_heads(),
        mc.head_dim,
        cache_dtype,
    ) * blocks)
}
