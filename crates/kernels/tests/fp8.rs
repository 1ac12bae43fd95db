//! FP8 E4M3 weights: the quantizer against torch's `float8_e4m3fn` conversion (the bits, on
//! `tests/fixtures/quant/fp8_ref.json`, made by `tests/fixtures/make_fp8_ref.py`), the round trip
//! within E4M3's bound, and the products against the dequantized reference: on the CPU here, and
//! on the GPU (the same bits from the GPU quantizer, the decode kernel and the tensor-core product)
//! when built with `cuda`.
#![allow(clippy::unwrap_used)]

use candle_core::{DType, Device, Result, Tensor};
use rserve_kernels::fp8::{self, decode, encode, quantize_rows_ref};
use serde_json::Value;

fn golden() -> Value {
    let p = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/quant/fp8_ref.json"
    );
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|b| f32::from_bits(b.as_i64().unwrap() as i32 as u32))
        .collect()
}

fn bytes(v: &Value) -> Vec<u8> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_u64().unwrap() as u8)
        .collect()
}

#[test]
fn encode_writes_torchs_bits() {
    let g = golden();
    let (vals, want) = (f32s(&g["values"]), bytes(&g["bytes"]));
    assert_eq!(vals.len(), want.len());
    let mut wrong = Vec::new();
    for (v, w) in vals.iter().zip(&want) {
        if encode(v.clamp(-448.0, 448.0)) != *w {
            wrong.push((*v, encode(*v), *w));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {} differ, e.g. {:?}",
        wrong.len(),
        vals.len(),
        &wrong[..wrong.len().min(8)]
    );
}

#[test]
fn row_quantization_writes_torchs_bits_and_scales() {
    for set in golden()["rows"].as_array().unwrap() {
        let cols = set["cols"].as_u64().unwrap() as usize;
        let (q, s) = quantize_rows_ref(&f32s(&set["values"]), cols);
        assert_eq!(q, bytes(&set["bytes"]));
        assert_eq!(s, f32s(&set["scales"]));
    }
}

#[test]
fn every_code_round_trips_and_values_stay_within_the_bound() {
    for b in 0..=255u8 {
        let v = decode(b);
        if v.is_nan() {
            assert_eq!(b & 0x7f, 0x7f);
            continue;
        }
        assert_eq!(encode(v), b, "code {b:#04x} = {v}");
    }
    // three mantissa bits: at most half a step, 1/16 of the value, for normal values
    let mut x = 2f32.powi(-6);
    while x < 448.0 {
        for v in [x, -x * 1.013] {
            let err = (decode(encode(v)) - v).abs() / v.abs();
            assert!(err <= 1.0 / 16.0 + 1e-7, "{v}: relative error {err}");
        }
        x *= 1.0371;
    }
    assert_eq!(encode(1e9), 0x7e);
    assert_eq!(encode(-1e9), 0xfe);
    assert_eq!(encode(f32::NAN) & 0x7f, 0x7f);
    // rows of zeros get scale 1; tiny rows keep a normal scale
    let (q, s) = quantize_rows_ref(&[0.0; 8], 4);
    assert_eq!((q, s), (vec![0; 8], vec![1.0, 1.0]));
    let (_, s) = quantize_rows_ref(&[1e-42, 0.0], 2);
    assert!(s[0] >= f32::MIN_POSITIVE);
}

/// Random `x` `[m, k]` and a weight `[n, k]` quantized to E4M3 on `dev`.
fn operands(
    dev: &Device,
    dtype: DType,
    m: usize,
    n: usize,
    k: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let cpu = Device::Cpu;
    let x = Tensor::randn(0f32, 1., (m, k), &cpu)?
        .to_dtype(dtype)?
        .to_device(dev)?;
    let w = (Tensor::randn(0f32, 1., (n, k), &cpu)? * 0.05)?
        .to_dtype(dtype)?
        .to_device(dev)?;
    let (q, s) = fp8::quantize_rows(&w)?;
    Ok((x, q, s))
}

/// Largest error of `got` against `want` relative to `want`'s largest magnitude.
fn rel_err(got: &Tensor, want: &Tensor) -> Result<f32> {
    let cpu = Device::Cpu;
    let got = got.to_device(&cpu)?.to_dtype(DType::F32)?;
    let want = want.to_device(&cpu)?.to_dtype(DType::F32)?;
    let scale = want
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?
        .max(1e-6);
    let err = (got - want)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?;
    Ok(err / scale)
}

#[test]
fn cpu_norm_rows_are_the_norm_then_the_quantizer() -> Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::randn(0f32, 1., (3, 40), &dev)?;
    let r = Tensor::randn(0f32, 1., (3, 40), &dev)?;
    let w = Tensor::randn(0f32, 1., 40, &dev)?;
    let (sum, normed, f8) = fp8::add_rms_norm_rows(&x, &r, &w, 1e-6)?;
    let (want_sum, want_normed) = rserve_kernels::add_rms_norm(&x, &r, &w, 1e-6)?;
    assert_eq!(sum.to_vec2::<f32>()?, want_sum.to_vec2::<f32>()?);
    assert_eq!(normed.to_vec2::<f32>()?, want_normed.to_vec2::<f32>()?);
    let (q, s) = quantize_rows_ref(&want_normed.flatten_all()?.to_vec1()?, 40);
    assert_eq!(f8.q.flatten_all()?.to_vec1::<u8>()?, q);
    assert_eq!(f8.scale.to_vec1::<f32>()?, s);
    assert!(
        !fp8::takes_fp8_rows(&x),
        "no FP8 product on the CPU quantizes its input"
    );
    Ok(())
}

