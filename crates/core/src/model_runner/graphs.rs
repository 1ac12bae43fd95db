//! CUDA graphs of decode steps, one per batch-size bucket.
//!
//! A step whose every sequence decodes one token runs as the graph of the smallest bucket that
//! holds it. Each bucket owns its input tensors (token ids, positions, slots, sequence lengths and
//! a block table as wide as the longest context allows); the step's values are written into them
//! in place and padding rows are inert: token 0 at position 0, no cache write (slot -1), a context
//! of one key. The decode kernel's key split is planned for the longest context, so one graph
//! serves every context length. Logits land in a buffer shared by all buckets, of which the step's
//! rows are returned.
//!
//! With LoRA adapters other sets of graphs run the steps that have adapter rows: each of their
//! buckets also owns the rows' adapter slots (padding and base rows [`NO_ADAPTER`]), which the
//! captured LoRA kernels read on the device. Where products read every slot's `A` rows at once
//! (a weight stored above them), a set is captured for each of a few slot counts
//! ([`lora_graph_covers`]) and a step takes the smallest that covers its adapters' slots, so
//! idle slots cost a decode step nothing. All sets share one logits buffer.
//!
//! Every bucket's graph is captured when the engine starts ([`DecodeGraphs::capture_all`], the
//! largest first, on inert inputs), so no step pays for a capture; a bucket not captured then is
//! captured on its first step. A bucket whose capture fails runs eagerly from then on.

use super::{ForwardBatch, HostBatch};
use crate::kv_cache::KvCache;
use crate::models::Model;
use candle_core::{DType, Device, Result, Tensor};
use rserve_kernels::lora::NO_ADAPTER;
use rserve_kernels::{AttentionMetadata, DeviceArrays};
use std::sync::Arc;

/// Batch sizes graphs are captured for, up to the scheduler's limit.
const BUCKETS: [usize; 18] = [
    1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512,
];

/// Which decode steps run as graphs: their batch-size buckets and the longest context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraphPlan {
    /// Ascending batch sizes.
    pub buckets: Vec<usize>,
    /// Block-table width of every bucket: the blocks of the longest context.
    pub max_blocks: usize,
    /// The longest context a graph serves (the decode split is planned for it).
    pub max_context: usize,
    /// Whether buckets of few rows may be captured with detached allocations (with
    /// `RSERVE_CUDA_GRAPH_DETACH=1`); off for tensor-parallel ranks, whose fallback capture would
    /// run collectives the other ranks do not.
    pub detach: bool,
}

impl GraphPlan {
    /// Buckets up to `max_num_seqs` (which is one, when at most 512), for contexts up to
    /// `max_model_len` tokens in blocks of `block_size`.
    pub fn new(max_num_seqs: usize, max_model_len: usize, block_size: usize) -> Self {
        let mut buckets: Vec<usize> = BUCKETS.into_iter().filter(|&b| b < max_num_seqs).collect();
        if max_num_seqs <= BUCKETS[BUCKETS.len() - 1] {
            buckets.push(max_num_seqs);
        }
        Self {
            buckets,
            max_blocks: max_model_len.div_ceil(block_size.max(1)).max(1),
            max_context: max_model_len,
            detach: true,
        }
    }

    /// The index of the smallest bucket of at least `n` rows.
    pub fn bucket(&self, n: usize) -> Option<usize> {
        self.buckets.iter().position(|&b| b >= n)
    }

    /// Whether a step of these host arrays can run as a graph, and in which bucket.
    pub fn bucket_for(&self, host: &HostBatch) -> Option<usize> {
        if !host.is_plain_decode() || host.width > self.max_blocks {
            return None;
        }
        self.bucket(host.seq_lens.len())
    }
}

/// A step's per-row inputs padded to `size` rows: token ids, positions, slots, sequence lengths.
pub fn padded_rows(host: &HostBatch, size: usize) -> (Vec<u32>, Vec<u32>, Vec<i64>, Vec<u32>) {
    let pad = size.saturating_sub(host.input_ids.len());
    let fill = |v: &[u32], x: u32| -> Vec<u32> {
        v.iter()
            .copied()
            .chain(std::iter::repeat_n(x, pad))
            .collect()
    };
    (
        fill(&host.input_ids, 0),
        fill(&host.positions, 0),
        host.slots
            .iter()
            .copied()
            .chain(std::iter::repeat_n(-1, pad))
            .collect(),
        fill(&host.seq_lens, 1),
    )
}

