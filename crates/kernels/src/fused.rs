//! Fused element-wise ops of the decoder layer. On the CPU each is the plain candle composition
//! (which is also the reference the CUDA kernels are tested against); on CUDA each is one kernel
//! from `csrc/fused.cu`.

use crate::cache::CacheScales;
use crate::metadata::AttentionMetadata;
use candle_core::backend::BackendStorage;
use candle_core::{DType, Result, Tensor};

/// `silu(gate) * up` for `gate_up` = `[tokens, 2 * inter]` (gate columns first): `[tokens, inter]`.
pub fn silu_and_mul(gate_up: &Tensor) -> Result<Tensor> {
    let (_, two_i) = gate_up.dims2()?;
    if two_i % 2 != 0 {
        candle_core::bail!("silu_and_mul: odd width {two_i}");
    }
    match gate_up.device() {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(_) => gate_up.contiguous()?.apply_op1_no_bwd(&cuda::SiluAndMul),
        _ => silu_and_mul_reference(gate_up),
    }
}

/// `x` as f32 (the logits leaving the LM head): on CUDA one pass of 16-byte loads for 16-bit
/// types; elsewhere candle's cast, which is also the reference. Values are exactly the cast's.
pub fn to_f32(x: &Tensor) -> Result<Tensor> {
    match (x.device(), x.dtype()) {
        (_, DType::F32) => Ok(x.clone()),
        #[cfg(feature = "cuda")]
        (candle_core::Device::Cuda(_), DType::BF16 | DType::F16) if x.elem_count() > 0 => {
            x.contiguous()?.apply_op1_no_bwd(&cuda::ToF32)
        }
        _ => x.to_dtype(DType::F32),
    }
}

/// Writes `x` as f32 into the first `x.elem_count()` elements of `dst` (a contiguous f32 tensor,
/// such as a logits buffer a CUDA graph owns), with [`to_f32`]'s values and no intermediate.
pub fn to_f32_into(x: &Tensor, dst: &Tensor) -> Result<()> {
    let n = x.elem_count();
    if dst.dtype() != DType::F32 || !dst.is_contiguous() || dst.elem_count() < n {
        candle_core::bail!(
            "to_f32_into: {:?} {:?} does not take {n} f32 values",
            dst.dtype(),
            dst.shape()
        );
    }
    match (x.device(), x.dtype()) {
        #[cfg(feature = "cuda")]
        (candle_core::Device::Cuda(_), DType::BF16 | DType::F16) if n > 0 => {
            dst.inplace_op2(&x.contiguous()?, &cuda::ToF32Into)
        }
        _ => dst
            .flatten_all()?
            .slice_set(&to_f32(x)?.flatten_all()?, 0, 0),
    }
}

/// The candle composition of [`silu_and_mul`].
pub fn silu_and_mul_reference(gate_up: &Tensor) -> Result<Tensor> {
    let inter = gate_up.dim(1)? / 2;
    let g = candle_nn::ops::silu(&gate_up.narrow(1, 0, inter)?)?;
    g * gate_up.narrow(1, inter, inter)?
}

/// `sum = x + residual` and `rms_norm(sum) * weight`, both `[tokens, hidden]` in `x`'s dtype.
pub fn add_rms_norm(
    x: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    check_add_rms_norm("add_rms_norm", x, residual, weight)?;
    match x.device() {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(_) => {
            let out = x.contiguous()?.apply_op3_no_bwd(
                &residual.contiguous()?,
                &weight.contiguous()?,
                &cuda::AddRmsNorm { eps: eps as f32 },
            )?;
            Ok((out.get(0)?, out.get(1)?))
        }
        _ => add_rms_norm_reference(x, residual, weight, eps),
    }
}

/// Checks [`add_rms_norm`]'s shapes (`x` and `residual` `[tokens, hidden]`, `weight` `[hidden]`)
/// for the op named `what`.
pub(crate) fn check_add_rms_norm(
    what: &str,
    x: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
) -> Result<()> {
    let (t, h) = x.dims2()?;
    if residual.dims2()? != (t, h) || weight.dims1()? != h {
        candle_core::bail!(
            "{what}: x {:?}, residual {:?}, weight {:?}",
            x.shape(),
            residual.shape(),
            weight.shape()
        );
    }
    Ok(())
}

