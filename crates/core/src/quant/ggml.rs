//! A linear weight in a GGML block format (`q8_0`, `q4_0`, `q5_0`, `q4k`, `q6k`, and the other
//! types a GGUF file may hold), `[out, in]` row-major with each row cut into blocks.
//!
//! - On a GPU the five formats rserve writes are `rserve_kernels::ggml` block weights: quantized
//!   on the GPU, streamed by rserve's kernels for decode batches (16-bit activations, the weight
//!   unpacked in registers) and dequantized to the activations' type for larger batches.
//! - On the CPU they are held in `rserve_kernels::cpu_quant`'s layout (rows in groups of eight,
//!   interleaved) and run its kernels (hand-written AVX2 chosen at run time), which quantize the
//!   activations to 8 bits per block, as ggml does, and take integer dot products with the
//!   packed weights.
//! - Other GGUF types run candle's quantized matmul.
//!
//! The reference is the dequantized weight in f32 (tests).

use crate::batch::LayerCtx;
use crate::models::layers::linear::LinearMethod;
use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Module, Result, Tensor};
use rserve_kernels::cpu_quant::X8Weight;
use rserve_kernels::ggml::BlockWeight;
use rserve_kernels::quantize::{self, BlockType};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A weight stored in GGML blocks.
#[derive(Debug, Clone)]
pub struct GgmlLinear {
    weight: Packed,
    /// `(out, in)`.
    shape: (usize, usize),
}

/// Where the blocks live and which kernels read them.
#[derive(Debug, Clone)]
enum Packed {
    /// candle's tensor in ggml's bytes: the GGUF types rserve's kernels do not take.
    Candle(Arc<QTensor>),
    /// rserve's CPU layout (rows in groups of eight, interleaved).
    Cpu(Arc<X8Weight>),
    /// rserve's GPU layout.
    Blocks(BlockWeight),
}

/// Every product on the CPU multiplies the dequantized weight in f32 when set: the reference
/// the fast kernels (which quantize the activations) are compared with in tests and quality
/// reports.
static REFERENCE_PRODUCTS: AtomicBool = AtomicBool::new(false);

/// Sets [`REFERENCE_PRODUCTS`] for the whole process.
pub fn set_reference_products(on: bool) {
    REFERENCE_PRODUCTS.store(on, Ordering::Relaxed);
}

/// From this many rows on (prefill), the GGUF types without rserve's kernels are dequantized for
/// an f32 matrix product on the CPU. rserve's formats take integer block products at every row
/// count: four activation rows share each unpacked weight vector, and 8-bit products carry four
/// times the multiply-adds of f32 ones per instruction (3-5x the f32 route's rate over 128 rows,
/// `cargo run -p rserve-kernels --example cpu_quant_bench`).
const DEQUANTIZE_FROM_ROWS: usize = 32;

/// The block types rserve's quantizers write.
pub fn block_type(t: GgmlDType) -> Option<BlockType> {
    Some(match t {
        GgmlDType::Q8_0 => BlockType::Q8_0,
        GgmlDType::Q4_0 => BlockType::Q4_0,
        GgmlDType::Q5_0 => BlockType::Q5_0,
        GgmlDType::Q4K => BlockType::Q4K,
        GgmlDType::Q6K => BlockType::Q6K,
        _ => return None,
    })
}

/// The GGML type of a block format.
fn ggml_type(t: BlockType) -> GgmlDType {
    match t {
        BlockType::Q8_0 => GgmlDType::Q8_0,
        BlockType::Q4_0 => GgmlDType::Q4_0,
        BlockType::Q5_0 => GgmlDType::Q5_0,
        BlockType::Q4K => GgmlDType::Q4K,
        BlockType::Q6K => GgmlDType::Q6K,
    }
}