/// The slot counts LoRA decode graphs are captured for, ascending, the last all `num_slots`:
/// with `narrowed` (products that read every covered slot's `A` rows) also an eighth, a quarter
/// and half of them, where that is at least 8 slots; otherwise only all of them.
pub fn lora_graph_covers(num_slots: usize, narrowed: bool) -> Vec<usize> {
    let fractions: &[usize] = if narrowed { &[8, 4, 2] } else { &[] };
    fractions
        .iter()
        .map(|d| num_slots.div_ceil(*d))
        .filter(|&c| c >= 8 && c < num_slots)
        .chain([num_slots])
        .collect()
}

/// The set among `covers` (ascending) for a step whose adapters need the first `needed` slots:
/// the smallest that covers them.
pub fn lora_graph_set(covers: &[usize], needed: usize) -> Option<usize> {
    covers.iter().position(|&c| c >= needed)
}

/// One bucket's input tensors, the batch over them, and its graph once captured.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Bucket {
    size: usize,
    /// Captured with detached allocations where they are switched on.
    detach: bool,
    input_ids: Tensor,
    positions: Tensor,
    slots: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    /// The rows' adapter slots (graphs of steps with adapter rows).
    adapter_slots: Option<Tensor>, // [size] u32
    batch: ForwardBatch,
    #[cfg(feature = "cuda")]
    graph: Option<rserve_kernels::graph::Graph>,
}

impl Bucket {
    fn new(size: usize, plan: &GraphPlan, lora: Option<usize>, device: &Device) -> Result<Self> {
        let w = plan.max_blocks;
        let input_ids = Tensor::zeros(size, DType::U32, device)?;
        let positions = Tensor::zeros(size, DType::U32, device)?;
        let slots = Tensor::from_vec(vec![-1i64; size], size, device)?;
        let seq_lens = Tensor::ones(size, DType::U32, device)?;
        let block_tables = Tensor::zeros((size, w), DType::U32, device)?;
        let rows: Vec<u32> = (0..size as u32).collect();
        let starts: Vec<u32> = (0..=size as u32).collect();
        let arrays = DeviceArrays {
            slots: slots.clone(),
            block_tables: block_tables.clone(),
            seq_lens: seq_lens.clone(),
            query_start_loc: Tensor::new(starts.as_slice(), device)?,
        };
        let attn = AttentionMetadata::new(
            vec![-1; size],
            vec![0; size * w],
            w,
            vec![1; size],
            starts,
            &Device::Cpu,
        )?
        .on_device(
            arrays,
            Tensor::new(rows.as_slice(), device)?,
            plan.max_context,
        )?;
        let adapter_slots = match lora {
            Some(_) => Some(Tensor::from_vec(vec![NO_ADAPTER; size], size, device)?),
            None => None,
        };
        let batch = ForwardBatch {
            input_ids: input_ids.clone(),
            positions: positions.clone(),
            logits_indices: Tensor::new(rows.as_slice(), device)?,
            attn: Arc::new(attn),
            adapter_slots: adapter_slots.clone(),
            adapter_slots_covered: lora.unwrap_or(0),
            adapter_runs: Vec::new(),
            adapter_listed: None,
            image_rows: Vec::new(),
            mrope_positions: None,
        };
        Ok(Self {
            size,
            detach: plan.detach,
            input_ids,
            positions,
            slots,
            seq_lens,
            block_tables,
            adapter_slots,
            batch,
            #[cfg(feature = "cuda")]
            graph: None,
        })
    }
}

/// The decode graphs of one model runner.
pub struct DecodeGraphs {
    plan: GraphPlan,
    vocab: usize,
    /// Graphs of steps with adapter rows: how many leading slots their products cover.
    lora: Option<usize>,
    buckets: Vec<Option<Bucket>>,
    /// Buckets whose capture failed (they run eagerly).
    failed: Vec<bool>,
    /// `[largest bucket, vocab]` f32: every graph's logits.
    logits: Option<Tensor>,
}

impl DecodeGraphs {
    /// The graphs of `plan` for a vocabulary of `vocab`; with `lora`, of steps with adapter rows
    /// whose adapters lie in that many leading slots.
    pub fn new(plan: GraphPlan, vocab: usize, lora: Option<usize>) -> Self {
        let n = plan.buckets.len();
        Self {
            plan,
            vocab,
            lora,
            buckets: (0..n).map(|_| None).collect(),
            failed: vec![false; n],
            logits: None,
        }
    }

