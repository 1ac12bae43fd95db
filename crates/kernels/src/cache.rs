//! Writes into the paged KV cache: new keys/values by slot mapping, and whole-block copies for
//! copy-on-write. The caches are mutated in place; nothing here allocates cache memory.
//!
//! Invariants: a slot is `block * block_size + offset`; a negative slot means "do not write" (padding);
//! a slot past the cache is an error, never an out-of-bounds write.
//!
//! FP8 caches (`--kv-cache-dtype fp8`) are `U8` tensors of E4M3 bytes: a value `x` of a layer is
//! stored as `x / scale` rounded to nearest-even and saturated ([`crate::fp8::encode`]), with one
//! scale per layer for keys and one for values ([`CacheScales`]); the attention reads them back
//! exactly (every E4M3 value is a 16-bit float), the key scale folded into the score scale.

use crate::elem::{contiguous_range, for_kernel, Elem};
use crate::metadata::AttentionMetadata;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, InplaceOp2, Layout, Result, Tensor};
use half::{bf16, f16};

/// The dtype of an FP8 E4M3 cache tensor (its bytes).
pub const FP8_CACHE_DTYPE: DType = DType::U8;

/// Whether `cache` holds FP8 E4M3 bytes rather than the model's floats.
pub fn is_fp8_cache(cache: &Tensor) -> bool {
    cache.dtype() == FP8_CACHE_DTYPE
}

/// One layer's FP8 cache scales: keys are stored as `k / k`, values as `v / v`. Unit scales (the
/// default, as vLLM uses without calibrated scales) leave values as they are; 16-bit caches ignore
/// them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheScales {
    pub k: f32,
    pub v: f32,
}

impl Default for CacheScales {
    fn default() -> Self {
        Self { k: 1.0, v: 1.0 }
    }
}

impl CacheScales {
    /// Checks that both scales are finite and positive.
    pub fn validate(&self) -> Result<()> {
        for (what, s) in [("k", self.k), ("v", self.v)] {
            if !(s.is_finite() && s > 0.0) {
                candle_core::bail!("KV cache {what} scale {s} (must be finite and positive)");
            }
        }
        Ok(())
    }
}

struct WriteSlots<'a> {
    meta: &'a AttentionMetadata,
    /// FP8 caches: 1 / the layer's scale.
    inv: f32,
}

impl WriteSlots<'_> {
    /// Copies row `t` of `src` (rows of `kv_heads * head_dim`, one per token) to the row of
    /// `dst` (`[num_blocks, block_size, kv_heads, head_dim]`) at token t's slot, converting each
    /// value with `put`; skipped slots are left alone, slots past the cache refused.
    fn scatter<S: Copy, D>(
        &self,
        dst: &mut [D],
        dst_l: &Layout,
        src: &[S],
        put: impl Fn(S) -> D,
    ) -> Result<()> {
        let dims = dst_l.dims();
        let row = dims[2] * dims[3];
        let total_slots = dims[0] * dims[1];
        let (da, db) = contiguous_range(dst_l, "cache")?;
        let dst = &mut dst[da..db];
        if src.len() != self.meta.slots.len() * row {
            candle_core::bail!(
                "slot_mapping has {} entries for {} rows",
                self.meta.slots.len(),
                src.len() / row.max(1)
            );
        }
        for (t, &slot) in self.meta.slots.iter().enumerate() {
            if slot < 0 {
                continue;
            }
            let slot = slot as usize;
            if slot >= total_slots {
                candle_core::bail!("slot {slot} outside the cache ({total_slots} slots)");
            }
            let d = &mut dst[slot * row..(slot + 1) * row];
            for (o, &x) in d.iter_mut().zip(&src[t * row..(t + 1) * row]) {
                *o = put(x);
            }
        }
        Ok(())
    }

    /// Into an FP8 cache: `src` of type `T`, each value times `inv`, encoded.
    fn run_fp8<T: Elem>(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        src: &CpuStorage,
        src_l: &Layout,
    ) -> Result<()> {
        let src = crate::elem::typed::<T>(src, src_l, "new k/v")?;
        let CpuStorage::U8(dst) = dst else {
            candle_core::bail!("FP8 cache dtype");
        };
        self.scatter(dst, dst_l, src, |x| {
            crate::fp8::encode(x.to_f32() * self.inv)
        })
    }

    /// Into a cache of the values' own dtype `T`.
    fn run<T: Elem>(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        src: &CpuStorage,
        src_l: &Layout,
    ) -> Result<()> {
        let (sa, sb) = contiguous_range(src_l, "new k/v")?;
        let src = T::slice(src)
            .ok_or_else(|| candle_core::Error::Msg("k/v dtype must match the cache".into()))?;
        let dst = T::slice_mut(dst).ok_or_else(|| candle_core::Error::Msg("cache dtype".into()))?;
        self.scatter(dst, dst_l, &src[sa..sb], |x| x)
    }
}

