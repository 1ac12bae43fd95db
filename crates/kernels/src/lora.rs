//! The LoRA term of a projection for a batch whose rows use different adapters: `y + (x A_s^T)
//! B_s^T` per row, `s` the row's adapter slot, every adapter of a projection stacked over slots.
//!
//! On CUDA, rows reach the term two ways ([`LoraRows`]):
//! - gathered: two kernels (`csrc/lora.cu`, Punica's BGMV form: shrink to `u`, then expand into
//!   `y`) read each row's slot on the device, so a step's slots are data and a captured decode
//!   graph replays with new ones;
//! - runs: consecutive rows that share an adapter (a prompt chunk) multiplied as a whole by
//!   cuBLAS (the SGMV form: tensor cores, `A` and `B` read once per run instead of once per
//!   row), the expand accumulating into `y` in place.
//!
//! Elsewhere rows are grouped by slot and multiplied with candle's matmul, which is also the
//! reference.
//!
//! Shapes: `x` `[tokens, in]`, `y` `[tokens, out]`, `a` `[slots, parts * rank, in]`, `b`
//! `[slots, out, rank]`, slots `[tokens]` u32 ([`NO_ADAPTER`]: the row is left alone). The
//! projection's output columns form up to [`MAX_PARTS`] parts (q, k, v of a fused qkv; gate and up
//! of a fused gate-up), part `p` applying rows `p * rank .. (p + 1) * rank` of `A`'s output.

use candle_core::{DType, Result, Tensor};
use std::collections::BTreeMap;

/// The slot of a row that uses no adapter.
pub const NO_ADAPTER: u32 = u32::MAX;
/// Most parts of one projection.
pub const MAX_PARTS: usize = 3;
/// The largest rank the kernels take (`kMaxPr` in csrc/lora.cu is `MAX_PARTS` times it).
pub const MAX_RANK: usize = 512;
/// The shortest run of rows sharing an adapter that [`split_runs`] takes out of the gathered
/// kernels: below it the per-run products cost more than they save.
pub const MIN_RUN: usize = 16;

/// The shortest run the step builder takes out of the gathered kernels: [`MIN_RUN`], or
/// `RSERVE_LORA_MIN_RUN` (`0` keeps every row in the gathered kernels, for comparisons).
pub fn min_run() -> usize {
    static MIN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MIN.get_or_init(|| {
        std::env::var("RSERVE_LORA_MIN_RUN")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .map_or(MIN_RUN, |v: usize| if v == 0 { usize::MAX } else { v })
    })
}

/// Every adapter of one projection, stacked over slots.
#[derive(Debug, Clone, Copy)]
pub struct LoraStack<'a> {
    pub a: &'a Tensor, // [slots, parts * rank, in]
    pub b: &'a Tensor, // [slots, out, rank]
    /// The widths of the output's parts, in order (summing to `out`).
    pub parts: &'a [usize],
}

/// Rows `start .. start + len`, all of adapter `slot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoraRun {
    pub start: usize,
    pub len: usize,
    pub slot: u32,
}

/// How a step's prompt runs get their LoRA terms on CUDA: a cuBLAS shrink and an expand per
/// part for each run in turn (`runs`), the same products in two grouped cuBLAS calls
/// (`grouped`), or the first for a few runs and the second for many (`auto`, the default).
/// `RSERVE_LORA_PROMPT_TERMS` names one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptTerms {
    Auto = 1,
    Runs = 2,
    Grouped = 3,
}

static PROMPT_TERMS: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// The form prompt runs take: [`set_prompt_terms`]'s, else `RSERVE_LORA_PROMPT_TERMS`'s.
pub fn prompt_terms() -> PromptTerms {
    use std::sync::atomic::Ordering;
    match PROMPT_TERMS.load(Ordering::Relaxed) {
        1 => PromptTerms::Auto,
        2 => PromptTerms::Runs,
        3 => PromptTerms::Grouped,
        _ => {
            let mode = match std::env::var("RSERVE_LORA_PROMPT_TERMS")
                .as_deref()
                .map(str::trim)
            {
                Ok("runs") => PromptTerms::Runs,
                Ok("grouped") => PromptTerms::Grouped,
                _ => PromptTerms::Auto,
            };
            PROMPT_TERMS.store(mode as u8, Ordering::Relaxed);
            mode
        }
    }
}

