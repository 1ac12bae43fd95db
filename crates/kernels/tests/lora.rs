//! The LoRA term of mixed-adapter batches: the grouped reference against a row-by-row f32
//! product, and (with CUDA) the BGMV kernels against the reference, for one-part, fused three-part
//! and two-part projections, rows without an adapter, and ranks that are and are not multiples of
//! the kernels' vectors.
#![allow(clippy::unwrap_used)]

use candle_core::{DType, Device, Result, Tensor};
use rserve_kernels::lora::{lora_add, lora_add_reference, LoraStack, NO_ADAPTER};

struct Case {
    x: Tensor,
    y: Tensor,
    a: Tensor,
    b: Tensor,
    parts: Vec<usize>,
    slots: Vec<u32>,
}

fn case(tokens: usize, k: usize, parts: &[usize], rank: usize, num_slots: usize) -> Result<Case> {
    let cpu = Device::Cpu;
    let n: usize = parts.iter().sum();
    let slots = (0..tokens)
        .map(|t| match t % (num_slots + 1) {
            0 => NO_ADAPTER,
            s => (s - 1) as u32,
        })
        .collect();
    Ok(Case {
        x: Tensor::randn(0f32, 1., (tokens, k), &cpu)?,
        y: Tensor::randn(0f32, 1., (tokens, n), &cpu)?,
        a: (Tensor::randn(0f32, 1., (num_slots, parts.len() * rank, k), &cpu)? * 0.1)?,
        b: (Tensor::randn(0f32, 1., (num_slots, n, rank), &cpu)? * 0.1)?,
        parts: parts.to_vec(),
        slots,
    })
}

/// Row by row in f32: y[t] + sum over parts of B_p (A_p x[t]).
fn naive(c: &Case) -> Result<Vec<Vec<f32>>> {
    let x = c.x.to_vec2::<f32>()?;
    let mut y = c.y.to_vec2::<f32>()?;
    let a = c.a.to_dtype(DType::F32)?;
    let b = c.b.to_dtype(DType::F32)?;
    let rank = b.dim(2)?;
    for (t, &s) in c.slots.iter().enumerate() {
        if s == NO_ADAPTER {
            continue;
        }
        let a = a.get(s as usize)?.to_vec2::<f32>()?;
        let b = b.get(s as usize)?.to_vec2::<f32>()?;
        let u: Vec<f32> = a
            .iter()
            .map(|row| row.iter().zip(&x[t]).map(|(p, q)| p * q).sum())
            .collect();
        let mut col = 0;
        for (p, &w) in c.parts.iter().enumerate() {
            for o in col..col + w {
                y[t][o] += (0..rank).map(|q| u[p * rank + q] * b[o][q]).sum::<f32>();
            }
            col += w;
        }
    }
    Ok(y)
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(p, q)| (p - q).abs())
        .fold(0.0, f32::max)
}

const SHAPES: &[(usize, usize, &[usize], usize, usize)] = &[
    // tokens, in, parts, rank, slots
    (7, 64, &[48], 8, 3),
    (9, 64, &[64, 16, 16], 4, 2),
    (5, 40, &[24, 24], 16, 4),
    (33, 72, &[40], 3, 5),
];

#[test]
fn the_reference_adds_each_rows_adapter() -> Result<()> {
    for &(t, k, parts, r, s) in SHAPES {
        let c = case(t, k, parts, r, s)?;
        let stack = LoraStack {
            a: &c.a,
            b: &c.b,
            parts: &c.parts,
        };
        let got = lora_add_reference(&c.y, &c.x, &stack, &c.slots)?.to_vec2::<f32>()?;
        let d = max_diff(&got, &naive(&c)?);
        assert!(d < 1e-4, "{t}x{k} {parts:?} r{r}: {d}");
        // through the public op (the slots as a tensor) on the CPU
        let slots = Tensor::new(c.slots.as_slice(), &Device::Cpu)?;
        let got = lora_add(&c.y, &c.x, &stack, &slots)?.to_vec2::<f32>()?;
        assert!(max_diff(&got, &naive(&c)?) < 1e-4);
        // rows without an adapter are left exactly as they were
        let y = c.y.to_vec2::<f32>()?;
        for (row, &s) in c.slots.iter().enumerate() {
            if s == NO_ADAPTER {
                assert_eq!(got[row], y[row]);
            }
        }
    }
    Ok(())
}

#[test]
fn a_slot_past_the_stack_is_an_error() -> Result<()> {
    let c = case(3, 16, &[8], 2, 2)?;
    let stack = LoraStack {
        a: &c.a,
        b: &c.b,
        parts: &c.parts,
    };
    assert!(lora_add_reference(&c.y, &c.x, &stack, &[0, 2, NO_ADAPTER]).is_err());
    let bad = LoraStack {
        a: &c.a,
        b: &c.b,
        parts: &[4, 3],
    };
    assert!(lora_add_reference(&c.y, &c.x, &bad, &[0, 1, 0]).is_err());
    Ok(())
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;

    #[test]
    fn the_kernels_match_the_reference() -> Result<()> {
        let dev = Device::new_cuda(0).expect("a CUDA device");
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for &(t, k, parts, r, s) in
                SHAPES
                    .iter()
                    .chain(&[(64, 4096, &[4096, 1024, 1024][..], 16, 8)])
            {
                let c = case(t, k, parts, r, s)?;
                let cast = |x: &Tensor| x.to_dtype(dtype);
                let (x, y, a, b) = (cast(&c.x)?, cast(&c.y)?, cast(&c.a)?, cast(&c.b)?);
                let want = naive(&Case {
                    x: x.to_dtype(DType::F32)?,
                    y: y.to_dtype(DType::F32)?,
                    a: a.clone(),
                    b: b.clone(),
                    parts: c.parts.clone(),
                    slots: c.slots.clone(),
                })?;
                let on = |x: &Tensor| x.to_device(&dev);
                let (ad, bd) = (on(&a)?, on(&b)?);
                let stack = LoraStack {
                    a: &ad,
                    b: &bd,
                    parts: &c.parts,
                };
                let slots = Tensor::new(c.slots.as_slice(), &dev)?;
                let got = lora_add(&on(&y)?, &on(&x)?, &stack, &slots)?
                    .to_dtype(DType::F32)?
                    .to_device(&Device::Cpu)?
                    .to_vec2::<f32>()?;
                let scale = want.iter().flatten().fold(1f32, |m, v| m.max(v.abs()));
                let tol = match dtype {
                    DType::BF16 => 1e-2,
                    DType::F16 => 2e-3,
                    _ => 1e-5,
                } * scale;
                let d = max_diff(&got, &want);
                assert!(d <= tol, "{dtype:?} {t}x{k} {parts:?} r{r}: {d} > {tol}");
            }
        }
        Ok(())
    }
}
