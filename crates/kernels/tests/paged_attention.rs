//! Paged attention against dense reference attention: each sequence's K/V is written into scrambled
//! cache blocks, then decode tokens, whole prompts and prompt chunks are attended in one call and
//! compared, sequence by sequence, with the textbook formula computed in f32 on the CPU.
//! The same cases run on the CPU kernel always and on the CUDA kernel with the `cuda` feature.
#![allow(clippy::unwrap_used)]

mod attention_case;

use attention_case::{check, Case};
use candle_core::{DType, Device, Result, Tensor};
use rserve_kernels::{
    copy_blocks, paged_attention, reshape_and_cache, AttentionMetadata, PagedAttentionParams,
};

fn mixed(dev: &Device) -> Result<()> {
    check(
        dev,
        &Case {
            dtype: DType::F32,
            heads: 4,
            kvh: 2,
            d: 16,
            bs: 16,
            seqs: &[(1, 1), (1, 37), (20, 20), (5, 50), (1, 16)],
            window: None,
            tol: 1e-5,
            last_rows: None,
        },
    )
}

fn mqa_block32(dev: &Device) -> Result<()> {
    check(
        dev,
        &Case {
            dtype: DType::F32,
            heads: 8,
            kvh: 1,
            d: 64,
            bs: 32,
            seqs: &[(3, 70), (1, 33)],
            window: None,
            tol: 1e-5,
            last_rows: None,
        },
    )
}

fn sliding(dev: &Device) -> Result<()> {
    check(
        dev,
        &Case {
            dtype: DType::F32,
            heads: 4,
            kvh: 4,
            d: 8,
            bs: 16,
            seqs: &[(12, 40), (1, 9), (1, 3)],
            window: Some(8),
            tol: 1e-5,
            last_rows: None,
        },
    )
}

fn half(dev: &Device) -> Result<()> {
    for (dtype, window, tol) in [(DType::BF16, None, 2e-2), (DType::F16, Some(10), 5e-3)] {
        check(
            dev,
            &Case {
                dtype,
                heads: 4,
                kvh: 2,
                d: 32,
                bs: 16,
                seqs: &[(7, 30), (1, 45)],
                window,
                tol,
                last_rows: None,
            },
        )?;
    }
    Ok(())
}

#[test]
fn cpu_mixed_decode_and_prefill() -> Result<()> {
    mixed(&Device::Cpu)
}

#[test]
fn cpu_mqa_block32_head64() -> Result<()> {
    mqa_block32(&Device::Cpu)
}

#[test]
fn cpu_sliding_window() -> Result<()> {
    sliding(&Device::Cpu)
}

#[test]
fn cpu_half_precision() -> Result<()> {
    half(&Device::Cpu)
}

#[test]
fn rejects_block_outside_cache() -> Result<()> {
    let dev = Device::Cpu;
    let c = Tensor::zeros((2, 4, 1, 4), DType::F32, &dev)?;
    let q = Tensor::zeros((1, 1, 4), DType::F32, &dev)?;
    let p = PagedAttentionParams {
        scale: 1.0,
        sliding_window: None,
    };
    let meta = AttentionMetadata::new(vec![-1], vec![7], 1, vec![1], vec![0, 1], &dev)?;
    assert!(paged_attention(&q, &c, &c, &meta, &p).is_err());
    let meta = AttentionMetadata::new(vec![8], vec![0], 1, vec![1], vec![0, 1], &dev)?;
    let k = Tensor::zeros((1, 1, 4), DType::F32, &dev)?;
    assert!(reshape_and_cache(&k, &k, &c, &c.clone(), &meta).is_err());
    Ok(())
}

#[test]
fn split_keys_only_when_the_grid_is_small_and_contexts_long() -> Result<()> {
    use rserve_kernels::paged_attention::LaunchPlan;
    let plan = LaunchPlan::new(32, 8, 128, 2)?;
    assert_eq!(plan.split_keys(1, 300, 132), 0, "short context");
    assert_eq!(plan.split_keys(64, 4000, 132), 0, "enough CTAs already");
    let k = plan.split_keys(1, 4000, 132);
    assert!(k >= 256 && k % plan.tile_keys == 0, "{k}");
    assert!(4000usize.div_ceil(k) <= 264 / 8 + 1);
    Ok(())
}

