//! GGML block weights on the GPU: `q8_0`, `q4_0`, `q5_0`, `q4k` and `q6k` quantized where the
//! weight lives (no trip through the host), products for decode batches that read the packed
//! weight once, and the weight dequantized to the activations' type for larger batches.
//!
//! The device layout is rserve's, not the file's: every block's f16 scale `d` moves to a separate
//! array `[n, k / block]` and the rest of each block stays in ggml's byte order, so that every load
//! is aligned (ggml's 34-byte `q8_0` blocks are only 2-byte aligned). `q4k` keeps its blocks whole
//! (144 bytes, already 16-byte aligned, `d` and `dmin` inside). [`split`] and [`join`] convert
//! from and to ggml's bytes; [`crate::quantize`] (llama.cpp's reference quantizers, bit for bit)
//! is the reference of the GPU quantizers, and products over the dequantized weight the
//! reference of the GPU products.

use crate::quantize::{self, BlockType};
use candle_core::{DType, Device, Result, Tensor};

#[cfg(feature = "cuda")]
mod cuda;

/// The most rows of `x` the streaming products take; more rows dequantize the weight and run a
/// dense product.
pub const GEMV_MAX_ROWS: usize = 8;

/// Bytes of a block in the device layout, its scale `d` left out (`q4k` keeps its own).
pub fn data_bytes(t: BlockType) -> usize {
    match t {
        BlockType::Q4K => t.block_bytes(),
        _ => t.block_bytes() - 2,
    }
}

/// Whether the format's scales live in a separate array (all but `q4k`).
pub fn has_scales(t: BlockType) -> bool {
    t != BlockType::Q4K
}

/// Where a block's f16 scale sits in ggml's bytes.
fn scale_offset(t: BlockType) -> usize {
    match t {
        BlockType::Q6K => 208,
        _ => 0,
    }
}

/// ggml's blocks (`bytes`, whole blocks of `t`) as the device layout: the data of every block,
/// then every block's scale (f16, little-endian; empty for `q4k`).
pub fn split(t: BlockType, bytes: &[u8]) -> Result<(Vec<u8>, Vec<u8>)> {
    let bb = t.block_bytes();
    if !bytes.len().is_multiple_of(bb) {
        candle_core::bail!("{t:?}: {} bytes are not whole blocks of {bb}", bytes.len());
    }
    if !has_scales(t) {
        return Ok((bytes.to_vec(), Vec::new()));
    }
    let blocks = bytes.len() / bb;
    let off = scale_offset(t);
    let mut data = Vec::with_capacity(blocks * data_bytes(t));
    let mut scales = Vec::with_capacity(blocks * 2);
    for b in bytes.chunks_exact(bb) {
        scales.extend_from_slice(&b[off..off + 2]);
        data.extend_from_slice(&b[..off]);
        data.extend_from_slice(&b[off + 2..]);
    }
    Ok((data, scales))
}

/// The inverse of [`split`]: ggml's bytes.
pub fn join(t: BlockType, data: &[u8], scales: &[u8]) -> Result<Vec<u8>> {
    if !has_scales(t) {
        return Ok(data.to_vec());
    }
    let db = data_bytes(t);
    let blocks = data.len() / db;
    if data.len() != blocks * db || scales.len() != blocks * 2 {
        candle_core::bail!(
            "{t:?}: {} data bytes and {} scale bytes are not whole blocks",
            data.len(),
            scales.len()
        );
    }
    let off = scale_offset(t);
    let mut out = Vec::with_capacity(blocks * t.block_bytes());
    for (d, s) in data.chunks_exact(db).zip(scales.chunks_exact(2)) {
        out.extend_from_slice(&d[..off]);
        out.extend_from_slice(s);
        out.extend_from_slice(&d[off..]);
    }
    Ok(out)
}

/// A weight `[n, k]` in a GGML block format, in the device layout: `data` (u8 `[n, k / block *
/// data_bytes]`) and, but for `q4k`, `scales` (f16 `[n, k / block]`).
#[derive(Debug, Clone)]
pub struct BlockWeight {
    t: BlockType,
    data: Tensor,
    scales: Option<Tensor>,
    shape: (usize, usize),
}

