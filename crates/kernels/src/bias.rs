//! A linear layer's bias added to its product: `y + bias` over rows. On CUDA one pass of 16-byte
//! vectors (`add_bias_<dtype>` in `csrc/fused.cu`); elsewhere candle's broadcast add, which is also
//! the reference. Both round the sum once, so the values are the same.

use candle_core::{Result, Tensor};

/// `y + bias` for `y` `[rows, cols]` and `bias` `[cols]` (other shapes, and dtypes that differ,
/// take the broadcast add and its errors).
pub fn add_bias(y: &Tensor, bias: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if y.device().is_cuda()
        && y.rank() == 2
        && bias.dims() == [y.dim(1)?]
        && bias.dtype() == y.dtype()
        && y.elem_count() > 0
    {
        return y
            .contiguous()?
            .apply_op2_no_bwd(&bias.contiguous()?, &cuda::AddBias);
    }
    y.broadcast_add(bias)
}

#[cfg(feature = "cuda")]
mod cuda {
    use crate::cuda::{dtype_suffix, function, strided_launch, vector_items, view};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, DType, Layout, Result, Shape, WithDType};
    use half::{bf16, f16};

    pub struct AddBias;

    fn run<T: CudaDType + WithDType + DeviceRepr>(
        y: (&CudaStorage, &Layout),
        b: (&CudaStorage, &Layout),
    ) -> Result<(CudaStorage, Shape)> {
        let (rows, cols) = y.1.shape().dims2()?;
        let dev = y.0.device().clone();
        let yv = view::<T>(y.0, y.1, "y")?;
        let bv = view::<T>(b.0, b.1, "bias")?;
        let n = (rows * cols) as i64;
        // SAFETY: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<T>(rows * cols) }?;
        let func = function(&dev, &format!("add_bias_{}", dtype_suffix(T::DTYPE)?))?;
        let stream = dev.cuda_stream();
        let mut l = stream.launch_builder(&func);
        let cols_i = cols as i32;
        l.arg(&mut out).arg(&yv).arg(&bv).arg(&n).arg(&cols_i);
        let cfg = strided_launch(vector_items::<T>(rows * cols, cols));
        // SAFETY: matches `add_bias_<dtype>` in csrc/fused.cu; y is [rows, cols] and bias
        // [cols], both contiguous.
        unsafe { l.launch(cfg) }.w()?;
        Ok((T::wrap_cuda_slice(out, dev), Shape::from((rows, cols))))
    }

    impl candle_core::CustomOp2 for AddBias {
        fn name(&self) -> &'static str {
            "add-bias"
        }

        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &Layout,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("add_bias: the CPU path is the broadcast add")
        }

        fn cuda_fwd(
            &self,
            y: &CudaStorage,
            yl: &Layout,
            b: &CudaStorage,
            bl: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            match y.dtype() {
                DType::F32 => run::<f32>((y, yl), (b, bl)),
                DType::BF16 => run::<bf16>((y, yl), (b, bl)),
                DType::F16 => run::<f16>((y, yl), (b, bl)),
                dt => candle_core::bail!("add_bias: unsupported dtype {dt:?}"),
            }
        }
    }
}
