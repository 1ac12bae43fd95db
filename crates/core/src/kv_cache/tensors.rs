//! The tensors that hold keys and values: per layer, K and V shaped
//! `[num_blocks, block_size, kv_heads, head_dim]`, written in place by the kernels.
//!
//! Owns device memory only; which block belongs to whom lives in `manager`.

use candle_core::{DType, Device, Result, Tensor};

/// Keys and values of every layer.
#[derive(Debug, Clone)]
pub struct KvCache {
    /// Per layer: (k, v), each `[num_blocks, block_size, kv_heads, head_dim]`.
    pub layers: Vec<(Tensor, Tensor)>,
    pub num_blocks: usize,
    pub block_size: usize,
}

impl KvCache {
    /// Bytes one block takes across all layers (K and V).
    pub fn bytes_per_block(
        num_layers: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: DType,
    ) -> usize {
        2 * num_layers * block_size * kv_heads * head_dim * dtype.size_in_bytes()
    }

    #[allow(clippy::too_many_arguments)]
    pub fn new(
        num_layers: usize,
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        // the decode kernels keep a key's slot in 32 bits (computed in 64)
        if num_blocks.saturating_mul(block_size) > u32::MAX as usize {
            candle_core::bail!(
                "a KV cache of {num_blocks} blocks of {block_size} tokens has more than 2^32 token slots"
            );
        }
        let shape = (num_blocks, block_size, kv_heads, head_dim);
        let layers = (0..num_layers)
            .map(|_| {
                Ok((
                    Tensor::zeros(shape, dtype, device)?,
                    Tensor::zeros(shape, dtype, device)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            num_blocks,
            block_size,
        })
    }

    /// Copies whole blocks `src -> dst` in every layer (copy-on-write).
    pub fn copy_blocks(&self, pairs: &[(usize, usize)]) -> Result<()> {
        for (k, v) in &self.layers {
            rserve_kernels::copy_blocks(k, pairs)?;
            rserve_kernels::copy_blocks(v, pairs)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_of_2_to_the_32_slots_or_more_is_refused_before_allocating() {
        let err =
            KvCache::new(1, 1 << 28, 16, 1, 1, DType::F32, &Device::Cpu).expect_err("2^32 slots");
        assert!(err.to_string().contains("2^32"), "{err}");
    }
}
