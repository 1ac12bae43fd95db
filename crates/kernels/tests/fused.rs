//! The fused decoder ops against their candle compositions: rotary embedding in place vs candle's
//! `rope_thd`, and on CUDA each kernel vs the CPU reference, for f32, bf16 and f16.
#![allow(clippy::unwrap_used)]

use candle_core::{DType, Device, Result, Tensor};
use rserve_kernels::{rotary_qk_, rotary_qk_cache_, AttentionMetadata, CacheScales};

/// Largest `|a - b| / max(1, |b|)`: one rounding step of the dtype at any magnitude.
fn max_rel_err(a: &Tensor, b: &Tensor) -> Result<f32> {
    let (a, b) = (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
    let scale = b.abs()?.maximum(1f32)?;
    ((a - &b)?.abs()? / scale)?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn max_err(a: &Tensor, b: &Tensor) -> Result<f32> {
    (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()
}

/// Tables like the model's: `[max_pos, d / 2]` cos and sin of `pos * inv_freq`.
fn tables(max_pos: usize, d: usize, dtype: DType, dev: &Device) -> Result<(Tensor, Tensor)> {
    let half = d / 2;
    let (mut c, mut s) = (vec![], vec![]);
    for p in 0..max_pos {
        for i in 0..half {
            let a = p as f32 / 10000f32.powf(2.0 * i as f32 / d as f32);
            c.push(a.cos());
            s.push(a.sin());
        }
    }
    Ok((
        Tensor::from_vec(c, (max_pos, half), dev)?.to_dtype(dtype)?,
        Tensor::from_vec(s, (max_pos, half), dev)?.to_dtype(dtype)?,
    ))
}

/// Rotates q and k of a random qkv of head dim `d` on `dev` and compares with candle's `rope_thd`
/// on the CPU (relative error: bf16 values of 2 and more are 1/64 apart).
fn rotary_case(dev: &Device, dtype: DType, d: usize, tol: f32) -> Result<()> {
    let (t, h, kvh, max_pos) = (7, 4, 2, 50);
    let cpu = Device::Cpu;
    let qkv = Tensor::randn(0f32, 1., (t, h + 2 * kvh, d), &cpu)?.to_dtype(dtype)?;
    // a view past the start of a larger table, as the vision encoder passes its positions
    let table = Tensor::new(&[3u32, 4, 0, 1, 5, 9, 17, 33, 49], &cpu)?;
    let positions = table.narrow(0, 2, t)?;
    let (cos, sin) = tables(max_pos, d, dtype, &cpu)?;
    let want = {
        let c = cos.index_select(&positions, 0)?;
        let s = sin.index_select(&positions, 0)?;
        let rot = |x: Tensor| -> Result<Tensor> {
            candle_nn::rotary_emb::rope_thd(&x.contiguous()?.unsqueeze(0)?, &c, &s)?.squeeze(0)
        };
        Tensor::cat(
            &[
                rot(qkv.narrow(1, 0, h)?)?,
                rot(qkv.narrow(1, h, kvh)?)?,
                qkv.narrow(1, h + kvh, kvh)?,
            ],
            1,
        )?
    };
    let got = qkv.to_device(dev)?.contiguous()?;
    let (dc, ds) = (cos.to_device(dev)?, sin.to_device(dev)?);
    let positions = table.to_device(dev)?.narrow(0, 2, t)?;
    rotary_qk_(&got, &positions, &dc, &ds, h + kvh)?;
    let err = max_rel_err(&got.to_device(&cpu)?, &want)?;
    assert!(err <= tol, "{dtype:?} d {d} on {dev:?}: max error {err}");
    Ok(())
}

#[test]
fn cpu_rotary_matches_rope_thd() -> Result<()> {
    rotary_case(&Device::Cpu, DType::F32, 64, 1e-6)?;
    rotary_case(&Device::Cpu, DType::BF16, 64, 2e-2)?;
    rotary_case(&Device::Cpu, DType::F16, 64, 4e-3)
}

#[test]
fn layer_norm_rejects_bad_operands() -> Result<()> {
    use rserve_kernels::layer_norm::{add_layer_norm, layer_norm};
    let dev = Device::Cpu;
    let x = Tensor::zeros((2, 8), DType::F32, &dev)?;
    let w = Tensor::ones(8, DType::F32, &dev)?;
    let b = Tensor::zeros(8, DType::F32, &dev)?;
    let short = Tensor::ones(7, DType::F32, &dev)?;
    assert!(layer_norm(&x, &short, &b, 1e-5).is_err());
    assert!(layer_norm(&x, &w, &short, 1e-5).is_err());
    assert!(layer_norm(&x, &w.to_dtype(DType::BF16)?, &b, 1e-5).is_err());
    assert!(add_layer_norm(&x, &x.narrow(0, 0, 1)?, &w, &b, 1e-5).is_err());
    assert!(add_layer_norm(&x, &x.to_dtype(DType::F16)?, &w, &b, 1e-5).is_err());
    let x3 = Tensor::zeros((2, 3, 8), DType::F32, &dev)?;
    assert!(add_layer_norm(&x3, &x3, &w, &b, 1e-5).is_err(), "rows only");
    assert_eq!(layer_norm(&x3, &w, &b, 1e-5)?.dims(), &[2, 3, 8]);
    Ok(())
}

#[test]
fn rotary_rejects_bad_shapes() -> Result<()> {
    let dev = Device::Cpu;
    let (cos, sin) = tables(8, 8, DType::F32, &dev)?;
    let qkv = Tensor::zeros((2, 3, 8), DType::F32, &dev)?;
    let pos = Tensor::new(&[0u32, 9], &dev)?; // past the table
    assert!(rotary_qk_(&qkv, &pos, &cos, &sin, 2).is_err());
    let pos = Tensor::new(&[0u32, 1], &dev)?;
    assert!(rotary_qk_(&qkv, &pos, &cos, &sin, 4).is_err()); // more heads than there are
    Ok(())
}

#[test]
fn rotary_cache_rejects_bad_operands() -> Result<()> {
    let cpu = Device::Cpu;
    let (cos, sin) = tables(8, 8, DType::F32, &cpu)?;
    let pos = Tensor::new(&[0u32, 1], &cpu)?;
    let cache = Tensor::zeros((2, 4, 1, 8), DType::F32, &cpu)?;
    let meta = AttentionMetadata::new(vec![0, 1], vec![0], 1, vec![2], vec![0, 2], &cpu)?;
    let run = |qkv: &Tensor, meta: &AttentionMetadata| {
        rotary_qk_cache_(
            qkv,
            &pos,
            &cos,
            &sin,
            (2, 1),
            &cache,
            &cache.copy()?,
            meta,
            CacheScales::default(),
        )
    };
    // 2 q + 2 x 1 kv heads expected, 3 given
    assert!(run(&Tensor::zeros((2, 3, 8), DType::F32, &cpu)?, &meta).is_err());
    // one slot for two tokens
    let qkv = Tensor::zeros((2, 4, 8), DType::F32, &cpu)?;
    let short = AttentionMetadata::new(vec![0], vec![0], 1, vec![1], vec![0, 1], &cpu)?;
    assert!(run(&qkv, &short).is_err());
    run(&qkv, &meta)
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use rserve_kernels::fused::{add_rms_norm_reference, silu_and_mul_reference};
    use rserve_kernels::{add_rms_norm, silu_and_mul};

    fn gpu() -> Device {
        Device::new_cuda(0).expect("a CUDA device")
    }

    const CASES: [(DType, f32); 3] = [(DType::F32, 1e-5), (DType::BF16, 2e-2), (DType::F16, 4e-3)];

    #[test]
    fn cuda_rotary_matches_rope_thd() -> Result<()> {
        // head dim 64 takes the kernel's 16-byte vectors, 72 (half rows of 36) single elements
        for d in [64, 72] {
            for (dtype, tol) in CASES {
                rotary_case(&gpu(), dtype, d, tol.max(1e-5))?;
            }
        }
        Ok(())
    }

    /// The fused rotary + cache write on the GPU against rotary_qk_ and reshape_and_cache on the
    /// CPU: the rotated qkv and both caches (a skipped slot leaves its row untouched).
    #[test]
    fn cuda_rotary_cache_matches_separate_ops() -> Result<()> {
        // head dim 64 takes the kernel's 16-byte vectors, 72 single elements
        for d in [64, 72] {
            rotary_cache_case(d, None)?;
        }
        Ok(())
    }

    /// The same into FP8 caches, with unit and non-unit scales: every byte decodes to the CPU
    /// path's value within one E4M3 step (the rotated values may differ in their last f32 bit).
    #[test]
    fn cuda_rotary_cache_writes_fp8_caches_as_the_cpu() -> Result<()> {
        for d in [64, 72] {
            for scales in [CacheScales::default(), CacheScales { k: 0.02, v: 3.0 }] {
                rotary_cache_case(d, Some(scales))?;
            }
        }
        Ok(())
    }

    /// The values of an FP8 cache tensor.
    fn decoded(t: &Tensor) -> Result<Vec<f32>> {
        let bytes = t.flatten_all()?.to_device(&Device::Cpu)?.to_vec1::<u8>()?;
        Ok(bytes
            .iter()
            .map(|&b| rserve_kernels::fp8::decode(b))
            .collect())
    }

    fn rotary_cache_case(d: usize, fp8: Option<CacheScales>) -> Result<()> {
        let (t, h, kvh, max_pos, blocks, bs) = (5, 4, 2, 50, 4, 4);
        let cpu = Device::Cpu;
        let dev = gpu();
        for (dtype, tol) in CASES {
            let qkv = Tensor::randn(0f32, 1., (t, h + 2 * kvh, d), &cpu)?.to_dtype(dtype)?;
            let positions = Tensor::new(&[0u32, 3, 7, 20, 49], &cpu)?;
            let (cos, sin) = tables(max_pos, d, dtype, &cpu)?;
            let cache = || {
                let x = Tensor::randn(0f32, 1., (blocks, bs, kvh, d), &cpu)?;
                match fp8 {
                    Some(_) => {
                        let v = x.flatten_all()?.to_vec1::<f32>()?;
                        let b: Vec<u8> =
                            v.iter().map(|&x| rserve_kernels::fp8::encode(x)).collect();
                        Tensor::from_vec(b, (blocks, bs, kvh, d), &cpu)
                    }
                    None => x.to_dtype(dtype),
                }
            };
            let scales = fp8.unwrap_or_default();
            let (kc, vc) = (cache()?, cache()?);
            let slots = vec![0i64, 5, -1, 14, 9];
            let meta = |dev: &Device| {
                AttentionMetadata::new(
                    slots.clone(),
                    vec![0, 1, 2, 3],
                    4,
                    vec![15],
                    vec![0, 5],
                    dev,
                )
            };
            let want = (qkv.copy()?, kc.copy()?, vc.copy()?);
            rotary_qk_cache_(
                &want.0,
                &positions,
                &cos,
                &sin,
                (h, kvh),
                &want.1,
                &want.2,
                &meta(&cpu)?,
                scales,
            )?;
            let got = (
                qkv.to_device(&dev)?,
                kc.to_device(&dev)?,
                vc.to_device(&dev)?,
            );
            let (dc, ds) = (cos.to_device(&dev)?, sin.to_device(&dev)?);
            let dpos = positions.to_device(&dev)?;
            rotary_qk_cache_(
                &got.0,
                &dpos,
                &dc,
                &ds,
                (h, kvh),
                &got.1,
                &got.2,
                &meta(&dev)?,
                scales,
            )?;
            for (name, g, w) in [
                ("qkv", &got.0, &want.0),
                ("k", &got.1, &want.1),
                ("v", &got.2, &want.2),
            ] {
                if name != "qkv" && fp8.is_some() {
                    for (i, (a, b)) in decoded(g)?.iter().zip(decoded(w)?).enumerate() {
                        assert!(
                            (a - b).abs() <= b.abs() / 16.0 + 1.0 / 512.0,
                            "{dtype:?} d {d} {name}[{i}]: {a} vs {b}"
                        );
                    }
                    continue;
                }
                let err = max_err(&g.to_device(&cpu)?, w)?;
                assert!(
                    err <= tol.max(1e-5),
                    "{dtype:?} d {d} {name}: max error {err}"
                );
            }
            // a slot past the cache is refused before any write
            let bad = AttentionMetadata::new(
                vec![0, 1, 2, 3, 16],
                vec![0, 1, 2, 3],
                4,
                vec![15],
                vec![0, 5],
                &dev,
            )?;
            assert!(rotary_qk_cache_(
                &got.0,
                &dpos,
                &dc,
                &ds,
                (h, kvh),
                &got.1,
                &got.2,
                &bad,
                CacheScales::default()
            )
            .is_err());
        }
        Ok(())
    }

    #[test]
    fn cuda_add_bias_equals_the_broadcast_add() -> Result<()> {
        // whole 16-byte vectors (6840, 1280 columns), single elements (3420 in 16-bit, 1279)
        let dev = gpu();
        for (rows, cols) in [(37, 6840), (5, 1280), (9, 3420), (3, 1279), (1, 8)] {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let y = Tensor::randn(0f32, 3.0, (rows, cols), &dev)?.to_dtype(dtype)?;
                let b = Tensor::randn(0f32, 1.0, cols, &dev)?.to_dtype(dtype)?;
                let got = rserve_kernels::add_bias(&y, &b)?.to_dtype(DType::F32)?;
                let want = y.broadcast_add(&b)?.to_dtype(DType::F32)?;
                assert_eq!(
                    got.flatten_all()?.to_vec1::<f32>()?,
                    want.flatten_all()?.to_vec1::<f32>()?,
                    "{rows}x{cols} {dtype:?}"
                );
            }
        }
        Ok(())
    }

    #[test]
    fn cuda_linear_bias_rounds_the_f32_product_plus_bias_once() -> Result<()> {
        // prompt-sized rows take the cuBLASLt epilogue; a decode batch (4 rows) and f32 the
        // product then add_bias
        let dev = gpu();
        for (m, k, n) in [
            (37, 1280, 3840),
            (300, 1280, 1288),
            (4, 1280, 1280),
            (64, 512, 8),
        ] {
            for dtype in [DType::BF16, DType::F16, DType::F32] {
                let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?.to_dtype(dtype)?;
                let w = (Tensor::randn(0f32, 1.0, (n, k), &dev)? / (k as f64).sqrt())?
                    .to_dtype(dtype)?;
                let b = Tensor::randn(0f32, 1.0, n, &dev)?.to_dtype(dtype)?;
                let got = rserve_kernels::linear_bias(&x, &w, &b)?;
                assert_eq!(got.dims(), [m, n]);
                assert_eq!(got.dtype(), dtype);
                let got = got.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                let two_step = rserve_kernels::add_bias(&rserve_kernels::linear_rows(&x, &w)?, &b)?
                    .to_dtype(DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                if m <= 4 || dtype == DType::F32 {
                    assert_eq!(got, two_step, "{m}x{k}x{n} {dtype:?}: the two-step path");
                    continue;
                }
                let f = |t: &Tensor| t.to_dtype(DType::F32);
                let exact = f(&x)?
                    .matmul(&f(&w)?.t()?)?
                    .broadcast_add(&f(&b)?)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                // one rounding of the f32 sum: half an ulp of the dtype, and a little for the
                // order of the f32 sums
                let rel = if dtype == DType::BF16 {
                    1.0 / 256.0
                } else {
                    1.0 / 2048.0
                };
                for (i, (g, e)) in got.iter().zip(&exact).enumerate() {
                    assert!(
                        (g - e).abs() <= rel * e.abs() + 1e-3,
                        "{m}x{k}x{n} {dtype:?} [{i}]: {g} against {e}"
                    );
                }
            }
        }
        Ok(())
    }

    #[test]
    fn cuda_to_f32_equals_the_cast() -> Result<()> {
        // whole vectors, a ragged tail, a strided input, and f32 passing through
        let dev = gpu();
        for dtype in [DType::BF16, DType::F16] {
            for (rows, cols) in [(256, 4096), (3, 1001), (1, 5)] {
                let x = Tensor::randn(0f32, 3.0, (rows, cols), &dev)?.to_dtype(dtype)?;
                let got = rserve_kernels::to_f32(&x)?;
                assert_eq!(got.dtype(), DType::F32);
                assert_eq!(got.dims(), x.dims());
                let want = x.to_dtype(DType::F32)?;
                assert_eq!(max_err(&got, &want)?, 0.0, "{dtype:?} {rows}x{cols}");
            }
            let t = Tensor::randn(0f32, 1.0, (64, 24), &dev)?
                .to_dtype(dtype)?
                .t()?;
            assert_eq!(
                max_err(&rserve_kernels::to_f32(&t)?, &t.to_dtype(DType::F32)?)?,
                0.0
            );
        }
        let f = Tensor::randn(0f32, 1.0, (4, 4), &dev)?;
        assert_eq!(max_err(&rserve_kernels::to_f32(&f)?, &f)?, 0.0);
        Ok(())
    }

    #[test]
    fn cuda_to_f32_into_fills_the_first_rows_of_a_buffer() -> Result<()> {
        // the graphs' logits buffer: the cast's values in the first rows, the rest untouched
        let dev = gpu();
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            for (rows, cols) in [(3, 1001), (256, 4096)] {
                let buf = Tensor::full(-7f32, (300, cols), &dev)?;
                let x = Tensor::randn(0f32, 3.0, (rows, cols), &dev)?.to_dtype(dtype)?;
                rserve_kernels::to_f32_into(&x, &buf)?;
                let want = x.to_dtype(DType::F32)?;
                assert_eq!(max_err(&buf.narrow(0, 0, rows)?, &want)?, 0.0, "{dtype:?}");
                let rest = buf
                    .narrow(0, rows, 300 - rows)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                assert!(rest.iter().all(|&v| v == -7.0), "{dtype:?}: past the rows");
            }
        }
        let small = Tensor::zeros((2, 5), DType::F32, &dev)?;
        let x = Tensor::zeros((3, 5), DType::BF16, &dev)?;
        assert!(
            rserve_kernels::to_f32_into(&x, &small).is_err(),
            "too small"
        );
        Ok(())
    }

    #[test]
    fn cuda_graph_replays_dependents_and_counts_them() -> Result<()> {
        // norm -> add -> SiLU-and-multiply -> cast, the dependents allocating their outputs: the
        // graph computes what the launches do, and its shape counts what capture made of them
        use rserve_kernels::graph::Graph;
        let dev = gpu();
        let x = Tensor::randn(0f32, 1.0, (4, 512), &dev)?.to_dtype(DType::BF16)?;
        let res = Tensor::randn(0f32, 1.0, (4, 512), &dev)?.to_dtype(DType::BF16)?;
        let w = Tensor::randn(1f32, 0.1, 512, &dev)?.to_dtype(DType::BF16)?;
        let out = Tensor::zeros((4, 256), DType::F32, &dev)?;
        let step = || -> Result<()> {
            let (normed, sum) = add_rms_norm(&x, &res, &w, 1e-6)?;
            let act = silu_and_mul(&(normed + sum)?)?;
            rserve_kernels::to_f32_into(&act, &out)
        };
        step()?;
        let want = out.to_vec2::<f32>()?;
        let g = Graph::capture(&dev, step)?;
        rserve_kernels::to_f32_into(&Tensor::zeros((4, 256), DType::BF16, &dev)?, &out)?;
        g.launch()?;
        assert_eq!(out.to_vec2::<f32>()?, want);
        let s = g.shape;
        eprintln!("{s:?}");
        assert!(s.kernels >= 4 && s.memory_nodes >= 4, "{s:?}");
        if std::env::var("RSERVE_CUDA_PDL").map_or(true, |v| v != "0") {
            // the norm and the SiLU-and-multiply
            assert!(s.dependents >= 2, "{s:?}");
        }
        assert!(s.overlapping + s.behind_memory <= s.dependents, "{s:?}");
        Ok(())
    }

    #[test]
    fn cuda_graph_with_detached_allocations_overlaps_its_dependents() -> Result<()> {
        // norm -> SiLU-and-multiply -> norm, each allocating its output and dropping tensors
        // between launches: with detached allocations every dependent after the first hangs on
        // the kernel before it by a programmatic edge, and the replay computes what the launches do
        use rserve_kernels::graph::{CaptureOptions, Graph};
        let dev = gpu();
        let x = Tensor::randn(0f32, 1.0, (4, 1024), &dev)?.to_dtype(DType::BF16)?;
        let res = Tensor::randn(0f32, 1.0, (4, 1024), &dev)?.to_dtype(DType::BF16)?;
        let w = Tensor::randn(1f32, 0.1, 1024, &dev)?.to_dtype(DType::BF16)?;
        let w2 = Tensor::randn(1f32, 0.1, 512, &dev)?.to_dtype(DType::BF16)?;
        let res2 = Tensor::randn(0f32, 1.0, (4, 512), &dev)?.to_dtype(DType::BF16)?;
        let out = Tensor::zeros((4, 512), DType::F32, &dev)?;
        let step = || -> Result<()> {
            let (sum, normed) = add_rms_norm(&x, &res, &w, 1e-6)?;
            drop(sum);
            let act = silu_and_mul(&normed)?;
            drop(normed);
            let (_sum, normed) = add_rms_norm(&act, &res2, &w2, 1e-6)?;
            drop(act);
            rserve_kernels::to_f32_into(&normed, &out)
        };
        step()?;
        let want = out.to_vec2::<f32>()?;
        let options = CaptureOptions {
            detach_allocations: true,
        };
        let g = Graph::capture_with(&dev, options, step)?;
        rserve_kernels::to_f32_into(&Tensor::zeros((4, 512), DType::BF16, &dev)?, &out)?;
        g.launch()?;
        assert_eq!(out.to_vec2::<f32>()?, want);
        g.launch()?;
        assert_eq!(out.to_vec2::<f32>()?, want);
        let s = g.shape;
        eprintln!("{s:?}");
        if std::env::var("RSERVE_CUDA_PDL").map_or(true, |v| v != "0") {
            // two norms and the SiLU-and-multiply; only the first has no kernel before it
            assert!(s.dependents >= 3, "{s:?}");
            assert!(s.overlapping + 1 >= s.dependents, "{s:?}");
            assert!(s.behind_memory <= 1, "{s:?}");
        }
        Ok(())
    }

    #[test]
    fn cuda_graph_with_detached_allocations_keeps_large_ones_sharing_memory() -> Result<()> {
        // eight 16 MiB outputs, each dropped before a small kernel whose detached output lifts
        // the frees before it: only detached allocations' frees are lifted, so each large output
        // still comes after the free of the one before and may take its memory, as in a plain
        // capture (were its free lifted too, the eight would hold 128 MiB)
        use rserve_kernels::graph::{graph_memory_in_use, CaptureOptions, Graph};
        let dev = gpu();
        let big = Tensor::randn(0f32, 1.0, (1024, 16384), &dev)?.to_dtype(DType::BF16)?;
        let small = Tensor::randn(0f32, 1.0, (4, 256), &dev)?.to_dtype(DType::BF16)?;
        let work = || -> Result<()> {
            for _ in 0..8 {
                drop(silu_and_mul(&big)?);
                drop(silu_and_mul(&small)?);
            }
            Ok(())
        };
        let in_graphs = |detach_allocations| -> Result<usize> {
            let before = graph_memory_in_use(&dev)?;
            let g = Graph::capture_with(&dev, CaptureOptions { detach_allocations }, work)?;
            g.launch()?;
            dev.synchronize()?;
            let used = graph_memory_in_use(&dev)?.saturating_sub(before);
            drop(g);
            dev.synchronize()?;
            Ok(used)
        };
        let plain = in_graphs(false)?;
        let detached = in_graphs(true)?;
        eprintln!("graph memory in use: plain {plain} B, detached {detached} B");
        assert!(
            detached <= plain + (32 << 20),
            "plain {plain} B, detached {detached} B"
        );
        Ok(())
    }

    #[test]
    fn cuda_quick_gelu_matches_reference() -> Result<()> {
        use rserve_kernels::activation::{quick_gelu, quick_gelu_reference};
        let dev = gpu();
        for (dtype, tol) in CASES {
            // whole 16-byte vectors, a tail past them, and a strided input (made contiguous)
            for (t, c) in [(1, 8), (300, 5120), (3, 37), (2, 4097)] {
                let x = (Tensor::randn(0f32, 3., (t, c), &Device::Cpu)?).to_dtype(dtype)?;
                // the reference in f32, then rounded once as the kernel does
                let want = quick_gelu_reference(&x.to_dtype(DType::F32)?)?.to_dtype(dtype)?;
                let got = quick_gelu(&x.to_device(&dev)?)?.to_device(&Device::Cpu)?;
                assert_eq!(got.dims(), &[t, c]);
                let err = max_rel_err(&got, &want)?;
                assert!(err <= tol, "{dtype:?} {t}x{c}: {err}");
                let xt = x.t()?.to_device(&dev)?;
                let got = quick_gelu(&xt)?.to_device(&Device::Cpu)?;
                let err = max_rel_err(&got, &want.t()?)?;
                assert!(err <= tol, "{dtype:?} {t}x{c} transposed: {err}");
            }
        }
        Ok(())
    }

    #[test]
    fn cuda_silu_and_mul_matches_reference() -> Result<()> {
        let dev = gpu();
        for (dtype, tol) in CASES {
            // whole 16-byte vectors per row, and rows that are not (the element-wise path)
            for (t, inter) in [(1, 8), (5, 14336), (300, 18944), (2, 7), (3, 36)] {
                let gu = Tensor::randn(0f32, 2., (t, 2 * inter), &Device::Cpu)?.to_dtype(dtype)?;
                let want = silu_and_mul_reference(&gu)?;
                let got = silu_and_mul(&gu.to_device(&dev)?)?.to_device(&Device::Cpu)?;
                assert_eq!(got.dims(), &[t, inter]);
                let err = max_rel_err(&got, &want)?;
                assert!(err <= tol, "{dtype:?} {t}x{inter}: {err}");
            }
        }
        Ok(())
    }

    #[test]
    fn cuda_add_rms_norm_matches_reference() -> Result<()> {
        let dev = gpu();
        for (dtype, tol) in CASES {
            // rows of whole 16-byte vectors (several per thread in the last), and rows that are not
            for (t, hidden) in [
                (1, 64),
                (3, 4096),
                (257, 3584),
                (2, 100),
                (2, 30),
                (2, 16384),
            ] {
                let cpu = Device::Cpu;
                let x = Tensor::randn(0f32, 1., (t, hidden), &cpu)?.to_dtype(dtype)?;
                let r = Tensor::randn(0f32, 1., (t, hidden), &cpu)?.to_dtype(dtype)?;
                let w = Tensor::randn(1f32, 0.1, hidden, &cpu)?.to_dtype(dtype)?;
                let (ws, wn) = add_rms_norm_reference(&x, &r, &w, 1e-5)?;
                let (gs, gn) = add_rms_norm(
                    &x.to_device(&dev)?,
                    &r.to_device(&dev)?,
                    &w.to_device(&dev)?,
                    1e-5,
                )?;
                assert!(gs.is_contiguous() && gn.is_contiguous());
                let es = max_rel_err(&gs.to_device(&cpu)?, &ws)?;
                let en = max_rel_err(&gn.to_device(&cpu)?, &wn)?;
                assert!(es <= tol, "{dtype:?} sum: {es}");
                assert!(en <= tol, "{dtype:?} norm: {en}");
            }
        }
        Ok(())
    }

    /// LayerNorm alone and after the residual add against candle's ops on the CPU (which take
    /// the statistics as E[x^2] - mean^2 where the kernel takes two passes, so inputs with a
    /// large mean against their spread are left out of the comparison).
    #[test]
    fn cuda_layer_norms_match_reference() -> Result<()> {
        use rserve_kernels::layer_norm::{
            add_layer_norm, add_layer_norm_reference, layer_norm, layer_norm_reference,
        };
        let dev = gpu();
        let cpu = Device::Cpu;
        for (dtype, tol) in CASES {
            // rows of whole 16-byte vectors (one or several per thread), rows that are not, and
            // the towers' widths (CLIP-L 1,024, Qwen2-VL 1,280)
            for (t, hidden) in [
                (1, 64),
                (3, 1024),
                (300, 1280),
                (2, 100),
                (2, 30),
                (2, 16384),
            ] {
                let x = (Tensor::randn(0f32, 2., (t, hidden), &cpu)? + 0.5)?.to_dtype(dtype)?;
                let r = Tensor::randn(0f32, 1., (t, hidden), &cpu)?.to_dtype(dtype)?;
                let w = Tensor::randn(1f32, 0.1, hidden, &cpu)?.to_dtype(dtype)?;
                let b = Tensor::randn(0f32, 0.1, hidden, &cpu)?.to_dtype(dtype)?;
                let g = |v: &Tensor| v.to_device(&dev);
                let c = |v: &Tensor| v.to_device(&cpu);
                let want = layer_norm_reference(&x, &w, &b, 1e-6)?;
                let got = layer_norm(&g(&x)?, &g(&w)?, &g(&b)?, 1e-6)?;
                assert_eq!(got.dims(), &[t, hidden]);
                let err = max_rel_err(&c(&got)?, &want)?;
                assert!(err <= tol, "{dtype:?} {t}x{hidden} norm: {err}");
                let (ws, wn) = add_layer_norm_reference(&x, &r, &w, &b, 1e-6)?;
                let (gs, gn) = add_layer_norm(&g(&x)?, &g(&r)?, &g(&w)?, &g(&b)?, 1e-6)?;
                assert!(gs.is_contiguous() && gn.is_contiguous());
                let es = max_rel_err(&c(&gs)?, &ws)?;
                let en = max_rel_err(&c(&gn)?, &wn)?;
                assert!(es <= tol, "{dtype:?} {t}x{hidden} sum: {es}");
                assert!(en <= tol, "{dtype:?} {t}x{hidden} add + norm: {en}");
            }
            // any rank, and a strided input made contiguous
            let x = Tensor::randn(0f32, 1., (2, 3, 64), &cpu)?.to_dtype(dtype)?;
            let (w, b) = (
                Tensor::ones(64, dtype, &cpu)?,
                Tensor::zeros(64, dtype, &cpu)?,
            );
            let want = layer_norm_reference(&x, &w, &b, 1e-5)?;
            let got = layer_norm(
                &x.to_device(&dev)?,
                &w.to_device(&dev)?,
                &b.to_device(&dev)?,
                1e-5,
            )?;
            assert!(max_rel_err(&got.to_device(&cpu)?, &want)? <= tol);
            let xt = x.reshape((6, 64))?.t()?.contiguous()?.t()?; // [6, 64] with strides (1, 6)
            let want = layer_norm_reference(&xt, &w, &b, 1e-5)?;
            let got = layer_norm(
                &xt.to_device(&dev)?,
                &w.to_device(&dev)?,
                &b.to_device(&dev)?,
                1e-5,
            )?;
            assert!(max_rel_err(&got.to_device(&cpu)?, &want)? <= tol);
        }
        Ok(())
    }
}
