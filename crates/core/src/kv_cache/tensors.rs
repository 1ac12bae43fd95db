//! The tensors that hold keys and values: per layer, K and V shaped
//! `[num_blocks, block_size, kv_heads, head_dim]`, written in place by the kernels.
//!
//! Owns device memory only; which block belongs to whom lives in `manager`.

use candle_core::{DType, Device, Result, Tensor};
use rserve_kernels::{CacheScales, FP8_CACHE_DTYPE};

/// What the KV cache stores (`--kv-cache-dtype`, vLLM's values).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KvCacheDtype {
    /// The model's compute dtype.
    #[default]
    Auto,
    /// FP8 E4M3 bytes with a scale per layer for keys and one for values (1 unless the checkpoint
    /// gives them): half the bytes of a 16-bit cache, so twice the tokens.
    Fp8,
}

impl std::str::FromStr for KvCacheDtype {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "fp8" | "fp8_e4m3" => Ok(Self::Fp8),
            "fp8_e5m2" => Err("kv_cache_dtype fp8_e5m2 is not supported; fp8 (E4M3) is".into()),
            other => Err(format!(
                "unknown kv_cache_dtype {other:?} (choose auto, fp8 or fp8_e4m3)"
            )),
        }
    }
}

impl KvCacheDtype {
    /// The dtype of the cache tensors for a model computing in `model`.
    pub fn storage(self, model: DType) -> DType {
        match self {
            Self::Auto => model,
            Self::Fp8 => FP8_CACHE_DTYPE,
        }
    }

    /// The name the startup log and `/v1/models` give.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Fp8 => "fp8_e4m3",
        }
    }
}

/// One layer's keys and values, each `[num_blocks, block_size, kv_heads, head_dim]`, and the
/// scales an FP8 cache stores them at.
#[derive(Debug, Clone)]
pub struct LayerKv {
    pub k: Tensor,
    pub v: Tensor,
    pub scales: CacheScales,
}

/// Keys and values of every layer.
#[derive(Debug, Clone)]
pub struct KvCache {
    pub layers: Vec<LayerKv>,
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
        let alloc = || {
            (0..num_layers)
                .map(|_| {
                    Ok(LayerKv {
                        k: Tensor::zeros(shape, dtype, device)?,
                        v: Tensor::zeros(shape, dtype, device)?,
                        scales: CacheScales::default(),
                    })
                })
                .collect::<Result<Vec<_>>>()
        };
        // on the CPU the cache is host memory: zero pages, touched only as blocks are written
        let layers = if device.is_cpu() {
            crate::host::zero_page_allocations(alloc)?
        } else {
            alloc()?
        };
        Ok(Self {
            layers,
            num_blocks,
            block_size,
        })
    }

    /// Gives layer `i` the scales `scales[i]` where that is `Some` (a checkpoint's FP8 KV-cache
    /// scales); returns how many layers took one.
    pub fn set_scales(&mut self, scales: &[Option<CacheScales>]) -> usize {
        let mut n = 0;
        for (layer, s) in self.layers.iter_mut().zip(scales) {
            if let Some(s) = s {
                layer.scales = *s;
                n += 1;
            }
        }
        n
    }

    /// Copies whole blocks `src -> dst` in every layer (copy-on-write).
    pub fn copy_blocks(&self, pairs: &[(usize, usize)]) -> Result<()> {
        for layer in &self.layers {
            rserve_kernels::copy_blocks(&layer.k, pairs)?;
            rserve_kernels::copy_blocks(&layer.v, pairs)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_cache_dtypes_parse_as_vllm_spells_them() {
        assert_eq!("auto".parse(), Ok(KvCacheDtype::Auto));
        assert_eq!("fp8".parse(), Ok(KvCacheDtype::Fp8));
        assert_eq!("fp8_e4m3".parse(), Ok(KvCacheDtype::Fp8));
        let e5m2 = "fp8_e5m2".parse::<KvCacheDtype>().expect_err("e5m2");
        assert!(e5m2.contains("not supported"), "{e5m2}");
        let bad = "int8".parse::<KvCacheDtype>().expect_err("int8");
        assert!(bad.contains("auto, fp8"), "{bad}");
        assert_eq!(KvCacheDtype::Fp8.storage(DType::BF16), DType::U8);
        assert_eq!(KvCacheDtype::Auto.storage(DType::BF16), DType::BF16);
    }

    #[test]
    fn an_fp8_cache_block_takes_half_the_bytes_of_a_16_bit_one() {
        let b16 = KvCache::bytes_per_block(32, 16, 8, 128, DType::BF16);
        let b8 = KvCache::bytes_per_block(32, 16, 8, 128, KvCacheDtype::Fp8.storage(DType::BF16));
        assert_eq!(
            (b16, b8),
            (2 * 32 * 16 * 8 * 128 * 2, 2 * 32 * 16 * 8 * 128)
        );
    }

    #[test]
    fn a_cache_of_2_to_the_32_slots_or_more_is_refused_before_allocating() {
        let err =
            KvCache::new(1, 1 << 28, 16, 1, 1, DType::F32, &Device::Cpu).expect_err("2^32 slots");
        assert!(err.to_string().contains("2^32"), "{err}");
    }
}
