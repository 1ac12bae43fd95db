//! `y = x W^T` for the few rows of a decode batch. At batch sizes up to [`GEMV_MAX_ROWS`] the
//! product is bound by reading `W` once; on CUDA with 16-bit weights it runs as one streaming
//! kernel (`csrc/gemv.cu`), elsewhere (and for larger batches) as candle's matmul, which is also
//! the reference. Measured on H100 (`benchmarks/gpu/kbench.cu`): at one or two rows the kernel
//! streams 8B-shaped weights 6% faster than cuBLAS, at four rows it matches it, and from five
//! rows on cuBLAS's tensor-core kernels win.

use candle_core::{DType, Result, Tensor};

/// The most rows of `x` the streaming kernel takes.
pub const GEMV_MAX_ROWS: usize = 4;

/// Outputs each CTA of the streaming kernels owns (`kGemvRows` in csrc/gemv.cu; the GLU form's
/// CTA reads that many gate and as many up rows of `W`).
#[cfg(feature = "cuda")]
pub(crate) const GEMV_ROWS_PER_CTA: usize = 4;

/// The instantiated rows bucket (`M`) and threads per CTA of the streaming kernels for `m` rows
/// of `x` (csrc/gemv.cu, csrc/gemv_lora.cu).
#[cfg(feature = "cuda")]
pub(crate) fn gemv_launch_shape(m: usize) -> (usize, u32) {
    match m {
        1 => (1, 256),
        2 => (2, 256),
        _ => (4, 128),
    }
}

/// [`gemv_launch_shape`] of csrc/gemv.cu's own kernels, whose GLU form of one row of FP8 weights
/// runs 128 threads a CTA.
#[cfg(feature = "cuda")]
fn gemv_kernel_shape(m: usize, glu: bool, fp8: bool) -> (usize, u32) {
    match gemv_launch_shape(m) {
        (1, _) if glu && fp8 => (1, 128),
        shape => shape,
    }
}

/// `x` `[m, k]` times `w` `[n, k]` transposed: `[m, n]` in `x`'s dtype.
pub fn linear_rows(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (_, k) = x.dims2()?;
    let (_, wk) = w.dims2()?;
    if k != wk {
        candle_core::bail!("linear: x {:?} against weight {:?}", x.shape(), w.shape());
    }
    #[cfg(feature = "cuda")]
    if kernel_applies(x, w) {
        return x
            .contiguous()?
            .apply_op2_no_bwd(w, &cuda::Gemv { glu: false });
    }
    x.matmul(&w.t()?)
}

/// `silu(x G^T) * (x U^T)` for a fused gate-up weight `w` = `[2 * inter, k]` (gate rows, then up
/// rows) and `x` `[m, k]`: `[m, inter]`. For decode batches on CUDA one kernel that applies the
/// SiLU-and-multiply in the product's epilogue; elsewhere [`linear_rows`] then
/// [`crate::silu_and_mul`], which is also the reference.
pub fn silu_glu_rows(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if kernel_applies(x, w) && w.dim(0)?.is_multiple_of(2) {
        return x
            .contiguous()?
            .apply_op2_no_bwd(w, &cuda::Gemv { glu: true });
    }
    crate::silu_and_mul(&linear_rows(x, w)?)
}

/// Whether [`linear_rows`] takes the streaming kernel for `x` `[m, k]` and `w` `[n, k]`.
pub fn kernel_applies(x: &Tensor, w: &Tensor) -> bool {
    let (Ok((m, k)), Ok((_, wk))) = (x.dims2(), w.dims2()) else {
        return false;
    };
    x.device().is_cuda()
        && k == wk
        && (1..=GEMV_MAX_ROWS).contains(&m)
        && k.is_multiple_of(8)
        && matches!(x.dtype(), DType::BF16 | DType::F16)
        && w.dtype() == x.dtype()
        && w.is_contiguous()
        && w.layout().start_offset() == 0
}

/// The streaming kernel over an FP8 E4M3 weight `[n, k]` with row scales `[n]` (the third
/// operand); with `glu`, the gate-up form. Called by [`crate::fp8`] for CUDA decode batches of
/// 16-bit activations, `k` a multiple of 16.
#[derive(Debug, Clone, Copy)]
pub struct Fp8Gemv {
    pub glu: bool,
}

