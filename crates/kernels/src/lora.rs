//! The LoRA term of a projection for a batch whose rows use different adapters: `y + (x A_s^T)
//! B_s^T` per row, `s` the row's adapter slot, every adapter of a projection stacked over slots.
//! On CUDA two kernels (`csrc/lora.cu`, Punica's BGMV form: shrink to `u`, then expand into `y`)
//! read each row's slot on the device, so a step's slots are data and a captured graph replays
//! with new ones; elsewhere rows are grouped by slot and multiplied with candle's matmul, which is
//! also the reference.
//!
//! Shapes: `x` `[tokens, in]`, `y` `[tokens, out]`, `a` `[slots, parts * rank, in]`, `b`
//! `[slots, out, rank]`, `slots` `[tokens]` u32 ([`NO_ADAPTER`]: the row is left alone). The
//! projection's output columns form up to [`MAX_PARTS`] parts (q, k, v of a fused qkv; gate and up
//! of a fused gate-up), part `p` applying rows `p * rank .. (p + 1) * rank` of `A`'s output.

use candle_core::{DType, Result, Tensor};
use std::collections::BTreeMap;

/// The slot of a row that uses no adapter.
pub const NO_ADAPTER: u32 = u32::MAX;
/// Most parts of one projection.
pub const MAX_PARTS: usize = 3;

/// Every adapter of one projection, stacked over slots.
#[derive(Debug, Clone, Copy)]
pub struct LoraStack<'a> {
    pub a: &'a Tensor, // [slots, parts * rank, in]
    pub b: &'a Tensor, // [slots, out, rank]
    /// The widths of the output's parts, in order (summing to `out`).
    pub parts: &'a [usize],
}

impl LoraStack<'_> {
    /// `(slots, rank, in, out)`, checked against each other and the parts.
    fn dims(&self) -> Result<(usize, usize, usize, usize)> {
        let (s, pr, k) = self.a.dims3()?;
        let (sb, n, r) = self.b.dims3()?;
        let p = self.parts.len();
        if s != sb
            || p == 0
            || p > MAX_PARTS
            || pr != p * r
            || self.parts.iter().sum::<usize>() != n
        {
            candle_core::bail!(
                "lora: A {:?}, B {:?} and parts {:?} do not fit",
                self.a.shape(),
                self.b.shape(),
                self.parts
            );
        }
        Ok((s, r, k, n))
    }
}

/// `y` plus each row's LoRA term (see the module's shapes); `y` in `x`'s dtype.
pub fn lora_add(y: &Tensor, x: &Tensor, stack: &LoraStack<'_>, slots: &Tensor) -> Result<Tensor> {
    let (_, r, k, n) = stack.dims()?;
    let (t, xk) = x.dims2()?;
    if xk != k || y.dims2()? != (t, n) || slots.dims1()? != t || slots.dtype() != DType::U32 {
        candle_core::bail!(
            "lora: x {:?}, y {:?} and slots {:?} do not fit A {:?}",
            x.shape(),
            y.shape(),
            slots.shape(),
            stack.a.shape()
        );
    }
    if t == 0 || r == 0 {
        return Ok(y.clone());
    }
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(dev) = x.device() {
        return cuda::lora_add(dev, y, x, stack, slots, (r, k, n));
    }
    lora_add_reference(y, x, stack, &slots.to_vec1::<u32>()?)
}

