//! GGML block weights on the GPU against the CPU references: the GPU quantizers write the bytes
//! of llama.cpp's reference quantizers (`rserve_kernels::quantize`, itself checked against
//! llama.cpp's goldens), the dequantizer matches ggml's dequantization, and the products match
//! an f32 product with the dequantized weight for every row count and both 16-bit types (up to
//! 8 rows of x, x rounded to 8 bits per block of 32 first, as the streaming products take it).
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used)]

use candle_core::{DType, Device, Result, Tensor};
use rserve_kernels::ggml::{BlockWeight, GEMV_MAX_ROWS};
use rserve_kernels::quantize::{self, BlockType};

/// Values with a spread of magnitudes per block, some blocks of zeros and some constant, the
/// cases the quantizers' branches turn on.
fn weights(n: usize, k: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    let mut next = move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    (0..n * k)
        .map(|i| {
            let block = i / 32;
            match block % 23 {
                5 => 0.0,
                11 => 0.25,
                17 => next().abs() * 1e-3,
                _ => next() * (1.0 + (block % 5) as f32) * 0.1,
            }
        })
        .collect()
}

fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .and_then(|a| a.flatten_all())
        .and_then(|a| a.max(0))
        .and_then(|m| m.to_scalar::<f32>())
        .unwrap()
}

/// `x` `[m, k]` rounded as the streaming products take it: per block of 32, levels
/// round-to-nearest-even of x * 127 / max |x| (the product exact), times max |x| / 127.
fn q8_rounded(x: &Tensor) -> Result<Tensor> {
    let mut v = x.flatten_all()?.to_vec1::<f32>()?;
    for b in v.chunks_mut(32) {
        let amax = b.iter().fold(0f32, |a, &e| a.max(e.abs()));
        let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let d = amax / 127.0;
        for e in b.iter_mut() {
            *e = (f64::from(*e) * f64::from(id)).round_ties_even() as f32 * d;
        }
    }
    Tensor::from_vec(v, x.dims2()?, x.device())
}

mod cuda {
    use super::*;

    fn gpu() -> Device {
        Device::new_cuda(0).expect("a CUDA device")
    }

    /// The GPU quantizers' bytes are the CPU's, from every input dtype.
    #[test]
    fn quantizers_write_the_reference_bits() -> Result<()> {
        let dev = gpu();
        for (n, k) in [(3, 256), (37, 512), (64, 4096)] {
            let w = Tensor::from_vec(weights(n, k, 7), (n, k), &Device::Cpu)?;
            for t in BlockType::ALL {
                for dtype in [DType::BF16, DType::F16, DType::F32] {
                    // the values the dtype holds
                    let w = w.to_dtype(dtype)?;
                    let values = w.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                    let want = quantize::quantize(t, &values, k).unwrap();
                    let q = BlockWeight::quantize(t, &w.to_device(&dev)?)?;
                    let got = q.to_ggml()?;
                    let first = got.iter().zip(&want).position(|(a, b)| a != b);
                    assert_eq!(
                        first,
                        None,
                        "{t:?} from {dtype:?} [{n}, {k}]: first differing byte (block {})",
                        first.map_or(0, |i| i / t.block_bytes())
                    );
                    assert_eq!(got.len(), want.len());
                }
            }
        }
        Ok(())
    }