#[test]
fn decode_splits_fill_the_gpu_only_when_needed() {
    use rserve_kernels::paged_attention::{decode_group_bucket, decode_splits};
    assert_eq!(decode_splits(512, 4000, 132), 1, "enough CTAs");
    assert_eq!(decode_splits(8, 100, 132), 1, "short context");
    assert_eq!(decode_splits(8, 600, 132), 9, "slices of at least 64 keys");
    assert_eq!(
        decode_splits(8, 1 << 20, 132),
        33,
        "two CTAs per multiprocessor"
    );
    assert_eq!(decode_splits(1, 1 << 20, 132), 264);
    assert_eq!(decode_group_bucket(1), Some(1));
    assert_eq!(decode_group_bucket(7), Some(8));
    assert_eq!(decode_group_bucket(17), None);
}

#[test]
fn tensor_core_decode_narrows_its_ctas_for_large_grids() {
    use rserve_kernels::paged_attention::{decode_tc_shared_bytes, decode_tc_warps};
    assert_eq!(decode_tc_warps(96, 132), 4, "batch 1, split in 12");
    assert_eq!(decode_tc_warps(264, 132), 4, "two CTAs per multiprocessor");
    assert_eq!(decode_tc_warps(320, 132), 2, "40 sequences of 8 KV heads");
    assert_eq!(decode_tc_warps(2048, 132), 2);
    // four 2-warp CTAs of head dim 128 fit a Hopper multiprocessor's 228 KiB (1 KiB each kept)
    assert_eq!(decode_tc_shared_bytes(2, 128, 2, false, true), 52_224);
    assert!(4 * (decode_tc_shared_bytes(2, 128, 2, false, true) + 1024) <= 228 * 1024);
    assert_eq!(decode_tc_shared_bytes(4, 128, 2, false, false), 2 * 52_224);
    // an FP8 cache read straight into fragments: three stages of bytes, 8 such CTAs per SM
    assert_eq!(decode_tc_shared_bytes(2, 128, 2, true, true), 24_576);
    assert_eq!(
        decode_tc_shared_bytes(2, 128, 2, true, false),
        2 * (8_704 + 12_288)
    );
}

#[test]
fn the_early_decode_form_only_in_decode_only_steps_of_four_warps() {
    use rserve_kernels::paged_attention::decode_tc_layout;
    assert_eq!(decode_tc_layout(true, 4, true, true), "tk_early");
    assert_eq!(
        decode_tc_layout(true, 4, true, false),
        "tk",
        "not asked for"
    );
    assert_eq!(decode_tc_layout(true, 4, false, true), "tk", "a mixed step");
    assert_eq!(
        decode_tc_layout(true, 2, true, true),
        "tk",
        "many sequences"
    );
    assert_eq!(
        decode_tc_layout(false, 4, true, true),
        "tc",
        "a group past 8 heads"
    );
}

#[test]
fn rejects_inconsistent_metadata() {
    let dev = Device::Cpu;
    // more queries than context
    assert!(AttentionMetadata::new(vec![0, 1], vec![0], 1, vec![1], vec![0, 2], &dev).is_err());
    // query_start_loc does not cover the tokens
    assert!(AttentionMetadata::new(vec![0, 1], vec![0], 1, vec![2], vec![0, 1], &dev).is_err());
    // table too small
    assert!(AttentionMetadata::new(vec![0], vec![0], 2, vec![1], vec![0, 1], &dev).is_err());
}

fn cache_writes_and_copies(dev: &Device) -> Result<()> {
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let kc = Tensor::zeros((3, 2, 1, 2), dtype, dev)?;
        let vc = Tensor::zeros((3, 2, 1, 2), dtype, dev)?;
        let k = Tensor::new(&[[[1f32, 2.]], [[3., 4.]], [[5., 6.]]], dev)?.to_dtype(dtype)?;
        let v = (&k * 10.0)?;
        let meta = AttentionMetadata::new(vec![5, -1, 0], vec![0], 1, vec![3], vec![0, 3], dev)?;
        reshape_and_cache(&k, &v, &kc, &vc, &meta)?;
        let kv = kc.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(kv, vec![5., 6., 0., 0., 0., 0., 0., 0., 0., 0., 1., 2.]);
        assert_eq!(
            vc.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?[10],
            10.0
        );
        copy_blocks(&kc, &[(2, 1)])?;
        let kv = kc.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(kv, vec![5., 6., 0., 0., 0., 0., 1., 2., 0., 0., 1., 2.]);
    }
    Ok(())
}

