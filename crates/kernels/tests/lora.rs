//! The LoRA term of mixed-adapter batches: the grouped reference against a row-by-row f32
//! product, and (with CUDA) the BGMV kernels and the cuBLAS runs against it, for one-part, fused
//! three-part and two-part projections, rows without an adapter, ranks that are and are not
//! multiples of the kernels' vectors, and the fused gate-up's SiLU-and-multiply; the two-launch
//! decode product and the product over a weight stored above its adapters' `A` rows
//! (`lora_gemv`) against the product and the term composed; a step's gathered rows listed (the
//! kernels launched over them only) against the same rows unlisted.
#![allow(clippy::unwrap_used)]

use candle_core::{DType, Device, Result, Tensor};
use rserve_kernels::lora::{
    listed_rows, lora_add, lora_add_reference, lora_add_silu_glu, split_runs, LoraRows, LoraRun,
    LoraStack, MIN_RUN, NO_ADAPTER,
};

struct Case {
    x: Tensor,
    y: Tensor,
    a: Tensor,
    b: Tensor,
    parts: Vec<usize>,
    slots: Vec<u32>,
}

fn case(tokens: usize, k: usize, parts: &[usize], rank: usize, num_slots: usize) -> Result<Case> {
    let slots = (0..tokens)
        .map(|t| match t % (num_slots + 1) {
            0 => NO_ADAPTER,
            s => (s - 1) as u32,
        })
        .collect();
    case_with(slots, k, parts, rank, num_slots)
}

/// Rows in blocks: a prompt chunk of adapter 0, decode rows of mixed adapters, a chunk of
/// adapter 1, base rows, a chunk of the last adapter.
fn chunked_slots(num_slots: usize) -> Vec<u32> {
    let last = num_slots as u32 - 1;
    let mut v = vec![0; 40];
    v.extend([1, NO_ADAPTER, 0, last]);
    v.extend(std::iter::repeat_n(1, MIN_RUN));
    v.extend([NO_ADAPTER; 3]);
    v.extend(std::iter::repeat_n(last, 21));
    v
}

