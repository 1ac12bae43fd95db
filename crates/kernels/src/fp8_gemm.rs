//! FP8 tensor-core products through cuBLASLt: `y = (sx ⊗ sw) ∘ (xq wq^T)` for E4M3 activations
//! `xq` `[m, k]` with per-token scales `sx` `[m]` and an E4M3 weight `wq` `[n, k]` with
//! per-channel scales `sw` `[n]`, accumulated in f32 and written in 16 bits.
//!
//! cuBLASLt on Hopper scales FP8 operands per tensor only (its outer-vector scales were refused
//! for sm_90 by cuBLAS 13.1), so the product runs with unit scales and `fp8_scale_outer_*`
//! (csrc/fp8.cu) applies the per-token and per-channel scales to its output: in place for bf16
//! (the unscaled sums, at most 448² k, are within bf16's range), from an f32 output for f16
//! (they are not within f16's). The product itself runs in the crate's shared cuBLASLt module.

use crate::cublaslt::{self, Form, Operands};
use crate::cuda::{
    cuda_storage, dtype_suffix, function, launch_dependent, storage_view, tensor_from_slice, view,
};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::{DType, Result, Tensor, WithDType};
use std::ffi::c_void;

/// `[m, n]` in `out` (bf16 or f16): the FP8 product of `xq` `[m, k]` (scales `sx` `[m]`) and
/// `wq` `[n, k]` (scales `sw` `[n]`), all contiguous on `dev`; `k` and `n` multiples of 16.
pub fn scaled_mm(
    dev: &CudaDevice,
    xq: &Tensor,
    sx: &Tensor,
    wq: &Tensor,
    sw: &Tensor,
    out: DType,
) -> Result<Tensor> {
    match out {
        DType::BF16 => scaled_mm_as::<half::bf16>(dev, xq, sx, wq, sw),
        DType::F16 => scaled_mm_as::<half::f16>(dev, xq, sx, wq, sw),
        dt => candle_core::bail!("fp8 product: no {dt:?} output"),
    }
}

/// For a fused gate-up weight `wq` `[2 * inter, k]` (gate rows, then up rows): `a` =
/// `silu(gate) * up` `[m, inter]` in `out` (bf16 or f16) with its FP8 rows `(q, scale)`, the bits
/// [`scaled_mm`], `silu_and_mul` and `fp8::quantize_rows` give one after another, from one pass
/// over the product's sums (`fp8_glu_rows_*`).
pub fn scaled_mm_glu_rows(
    dev: &CudaDevice,
    xq: &Tensor,
    sx: &Tensor,
    wq: &Tensor,
    sw: &Tensor,
    out: DType,
) -> Result<(Tensor, Tensor, Tensor)> {
    match out {
        DType::BF16 => glu_rows_as::<half::bf16>(dev, xq, sx, wq, sw),
        DType::F16 => glu_rows_as::<half::f16>(dev, xq, sx, wq, sw),
        dt => candle_core::bail!("fp8 product: no {dt:?} output"),
    }
}

/// A product's unscaled sums `[m, n]`: in T where T is bf16 (the sums, at most 448² k, are within
/// its range), else in f32.
enum Sums<T> {
    Own(CudaSlice<T>),
    F32(CudaSlice<f32>),
}

