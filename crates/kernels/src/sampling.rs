//! Sampling on the GPU (`csrc/sampling.cu`): per row of f32 logits, sparse edits (bias, suppressed
//! ids, penalties), then greedy or temperature / min-p / top-k / top-p and one seeded draw; only
//! the chosen ids and their raw log-probabilities come back to the host.
//!
//! [`sample_rows_async`] queues the sampling and the copy of its results into reused page-locked
//! buffers and returns at once; [`PendingSample::write_tokens`] feeds the chosen ids to a later
//! step's token ids on the device, before the host has them ([`PendingSample::wait`]).
//!
//! [`reference_distribution`] is the CPU reference: the exact probability of every token under the
//! same rules, which the device tests compare empirical draws against.

use candle_core::{Result, Tensor};

/// One logit edit: `x' = rep(x + bias) - subtract`, where `rep` divides positive values by
/// `repetition_penalty` and multiplies the others by it; `subtract = +inf` suppresses the token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogitEdit {
    pub token: u32,
    pub bias: f32,
    pub repetition_penalty: f32,
    pub subtract: f32,
}

/// What one row asks of the sampler.
#[derive(Debug, Clone, PartialEq)]
pub struct RowSampling {
    /// 0 picks the arg-max of the edited logits (lowest id on ties).
    pub temperature: f32,
    /// 0 disables.
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    /// The row's draw depends on this seed and the token ids only.
    pub seed: u64,
    /// At most one edit per token.
    pub edits: Vec<LogitEdit>,
}

impl Default for RowSampling {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            edits: Vec::new(),
        }
    }
}

fn edited(row: &[f32], s: &RowSampling) -> Vec<f32> {
    let mut x = row.to_vec();
    for e in &s.edits {
        if let Some(v) = x.get_mut(e.token as usize) {
            let b = *v + e.bias;
            let r = if b > 0.0 {
                b / e.repetition_penalty
            } else {
                b * e.repetition_penalty
            };
            *v = r - e.subtract;
        }
    }
    x
}

/// The probability of each token of `row` under `s` (CPU reference of the kernel's rules; ties at a
/// top-k or top-p boundary keep every tied token).
pub fn reference_distribution(row: &[f32], s: &RowSampling) -> Vec<f64> {
    let x = edited(row, s);
    let n = x.len();
    let mut p = vec![0f64; n];
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if s.temperature < 1e-5 {
        if let Some(i) = x.iter().position(|&v| v == max) {
            p[i] = 1.0;
        }
        return p;
    }
    let t = f64::from(s.temperature);
    let w = |v: f32| ((f64::from(v) - f64::from(max)) / t).exp();
    let mut thr = f32::NEG_INFINITY;
    if s.min_p > 0.0 {
        thr = (f64::from(max) + f64::from(s.min_p).ln().min(0.0) * t) as f32;
    }
    let mut sorted: Vec<f32> = x.clone();
    sorted.sort_by(|a, b| b.total_cmp(a));
    if s.top_k > 0 && s.top_k < n {
        thr = thr.max(sorted[s.top_k - 1]);
    }
    if s.top_p < 1.0 {
        let total: f64 = x.iter().filter(|&&v| v >= thr).map(|&v| w(v)).sum();
        let target = f64::from(s.top_p) * total;
        let mut acc = 0.0;
        for &v in sorted.iter().filter(|&&v| v >= thr) {
            acc += w(v);
            if acc >= target {
                thr = thr.max(v);
                break;
            }
        }
    }
    let z: f64 = x
        .iter()
        .filter(|&&v| v >= thr && v > f32::NEG_INFINITY)
        .map(|&v| w(v))
        .sum();
    for (pi, &v) in p.iter_mut().zip(&x) {
        if v >= thr && v > f32::NEG_INFINITY && z > 0.0 {
            *pi = w(v) / z;
        }
    }
    p
}

/// Samples one token per row of `logits` (`[rows, vocab]` f32 on a CUDA device; edited in place)
/// and returns (token, raw log-probability) per row. Each call allocates page-locked buffers for
/// the results; a caller that samples every step keeps a [`ReadbackPool`] and calls
/// [`sample_rows_async`].
pub fn sample_rows(logits: &Tensor, rows: &[RowSampling]) -> Result<Vec<(u32, f32)>> {
    let mut pool = ReadbackPool::default();
    sample_rows_async(logits, rows, &mut pool)?.wait(&mut pool)
}