/// The candle composition of [`add_rms_norm`] (RMS statistics in f32).
pub fn add_rms_norm_reference(
    x: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let sum = (x + residual)?;
    let normed = candle_nn::ops::rms_norm(&sum, weight, eps as f32)?;
    Ok((sum, normed))
}

/// Rotates, in place, the first `rotated_heads` heads (q then k) of `qkv` (`[tokens, heads, dim]`,
/// contiguous) by `positions` (`[tokens]` u32) with `cos`/`sin` tables (`[max_positions, dim / 2]`,
/// `qkv`'s dtype), in the "rotate half" layout.
pub fn rotary_qk_(
    qkv: &Tensor,
    positions: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    rotated_heads: usize,
) -> Result<()> {
    let (pos, host) = check_rotary(qkv, positions, cos, sin, rotated_heads)?;
    qkv.inplace_op1(&Rotary {
        positions: &pos,
        host_positions: host,
        cos,
        sin,
        rotated_heads,
        cache: None,
    })
}

/// [`rotary_qk_`] of the `heads` q heads and `kv_heads` k heads of `qkv`
/// (`[tokens, heads + 2 * kv_heads, dim]`, contiguous), then [`crate::reshape_and_cache`] of its
/// k and v heads at the metadata's slots (an FP8 cache takes them divided by `scales`): one
/// kernel on CUDA, the two ops elsewhere.
#[allow(clippy::too_many_arguments)]
pub fn rotary_qk_cache_(
    qkv: &Tensor,
    positions: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    (heads, kv_heads): (usize, usize),
    k_cache: &Tensor,
    v_cache: &Tensor,
    meta: &AttentionMetadata,
    scales: CacheScales,
) -> Result<()> {
    let (t, all, d) = qkv.dims3()?;
    if meta.slots.len() != t {
        candle_core::bail!("rotary_qk_cache: {} slots for {t} tokens", meta.slots.len());
    }
    if all != heads + 2 * kv_heads {
        candle_core::bail!(
            "rotary_qk_cache: qkv {:?} for {heads} + 2 x {kv_heads} heads",
            qkv.shape()
        );
    }
    if qkv.device().is_cuda() {
        let (pos, host) = check_rotary(qkv, positions, cos, sin, heads + kv_heads)?;
        crate::cache::check_caches(kv_heads, d, k_cache, v_cache, meta)?;
        scales.validate()?;
        let fits = |c: &Tensor| c.dtype() == qkv.dtype() || crate::cache::is_fp8_cache(c);
        if !fits(k_cache) || k_cache.dtype() != v_cache.dtype() {
            candle_core::bail!("rotary_qk_cache: cache dtype differs from qkv");
        }
        return qkv.inplace_op1(&Rotary {
            positions: &pos,
            host_positions: host,
            cos,
            sin,
            rotated_heads: heads + kv_heads,
            cache: Some(CacheWrite {
                k_cache,
                v_cache,
                meta,
                heads,
                scales,
            }),
        });
    }
    rotary_qk_(qkv, positions, cos, sin, heads + kv_heads)?;
    crate::cache::reshape_and_cache_scaled(
        &qkv.narrow(1, heads, kv_heads)?,
        &qkv.narrow(1, heads + kv_heads, kv_heads)?,
        k_cache,
        v_cache,
        meta,
        scales,
    )
}

/// Checks the rotary operands; returns the positions as u32 and, on the CPU, on the host.
fn check_rotary(
    qkv: &Tensor,
    positions: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    rotated_heads: usize,
) -> Result<(Tensor, Vec<u32>)> {
    let (t, heads, d) = qkv.dims3()?;
    let (max_pos, half) = cos.dims2()?;
    if rotated_heads > heads || half * 2 != d || sin.dims2()? != (max_pos, half) {
        candle_core::bail!(
            "rotary_qk: qkv {:?}, cos {:?}, {rotated_heads} rotated heads",
            qkv.shape(),
            cos.shape()
        );
    }
    if positions.dims1()? != t || !qkv.is_contiguous() {
        candle_core::bail!("rotary_qk: positions must be [tokens] and qkv contiguous");
    }
    let pos = positions.to_dtype(DType::U32)?;
    let host: Vec<u32> = if qkv.device().is_cpu() {
        pos.to_vec1()?
    } else {
        Vec::new()
    };
    if host.iter().any(|&p| p as usize >= max_pos) {
        candle_core::bail!("rotary_qk: a position is past the table ({max_pos})");
    }
    Ok((pos, host))
}

