//! FP8 E4M3 rows with one f32 scale per row: the weights of `--isq fp8` (one scale per output
//! channel) and, on GPUs with FP8 tensor cores, the activations of the products (one scale per
//! token, computed at run time, as vLLM's dynamic `--quantization fp8` does).
//!
//! A row's scale is `amax / 448` (448 being E4M3's largest finite value), at least the smallest
//! normal f32, and 1 for a row of zeros; each value is `x / scale` rounded to nearest-even and
//! saturated to ±448. [`quantize_rows_ref`] is the reference, and the CUDA kernel
//! (`csrc/fp8.cu`) writes the same bits.
//!
//! Products `x W^T` with such a weight ([`linear`], [`silu_glu`]):
//! - CUDA, up to [`GEMV_MAX_ROWS`] rows: the streaming kernel of `csrc/gemv.cu` with the weight
//!   converted in registers (weight-only: the activations stay in 16 bits);
//! - CUDA with FP8 tensor cores (compute capability 8.9 and later), more rows: the activations
//!   quantized per token, then cuBLASLt's FP8 product with the per-token and per-channel scales
//!   applied to its f32 sums;
//! - elsewhere (the CPU, older GPUs): the weight dequantized to the activations' dtype, then a
//!   dense product. This is also the reference of the other two.

use candle_core::{DType, Device, Result, Tensor};
use rayon::prelude::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// E4M3's largest finite value.
pub const E4M3_MAX: f32 = 448.0;

/// Every E4M3 byte's value: [`decode`] as a table, for the CPU attention's inner loops over
/// FP8 caches.
pub static DECODE_TABLE: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut b = 0usize;
    while b < 256 {
        let (e, m) = ((b >> 3) & 0xf, b & 7);
        let magnitude = if e == 15 && m == 7 {
            f32::NAN
        } else if e == 0 {
            m as f32 / 512.0
        } else {
            f32::from_bits(((e + 120) << 23 | m << 20) as u32)
        };
        t[b] = if b & 0x80 != 0 { -magnitude } else { magnitude };
        b += 1;
    }
    t
};

/// `x` in E4M3 (the `fn` variant: no infinities, NaN = `0x7f`/`0xff`), rounded to
/// nearest-even and saturated to ±448.
pub fn encode(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    if x.is_nan() {
        return sign | 0x7f;
    }
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7e;
    }
    let bits = a.to_bits();
    let exp = (bits >> 23) as i32 - 127;
    if exp < -6 {
        // subnormal: m * 2^-9 (the scaling by 512 is exact; m = 8 is the smallest normal)
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let mant = bits & 0x7f_ffff;
    let mut v = (((exp + 7) as u32) << 3) | (mant >> 20);
    let rest = mant & 0xf_ffff;
    if rest > 0x8_0000 || (rest == 0x8_0000 && v & 1 == 1) {
        v += 1; // below 448 this never reaches 0x7f
    }
    sign | v as u8
}

/// The value of E4M3 byte `b` (exact in f32).
pub fn decode(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = i32::from((b >> 3) & 0xf);
    let m = f32::from(b & 7);
    if e == 15 && b & 7 == 7 {
        return f32::NAN;
    }
    sign * if e == 0 {
        m * (-9f32).exp2()
    } else {
        (1.0 + m / 8.0) * ((e - 7) as f32).exp2()
    }
}

/// The scale of a row whose largest magnitude is `amax`.
pub fn row_scale(amax: f32) -> f32 {
    if amax > 0.0 {
        (amax / E4M3_MAX).max(f32::MIN_POSITIVE)
    } else {
        1.0
    }
}

/// The reference quantizer: rows of `cols` values to E4M3 bytes and one scale per row.
pub fn quantize_rows_ref(x: &[f32], cols: usize) -> (Vec<u8>, Vec<f32>) {
    if cols == 0 {
        return (Vec::new(), Vec::new());
    }
    let mut q = vec![0u8; x.len()];
    let mut scales = vec![0f32; x.len() / cols];
    q.par_chunks_mut(cols)
        .zip(x.par_chunks(cols))
        .zip(scales.par_iter_mut())
        .for_each(|((qr, xr), s)| {
            let amax = xr.iter().fold(0f32, |m, v| m.max(v.abs()));
            *s = row_scale(amax);
            for (o, v) in qr.iter_mut().zip(xr) {
                *o = encode(v / *s);
            }
        });
    (q, scales)
}