/// Page-locked host buffers that sampled tokens are copied into, kept for reuse across steps
/// (and the one token bitmasks are staged in on their way to the device).
#[derive(Default)]
pub struct ReadbackPool {
    #[cfg(feature = "cuda")]
    free: Vec<cuda::Readback>,
    #[cfg(feature = "cuda")]
    staging: Option<candle_core::cuda_backend::cudarc::driver::PinnedHostSlice<u32>>,
}

/// Structured output's token masks: for each `i`, `logits[rows[i], t] = -inf` wherever bit
/// `t % 32` of word `t / 32` of mask `i` (`masks[i * words..][..words]`) is clear. In place, on
/// the logits' device; on a GPU the masks go up through a page-locked buffer of `pool`, so the
/// host does not wait for the forward pass that is still running.
pub fn apply_token_bitmask(
    logits: &Tensor,
    rows: &[u32],
    masks: &[u32],
    words: usize,
    pool: &mut ReadbackPool,
) -> Result<()> {
    let (n, vocab) = logits.dims2()?;
    if logits.dtype() != candle_core::DType::F32 || !logits.is_contiguous() {
        candle_core::bail!("apply_token_bitmask: logits must be contiguous f32");
    }
    if words < vocab.div_ceil(32) || masks.len() != rows.len() * words {
        candle_core::bail!(
            "apply_token_bitmask: {} mask words for {} rows of {words} (vocabulary {vocab})",
            masks.len(),
            rows.len()
        );
    }
    if let Some(r) = rows.iter().find(|&&r| r as usize >= n) {
        candle_core::bail!("apply_token_bitmask: row {r} of {n}");
    }
    if rows.is_empty() {
        return Ok(());
    }
    let op = Bitmask {
        rows,
        masks,
        words,
        pool: std::sync::Mutex::new(pool),
    };
    logits.inplace_op1(&op)
}

/// The CPU rule of [`apply_token_bitmask`] on one row (also the reference of the kernel).
pub fn mask_row(row: &mut [f32], mask: &[u32]) {
    for (t, x) in row.iter_mut().enumerate() {
        let allowed = mask.get(t / 32).is_some_and(|w| (w >> (t % 32)) & 1 == 1);
        if !allowed {
            *x = f32::NEG_INFINITY;
        }
    }
}

struct Bitmask<'a> {
    rows: &'a [u32],
    masks: &'a [u32],
    words: usize,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pool: std::sync::Mutex<&'a mut ReadbackPool>,
}

impl candle_core::InplaceOp1 for Bitmask<'_> {
    fn name(&self) -> &'static str {
        "token-bitmask"
    }

    fn cpu_fwd(&self, s: &mut candle_core::CpuStorage, l: &candle_core::Layout) -> Result<()> {
        let vocab = l.dims()[1];
        let candle_core::CpuStorage::F32(data) = s else {
            candle_core::bail!("apply_token_bitmask: logits must be f32");
        };
        let data = &mut data[l.start_offset()..];
        for (i, &r) in self.rows.iter().enumerate() {
            let row = &mut data[r as usize * vocab..][..vocab];
            mask_row(row, &self.masks[i * self.words..][..self.words]);
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &mut candle_core::CudaStorage, l: &candle_core::Layout) -> Result<()> {
        cuda::bitmask(self, s, l)
    }
}

/// Tokens sampled on the device and on their way to the host: the device copy can feed the next
/// step ([`PendingSample::write_tokens`]) before the host has them ([`PendingSample::wait`]).
pub struct PendingSample {
    #[cfg(feature = "cuda")]
    inner: cuda::Pending,
}

/// Queues the sampling of one token per row of `logits` (as [`sample_rows`]) and the copy of the
/// results into a buffer of `pool`, without waiting for either.
#[cfg(feature = "cuda")]
pub fn sample_rows_async(
    logits: &Tensor,
    rows: &[RowSampling],
    pool: &mut ReadbackPool,
) -> Result<PendingSample> {
    let (n, _) = logits.dims2()?;
    if n != rows.len() {
        candle_core::bail!("sample_rows: {n} logit rows, {} settings", rows.len());
    }
    if logits.dtype() != candle_core::DType::F32 || !logits.is_contiguous() {
        candle_core::bail!("sample_rows: logits must be contiguous f32");
    }
    let op = cuda::SampleRows {
        rows,
        pool: std::sync::Mutex::new(pool),
        result: std::sync::Mutex::new(None),
    };
    if n > 0 {
        logits.inplace_op1(&op)?;
    }
    let inner = op
        .result
        .into_inner()
        .map_err(|_| candle_core::Error::Msg("sampling result lock poisoned".into()))?;
    Ok(PendingSample {
        inner: inner.unwrap_or_default(),
    })
}