/// Picks the form prompt runs take from now on, in this process (tests, benchmarks).
pub fn set_prompt_terms(mode: PromptTerms) {
    PROMPT_TERMS.store(mode as u8, std::sync::atomic::Ordering::Relaxed);
}

/// Which adapter each row of a step uses.
#[derive(Debug, Clone, Copy, Default)]
pub struct LoraRows<'a> {
    /// `[tokens]` u32 on the step's device: each row's slot for the gathered kernels,
    /// [`NO_ADAPTER`] for rows without an adapter and rows of `runs`; `None` when no row is left
    /// to them.
    pub slots: Option<&'a Tensor>,
    /// Runs of rows sharing an adapter, in row order, not overlapping (host data).
    pub runs: &'a [LoraRun],
    /// The rows of `slots` that have an adapter, as `[rows]` u32 row indices and their `[rows]`
    /// u32 slots on the step's device ([`listed_rows`]). Where given (a step with runs, whose
    /// gathered rows are a few decode rows among thousands), the gathered kernels launch over
    /// these rows only instead of over every row of the step.
    pub listed: Option<(&'a Tensor, &'a Tensor)>,
}

/// The rows of `slots` that have an adapter and their slots, in row order: what
/// [`LoraRows::listed`] holds on the device.
pub fn listed_rows(slots: &[u32]) -> (Vec<u32>, Vec<u32>) {
    (0u32..)
        .zip(slots)
        .filter(|&(_, &s)| s != NO_ADAPTER)
        .map(|(row, &s)| (row, s))
        .unzip()
}

/// Whether a step with runs lists its gathered rows ([`LoraRows::listed`]); on unless
/// `RSERVE_LORA_LISTED_ROWS=0` (the gathered kernels then cover every row, for comparisons).
pub fn list_gathered_rows() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("RSERVE_LORA_LISTED_ROWS").map_or(true, |v| v.trim() != "0"))
}

impl LoraRows<'_> {
    /// Whether any row has an adapter.
    pub fn any(&self) -> bool {
        self.slots.is_some() || !self.runs.is_empty()
    }
}

/// Takes the runs of at least `min_len` consecutive rows of one adapter out of `slots`
/// (they become [`NO_ADAPTER`] there) and returns them in row order.
pub fn split_runs(slots: &mut [u32], min_len: usize) -> Vec<LoraRun> {
    let mut runs = Vec::new();
    let mut start = 0;
    while start < slots.len() {
        let slot = slots[start];
        let len = slots[start..].iter().take_while(|&&s| s == slot).count();
        if slot != NO_ADAPTER && len >= min_len.max(1) {
            slots[start..start + len].fill(NO_ADAPTER);
            runs.push(LoraRun { start, len, slot });
        }
        start += len;
    }
    runs
}

impl LoraStack<'_> {
    /// `(slots, rank, in, out)`, checked against each other and the parts.
    pub(crate) fn dims(&self) -> Result<(usize, usize, usize, usize)> {
        let (s, pr, k) = self.a.dims3()?;
        let (sb, n, r) = self.b.dims3()?;
        let p = self.parts.len();
        if s != sb
            || p == 0
            || p > MAX_PARTS
            || pr != p * r
            || r > MAX_RANK
            || self.parts.iter().sum::<usize>() != n
        {
            candle_core::bail!(
                "lora: A {:?}, B {:?} and parts {:?} do not fit",
                self.a.shape(),
                self.b.shape(),
                self.parts
            );
        }
        Ok((s, r, k, n))
    }

    /// Checks `x` and `y` against the stack and `rows`; `(rank, in, out)`.
    fn check(&self, y: &Tensor, x: &Tensor, rows: &LoraRows<'_>) -> Result<(usize, usize, usize)> {
        let (num_slots, r, k, n) = self.dims()?;
        let (t, xk) = x.dims2()?;
        let slots_fit = match rows.slots {
            Some(s) => s.dims1()? == t && s.dtype() == DType::U32,
            None => true,
        };
        let mut end = 0;
        for run in rows.runs {
            if run.start < end || run.start + run.len > t || run.slot as usize >= num_slots {
                candle_core::bail!("lora: run {run:?} does not fit {t} rows and {num_slots} slots");
            }
            end = run.start + run.len;
        }
        if xk != k || y.dims2()? != (t, n) || !slots_fit || y.dtype() != x.dtype() {
            candle_core::bail!(
                "lora: x {:?}, y {:?} and slots {:?} do not fit A {:?}",
                x.shape(),
                y.shape(),
                rows.slots.map(Tensor::shape),
                self.a.shape()
            );
        }
        Ok((r, k, n))
    }
}

