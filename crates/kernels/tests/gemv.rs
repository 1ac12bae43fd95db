//! The decode-batch matrix product against f32 matmul on the CPU: every row count the streaming
//! kernel takes (and one past it), odd output widths, short and long rows, both 16-bit types.
#![allow(clippy::unwrap_used)]

use candle_core::{DType, Device, Result, Tensor};
use rserve_kernels::gemv::{kernel_applies, linear_rows, silu_glu_rows, GEMV_MAX_ROWS};
use rserve_kernels::silu_and_mul;

/// Random `x` `[m, k]` and `w` `[rows, k]` in `dtype`, `op` on `dev` against `reference` in f32 on
/// the CPU: the output shape, and the largest error within `rel` (per dtype: bf16, f16) of the
/// largest output magnitude.
fn compare(
    dev: &Device,
    dtype: DType,
    (m, rows, k): (usize, usize, usize),
    op: fn(&Tensor, &Tensor) -> Result<Tensor>,
    reference: fn(&Tensor) -> Result<Tensor>,
    out: usize,
    rel: (f32, f32),
) -> Result<()> {
    let cpu = Device::Cpu;
    let x = Tensor::randn(0f32, 1., (m, k), &cpu)?.to_dtype(dtype)?;
    let w = (Tensor::randn(0f32, 1., (rows, k), &cpu)? * 0.05)?.to_dtype(dtype)?;
    let want = reference(
        &x.to_dtype(DType::F32)?
            .matmul(&w.to_dtype(DType::F32)?.t()?)?,
    )?;
    let got = op(&x.to_device(dev)?, &w.to_device(dev)?)?;
    assert_eq!(got.dims(), &[m, out]);
    let got = got.to_device(&cpu)?.to_dtype(DType::F32)?;
    let scale = want
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?
        .max(1.0);
    let err = (got - &want)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?;
    let tol = if dtype == DType::BF16 { rel.0 } else { rel.1 } * scale;
    assert!(
        err <= tol,
        "{dtype:?} m {m} rows {rows} k {k}: max abs error {err} (tol {tol})"
    );
    Ok(())
}

/// The product: one rounding of the output plus f32 accumulation order.
fn check(dev: &Device, dtype: DType, m: usize, n: usize, k: usize) -> Result<()> {
    compare(
        dev,
        dtype,
        (m, n, k),
        linear_rows,
        |y| Ok(y.clone()),
        n,
        (1e-2, 2e-3),
    )
}

/// The gate-up form against SiLU-and-multiply of the f32 product: the product is rounded to the
/// dtype before the SiLU, then the output.
fn check_glu(dev: &Device, dtype: DType, m: usize, inter: usize, k: usize) -> Result<()> {
    compare(
        dev,
        dtype,
        (m, 2 * inter, k),
        silu_glu_rows,
        silu_and_mul,
        inter,
        (2e-2, 4e-3),
    )
}

#[test]
fn cpu_glu_is_silu_of_the_product() -> Result<()> {
    check_glu(&Device::Cpu, DType::F32, 2, 5, 16)
}

#[test]
fn cpu_is_plain_matmul() -> Result<()> {
    check(&Device::Cpu, DType::BF16, 3, 17, 64)
}

#[test]
fn the_kernel_takes_decode_batches_only() -> Result<()> {
    let w = Tensor::zeros((4, 16), DType::BF16, &Device::Cpu)?;
    let x = Tensor::zeros((1, 16), DType::BF16, &Device::Cpu)?;
    assert!(!kernel_applies(&x, &w), "not on the CPU");
    assert_eq!(GEMV_MAX_ROWS, 4);
    Ok(())
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;

    #[test]
    fn cuda_matches_matmul() -> Result<()> {
        let dev = Device::new_cuda(0).expect("a CUDA device");
        for dtype in [DType::BF16, DType::F16] {
            for m in 1..=GEMV_MAX_ROWS + 1 {
                for (n, k) in [(1, 8), (33, 264), (4097, 4096), (130, 14336)] {
                    check(&dev, dtype, m, n, k)?;
                }
            }
        }
        // a row width that is not a multiple of 8 falls back to matmul
        check(&dev, DType::BF16, 2, 5, 12)
    }

    #[test]
    fn cuda_glu_matches_silu_of_the_product() -> Result<()> {
        let dev = Device::new_cuda(0).expect("a CUDA device");
        for dtype in [DType::BF16, DType::F16] {
            for m in 1..=GEMV_MAX_ROWS + 1 {
                for (inter, k) in [(1, 8), (3, 64), (33, 264), (2050, 4096), (70, 14336)] {
                    check_glu(&dev, dtype, m, inter, k)?;
                }
            }
        }
        Ok(())
    }
}
