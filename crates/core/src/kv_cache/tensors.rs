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