#[cfg(feature = "cuda")]
mod cuda {
    use crate::cuda::{dtype_suffix, function, launch_dependent, view};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};
    use candle_core::cuda_backend::{CudaDType, CudaStorage};
    use candle_core::{DType, Layout, Result, Shape, WithDType};
    use half::{bf16, f16};
    use std::ffi::c_void;

    /// The streaming product; with `glu`, the gate-up form with SiLU-and-multiply.
    pub struct Gemv {
        pub glu: bool,
    }

    /// An FP8 weight and its row scales.
    type Fp8Operands<'a> = ((&'a CudaStorage, &'a Layout), (&'a CudaStorage, &'a Layout));

    fn run<T: CudaDType + WithDType + DeviceRepr>(
        glu: bool,
        x: (&CudaStorage, &Layout),
        w: (&CudaStorage, &Layout),
        fp8: Option<Fp8Operands<'_>>,
    ) -> Result<(CudaStorage, Shape)> {
        let (m, k) = (x.1.dims()[0], x.1.dims()[1]);
        let wn = w.1.dims()[0];
        // width of y
        let n = if glu { wn / 2 } else { wn };
        let dev = x.0.device().clone();
        let xv = view::<T>(x.0, x.1, "x")?;
        // SAFETY: every element of y is written by the kernel.
        let mut y = unsafe { crate::cuda::alloc::<T>(&dev, m * n) }?;
        if n > 0 {
            let (bucket, threads) = super::gemv_kernel_shape(m, glu, fp8.is_some());
            let form = if glu { "gemv_glu" } else { "gemv" };
            let wform = if fp8.is_some() { "_fp8" } else { "" };
            let name = format!("{form}{wform}_m{bucket}_{}", dtype_suffix(T::DTYPE)?);
            let func = function(&dev, &name)?;
            let stream = dev.cuda_stream();
            let (mut mi, mut ni, mut ki) = (m as i32, wn as i32, k as i32);
            {
                let (mut yp, _y) = y.device_ptr_mut(&stream);
                let (mut xp, _x) = xv.device_ptr(&stream);
                // the weight as T, or as E4M3 bytes with its scales (null for T)
                let (dense, bytes, scales);
                let (mut wp, mut sp, _w, _s);
                match fp8 {
                    None => {
                        dense = view::<T>(w.0, w.1, "weight")?;
                        let (p, g) = dense.device_ptr(&stream);
                        (wp, _w, sp, _s) = (p, Some(g), 0u64, None);
                    }
                    Some((q, s)) => {
                        bytes = view::<u8>(q.0, q.1, "fp8 weight")?;
                        scales = view::<f32>(s.0, s.1, "fp8 scales")?;
                        let (p, g) = bytes.device_ptr(&stream);
                        let (ps, gs) = scales.device_ptr(&stream);
                        (wp, _w, sp, _s) = (p, Some(g), ps, Some(gs));
                    }
                }
                let mut params = [
                    (&raw mut yp).cast::<c_void>(),
                    (&raw mut xp).cast::<c_void>(),
                    (&raw mut wp).cast::<c_void>(),
                    (&raw mut sp).cast::<c_void>(),
                    (&raw mut mi).cast::<c_void>(),
                    (&raw mut ni).cast::<c_void>(),
                    (&raw mut ki).cast::<c_void>(),
                ];
                let grid = n.div_ceil(super::GEMV_ROWS_PER_CTA) as u32;
                // SAFETY: the parameters are `gemv[_glu][_fp8]_m<M>_<dtype>`'s (csrc/gemv.cu) in
                // order: y, x, W and the row scales (null for 16-bit W) as device pointers, then
                // m, W's rows (even for GLU) and k as i32; m <= M, k a multiple of W's values
                // per 16 bytes and every operand contiguous (checked by `kernel_applies`, the
                // fp8 caller and `view`); the kernel waits for the previous kernel before it
                // reads x or writes y.
                unsafe { launch_dependent(&func, &stream, grid, threads, &mut params) }?;
            }
        }
        Ok((T::wrap_cuda_slice(y, dev), Shape::from((m, n))))
    }

    impl candle_core::CustomOp2 for Gemv {
        fn name(&self) -> &'static str {
            "gemv"
        }

        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &Layout,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("gemv: the CPU path is candle's matmul")
        }

        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            w: &CudaStorage,
            wl: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            if x.dtype() != w.dtype() {
                candle_core::bail!("gemv: dtypes differ");
            }
            match x.dtype() {
                DType::BF16 => run::<bf16>(self.glu, (x, xl), (w, wl), None),
                DType::F16 => run::<f16>(self.glu, (x, xl), (w, wl), None),
                dt => candle_core::bail!("gemv: unsupported dtype {dt:?}"),
            }
        }
    }

    impl candle_core::CustomOp3 for super::Fp8Gemv {
        fn name(&self) -> &'static str {
            "gemv-fp8"
        }

        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &Layout,
            _: &candle_core::CpuStorage,
            _: &Layout,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("gemv-fp8: the CPU path is rserve_kernels::fp8's reference")
        }

        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            q: &CudaStorage,
            ql: &Layout,
            s: &CudaStorage,
            sl: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let (m, k) = (xl.dims()[0], xl.dims()[1]);
            if ql.dims().len() != 2 || ql.dims()[1] != k || m > super::GEMV_MAX_ROWS || k % 16 != 0
            {
                candle_core::bail!("gemv-fp8: x {:?} against weight {:?}", xl.dims(), ql.dims());
            }
            let fp8 = Some(((q, ql), (s, sl)));
            match x.dtype() {
                DType::BF16 => run::<bf16>(self.glu, (x, xl), (q, ql), fp8),
                DType::F16 => run::<f16>(self.glu, (x, xl), (q, ql), fp8),
                dt => candle_core::bail!("gemv-fp8: unsupported dtype {dt:?}"),
            }
        }
    }
}