impl GgmlLinear {
    /// Quantizes `weight` `[out, in]` to `dtype` with llama.cpp's reference quantizers (the same
    /// bytes llama.cpp writes) where it lives: on a GPU with rserve's kernels, else on the CPU
    /// (`in` must be a multiple of the block size).
    pub fn quantize(weight: &Tensor, dtype: GgmlDType) -> Result<Self> {
        let (out, inp) = weight.dims2()?;
        let Some(t) = block_type(dtype) else {
            candle_core::bail!("rserve does not quantize to {dtype:?}");
        };
        if weight.device().is_cuda() {
            return Ok(Self {
                weight: Packed::Blocks(BlockWeight::quantize(t, weight)?),
                shape: (out, inp),
            });
        }
        let x = weight
            .to_dtype(DType::F32)?
            .to_device(&candle_core::Device::Cpu)?;
        // the values where they lie when contiguous (a loaded weight), else a copy
        let (storage, layout) = x.storage_and_layout();
        let bytes = match (&*storage, layout.contiguous_offsets()) {
            (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)), Some((a, b))) => {
                quantize::quantize(t, &v[a..b], inp)
            }
            _ => quantize::quantize(t, &x.flatten_all()?.to_vec1::<f32>()?, inp),
        }
        .map_err(candle_core::Error::msg)?;
        Self::from_bytes(dtype, &bytes, (out, inp), weight.device())
    }

    /// A weight from its packed GGML bytes (as stored in a GGUF file), `[out, in]`.
    pub fn from_bytes(
        dtype: GgmlDType,
        bytes: &[u8],
        (out, inp): (usize, usize),
        device: &candle_core::Device,
    ) -> Result<Self> {
        let weight = match block_type(dtype) {
            Some(t) if device.is_cuda() => {
                Packed::Blocks(BlockWeight::from_ggml(t, bytes, (out, inp), device)?)
            }
            Some(t) if device.is_cpu() => Packed::Cpu(Arc::new(
                X8Weight::from_ggml(t, bytes, out, inp).map_err(candle_core::Error::msg)?,
            )),
            _ => Packed::Candle(Arc::new(qtensor_from_ggml(
                dtype,
                bytes,
                vec![out, inp],
                device,
            )?)),
        };
        Ok(Self {
            weight,
            shape: (out, inp),
        })
    }

    /// Weights stored in the same GGML type and input width as one, their rows stacked in order
    /// (a fused projection): each part is ggml's bytes of whole rows of `inp` values.
    pub fn from_parts(
        dtype: GgmlDType,
        parts: &[&[u8]],
        inp: usize,
        device: &candle_core::Device,
    ) -> Result<Self> {
        let rb = dtype.type_size() * inp / dtype.block_size();
        let rows = if rb == 0 {
            0
        } else {
            parts.iter().map(|p| p.len() / rb).sum()
        };
        match block_type(dtype) {
            Some(t) if device.is_cpu() => Ok(Self {
                weight: Packed::Cpu(Arc::new(
                    X8Weight::from_ggml_parts(t, parts, inp).map_err(candle_core::Error::msg)?,
                )),
                shape: (rows, inp),
            }),
            _ => Self::from_bytes(dtype, &parts.concat(), (rows, inp), device),
        }
    }

    /// The GGML type of the blocks.
    pub fn dtype(&self) -> GgmlDType {
        match &self.weight {
            Packed::Candle(q) => q.dtype(),
            Packed::Cpu(w) => ggml_type(w.format()),
            Packed::Blocks(b) => ggml_type(b.block_type()),
        }
    }

    /// Bytes of the packed weight.
    pub fn size_in_bytes(&self) -> usize {
        match &self.weight {
            Packed::Candle(q) => q.storage_size_in_bytes(),
            Packed::Cpu(w) => w.size_in_bytes(),
            Packed::Blocks(b) => b.size_in_bytes(),
        }
    }

    /// The weight dequantized to f32 by candle, `[out, in]` (the reference the products are
    /// tested against).
    pub fn dequantize(&self) -> Result<Tensor> {
        match &self.weight {
            Packed::Candle(q) => q.dequantize(&q.device()),
            Packed::Cpu(w) => {
                Tensor::from_vec(w.dequantize(), w.shape(), &candle_core::Device::Cpu)
            }
            Packed::Blocks(b) => b.dequantize(DType::F32),
        }
    }

    /// `x W^T` on the CPU with rserve's layout, `x` `[m, in]` f32: integer block products (the
    /// dequantized weight in f32 for the reference).
    fn cpu_matmul(w: &X8Weight, x: &Tensor) -> Result<Tensor> {
        let (m, _) = x.dims2()?;
        if REFERENCE_PRODUCTS.load(Ordering::Relaxed) {
            let wf = Tensor::from_vec(w.dequantize(), w.shape(), x.device())?;
            return rserve_kernels::linear_rows(x, &wf);
        }
        let xs = x.flatten_all()?.to_vec1::<f32>()?;
        let y = w.matmul(&xs, m).map_err(candle_core::Error::msg)?;
        Tensor::from_vec(y, (m, w.shape().0), x.device())
    }
}

impl LinearMethod for GgmlLinear {
    fn matmul(&self, x: &Tensor, _ctx: &LayerCtx<'_>) -> Result<Tensor> {
        let y = match &self.weight {
            Packed::Blocks(b) => return b.linear(x),
            Packed::Cpu(w) => Self::cpu_matmul(w, &x.to_dtype(DType::F32)?)?,
            Packed::Candle(q) => {
                let xf = x.to_dtype(DType::F32)?;
                let rows = xf.dims2()?.0;
                let dense =
                    rows >= DEQUANTIZE_FROM_ROWS || REFERENCE_PRODUCTS.load(Ordering::Relaxed);
                if x.device().is_cpu() && dense {
                    let wf = self.dequantize()?;
                    rserve_kernels::linear_rows(&xf, &wf)?
                } else {
                    QMatMul::QTensor(q.clone()).forward(&xf)?
                }
            }
        };
        y.to_dtype(x.dtype())
    }