/// `x` `[rows, k]` as `(q, scale)`: `q` `[rows, k]` u8 E4M3, `scale` `[rows]` f32, on `x`'s
/// device (quantized there).
pub fn quantize_rows(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let (rows, k) = x.dims2()?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = x.device() {
        if matches!(x.dtype(), DType::BF16 | DType::F16 | DType::F32) {
            return cuda::quantize_rows(dev, &x.contiguous()?);
        }
    }
    let v = x
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_device(&Device::Cpu)?
        .to_vec1::<f32>()?;
    let (q, s) = quantize_rows_ref(&v, k);
    Ok((
        Tensor::from_vec(q, (rows, k), x.device())?,
        Tensor::from_vec(s, rows, x.device())?,
    ))
}

/// The rows `q * scale` `[rows, k]` in `dtype`.
pub fn dequantize_rows(q: &Tensor, scale: &Tensor, dtype: DType) -> Result<Tensor> {
    let (rows, k) = q.dims2()?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = q.device() {
        if matches!(dtype, DType::BF16 | DType::F16 | DType::F32) {
            return cuda::dequantize_rows(dev, &q.contiguous()?, &scale.contiguous()?, dtype);
        }
    }
    let lut: Vec<f32> = (0..=255u8).map(decode).collect();
    let qs = q.flatten_all()?.to_device(&Device::Cpu)?.to_vec1::<u8>()?;
    let ss = scale.to_device(&Device::Cpu)?.to_vec1::<f32>()?;
    let mut out = vec![0f32; rows * k];
    if k > 0 {
        out.par_chunks_mut(k)
            .zip(qs.par_chunks(k))
            .zip(ss.par_iter())
            .for_each(|((o, qr), s)| {
                for (v, b) in o.iter_mut().zip(qr) {
                    *v = lut[usize::from(*b)] * s;
                }
            });
    }
    Tensor::from_vec(out, (rows, k), q.device())?.to_dtype(dtype)
}

/// Activation rows already in FP8 form, made by the kernel that produced them (the norm before
/// a product, [`add_rms_norm_rows`]): `q` `[rows, k]` E4M3 and `scale` `[rows]` f32, the
/// bits [`quantize_rows`] gives. An FP8 tensor-core product takes them instead of quantizing its
/// input itself.
#[derive(Debug, Clone)]
pub struct Fp8Rows {
    pub q: Tensor,
    pub scale: Tensor,
}

/// Whether an FP8 product quantizes its input `x` (`[m, k]`) per token, so that it can take the
/// rows as [`Fp8Rows`]: 16-bit activations on a GPU with FP8 tensor cores, more rows than the
/// streaming decode kernel takes.
pub fn takes_fp8_rows(x: &Tensor) -> bool {
    #[cfg(feature = "cuda")]
    {
        let Ok((m, k)) = x.dims2() else {
            return false;
        };
        x.device().is_cuda()
            && matches!(x.dtype(), DType::BF16 | DType::F16)
            && m > crate::gemv::GEMV_MAX_ROWS
            && k.is_multiple_of(16)
            && tensor_cores(x.device())
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = x;
        false
    }
}

/// [`crate::add_rms_norm`] with the normed rows' FP8 form ([`quantize_rows`] of them, the same
/// bits): `(x + residual, norm, rows)`, in one kernel on CUDA for 16-bit activations, the two ops
/// elsewhere.
pub fn add_rms_norm_rows(
    x: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor, Fp8Rows)> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = x.device() {
        if matches!(x.dtype(), DType::BF16 | DType::F16) {
            crate::fused::check_add_rms_norm("add_rms_norm_rows", x, residual, weight)?;
            return cuda::add_rms_norm_rows(dev, x, residual, weight, eps as f32);
        }
    }
    let (sum, normed) = crate::add_rms_norm(x, residual, weight, eps)?;
    let (q, scale) = quantize_rows(&normed)?;
    Ok((sum, normed, Fp8Rows { q, scale }))
}

