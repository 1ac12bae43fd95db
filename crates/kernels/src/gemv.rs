//! `y = x W^T` for the few rows of a decode batch. At batch sizes up to [`GEMV_MAX_ROWS`] the
//! product is bound by reading `W` once; on CUDA with 16-bit weights it runs as one streaming
//! kernel (`csrc/gemv.cu`), elsewhere (and for larger batches) as candle's matmul, which is also
//! the reference.

use candle_core::{DType, Result, Tensor};

/// The most rows of `x` the streaming kernel takes.
pub const GEMV_MAX_ROWS: usize = 8;

/// `x` `[m, k]` times `w` `[n, k]` transposed: `[m, n]` in `x`'s dtype.
pub fn linear_rows(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (_, k) = x.dims2()?;
    let (_, wk) = w.dims2()?;
    if k != wk {
        candle_core::bail!("linear: x {:?} against weight {:?}", x.shape(), w.shape());
    }
    #[cfg(feature = "cuda")]
    if kernel_applies(x, w) {
        return x.contiguous()?.apply_op2_no_bwd(w, &cuda::Gemv);
    }
    x.matmul(&w.t()?)
}

/// Whether [`linear_rows`] takes the streaming kernel for `x` `[m, k]` and `w` `[n, k]`.
pub fn kernel_applies(x: &Tensor, w: &Tensor) -> bool {
    let Ok((m, k)) = x.dims2() else {
        return false;
    };
    x.device().is_cuda()
        && (1..=GEMV_MAX_ROWS).contains(&m)
        && k.is_multiple_of(8)
        && matches!(x.dtype(), DType::BF16 | DType::F16)
        && w.dtype() == x.dtype()
        && w.is_contiguous()
        && w.layout().start_offset() == 0
}

#[cfg(feature = "cuda")]
mod cuda {
    use crate::cuda::{dtype_suffix, function, view};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, CudaStorage, WrapErr};
    use candle_core::{DType, Layout, Result, Shape, WithDType};
    use half::{bf16, f16};

    pub struct Gemv;

    fn run<T: CudaDType + WithDType + DeviceRepr>(
        x: (&CudaStorage, &Layout),
        w: (&CudaStorage, &Layout),
    ) -> Result<(CudaStorage, Shape)> {
        let (m, k) = (x.1.dims()[0], x.1.dims()[1]);
        let n = w.1.dims()[0];
        let dev = x.0.device().clone();
        let xv = view::<T>(x.0, x.1, "x")?;
        let wv = view::<T>(w.0, w.1, "weight")?;
        // SAFETY: every element of y is written by the kernel.
        let mut y = unsafe { dev.alloc::<T>(m * n) }?;
        if n > 0 {
            let bucket = [1, 2, 4, 8].into_iter().find(|&b| m <= b).unwrap_or(8);
            let name = format!("gemv_m{bucket}_{}", dtype_suffix(T::DTYPE)?);
            let func = function(&dev, &name)?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&func);
            let (mi, ni, ki) = (m as i32, n as i32, k as i32);
            b.arg(&mut y).arg(&xv).arg(&wv).arg(&mi).arg(&ni).arg(&ki);
            let cfg = LaunchConfig {
                // eight warps of two rows each per CTA
                grid_dim: (n.div_ceil(16) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: matches `gemv_m<M>_<dtype>` in csrc/gemv.cu; m <= M, k % 8 == 0 and both
            // operands contiguous (checked by `kernel_applies` and `view`).
            unsafe { b.launch(cfg) }.w()?;
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
                DType::BF16 => run::<bf16>((x, xl), (w, wl)),
                DType::F16 => run::<f16>((x, xl), (w, wl)),
                dt => candle_core::bail!("gemv: unsupported dtype {dt:?}"),
            }
        }
    }
}
