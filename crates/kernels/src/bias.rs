//! A linear layer's bias added to its product: `y + bias` over rows. On CUDA one pass of 16-byte
//! vectors (`add_bias_<dtype>` in `csrc/fused.cu`); elsewhere candle's broadcast add, which is also
//! the reference. Both round the sum once, so the values are the same.
//!
//! [`linear_bias`] is the product and the bias together: on CUDA, for 16-bit rows past the
//! streaming kernel's batch sizes, one cuBLASLt product whose epilogue adds the bias to the f32
//! sums before their one rounding (as PyTorch's `addmm` does), so no pass of its own.

use candle_core::{Result, Tensor};

/// `x w^T + bias` for `x` `[m, k]`, a weight `w` `[n, k]` and `bias` `[n]`. The reference is
/// [`crate::linear_rows`] then [`add_bias`], which rounds the product before adding.
pub fn linear_bias(x: &Tensor, w: &Tensor, bias: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(y) = cuda::linear_bias(x, w, bias)? {
        return Ok(y);
    }
    add_bias(&crate::linear_rows(x, w)?, bias)
}

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
    use crate::cublaslt::{self, Form, Operands};
    use crate::cuda::{
        by_float_dtype, dtype_suffix, function, storage_view, strided_launch, tensor_from_slice,
        vector_items, view,
    };
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        DevicePtr, DevicePtrMut, DeviceRepr, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
    use candle_core::{CudaStorage, DType, Layout, Result, Shape, Tensor, WithDType};
    use half::{bf16, f16};

    /// [`super::linear_bias`] as one cuBLASLt product, or `None` where it does not take one:
    /// not CUDA, not bf16 or f16 throughout, no more rows than the streaming kernel takes,
    /// widths not in whole 16-byte vectors, an operand off a 256-byte boundary (what the
    /// algorithms cuBLASLt picks by default assume), or a shape it has no algorithm for.
    pub fn linear_bias(x: &Tensor, w: &Tensor, bias: &Tensor) -> Result<Option<Tensor>> {
        let (candle_core::Device::Cuda(dev), Ok((m, k)), Ok((n, wk))) =
            (x.device(), x.dims2(), w.dims2())
        else {
            return Ok(None);
        };
        let fits = m > 0
            && n > 0
            && k > 0
            && !crate::gemv::kernel_applies(x, w)
            && k == wk
            && k.is_multiple_of(8)
            && n.is_multiple_of(8)
            && bias.dims() == [n]
            && matches!(x.dtype(), DType::BF16 | DType::F16)
            && w.dtype() == x.dtype()
            && bias.dtype() == x.dtype()
            && w.is_contiguous();
        if !fits {
            return Ok(None);
        }
        let (x, bias) = (x.contiguous()?, bias.contiguous()?);
        let aligned = |t: &Tensor| {
            (t.layout().start_offset() * t.dtype().size_in_bytes()).is_multiple_of(256)
        };
        if !(aligned(&x) && aligned(w) && aligned(&bias)) {
            return Ok(None);
        }
        match x.dtype() {
            DType::BF16 => product::<bf16>(dev, &x, w, &bias, (m, n, k)),
            _ => product::<f16>(dev, &x, w, &bias, (m, n, k)),
        }
    }

    fn product<T: CudaDType + WithDType + DeviceRepr>(
        dev: &CudaDevice,
        x: &Tensor,
        w: &Tensor,
        bias: &Tensor,
        (m, n, k): (usize, usize, usize),
    ) -> Result<Option<Tensor>> {
        let stream = dev.cuda_stream();
        let (xg, xl) = x.storage_and_layout();
        let (wg, wl) = w.storage_and_layout();
        let (bg, bl) = bias.storage_and_layout();
        let xv = storage_view::<T>(&xg, xl, "x")?;
        let wv = storage_view::<T>(&wg, wl, "weight")?;
        let bv = storage_view::<T>(&bg, bl, "bias")?;
        // SAFETY: every element is written by the product (when it runs).
        let mut y = unsafe { crate::cuda::alloc::<T>(dev, m * n) }?;
        let ran = {
            let (xp, _x) = xv.device_ptr(&stream);
            let (wp, _w) = wv.device_ptr(&stream);
            let (bp, _b) = bv.device_ptr(&stream);
            let (yp, _y) = y.device_ptr_mut(&stream);
            let ops = Operands {
                w: wp,
                x: xp,
                y: yp,
                bias: bp,
            };
            let form = Form::Bias16 { dtype: T::DTYPE };
            // SAFETY: x [m, k], w [n, k], bias [n] and y [m, n] of T, contiguous on `dev` and
            // on 256-byte boundaries (checked by the caller and the views), their guards held
            // to the end of this block.
            unsafe { cublaslt::matmul(dev, (m, n, k), form, &ops) }?
        };
        Ok(ran.then(|| tensor_from_slice(y, dev, (m, n))))
    }

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
        let mut out = unsafe { crate::cuda::alloc::<T>(&dev, rows * cols) }?;
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
            by_float_dtype!("add_bias", y.dtype(), run, (y, yl), (b, bl))
        }
    }
}