/// `y` plus each row's LoRA term (see the module's shapes), in `x`'s dtype. On CUDA `y` is
/// written in place when it is contiguous: the caller hands over a product it holds alone.
pub fn lora_add(
    y: &Tensor,
    x: &Tensor,
    stack: &LoraStack<'_>,
    rows: &LoraRows<'_>,
) -> Result<Tensor> {
    apply(y, x, stack, rows, false)
}

/// `silu(g) * v` of a fused gate-up product `y` `[tokens, 2 h]` plus each row's LoRA term (`g`
/// the first `h` columns, `v` the rest): `[tokens, h]`. The stack has the two parts `[h, h]`.
pub fn lora_add_silu_glu(
    y: &Tensor,
    x: &Tensor,
    stack: &LoraStack<'_>,
    rows: &LoraRows<'_>,
) -> Result<Tensor> {
    if stack.parts.len() != 2 || stack.parts[0] != stack.parts[1] {
        candle_core::bail!(
            "lora: a gate-up stack has two equal parts, not {:?}",
            stack.parts
        );
    }
    apply(y, x, stack, rows, true)
}

fn apply(
    y: &Tensor,
    x: &Tensor,
    stack: &LoraStack<'_>,
    rows: &LoraRows<'_>,
    glu: bool,
) -> Result<Tensor> {
    let dims = stack.check(y, x, rows)?;
    let r = dims.0;
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(dev) = x.device() {
        if x.dim(0)? > 0 && r > 0 {
            return cuda::apply(dev, y, x, stack, rows, glu, dims);
        }
    }
    let mut slots = match rows.slots {
        Some(s) => s.to_vec1::<u32>()?,
        None => vec![NO_ADAPTER; x.dim(0)?],
    };
    for run in rows.runs {
        slots[run.start..run.start + run.len].fill(run.slot);
    }
    let out = if r == 0 {
        y.clone()
    } else {
        lora_add_reference(y, x, stack, &slots)?
    };
    if glu {
        crate::silu_and_mul(&out)
    } else {
        Ok(out)
    }
}