/// `xq wq^T` with unit scales, `(m, n)` and the sums.
fn product<T: CudaDType + WithDType + DeviceRepr>(
    dev: &CudaDevice,
    xq: &Tensor,
    wq: &Tensor,
) -> Result<((usize, usize), Sums<T>)> {
    let (m, k) = xq.dims2()?;
    let (n, wk) = wq.dims2()?;
    if k != wk || k % 16 != 0 || n % 16 != 0 || m == 0 || n == 0 {
        candle_core::bail!("fp8 product: x [{m}, {k}] against weight [{n}, {wk}]");
    }
    let stream = dev.cuda_stream();
    // SAFETY: every element is written by the product.
    let mut sums = match T::DTYPE {
        DType::BF16 => Sums::Own(unsafe { crate::cuda::alloc::<T>(dev, m * n) }?),
        _ => Sums::F32(unsafe { crate::cuda::alloc::<f32>(dev, m * n) }?),
    };
    let (xg, xl) = xq.storage_and_layout();
    let (wg, wl) = wq.storage_and_layout();
    let xv = storage_view::<u8>(&xg, xl, "activations")?;
    let wv = storage_view::<u8>(&wg, wl, "weight")?;
    {
        let (xp, _x) = xv.device_ptr(&stream);
        let (wp, _w) = wv.device_ptr(&stream);
        let (form, (dp, _d)) = match &mut sums {
            Sums::Own(y) => (DType::BF16, y.device_ptr_mut(&stream)),
            Sums::F32(s) => (DType::F32, s.device_ptr_mut(&stream)),
        };
        let ops = Operands {
            w: wp,
            x: xp,
            y: dp,
            bias: 0,
        };
        // SAFETY: weight [n, k] and activations [m, k] E4M3, the sums [m, n] of the form's
        // output type, all contiguous on `dev` (checked above), their guards held to the end of
        // this block.
        if !unsafe { cublaslt::matmul(dev, (m, n, k), Form::Fp8 { sums: form }, &ops) }? {
            candle_core::bail!("fp8 product: cuBLASLt has no algorithm for m={m} n={n} k={k}");
        }
    }
    Ok(((m, n), sums))
}

/// The device pointers of the scales `sx` `[m]` and `sw` `[n]` (f32), with their guards.
macro_rules! scale_ptrs {
    ($stream:expr, $sx:expr, $sw:expr, $sxp:ident, $swp:ident) => {
        let (sxg, sxl) = $sx.storage_and_layout();
        let (swg, swl) = $sw.storage_and_layout();
        let sxv = view::<f32>(
            cuda_storage(&sxg, "activation scales")?,
            sxl,
            "activation scales",
        )?;
        let swv = storage_view::<f32>(&swg, swl, "weight scales")?;
        let ($sxp, _sx_guard) = sxv.device_ptr($stream);
        let ($swp, _sw_guard) = swv.device_ptr($stream);
    };
}

fn scaled_mm_as<T: CudaDType + WithDType + DeviceRepr>(
    dev: &CudaDevice,
    xq: &Tensor,
    sx: &Tensor,
    wq: &Tensor,
    sw: &Tensor,
) -> Result<Tensor> {
    let (m, n) = (xq.dims2()?.0, wq.dims2()?.0);
    if m == 0 || n == 0 {
        return Tensor::zeros((m, n), T::DTYPE, xq.device());
    }
    let ((m, n), sums) = product::<T>(dev, xq, wq)?;
    let stream = dev.cuda_stream();
    scale_ptrs!(&stream, sx, sw, sxp, swp);
    let y = match sums {
        Sums::Own(mut y) => {
            scale_outer::<T>(dev, &mut y, None, sxp, swp, (m, n))?;
            y
        }
        Sums::F32(s) => {
            // SAFETY: every element is written by the scaling kernel.
            let mut y = unsafe { crate::cuda::alloc::<T>(dev, m * n) }?;
            scale_outer::<T>(dev, &mut y, Some(&s), sxp, swp, (m, n))?;
            y
        }
    };
    Ok(tensor_from_slice(y, dev, (m, n)))
}

