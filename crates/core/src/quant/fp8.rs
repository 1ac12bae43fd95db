//! A linear weight in FP8 E4M3 with one f32 scale per output channel (`--isq fp8`). The weight is
//! quantized where it lives: on the GPU when serving on one (a kernel per tensor as the
//! checkpoint streams in), else on the CPU. The products are `rserve_kernels::fp8`'s: FP8 tensor
//! cores with per-token activation scales on GPUs that have them (compute capability 8.9+), the
//! weight converted in registers for decode batches, and the weight dequantized to the
//! activations' dtype elsewhere (the CPU and older GPUs: correct, but no faster than the 16-bit
//! model; `q8_0` is the CPU's fast 8-bit format).

use crate::batch::LayerCtx;
use crate::models::layers::linear::LinearMethod;
use candle_core::{Device, Result, Tensor};
use rserve_kernels::fp8;

/// An E4M3 weight `[out, in]` and its row scales `[out]`.
#[derive(Debug, Clone)]
pub struct Fp8Linear {
    q: Tensor,
    scale: Tensor,
}

impl Fp8Linear {
    /// Quantizes `weight` `[out, in]` on its device.
    pub fn quantize(weight: &Tensor) -> Result<Self> {
        let (q, scale) = fp8::quantize_rows(weight)?;
        Ok(Self { q, scale })
    }

    /// How products run on `device`, for the startup line.
    pub fn products(device: &Device) -> &'static str {
        if fp8::tensor_cores(device) {
            "FP8 tensor cores with per-token activation scales (weight-only FP8 kernels for decode batches of up to 4)"
        } else if device.is_cuda() {
            "this GPU has no FP8 tensor cores: weight-only FP8 kernels for decode batches, the weight dequantized to 16 bits for larger ones"
        } else {
            "on the CPU the weight is dequantized for each product (a reference path; q8_0 is the CPU's fast 8-bit format)"
        }
    }

    /// The E4M3 bytes `[out, in]` (u8) and the scales `[out]` (f32).
    pub fn parts(&self) -> (&Tensor, &Tensor) {
        (&self.q, &self.scale)
    }

    /// Bytes of the weight and its scales.
    pub fn size_in_bytes(&self) -> usize {
        self.q.elem_count() + 4 * self.scale.elem_count()
    }
}

impl LinearMethod for Fp8Linear {
    fn matmul(&self, x: &Tensor, _ctx: &LayerCtx<'_>) -> Result<Tensor> {
        fp8::linear(x, &self.q, &self.scale)
    }

    fn matmul_silu_glu(&self, x: &Tensor, _ctx: &LayerCtx<'_>) -> Result<Tensor> {
        fp8::silu_glu(x, &self.q, &self.scale)
    }

    fn takes_fp8_rows(&self, x: &Tensor) -> bool {
        fp8::takes_fp8_rows(x)
    }

    fn matmul_fp8_rows(
        &self,
        x: &Tensor,
        rows: &fp8::Fp8Rows,
        glu: bool,
        _ctx: &LayerCtx<'_>,
    ) -> Result<Tensor> {
        if glu {
            fp8::silu_glu_with_rows(x, Some(rows), &self.q, &self.scale)
        } else {
            fp8::linear_with_rows(x, Some(rows), &self.q, &self.scale)
        }
    }

    fn matmul_silu_glu_rows(
        &self,
        x: &Tensor,
        rows: Option<&fp8::Fp8Rows>,
        _ctx: &LayerCtx<'_>,
    ) -> Result<(Tensor, Option<fp8::Fp8Rows>)> {
        fp8::silu_glu_rows(x, rows, &self.q, &self.scale)
    }

    fn shape(&self) -> (usize, usize) {
        let d = self.q.dims();
        (
            d.first().copied().unwrap_or(0),
            d.get(1).copied().unwrap_or(0),
        )
    }
}