    fn matmul_silu_glu(&self, x: &Tensor, ctx: &LayerCtx<'_>) -> Result<Tensor> {
        match &self.weight {
            Packed::Blocks(b) => b.silu_glu(x),
            Packed::Candle(_) | Packed::Cpu(_) => {
                rserve_kernels::silu_and_mul(&self.matmul(x, ctx)?)
            }
        }
    }

    fn shape(&self) -> (usize, usize) {
        self.shape
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn random(rows: usize, cols: usize, seed: u64) -> Tensor {
        let mut s = seed;
        let v: Vec<f32> = (0..rows * cols)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect();
        Tensor::from_vec(v, (rows, cols), &Device::Cpu).expect("tensor")
    }

    fn max_abs(t: &Tensor) -> f32 {
        t.abs()
            .and_then(|a| a.flatten_all())
            .and_then(|a| a.max(0))
            .and_then(|m| m.to_scalar::<f32>())
            .expect("max")
    }

    /// The block products of every row count a decode or short prefill uses, on the shapes of
    /// the tiny GGUF fixtures (vocabulary rows, narrow k/v projections).
    #[test]
    fn products_for_every_row_count_and_shape() {
        let ctx = LayerCtx::default();
        for (n, k) in [(128, 256), (1000, 256), (256, 512)] {
            let w = random(n, k, 7);
            for t in [
                GgmlDType::Q4K,
                GgmlDType::Q6K,
                GgmlDType::Q8_0,
                GgmlDType::Q4_0,
            ] {
                let q = GgmlLinear::quantize(&w, t).expect("quantize");
                let d = q.dequantize().expect("dequantize");
                for m in [1, 2, 5, 8, 13, 31] {
                    let x = random(m, k, 100 + m as u64);
                    let got = q.matmul(&x, &ctx).expect("matmul");
                    let want = x.matmul(&d.t().expect("t")).expect("reference");
                    let rel = max_abs(&(&got - &want).expect("diff")) / max_abs(&want);
                    assert!(rel < 0.02, "{t:?} {n}x{k}, {m} rows: {rel}");
                }
            }
        }
    }

    /// Round trips stay within each format's step; products match the dequantized reference.
    #[test]
    fn formats_round_trip_and_multiply_like_their_dequantized_weight() {
        let w = random(64, 512, 7);
        let x = random(5, 512, 11);
        let x_long = random(40, 512, 13);
        let ctx = LayerCtx::default();
        // values in [-1, 1]: the quantization step of each format bounds the error
        for (t, bound) in [
            (GgmlDType::Q8_0, 1.0 / 127.0),
            (GgmlDType::Q6K, 2.0 / 31.0),
            (GgmlDType::Q5_0, 1.0 / 15.0),
            (GgmlDType::Q4K, 2.0 / 15.0),
            (GgmlDType::Q4_0, 1.0 / 7.0),
        ] {
            let q = GgmlLinear::quantize(&w, t).expect("quantize");
            assert_eq!(q.shape(), (64, 512));
            let d = q.dequantize().expect("dequantize");
            let err = max_abs(&(&d - &w).expect("diff"));
            assert!(err <= bound, "{t:?}: round-trip error {err} > {bound}");
            let got = q.matmul(&x, &ctx).expect("matmul");
            let want = x.matmul(&d.t().expect("t")).expect("reference");
            let rel = max_abs(&(&got - &want).expect("diff")) / max_abs(&want);
            // activations are quantized to 8 bits per block on the CPU
            assert!(
                rel < 0.02,
                "{t:?}: product error {rel} relative to the largest output"
            );
            // many rows (prefill): the same integer products
            let got = q.matmul(&x_long, &ctx).expect("matmul");
            let want = x_long.matmul(&d.t().expect("t")).expect("reference");
            let rel = max_abs(&(&got - &want).expect("diff")) / max_abs(&want);
            assert!(rel < 0.02, "{t:?}: {rel} over 40 rows");
            // the reference route multiplies the dequantized weight in f32
            set_reference_products(true);
            let got = q.matmul(&x_long, &ctx).expect("matmul");
            set_reference_products(false);
            let rel = max_abs(&(&got - &want).expect("diff")) / max_abs(&want);
            assert!(rel < 1e-5, "{t:?}: reference products {rel}");
            assert!(q.size_in_bytes() < 64 * 512 * 4 / 3, "{t:?} is not smaller");
        }
    }
}
