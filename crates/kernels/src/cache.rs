//! Writes into the paged KV cache: new keys/values by slot mapping, and whole-block copies for
//! copy-on-write. The caches are mutated in place; nothing here allocates cache memory.
//!
//! Invariants: a slot is `block * block_size + offset`; a negative slot means "do not write" (padding);
//! a slot past the cache is an error, never an out-of-bounds write.

use crate::elem::{contiguous_range, for_kernel, Elem};
use crate::metadata::AttentionMetadata;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, InplaceOp2, Layout, Result, Tensor};
use half::{bf16, f16};

struct WriteSlots<'a> {
    meta: &'a AttentionMetadata,
}

impl WriteSlots<'_> {
    fn run<T: Elem>(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        src: &CpuStorage,
        src_l: &Layout,
    ) -> Result<()> {
        // dst: [num_blocks, block_size, kv_heads, head_dim]; src: [num_tokens, kv_heads, head_dim]
        let dims = dst_l.dims();
        let row = dims[2] * dims[3];
        let total_slots = dims[0] * dims[1];
        let (da, db) = contiguous_range(dst_l, "cache")?;
        let (sa, sb) = contiguous_range(src_l, "new k/v")?;
        let src = T::slice(src)
            .ok_or_else(|| candle_core::Error::Msg("k/v dtype must match the cache".into()))?;
        let src = &src[sa..sb];
        let dst = T::slice_mut(dst).ok_or_else(|| candle_core::Error::Msg("cache dtype".into()))?;
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
            dst[slot * row..(slot + 1) * row].copy_from_slice(&src[t * row..(t + 1) * row]);
        }
        Ok(())
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
        match dst.dtype() {
            DType::F32 => self.run::<f32>(dst, dst_l, src, src_l),
            DType::BF16 => self.run::<bf16>(dst, dst_l, src, src_l),
            DType::F16 => self.run::<f16>(dst, dst_l, src, src_l),
            dt => candle_core::bail!("unsupported cache dtype {dt:?}"),
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
        match dst.dtype() {
            DType::F32 => self.cuda_run::<f32>(dst, dst_l, src, src_l),
            DType::BF16 => self.cuda_run::<bf16>(dst, dst_l, src, src_l),
            DType::F16 => self.cuda_run::<f16>(dst, dst_l, src, src_l),
            dt => candle_core::bail!("unsupported cache dtype {dt:?}"),
        }
    }
}

#[cfg(feature = "cuda")]
impl WriteSlots<'_> {
    fn cuda_run<T>(
        &self,
        dst: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        src: &candle_core::CudaStorage,
        src_l: &Layout,
    ) -> Result<()>
    where
        T: candle_core::cuda_backend::CudaDType
            + candle_core::WithDType
            + candle_core::cuda_backend::cudarc::driver::DeviceRepr,
    {
        use crate::cuda::{cuda_slice, dtype_suffix, function, token_rows};
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
        let (sg, _) = arrays.slots.storage_and_layout();
        let slots = cuda_slice::<i64>(&sg, "slot_mapping")?;
        let cache = dst.as_cuda_slice_mut::<T>()?;
        let func = function(
            &dev,
            &format!("reshape_and_cache_{}", dtype_suffix(T::DTYPE)?),
        )?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        let row_i = row as i32;
        b.arg(cache)
            .arg(&src_view)
            .arg(slots)
            .arg(&row_i)
            .arg(&src_stride);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (row.next_multiple_of(32).min(256) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `reshape_and_cache_<dtype>` in csrc/cache.cu; slots were validated
        // against the cache size on the host.
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
    let (_, kvh, d) = key.dims3()?;
    if value.dims3()? != key.dims3()? {
        candle_core::bail!(
            "reshape_and_cache: k {:?} v {:?}",
            key.shape(),
            value.shape()
        );
    }
    check_caches(kvh, d, k_cache, v_cache, meta)?;
    let op = WriteSlots { meta };
    k_cache.inplace_op2(&for_kernel(key)?, &op)?;
    v_cache.inplace_op2(&for_kernel(value)?, &op)
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
        let dims = l.dims();
        let per_block = dims[1] * dims[2] * dims[3];
        let (a, b) = contiguous_range(l, "cache")?;
        let data =
            T::slice_mut(dst).ok_or_else(|| candle_core::Error::Msg("cache dtype".into()))?;
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
        match s.dtype() {
            DType::F32 => self.run::<f32>(s, l),
            DType::BF16 => self.run::<bf16>(s, l),
            DType::F16 => self.run::<f16>(s, l),
            dt => candle_core::bail!("unsupported cache dtype {dt:?}"),
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
        let name = format!("copy_blocks_{}", dtype_suffix(s.dtype())?);
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
