//! The decode product of an adapted projection in two launches (`csrc/gemv_lora.cu`): the
//! streaming product `x W^T` with a few more CTAs that compute each row's `u = x A_s^T` in full,
//! then the expand of [`crate::lora`] adding `B_s u` (or, for a fused gate-up, writing
//! `silu(g) * v`). For batches of up to [`GEMV_MAX_ROWS`] rows with a 16-bit `W`, on CUDA. It
//! replaces three launches (the product, the split-K shrink, an expand that adds the shrink's
//! partials): one launch fewer per projection, and the expand reads one complete `u`.
//!
//! Larger decode batches over a weight stored above its adapters' `A` rows take
//! [`linear_rows_lora_stacked`]: one product computes `x W^T` and every slot's `u = x A_s^T`
//! (cuBLAS's tensor cores over the rows of all slots, the shrink's gathered launch gone), then
//! the expand reads each row's `u` from its own slot's columns. Steps with prompt runs take
//! [`linear_rows_lora_runs`]: the runs' terms are written first and the product adds onto them
//! in its epilogue, instead of a pass that reads and writes the whole output again after it.
//!
//! Where none applies, [`linear_rows_lora`], [`linear_rows_lora_stacked`] and
//! [`linear_rows_lora_runs`] say so and the caller composes [`crate::linear_rows`] and
//! [`crate::lora::lora_add`], which is also the reference.

use crate::gemv::GEMV_MAX_ROWS;
use crate::lora::{LoraRows, LoraStack, NO_ADAPTER};
use candle_core::{DType, Result, Tensor};

/// Whether decode rows of an adapted dense projection take the two launches: yes, unless
/// `RSERVE_LORA_FUSED=0` (the three-launch form, for comparisons).
pub fn fused_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        !matches!(
            std::env::var("RSERVE_LORA_FUSED").as_deref().map(str::trim),
            Ok("0")
        )
    })
}

/// `x W^T` plus each row's LoRA term (with `glu`, `silu(g) * v` of a fused gate-up's two halves
/// after their terms: `[m, out / 2]`), `slots` `[m]` u32 the rows' adapter slots
/// ([`crate::lora::NO_ADAPTER`]: none). `None` where the two-launch form does not apply: not
/// CUDA, more than [`GEMV_MAX_ROWS`] rows, `W` not a contiguous weight in `x`'s 16-bit dtype, the
/// stack in another dtype or not fitting `W`, a gate-up stack without two equal parts.
pub fn linear_rows_lora(
    x: &Tensor,
    w: &Tensor,
    stack: &LoraStack<'_>,
    slots: &Tensor,
    glu: bool,
) -> Result<Option<Tensor>> {
    if !applies(x, w, stack, slots, glu)? {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(dev) = x.device() {
        return cuda::run(dev, x, w, stack, slots, glu).map(Some);
    }
    Ok(None)
}

/// The most rows [`linear_rows_lora_stacked`] takes: past decode batch sizes the rows of every
/// slot's `A` cost the product compute that prompt chunks need.
pub const STACKED_MAX_ROWS: usize = 256;

/// Whether the LoRA slots of a projection whose weight is `[n, k]` are stored below it
/// (`slot_rows`: slots times `parts * rank`; see [`linear_rows_lora_stacked`]): on CUDA for a
/// weight whose slots' rows are no more than its own, so that idle slots cost a decode product
/// at most as many bytes again, unless `RSERVE_LORA_STACKED=0` (for comparisons).
pub fn stacked_applies(w: &Tensor, slot_rows: usize) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| crate::switch_on("RSERVE_LORA_STACKED"));
    let Ok((n, _)) = w.dims2() else {
        return false;
    };
    on && w.device().is_cuda()
        && matches!(w.dtype(), DType::BF16 | DType::F16 | DType::F32)
        && slot_rows <= n
}

