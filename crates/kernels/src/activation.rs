//! Element-wise activations of the vision towers. `quick_gelu(x) = x * sigmoid(1.702 x)` (CLIP's
//! and Qwen2-VL's MLP activation): on CUDA one pass of 16-byte vectors (`quick_gelu_<dtype>` in
//! `csrc/fused.cu`) computing in f32 and rounding once; elsewhere the candle composition, which
//! is also the reference (it rounds after each of its three ops, as PyTorch's bf16 form does, so
//! 16-bit results may differ from the kernel's by a rounding step).

use candle_core::{Result, Tensor};

/// `x * sigmoid(1.702 x)`, any shape.
pub fn quick_gelu(x: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda()
        && matches!(
            x.dtype(),
            candle_core::DType::F32 | candle_core::DType::BF16 | candle_core::DType::F16
        )
        && x.elem_count() > 0
    {
        return x.contiguous()?.apply_op1_no_bwd(&cuda::QuickGelu);
    }
    quick_gelu_reference(x)
}

/// The candle composition of [`quick_gelu`].
pub fn quick_gelu_reference(x: &Tensor) -> Result<Tensor> {
    x * candle_nn::ops::sigmoid(&(x * 1.702)?)?
}

#[cfg(feature = "cuda")]
mod cuda {
    use crate::cuda::{by_float_dtype, dtype_suffix, function, strided_launch, vector_items, view};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, Layout, Result, Shape, WithDType};

    pub struct QuickGelu;

    fn run<T: CudaDType + WithDType + DeviceRepr>(
        s: &CudaStorage,
        l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let n = l.shape().elem_count();
        let dev = s.device().clone();
        let xv = view::<T>(s, l, "x")?;
        // SAFETY: every element is written by the kernel.
        let mut out = unsafe { crate::cuda::alloc::<T>(&dev, n) }?;
        let func = function(&dev, &format!("quick_gelu_{}", dtype_suffix(T::DTYPE)?))?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        let n_i = n as i64;
        b.arg(&mut out).arg(&xv).arg(&n_i);
        let cfg = strided_launch(vector_items::<T>(n, n));
        // SAFETY: matches `quick_gelu_<dtype>` in csrc/fused.cu; x and out hold n values.
        unsafe { b.launch(cfg) }.w()?;
        Ok((T::wrap_cuda_slice(out, dev), l.shape().clone()))
    }

    impl candle_core::CustomOp1 for QuickGelu {
        fn name(&self) -> &'static str {
            "quick-gelu"
        }

        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("quick_gelu: the CPU path is quick_gelu_reference")
        }

        fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            by_float_dtype!("quick_gelu", s.dtype(), run, s, l)
        }
    }
}