/// `x` `[m, k]` times the E4M3 weight `q` `[n, k]` (row scales `scale` `[n]`) transposed:
/// `[m, n]` in `x`'s dtype.
pub fn linear(x: &Tensor, q: &Tensor, scale: &Tensor) -> Result<Tensor> {
    linear_with_rows(x, None, q, scale)
}

/// [`linear`] of `x`, whose FP8 form `rows` may come with it (taken where the product quantizes
/// its input).
pub fn linear_with_rows(
    x: &Tensor,
    rows: Option<&Fp8Rows>,
    q: &Tensor,
    scale: &Tensor,
) -> Result<Tensor> {
    check(x, q, scale)?;
    #[cfg(feature = "cuda")]
    if let Some(y) = cuda::linear(x, rows, q, scale, false)? {
        return Ok(y);
    }
    let _ = rows;
    reference_linear(x, q, scale)
}

/// `silu(x G^T) * (x U^T)` for a fused gate-up E4M3 weight `q` `[2 * inter, k]` (gate rows,
/// then up rows): `[m, inter]`.
pub fn silu_glu(x: &Tensor, q: &Tensor, scale: &Tensor) -> Result<Tensor> {
    silu_glu_with_rows(x, None, q, scale)
}

/// [`silu_glu`] of `x` with its FP8 form `rows`, as [`linear_with_rows`].
pub fn silu_glu_with_rows(
    x: &Tensor,
    rows: Option<&Fp8Rows>,
    q: &Tensor,
    scale: &Tensor,
) -> Result<Tensor> {
    check(x, q, scale)?;
    #[cfg(feature = "cuda")]
    if let Some(y) = cuda::linear(x, rows, q, scale, true)? {
        return Ok(y);
    }
    crate::silu_and_mul(&linear_with_rows(x, rows, q, scale)?)
}

/// [`silu_glu_with_rows`] that also gives the result's FP8 rows (the bits [`quantize_rows`] gives)
/// where the product makes them in the same pass, for the next product to take: an FP8
/// tensor-core product ([`takes_fp8_rows`] of `x`) with an intermediate width that is a multiple
/// of 8; elsewhere `None`.
pub fn silu_glu_rows(
    x: &Tensor,
    rows: Option<&Fp8Rows>,
    q: &Tensor,
    scale: &Tensor,
) -> Result<(Tensor, Option<Fp8Rows>)> {
    check(x, q, scale)?;
    #[cfg(feature = "cuda")]
    if let Some((a, r)) = cuda::glu_rows(x, rows, q, scale)? {
        return Ok((a, Some(r)));
    }
    Ok((silu_glu_with_rows(x, rows, q, scale)?, None))
}

/// The reference product: the weight dequantized to `x`'s dtype, then a dense product.
pub fn reference_linear(x: &Tensor, q: &Tensor, scale: &Tensor) -> Result<Tensor> {
    let w = dequantize_rows(q, scale, x.dtype())?;
    crate::linear_rows(x, &w)
}

fn check(x: &Tensor, q: &Tensor, scale: &Tensor) -> Result<()> {
    let (_, k) = x.dims2()?;
    let (n, qk) = q.dims2()?;
    if k != qk || q.dtype() != DType::U8 || scale.dims1()? != n || scale.dtype() != DType::F32 {
        candle_core::bail!(
            "fp8 linear: x {:?} against weight {:?} {:?} with scales {:?} {:?}",
            x.shape(),
            q.shape(),
            q.dtype(),
            scale.shape(),
            scale.dtype()
        );
    }
    Ok(())
}

/// Whether `dev` multiplies FP8 on tensor cores: a CUDA GPU of compute capability 8.9 or later,
/// unless they are turned off ([`allow_tensor_cores`], or `RSERVE_FP8_TENSOR_CORES=0` at start),
/// which gives the path of GPUs without them.
pub fn tensor_cores(dev: &Device) -> bool {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        return tensor_cores_allowed().load(Ordering::Relaxed)
            && cuda::compute_capability(d).is_ok_and(|cc| cc >= (8, 9));
    }
    let _ = dev;
    false
}

fn tensor_cores_allowed() -> &'static AtomicBool {
    static ON: OnceLock<AtomicBool> = OnceLock::new();
    ON.get_or_init(|| AtomicBool::new(crate::switch_on("RSERVE_FP8_TENSOR_CORES")))
}