#[test]
fn cpu_cache_writes_and_copies() -> Result<()> {
    cache_writes_and_copies(&Device::Cpu)
}

#[cfg(feature = "cuda")]
mod cuda {
    //! The same cases on the GPU, plus every head dim, dtype and block size the models use.
    use super::attention_case::check_planned;
    use super::*;

    fn gpu() -> Device {
        Device::new_cuda(0).expect("a CUDA device")
    }

    #[test]
    fn cuda_mixed_decode_and_prefill() -> Result<()> {
        mixed(&gpu())
    }

    #[test]
    fn cuda_mqa_block32_head64() -> Result<()> {
        mqa_block32(&gpu())
    }

    #[test]
    fn cuda_sliding_window() -> Result<()> {
        sliding(&gpu())
    }

    #[test]
    fn cuda_half_precision() -> Result<()> {
        half(&gpu())
    }

    #[test]
    fn cuda_cache_writes_and_copies() -> Result<()> {
        cache_writes_and_copies(&gpu())
    }

    /// The vision encoders' segment attention kernel against its composition in f32: windows of
    /// every length around a tile's edge, and a whole image's worth of patches.
    #[test]
    fn cuda_segment_attention_matches_the_composition() -> Result<()> {
        use rserve_kernels::segment_attention::SegmentPlan;
        let dev = gpu();
        let lens = [64, 1, 63, 65, 16, 200, 128, 4, 1300];
        let bounds: Vec<usize> = std::iter::once(0)
            .chain(lens.iter().scan(0, |acc, l| {
                *acc += l;
                Some(*acc)
            }))
            .collect();
        let n = *bounds.last().unwrap();
        let heads = 16;
        for d in [64, 80, 128] {
            let qkv = (Tensor::randn(0f32, 1.0, (n, 3 * heads, d), &dev)? * 2.0)?;
            // relative to the value: the output itself is rounded to the dtype
            for (dtype, tol) in [(DType::BF16, 1.2e-2), (DType::F16, 2e-3)] {
                // the reference sees the same rounded inputs, in f32
                let qkv = qkv.to_dtype(dtype)?;
                let want = SegmentPlan::composed(&bounds, n, &dev)?
                    .attend(&qkv.to_dtype(DType::F32)?, heads)?;
                let plan = SegmentPlan::new(&bounds, n, &dev, dtype, d)?;
                assert!(plan.uses_kernel(), "head dim {d} {dtype:?}");
                let got = plan.attend(&qkv, heads)?;
                let diff = ((got.to_dtype(DType::F32)? - &want)?.abs()? / (want.abs()? + 1.0)?)?
                    .max_all()?
                    .to_scalar::<f32>()?;
                assert!(
                    diff < tol,
                    "head dim {d} {dtype:?}: max relative diff {diff}"
                );
            }
        }
        Ok(())
    }

    #[test]
    fn cuda_model_shapes() -> Result<()> {
        let dev = gpu();
        let seqs: &[(usize, usize)] = &[(1, 1), (1, 300), (37, 37), (16, 120), (1, 17), (5, 64)];
        for d in [64, 80, 96, 128, 256] {
            for (heads, kvh) in [(32, 8), (28, 4), (16, 1), (8, 8)] {
                for (dtype, tol) in [(DType::BF16, 2e-2), (DType::F16, 4e-3)] {
                    for bs in [16, 32] {
                        check(
                            &dev,
                            &Case {
                                dtype,
                                heads,
                                kvh,
                                d,
                                bs,
                                seqs,
                                window: None,
                                tol,
                                last_rows: None,
                            },
                        )?;
                    }
                }
            }
        }
        // sliding window with a chunked prefill and decodes past the window
        check(
            &dev,
            &Case {
                dtype: DType::BF16,
                heads: 32,
                kvh: 8,
                d: 128,
                bs: 16,
                seqs: &[(64, 200), (1, 300), (1, 40)],
                window: Some(96),
                tol: 2e-2,
                last_rows: None,
            },
        )
    }