    /// The bucket a step of these host arrays runs in, if it runs as a graph.
    pub fn bucket_for(&self, host: &HostBatch) -> Option<usize> {
        self.plan
            .bucket_for(host)
            .filter(|&b| !self.failed.get(b).copied().unwrap_or(true))
    }

    /// Checks the step against a cache of `num_blocks` blocks of `block_size` and writes it into
    /// bucket `b`'s inputs.
    pub fn write_inputs(
        &mut self,
        b: usize,
        host: &HostBatch,
        num_blocks: usize,
        block_size: usize,
        device: &Device,
    ) -> Result<()> {
        AttentionMetadata::check_arrays(
            &host.slots,
            &host.block_tables,
            host.width,
            &host.seq_lens,
            num_blocks,
            block_size,
        )?;
        write(self.bucket(b, device)?, host)
    }

    /// Bucket `b`, its input tensors made on first use.
    fn bucket(&mut self, b: usize, device: &Device) -> Result<&mut Bucket> {
        let (Some(&size), Some(slot)) = (self.plan.buckets.get(b), self.buckets.get_mut(b)) else {
            candle_core::bail!("no graph bucket {b}");
        };
        match slot {
            Some(bucket) => Ok(bucket),
            None => Ok(slot.insert(Bucket::new(size, &self.plan, self.lora, device)?)),
        }
    }

    /// Bucket `b`'s token-id input, once made.
    pub fn input_ids(&self, b: usize) -> Option<Tensor> {
        self.buckets
            .get(b)?
            .as_ref()
            .map(|bucket| bucket.input_ids.clone())
    }

    /// Has every graph of this set write into `logits`, the buffer of another set of the same
    /// plan (steps run one at a time, and each step's logits are read before the next runs).
    pub fn share_logits(&mut self, logits: &Tensor) {
        self.logits = Some(logits.clone());
    }

    /// The logits buffer every graph writes, `[largest bucket, vocab]` f32.
    pub fn logits(&mut self, device: &Device) -> Result<Tensor> {
        if let Some(l) = &self.logits {
            return Ok(l.clone());
        }
        let largest = self.plan.buckets.last().copied().unwrap_or(1);
        let l = Tensor::zeros((largest, self.vocab), DType::F32, device)?;
        self.logits = Some(l.clone());
        Ok(l)
    }

    /// Captures the graph of every bucket that has none, the largest first, on the buckets' inert
    /// initial inputs (so the runs change no cache block); returns how many graphs exist then. A
    /// bucket whose capture fails runs eagerly.
    pub fn capture_all(
        &mut self,
        model: &dyn Model,
        kv: &KvCache,
        device: &Device,
    ) -> Result<usize> {
        let logits = self.logits(device)?;
        let forward = |batch: &ForwardBatch| forward_into(model, kv, batch, &logits);
        let mut captured = 0;
        for b in (0..self.plan.buckets.len()).rev() {
            if self.failed[b] {
                continue;
            }
            if capture_bucket(self.bucket(b, device)?, &forward, device) {
                captured += 1;
            } else {
                self.failed[b] = true;
            }
        }
        Ok(captured)
    }

    /// Runs bucket `b` (capturing its graph first if it has none) and returns the logits of its
    /// first `rows` rows, `[rows, vocab]` f32.
    pub fn run(
        &mut self,
        b: usize,
        rows: usize,
        model: &dyn Model,
        kv: &KvCache,
        device: &Device,
    ) -> Result<Tensor> {
        let logits = self.logits(device)?;
        let Some(Some(bucket)) = self.buckets.get_mut(b) else {
            candle_core::bail!("graph bucket {b} has no inputs");
        };
        let forward = |batch: &ForwardBatch| forward_into(model, kv, batch, &logits);
        run_bucket(bucket, &mut self.failed[b], &forward, device)?;
        logits.narrow(0, 0, rows)
    }
}

/// The forward pass a graph records: the model over `batch`, its logits into the first rows of
/// the shared buffer.
fn forward_into(
    model: &dyn Model,
    kv: &KvCache,
    batch: &ForwardBatch,
    logits: &Tensor,
) -> Result<()> {
    model.forward_into(batch, kv, logits)
}

