//! The launches of `csrc/ggml.cu`.

use super::{data_bytes, has_scales, BlockWeight, GEMV_MAX_ROWS};
use crate::cuda::{dtype_suffix, function, launch_dependent, storage_view, tensor_from_slice};
use crate::quantize::BlockType;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device, Result, Tensor};
use std::ffi::c_void;
use std::sync::Arc;

/// The format's name in the kernels' names.
fn format_name(t: BlockType) -> &'static str {
    match t {
        BlockType::Q8_0 => "q8_0",
        BlockType::Q4_0 => "q4_0",
        BlockType::Q5_0 => "q5_0",
        BlockType::Q4K => "q4k",
        BlockType::Q6K => "q6k",
    }
}

/// Quantizes `w` `[n, k]` (contiguous; f32, bf16 or f16) on the GPU: the data and scales.
pub fn quantize(dev: &CudaDevice, t: BlockType, w: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
    match w.dtype() {
        DType::BF16 => quantize_as::<half::bf16>(dev, t, w),
        DType::F16 => quantize_as::<half::f16>(dev, t, w),
        DType::F32 => quantize_as::<f32>(dev, t, w),
        dt => candle_core::bail!("no GPU quantizer from {dt:?}"),
    }
}

fn quantize_as<T: crate::cuda::KernelElem>(
    dev: &CudaDevice,
    t: BlockType,
    w: &Tensor,
) -> Result<(Tensor, Option<Tensor>)> {
    let (n, k) = w.dims2()?;
    let per_row = k / t.block_values();
    let blocks = n * per_row;
    let stream = dev.cuda_stream();
    // SAFETY: the kernel writes every block's data and scale.
    let mut q = unsafe { crate::cuda::alloc::<u8>(dev, blocks * data_bytes(t)) }?;
    let mut d = unsafe { crate::cuda::alloc::<half::f16>(dev, blocks.max(1)) }?;
    if blocks > 0 {
        let name = format!(
            "ggml_quantize_{}_{}",
            format_name(t),
            dtype_suffix(T::DTYPE)?
        );
        let func = function(dev, &name)?;
        let (wg, wl) = w.storage_and_layout();
        let wv = storage_view::<T>(&wg, wl, "weight")?;
        let (mut wp, _w) = wv.device_ptr(&stream);
        let (mut qp, _q) = q.device_ptr_mut(&stream);
        let (mut dp, _d) = d.device_ptr_mut(&stream);
        let mut nb = blocks as u64;
        let mut params = [
            (&raw mut qp).cast::<c_void>(),
            (&raw mut dp).cast::<c_void>(),
            (&raw mut wp).cast::<c_void>(),
            (&raw mut nb).cast::<c_void>(),
        ];
        // blocks per CTA of 256 threads: one per thread, 32 for q4k (8 lanes each), 16 for q6k
        let per_cta = match t {
            BlockType::Q4K => 32,
            BlockType::Q6K => 16,
            _ => 256,
        };
        let grid = u32::try_from(blocks.div_ceil(per_cta))
            .map_err(|_| candle_core::Error::Msg(format!("{t:?}: weight too large")))?;
        // SAFETY: `ggml_quantize_<fmt>_<dtype>(q, d, x, blocks)` (csrc/ggml.cu): x holds `blocks`
        // contiguous blocks of T (checked by `view`), q `blocks * data_bytes` bytes, d `blocks`
        // f16 (unused by q4k); CTAs of 256 threads as counted above; the kernel waits before
        // it reads or writes.
        unsafe { launch_dependent(&func, &stream, grid, 256, &mut params) }?;
    }
    let data = tensor_from_slice(q, dev, (n, per_row * data_bytes(t)));
    let scales = if has_scales(t) {
        let s = tensor_from_slice(d, dev, blocks.max(1));
        Some(s.narrow(0, 0, blocks)?.reshape((n, per_row))?)
    } else {
        None
    };
    Ok((data, scales))
}

/// Runs `f` with the device pointers of `w`'s data and scales (0 for `q4k`), valid on `stream`
/// for the call.
fn with_weight<R>(
    w: &BlockWeight,
    stream: &Arc<CudaStream>,
    f: impl FnOnce(u64, u64) -> Result<R>,
) -> Result<R> {
    let (dg, dl) = w.data.storage_and_layout();
    let data = storage_view::<u8>(&dg, dl, "block data")?;
    let (wp, _w) = data.device_ptr(stream);
    match &w.scales {
        Some(s) => {
            let (sg, sl) = s.storage_and_layout();
            let scales = storage_view::<half::f16>(&sg, sl, "block scales")?;
            let (sp, _s) = scales.device_ptr(stream);
            f(wp, sp)
        }
        None => f(wp, 0),
    }
}

/// `w` dequantized to `dtype`.
pub fn dequantize(dev: &CudaDevice, w: &BlockWeight, dtype: DType, tiled: bool) -> Result<Tensor> {
    match dtype {
        DType::BF16 => dequantize_as::<half::bf16>(dev, w, tiled),
        DType::F16 => dequantize_as::<half::f16>(dev, w, tiled),
        DType::F32 => dequantize_as::<f32>(dev, w, tiled),
        dt => candle_core::bail!("no GPU dequantizer to {dt:?}"),
    }
}

/// Chunks of a tile of the tiled dequantizer (`kTileChunks` in csrc/ggml.cu), one a thread.
const TILE_CHUNKS: usize = 128;