/// Lets [`tensor_cores`] say yes where the GPU has them (`true`), or makes every GPU take the
/// path of those without them (`false`): for tests and comparisons on one machine.
pub fn allow_tensor_cores(on: bool) {
    tensor_cores_allowed().store(on, Ordering::Relaxed);
}

#[cfg(feature = "cuda")]
mod cuda {
    use crate::cuda::{dtype_suffix, function, launch_dependent, storage_view, tensor_from_slice};
    use crate::fp8_gemm;
    use crate::gemv::GEMV_MAX_ROWS;
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
    use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
    use candle_core::cuda_backend::{CudaDevice, WrapErr};
    use candle_core::{DType, Device, Result, Tensor};
    use std::ffi::c_void;
    use std::sync::{Mutex, OnceLock};

    const THREADS: u32 = 256;

    /// The GPU's compute capability, asked of the driver once per device (the FP8 paths ask
    /// it for every product).
    pub fn compute_capability(dev: &CudaDevice) -> Result<(i32, i32)> {
        type Known = Mutex<Vec<(usize, (i32, i32))>>;
        static KNOWN: OnceLock<Known> = OnceLock::new();
        let ctx = dev.cuda_stream().context().clone();
        let ordinal = ctx.ordinal();
        let known = KNOWN.get_or_init(|| Mutex::new(Vec::new()));
        if let Some(&(_, cc)) = known
            .lock()
            .map_err(|_| candle_core::Error::Msg("compute capability cache poisoned".into()))?
            .iter()
            .find(|(o, _)| *o == ordinal)
        {
            return Ok(cc);
        }
        let major = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .w()?;
        let minor = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
            .w()?;
        if let Ok(mut k) = known.lock() {
            k.push((ordinal, (major, minor)));
        }
        Ok((major, minor))
    }

    pub fn quantize_rows(dev: &CudaDevice, x: &Tensor) -> Result<(Tensor, Tensor)> {
        match x.dtype() {
            DType::BF16 => quantize_as::<half::bf16>(dev, x),
            DType::F16 => quantize_as::<half::f16>(dev, x),
            _ => quantize_as::<f32>(dev, x),
        }
    }

    fn quantize_as<T>(dev: &CudaDevice, x: &Tensor) -> Result<(Tensor, Tensor)>
    where
        T: crate::cuda::KernelElem,
    {
        let (rows, k) = x.dims2()?;
        let stream = dev.cuda_stream();
        // SAFETY: every byte and scale is written by the kernel (one CTA per row).
        let mut q = unsafe { crate::cuda::alloc::<u8>(dev, rows * k) }?;
        let mut s = unsafe { crate::cuda::alloc::<f32>(dev, rows) }?;
        if rows > 0 && k > 0 {
            let func = function(
                dev,
                &format!("fp8_quantize_rows_{}", dtype_suffix(T::DTYPE)?),
            )?;
            let (xg, xl) = x.storage_and_layout();
            let xv = storage_view::<T>(&xg, xl, "x")?;
            let (mut xp, _x) = xv.device_ptr(&stream);
            let (mut qp, _q) = q.device_ptr_mut(&stream);
            let (mut sp, _s) = s.device_ptr_mut(&stream);
            let mut ki = k as i32;
            let mut params = [
                (&raw mut qp).cast::<c_void>(),
                (&raw mut sp).cast::<c_void>(),
                (&raw mut xp).cast::<c_void>(),
                (&raw mut ki).cast::<c_void>(),
            ];
            // SAFETY: `fp8_quantize_rows_<dtype>(q, scale, x, k)` (csrc/fp8.cu): x is
            // [rows, k] contiguous of that dtype, q holds rows * k bytes and scale rows f32;
            // one CTA of 256 threads per row; the kernel waits before it reads.
            unsafe { launch_dependent(&func, &stream, rows as u32, THREADS, &mut params) }?;
        }
        Ok((
            tensor_from_slice(q, dev, (rows, k)),
            tensor_from_slice(s, dev, rows),
        ))
    }