/// Writes the step's rows into the bucket's inputs (padding rows are inert).
#[cfg(feature = "cuda")]
fn write(bucket: &Bucket, host: &HostBatch) -> Result<()> {
    use rserve_kernels::graph::write_rows;
    let n = host.seq_lens.len();
    let (ids, pos, slots, lens) = padded_rows(host, bucket.size);
    write_rows(&bucket.input_ids, &ids, 1, ids.len())?;
    write_rows(&bucket.positions, &pos, 1, pos.len())?;
    write_rows(&bucket.slots, &slots, 1, slots.len())?;
    write_rows(&bucket.seq_lens, &lens, 1, lens.len())?;
    if let Some(t) = &bucket.adapter_slots {
        let mut s = host.adapter_slots.clone();
        s.resize(bucket.size, NO_ADAPTER);
        write_rows(t, &s, 1, s.len())?;
    }
    write_rows(&bucket.block_tables, &host.block_tables, n, host.width)
}

#[cfg(not(feature = "cuda"))]
fn write(_bucket: &Bucket, _host: &HostBatch) -> Result<()> {
    candle_core::bail!("decode graphs need the cuda feature")
}

/// The largest bucket captured with detached allocations (`rserve_kernels::graph::CaptureOptions`):
/// its kernels overlap the kernel before them whatever the step allocates between them, and each
/// of its small allocations has memory of its own (the `fp8` 8B graphs of 1 to 16 rows fit in the
/// 128 MiB the driver reserves for graphs either way).
#[cfg(feature = "cuda")]
const DETACHED_MAX_ROWS: usize = 16;

