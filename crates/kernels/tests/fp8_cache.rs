//! FP8 E4M3 KV caches (`--kv-cache-dtype fp8`): the cache writes store `x / scale` with the
//! encoder's bits, block copies move bytes, and every attention path (the CPU loop; on CUDA the
//! direct and tensor-core decode kernels, the prompt kernel and the generic kernel, split or not)
//! attends to exactly the values the cache holds, checked against the textbook formula over
//! those values.
#![allow(clippy::unwrap_used)]

mod attention_case;

use attention_case::{check_fp8, Case};
use candle_core::{DType, Device, Result, Tensor};
use rserve_kernels::fp8::{decode, encode, DECODE_TABLE};
use rserve_kernels::{
    copy_blocks, paged_attention, reshape_and_cache_scaled, AttentionMetadata, CacheScales,
    PagedAttentionParams, FP8_CACHE_DTYPE,
};

const SCALED: CacheScales = CacheScales { k: 0.05, v: 2.5 };

fn case(dtype: DType, heads: usize, kvh: usize, d: usize, seqs: &[(usize, usize)]) -> Case<'_> {
    Case {
        dtype,
        heads,
        kvh,
        d,
        bs: 16,
        seqs,
        window: None,
        tol: match dtype {
            DType::F32 => 1e-5,
            DType::F16 => 4e-3,
            _ => 2e-2,
        },
        last_rows: None,
    }
}

const MIXED: &[(usize, usize)] = &[(1, 1), (1, 37), (20, 20), (5, 50), (1, 16)];

#[test]
fn the_decode_table_is_the_decoder() {
    for b in 0..=255u8 {
        let (t, d) = (DECODE_TABLE[b as usize], decode(b));
        assert!(t == d || (t.is_nan() && d.is_nan()), "{b:#04x}: {t} vs {d}");
    }
}

#[test]
fn cpu_attention_reads_fp8_caches_exactly() -> Result<()> {
    let cpu = Device::Cpu;
    for scales in [CacheScales::default(), SCALED] {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            check_fp8(&cpu, &case(dtype, 4, 2, 16, MIXED), scales)?;
        }
        let mut window = case(DType::F32, 8, 1, 32, &[(30, 100), (1, 90)]);
        window.window = Some(24);
        check_fp8(&cpu, &window, scales)?;
    }
    Ok(())
}

/// Writes three tokens (one skipped) into FP8 caches at `scales` and copies a block.
fn writes_and_copies(dev: &Device) -> Result<()> {
    let scales = CacheScales { k: 0.5, v: 4.0 };
    let k = Tensor::new(&[[[1f32, -2.7]], [[3., 4.]], [[500., 0.013]]], dev)?;
    let v = (&k * 10.0)?;
    for dtype in [DType::F32, DType::BF16] {
        let kc = Tensor::zeros((3, 2, 1, 2), FP8_CACHE_DTYPE, dev)?;
        let vc = Tensor::zeros((3, 2, 1, 2), FP8_CACHE_DTYPE, dev)?;
        let meta = AttentionMetadata::new(vec![5, -1, 0], vec![0], 1, vec![3], vec![0, 3], dev)?;
        let (k, v) = (k.to_dtype(dtype)?, v.to_dtype(dtype)?);
        reshape_and_cache_scaled(&k, &v, &kc, &vc, &meta, scales)?;
        let bytes = |t: &Tensor| t.flatten_all()?.to_vec1::<u8>();
        let x = k.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let want = |x: f32| encode(x / scales.k);
        let kb = bytes(&kc)?;
        assert_eq!(
            kb,
            vec![
                want(x[4]),
                want(x[5]),
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                want(x[0]),
                want(x[1])
            ],
            "{dtype:?}"
        );
        // 500 / 0.5 saturates at 448
        assert_eq!(decode(kb[0]), 448.0);
        let vb = bytes(&vc)?;
        assert_eq!(decode(vb[10]) * scales.v, 10.0);
        copy_blocks(&kc, &[(2, 1)])?;
        assert_eq!(bytes(&kc)?[4..8], kb[8..12]);
    }
    Ok(())
}

#[test]
fn cpu_writes_and_copies() -> Result<()> {
    writes_and_copies(&Device::Cpu)
}

#[test]
fn mismatched_caches_and_bad_scales_are_refused() -> Result<()> {
    let cpu = Device::Cpu;
    let fp8 = Tensor::zeros((2, 4, 1, 8), FP8_CACHE_DTYPE, &cpu)?;
    let f32c = Tensor::zeros((2, 4, 1, 8), DType::F32, &cpu)?;
    let meta = AttentionMetadata::new(vec![0], vec![0], 1, vec![1], vec![0, 1], &cpu)?;
    let q = Tensor::zeros((1, 2, 8), DType::F32, &cpu)?;
    let params = PagedAttentionParams {
        scale: 1.0,
        sliding_window: None,
    };
    let err = paged_attention(&q, &fp8, &f32c, &meta, &params).expect_err("mixed caches");
    assert!(err.to_string().contains("caches"), "{err}");
    let k = Tensor::zeros((1, 1, 8), DType::F32, &cpu)?;
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let scales = CacheScales { k: bad, v: 1.0 };
        let err = reshape_and_cache_scaled(&k, &k, &fp8, &fp8.copy()?, &meta, scales)
            .expect_err("bad scale");
        assert!(err.to_string().contains("scale"), "{err}");
    }
    Ok(())
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;

    fn gpu() -> Device {
        Device::new_cuda(0).expect("a CUDA device")
    }

    #[test]
    fn cuda_writes_and_copies() -> Result<()> {
        writes_and_copies(&gpu())
    }

    /// Every kernel path: head dims 64 and 128 take the tensor-core decode kernels (heads as rows
    /// for groups of 16, keys as rows up to 8) and the prompt kernel; 80 and 96 the direct decode
    /// kernel and the generic kernel; f32 the direct and generic kernels.
    #[test]
    fn cuda_fp8_caches_on_model_shapes() -> Result<()> {
        let dev = gpu();
        let seqs: &[(usize, usize)] = &[(1, 1), (1, 300), (37, 37), (16, 120), (1, 17), (5, 64)];
        for d in [64, 80, 96, 128] {
            for (heads, kvh) in [(32, 8), (28, 4), (16, 1), (8, 8)] {
                for dtype in [DType::BF16, DType::F16] {
                    for bs in [16, 32] {
                        let mut c = case(dtype, heads, kvh, d, seqs);
                        c.bs = bs;
                        check_fp8(&dev, &c, SCALED)?;
                    }
                }
            }
        }
        check_fp8(
            &dev,
            &case(DType::F32, 8, 2, 64, seqs),
            CacheScales::default(),
        )?;
        let mut window = case(DType::BF16, 32, 8, 128, &[(64, 200), (1, 300), (1, 40)]);
        window.window = Some(96);
        check_fp8(&dev, &window, SCALED)
    }

    /// Few sequences over long contexts (the decode kernels' key split and merge) and a batch of
    /// 64 decode rows.
    #[test]
    fn cuda_fp8_split_decode_and_batches() -> Result<()> {
        let dev = gpu();
        for d in [64, 128] {
            check_fp8(
                &dev,
                &case(DType::BF16, 32, 8, d, &[(1, 3000), (1, 1500), (1, 9)]),
                SCALED,
            )?;
            let many: Vec<(usize, usize)> = (0..64).map(|i| (1, 50 + 37 * i)).collect();
            check_fp8(&dev, &case(DType::BF16, 32, 8, d, &many), SCALED)?;
        }
        Ok(())
    }
}