    pub fn add_rms_norm_rows(
        dev: &CudaDevice,
        x: &Tensor,
        residual: &Tensor,
        weight: &Tensor,
        eps: f32,
    ) -> Result<(Tensor, Tensor, super::Fp8Rows)> {
        match x.dtype() {
            DType::BF16 => add_rms_norm_rows_as::<half::bf16>(dev, x, residual, weight, eps),
            _ => add_rms_norm_rows_as::<half::f16>(dev, x, residual, weight, eps),
        }
    }

    fn add_rms_norm_rows_as<T>(
        dev: &CudaDevice,
        x: &Tensor,
        residual: &Tensor,
        weight: &Tensor,
        eps: f32,
    ) -> Result<(Tensor, Tensor, super::Fp8Rows)>
    where
        T: crate::cuda::KernelElem,
    {
        let (rows, h) = x.dims2()?;
        let (x, residual, weight) = (
            x.contiguous()?,
            residual.contiguous()?,
            weight.contiguous()?,
        );
        if residual.dtype() != x.dtype() || weight.dtype() != x.dtype() {
            candle_core::bail!("add_rms_norm_rows: dtypes differ");
        }
        let stream = dev.cuda_stream();
        // SAFETY: every element, byte and scale is written by the kernel (one CTA per row).
        let mut out = unsafe { crate::cuda::alloc::<T>(dev, 2 * rows * h) }?;
        let mut q = unsafe { crate::cuda::alloc::<u8>(dev, rows * h) }?;
        let mut s = unsafe { crate::cuda::alloc::<f32>(dev, rows) }?;
        if rows > 0 && h > 0 {
            let func = function(
                dev,
                &format!("add_rms_norm_fp8_{}", dtype_suffix(T::DTYPE)?),
            )?;
            let (xg, xl) = x.storage_and_layout();
            let (rg, rl) = residual.storage_and_layout();
            let (wg, wl) = weight.storage_and_layout();
            let xv = storage_view::<T>(&xg, xl, "x")?;
            let rv = storage_view::<T>(&rg, rl, "residual")?;
            let wv = storage_view::<T>(&wg, wl, "weight")?;
            let mut b = crate::cuda::Dependent::new(&stream, &func);
            b.buf_mut(&mut out)
                .buf_mut(&mut q)
                .buf_mut(&mut s)
                .buf(&xv)
                .buf(&rv)
                .buf(&wv)
                .val(rows as i32)
                .val(h as i32)
                .val(eps);
            let cfg = crate::fused::norm_launch::<T>(rows, h);
            // SAFETY: matches `add_rms_norm_fp8_<dtype>(out, q, qscale, x, res, w, tokens,
            // hidden, eps)` in csrc/fused.cu: x and residual [rows, h], weight [h], out holds
            // 2 rows * h values, q rows * h bytes and s rows scales; the kernel waits for the
            // kernel before it at entry.
            unsafe { b.launch(cfg) }?;
        }
        let out = tensor_from_slice(out, dev, (2, rows, h));
        Ok((
            out.get(0)?,
            out.get(1)?,
            super::Fp8Rows {
                q: tensor_from_slice(q, dev, (rows, h)),
                scale: tensor_from_slice(s, dev, rows),
            },
        ))
    }

    pub fn dequantize_rows(
        dev: &CudaDevice,
        q: &Tensor,
        scale: &Tensor,
        dtype: DType,
    ) -> Result<Tensor> {
        match dtype {
            DType::BF16 => dequantize_as::<half::bf16>(dev, q, scale),
            DType::F16 => dequantize_as::<half::f16>(dev, q, scale),
            _ => dequantize_as::<f32>(dev, q, scale),
        }
    }