    /// The dequantizer matches ggml's dequantization (f32 math both sides; the weight's own
    /// rounding only in 16-bit outputs).
    #[test]
    fn dequantize_matches_the_reference() -> Result<()> {
        let dev = gpu();
        // 19 rows of 1,024: the last tile of 128 chunks is partial in every format
        let (n, k) = (19, 1024);
        let values = weights(n, k, 3);
        for t in BlockType::ALL {
            let bytes = quantize::quantize(t, &values, k).unwrap();
            let want = Tensor::from_vec(quantize::dequantize(t, &bytes), (n, k), &Device::Cpu)?;
            let q = BlockWeight::from_ggml(t, &bytes, (n, k), &dev)?;
            assert_eq!(q.to_ggml()?, bytes, "{t:?}: the device layout round trip");
            for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 8e-3), (DType::F16, 1e-3)] {
                let [tiled, direct] = [true, false].map(|tiled| {
                    q.dequantize_with(dtype, tiled)
                        .and_then(|w| w.to_dtype(DType::F32)?.to_device(&Device::Cpu))
                });
                let (tiled, direct) = (tiled?, direct?);
                let err = max_abs(&(&tiled - &want)?) / max_abs(&want);
                assert!(err <= tol, "{t:?} to {dtype:?}: {err}");
                // the two kernels write the same values (the tiled one through shared memory)
                assert_eq!(max_abs(&(&tiled - &direct)?), 0.0, "{t:?} to {dtype:?}");
            }
        }
        Ok(())
    }

    /// `x W^T` (and the gate-up form) against the f32 product with the dequantized weight.
    #[test]
    fn products_match_the_dequantized_weight() -> Result<()> {
        let dev = gpu();
        let cpu = Device::Cpu;
        for t in BlockType::ALL {
            for (n, k) in [(1, 256), (37, 512), (130, 4096), (64, 14336)] {
                let bytes = quantize::quantize(t, &weights(n, k, 11), k).unwrap();
                let wf = Tensor::from_vec(quantize::dequantize(t, &bytes), (n, k), &cpu)?;
                let q = BlockWeight::from_ggml(t, &bytes, (n, k), &dev)?;
                for dtype in [DType::BF16, DType::F16] {
                    for m in [1, 2, 3, 4, 5, 8, GEMV_MAX_ROWS + 1, 33] {
                        let x = Tensor::randn(0f32, 1., (m, k), &cpu)?.to_dtype(dtype)?;
                        let xf = x.to_dtype(DType::F32)?;
                        // the streaming products take x quantized to int8 per block of 32, as
                        // ggml's q8_0 does it; the dense path takes x as it is
                        let xf = if m <= GEMV_MAX_ROWS {
                            q8_rounded(&xf)?
                        } else {
                            xf
                        };
                        let want = xf.matmul(&wf.t()?)?;
                        let got = q.linear(&x.to_device(&dev)?)?;
                        assert_eq!(got.dims(), &[m, n]);
                        let got = got.to_dtype(DType::F32)?.to_device(&cpu)?;
                        let err = max_abs(&(&got - &want)?) / max_abs(&want).max(1e-3);
                        let tol = if dtype == DType::BF16 { 1e-2 } else { 2e-3 };
                        assert!(err <= tol, "{t:?} [{n}, {k}] {dtype:?} m {m}: {err}");
                        if n % 2 == 0 {
                            let want = rserve_kernels::silu_and_mul(&want)?;
                            let got = q.silu_glu(&x.to_device(&dev)?)?;
                            assert_eq!(got.dims(), &[m, n / 2]);
                            let got = got.to_dtype(DType::F32)?.to_device(&cpu)?;
                            let err = max_abs(&(&got - &want)?) / max_abs(&want).max(1e-3);
                            assert!(
                                err <= 2.0 * tol,
                                "{t:?} GLU [{n}, {k}] {dtype:?} m {m}: {err}"
                            );
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Stacked weights (fused q/k/v, gate/up) are the parts' rows in order.
    #[test]
    fn stacking_keeps_the_rows() -> Result<()> {
        let dev = gpu();
        for t in BlockType::ALL {
            let a = quantize::quantize(t, &weights(3, 512, 1), 512).unwrap();
            let b = quantize::quantize(t, &weights(5, 512, 2), 512).unwrap();
            let qa = BlockWeight::from_ggml(t, &a, (3, 512), &dev)?;
            let qb = BlockWeight::from_ggml(t, &b, (5, 512), &dev)?;
            let s = BlockWeight::stack(&[qa, qb])?.unwrap();
            assert_eq!(s.shape(), (8, 512));
            assert_eq!(s.to_ggml()?, [a, b].concat(), "{t:?}");
        }
        Ok(())
    }
}
