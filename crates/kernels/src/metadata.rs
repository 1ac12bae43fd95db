//! One step's layout of query tokens over the paged cache, built once per step and shared by every
//! layer: host vectors (for the CPU kernels and for validation) and, on a GPU, the same arrays as
//! device tensors, uploaded once.

use candle_core::{Device, Result, Tensor};
use std::sync::Mutex;

/// Where each query token of a step sits and which cache blocks each sequence owns.
#[derive(Debug)]
pub struct AttentionMetadata {
    /// `[num_tokens]` flat cache slot of each token (`block * block_size + offset`), -1 to skip.
    pub slots: Vec<i64>,
    /// `[num_seqs, width]` block ids; entries past a sequence's blocks are unused.
    pub block_tables: Vec<u32>,
    pub width: usize,
    /// `[num_seqs]` context length of each sequence after this step's tokens.
    pub seq_lens: Vec<u32>,
    /// `[num_seqs + 1]` cumulative query token counts.
    pub query_start_loc: Vec<u32>,
    device: Device,
    /// The arrays above on `device` (only for non-CPU devices).
    dev: Option<DeviceArrays>,
    /// Sequences with exactly one query token (decode rows).
    num_decode: usize,
    /// The GPU attention kernels' lists built so far in this step (at most a few).
    work: Mutex<Vec<(ListKey, Tensor)>>,
    /// The longest context the decode kernel's key split is planned for.
    split_context: usize,
    /// The cache geometry (blocks, block size) these arrays were last checked against: every
    /// layer's cache has the same one, so the check runs once per step, not once per layer.
    checked: Mutex<Option<(usize, usize)>>,
}

/// Which per-step list: work items (tokens per item, least query tokens of a listed sequence),
/// or the decode sequences.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
enum ListKey {
    Work { per_item: usize, min_len: usize },
    Decode,
}

/// The metadata arrays as device tensors (see [`AttentionMetadata`] for each one's meaning).
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub struct DeviceArrays {
    pub slots: Tensor,           // [num_tokens] i64
    pub block_tables: Tensor,    // [num_seqs, width] u32
    pub seq_lens: Tensor,        // [num_seqs] u32
    pub query_start_loc: Tensor, // [num_seqs + 1] u32
}

impl AttentionMetadata {
    /// Checks the arrays against each other and uploads them when `device` is not the CPU.
    pub fn new(
        slots: Vec<i64>,
        block_tables: Vec<u32>,
        width: usize,
        seq_lens: Vec<u32>,
        query_start_loc: Vec<u32>,
        device: &Device,
    ) -> Result<Self> {
        let n = seq_lens.len();
        if query_start_loc.len() != n + 1 || block_tables.len() != n * width || width == 0 {
            candle_core::bail!(
                "attention metadata: {n} seq_lens, {} query_start_loc, {} table entries for width {width}",
                query_start_loc.len(),
                block_tables.len()
            );
        }
        if query_start_loc[0] != 0 || query_start_loc[n] as usize != slots.len() {
            candle_core::bail!(
                "attention metadata: query_start_loc must run from 0 to {} tokens",
                slots.len()
            );
        }
        for s in 0..n {
            let (a, b) = (query_start_loc[s], query_start_loc[s + 1]);
            if b < a || b - a > seq_lens[s] {
                candle_core::bail!(
                    "attention metadata: sequence {s} has queries [{a}, {b}) and context {}",
                    seq_lens[s]
                );
            }
        }
        let dev = if device.is_cpu() {
            None
        } else {
            Some(DeviceArrays {
                slots: Tensor::new(slots.as_slice(), device)?,
                block_tables: Tensor::from_slice(&block_tables, (n, width), device)?,
                seq_lens: Tensor::new(seq_lens.as_slice(), device)?,
                query_start_loc: Tensor::new(query_start_loc.as_slice(), device)?,
            })
        };
        let num_decode = query_start_loc
            .windows(2)
            .filter(|w| w[1] - w[0] == 1)
            .count();
        let split_context = seq_lens.iter().copied().max().unwrap_or(0) as usize;
        Ok(Self {
            num_decode,
            slots,
            block_tables,
            width,
            seq_lens,
            query_start_loc,
            device: device.clone(),
            dev,
            work: Mutex::new(Vec::new()),
            split_context,
            checked: Mutex::new(None),
        })
    }

    /// These host arrays (built on the CPU device) served from arrays that already live on a
    /// device, for a step of decode rows only: a captured CUDA graph's inputs, rewritten in place
    /// before each replay, the host arrays being their values while capturing. `decode_seqs` is
    /// `[num_seqs]` u32 `0..num_seqs`; the decode key split is planned for contexts up to
    /// `split_context`.
    pub fn on_device(
        mut self,
        arrays: DeviceArrays,
        decode_seqs: Tensor,
        split_context: usize,
    ) -> Result<Self> {
        let n = self.num_seqs();
        if self.num_decode != n || self.num_tokens() != n {
            candle_core::bail!("attention metadata: a decode graph takes one query per sequence");
        }
        if decode_seqs.dims() != [n] || arrays.block_tables.dims() != [n, self.width] {
            candle_core::bail!(
                "attention metadata: {:?} decode sequences and a {:?} table for {n} sequences of width {}",
                decode_seqs.dims(),
                arrays.block_tables.dims(),
                self.width
            );
        }
        self.device = decode_seqs.device().clone();
        self.dev = Some(arrays);
        self.split_context = split_context.max(self.split_context);
        self.work
            .lock()
            .map_err(|_| candle_core::Error::Msg("work list lock poisoned".into()))?
            .push((ListKey::Decode, decode_seqs));
        Ok(self)
    }