struct Rotary<'a> {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    positions: &'a Tensor,
    host_positions: Vec<u32>,
    cos: &'a Tensor,
    sin: &'a Tensor,
    rotated_heads: usize,
    /// Also write the rotated k heads and the v heads into the cache (CUDA only).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    cache: Option<CacheWrite<'a>>,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct CacheWrite<'a> {
    k_cache: &'a Tensor,
    v_cache: &'a Tensor,
    meta: &'a AttentionMetadata,
    /// q heads before the k heads
    heads: usize,
    scales: CacheScales,
}

impl Rotary<'_> {
    fn cpu_run<T: crate::elem::Elem>(
        &self,
        s: &mut candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> Result<()> {
        use crate::elem::{typed, with_cpu};
        let dims = l.dims();
        let (heads, d) = (dims[1], dims[2]);
        let half = d / 2;
        let (a, b) = crate::elem::contiguous_range(l, "qkv")?;
        let data = T::slice_mut(s).ok_or_else(|| candle_core::Error::Msg("qkv dtype".into()))?;
        let data = &mut data[a..b];
        with_cpu(self.cos, "cos", |cs, cl| {
            let cos = typed::<T>(cs, cl, "cos")?;
            with_cpu(self.sin, "sin", |ss, sl| {
                let sin = typed::<T>(ss, sl, "sin")?;
                for (t, &p) in self.host_positions.iter().enumerate() {
                    let (c, sn) = (
                        &cos[p as usize * half..(p as usize + 1) * half],
                        &sin[p as usize * half..(p as usize + 1) * half],
                    );
                    let row = &mut data[t * heads * d..(t + 1) * heads * d];
                    for h in 0..self.rotated_heads {
                        let head = &mut row[h * d..(h + 1) * d];
                        for j in 0..half {
                            let (x1, x2) = (head[j].to_f32(), head[j + half].to_f32());
                            let (cj, sj) = (c[j].to_f32(), sn[j].to_f32());
                            head[j] = T::from_f32(x1 * cj - x2 * sj);
                            head[j + half] = T::from_f32(x2 * cj + x1 * sj);
                        }
                    }
                }
                Ok(())
            })
        })
    }
}