/// Without CUDA there is no device sampler; the engine samples on the host.
#[cfg(not(feature = "cuda"))]
pub fn sample_rows_async(
    _logits: &Tensor,
    _rows: &[RowSampling],
    _pool: &mut ReadbackPool,
) -> Result<PendingSample> {
    candle_core::bail!("sample_rows needs the cuda feature")
}

impl PendingSample {
    /// Rows sampled.
    pub fn len(&self) -> usize {
        self.rows()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Queues `dst[d] = token of row s` for each `(d, s)` of `pairs`, on the device (`dst`: a
    /// contiguous u32 tensor on the sampler's GPU, such as a step's token ids).
    pub fn write_tokens(&self, dst: &Tensor, pairs: &[(u32, u32)]) -> Result<()> {
        if pairs.is_empty() {
            return Ok(());
        }
        if dst.dtype() != candle_core::DType::U32 || !dst.is_contiguous() || dst.rank() != 1 {
            candle_core::bail!("write_tokens: the destination must be a contiguous u32 vector");
        }
        let (len, n) = (dst.dim(0)?, self.len());
        if let Some(&(d, s)) = pairs
            .iter()
            .find(|&&(d, s)| d as usize >= len || s as usize >= n)
        {
            candle_core::bail!("write_tokens: row {s} of {n} into {d} of {len}");
        }
        self.scatter(dst, pairs)
    }
}

#[cfg(feature = "cuda")]
impl PendingSample {
    fn rows(&self) -> usize {
        self.inner.n
    }

    fn scatter(&self, dst: &Tensor, pairs: &[(u32, u32)]) -> Result<()> {
        dst.inplace_op1(&cuda::ScatterTokens {
            pending: &self.inner,
            pairs,
        })
    }

    /// Waits for the tokens and returns (token, raw log-probability) per row; the buffer goes back
    /// to `pool`.
    pub fn wait(self, pool: &mut ReadbackPool) -> Result<Vec<(u32, f32)>> {
        self.inner.wait(pool)
    }
}

#[cfg(not(feature = "cuda"))]
impl PendingSample {
    fn rows(&self) -> usize {
        0
    }

    fn scatter(&self, _dst: &Tensor, _pairs: &[(u32, u32)]) -> Result<()> {
        candle_core::bail!("write_tokens needs the cuda feature")
    }

    /// Waits for the tokens and returns (token, raw log-probability) per row.
    pub fn wait(self, _pool: &mut ReadbackPool) -> Result<Vec<(u32, f32)>> {
        Ok(Vec::new())
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::{ReadbackPool, RowSampling};
    use crate::cuda::function;
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaEvent, CudaSlice, CudaStream, LaunchConfig, PinnedHostSlice, PushKernelArg,
    };
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CpuStorage, CudaStorage, Layout, Result};
    use std::sync::{Arc, Mutex};

    /// Page-locked host copies of one step's sampled tokens and log-probabilities, and the event
    /// recorded after the copies into them.
    pub struct Readback {
        tokens: PinnedHostSlice<u32>,
        lps: PinnedHostSlice<f32>,
        done: CudaEvent,
    }

    impl ReadbackPool {
        /// A free buffer of at least `n` rows, allocated on `stream`'s context when none fits.
        fn take(&mut self, n: usize, stream: &Arc<CudaStream>) -> Result<Readback> {
            if let Some(i) = self.free.iter().position(|r| r.tokens.len() >= n) {
                return Ok(self.free.swap_remove(i));
            }
            let cap = n.next_power_of_two().max(64);
            let ctx = stream.context();
            // SAFETY: the buffers are only read after a device copy into them has completed
            // (`Pending::wait` waits on their events), and at most `n <= cap` values are read.
            let (tokens, lps) = unsafe {
                (
                    ctx.alloc_pinned_with_flags::<u32>(cap, 0).w()?,
                    ctx.alloc_pinned_with_flags::<f32>(cap, 0).w()?,
                )
            };
            let done = ctx.new_event(None).w()?;
            Ok(Readback { tokens, lps, done })
        }
    }

    /// One queued sampling: the chosen ids on the device and the copies on their way to the host.
    #[derive(Default)]
    pub struct Pending {
        pub n: usize,
        tokens: Option<CudaSlice<u32>>,
        host: Option<Readback>,
    }

    impl Pending {
        pub fn wait(self, pool: &mut ReadbackPool) -> Result<Vec<(u32, f32)>> {
            let Some(host) = self.host else {
                return Ok(Vec::new());
            };
            host.done.synchronize().w()?;
            let toks = host.tokens.as_slice().w()?;
            let lps = host.lps.as_slice().w()?;
            let out = toks
                .iter()
                .copied()
                .zip(lps.iter().copied())
                .take(self.n)
                .collect();
            pool.free.push(host);
            Ok(out)
        }
    }

    pub struct SampleRows<'a> {
        pub rows: &'a [RowSampling],
        pub pool: Mutex<&'a mut ReadbackPool>,
        pub result: Mutex<Option<Pending>>,
    }