    /// The longest context the decode kernel's key split is planned for: the longest in this
    /// step, or a captured graph's limit.
    pub fn split_context(&self) -> usize {
        self.split_context
    }

    pub fn num_tokens(&self) -> usize {
        self.slots.len()
    }

    pub fn num_seqs(&self) -> usize {
        self.seq_lens.len()
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn device_arrays(&self) -> Result<&DeviceArrays> {
        self.dev
            .as_ref()
            .ok_or_else(|| candle_core::Error::Msg("attention metadata lives on the CPU".into()))
    }

    /// Checks that every slot is inside a cache of `total_slots` slots (negative slots are skipped).
    pub fn check_slots(&self, total_slots: usize) -> Result<()> {
        check_slots(&self.slots, total_slots)
    }

    /// Checks that every block a query needs is in the table and inside a cache of `num_blocks`
    /// blocks of `block_size`, and that every slot is inside the cache (once per geometry).
    pub fn validate(&self, num_blocks: usize, block_size: usize) -> Result<()> {
        let mut checked = self
            .checked
            .lock()
            .map_err(|_| candle_core::Error::Msg("metadata check lock poisoned".into()))?;
        if *checked == Some((num_blocks, block_size)) {
            return Ok(());
        }
        Self::check_arrays(
            &self.slots,
            &self.block_tables,
            self.width,
            &self.seq_lens,
            num_blocks,
            block_size,
        )?;
        *checked = Some((num_blocks, block_size));
        Ok(())
    }

    /// [`AttentionMetadata::validate`] over bare arrays (`block_tables` is `[seqs, width]`), for
    /// callers that write them to the device themselves.
    pub fn check_arrays(
        slots: &[i64],
        block_tables: &[u32],
        width: usize,
        seq_lens: &[u32],
        num_blocks: usize,
        block_size: usize,
    ) -> Result<()> {
        check_slots(slots, num_blocks * block_size)?;
        for (s, &ctx) in seq_lens.iter().enumerate() {
            let needed = (ctx as usize).div_ceil(block_size);
            if needed > width {
                candle_core::bail!(
                    "sequence {s}: context {ctx} needs {needed} blocks, table has {width}"
                );
            }
            let row = block_tables
                .get(s * width..s * width + needed)
                .ok_or_else(|| candle_core::Error::Msg(format!("no table row for sequence {s}")))?;
            if let Some(&b) = row.iter().find(|&&b| b as usize >= num_blocks) {
                candle_core::bail!("block id {b} outside the cache ({num_blocks} blocks)");
            }
        }
        Ok(())
    }

    /// Query tokens of sequence `s` in this step.
    pub fn query_len(&self, s: usize) -> usize {
        (self.query_start_loc[s + 1] - self.query_start_loc[s]) as usize
    }

    /// Sequences with exactly one query token (decode rows).
    pub fn num_decode(&self) -> usize {
        self.num_decode
    }

    /// `[num_work, 2]` u32 (sequence, first query index) covering, in runs of at most `per_item`,
    /// the query tokens of every sequence with at least `min_len` of them; built on first use for
    /// each pair and kept for the rest of the step.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn work_items(&self, per_item: usize, min_len: usize) -> Result<(Tensor, usize)> {
        self.cached_list(ListKey::Work { per_item, min_len }, |items| {
            // (keys seen by the item's last query, sequence, start): the longest items go first so
            // the launch does not end on a tail of them
            let mut list = Vec::new();
            for s in 0..self.num_seqs() {
                let q_len = self.query_len(s);
                if q_len < min_len {
                    continue;
                }
                let first_pos = self.seq_lens[s] as usize - q_len;
                for start in (0..q_len).step_by(per_item.max(1)) {
                    let last = first_pos + (start + per_item).min(q_len);
                    list.push((last, s as u32, start as u32));
                }
            }
            list.sort_unstable_by_key(|item| std::cmp::Reverse(item.0));
            for (_, s, start) in list {
                items.push(s);
                items.push(start);
            }
            2
        })
    }

    /// `[num_decode]` u32: the sequences with exactly one query token.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn decode_seqs(&self) -> Result<(Tensor, usize)> {
        self.cached_list(ListKey::Decode, |items| {
            items.extend(
                (0..self.num_seqs())
                    .filter(|&s| self.query_len(s) == 1)
                    .map(|s| s as u32),
            );
            1
        })
    }

    /// A u32 list of rows of `cols` entries made by `build` on `key`'s first use in this step.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn cached_list(
        &self,
        key: ListKey,
        build: impl FnOnce(&mut Vec<u32>) -> usize,
    ) -> Result<(Tensor, usize)> {
        let mut cache = self
            .work
            .lock()
            .map_err(|_| candle_core::Error::Msg("work list lock poisoned".into()))?;
        if let Some((_, t)) = cache.iter().find(|(k, _)| *k == key) {
            return Ok((t.clone(), t.dim(0)?));
        }
        let mut items = Vec::new();
        let cols = build(&mut items);
        let count = items.len() / cols;
        let t = if cols == 1 {
            Tensor::from_vec(items, count, &self.device)?
        } else {
            Tensor::from_vec(items, (count, cols), &self.device)?
        };
        cache.push((key, t.clone()));
        Ok((t, count))
    }
}

/// Checks that every slot is inside a cache of `total_slots` slots (negative slots are skipped).
fn check_slots(slots: &[i64], total_slots: usize) -> Result<()> {
    let total = total_slots as i64;
    if let Some(&bad) = slots.iter().find(|&&s| s >= total) {
        candle_core::bail!("slot {bad} outside the cache ({total} slots)");
    }
    Ok(())
}