impl candle_core::InplaceOp1 for Rotary<'_> {
    fn name(&self) -> &'static str {
        "rotary-qk"
    }

    fn cpu_fwd(&self, s: &mut candle_core::CpuStorage, l: &candle_core::Layout) -> Result<()> {
        if self.cache.is_some() {
            candle_core::bail!("rotary_qk: the fused cache write is CUDA only");
        }
        match s.dtype() {
            DType::F32 => self.cpu_run::<f32>(s, l),
            DType::BF16 => self.cpu_run::<half::bf16>(s, l),
            DType::F16 => self.cpu_run::<half::f16>(s, l),
            dt => candle_core::bail!("rotary_qk: unsupported dtype {dt:?}"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &mut candle_core::CudaStorage, l: &candle_core::Layout) -> Result<()> {
        cuda::rotary(self, s, l)
    }
}

#[cfg(feature = "cuda")]
pub(crate) use cuda::norm_launch;

#[cfg(feature = "cuda")]
mod cuda {
    use super::Rotary;
    use crate::cuda::{
        by_float_dtype, cuda_slice, dtype_suffix, function, storage_view, strided_launch,
        vector_items, view, Dependent,
    };
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaView, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
    use candle_core::{CudaStorage, Layout, Result, Shape, WithDType};

    pub struct ToF32;

    fn to_f32<T: CudaDType + WithDType + DeviceRepr>(
        s: &CudaStorage,
        l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let dev = s.device().clone();
        let input = view::<T>(s, l, "x")?;
        let n = l.shape().elem_count();
        // SAFETY: every element is written by the kernel.
        let mut out = unsafe { crate::cuda::alloc::<f32>(&dev, n) }?;
        if n > 0 {
            launch_to_f32(&dev, &mut out.slice_mut(..), &input, n)?;
        }
        Ok((f32::wrap_cuda_slice(out, dev), l.shape().clone()))
    }

    /// `out[i] = input[i]` as f32 for i < n (`to_f32_<dtype>` in csrc/fused.cu).
    fn launch_to_f32<T: CudaDType + WithDType + DeviceRepr>(
        dev: &CudaDevice,
        out: &mut CudaViewMut<'_, f32>,
        input: &CudaView<'_, T>,
        n: usize,
    ) -> Result<()> {
        if out.len() < n || input.len() < n {
            candle_core::bail!("to_f32: {n} values from {} into {}", input.len(), out.len());
        }
        let func = function(dev, &format!("to_f32_{}", dtype_suffix(T::DTYPE)?))?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        let n_i = n as i64;
        b.arg(out).arg(input).arg(&n_i);
        let cfg = strided_launch((n / (16 / std::mem::size_of::<T>())) as u64);
        // SAFETY: matches `to_f32_<dtype>` in csrc/fused.cu; both views hold n values (checked).
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }

    /// [`ToF32`] into an existing f32 tensor: `dst` (the first storage) takes `x`'s elements.
    pub struct ToF32Into;

    fn to_f32_into<T: CudaDType + WithDType + DeviceRepr>(
        d: &mut CudaStorage,
        dl: &Layout,
        s: &CudaStorage,
        l: &Layout,
    ) -> Result<()> {
        let dev = s.device().clone();
        let input = view::<T>(s, l, "x")?;
        let n = l.shape().elem_count();
        let start = dl.start_offset();
        let mut out = d.as_cuda_slice_mut::<f32>()?.slice_mut(start..start + n);
        launch_to_f32(&dev, &mut out, &input, n)
    }

    impl candle_core::InplaceOp2 for ToF32Into {
        fn name(&self) -> &'static str {
            "to-f32-into"
        }

        fn cpu_fwd(
            &self,
            _: &mut candle_core::CpuStorage,
            _: &Layout,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> Result<()> {
            candle_core::bail!("to_f32_into: the CPU path is candle's cast")
        }

        fn cuda_fwd(
            &self,
            d: &mut CudaStorage,
            dl: &Layout,
            s: &CudaStorage,
            l: &Layout,
        ) -> Result<()> {
            by_float_dtype!("to_f32_into", s.dtype(), to_f32_into, d, dl, s, l)
        }
    }

    impl candle_core::CustomOp1 for ToF32 {
        fn name(&self) -> &'static str {
            "to-f32"
        }

        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("to_f32: the CPU path is candle's cast")
        }

        fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            by_float_dtype!("to_f32", s.dtype(), to_f32, s, l)
        }
    }

    pub struct SiluAndMul;

    fn silu_and_mul<T: CudaDType + WithDType + DeviceRepr>(
        s: &CudaStorage,
        l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (t, two_i) = (l.dims()[0], l.dims()[1]);
        let inter = two_i / 2;
        let dev = s.device().clone();
        let input = view::<T>(s, l, "gate_up")?;
        // SAFETY: every element is written by the kernel.
        let mut out = unsafe { crate::cuda::alloc::<T>(&dev, t * inter) }?;
        let n = (t * inter) as i64;
        if n > 0 {
            let func = function(&dev, &format!("silu_and_mul_{}", dtype_suffix(T::DTYPE)?))?;
            let stream = dev.cuda_stream();
            let mut b = Dependent::new(&stream, &func);
            b.buf_mut(&mut out).buf(&input).val(n).val(inter as i32);
            // a thread per 16-byte vector when rows are whole vectors (the kernel loops otherwise)
            let cfg = strided_launch(vector_items::<T>(t * inter, inter));
            // SAFETY: matches `silu_and_mul_<dtype>` in csrc/fused.cu, which waits for the kernel
            // before it at entry.
            unsafe { b.launch(cfg) }?;
        }
        Ok((T::wrap_cuda_slice(out, dev), Shape::from((t, inter))))
    }

    impl candle_core::CustomOp1 for SiluAndMul {
        fn name(&self) -> &'static str {
            "silu-and-mul"
        }

        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("silu_and_mul: the CPU path is silu_and_mul_reference")
        }

        fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            by_float_dtype!("silu_and_mul", s.dtype(), silu_and_mul, s, l)
        }
    }

    pub struct AddRmsNorm {
        pub eps: f32,
    }

    fn add_rms_norm<T: CudaDType + WithDType + DeviceRepr>(
        eps: f32,
        x: (&CudaStorage, &Layout),
        r: (&CudaStorage, &Layout),
        w: (&CudaStorage, &Layout),
    ) -> Result<(CudaStorage, Shape)> {
        let (t, h) = (x.1.dims()[0], x.1.dims()[1]);
        let dev = x.0.device().clone();
        let xv = view::<T>(x.0, x.1, "x")?;
        let rv = view::<T>(r.0, r.1, "residual")?;
        let wv = view::<T>(w.0, w.1, "weight")?;
        // SAFETY: every element is written by the kernel.
        let mut out = unsafe { crate::cuda::alloc::<T>(&dev, 2 * t * h) }?;
        if t > 0 {
            let func = function(&dev, &format!("add_rms_norm_{}", dtype_suffix(T::DTYPE)?))?;
            let stream = dev.cuda_stream();
            let mut b = Dependent::new(&stream, &func);
            b.buf_mut(&mut out)
                .buf(&xv)
                .buf(&rv)
                .buf(&wv)
                .val(t as i32)
                .val(h as i32)
                .val(eps);
            let cfg = norm_launch::<T>(t, h);
            // SAFETY: matches `add_rms_norm_<dtype>` in csrc/fused.cu, which waits for the kernel
            // before it at entry.
            unsafe { b.launch(cfg) }?;
        }
        Ok((T::wrap_cuda_slice(out, dev), Shape::from((2, t, h))))
    }

    /// The launch of the norm kernels over `rows` rows of `h` values of `T`: a CTA per row, a
    /// thread per 16-byte vector of the row when the row is made of them.
    pub(crate) fn norm_launch<T>(rows: usize, h: usize) -> LaunchConfig {
        let per = 16 / std::mem::size_of::<T>();
        let lanes = if h.is_multiple_of(per) { h / per } else { h };
        LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (block_threads(lanes, 1024), 1, 1),
            shared_mem_bytes: 0,
        }
    }

    impl candle_core::CustomOp3 for AddRmsNorm {
        fn name(&self) -> &'static str {
            "add-rms-norm"
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
            candle_core::bail!("add_rms_norm: the CPU path is add_rms_norm_reference")
        }

        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            r: &CudaStorage,
            rl: &Layout,
            w: &CudaStorage,
            wl: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            if r.dtype() != x.dtype() || w.dtype() != x.dtype() {
                candle_core::bail!("add_rms_norm: dtypes differ");
            }
            by_float_dtype!(
                "add_rms_norm",
                x.dtype(),
                add_rms_norm,
                self.eps,
                (x, xl),
                (r, rl),
                (w, wl)
            )
        }
    }

    fn rotary_typed<T: CudaDType + WithDType + DeviceRepr>(
        op: &Rotary<'_>,
        s: &mut CudaStorage,
        l: &Layout,
    ) -> Result<()> {
        let dims = l.dims();
        let (t, heads, d) = (dims[0], dims[1], dims[2]);
        if t == 0 {
            return Ok(());
        }
        if l.start_offset() != 0 {
            candle_core::bail!("rotary_qk: qkv must start at offset 0");
        }
        let dev = s.device().clone();
        let (pg, pl) = op.positions.storage_and_layout();
        let (cg, cl) = op.cos.storage_and_layout();
        let (sg, sl) = op.sin.storage_and_layout();
        // a view of a larger table (the vision encoder's positions) starts past its storage's start
        let positions = storage_view::<u32>(&pg, pl, "positions")?;
        let cos = cuda_slice::<T>(&cg, cl, "rotary_qk: cos table")?;
        let sin = cuda_slice::<T>(&sg, sl, "rotary_qk: sin table")?;
        let qkv = s.as_cuda_slice_mut::<T>()?;
        let stream = dev.cuda_stream();
        let suffix = dtype_suffix(T::DTYPE)?;
        let stride = (heads * d) as i64;
        // the kernel's 16-byte vectors (`VN` in csrc/fused.cu): VN pairs or values per thread
        let vn = 16 / std::mem::size_of::<T>();
        let per_thread = if (d / 2) % vn == 0 { vn } else { 1 };
        let Some(cw) = &op.cache else {
            let func = function(&dev, &format!("rotary_qk_{suffix}"))?;
            let mut b = Dependent::new(&stream, &func);
            b.buf_mut(qkv)
                .buf(&positions)
                .buf(cos)
                .buf(sin)
                .val(op.rotated_heads as i32)
                .val(d as i32)
                .val(stride);
            let cfg = LaunchConfig {
                grid_dim: (t as u32, 1, 1),
                block_dim: (
                    block_threads(op.rotated_heads * d / 2 / per_thread, 512),
                    1,
                    1,
                ),
                shared_mem_bytes: 0,
            };
            // SAFETY: matches `rotary_qk_<dtype>` in csrc/fused.cu (which waits for the kernel
            // before it at entry); positions index tables of max_positions rows (the model never
            // schedules a position past max_model_len).
            unsafe { b.launch(cfg) }?;
            return Ok(());
        };
        let kv_heads = op.rotated_heads - cw.heads;
        let (kg, kl) = cw.k_cache.storage_and_layout();
        let (vg, vl) = cw.v_cache.storage_and_layout();
        if !kl.is_contiguous()
            || kl.start_offset() != 0
            || !vl.is_contiguous()
            || vl.start_offset() != 0
        {
            candle_core::bail!("rotary_qk_cache: the caches must be whole contiguous tensors");
        }
        let fp8 = crate::cache::is_fp8_cache(cw.k_cache);
        let (k8, v8, k16, v16);
        let arrays = cw.meta.device_arrays()?;
        let (sg, sl) = arrays.slots.storage_and_layout();
        let slots = storage_view::<i64>(&sg, sl, "slot_mapping")?;
        let name = crate::cache::cache_kernel("rotary_qk_cache", T::DTYPE, cw.k_cache.dtype())?;
        let func = function(&dev, &name)?;
        let (k_inv, v_inv) = if fp8 {
            (1.0 / cw.scales.k, 1.0 / cw.scales.v)
        } else {
            (1f32, 1f32)
        };
        let mut b = Dependent::new(&stream, &func);
        b.attention()
            .buf_mut(qkv)
            .buf(&positions)
            .buf(cos)
            .buf(sin)
            .val(cw.heads as i32)
            .val(kv_heads as i32)
            .val(d as i32)
            .val(stride);
        if fp8 {
            k8 = cuda_slice::<u8>(&kg, kl, "k_cache")?;
            v8 = cuda_slice::<u8>(&vg, vl, "v_cache")?;
            b.buf(k8).buf(v8);
        } else {
            k16 = cuda_slice::<T>(&kg, kl, "k_cache")?;
            v16 = cuda_slice::<T>(&vg, vl, "v_cache")?;
            b.buf(k16).buf(v16);
        }
        b.buf(&slots).val(k_inv).val(v_inv);
        let cfg = LaunchConfig {
            grid_dim: (t as u32, 1, 1),
            block_dim: (
                block_threads((op.rotated_heads * d / 2 + kv_heads * d) / per_thread, 1024),
                1,
                1,
            ),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `rotary_qk_cache_<dtype>[_fp8]` in csrc/fused.cu; positions index tables of
        // max_positions rows; the slots were checked against both caches (same shape) on the
        // host. The kernel writes the caches through these views: they are device memory that
        // no host reference reads, and this stream orders the write before any attention read
        // (the kernel waits for the kernel before it at entry, and attention waits for it).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// CTAs of 256 threads for `items` work items of a grid-stride kernel (one item a thread, at
    /// most 65535 x 8 CTAs; the kernel loops over the rest).
    /// Threads for `work` items per CTA: a multiple of 32 in 32..=`max`.
    fn block_threads(work: usize, max: usize) -> u32 {
        work.next_multiple_of(32).clamp(32, max) as u32
    }

    pub(super) fn rotary(op: &Rotary<'_>, s: &mut CudaStorage, l: &Layout) -> Result<()> {
        by_float_dtype!("rotary", s.dtype(), rotary_typed, op, s, l)
    }
}