fn dequantize_as<T: crate::cuda::KernelElem>(
    dev: &CudaDevice,
    w: &BlockWeight,
    tiled: bool,
) -> Result<Tensor> {
    let (n, k) = w.shape;
    let stream = dev.cuda_stream();
    // SAFETY: every element is written by the kernel.
    let mut y = unsafe { crate::cuda::alloc::<T>(dev, n * k) }?;
    if n * k > 0 {
        let name = format!(
            "ggml_dequantize_{}{}_{}",
            if tiled { "tiled_" } else { "" },
            format_name(w.t),
            dtype_suffix(T::DTYPE)?
        );
        let func = function(dev, &name)?;
        let (mut yp, _y) = y.device_ptr_mut(&stream);
        with_weight(w, &stream, |mut wp, mut sp| {
            let (mut ni, mut ki) = (n as i32, k as i32);
            let mut params = [
                (&raw mut yp).cast::<c_void>(),
                (&raw mut wp).cast::<c_void>(),
                (&raw mut sp).cast::<c_void>(),
                (&raw mut ni).cast::<c_void>(),
                (&raw mut ki).cast::<c_void>(),
            ];
            let sms = 132 * 8;
            let (grid, threads) = if tiled {
                let chunks = n * k / chunk_values(w.t);
                (
                    chunks.div_ceil(TILE_CHUNKS).clamp(1, 132 * 16),
                    TILE_CHUNKS as u32,
                )
            } else {
                ((n * k / 32).div_ceil(256).clamp(1, sms), 256)
            };
            // SAFETY: `ggml_dequantize_[tiled_]<fmt>_<dtype>(out, w, d, n, k)` (csrc/ggml.cu): w
            // and d are the weight's data and scales in the device layout for [n, k] (null d for
            // q4k), out holds n * k of T; grid-stride loops, so any grid is valid (the tiled form
            // takes CTAs of kTileChunks threads); the kernels wait before they write.
            unsafe { launch_dependent(&func, &stream, grid as u32, threads, &mut params) }
        })?;
    }
    Ok(tensor_from_slice(y, dev, (n, k)))
}

/// Values a dequantizer thread unpacks (`kVals` of the format in csrc/ggml.cu).
fn chunk_values(t: BlockType) -> usize {
    match t {
        BlockType::Q4K | BlockType::Q6K => 64,
        BlockType::Q8_0 | BlockType::Q4_0 | BlockType::Q5_0 => 32,
    }
}

/// The streaming product `x W^T` (with `glu`, SiLU(x G^T) * x U^T of a stacked gate-up weight),
/// or `None` where it does not apply: CPU tensors, activations other than bf16 and f16, more than
/// [`GEMV_MAX_ROWS`] rows.
pub fn gemv(w: &BlockWeight, x: &Tensor, glu: bool) -> Result<Option<Tensor>> {
    let Device::Cuda(dev) = x.device() else {
        return Ok(None);
    };
    let (m, k) = x.dims2()?;
    if k != w.shape.1 || !(1..=GEMV_MAX_ROWS).contains(&m) || !w.data.device().is_cuda() {
        return Ok(None);
    }
    let x = x.contiguous()?;
    match x.dtype() {
        DType::BF16 => gemv_as::<half::bf16>(dev, w, &x, glu).map(Some),
        DType::F16 => gemv_as::<half::f16>(dev, w, &x, glu).map(Some),
        _ => Ok(None),
    }
}

fn gemv_as<T: crate::cuda::KernelElem>(
    dev: &CudaDevice,
    w: &BlockWeight,
    x: &Tensor,
    glu: bool,
) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    let wn = w.shape.0;
    let n = if glu { wn / 2 } else { wn };
    let stream = dev.cuda_stream();
    // SAFETY: every element of y is written by the kernel.
    let mut y = unsafe { crate::cuda::alloc::<T>(dev, m * n) }?;
    if n > 0 {
        // the kernels are built for 1, 2, 4 and 8 rows (m <= GEMV_MAX_ROWS = 8)
        let bucket = m.next_power_of_two();
        let form = if glu { "ggml_gemv_glu" } else { "ggml_gemv" };
        let name = format!(
            "{form}_{}_m{bucket}_{}",
            format_name(w.t),
            dtype_suffix(T::DTYPE)?
        );
        let func = function(dev, &name)?;
        let (xg, xl) = x.storage_and_layout();
        let xv = storage_view::<T>(&xg, xl, "x")?;
        let (mut xp, _x) = xv.device_ptr(&stream);
        let (mut yp, _y) = y.device_ptr_mut(&stream);
        with_weight(w, &stream, |mut wp, mut sp| {
            let (mut mi, mut ni, mut ki) = (m as i32, wn as i32, k as i32);
            let mut params = [
                (&raw mut yp).cast::<c_void>(),
                (&raw mut xp).cast::<c_void>(),
                (&raw mut wp).cast::<c_void>(),
                (&raw mut sp).cast::<c_void>(),
                (&raw mut mi).cast::<c_void>(),
                (&raw mut ni).cast::<c_void>(),
                (&raw mut ki).cast::<c_void>(),
            ];
            // 4 warps of 4 rows of W per CTA: 16 outputs, or in the GLU form 8 (2 gate and the
            // 2 matching up rows a warp)
            let grid = n.div_ceil(if glu { 8 } else { 16 }) as u32;
            // SAFETY: `ggml_gemv[_glu]_<fmt>_m<M>_<dtype>(y, x, w, d, m, n, k)` (csrc/ggml.cu): x
            // [m, k] contiguous of T with m <= M, w and d the weight's data and scales for [n, k]
            // in the device layout (d null for q4k), k a multiple of the block (checked when the
            // weight was made), y [m, n or n / 2]; 128 threads per CTA (kGemvThreads); the
            // kernel waits before it reads x or writes y.
            unsafe { launch_dependent(&func, &stream, grid, 128, &mut params) }
        })?;
    }
    Ok(tensor_from_slice(y, dev, (m, n)))
}