    /// Decode rows in bf16 over blocks of 16.
    fn bf16_decode<'a>(
        heads: usize,
        kvh: usize,
        d: usize,
        seqs: &'a [(usize, usize)],
        window: Option<usize>,
    ) -> Case<'a> {
        Case {
            dtype: DType::BF16,
            heads,
            kvh,
            d,
            bs: 16,
            seqs,
            window,
            tol: 2e-2,
            last_rows: None,
        }
    }

    #[test]
    fn cuda_split_decode_long_contexts() -> Result<()> {
        // few decode rows over long contexts: the flash-decoding split and merge path
        let dev = gpu();
        for (heads, kvh, d, window) in [
            (32, 8, 128, None),
            (16, 1, 64, None),
            (28, 4, 128, Some(1000)),
        ] {
            check(
                &dev,
                &bf16_decode(
                    heads,
                    kvh,
                    d,
                    &[(1, 3000), (1, 700), (1, 3), (1, 1025)],
                    window,
                ),
            )?;
        }
        Ok(())
    }

    #[test]
    fn cuda_decode_split_planned_for_longer_contexts() -> Result<()> {
        // a decode graph's metadata: the split is planned for the longest context the graph
        // serves, so most slices of these contexts are empty
        let dev = gpu();
        for (seqs, planned) in [
            (&[(1, 3000), (1, 700), (1, 3), (1, 1025)][..], 131_072),
            (&[(1, 20)][..], 8192),
            (&[(1, 777)][..], 4096),
        ] {
            check_planned(&dev, &bf16_decode(32, 8, 128, seqs, None), Some(planned))?;
        }
        Ok(())
    }

    #[test]
    fn cuda_decode_batches() -> Result<()> {
        // decode-only steps: many sequences (no split), few (split), every group bucket, f32 too;
        // 40 sequences of 8 KV heads take the 2-warp tensor-core kernel on 132 SMs, the others
        // the 4-warp one; groups of up to 8 take keys as the products' rows, 16 heads as rows
        let dev = gpu();
        let many: Vec<(usize, usize)> = (0..40).map(|i| (1, 1 + (i * 37) % 300)).collect();
        let few: &[(usize, usize)] = &[(1, 2000), (1, 129), (1, 64)];
        for (heads, kvh, d, dtype, tol) in [
            (32, 8, 128, DType::BF16, 2e-2),
            (28, 4, 128, DType::BF16, 2e-2),
            (8, 8, 64, DType::F16, 4e-3),
            (16, 2, 64, DType::F16, 4e-3),
            (32, 2, 128, DType::BF16, 2e-2),
            (16, 1, 256, DType::BF16, 2e-2),
            (12, 6, 80, DType::F32, 1e-4),
        ] {
            for seqs in [&many[..], few] {
                check(
                    &dev,
                    &Case {
                        dtype,
                        heads,
                        kvh,
                        d,
                        bs: 16,
                        seqs,
                        window: None,
                        tol,
                        last_rows: None,
                    },
                )?;
            }
        }
        Ok(())
    }

    #[test]
    fn cuda_decode_block_sizes() -> Result<()> {
        // the tensor-core decode kernels read a tile's keys from one cache block when blocks hold
        // whole tiles (32) and key by key otherwise (8); a split slice starts on a tile boundary
        let dev = gpu();
        let many: Vec<(usize, usize)> = (0..40).map(|i| (1, 1 + (i * 53) % 400)).collect();
        let few: &[(usize, usize)] = &[(1, 1500), (1, 77)];
        for (heads, kvh) in [(32, 8), (32, 2)] {
            for bs in [8, 32] {
                for seqs in [&many[..], few] {
                    check(
                        &dev,
                        &Case {
                            bs,
                            ..bf16_decode(heads, kvh, 128, seqs, None)
                        },
                    )?;
                }
            }
        }
        Ok(())
    }

    #[test]
    fn cuda_long_prompt_fits() -> Result<()> {
        // a 32k-token and an 8k-token prompt in a single call: no score matrix is materialised
        check(
            &gpu(),
            &Case {
                dtype: DType::BF16,
                heads: 32,
                kvh: 8,
                d: 128,
                bs: 16,
                seqs: &[(32768, 32768), (8192, 8192), (1, 4000)],
                window: None,
                tol: 2e-2,
                last_rows: Some(16),
            },
        )
    }
}