/// Captures the bucket's graph if it has none; false when that fails (logged).
#[cfg(feature = "cuda")]
fn capture_bucket(
    bucket: &mut Bucket,
    forward: &dyn Fn(&ForwardBatch) -> Result<()>,
    device: &Device,
) -> bool {
    use rserve_kernels::graph::{detach_allocations_enabled, graph_memory, CaptureOptions, Graph};
    if bucket.graph.is_some() {
        return true;
    }
    let started = std::time::Instant::now();
    let mut options = CaptureOptions {
        detach_allocations: bucket.detach
            && bucket.size <= DETACHED_MAX_ROWS
            && detach_allocations_enabled(),
    };
    let mut captured = Graph::capture_with(device, options, || forward(&bucket.batch));
    if let (Err(e), true) = (&captured, options.detach_allocations) {
        tracing::warn!(
            "decode graph for batch {} not captured with detached allocations ({e}); \
             capturing it plainly",
            bucket.size
        );
        options.detach_allocations = false;
        captured = Graph::capture_with(device, options, || forward(&bucket.batch));
    }
    match captured {
        Ok(g) => {
            let s = g.shape;
            tracing::debug!(
                "captured the decode graph for batch {}{} in {:.0} ms; graph memory {:.0} MiB; \
                 {} kernels, {} memory nodes; of {} programmatic dependents {} overlap the \
                 kernel before them, {} wait behind a memory node",
                bucket.size,
                if options.detach_allocations {
                    " (allocations detached)"
                } else {
                    ""
                },
                started.elapsed().as_secs_f64() * 1e3,
                graph_memory(device).unwrap_or(0) as f64 / (1u64 << 20) as f64,
                s.kernels,
                s.memory_nodes,
                s.dependents,
                s.overlapping,
                s.behind_memory
            );
            bucket.graph = Some(g);
            true
        }
        Err(e) => {
            tracing::warn!(
                "decode graph for batch {} not captured ({e}); it runs eagerly",
                bucket.size
            );
            false
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn capture_bucket(
    _bucket: &mut Bucket,
    _forward: &dyn Fn(&ForwardBatch) -> Result<()>,
    _device: &Device,
) -> bool {
    false
}

/// Launches the bucket's graph, capturing it first if need be; a failed capture marks the bucket
/// `failed` and runs this step eagerly.
#[cfg(feature = "cuda")]
fn run_bucket(
    bucket: &mut Bucket,
    failed: &mut bool,
    forward: &dyn Fn(&ForwardBatch) -> Result<()>,
    device: &Device,
) -> Result<()> {
    if !capture_bucket(bucket, forward, device) {
        *failed = true;
    }
    match &bucket.graph {
        Some(g) => g.launch().inspect_err(|_| *failed = true),
        None => forward(&bucket.batch),
    }
}

#[cfg(not(feature = "cuda"))]
fn run_bucket(
    _bucket: &mut Bucket,
    _failed: &mut bool,
    _forward: &dyn Fn(&ForwardBatch) -> Result<()>,
    _device: &Device,
) -> Result<()> {
    candle_core::bail!("decode graphs need the cuda feature")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_host(n: usize, width: usize) -> HostBatch {
        HostBatch {
            input_ids: (0..n as u32).map(|i| 10 + i).collect(),
            positions: (0..n as u32).map(|i| 5 + i).collect(),
            slots: (0..n as i64).map(|i| 100 + i).collect(),
            block_tables: vec![3; n * width],
            width,
            seq_lens: (0..n as u32).map(|i| 6 + i).collect(),
            query_start_loc: (0..=n as u32).collect(),
            logits_indices: (0..n as u32).collect(),
            pending: Vec::new(),
            adapter_slots: Vec::new(),
            images: Vec::new(),
            mrope: Vec::new(),
        }
    }

    #[test]
    fn lora_graph_sets_cover_fractions_of_the_slots_where_products_read_them_all() {
        assert_eq!(lora_graph_covers(64, true), vec![8, 16, 32, 64]);
        assert_eq!(lora_graph_covers(64, false), vec![64]);
        assert_eq!(lora_graph_covers(1024, true), vec![128, 256, 512, 1024]);
        assert_eq!(lora_graph_covers(16, true), vec![8, 16]);
        assert_eq!(lora_graph_covers(9, true), vec![9]);
        assert_eq!(lora_graph_covers(1, true), vec![1]);
        let covers = lora_graph_covers(64, true);
        assert_eq!(lora_graph_set(&covers, 0), Some(0));
        assert_eq!(lora_graph_set(&covers, 8), Some(0));
        assert_eq!(lora_graph_set(&covers, 9), Some(1));
        assert_eq!(lora_graph_set(&covers, 64), Some(3));
        assert_eq!(lora_graph_set(&covers, 65), None);
        assert_eq!(lora_graph_set(&[], 1), None);
    }

    #[test]
    fn buckets_end_at_the_sequence_limit() {
        let p = GraphPlan::new(256, 4096, 16);
        assert_eq!(p.buckets.first(), Some(&1));
        assert_eq!(p.buckets.last(), Some(&256));
        assert!(p.buckets.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(p.max_blocks, 256);
        assert_eq!(p.max_context, 4096);
        let p = GraphPlan::new(100, 1000, 16);
        assert_eq!(p.buckets.last(), Some(&100));
        assert_eq!(p.max_blocks, 63);
        assert_eq!(GraphPlan::new(1, 10, 16).buckets, vec![1]);
        let p = GraphPlan::new(2000, 10, 16);
        assert_eq!(p.buckets.last(), Some(&512), "larger batches run eagerly");
    }

    #[test]
    fn a_step_takes_the_smallest_bucket_that_holds_it() {
        let p = GraphPlan::new(256, 4096, 16);
        assert_eq!(p.bucket(1).map(|b| p.buckets[b]), Some(1));
        assert_eq!(p.bucket(3).map(|b| p.buckets[b]), Some(4));
        assert_eq!(p.bucket(33).map(|b| p.buckets[b]), Some(48));
        assert_eq!(p.bucket(256).map(|b| p.buckets[b]), Some(256));
        assert_eq!(p.bucket(257), None);
        assert_eq!(
            p.bucket_for(&decode_host(5, 4)).map(|b| p.buckets[b]),
            Some(8)
        );
    }

    #[test]
    fn only_plain_decode_steps_within_the_context_limit_run_as_graphs() {
        let p = GraphPlan::new(256, 64, 16);
        assert!(p.bucket_for(&decode_host(3, 4)).is_some());
        assert!(p.bucket_for(&decode_host(3, 5)).is_none(), "table too wide");
        let mut prompt = decode_host(2, 1);
        prompt.input_ids.push(7);
        prompt.positions.push(7);
        prompt.slots.push(7);
        prompt.query_start_loc = vec![0, 1, 3];
        prompt.logits_indices = vec![0, 2];
        assert!(p.bucket_for(&prompt).is_none(), "a prompt chunk");
        let mut logprobs = decode_host(2, 1);
        logprobs.logits_indices = vec![0, 0, 1];
        assert!(p.bucket_for(&logprobs).is_none(), "extra logit rows");
        assert!(p.bucket_for(&HostBatch::default()).is_none(), "empty step");
    }

    #[test]
    fn padding_rows_are_inert() {
        let (ids, pos, slots, lens) = padded_rows(&decode_host(3, 1), 8);
        assert_eq!(ids, vec![10, 11, 12, 0, 0, 0, 0, 0]);
        assert_eq!(pos, vec![5, 6, 7, 0, 0, 0, 0, 0]);
        assert_eq!(slots, vec![100, 101, 102, -1, -1, -1, -1, -1]);
        assert_eq!(lens, vec![6, 7, 8, 1, 1, 1, 1, 1]);
    }
}