/// `x W^T` plus each row's LoRA term (with `glu`, `silu(g) * v` as [`linear_rows_lora`]) for a
/// weight stored above its adapters' `A` rows: `w_ext` `[n + slots * parts * rank, k]`, its first
/// `n` rows `W`, the rest `stack.a` (`[slots, parts * rank, k]`, the same memory). The product
/// reads the `A` rows of the first `covered` slots only ([`slots_covered`]; 0 or more than the
/// slots: all), so idle slots past the rows' cost nothing; a row whose slot is not covered
/// gets no term. `None` where it does not apply: not CUDA, no rows or more than
/// [`STACKED_MAX_ROWS`], `w_ext` not of that shape in `x`'s dtype, a gate-up stack without two
/// equal parts.
pub fn linear_rows_lora_stacked(
    x: &Tensor,
    w_ext: &Tensor,
    stack: &LoraStack<'_>,
    slots: &Tensor,
    glu: bool,
    covered: usize,
) -> Result<Option<Tensor>> {
    let (m, k) = x.dims2()?;
    let Ok((num_slots, r, ak, n)) = stack.dims() else {
        return Ok(None);
    };
    let parts = stack.parts;
    let applies = x.device().is_cuda()
        && (1..=STACKED_MAX_ROWS).contains(&m)
        && matches!(x.dtype(), DType::BF16 | DType::F16 | DType::F32)
        && w_ext.dtype() == x.dtype()
        && stack.b.dtype() == x.dtype()
        && w_ext.dims2()? == (n + num_slots * parts.len() * r, k)
        && ak == k
        && r > 0
        && slots.dtype() == DType::U32
        && slots.dims1()? == m
        && (!glu || (parts.len() == 2 && parts[0] == parts[1]));
    if !applies {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(dev) = x.device() {
        let covered = if covered == 0 || covered > num_slots {
            num_slots
        } else {
            covered
        };
        // the weight and the covered slots' rows: a prefix of w_ext, no copy
        let w = w_ext.narrow(0, 0, n + covered * parts.len() * r)?;
        let y = crate::linear_rows(x, &w)?;
        return cuda::expand_in_row(dev, &y, stack, slots, glu, r, covered).map(Some);
    }
    let _ = covered; // CUDA only
    Ok(None)
}

/// How many leading device slots hold the adapters of rows with these slots (one past the
/// highest; [`NO_ADAPTER`] rows need none): what [`linear_rows_lora_stacked`] must cover.
pub fn slots_covered(slots: &[u32]) -> usize {
    slots
        .iter()
        .filter(|&&s| s != NO_ADAPTER)
        .map(|&s| s as usize + 1)
        .max()
        .unwrap_or(0)
}

/// Whether prompt runs take [`linear_rows_lora_runs`]: yes, unless `RSERVE_LORA_TERMS_FIRST=0`
/// (the product, then the terms added onto it; for comparisons).
fn terms_first() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| crate::switch_on("RSERVE_LORA_TERMS_FIRST"))
}

