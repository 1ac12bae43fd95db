//! Writes into the paged KV cache: new keys/values by slot mapping, and whole-block copies for
//! copy-on-write. The caches are mutated in place; nothing here allocates cache memory.
//!
//! Invariants: a slot is `block * block_size + offset`; a negative slot means "do not write" (padding);
//! a slot past the cache is an error, never an out-of-bounds write.

use crate::elem::{contiguous_range, host_ints, Elem};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, InplaceOp2, Layout, Result, Tensor};
use half::{bf16, f16};

struct WriteSlots {
    slots: Vec<i64>,
}

impl WriteSlots {
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
        if src.len() != self.slots.len() * row {
            candle_core::bail!(
                "slot_mapping has {} entries for {} rows",
                self.slots.len(),
                src.len() / row.max(1)
            );
        }
        for (t, &slot) in self.slots.iter().enumerate() {
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

impl InplaceOp2 for WriteSlots {
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
}

/// Writes `key`/`value` (`[num_tokens, kv_heads, head_dim]`) into `k_cache`/`v_cache`
/// (`[num_blocks, block_size, kv_heads, head_dim]`) at `slot_mapping` (`[num_tokens]`).
pub fn reshape_and_cache(
    key: &Tensor,
    value: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    slot_mapping: &Tensor,
) -> Result<()> {
    let (_, kvh, d) = key.dims3()?;
    let cd = k_cache.dims4()?;
    if (cd.2, cd.3) != (kvh, d) || value.dims3()? != key.dims3()? || v_cache.dims4()? != cd {
        candle_core::bail!(
            "reshape_and_cache: k {:?} v {:?} cache {:?}",
            key.shape(),
            value.shape(),
            k_cache.shape()
        );
    }
    let slots = host_ints(slot_mapping, "slot_mapping")?;
    let op = WriteSlots { slots };
    k_cache.inplace_op2(&key.contiguous()?, &op)?;
    v_cache.inplace_op2(&value.contiguous()?, &op)
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn writes_rows_at_slots_and_skips_negative() -> Result<()> {
        let dev = Device::Cpu;
        let kc = Tensor::zeros((3, 2, 1, 2), DType::F32, &dev)?;
        let vc = Tensor::zeros((3, 2, 1, 2), DType::F32, &dev)?;
        let k = Tensor::new(&[[[1f32, 2.]], [[3., 4.]], [[5., 6.]]], &dev)?;
        let v = (&k * 10.0)?;
        let slots = Tensor::new(&[5i64, -1, 0], &dev)?;
        reshape_and_cache(&k, &v, &kc, &vc, &slots)?;
        let kv = kc.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(kv, vec![5., 6., 0., 0., 0., 0., 0., 0., 0., 0., 1., 2.]);
        assert_eq!(vc.flatten_all()?.to_vec1::<f32>()?[10], 10.0);
        Ok(())
    }

    #[test]
    fn out_of_range_slot_is_an_error() -> Result<()> {
        let dev = Device::Cpu;
        let kc = Tensor::zeros((1, 2, 1, 2), DType::F32, &dev)?;
        let k = Tensor::zeros((1, 1, 2), DType::F32, &dev)?;
        let slots = Tensor::new(&[2i64], &dev)?;
        assert!(reshape_and_cache(&k, &k, &kc, &kc.clone(), &slots).is_err());
        Ok(())
    }

    #[test]
    fn copies_blocks() -> Result<()> {
        let dev = Device::Cpu;
        let c = Tensor::arange(0f32, 8., &dev)?.reshape((4, 1, 1, 2))?;
        copy_blocks(&c, &[(1, 3)])?;
        assert_eq!(
            c.flatten_all()?.to_vec1::<f32>()?,
            vec![0., 1., 2., 3., 4., 5., 2., 3.]
        );
        Ok(())
    }
}