/// Whether GPU dequantization takes the tiled kernel: yes, unless `RSERVE_GGML_DEQUANT_TILED=0`
/// (for comparisons).
fn tiled_dequantizer() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| crate::switch_on("RSERVE_GGML_DEQUANT_TILED"))
}

impl BlockWeight {
    /// Checks that `k` holds whole blocks of `t`.
    fn check(t: BlockType, (n, k): (usize, usize)) -> Result<()> {
        let bv = t.block_values();
        if k == 0 || !k.is_multiple_of(bv) {
            candle_core::bail!(
                "{t:?} needs rows that are a multiple of {bv} values, got [{n}, {k}]"
            );
        }
        Ok(())
    }

    /// A weight from ggml's bytes (as a GGUF file stores it), placed on `device`.
    pub fn from_ggml(
        t: BlockType,
        bytes: &[u8],
        (n, k): (usize, usize),
        device: &Device,
    ) -> Result<Self> {
        Self::check(t, (n, k))?;
        if bytes.len() != n * t.row_bytes(k) {
            candle_core::bail!(
                "{t:?} [{n}, {k}] takes {} bytes, got {}",
                n * t.row_bytes(k),
                bytes.len()
            );
        }
        let (data, scales) = split(t, bytes)?;
        let blocks = k / t.block_values();
        let data = Tensor::from_vec(data, (n, blocks * data_bytes(t)), device)?;
        let scales = if has_scales(t) {
            let s: Vec<half::f16> = scales
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]))
                .collect();
            Some(Tensor::from_vec(s, (n, blocks), device)?)
        } else {
            None
        };
        Ok(Self {
            t,
            data,
            scales,
            shape: (n, k),
        })
    }

    /// Quantizes `w` `[n, k]` to `t` where it lives: on a GPU with rserve's kernels (the same
    /// bits as llama.cpp's reference quantizers), on the CPU with [`quantize::quantize`].
    pub fn quantize(t: BlockType, w: &Tensor) -> Result<Self> {
        let (n, k) = w.dims2()?;
        Self::check(t, (n, k))?;
        #[cfg(feature = "cuda")]
        if let Device::Cuda(dev) = w.device() {
            let (data, scales) = cuda::quantize(dev, t, &w.contiguous()?)?;
            return Ok(Self {
                t,
                data,
                scales,
                shape: (n, k),
            });
        }
        let x = w.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let bytes = quantize::quantize(t, &x, k).map_err(candle_core::Error::msg)?;
        Self::from_ggml(t, &bytes, (n, k), w.device())
    }

    /// The format.
    pub fn block_type(&self) -> BlockType {
        self.t
    }

    /// Where the weight lives.
    pub fn device(&self) -> Device {
        self.data.device().clone()
    }

    /// `(n, k)`.
    pub fn shape(&self) -> (usize, usize) {
        self.shape
    }

    /// Bytes of the packed weight and its scales.
    pub fn size_in_bytes(&self) -> usize {
        self.data.elem_count() + self.scales.as_ref().map_or(0, |s| 2 * s.elem_count())
    }

    /// ggml's bytes of the weight (read back from the device).
    pub fn to_ggml(&self) -> Result<Vec<u8>> {
        let data = self.data.flatten_all()?.to_vec1::<u8>()?;
        let scales = match &self.scales {
            Some(s) => s
                .flatten_all()?
                .to_vec1::<half::f16>()?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            None => Vec::new(),
        };
        join(self.t, &data, &scales)
    }

    /// Weights of one format and input width, their rows stacked in order (`None` when formats
    /// or widths differ).
    pub fn stack(parts: &[BlockWeight]) -> Result<Option<Self>> {
        let Some(first) = parts.first() else {
            return Ok(None);
        };
        if parts
            .iter()
            .any(|p| p.t != first.t || p.shape.1 != first.shape.1)
        {
            return Ok(None);
        }
        let data: Vec<&Tensor> = parts.iter().map(|p| &p.data).collect();
        let scales = match first.scales {
            Some(_) => {
                let s: Vec<&Tensor> = parts.iter().filter_map(|p| p.scales.as_ref()).collect();
                Some(Tensor::cat(&s, 0)?)
            }
            None => None,
        };
        Ok(Some(Self {
            t: first.t,
            data: Tensor::cat(&data, 0)?,
            scales,
            shape: (parts.iter().map(|p| p.shape.0).sum(), first.shape.1),
        }))
    }

    /// The weight as `dtype` `[n, k]`, on its device.
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        self.dequantize_with(dtype, tiled_dequantizer())
    }

    /// [`Self::dequantize`] on a GPU through the tiled kernel (stores coalesced through shared
    /// memory) or the one that stores each thread's values in place (`tiled` false); the same
    /// values either way.
    pub fn dequantize_with(&self, dtype: DType, tiled: bool) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(dev) = self.data.device() {
            return cuda::dequantize(dev, self, dtype, tiled);
        }
        let _ = tiled;
        let w = quantize::dequantize(self.t, &self.to_ggml()?);
        Tensor::from_vec(w, self.shape, self.data.device())?.to_dtype(dtype)
    }

    /// `x W^T` for `x` `[m, k]`: the streaming kernel for up to [`GEMV_MAX_ROWS`] rows of 16-bit
    /// activations on a GPU, else a dense product with the dequantized weight.
    pub fn linear(&self, x: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(y) = cuda::gemv(self, x, false)? {
            return Ok(y);
        }
        crate::linear_rows(x, &self.dequantize(x.dtype())?)
    }

    /// `silu(x G^T) * (x U^T)` for a stacked gate-up weight (gate rows, then up rows).
    pub fn silu_glu(&self, x: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.shape.0.is_multiple_of(2) {
            if let Some(y) = cuda::gemv(self, x, true)? {
                return Ok(y);
            }
        }
        crate::silu_and_mul(&self.linear(x)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|i| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                ((s >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * (1.0 + (i % 7) as f32)
            })
            .collect()
    }

    #[test]
    fn split_and_join_are_inverse() {
        for t in BlockType::ALL {
            let bytes = quantize::quantize(t, &values(4 * 512, 3), 512).expect("quantize");
            let (data, scales) = split(t, &bytes).expect("split");
            let blocks = bytes.len() / t.block_bytes();
            assert_eq!(data.len(), blocks * data_bytes(t), "{t:?}");
            assert_eq!(scales.len(), if has_scales(t) { 2 * blocks } else { 0 });
            assert_eq!(join(t, &data, &scales).expect("join"), bytes, "{t:?}");
            // the scale is the block's d
            if has_scales(t) {
                let at = scale_offset(t);
                assert_eq!(&scales[..2], &bytes[at..at + 2]);
            }
        }
        assert!(split(BlockType::Q8_0, &[0; 35]).is_err());
        assert!(join(BlockType::Q8_0, &[0; 32], &[0; 4]).is_err());
    }

    /// On the CPU a block weight is the reference itself: products equal the dequantized weight's.
    #[test]
    fn cpu_products_and_stacking() {
        let dev = Device::Cpu;
        for t in BlockType::ALL {
            let w = Tensor::from_vec(values(6 * 256, 5), (6, 256), &dev).expect("w");
            let q = BlockWeight::quantize(t, &w).expect("quantize");
            let bytes = quantize::quantize(t, &values(6 * 256, 5), 256).expect("reference");
            assert_eq!(q.to_ggml().expect("bytes"), bytes, "{t:?}");
            let d = q.dequantize(DType::F32).expect("dequantize");
            let x = Tensor::from_vec(values(3 * 256, 9), (3, 256), &dev).expect("x");
            let want = x.matmul(&d.t().expect("t")).expect("ref");
            let got = q.linear(&x).expect("linear");
            let diff = (got - &want)
                .and_then(|e| e.abs())
                .and_then(|e| e.max_all())
                .and_then(|e| e.to_scalar::<f32>())
                .expect("diff");
            assert!(diff < 1e-4, "{t:?}: {diff}");
            let two = BlockWeight::stack(&[q.clone(), q.clone()])
                .expect("stack")
                .expect("same format");
            assert_eq!(two.shape(), (12, 256));
            assert_eq!(
                two.to_ggml().expect("bytes"),
                [bytes.clone(), bytes].concat()
            );
        }
        let w = Tensor::zeros((2, 100), DType::F32, &dev).expect("w");
        assert!(BlockWeight::quantize(BlockType::Q8_0, &w).is_err());
    }
}