/// [`lora_add`] with the slots on the host: rows grouped by slot, each group's term through
/// candle's matmul in `x`'s dtype. The CPU path, and the reference of the CUDA kernels.
pub fn lora_add_reference(
    y: &Tensor,
    x: &Tensor,
    stack: &LoraStack<'_>,
    slots: &[u32],
) -> Result<Tensor> {
    let (num_slots, r, _, _) = stack.dims()?;
    let mut groups: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for (row, &s) in (0u32..).zip(slots) {
        if s != NO_ADAPTER {
            if s as usize >= num_slots {
                candle_core::bail!("lora: slot {s} of row {row} is past the {num_slots} slots");
            }
            groups.entry(s).or_default().push(row);
        }
    }
    let mut out = y.clone();
    for (s, rows) in groups {
        let idx = Tensor::new(rows.as_slice(), x.device())?;
        let xs = x.index_select(&idx, 0)?; // [n, in]
        let a = stack.a.get(s as usize)?.to_dtype(x.dtype())?; // [parts * rank, in]
        let b = stack.b.get(s as usize)?.to_dtype(x.dtype())?; // [out, rank]
        let u = xs.matmul(&a.t()?)?; // [n, parts * rank]
        let mut terms = Vec::with_capacity(stack.parts.len());
        let mut col = 0;
        for (p, &w) in stack.parts.iter().enumerate() {
            let up = u.narrow(1, p * r, r)?.contiguous()?;
            let bp = b.narrow(0, col, w)?;
            terms.push(up.matmul(&bp.t()?)?); // [n, w]
            col += w;
        }
        let term = Tensor::cat(&terms, 1)?.to_dtype(y.dtype())?;
        out = out.index_add(&idx, &term, 0)?;
    }
    Ok(out)
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    use super::{LoraRows, LoraStack};
    use crate::cuda::{
        dtype_suffix, function, launch_dependent, storage_view, tensor_from_slice, KernelElem,
    };
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
    use candle_core::cuda_backend::CudaDevice;
    use candle_core::{DType, Result, Tensor};
    use std::ffi::c_void;

    /// Warps per CTA of the shrink.
    const SHRINK_WARPS: usize = 8;
    const EXPAND_THREADS: usize = 256;

    /// Values of k each warp of the shrink covers: 2,048, or `RSERVE_LORA_SHRINK_CHUNK` (a
    /// multiple of 256). At 64 decode rows of an 8B shape 2,048 against 512 took the shrink's
    /// CTAs from up to ~3.4 waves to under one and the 64-concurrent adapter mix from 0.76x to
    /// 0.82x the base (benchmarks/gpu-notes.md, 2026-12-02).
    fn shrink_chunk() -> usize {
        static CHUNK: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        *CHUNK.get_or_init(|| {
            std::env::var("RSERVE_LORA_SHRINK_CHUNK")
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
                .filter(|c| *c > 0 && c % 256 == 0)
                .unwrap_or(2048)
        })
    }

    pub fn apply(
        dev: &CudaDevice,
        y: &Tensor,
        x: &Tensor,
        stack: &LoraStack<'_>,
        rows: &LoraRows<'_>,
        glu: bool,
        dims: (usize, usize, usize),
    ) -> Result<Tensor> {
        if stack.a.dtype() != x.dtype() || stack.b.dtype() != x.dtype() {
            candle_core::bail!("lora: x, y, A and B must share one dtype");
        }
        match x.dtype() {
            DType::BF16 => run::<half::bf16>(dev, y, x, stack, rows, glu, dims),
            DType::F16 => run::<half::f16>(dev, y, x, stack, rows, glu, dims),
            DType::F32 => run::<f32>(dev, y, x, stack, rows, glu, dims),
            dt => candle_core::bail!("lora: unsupported dtype {dt:?}"),
        }
    }

    fn run<T: KernelElem>(
        dev: &CudaDevice,
        y: &Tensor,
        x: &Tensor,
        stack: &LoraStack<'_>,
        rows: &LoraRows<'_>,
        glu: bool,
        dims: (usize, usize, usize),
    ) -> Result<Tensor> {
        let x = x.contiguous()?;
        let y = y.contiguous()?;
        let (a, b) = (stack.a.contiguous()?, stack.b.contiguous()?);
        if !rows.runs.is_empty() {
            crate::lora_blas::runs::<T>(dev, &y, &x, (&a, &b), stack.parts, rows.runs, dims)?;
        }
        gathered::<T>(dev, &y, &x, (&a, &b), stack.parts, rows, glu, dims)
    }

    /// The BGMV kernels over the rows of `rows.slots`: the shrink writes split-K partials, the
    /// expand adds them and writes `y` in place (or, `glu`, `silu(g) * v` into a new tensor).
    /// Without `slots` no row is left to them: `y` as it is (or, `glu`, `silu(g) * v`). With
    /// `rows.listed` the launches cover the listed rows only (with `glu`, `silu(g) * v` of every
    /// row first, then the listed rows written over).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gathered<T: KernelElem>(
        dev: &CudaDevice,
        y: &Tensor,
        x: &Tensor,
        (a, b): (&Tensor, &Tensor),
        parts: &[usize],
        rows: &LoraRows<'_>,
        glu: bool,
        (r, k, _): (usize, usize, usize),
    ) -> Result<Tensor> {
        let none_left = || {
            if glu {
                crate::silu_and_mul(y)
            } else {
                Ok(y.clone())
            }
        };
        let Some(slots) = rows.slots else {
            return none_left();
        };
        let (slots, list) = match rows.listed {
            Some((list, listed)) => {
                if list.dims1()? != listed.dims1()? || list.dtype() != DType::U32 {
                    candle_core::bail!(
                        "lora: listed rows {:?} and slots {:?}",
                        list.shape(),
                        listed.shape()
                    );
                }
                (listed.contiguous()?, Some(list.contiguous()?))
            }
            None => (slots.contiguous()?, None),
        };
        // the tokens the launches cover: the listed rows, else every row
        let t = slots.dim(0)?;
        if t == 0 {
            return none_left();
        }
        if t > x.dim(0)? {
            candle_core::bail!("lora: {t} listed rows in a step of {} rows", x.dim(0)?);
        }
        let pr = parts.len() * r;
        let chunk = shrink_chunk();
        let chunks = k.div_ceil(chunk);
        let stream = dev.cuda_stream();
        let sfx = dtype_suffix(T::DTYPE)?;
        // SAFETY: the expand reads the partials of adapter rows only, all written by the shrink.
        let mut part = unsafe { crate::cuda::alloc::<f32>(dev, chunks * t * pr) }?;
        // the listed rows' device address (0: token t is row t), held until both launches
        let list_guard = list.as_ref().map(|l| l.storage_and_layout());
        let list_view = match &list_guard {
            Some((g, l)) => Some(storage_view::<u32>(g, l, "lora rows")?),
            None => None,
        };
        let (list_ptr, _l) = match &list_view {
            Some(v) => {
                let (p, g) = v.device_ptr(&stream);
                (p, Some(g))
            }
            None => (0, None),
        };
        {
            let (xg, xl) = x.storage_and_layout();
            let (ag, al) = a.storage_and_layout();
            let (sg, sl) = slots.storage_and_layout();
            let xv = storage_view::<T>(&xg, xl, "lora x")?;
            let av = storage_view::<T>(&ag, al, "lora A")?;
            let sv = storage_view::<u32>(&sg, sl, "lora slots")?;
            let (mut pp, _p) = part.device_ptr_mut(&stream);
            let (mut xp, _x) = xv.device_ptr(&stream);
            let (mut ap, _a) = av.device_ptr(&stream);
            let (mut sp, _s) = sv.device_ptr(&stream);
            let (mut ldx, mut ti, mut pri, mut ki) = (k as i64, t as i32, pr as i32, k as i32);
            let mut ci = chunk as i32;
            let mut lp = list_ptr;
            let shrink = function(dev, &format!("lora_shrink_{sfx}"))?;
            let mut params = [
                (&raw mut pp).cast::<c_void>(),
                (&raw mut xp).cast::<c_void>(),
                (&raw mut ldx).cast::<c_void>(),
                (&raw mut ap).cast::<c_void>(),
                (&raw mut sp).cast::<c_void>(),
                (&raw mut lp).cast::<c_void>(),
                (&raw mut ti).cast::<c_void>(),
                (&raw mut pri).cast::<c_void>(),
                (&raw mut ki).cast::<c_void>(),
                (&raw mut ci).cast::<c_void>(),
            ];
            let grid = (t * pr * chunks).div_ceil(SHRINK_WARPS);
            // SAFETY: `lora_shrink_<dtype>(part, x, ldx, a, slots, rows, tokens, pr, k, chunk)`
            // (csrc/lora.cu): part [chunks, t, pr] f32, x [rows of the step, k] contiguous
            // (ldx = k), a [S, pr, k] and slots [t] u32 (each < S or NO_ADAPTER, as the layer's
            // slots are) contiguous; rows 0 or [t] u32 row indices of x (`listed_rows` of the
            // step's slots, no more of them than x has rows, checked); chunks = ceil(k / chunk);
            // one warp per (token, output, chunk of k), warps past the last exit; the kernel
            // waits before it reads.
            let threads = (SHRINK_WARPS * 32) as u32;
            unsafe { launch_dependent(&shrink, &stream, grid as u32, threads, &mut params) }?;
        }
        // a listed gate-up's rows outside the list still need their SiLU-and-multiply
        let over = match list {
            Some(_) if glu => Some(crate::silu_and_mul(y)?),
            _ => None,
        };
        expand::<T>(
            dev,
            y,
            Shrunk::Partials(&part, chunks),
            b,
            parts,
            (&slots, list_ptr),
            over,
            glu,
            r,
        )
    }

    /// Where the expand finds each row's `u`.
    #[derive(Clone, Copy)]
    pub(crate) enum Shrunk<'a> {
        /// `chunks` partial sums in `[chunks, t, parts * r]` f32 (rows with an adapter written).
        Partials(&'a CudaSlice<f32>, usize),
        /// In `y`'s own row past its `n` outputs: `y` is the product over a weight stored above
        /// the `A` rows of its adapters' first `covered` slots, `[t, n + covered * parts * r]`,
        /// slot `s`'s `u` at columns `n + s * parts * r ..` (rows of a slot past them are left
        /// as base rows).
        InRow { covered: usize },
    }

    /// The expand of the BGMV form: adds each row's `B_s u` (`u` from `shrunk`) to `y`'s `n`
    /// outputs, in place where `y` is `[t, n]` (or, `glu`, writes `silu(g) * v` into a new
    /// `[t, n / 2]`; with `u` in the row, the plain form into a new `[t, n]` too). `slots`: one
    /// per token the launch covers, with the device address of those tokens' row indices (`0`:
    /// token `i` is row `i`, every row covered); `over`, with a row list where the output is not
    /// `y` in place, the tensor the listed rows are written into, which holds every other row's
    /// output already.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn expand<T: KernelElem>(
        dev: &CudaDevice,
        y: &Tensor,
        shrunk: Shrunk<'_>,
        b: &Tensor,
        parts: &[usize],
        (slots, list_ptr): (&Tensor, u64),
        over: Option<Tensor>,
        glu: bool,
        r: usize,
    ) -> Result<Tensor> {
        let (rows, ldy) = y.dims2()?;
        let (num_slots, n, _) = b.dims3()?;
        let pr = parts.len() * r;
        let width = if glu { n / 2 } else { n };
        // the tokens the launch covers
        let t = slots.dim(0)?;
        let fits = match shrunk {
            Shrunk::Partials(part, chunks) => ldy == n && part.len() >= chunks * t * pr,
            Shrunk::InRow { covered } => covered <= num_slots && ldy == n + covered * pr,
        };
        // a new output (glu, or u in the row) has every row written: by this launch, or, with a
        // row list, before it (`over`); the plain form with partials adds into y in place
        let new_output = glu || matches!(shrunk, Shrunk::InRow { .. });
        let rows_fit = if list_ptr == 0 {
            t == rows && over.is_none()
        } else {
            t <= rows && (over.is_some() || !new_output)
        };
        let over_fits = match &over {
            Some(o) => o.dims2()? == (rows, width) && o.dtype() == y.dtype() && o.is_contiguous(),
            None => true,
        };
        if !fits || !rows_fit || !over_fits || !y.is_contiguous() || !b.is_contiguous() {
            candle_core::bail!(
                "lora expand: y {:?} does not fit B {:?}, its u and {t} rows",
                y.shape(),
                b.shape()
            );
        }
        let (part, chunks) = match shrunk {
            Shrunk::Partials(part, chunks) => (Some(part), chunks),
            Shrunk::InRow { .. } => (None, 0),
        };
        let stream = dev.cuda_stream();
        // SAFETY: with glu or u in the row every element of the new output is written by the
        // expand (rows without an adapter copied).
        let mut fresh = if new_output && over.is_none() {
            Some(unsafe { crate::cuda::alloc::<T>(dev, rows * width) }?)
        } else {
            None
        };
        let over_guard = over.as_ref().map(|o| o.storage_and_layout());
        let over_view = match &over_guard {
            Some((g, l)) => Some(storage_view::<T>(g, l, "lora out")?),
            None => None,
        };
        let (yg, yl) = y.storage_and_layout();
        let (bg, bl) = b.storage_and_layout();
        let (sg, sl) = slots.storage_and_layout();
        let yv = storage_view::<T>(&yg, yl, "lora y")?;
        let bv = storage_view::<T>(&bg, bl, "lora B")?;
        let sv = storage_view::<u32>(&sg, sl, "lora slots")?;
        let (mut pp, _p) = match part {
            Some(p) => {
                let (ptr, g) = p.device_ptr(&stream);
                (ptr, Some(g))
            }
            None => (0, None),
        };
        let mut ldyi = ldy as i64;
        let (mut sp, _s) = sv.device_ptr(&stream);
        let (mut yp, _y) = yv.device_ptr(&stream);
        let (mut op, _o) = match (fresh.as_mut(), &over_view) {
            (Some(f), _) => {
                let (p, g) = f.device_ptr_mut(&stream);
                (p, Some(g))
            }
            // the listed rows written over the caller's SiLU-and-multiply
            (None, Some(v)) => {
                let (p, g) = v.device_ptr(&stream);
                (p, Some(g))
            }
            (None, None) => (yp, None),
        };
        let mut lp = list_ptr;
        let (mut bp, _b) = bv.device_ptr(&stream);
        let mut ends = [n as i32; 2];
        let mut col = 0;
        for (e, w) in ends.iter_mut().zip(parts) {
            col += w;
            *e = col as i32;
        }
        let (mut ti, mut ni, mut ri, mut pri, mut ci) =
            (t as i32, n as i32, r as i32, pr as i32, chunks as i32);
        let (mut e0, mut e1) = (ends[0], ends[1]);
        let name = if glu {
            "lora_expand_glu"
        } else {
            "lora_expand"
        };
        let expand = function(dev, &format!("{name}_{}", dtype_suffix(T::DTYPE)?))?;
        let mut params = [
            (&raw mut op).cast::<c_void>(),
            (&raw mut yp).cast::<c_void>(),
            (&raw mut ldyi).cast::<c_void>(),
            (&raw mut pp).cast::<c_void>(),
            (&raw mut bp).cast::<c_void>(),
            (&raw mut sp).cast::<c_void>(),
            (&raw mut lp).cast::<c_void>(),
            (&raw mut ti).cast::<c_void>(),
            (&raw mut ni).cast::<c_void>(),
            (&raw mut ri).cast::<c_void>(),
            (&raw mut pri).cast::<c_void>(),
            (&raw mut ci).cast::<c_void>(),
            (&raw mut e0).cast::<c_void>(),
            (&raw mut e1).cast::<c_void>(),
        ];
        let grid = t * width.div_ceil(EXPAND_THREADS);
        // SAFETY: `lora_expand[_glu]_<dtype>(out, y, ldy, part, b, slots, rows, tokens, n, r,
        // pr, chunks, e0, e1)` (csrc/lora.cu): y [rows, ldy] contiguous; out y itself (written in
        // place, the caller's product, ldy = n), a fresh [rows, width] or the caller's
        // [rows, width] (checked) of which only the listed rows are written; rows 0 (t = rows) or
        // [t] u32 row indices below rows (`listed_rows` of the step's slots); part holds the
        // partials of the t tokens written before on this stream (length checked), or is null
        // with ldy = n + C * pr, C <= S (u in the row, checked; the kernel treats a slot >= C as
        // NO_ADAPTER); b [S, n, r] contiguous; slots [t] u32 (each < S or NO_ADAPTER); e0 <= e1
        // <= n the parts' ends; pr <= kMaxPr (rank <= MAX_RANK, checked by the stack); one CTA
        // per (token, tile of EXPAND_THREADS columns).
        let threads = EXPAND_THREADS as u32;
        unsafe { launch_dependent(&expand, &stream, grid as u32, threads, &mut params) }?;
        drop((_o, _y, _b, _p, _s));
        drop(over_guard);
        match (fresh, over) {
            (Some(f), _) => Ok(tensor_from_slice(f, dev, (rows, width))),
            (None, Some(o)) => Ok(o),
            (None, None) => Ok(y.clone()),
        }
    }
}