#[test]
fn cpu_products_are_the_dequantized_weights() -> Result<()> {
    let cpu = Device::Cpu;
    let (x, q, s) = operands(&cpu, DType::F32, 3, 24, 64)?;
    let w = fp8::dequantize_rows(&q, &s, DType::F32)?;
    let want = x.matmul(&w.t()?)?;
    assert!(rel_err(&fp8::linear(&x, &q, &s)?, &want)? < 1e-6);
    let glu = fp8::silu_glu(&x, &q, &s)?;
    let (g, u) = (want.narrow(1, 0, 12)?, want.narrow(1, 12, 12)?);
    assert!(rel_err(&glu, &(g.silu()? * u)?)? < 1e-6);
    // on the CPU the gate-up product makes no FP8 rows of its result
    let (same, rows) = fp8::silu_glu_rows(&x, None, &q, &s)?;
    assert!(rows.is_none());
    assert_eq!(
        same.flatten_all()?.to_vec1::<f32>()?,
        glu.flatten_all()?.to_vec1::<f32>()?
    );
    // the dequantized weight is within E4M3's bound of the original
    let w0 = (Tensor::randn(0f32, 1., (5, 32), &cpu)? * 3.0)?;
    let (q, s) = fp8::quantize_rows(&w0)?;
    let back = fp8::dequantize_rows(&q, &s, DType::F32)?;
    let amax = w0.abs()?.max(1)?;
    let err = (back - &w0)?.abs()?.max(1)?;
    for (e, a) in err.to_vec1::<f32>()?.iter().zip(amax.to_vec1::<f32>()?) {
        assert!(*e <= a / 16.0, "{e} vs row amax {a}");
    }
    // a mismatched weight is an error, not a panic
    assert!(fp8::linear(&x, &q, &s).is_err());
    Ok(())
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use std::sync::{Mutex, MutexGuard};

    fn gpu() -> Device {
        Device::new_cuda(0).expect("a CUDA device")
    }

    /// Held by the tests whose products depend on [`fp8::allow_tensor_cores`], which one of them
    /// turns off for a while.
    fn tensor_core_switch() -> MutexGuard<'static, ()> {
        static LOCK: Mutex<()> = Mutex::new(());
        LOCK.lock().unwrap_or_else(|e| e.into_inner())
    }

    #[test]
    fn gpu_quantizer_writes_the_references_bits() -> Result<()> {
        let dev = gpu();
        // rows held in registers (up to 8,192 16-bit values), and rows read twice: odd or long
        for k in [4096, 24, 1001, 12288] {
            for dtype in [DType::BF16, DType::F16, DType::F32] {
                let w = (Tensor::randn(0f32, 1., (37, k), &Device::Cpu)? * 0.3)?.to_dtype(dtype)?;
                let (q, s) = fp8::quantize_rows(&w.to_device(&dev)?)?;
                let (rq, rs) =
                    quantize_rows_ref(&w.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?, k);
                assert_eq!(q.flatten_all()?.to_vec1::<u8>()?, rq, "{dtype:?} k {k}");
                assert_eq!(s.to_vec1::<f32>()?, rs, "{dtype:?} k {k}");
            }
        }
        Ok(())
    }

    #[test]
    fn decode_kernel_matches_the_reference() -> Result<()> {
        let dev = gpu();
        for dtype in [DType::BF16, DType::F16] {
            for m in 1..=4 {
                // 14,336: the 8B shape's down projection
                for (n, k) in [(24, 64), (37, 4096), (1032, 1024), (48, 14336)] {
                    let (x, q, s) = operands(&dev, dtype, m, n, k)?;
                    let want = fp8::reference_linear(&x.to_dtype(DType::F32)?, &q, &s)?;
                    let e = rel_err(&fp8::linear(&x, &q, &s)?, &want)?;
                    assert!(e < 1e-2, "{dtype:?} m {m} n {n} k {k}: {e}");
                    if n % 2 == 0 {
                        let h = n / 2;
                        let (g, u) = (want.narrow(1, 0, h)?, want.narrow(1, h, h)?);
                        let e = rel_err(&fp8::silu_glu(&x, &q, &s)?, &(g.silu()? * u)?)?;
                        assert!(e < 2e-2, "glu {dtype:?} m {m} n {n} k {k}: {e}");
                    }
                }
            }
        }
        Ok(())
    }

    /// The norm that hands its rows to an FP8 product in FP8 form: the sum and norm of
    /// `add_rms_norm`, and the bits `quantize_rows` gives for that norm, row lengths with and
    /// without whole vectors; the products over them equal the ones that quantize themselves.
    #[test]
    fn the_norms_fp8_rows_are_the_quantizers_bits() -> Result<()> {
        let _switch = tensor_core_switch();
        let dev = gpu();
        for dtype in [DType::BF16, DType::F16] {
            for (rows, h) in [(300, 4096), (7, 1000), (64, 2048), (5, 8192)] {
                let x = (Tensor::randn(0f32, 1., (rows, h), &dev)? * 3.0)?.to_dtype(dtype)?;
                let r = Tensor::randn(0f32, 1., (rows, h), &dev)?.to_dtype(dtype)?;
                let w = (Tensor::randn(0f32, 1., h, &dev)? + 1.0)?.to_dtype(dtype)?;
                let (sum, normed, f8) = fp8::add_rms_norm_rows(&x, &r, &w, 1e-5)?;
                let (want_sum, want_normed) = rserve_kernels::add_rms_norm(&x, &r, &w, 1e-5)?;
                let bits = |t: &Tensor| -> Result<Vec<f32>> {
                    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
                };
                assert_eq!(bits(&sum)?, bits(&want_sum)?, "{dtype:?} {rows}x{h} sum");
                assert_eq!(
                    bits(&normed)?,
                    bits(&want_normed)?,
                    "{dtype:?} {rows}x{h} norm"
                );
                let (q, s) = fp8::quantize_rows(&want_normed)?;
                assert_eq!(
                    f8.q.flatten_all()?.to_vec1::<u8>()?,
                    q.flatten_all()?.to_vec1::<u8>()?,
                    "{dtype:?} {rows}x{h} bytes"
                );
                assert_eq!(
                    f8.scale.to_vec1::<f32>()?,
                    s.to_vec1::<f32>()?,
                    "{dtype:?} scales"
                );
                if h % 16 == 0 {
                    let (_, wq, ws) = operands(&dev, dtype, rows, 64, h)?;
                    let a = fp8::linear_with_rows(&normed, Some(&f8), &wq, &ws)?;
                    let b = fp8::linear(&normed, &wq, &ws)?;
                    assert_eq!(bits(&a)?, bits(&b)?, "{dtype:?} {rows}x{h} product");
                }
            }
        }
        Ok(())
    }

    /// The gate-up product's fused end: the activations are the bits of the product, then
    /// `silu_and_mul`, and their FP8 rows the bits `quantize_rows` gives for them, with the
    /// input's rows handed over or not, widths whose last pass is whole or partial; at decode
    /// sizes (the streaming kernel) no rows are made.
    #[test]
    fn the_gate_ups_fp8_rows_are_the_quantizers_bits() -> Result<()> {
        let _switch = tensor_core_switch();
        let dev = gpu();
        let bits = |t: &Tensor| -> Result<Vec<f32>> {
            t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
        };
        for dtype in [DType::BF16, DType::F16] {
            for (m, inter, k) in [(64, 1024, 512), (300, 2056, 256), (9, 7168, 1024)] {
                let (x, q, s) = operands(&dev, dtype, m, 2 * inter, k)?;
                let x = (x * 4.0)?;
                let want = fp8::silu_glu(&x, &q, &s)?;
                let (wq, ws) = fp8::quantize_rows(&want)?;
                let (xq, xs) = fp8::quantize_rows(&x)?;
                let given = fp8::Fp8Rows { q: xq, scale: xs };
                for rows in [None, Some(&given)] {
                    let (a, f8) = fp8::silu_glu_rows(&x, rows, &q, &s)?;
                    let what = format!("{dtype:?} {m}x{inter}x{k} given {}", rows.is_some());
                    assert_eq!(bits(&a)?, bits(&want)?, "{what}: activations");
                    let f8 = f8.expect("a tensor-core gate-up makes the rows");
                    assert_eq!(
                        f8.q.flatten_all()?.to_vec1::<u8>()?,
                        wq.flatten_all()?.to_vec1::<u8>()?,
                        "{what}: bytes"
                    );
                    assert_eq!(f8.scale.to_vec1::<f32>()?, ws.to_vec1::<f32>()?, "{what}");
                }
            }
            let (x, q, s) = operands(&dev, dtype, 3, 512, 256)?;
            let (a, f8) = fp8::silu_glu_rows(&x, None, &q, &s)?;
            assert!(f8.is_none(), "decode rows take the streaming kernel");
            assert_eq!(bits(&a)?, bits(&fp8::silu_glu(&x, &q, &s)?)?);
        }
        Ok(())
    }

    #[test]
    fn tensor_core_products_match_the_reference() -> Result<()> {
        let _switch = tensor_core_switch();
        let dev = gpu();
        assert!(fp8::tensor_cores(&dev), "the test GPU has FP8 tensor cores");
        for dtype in [DType::BF16, DType::F16] {
            for m in [5, 17, 64, 300] {
                for (n, k) in [(32, 64), (1024, 4096), (4096, 1024)] {
                    let (x, q, s) = operands(&dev, dtype, m, n, k)?;
                    let got = fp8::linear(&x, &q, &s)?;
                    // the same product with the activations quantized per token, in f32
                    let (xq, xs) = fp8::quantize_rows(&x)?;
                    let xd = fp8::dequantize_rows(&xq, &xs, DType::F32)?;
                    let want = fp8::reference_linear(&xd, &q, &s)?;
                    let e = rel_err(&got, &want)?;
                    assert!(e < 1e-2, "{dtype:?} m {m} n {n} k {k}: {e}");
                    // and against the unquantized activations, within E4M3's error
                    let exact = fp8::reference_linear(&x.to_dtype(DType::F32)?, &q, &s)?;
                    let e = rel_err(&got, &exact)?;
                    assert!(
                        e < 0.08,
                        "{dtype:?} m {m} n {n} k {k} vs 16-bit activations: {e}"
                    );
                }
            }
        }
        Ok(())
    }

    /// A GPU without FP8 tensor cores (simulated by turning them off): rows past the decode
    /// kernel's take the dequantized weight through a 16-bit product, as the reference does, and
    /// the norm's FP8 rows are not asked for.
    #[test]
    fn without_tensor_cores_larger_products_are_the_dequantized_weights() -> Result<()> {
        struct Restore;
        impl Drop for Restore {
            fn drop(&mut self) {
                fp8::allow_tensor_cores(true);
            }
        }
        let _switch = tensor_core_switch();
        let dev = gpu();
        fp8::allow_tensor_cores(false);
        let _restore = Restore;
        assert!(!fp8::tensor_cores(&dev));
        for dtype in [DType::BF16, DType::F16] {
            for m in [1, 4, 5, 64, 300] {
                for (n, k) in [(32, 64), (1024, 4096)] {
                    let (x, q, s) = operands(&dev, dtype, m, n, k)?;
                    assert!(!fp8::takes_fp8_rows(&x), "m {m}");
                    let want = fp8::reference_linear(&x.to_dtype(DType::F32)?, &q, &s)?;
                    let got = fp8::linear(&x, &q, &s)?;
                    let e = rel_err(&got, &want)?;
                    assert!(e < 1e-2, "{dtype:?} m {m} n {n} k {k}: {e}");
                    if m > 4 {
                        // exactly the 16-bit product of the dequantized weight
                        let dense = fp8::reference_linear(&x, &q, &s)?;
                        assert_eq!(rel_err(&got, &dense)?, 0.0, "{dtype:?} m {m} n {n} k {k}");
                    }
                    let h = n / 2;
                    let (g, u) = (want.narrow(1, 0, h)?, want.narrow(1, h, h)?);
                    let e = rel_err(&fp8::silu_glu(&x, &q, &s)?, &(g.silu()? * u)?)?;
                    assert!(e < 2e-2, "glu {dtype:?} m {m} n {n} k {k}: {e}");
                }
            }
        }
        Ok(())
    }
}