fn glu_rows_as<T: CudaDType + WithDType + DeviceRepr>(
    dev: &CudaDevice,
    xq: &Tensor,
    sx: &Tensor,
    wq: &Tensor,
    sw: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (m, n) = (xq.dims2()?.0, wq.dims2()?.0);
    if n % 16 != 0 {
        candle_core::bail!("fp8 gate-up product: {n} rows");
    }
    let inter = n / 2;
    if m == 0 {
        return Ok((
            Tensor::zeros((0, inter), T::DTYPE, xq.device())?,
            Tensor::zeros((0, inter), DType::U8, xq.device())?,
            Tensor::zeros(0, DType::F32, xq.device())?,
        ));
    }
    let (_, sums) = product::<T>(dev, xq, wq)?;
    let stream = dev.cuda_stream();
    scale_ptrs!(&stream, sx, sw, sxp, swp);
    // SAFETY: every element, byte and scale is written by the kernel (one CTA per row).
    let mut a = unsafe { crate::cuda::alloc::<T>(dev, m * inter) }?;
    let mut q = unsafe { crate::cuda::alloc::<u8>(dev, m * inter) }?;
    let mut qs = unsafe { crate::cuda::alloc::<f32>(dev, m) }?;
    {
        let (form, (mut dp, _d)) = match &sums {
            Sums::Own(y) => ("", y.device_ptr(&stream)),
            Sums::F32(s) => ("_f32", s.device_ptr(&stream)),
        };
        let func = function(
            dev,
            &format!("fp8_glu_rows{form}_{}", dtype_suffix(T::DTYPE)?),
        )?;
        let (mut ap, _a) = a.device_ptr_mut(&stream);
        let (mut qp, _q) = q.device_ptr_mut(&stream);
        let (mut qsp, _qs) = qs.device_ptr_mut(&stream);
        let (mut sxp, mut swp) = (sxp, swp);
        let mut ii = inter as i32;
        let mut params = [
            (&raw mut ap).cast::<c_void>(),
            (&raw mut qp).cast::<c_void>(),
            (&raw mut qsp).cast::<c_void>(),
            (&raw mut dp).cast::<c_void>(),
            (&raw mut sxp).cast::<c_void>(),
            (&raw mut swp).cast::<c_void>(),
            (&raw mut ii).cast::<c_void>(),
        ];
        // SAFETY: `fp8_glu_rows[_f32]_<dtype>(a, q, qs, d, sx, sw, inter)` (csrc/fp8.cu): d the
        // sums [m, 2 inter] (T, or f32 with `_f32`), sx [m] and sw [2 inter] f32, a [m, inter]
        // of T, q [m, inter] bytes, qs [m] f32, all alive for the call; one CTA of 256 threads
        // per row; inter is a multiple of 8 (n of 16) and every buffer a fresh allocation.
        unsafe { launch_dependent(&func, &stream, m as u32, 256, &mut params) }?;
    }
    Ok((
        tensor_from_slice(a, dev, (m, inter)),
        tensor_from_slice(q, dev, (m, inter)),
        tensor_from_slice(qs, dev, m),
    ))
}

/// `y = sums * sx[i] * sw[j]`, or in place on `y` without `sums` (`fp8_scale_outer_*`).
fn scale_outer<T: CudaDType + WithDType + DeviceRepr>(
    dev: &CudaDevice,
    y: &mut CudaSlice<T>,
    sums: Option<&CudaSlice<f32>>,
    sx: u64,
    sw: u64,
    (m, n): (usize, usize),
) -> Result<()> {
    let stream = dev.cuda_stream();
    let form = if sums.is_some() { "_f32" } else { "" };
    let name = format!("fp8_scale_outer{form}_{}", dtype_suffix(T::DTYPE)?);
    let func = function(dev, &name)?;
    let (mut yp, _y) = y.device_ptr_mut(&stream);
    let (mut dp, _d) = match sums {
        Some(s) => {
            let (p, g) = s.device_ptr(&stream);
            (p, Some(g))
        }
        None => (yp, None),
    };
    let (mut sxp, mut swp) = (sx, sw);
    let mut ni = n as i32;
    let mut params = [
        (&raw mut yp).cast::<c_void>(),
        (&raw mut dp).cast::<c_void>(),
        (&raw mut sxp).cast::<c_void>(),
        (&raw mut swp).cast::<c_void>(),
        (&raw mut ni).cast::<c_void>(),
    ];
    // a thread takes 8 columns (`kScaleCols` = 2,048 per CTA in csrc/fp8.cu)
    let grid = (m * n.div_ceil(8 * 256)) as u32;
    // SAFETY: `fp8_scale_outer[_f32]_<dtype>(y, d, sx, sw, n)` (csrc/fp8.cu): y [m, n] of T, d
    // the sums ([m, n] f32, or y itself), sx [m] and sw [n] f32, alive for the call (the caller
    // holds their guards); m * ceil(n / 2048) CTAs of 256 threads.
    unsafe { launch_dependent(&func, &stream, grid, 256, &mut params) }
}