    impl candle_core::InplaceOp1 for SampleRows<'_> {
        fn name(&self) -> &'static str {
            "sample-rows"
        }

        fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
            candle_core::bail!("sample_rows runs on CUDA only")
        }

        fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> Result<()> {
            let (n, vocab) = (l.dims()[0], l.dims()[1]);
            if l.start_offset() != 0 {
                candle_core::bail!("sample_rows: logits must start at offset 0");
            }
            let dev = s.device().clone();
            let stream = dev.cuda_stream();
            let mut starts = Vec::with_capacity(n + 1);
            let (mut tokens, mut vals) = (Vec::new(), Vec::new());
            starts.push(0u32);
            for r in self.rows {
                for e in &r.edits {
                    tokens.push(e.token);
                    vals.extend([e.bias, e.repetition_penalty, e.subtract]);
                }
                starts.push(tokens.len() as u32);
            }
            // the kernel never reads past `starts`; keep the buffers non-empty
            tokens.push(0);
            vals.extend([0.0; 3]);
            let up = |v: &[f32]| stream.clone_htod(v).w();
            let temps = up(&self.rows.iter().map(|r| r.temperature).collect::<Vec<_>>())?;
            let top_p = up(&self.rows.iter().map(|r| r.top_p).collect::<Vec<_>>())?;
            let min_p = up(&self.rows.iter().map(|r| r.min_p).collect::<Vec<_>>())?;
            let top_k = stream
                .clone_htod(
                    &self
                        .rows
                        .iter()
                        .map(|r| r.top_k.min(i32::MAX as usize) as i32)
                        .collect::<Vec<_>>(),
                )
                .w()?;
            let seeds = stream
                .clone_htod(&self.rows.iter().map(|r| r.seed).collect::<Vec<_>>())
                .w()?;
            let starts = stream.clone_htod(&starts).w()?;
            let edit_tokens = stream.clone_htod(&tokens).w()?;
            let edit_vals = up(&vals)?;
            let mut edit_raw = stream.alloc_zeros::<f32>(tokens.len()).w()?;
            let mut host = self
                .pool
                .lock()
                .map_err(|_| candle_core::Error::Msg("readback pool lock poisoned".into()))?
                .take(n, &stream)?;
            // as long as the host buffers: a copy moves the whole destination
            let cap = host.tokens.len();
            let mut out_tokens = stream.alloc_zeros::<u32>(cap).w()?;
            let mut out_lps = stream.alloc_zeros::<f32>(cap).w()?;
            let logits = s.as_cuda_slice_mut::<f32>()?;
            let func = function(&dev, "sample_rows")?;
            let mut b = stream.launch_builder(&func);
            let vocab_i = vocab as i32;
            b.arg(logits)
                .arg(&vocab_i)
                .arg(&temps)
                .arg(&top_k)
                .arg(&top_p)
                .arg(&min_p)
                .arg(&seeds)
                .arg(&starts)
                .arg(&edit_tokens)
                .arg(&edit_vals)
                .arg(&mut edit_raw)
                .arg(&mut out_tokens)
                .arg(&mut out_lps);
            let cfg = LaunchConfig {
                grid_dim: (n as u32, 1, 1),
                block_dim: (1024, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: matches `sample_rows` in csrc/sampling.cu; every array has one entry per row
            // (edits: `starts[n]` entries, plus one unused).
            unsafe { b.launch(cfg) }.w()?;
            stream.memcpy_dtoh(&out_tokens, &mut host.tokens).w()?;
            stream.memcpy_dtoh(&out_lps, &mut host.lps).w()?;
            host.done.record(&stream).w()?;
            *self
                .result
                .lock()
                .map_err(|_| candle_core::Error::Msg("sampling result lock poisoned".into()))? =
                Some(Pending {
                    n,
                    tokens: Some(out_tokens),
                    host: Some(host),
                });
            Ok(())
        }
    }

    /// Stages rows and masks in the pool's page-locked buffer (waiting only for the copy out of
    /// it a step before) and masks the rows on the stream.
    pub(super) fn bitmask(op: &super::Bitmask<'_>, s: &mut CudaStorage, l: &Layout) -> Result<()> {
        let vocab = l.dims()[1];
        let dev = s.device().clone();
        let stream = dev.cuda_stream();
        let n = op.rows.len();
        let need = n + op.masks.len();
        let mut pool = op
            .pool
            .lock()
            .map_err(|_| candle_core::Error::Msg("readback pool lock poisoned".into()))?;
        if pool.staging.as_ref().is_none_or(|b| b.len() < need) {
            let cap = need.next_power_of_two();
            // SAFETY: written in full below (the first `need` values) before any copy reads it.
            pool.staging =
                Some(unsafe { stream.context().alloc_pinned_with_flags::<u32>(cap, 0) }.w()?);
        }
        let Some(staging) = pool.staging.as_mut() else {
            candle_core::bail!("apply_token_bitmask: no staging buffer");
        };
        {
            let host = staging.as_mut_slice().w()?;
            host[..n].copy_from_slice(op.rows);
            host[n..need].copy_from_slice(op.masks);
        }
        let mut dev_buf = unsafe { stream.alloc::<u32>(staging.len()) }.w()?;
        stream.memcpy_htod(&*staging, &mut dev_buf).w()?;
        let rows = dev_buf.slice(..n);
        let masks = dev_buf.slice(n..need);
        let logits = s.as_cuda_slice_mut::<f32>()?;
        let mut logits = logits.slice_mut(l.start_offset()..);
        let func = function(&dev, "apply_token_bitmask")?;
        let mut b = stream.launch_builder(&func);
        let (vocab_i, words_i) = (vocab as i32, op.words as i32);
        b.arg(&mut logits)
            .arg(&vocab_i)
            .arg(&rows)
            .arg(&masks)
            .arg(&words_i);
        let cfg = LaunchConfig {
            grid_dim: ((vocab as u32).div_ceil(256), n as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `apply_token_bitmask` in csrc/sampling.cu; every row index was checked
        // against the logits' rows and each mask has `words >= vocab / 32` words.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }

    /// `dst[d] = pending token s` for each pair, on the device.
    pub struct ScatterTokens<'a> {
        pub pending: &'a Pending,
        pub pairs: &'a [(u32, u32)],
    }

    impl candle_core::InplaceOp1 for ScatterTokens<'_> {
        fn name(&self) -> &'static str {
            "scatter-tokens"
        }

        fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
            candle_core::bail!("write_tokens runs on CUDA only")
        }

        fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> Result<()> {
            let Some(src) = &self.pending.tokens else {
                candle_core::bail!("write_tokens: nothing was sampled");
            };
            let dev = s.device().clone();
            let stream = dev.cuda_stream();
            let flat: Vec<u32> = self.pairs.iter().flat_map(|&(d, s)| [d, s]).collect();
            let pairs = stream.clone_htod(&flat).w()?;
            let dst = s.as_cuda_slice_mut::<u32>()?;
            let mut dst = dst.slice_mut(l.start_offset()..);
            let n = self.pairs.len() as i32;
            let func = function(&dev, "scatter_tokens")?;
            let mut b = stream.launch_builder(&func);
            b.arg(&mut dst).arg(src).arg(&pairs).arg(&n);
            let cfg = LaunchConfig {
                grid_dim: ((self.pairs.len() as u32).div_ceil(256), 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: matches `scatter_tokens` in csrc/sampling.cu; every pair was checked against
            // the destination's length and the sampled rows (`PendingSample::write_tokens`).
            unsafe { b.launch(cfg) }.w()?;
            Ok(())
        }
    }
}