/// [`lora_add`] with the slots on the host: rows grouped by slot, each group's term through
/// candle's matmul in `x`'s dtype. The CPU path, and the reference of the CUDA kernels.
pub fn lora_add_reference(
    y: &Tensor,
    x: &Tensor,
    stack: &LoraStack<'_>,
    slots: &[u32],
) -> Result<Tensor> {
    let (num_slots, r, _, _) = stack.dims()?;
    let mut groups: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for (row, &s) in (0u32..).zip(slots) {
        if s != NO_ADAPTER {
            if s as usize >= num_slots {
                candle_core::bail!("lora: slot {s} of row {row} is past the {num_slots} slots");
            }
            groups.entry(s).or_default().push(row);
        }
    }
    let mut out = y.clone();
    for (s, rows) in groups {
        let idx = Tensor::new(rows.as_slice(), x.device())?;
        let xs = x.index_select(&idx, 0)?; // [n, in]
        let a = stack.a.get(s as usize)?.to_dtype(x.dtype())?; // [parts * rank, in]
        let b = stack.b.get(s as usize)?.to_dtype(x.dtype())?; // [out, rank]
        let u = xs.matmul(&a.t()?)?; // [n, parts * rank]
        let mut terms = Vec::with_capacity(stack.parts.len());
        let mut col = 0;
        for (p, &w) in stack.parts.iter().enumerate() {
            let up = u.narrow(1, p * r, r)?.contiguous()?;
            let bp = b.narrow(0, col, w)?;
            terms.push(up.matmul(&bp.t()?)?); // [n, w]
            col += w;
        }
        let term = Tensor::cat(&terms, 1)?.to_dtype(y.dtype())?;
        out = out.index_add(&idx, &term, 0)?;
    }
    Ok(out)
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::LoraStack;
    use crate::cuda::{
        cuda_storage, dtype_suffix, function, launch_dependent, tensor_from_slice, view, KernelElem,
    };
    use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
    use candle_core::cuda_backend::CudaDevice;
    use candle_core::{DType, Result, Tensor};
    use std::ffi::c_void;

    /// Values of k per warp of the shrink (`kShrinkChunk` in csrc/lora.cu), warps per CTA.
    const SHRINK_CHUNK: usize = 512;
    const SHRINK_WARPS: usize = 8;
    const EXPAND_THREADS: u32 = 256;

    pub fn lora_add(
        dev: &CudaDevice,
        y: &Tensor,
        x: &Tensor,
        stack: &LoraStack<'_>,
        slots: &Tensor,
        dims: (usize, usize, usize),
    ) -> Result<Tensor> {
        if stack.a.dtype() != x.dtype() || stack.b.dtype() != x.dtype() || y.dtype() != x.dtype() {
            candle_core::bail!("lora: x, y, A and B must share one dtype");
        }
        match x.dtype() {
            DType::BF16 => run::<half::bf16>(dev, y, x, stack, slots, dims),
            DType::F16 => run::<half::f16>(dev, y, x, stack, slots, dims),
            DType::F32 => run::<f32>(dev, y, x, stack, slots, dims),
            dt => candle_core::bail!("lora: unsupported dtype {dt:?}"),
        }
    }

    fn run<T: KernelElem>(
        dev: &CudaDevice,
        y: &Tensor,
        x: &Tensor,
        stack: &LoraStack<'_>,
        slots: &Tensor,
        (r, k, n): (usize, usize, usize),
    ) -> Result<Tensor> {
        let x = x.contiguous()?;
        let y = y.contiguous()?;
        let (a, b) = (stack.a.contiguous()?, stack.b.contiguous()?);
        let slots = slots.contiguous()?;
        let t = x.dim(0)?;
        let pr = stack.parts.len() * r;
        let stream = dev.cuda_stream();
        let sfx = dtype_suffix(T::DTYPE)?;
        // u is accumulated into (split-K), so it starts at zero; every element of out is written
        let mut u = dev.alloc_zeros::<f32>(t * pr)?;
        // SAFETY: every element of out is written by the expand kernel.
        let mut out = unsafe { dev.alloc::<T>(t * n) }?;
        let (xg, xl) = x.storage_and_layout();
        let (yg, yl) = y.storage_and_layout();
        let (ag, al) = a.storage_and_layout();
        let (bg, bl) = b.storage_and_layout();
        let (sg, sl) = slots.storage_and_layout();
        let xv = view::<T>(cuda_storage(&xg, "lora x")?, xl, "lora x")?;
        let yv = view::<T>(cuda_storage(&yg, "lora y")?, yl, "lora y")?;
        let av = view::<T>(cuda_storage(&ag, "lora A")?, al, "lora A")?;
        let bv = view::<T>(cuda_storage(&bg, "lora B")?, bl, "lora B")?;
        let sv = view::<u32>(cuda_storage(&sg, "lora slots")?, sl, "lora slots")?;
        let (mut up, _u) = u.device_ptr_mut(&stream);
        let (mut xp, _x) = xv.device_ptr(&stream);
        let (mut ap, _a) = av.device_ptr(&stream);
        let (mut sp, _s) = sv.device_ptr(&stream);
        let (mut ldx, mut ti, mut pri, mut ki) = (k as i64, t as i32, pr as i32, k as i32);
        let shrink = function(dev, &format!("lora_shrink_{sfx}"))?;
        let mut params = [
            (&raw mut up).cast::<c_void>(),
            (&raw mut xp).cast::<c_void>(),
            (&raw mut ldx).cast::<c_void>(),
            (&raw mut ap).cast::<c_void>(),
            (&raw mut sp).cast::<c_void>(),
            (&raw mut ti).cast::<c_void>(),
            (&raw mut pri).cast::<c_void>(),
            (&raw mut ki).cast::<c_void>(),
        ];
        let warps = t * pr * k.div_ceil(SHRINK_CHUNK);
        let grid = warps.div_ceil(SHRINK_WARPS);
        // SAFETY: `lora_shrink_<dtype>(u, x, ldx, a, slots, tokens, pr, k)` (csrc/lora.cu): u
        // [t, pr] f32 zeroed, x [t, k] contiguous (ldx = k), a [S, pr, k] and slots [t] u32
        // (each < S or NO_ADAPTER, as the layer's slots are) contiguous; one warp per (token,
        // output, chunk of k), warps past the last exit; the kernel waits before it reads.
        let threads = (SHRINK_WARPS * 32) as u32;
        unsafe { launch_dependent(&shrink, &stream, grid as u32, threads, &mut params) }?;
        let (mut op, _o) = out.device_ptr_mut(&stream);
        let (mut yp, _y) = yv.device_ptr(&stream);
        let (mut bp, _b) = bv.device_ptr(&stream);
        let total = t * n;
        let mut ends = [n as i32; 2];
        let mut col = 0;
        for (e, w) in ends.iter_mut().zip(stack.parts) {
            col += w;
            *e = col as i32;
        }
        let (mut tot, mut ni, mut ri) = (total as i64, n as i32, r as i32);
        let (mut e0, mut e1) = (ends[0], ends[1]);
        let expand = function(dev, &format!("lora_expand_{sfx}"))?;
        let mut params = [
            (&raw mut op).cast::<c_void>(),
            (&raw mut yp).cast::<c_void>(),
            (&raw mut up).cast::<c_void>(),
            (&raw mut bp).cast::<c_void>(),
            (&raw mut sp).cast::<c_void>(),
            (&raw mut tot).cast::<c_void>(),
            (&raw mut ni).cast::<c_void>(),
            (&raw mut ri).cast::<c_void>(),
            (&raw mut pri).cast::<c_void>(),
            (&raw mut e0).cast::<c_void>(),
            (&raw mut e1).cast::<c_void>(),
        ];
        let grid = total.div_ceil(EXPAND_THREADS as usize);
        // SAFETY: `lora_expand_<dtype>(out, y, u, b, slots, total, n, r, pr, e0, e1)`
        // (csrc/lora.cu): out and y [t, n] contiguous, u [t, pr] f32 written by the shrink just
        // before on this stream, b [S, n, r], slots as above; e0 <= e1 <= n the parts' ends; one
        // thread per element of out.
        unsafe { launch_dependent(&expand, &stream, grid as u32, EXPAND_THREADS, &mut params) }?;
        drop((_o, _y, _b, _u, _x, _a, _s));
        Ok(tensor_from_slice(out, dev, (t, n)))
    }
}