impl InplaceOp2 for WriteSlots<'_> {
    fn name(&self) -> &'static str {
        "reshape-and-cache"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        src: &CpuStorage,
        src_l: &Layout,
    ) -> Result<()> {
        match (dst.dtype(), src.dtype()) {
            (DType::F32, _) => self.run::<f32>(dst, dst_l, src, src_l),
            (DType::BF16, _) => self.run::<bf16>(dst, dst_l, src, src_l),
            (DType::F16, _) => self.run::<f16>(dst, dst_l, src, src_l),
            (FP8_CACHE_DTYPE, DType::F32) => self.run_fp8::<f32>(dst, dst_l, src, src_l),
            (FP8_CACHE_DTYPE, DType::BF16) => self.run_fp8::<bf16>(dst, dst_l, src, src_l),
            (FP8_CACHE_DTYPE, DType::F16) => self.run_fp8::<f16>(dst, dst_l, src, src_l),
            (dt, st) => candle_core::bail!("unsupported cache dtype {dt:?} for {st:?} k/v"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        src: &candle_core::CudaStorage,
        src_l: &Layout,
    ) -> Result<()> {
        match (dst.dtype(), src.dtype()) {
            (DType::F32, DType::F32) => self.cuda_run::<f32, f32>(dst, dst_l, src, src_l),
            (DType::BF16, DType::BF16) => self.cuda_run::<bf16, bf16>(dst, dst_l, src, src_l),
            (DType::F16, DType::F16) => self.cuda_run::<f16, f16>(dst, dst_l, src, src_l),
            (FP8_CACHE_DTYPE, DType::F32) => self.cuda_run::<f32, u8>(dst, dst_l, src, src_l),
            (FP8_CACHE_DTYPE, DType::BF16) => self.cuda_run::<bf16, u8>(dst, dst_l, src, src_l),
            (FP8_CACHE_DTYPE, DType::F16) => self.cuda_run::<f16, u8>(dst, dst_l, src, src_l),
            (dt, st) => candle_core::bail!("unsupported cache dtype {dt:?} for {st:?} k/v"),
        }
    }
}

/// The name suffix of a kernel instantiated per (compute dtype, cache dtype): `<dtype>`, or
/// `<dtype>_fp8` for an FP8 cache.
#[cfg(feature = "cuda")]
pub(crate) fn cache_suffix(compute: DType, cache: DType) -> Result<String> {
    let suffix = crate::cuda::dtype_suffix(compute)?;
    Ok(if cache == FP8_CACHE_DTYPE {
        format!("{suffix}_fp8")
    } else if cache == compute {
        suffix.to_string()
    } else {
        candle_core::bail!("a {cache:?} cache for {compute:?} values")
    })
}

/// `<base>_<cache_suffix>`: the kernel `base` for these dtypes.
#[cfg(feature = "cuda")]
pub(crate) fn cache_kernel(base: &str, compute: DType, cache: DType) -> Result<String> {
    Ok(format!("{base}_{}", cache_suffix(compute, cache)?))
}

#[cfg(feature = "cuda")]
impl WriteSlots<'_> {
    fn cuda_run<T, C>(
        &self,
        dst: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        src: &candle_core::CudaStorage,
        src_l: &Layout,
    ) -> Result<()>
    where
        T: crate::cuda::KernelElem,
        C: crate::cuda::KernelElem,
    {
        use crate::cuda::{function, storage_view, token_rows};
        use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
        use candle_core::cuda_backend::WrapErr;

        let dims = dst_l.dims();
        let row = dims[2] * dims[3];
        let n = self.meta.num_tokens();
        if src_l.shape().elem_count() != n * row {
            candle_core::bail!(
                "slot_mapping has {n} entries for {} rows",
                src_l.shape().elem_count() / row.max(1)
            );
        }
        if n == 0 {
            return Ok(());
        }
        if !dst_l.is_contiguous() || dst_l.start_offset() != 0 {
            candle_core::bail!("reshape_and_cache: the cache must be a whole contiguous tensor");
        }
        let dev = dst.device().clone();
        let (src_view, src_stride) = token_rows::<T>(src, src_l, "new k/v")?;
        let arrays = self.meta.device_arrays()?;
        let (sg, sl) = arrays.slots.storage_and_layout();
        let slots = storage_view::<i64>(&sg, sl, "slot_mapping")?;
        let cache = dst.as_cuda_slice_mut::<C>()?;
        let func = function(
            &dev,
            &cache_kernel("reshape_and_cache", T::DTYPE, C::DTYPE)?,
        )?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        let row_i = row as i32;
        b.arg(cache)
            .arg(&src_view)
            .arg(&slots)
            .arg(&row_i)
            .arg(&src_stride)
            .arg(&self.inv);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (row.next_multiple_of(32).min(256) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `reshape_and_cache_<dtype>[_fp8]` in csrc/cache.cu; slots were
        // validated against the cache size on the host.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }
}

/// Writes `key`/`value` (`[num_tokens, kv_heads, head_dim]`) into `k_cache`/`v_cache`
/// (`[num_blocks, block_size, kv_heads, head_dim]`) at the metadata's slots.
pub fn reshape_and_cache(
    key: &Tensor,
    value: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    meta: &AttentionMetadata,
) -> Result<()> {
    reshape_and_cache_scaled(key, value, k_cache, v_cache, meta, CacheScales::default())
}

/// [`reshape_and_cache`] with the layer's FP8 scales (ignored by 16-bit caches).
pub fn reshape_and_cache_scaled(
    key: &Tensor,
    value: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    meta: &AttentionMetadata,
    scales: CacheScales,
) -> Result<()> {
    let (_, kvh, d) = key.dims3()?;
    if value.dims3()? != key.dims3()? {
        candle_core::bail!(
            "reshape_and_cache: k {:?} v {:?}",
            key.shape(),
            value.shape()
        );
    }
    check_caches(kvh, d, k_cache, v_cache, meta)?;
    scales.validate()?;
    let write = |cache: &Tensor, x: &Tensor, scale: f32| {
        let inv = if is_fp8_cache(cache) {
            1.0 / scale
        } else {
            1.0
        };
        cache.inplace_op2(&for_kernel(x)?, &WriteSlots { meta, inv })
    };
    write(k_cache, key, scales.k)?;
    write(v_cache, value, scales.v)
}

/// Checks that both caches are `[num_blocks, block_size, kv_heads, head_dim]` and that every slot
/// of `meta` lies inside them.
pub(crate) fn check_caches(
    kv_heads: usize,
    head_dim: usize,
    k_cache: &Tensor,
    v_cache: &Tensor,
    meta: &AttentionMetadata,
) -> Result<()> {
    let cd = k_cache.dims4()?;
    if (cd.2, cd.3) != (kv_heads, head_dim) || v_cache.dims4()? != cd {
        candle_core::bail!(
            "cache write: k cache {:?}, v cache {:?} for {kv_heads} heads of {head_dim}",
            k_cache.shape(),
            v_cache.shape()
        );
    }
    meta.check_slots(cd.0 * cd.1)
}

struct CopyBlocks {
    pairs: Vec<(usize, usize)>,
}

impl CopyBlocks {
    fn run<T: Elem>(&self, dst: &mut CpuStorage, l: &Layout) -> Result<()> {
        let data =
            T::slice_mut(dst).ok_or_else(|| candle_core::Error::Msg("cache dtype".into()))?;
        self.copy(data, l)
    }

    fn copy<T: Copy>(&self, data: &mut [T], l: &Layout) -> Result<()> {
        let dims = l.dims();
        let per_block = dims[1] * dims[2] * dims[3];
        let (a, b) = contiguous_range(l, "cache")?;
        let data = &mut data[a..b];
        for &(src, dst) in &self.pairs {
            if src >= dims[0] || dst >= dims[0] {
                candle_core::bail!(
                    "copy_blocks: block {src} -> {dst} outside {} blocks",
                    dims[0]
                );
            }
            if src != dst {
                data.copy_within(src * per_block..(src + 1) * per_block, dst * per_block);
            }
        }
        Ok(())
    }
}

impl candle_core::InplaceOp1 for CopyBlocks {
    fn name(&self) -> &'static str {
        "copy-blocks"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        match s {
            CpuStorage::F32(_) => self.run::<f32>(s, l),
            CpuStorage::BF16(_) => self.run::<bf16>(s, l),
            CpuStorage::F16(_) => self.run::<f16>(s, l),
            CpuStorage::U8(data) => self.copy(data, l),
            _ => candle_core::bail!("unsupported cache dtype {:?}", s.dtype()),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &mut candle_core::CudaStorage, l: &Layout) -> Result<()> {
        use crate::cuda::{dtype_suffix, function};
        use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
        use candle_core::cuda_backend::WrapErr;

        let dims = l.dims();
        let per_block = dims[1] * dims[2] * dims[3];
        if !l.is_contiguous() || l.start_offset() != 0 {
            candle_core::bail!("copy_blocks: the cache must be a whole contiguous tensor");
        }
        let mut flat = Vec::with_capacity(2 * self.pairs.len());
        for &(src, dst) in &self.pairs {
            if src >= dims[0] || dst >= dims[0] {
                candle_core::bail!(
                    "copy_blocks: block {src} -> {dst} outside {} blocks",
                    dims[0]
                );
            }
            flat.extend([src as u32, dst as u32]);
        }
        let dev = s.device().clone();
        let stream = dev.cuda_stream();
        let pairs = stream.clone_htod(&flat).w()?;
        let name = match s.dtype() {
            FP8_CACHE_DTYPE => "copy_blocks_u8".to_string(),
            dt => format!("copy_blocks_{}", dtype_suffix(dt)?),
        };
        let func = function(&dev, &name)?;
        let per_block_i = per_block as i32;
        let cfg = LaunchConfig {
            grid_dim: (
                self.pairs.len() as u32,
                per_block.div_ceil(256 * 8).max(1) as u32,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        macro_rules! launch {
            ($t:ty) => {{
                let cache = s.as_cuda_slice_mut::<$t>()?;
                let mut b = stream.launch_builder(&func);
                b.arg(cache).arg(&pairs).arg(&per_block_i);
                // SAFETY: matches `copy_blocks_<dtype>` in csrc/cache.cu; block ids checked above.
                unsafe { b.launch(cfg) }.w()?;
            }};
        }
        match s.dtype() {
            DType::F32 => launch!(f32),
            DType::BF16 => launch!(bf16),
            DType::F16 => launch!(f16),
            FP8_CACHE_DTYPE => launch!(u8),
            dt => candle_core::bail!("unsupported cache dtype {dt:?}"),
        }
        Ok(())
    }
}

/// Copies whole blocks `src -> dst` within one cache tensor (copy-on-write of shared blocks).
pub fn copy_blocks(cache: &Tensor, pairs: &[(usize, usize)]) -> Result<()> {
    if pairs.is_empty() {
        return Ok(());
    }
    cache.inplace_op1(&CopyBlocks {
        pairs: pairs.to_vec(),
    })
}