/// `x W^T` plus each row's LoRA term (with `glu`, `silu(g) * v`) for a batch with prompt runs:
/// the runs' terms go into the output first and the product adds onto them in its epilogue
/// (`lora_blas`), then the gathered rows' terms as [`crate::lora::lora_add`] adds them. `None`
/// where it does not apply: not CUDA, no runs, `W` not a contiguous `[n, k]` weight in `x`'s
/// dtype (16-bit or f32), the stack not fitting it, a gate-up stack without two equal parts.
pub fn linear_rows_lora_runs(
    x: &Tensor,
    w: &Tensor,
    stack: &LoraStack<'_>,
    rows: &LoraRows<'_>,
    glu: bool,
) -> Result<Option<Tensor>> {
    let (t, k) = x.dims2()?;
    let Ok((num_slots, r, ak, n)) = stack.dims() else {
        return Ok(None);
    };
    let parts = stack.parts;
    let slots_fit = match rows.slots {
        Some(s) => s.dtype() == DType::U32 && s.dims1()? == t,
        None => true,
    };
    let mut end = 0;
    let runs_fit = rows.runs.iter().all(|run| {
        let fits = run.start >= end && run.start + run.len <= t && (run.slot as usize) < num_slots;
        end = run.start + run.len;
        fits
    });
    let applies = terms_first()
        && x.device().is_cuda()
        && !rows.runs.is_empty()
        && runs_fit
        && slots_fit
        && matches!(x.dtype(), DType::BF16 | DType::F16 | DType::F32)
        && w.dtype() == x.dtype()
        && stack.a.dtype() == x.dtype()
        && stack.b.dtype() == x.dtype()
        && w.dims2()? == (n, k)
        && w.is_contiguous()
        && ak == k
        && r > 0
        && (!glu || (parts.len() == 2 && parts[0] == parts[1]));
    if !applies {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(dev) = x.device() {
        return cuda::runs_first(dev, x, w, stack, rows, glu, (r, k, n)).map(Some);
    }
    Ok(None)
}

fn applies(
    x: &Tensor,
    w: &Tensor,
    stack: &LoraStack<'_>,
    slots: &Tensor,
    glu: bool,
) -> Result<bool> {
    if !fused_enabled() || !crate::gemv::kernel_applies(x, w) {
        return Ok(false);
    }
    let (m, k) = x.dims2()?;
    let (n, _) = w.dims2()?;
    // a stack that does not fit itself is the composed path's error to report
    let Ok((_, r, ak, bn)) = stack.dims() else {
        return Ok(false);
    };
    let parts = stack.parts;
    Ok(m <= GEMV_MAX_ROWS
        && ak == k
        && bn == n
        && r > 0
        && stack.a.dtype() == x.dtype()
        && stack.b.dtype() == x.dtype()
        && slots.dtype() == DType::U32
        && slots.dims1()? == m
        && (!glu || (parts.len() == 2 && parts[0] == parts[1])))
}

#[cfg(feature = "cuda")]
mod cuda {
    use crate::cuda::{
        dtype_suffix, function, launch_dependent, storage_view, tensor_from_slice, KernelElem,
    };
    use crate::gemv::{gemv_launch_shape, GEMV_ROWS_PER_CTA};
    use crate::lora::{LoraRows, LoraStack};
    use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
    use candle_core::cuda_backend::CudaDevice;
    use candle_core::{DType, Result, Tensor};
    use std::ffi::c_void;

    /// Rows of x the shrink CTAs cover (`kLoraTokens` in csrc/gemv_lora.cu); each CTA streams
    /// GEMV_ROWS_PER_CTA rows of W or A.
    const LORA_TOKENS: usize = 4;

    /// The expand of a stacked product `y` (u in each row).
    pub fn expand_in_row(
        dev: &CudaDevice,
        y: &Tensor,
        stack: &LoraStack<'_>,
        slots: &Tensor,
        glu: bool,
        r: usize,
        covered: usize,
    ) -> Result<Tensor> {
        let (b, slots) = (stack.b.contiguous()?, slots.contiguous()?);
        let u = crate::lora::cuda::Shrunk::InRow { covered };
        let p = stack.parts;
        match y.dtype() {
            DType::BF16 => {
                crate::lora::cuda::expand::<half::bf16>(dev, y, u, &b, p, (&slots, 0), None, glu, r)
            }
            DType::F16 => {
                crate::lora::cuda::expand::<half::f16>(dev, y, u, &b, p, (&slots, 0), None, glu, r)
            }
            DType::F32 => {
                crate::lora::cuda::expand::<f32>(dev, y, u, &b, p, (&slots, 0), None, glu, r)
            }
            dt => candle_core::bail!("lora stacked product: unsupported dtype {dt:?}"),
        }
    }

    pub fn runs_first(
        dev: &CudaDevice,
        x: &Tensor,
        w: &Tensor,
        stack: &LoraStack<'_>,
        rows: &LoraRows<'_>,
        glu: bool,
        dims: (usize, usize, usize),
    ) -> Result<Tensor> {
        match x.dtype() {
            DType::BF16 => runs_first_t::<half::bf16>(dev, x, w, stack, rows, glu, dims),
            DType::F16 => runs_first_t::<half::f16>(dev, x, w, stack, rows, glu, dims),
            DType::F32 => runs_first_t::<f32>(dev, x, w, stack, rows, glu, dims),
            dt => candle_core::bail!("lora runs: unsupported dtype {dt:?}"),
        }
    }

    fn runs_first_t<T: KernelElem>(
        dev: &CudaDevice,
        x: &Tensor,
        w: &Tensor,
        stack: &LoraStack<'_>,
        rows: &LoraRows<'_>,
        glu: bool,
        dims: (usize, usize, usize),
    ) -> Result<Tensor> {
        let x = x.contiguous()?;
        let (a, b) = (stack.a.contiguous()?, stack.b.contiguous()?);
        let p = stack.parts;
        let y =
            crate::lora_blas::product_over_terms::<T>(dev, &x, w, (&a, &b), p, rows.runs, dims)?;
        crate::lora::cuda::gathered::<T>(dev, &y, &x, (&a, &b), p, rows, glu, dims)
    }

    pub fn run(
        dev: &CudaDevice,
        x: &Tensor,
        w: &Tensor,
        stack: &LoraStack<'_>,
        slots: &Tensor,
        glu: bool,
    ) -> Result<Tensor> {
        match x.dtype() {
            DType::BF16 => launch::<half::bf16>(dev, x, w, stack, slots, glu),
            DType::F16 => launch::<half::f16>(dev, x, w, stack, slots, glu),
            dt => candle_core::bail!("lora gemv: unsupported dtype {dt:?}"),
        }
    }

    fn launch<T: KernelElem>(
        dev: &CudaDevice,
        x: &Tensor,
        w: &Tensor,
        stack: &LoraStack<'_>,
        slots: &Tensor,
        glu: bool,
    ) -> Result<Tensor> {
        let x = x.contiguous()?;
        let (a, b, slots) = (
            stack.a.contiguous()?,
            stack.b.contiguous()?,
            slots.contiguous()?,
        );
        let (m, k) = x.dims2()?;
        let (n, _) = w.dims2()?;
        let (_, pr, _) = a.dims3()?;
        let r = b.dim(2)?;
        let grid = LORA_TOKENS * pr.div_ceil(GEMV_ROWS_PER_CTA) + n.div_ceil(GEMV_ROWS_PER_CTA);
        let stream = dev.cuda_stream();
        // SAFETY: every element of y is written by the kernel; u's rows of tokens with an adapter
        // are written by the shrink CTAs, and the expand reads only those.
        let mut y = unsafe { crate::cuda::alloc::<T>(dev, m * n) }?;
        let mut u = unsafe { crate::cuda::alloc::<f32>(dev, LORA_TOKENS * pr) }?;
        {
            let (xg, xl) = x.storage_and_layout();
            let (wg, wl) = w.storage_and_layout();
            let (ag, al) = a.storage_and_layout();
            let (sg, sl) = slots.storage_and_layout();
            let xv = storage_view::<T>(&xg, xl, "lora gemv x")?;
            let wv = storage_view::<T>(&wg, wl, "lora gemv W")?;
            let av = storage_view::<T>(&ag, al, "lora gemv A")?;
            let sv = storage_view::<u32>(&sg, sl, "lora gemv slots")?;
            let (mut yp, _y) = y.device_ptr_mut(&stream);
            let (mut up, _u) = u.device_ptr_mut(&stream);
            let (mut xp, _x) = xv.device_ptr(&stream);
            let (mut wp, _w) = wv.device_ptr(&stream);
            let (mut ap, _a) = av.device_ptr(&stream);
            let (mut sp, _s) = sv.device_ptr(&stream);
            let (mut mi, mut ni, mut ki, mut pri) = (m as i32, n as i32, k as i32, pr as i32);
            let mut params = [
                (&raw mut yp).cast::<c_void>(),
                (&raw mut xp).cast::<c_void>(),
                (&raw mut wp).cast::<c_void>(),
                (&raw mut mi).cast::<c_void>(),
                (&raw mut ni).cast::<c_void>(),
                (&raw mut ki).cast::<c_void>(),
                (&raw mut ap).cast::<c_void>(),
                (&raw mut sp).cast::<c_void>(),
                (&raw mut up).cast::<c_void>(),
                (&raw mut pri).cast::<c_void>(),
            ];
            let (bucket, threads) = gemv_launch_shape(m);
            let name = format!("gemv_shrink_m{bucket}_{}", dtype_suffix(T::DTYPE)?);
            let func = function(dev, &name)?;
            // SAFETY: the parameters are `gemv_shrink_m<M>_<dtype>`'s (csrc/gemv_lora.cu) in
            // order: y [m, n], x [m, k], W [n, k], A [S, pr, k] and slots [m] (each < S or
            // NO_ADAPTER, as the layer's slots are), all contiguous (checked by `applies` and
            // `view`); u [LORA_TOKENS, pr] f32; m <= M, k a multiple of 8; the grid is the
            // shrink CTAs then the product's, as the kernel counts them; it waits for the
            // previous kernel before it reads x or writes anything.
            unsafe { launch_dependent(&func, &stream, grid as u32, threads, &mut params) }?;
        }
        let y = tensor_from_slice(y, dev, (m, n));
        let u = crate::lora::cuda::Shrunk::Partials(&u, 1);
        crate::lora::cuda::expand::<T>(dev, &y, u, &b, stack.parts, (&slots, 0), None, glu, r)
    }
}