    fn dequantize_as<T>(dev: &CudaDevice, q: &Tensor, scale: &Tensor) -> Result<Tensor>
    where
        T: crate::cuda::KernelElem,
    {
        let (rows, k) = q.dims2()?;
        let stream = dev.cuda_stream();
        // SAFETY: every element is written by the kernel.
        let mut y = unsafe { crate::cuda::alloc::<T>(dev, rows * k) }?;
        if rows > 0 && k > 0 {
            let func = function(
                dev,
                &format!("fp8_dequantize_rows_{}", dtype_suffix(T::DTYPE)?),
            )?;
            let (qg, ql) = q.storage_and_layout();
            let (sg, sl) = scale.storage_and_layout();
            let qv = storage_view::<u8>(&qg, ql, "fp8 weight")?;
            let sv = storage_view::<f32>(&sg, sl, "fp8 scales")?;
            let (mut qp, _q) = qv.device_ptr(&stream);
            let (mut sp, _s) = sv.device_ptr(&stream);
            let (mut yp, _y) = y.device_ptr_mut(&stream);
            let mut ki = k as i32;
            let mut params = [
                (&raw mut yp).cast::<c_void>(),
                (&raw mut qp).cast::<c_void>(),
                (&raw mut sp).cast::<c_void>(),
                (&raw mut ki).cast::<c_void>(),
            ];
            // SAFETY: `fp8_dequantize_rows_<dtype>(y, q, scale, k)` (csrc/fp8.cu): q [rows, k]
            // bytes, scale [rows] f32, y [rows, k]; one CTA per row.
            unsafe { launch_dependent(&func, &stream, rows as u32, THREADS, &mut params) }?;
        }
        Ok(tensor_from_slice(y, dev, (rows, k)))
    }

    /// The CUDA product, or `None` where it is the reference's (CPU tensors, f32 activations).
    pub fn linear(
        x: &Tensor,
        rows: Option<&super::Fp8Rows>,
        q: &Tensor,
        scale: &Tensor,
        glu: bool,
    ) -> Result<Option<Tensor>> {
        let Device::Cuda(dev) = x.device() else {
            return Ok(None);
        };
        if !matches!(x.dtype(), DType::BF16 | DType::F16) {
            return Ok(None);
        }
        let (m, k) = x.dims2()?;
        let (n, _) = q.dims2()?;
        if glu && n % 2 != 0 {
            return Ok(None);
        }
        let x = x.contiguous()?;
        if (1..=GEMV_MAX_ROWS).contains(&m) && k % 16 == 0 {
            return x
                .apply_op3_no_bwd(q, scale, &crate::gemv::Fp8Gemv { glu })
                .map(Some);
        }
        if m > 0 && k % 16 == 0 && n % 16 == 0 && super::tensor_cores(x.device()) {
            let (xq, sx) = rows_of(dev, &x, rows)?;
            let y = fp8_gemm::scaled_mm(dev, &xq, &sx, q, scale, x.dtype())?;
            return if glu {
                crate::silu_and_mul(&y).map(Some)
            } else {
                Ok(Some(y))
            };
        }
        Ok(None)
    }

    /// The tensor-core gate-up product with its result's FP8 rows (`fp8_glu_rows_*`), or `None`
    /// where [`linear`] takes another path or the intermediate width is not a multiple of 8.
    pub fn glu_rows(
        x: &Tensor,
        rows: Option<&super::Fp8Rows>,
        q: &Tensor,
        scale: &Tensor,
    ) -> Result<Option<(Tensor, super::Fp8Rows)>> {
        let Device::Cuda(dev) = x.device() else {
            return Ok(None);
        };
        let (m, k) = x.dims2()?;
        let (n, _) = q.dims2()?;
        if !super::takes_fp8_rows(x) || m == 0 || n % 16 != 0 || k % 16 != 0 {
            return Ok(None);
        }
        let x = x.contiguous()?;
        let (xq, sx) = rows_of(dev, &x, rows)?;
        let (a, aq, ascale) = fp8_gemm::scaled_mm_glu_rows(dev, &xq, &sx, q, scale, x.dtype())?;
        Ok(Some((
            a,
            super::Fp8Rows {
                q: aq,
                scale: ascale,
            },
        )))
    }

    /// The FP8 rows of `x` `[m, k]`: `rows` when they came with it (made from these very
    /// values), else quantized here.
    fn rows_of(
        dev: &CudaDevice,
        x: &Tensor,
        rows: Option<&super::Fp8Rows>,
    ) -> Result<(Tensor, Tensor)> {
        let (m, k) = x.dims2()?;
        match rows {
            Some(r) if r.q.dims2()? == (m, k) && r.scale.dims1()? == m => {
                Ok((r.q.clone(), r.scale.clone()))
            }
            _ => quantize_rows(dev, x),
        }
    }
}
