//! LayerNorm with weight and bias over the last dimension (the vision towers' norm), alone or fused
//! with the residual add before it. On CUDA each is one kernel (`layer_norm_<dtype>` and
//! `add_layer_norm_<dtype>` in `csrc/fused.cu`: a CTA per row, f32 statistics from two passes over
//! the row, each output rounded once); elsewhere candle's ops, which are also the references.

use candle_core::{Result, Tensor};

/// `layer_norm(x) * weight + bias` over the last dimension of `x` (any rank).
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    check("layer_norm", x, None, weight, bias)?;
    #[cfg(feature = "cuda")]
    if on_cuda(x) {
        let rows = x
            .contiguous()?
            .reshape(((), x.dim(candle_core::D::Minus1)?))?;
        return rows
            .apply_op3_no_bwd(
                &weight.contiguous()?,
                &bias.contiguous()?,
                &cuda::LayerNorm {
                    eps: eps as f32,
                    residual: None,
                },
            )?
            .reshape(x.shape());
    }
    layer_norm_reference(x, weight, bias, eps)
}

/// `sum = x + residual` and `layer_norm(sum) * weight + bias`, both `[tokens, hidden]` in `x`'s
/// dtype.
pub fn add_layer_norm(
    x: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    check("add_layer_norm", x, Some(residual), weight, bias)?;
    x.dims2()?;
    #[cfg(feature = "cuda")]
    if on_cuda(x) {
        let residual = residual.contiguous()?;
        let out = x.contiguous()?.apply_op3_no_bwd(
            &weight.contiguous()?,
            &bias.contiguous()?,
            &cuda::LayerNorm {
                eps: eps as f32,
                residual: Some(&residual),
            },
        )?;
        return Ok((out.get(0)?, out.get(1)?));
    }
    add_layer_norm_reference(x, residual, weight, bias, eps)
}

/// candle's LayerNorm: the reference of [`layer_norm`].
pub fn layer_norm_reference(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
) -> Result<Tensor> {
    candle_nn::ops::layer_norm(&x.contiguous()?, weight, bias, eps as f32)
}

/// The candle composition of [`add_layer_norm`].
pub fn add_layer_norm_reference(
    x: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let sum = (x + residual)?;
    let normed = layer_norm_reference(&sum, weight, bias, eps)?;
    Ok((sum, normed))
}

#[cfg(feature = "cuda")]
fn on_cuda(x: &Tensor) -> bool {
    x.device().is_cuda()
        && matches!(
            x.dtype(),
            candle_core::DType::F32 | candle_core::DType::BF16 | candle_core::DType::F16
        )
}

/// `weight` and `bias` `[hidden]` for `x` `[.., hidden]` (and `residual` of `x`'s shape), all of
/// one dtype on one device.
fn check(
    what: &str,
    x: &Tensor,
    residual: Option<&Tensor>,
    weight: &Tensor,
    bias: &Tensor,
) -> Result<()> {
    let h = x.dims().last().copied().unwrap_or(0);
    let same = |o: &Tensor| o.dtype() == x.dtype() && o.device().same_device(x.device());
    let fits = x.rank() >= 1
        && residual.is_none_or(|r| r.dims() == x.dims() && same(r))
        && weight.dims() == [h]
        && bias.dims() == [h]
        && same(weight)
        && same(bias);
    if !fits {
        candle_core::bail!(
            "{what}: x {:?} {:?}, residual {:?}, weight {:?}, bias {:?}",
            x.shape(),
            x.dtype(),
            residual.map(|r| (r.shape().clone(), r.dtype())),
            (weight.shape(), weight.dtype()),
            (bias.shape(), bias.dtype()),
        );
    }
    Ok(())
}

#[cfg(feature = "cuda")]
mod cuda {
    use crate::cuda::{by_float_dtype, dtype_suffix, function, storage_view, view, Dependent};
    use crate::fused::norm_launch;
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::DeviceRepr;
    use candle_core::cuda_backend::CudaDType;
    use candle_core::{CudaStorage, Layout, Result, Shape, Tensor, WithDType};

    /// The op's operands are x, the weight and the bias; the residual (of the same shape as x,
    /// contiguous) rides along.
    pub struct LayerNorm<'a> {
        pub eps: f32,
        pub residual: Option<&'a Tensor>,
    }

    fn run<T: CudaDType + WithDType + DeviceRepr>(
        op: &LayerNorm<'_>,
        x: (&CudaStorage, &Layout),
        w: (&CudaStorage, &Layout),
        b: (&CudaStorage, &Layout),
    ) -> Result<(CudaStorage, Shape)> {
        let (t, h) = (x.1.dims()[0], x.1.dims()[1]);
        let dev = x.0.device().clone();
        let xv = view::<T>(x.0, x.1, "x")?;
        let wv = view::<T>(w.0, w.1, "weight")?;
        let bv = view::<T>(b.0, b.1, "bias")?;
        let res = op.residual.map(|r| r.storage_and_layout());
        let (parts, shape) = match res {
            Some(_) => (2, Shape::from((2, t, h))),
            None => (1, Shape::from((t, h))),
        };
        // SAFETY: every element is written by the kernel.
        let mut out = unsafe { crate::cuda::alloc::<T>(&dev, parts * t * h) }?;
        if t > 0 {
            let suffix = dtype_suffix(T::DTYPE)?;
            let stream = dev.cuda_stream();
            let cfg = norm_launch::<T>(t, h);
            let rv = match &res {
                Some((rs, rl)) => Some(storage_view::<T>(rs, rl, "residual")?),
                None => None,
            };
            let name = if rv.is_some() {
                "add_layer_norm"
            } else {
                "layer_norm"
            };
            let func = function(&dev, &format!("{name}_{suffix}"))?;
            let mut l = Dependent::new(&stream, &func);
            l.buf_mut(&mut out).buf(&xv);
            if let Some(rv) = &rv {
                l.buf(rv);
            }
            l.buf(&wv).buf(&bv).val(t as i32).val(h as i32).val(op.eps);
            // SAFETY: matches `[add_]layer_norm_<dtype>(out, x, [residual,] w, b, tokens, hidden,
            // eps)` in csrc/fused.cu (which waits for the kernel before it at entry); x and the
            // residual are [t, h], w and b [h], out [2, t, h] with the residual, else [t, h].
            unsafe { l.launch(cfg) }?;
        }
        Ok((T::wrap_cuda_slice(out, dev), shape))
    }

    impl candle_core::CustomOp3 for LayerNorm<'_> {
        fn name(&self) -> &'static str {
            "layer-norm"
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
            candle_core::bail!("layer_norm: the CPU path is layer_norm_reference")
        }

        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            w: &CudaStorage,
            wl: &Layout,
            b: &CudaStorage,
            bl: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            by_float_dtype!(
                "layer_norm",
                x.dtype(),
                run,
                self,
                (x, xl),
                (w, wl),
                (b, bl)
            )
        }
    }
}