fn case_with(
    slots: Vec<u32>,
    k: usize,
    parts: &[usize],
    rank: usize,
    num_slots: usize,
) -> Result<Case> {
    let cpu = Device::Cpu;
    let n: usize = parts.iter().sum();
    let tokens = slots.len();
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
        let rows = LoraRows {
            slots: Some(&slots),
            runs: &[],
            listed: None,
        };
        let got = lora_add(&c.y, &c.x, &stack, &rows)?.to_vec2::<f32>()?;
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
fn runs_of_one_adapter_are_split_from_the_gathered_rows() {
    let mut s = vec![
        0, 0, 0, 1, NO_ADAPTER, NO_ADAPTER, NO_ADAPTER, 2, 2, 2, 2, 1,
    ];
    let runs = split_runs(&mut s, 3);
    let run = |start, len, slot| LoraRun { start, len, slot };
    assert_eq!(runs, vec![run(0, 3, 0), run(7, 4, 2)]);
    let n = NO_ADAPTER;
    assert_eq!(s, vec![n, n, n, 1, n, n, n, n, n, n, n, 1]);
    // base rows never form a run; nothing at all is a no-op
    let mut base = vec![NO_ADAPTER; 40];
    assert!(split_runs(&mut base, 3).is_empty());
    assert!(split_runs(&mut [], 3).is_empty());
}

#[test]
fn the_slots_a_step_covers_end_past_its_highest() {
    use rserve_kernels::lora_gemv::slots_covered;
    assert_eq!(slots_covered(&[]), 0);
    assert_eq!(slots_covered(&[NO_ADAPTER, NO_ADAPTER]), 0);
    assert_eq!(slots_covered(&[0, NO_ADAPTER]), 1);
    assert_eq!(slots_covered(&[3, NO_ADAPTER, 0, 7, 1]), 8);
}

#[test]
fn listed_rows_are_the_rows_with_an_adapter_in_order() {
    assert_eq!(listed_rows(&[]), (vec![], vec![]));
    assert_eq!(listed_rows(&[NO_ADAPTER, NO_ADAPTER]), (vec![], vec![]));
    assert_eq!(
        listed_rows(&[NO_ADAPTER, 3, 0, NO_ADAPTER, 3]),
        (vec![1, 2, 4], vec![3, 0, 3])
    );
}

#[test]
fn runs_and_gathered_rows_add_the_same_terms() -> Result<()> {
    let c = case_with(chunked_slots(3), 24, &[16, 16], 4, 3)?;
    let stack = LoraStack {
        a: &c.a,
        b: &c.b,
        parts: &c.parts,
    };
    let mut gathered = c.slots.clone();
    let runs = split_runs(&mut gathered, MIN_RUN);
    assert_eq!(runs.len(), 3);
    let slots = Tensor::new(gathered.as_slice(), &Device::Cpu)?;
    let rows = LoraRows {
        slots: Some(&slots),
        runs: &runs,
        listed: None,
    };
    let want = naive(&c)?;
    let got = lora_add(&c.y, &c.x, &stack, &rows)?.to_vec2::<f32>()?;
    assert!(max_diff(&got, &want) < 1e-4);
    // the fused gate-up form is silu(g) * v of the same sums
    let glu = lora_add_silu_glu(&c.y, &c.x, &stack, &rows)?.to_vec2::<f32>()?;
    let want_glu: Vec<Vec<f32>> = want.iter().map(|r| silu_mul(r)).collect();
    assert!(max_diff(&glu, &want_glu) < 1e-4);
    // a run past the rows, or overlapping another, is an error
    let bad = [LoraRun {
        start: 70,
        len: 30,
        slot: 0,
    }];
    let rows = LoraRows {
        slots: None,
        runs: &bad,
        listed: None,
    };
    assert!(lora_add(&c.y, &c.x, &stack, &rows).is_err());
    Ok(())
}

fn silu_mul(row: &[f32]) -> Vec<f32> {
    let h = row.len() / 2;
    (0..h)
        .map(|o| row[o] / (1. + (-row[o]).exp()) * row[h + o])
        .collect()
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
                let d = OnDevice::new(&c, dtype, &dev)?;
                let (x, y, want) = (&d.x, &d.y, &d.want);
                let stack = d.stack(&c.parts);
                let slots = Tensor::new(c.slots.as_slice(), &dev)?;
                let rows = LoraRows {
                    slots: Some(&slots),
                    runs: &[],
                    listed: None,
                };
                let got = host(&lora_add(&y.copy()?, x, &stack, &rows)?)?;
                let tol = tolerance(dtype, want);
                let d = max_diff(&got, want);
                assert!(d <= tol, "{dtype:?} {t}x{k} {parts:?} r{r}: {d} > {tol}");
            }
        }
        Ok(())
    }

    /// A case in `dtype`: `x` and `y` on the device, `A` and `B` too, and the f32 product of
    /// the rounded values.
    struct OnDevice {
        x: Tensor,
        y: Tensor,
        a: Tensor,
        b: Tensor,
        want: Vec<Vec<f32>>,
    }

    impl OnDevice {
        fn stack<'a>(&'a self, parts: &'a [usize]) -> LoraStack<'a> {
            LoraStack {
                a: &self.a,
                b: &self.b,
                parts,
            }
        }

        fn new(c: &Case, dtype: DType, dev: &Device) -> Result<Self> {
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
            let on = |t: &Tensor| t.to_device(dev);
            Ok(Self {
                x: on(&x)?,
                y: on(&y)?,
                a: on(&a)?,
                b: on(&b)?,
                want,
            })
        }
    }

    fn host(t: &Tensor) -> Result<Vec<Vec<f32>>> {
        t.to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?
            .to_vec2::<f32>()
    }

    /// A random weight `[n, k]` in `dtype` on `dev`.
    fn weight(n: usize, k: usize, dtype: DType, dev: &Device) -> Result<Tensor> {
        (Tensor::randn(0f32, 1., (n, k), &Device::Cpu)? * 0.05)?
            .to_dtype(dtype)?
            .to_device(dev)
    }

    /// The fused products' reference: `x W^T`, then the rows' terms (with `glu`, then
    /// SiLU-and-multiply); with its tolerance (twice as wide for `glu`).
    fn composed(
        x: &Tensor,
        w: &Tensor,
        stack: &LoraStack<'_>,
        rows: &LoraRows<'_>,
        glu: bool,
        dtype: DType,
    ) -> Result<(Vec<Vec<f32>>, f32)> {
        let y = rserve_kernels::linear_rows(x, w)?;
        let want = if glu {
            host(&lora_add_silu_glu(&y, x, stack, rows)?)?
        } else {
            host(&lora_add(&y, x, stack, rows)?)?
        };
        let tol = tolerance(dtype, &want) * if glu { 2. } else { 1. };
        Ok((want, tol))
    }

    fn tolerance(dtype: DType, want: &[Vec<f32>]) -> f32 {
        let scale = want.iter().flatten().fold(1f32, |m, v| m.max(v.abs()));
        scale
            * match dtype {
                DType::BF16 => 1e-2,
                DType::F16 => 2e-3,
                _ => 1e-5,
            }
    }

    /// The two-launch decode product against the streaming product plus the BGMV term, for 1 to
    /// 4 rows (with and without adapters), plain and gate-up.
    #[test]
    fn the_two_launch_decode_product_matches_the_composed_one() -> Result<()> {
        use rserve_kernels::lora_gemv::linear_rows_lora;
        let dev = Device::new_cuda(0).expect("a CUDA device");
        for dtype in [DType::BF16, DType::F16] {
            for (k, parts, r, glu) in [
                (4096, &[4096, 1024, 1024][..], 16, false),
                (64, &[48][..], 8, false),
                (128, &[24, 24, 8][..], 5, false),
                (4096, &[1024, 1024][..], 16, true),
                (72, &[40, 40][..], 3, true),
            ] {
                let n: usize = parts.iter().sum();
                let w = weight(n, k, dtype, &dev)?;
                for round in 0..2u32 {
                    for m in 1..=4usize {
                        let slots: Vec<u32> = (0..m as u32)
                            .map(|t| match (t + round) % 4 {
                                3 => NO_ADAPTER,
                                s => s,
                            })
                            .collect();
                        let c = case_with(slots, k, parts, r, 3)?;
                        let d = OnDevice::new(&c, dtype, &dev)?;
                        let stack = d.stack(&c.parts);
                        let slots = Tensor::new(c.slots.as_slice(), &dev)?;
                        let got = linear_rows_lora(&d.x, &w, &stack, &slots, glu)?
                            .expect("the two-launch product applies");
                        let rows = LoraRows {
                            slots: Some(&slots),
                            runs: &[],
                            listed: None,
                        };
                        let (want, tol) = composed(&d.x, &w, &stack, &rows, glu, dtype)?;
                        let got = host(&got)?;
                        let diff = max_diff(&got, &want);
                        assert!(
                            diff <= tol,
                            "{dtype:?} m{m} k{k} {parts:?} r{r} glu {glu}: {diff} > {tol}"
                        );
                    }
                }
                // five rows are not the kernel's: the caller composes
                let c = case(5, k, parts, r, 3)?;
                let d = OnDevice::new(&c, dtype, &dev)?;
                let stack = d.stack(&c.parts);
                let slots = Tensor::new(c.slots.as_slice(), &dev)?;
                assert!(linear_rows_lora(&d.x, &w, &stack, &slots, glu)?.is_none());
            }
        }
        Ok(())
    }

    /// The product over a weight stored above its adapters' `A` rows (one product, the expand
    /// reading `u` from the row) against the product and the term composed, for 1 to 70 rows
    /// (with and without adapters), plain and gate-up; past its rows it does not apply.
    #[test]
    fn the_stacked_product_matches_the_composed_one() -> Result<()> {
        use rserve_kernels::lora_gemv::{
            linear_rows_lora_stacked, slots_covered, STACKED_MAX_ROWS,
        };
        let dev = Device::new_cuda(0).expect("a CUDA device");
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for (k, parts, r, s, glu) in [
                (4096, &[4096, 1024, 1024][..], 16, 8, false),
                (128, &[24, 24, 8][..], 5, 3, false),
                (4096, &[1024, 1024][..], 16, 8, true),
                (72, &[40, 40][..], 3, 2, true),
            ] {
                let n: usize = parts.iter().sum();
                let pr = parts.len() * r;
                let w = weight(n, k, dtype, &dev)?;
                for m in [1, 5, 8, 64, 70] {
                    let c = case(m, k, parts, r, s)?;
                    let d = OnDevice::new(&c, dtype, &dev)?;
                    let w_ext = Tensor::cat(&[&w, &d.a.reshape((s * pr, k))?], 0)?;
                    let a = w_ext.narrow(0, n, s * pr)?.reshape((s, pr, k))?;
                    let stacked = LoraStack {
                        a: &a,
                        b: &d.b,
                        parts,
                    };
                    let slots = Tensor::new(c.slots.as_slice(), &dev)?;
                    let rows = LoraRows {
                        slots: Some(&slots),
                        runs: &[],
                        listed: None,
                    };
                    let stack = d.stack(parts);
                    let (want, tol) = composed(&d.x, &w, &stack, &rows, glu, dtype)?;
                    // every slot (0), exactly the slots the rows use, more than there are
                    let used = slots_covered(&c.slots);
                    for covered in [0, used, s + 1] {
                        let got =
                            linear_rows_lora_stacked(&d.x, &w_ext, &stacked, &slots, glu, covered)?
                                .expect("the stacked product applies");
                        let diff = max_diff(&host(&got)?, &want);
                        assert!(
                            diff <= tol,
                            "{dtype:?} m{m} k{k} {parts:?} r{r} glu {glu} covering {covered}: \
                             {diff} > {tol}"
                        );
                    }
                    // rows of slots past the covered ones are base rows
                    if used > 1 {
                        let base: Vec<u32> = c
                            .slots
                            .iter()
                            .map(|&v| {
                                if v == NO_ADAPTER || v + 1 >= used as u32 {
                                    NO_ADAPTER
                                } else {
                                    v
                                }
                            })
                            .collect();
                        let base = Tensor::new(base.as_slice(), &dev)?;
                        let rows = LoraRows {
                            slots: Some(&base),
                            runs: &[],
                            listed: None,
                        };
                        let (want, tol) = composed(&d.x, &w, &stack, &rows, glu, dtype)?;
                        let got = linear_rows_lora_stacked(
                            &d.x,
                            &w_ext,
                            &stacked,
                            &slots,
                            glu,
                            used - 1,
                        )?
                        .expect("the stacked product applies");
                        let diff = max_diff(&host(&got)?, &want);
                        assert!(
                            diff <= tol,
                            "{dtype:?} m{m} uncovered slots: {diff} > {tol}"
                        );
                    }
                }
                let c = case(STACKED_MAX_ROWS + 1, k, parts, r, s)?;
                let d = OnDevice::new(&c, dtype, &dev)?;
                let w_ext = Tensor::cat(&[&w, &d.a.reshape((s * pr, k))?], 0)?;
                let slots = Tensor::new(c.slots.as_slice(), &dev)?;
                let stack = d.stack(parts);
                assert!(linear_rows_lora_stacked(&d.x, &w_ext, &stack, &slots, glu, 0)?.is_none());
            }
        }
        Ok(())
    }

    /// Prompt runs with their terms written first and the product added onto them, beside
    /// gathered decode rows and alone (rows past the runs get the product alone), plain and
    /// gate-up, against the product and the terms composed.
    #[test]
    fn the_terms_first_product_matches_the_composed_one() -> Result<()> {
        use rserve_kernels::lora_gemv::linear_rows_lora_runs;
        let dev = Device::new_cuda(0).expect("a CUDA device");
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for (k, parts, r, glu) in [
                (4096, &[4096, 1024, 1024][..], 16, false),
                (64, &[48, 48][..], 8, true),
                (4096, &[1024, 1024][..], 16, true),
                (72, &[40, 16, 8][..], 3, false),
            ] {
                let n: usize = parts.iter().sum();
                let w = weight(n, k, dtype, &dev)?;
                let c = case_with(chunked_slots(4), k, parts, r, 4)?;
                let d = OnDevice::new(&c, dtype, &dev)?;
                let stack = d.stack(&c.parts);
                let mut gathered = c.slots.clone();
                let runs = split_runs(&mut gathered, MIN_RUN);
                let slots = Tensor::new(gathered.as_slice(), &dev)?;
                let (list, listed) = listed_rows(&gathered);
                assert!(!list.is_empty());
                let (list, listed) = (Tensor::new(list, &dev)?, Tensor::new(listed, &dev)?);
                for rows in [
                    LoraRows {
                        slots: Some(&slots),
                        runs: &runs,
                        listed: None,
                    },
                    // the gathered kernels over the listed rows only
                    LoraRows {
                        slots: Some(&slots),
                        runs: &runs,
                        listed: Some((&list, &listed)),
                    },
                    LoraRows {
                        slots: None,
                        runs: &runs[..1],
                        listed: None,
                    },
                    LoraRows {
                        slots: None,
                        runs: &runs[1..],
                        listed: None,
                    },
                ] {
                    let got = linear_rows_lora_runs(&d.x, &w, &stack, &rows, glu)?
                        .expect("the terms-first product applies");
                    let (want, tol) = composed(&d.x, &w, &stack, &rows, glu, dtype)?;
                    let diff = max_diff(&host(&got)?, &want);
                    assert!(
                        diff <= tol,
                        "{dtype:?} k{k} {parts:?} r{r} glu {glu} runs {} listed {}: {diff} > {tol}",
                        rows.runs.len(),
                        rows.listed.is_some()
                    );
                }
                // without runs it is the other forms' to take
                let rows = LoraRows {
                    slots: Some(&slots),
                    runs: &[],
                    listed: None,
                };
                assert!(linear_rows_lora_runs(&d.x, &w, &stack, &rows, glu)?.is_none());
            }
        }
        Ok(())
    }

    /// Runs of `lens` rows, slots cycling over `num_slots`, each after `gap` base rows: the
    /// slots of every row and the runs.
    fn many_runs(lens: &[usize], num_slots: u32, gap: usize) -> (Vec<u32>, Vec<LoraRun>) {
        let (mut slots, mut runs) = (Vec::new(), Vec::new());
        for (i, &len) in lens.iter().enumerate() {
            slots.extend(std::iter::repeat_n(NO_ADAPTER, gap));
            let slot = i as u32 % num_slots;
            runs.push(LoraRun {
                start: slots.len(),
                len,
                slot,
            });
            slots.extend(std::iter::repeat_n(slot, len));
        }
        (slots, runs)
    }

    /// Each form of the prompt runs' terms (cuBLAS run by run, grouped, either by the run
    /// count; 16-bit, ranks of 16 to 64): a few runs and seventy, runs of 16 to 200 rows, parts
    /// of uneven widths, added into `y` in place and written under the product, against the
    /// row-by-row f32 reference.
    #[test]
    fn every_form_of_the_prompt_runs_matches_the_reference() -> Result<()> {
        use rserve_kernels::lora::{set_prompt_terms, PromptTerms};
        for mode in [PromptTerms::Grouped, PromptTerms::Runs, PromptTerms::Auto] {
            set_prompt_terms(mode);
            prompt_runs_match_the_reference(mode)?;
        }
        Ok(())
    }

    fn prompt_runs_match_the_reference(mode: rserve_kernels::lora::PromptTerms) -> Result<()> {
        use rserve_kernels::lora_gemv::linear_rows_lora_runs;
        let dev = Device::new_cuda(0).expect("a CUDA device");
        let short: Vec<usize> = (0..70).map(|i| 16 + (i * 7) % 90).collect();
        let long = [16, 64, 65, 130, 200, 17, 64, 100];
        for (k, parts, r, lens) in [
            (4096, &[4096, 1024, 1024][..], 16, &long[..]),
            (256, &[200, 56][..], 32, &short[..]),
            (512, &[96][..], 64, &short[..20]),
            (14336, &[4096][..], 16, &long[..3]),
        ] {
            let (slots, runs) = many_runs(lens, 4, 3);
            let c = case_with(slots, k, parts, r, 4)?;
            for dtype in [DType::BF16, DType::F16] {
                let d = OnDevice::new(&c, dtype, &dev)?;
                let stack = d.stack(&c.parts);
                let rows = LoraRows {
                    slots: None,
                    runs: &runs,
                    listed: None,
                };
                let tol = tolerance(dtype, &d.want);
                let got = host(&lora_add(&d.y.copy()?, &d.x, &stack, &rows)?)?;
                let diff = max_diff(&got, &d.want);
                assert!(
                    diff <= tol,
                    "{mode:?} {dtype:?} k{k} {parts:?} r{r} added: {diff} > {tol}"
                );
                let n: usize = parts.iter().sum();
                let w = weight(n, k, dtype, &dev)?;
                let product = rserve_kernels::linear_rows(&d.x, &w)?;
                let want = naive(&Case {
                    x: d.x.to_dtype(DType::F32)?.to_device(&Device::Cpu)?,
                    y: product.to_dtype(DType::F32)?.to_device(&Device::Cpu)?,
                    a: d.a.to_device(&Device::Cpu)?,
                    b: d.b.to_device(&Device::Cpu)?,
                    parts: c.parts.clone(),
                    slots: c.slots.clone(),
                })?;
                let got = linear_rows_lora_runs(&d.x, &w, &stack, &rows, false)?
                    .expect("the terms-first product applies");
                let tol = tolerance(dtype, &want);
                let diff = max_diff(&host(&got)?, &want);
                assert!(
                    diff <= tol,
                    "{mode:?} {dtype:?} k{k} {parts:?} r{r} first: {diff} > {tol}"
                );
            }
        }
        Ok(())
    }

    /// Prompt chunks through cuBLAS runs beside gathered decode rows, plain and fused gate-up
    /// (whose kernel also writes the rows without an adapter).
    #[test]
    fn runs_and_the_gated_expand_match_the_reference() -> Result<()> {
        let dev = Device::new_cuda(0).expect("a CUDA device");
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for (k, parts, r) in [
                (64, &[48, 48][..], 8),
                (4096, &[1024, 1024][..], 16),
                (72, &[40, 40][..], 3),
            ] {
                let c = case_with(chunked_slots(4), k, parts, r, 4)?;
                let d = OnDevice::new(&c, dtype, &dev)?;
                let (x, y, want) = (&d.x, &d.y, &d.want);
                let stack = d.stack(&c.parts);
                let mut gathered = c.slots.clone();
                let runs = split_runs(&mut gathered, MIN_RUN);
                let slots = Tensor::new(gathered.as_slice(), &dev)?;
                let tol = tolerance(dtype, want);
                for rows in [
                    LoraRows {
                        slots: Some(&slots),
                        runs: &runs,
                        listed: None,
                    },
                    LoraRows {
                        slots: None,
                        runs: &runs[..1],
                        listed: None,
                    },
                ] {
                    let got = host(&lora_add(&y.copy()?, x, &stack, &rows)?)?;
                    // with only the first run, rows past it keep y
                    let want = if rows.slots.is_some() {
                        want.clone()
                    } else {
                        let mut w = host(y)?;
                        w[..runs[0].len].clone_from_slice(&want[..runs[0].len]);
                        w
                    };
                    let d = max_diff(&got, &want);
                    assert!(d <= tol, "{dtype:?} k{k} {parts:?} r{r}: {d} > {tol}");
                    let glu = host(&lora_add_silu_glu(&y.copy()?, x, &stack, &rows)?)?;
                    let want_glu: Vec<Vec<f32>> = want.iter().map(|r| silu_mul(r)).collect();
                    let d = max_diff(&glu, &want_glu);
                    let tol = tolerance(dtype, &want_glu) * 2.;
                    assert!(d <= tol, "glu {dtype:?} k{k} {parts:?} r{r}: {d} > {tol}");
                }
            }
        }
        Ok(())
    }
}
