//! The device sampler against its CPU reference distribution: support (nothing outside the
//! min-p / top-k / top-p survivors is ever drawn), empirical frequencies over many seeds, greedy
//! rows, edits, seeded reproducibility independent of the batch, and raw log-probabilities.
#![allow(clippy::unwrap_used)]

use rserve_kernels::sampling::{reference_distribution, LogitEdit, RowSampling};

/// A mask over `vocab` tokens allowing every token whose id hash is below `keep` of 256 (and
/// junk bits past the vocabulary, which must be ignored).
fn random_mask(vocab: usize, seed: u32, keep: u32) -> Vec<u32> {
    let words = vocab.div_ceil(32) + 1;
    (0..words as u32)
        .map(|w| {
            (0..32u32).fold(0u32, |m, b| {
                let h = (w * 32 + b).wrapping_mul(2654435761).wrapping_add(seed) >> 24;
                m | (u32::from(h < keep) << b)
            })
        })
        .collect()
}

#[test]
fn the_cpu_bitmask_masks_exactly_the_cleared_bits() {
    use candle_core::{Device, Tensor};
    use rserve_kernels::sampling::{apply_token_bitmask, mask_row, ReadbackPool};
    let (rows, vocab) = (4usize, 1000usize);
    let data: Vec<f32> = (0..rows * vocab).map(|i| i as f32 * 0.01).collect();
    let logits = Tensor::from_vec(data.clone(), (rows, vocab), &Device::Cpu).unwrap();
    let words = vocab.div_ceil(32) + 1;
    let masks: Vec<u32> = [random_mask(vocab, 1, 128), random_mask(vocab, 2, 3)].concat();
    let mut pool = ReadbackPool::default();
    apply_token_bitmask(&logits, &[2, 0], &masks, words, &mut pool).unwrap();
    let got = logits.to_vec2::<f32>().unwrap();
    for (r, row) in got.iter().enumerate() {
        let mut want = data[r * vocab..][..vocab].to_vec();
        match r {
            2 => mask_row(&mut want, &masks[..words]),
            0 => mask_row(&mut want, &masks[words..]),
            _ => {}
        }
        assert_eq!(row, &want, "row {r}");
    }
    assert!(got[0].iter().any(|x| x.is_finite()) && got[0].iter().any(|x| !x.is_finite()));
    assert!(apply_token_bitmask(&logits, &[4], &masks[..words], words, &mut pool).is_err());
    assert!(apply_token_bitmask(&logits, &[0], &masks[..3], 3, &mut pool).is_err());
}

#[test]
fn reference_applies_thresholds_in_order() {
    let row = [3.0f32, 2.0, 1.0, 0.0, -1.0];
    let greedy = reference_distribution(&row, &RowSampling::default());
    assert_eq!(greedy, vec![1.0, 0.0, 0.0, 0.0, 0.0]);
    let top2 = reference_distribution(
        &row,
        &RowSampling {
            temperature: 1.0,
            top_k: 2,
            ..Default::default()
        },
    );
    assert!((top2[0] - 1.0 / (1.0 + (-1f64).exp())).abs() < 1e-9);
    assert_eq!(&top2[2..], &[0.0, 0.0, 0.0]);
    let suppressed = reference_distribution(
        &row,
        &RowSampling {
            edits: vec![LogitEdit {
                token: 0,
                bias: 0.0,
                repetition_penalty: 1.0,
                subtract: f32::INFINITY,
            }],
            ..Default::default()
        },
    );
    assert_eq!(suppressed[1], 1.0);
    let nucleus = reference_distribution(
        &row,
        &RowSampling {
            temperature: 1.0,
            top_p: 0.5,
            ..Default::default()
        },
    );
    assert_eq!(nucleus[0], 1.0, "the top token alone holds > 50%");
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use candle_core::{Device, Result, Tensor};
    use rserve_kernels::sampling::sample_rows;

    fn gpu() -> Device {
        Device::new_cuda(0).expect("a CUDA device")
    }

    fn random_row(vocab: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..vocab)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 8.0
            })
            .collect()
    }

    /// Draws `n` samples of `row` under `s` (seeds 0..n) and compares with the reference: no draw
    /// outside the support, and a total variation distance within three times what sampling noise
    /// alone gives (`E[TV] <= sum_i sqrt(p_i) / sqrt(2 pi n)`), times `slack`.
    fn check(row: &[f32], s: &RowSampling, n: usize, slack: f64) -> Result<()> {
        let v = row.len();
        let data: Vec<f32> = (0..n).flat_map(|_| row.iter().copied()).collect();
        let logits = Tensor::from_vec(data, (n, v), &gpu())?;
        let settings: Vec<RowSampling> = (0..n)
            .map(|i| RowSampling {
                seed: i as u64 * 7919 + 1,
                ..s.clone()
            })
            .collect();
        let got = sample_rows(&logits, &settings)?;
        let want = reference_distribution(row, s);
        let mut freq = vec![0f64; v];
        for &(t, _) in &got {
            assert!(
                want[t as usize] > 0.0,
                "token {t} drawn outside the support ({s:?})"
            );
            freq[t as usize] += 1.0 / n as f64;
        }
        let tv: f64 = freq
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .sum::<f64>()
            / 2.0;
        let noise = want.iter().map(|p| p.sqrt()).sum::<f64>()
            / (2.0 * std::f64::consts::PI * n as f64).sqrt();
        assert!(
            tv < 3.0 * noise * slack + 0.002,
            "total variation {tv}, noise {noise} ({s:?})"
        );
        // raw log-probabilities of the chosen tokens
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = m + row.iter().map(|&x| (x - m).exp()).sum::<f32>().ln();
        for &(t, lp) in got.iter().take(50) {
            assert!((lp - (row[t as usize] - lse)).abs() < 1e-3, "logprob {lp}");
        }
        Ok(())
    }

    #[test]
    fn cuda_distributions_match_reference() -> Result<()> {
        let row = random_row(1000, 3);
        let base = RowSampling {
            temperature: 1.0,
            ..Default::default()
        };
        let cases = [
            RowSampling {
                temperature: 0.8,
                ..base.clone()
            },
            RowSampling {
                top_k: 20,
                ..base.clone()
            },
            RowSampling {
                temperature: 0.7,
                top_p: 0.9,
                ..base.clone()
            },
            RowSampling {
                temperature: 1.2,
                min_p: 0.05,
                ..base.clone()
            },
            RowSampling {
                top_k: 50,
                top_p: 0.8,
                min_p: 0.02,
                edits: vec![
                    LogitEdit {
                        token: 5,
                        bias: 2.0,
                        repetition_penalty: 1.3,
                        subtract: 0.5,
                    },
                    LogitEdit {
                        token: 9,
                        bias: 0.0,
                        repetition_penalty: 1.0,
                        subtract: f32::INFINITY,
                    },
                ],
                ..base.clone()
            },
        ];
        for s in &cases {
            check(&row, s, 20000, 1.0)?;
        }
        Ok(())
    }

    #[test]
    fn cuda_bitmask_matches_the_cpu_rule() -> Result<()> {
        use rserve_kernels::sampling::{apply_token_bitmask, mask_row, ReadbackPool};
        let (rows, vocab) = (5usize, 128_256usize);
        let data: Vec<f32> = (0..rows as u64)
            .flat_map(|r| random_row(vocab, r))
            .collect();
        let words = vocab.div_ceil(32);
        let mut pool = ReadbackPool::default();
        // twice: the second call reuses the staging buffer
        for round in 0..2u32 {
            let logits = Tensor::from_vec(data.clone(), (rows, vocab), &gpu())?;
            let picked = [3u32, 0, 4];
            let masks: Vec<u32> = picked
                .iter()
                .flat_map(|&r| random_mask(vocab, r + round * 7, 40)[..words].to_vec())
                .collect();
            apply_token_bitmask(&logits, &picked, &masks, words, &mut pool)?;
            let got = logits.to_vec2::<f32>()?;
            for (r, row) in got.iter().enumerate() {
                let mut want = data[r * vocab..][..vocab].to_vec();
                if let Some(i) = picked.iter().position(|&p| p as usize == r) {
                    mask_row(&mut want, &masks[i * words..][..words]);
                }
                assert_eq!(row, &want, "round {round} row {r}");
            }
            // greedy sampling of a masked row picks an allowed token
            let s = RowSampling::default();
            let out = sample_rows(&logits, &vec![s; rows])?;
            let m = &masks[..words];
            let t = out[3].0 as usize;
            assert!((m[t / 32] >> (t % 32)) & 1 == 1, "token {t} allowed");
        }
        Ok(())
    }

    #[test]
    fn cuda_greedy_edits_and_large_vocab() -> Result<()> {
        let row = random_row(152064, 11);
        let argmax = |r: &[f32]| {
            r.iter()
                .enumerate()
                .fold(
                    (0, f32::NEG_INFINITY),
                    |b, (i, &x)| if x > b.1 { (i, x) } else { b },
                )
                .0 as u32
        };
        let best = argmax(&row);
        let suppress_best = RowSampling {
            edits: vec![LogitEdit {
                token: best,
                bias: 0.0,
                repetition_penalty: 1.0,
                subtract: f32::INFINITY,
            }],
            ..Default::default()
        };
        let boost = RowSampling {
            edits: vec![LogitEdit {
                token: 77,
                bias: 100.0,
                repetition_penalty: 1.0,
                subtract: 0.0,
            }],
            ..Default::default()
        };
        let nucleus = RowSampling {
            temperature: 0.9,
            top_k: 40,
            top_p: 0.95,
            seed: 5,
            ..Default::default()
        };
        let settings = vec![
            RowSampling::default(),
            suppress_best.clone(),
            boost,
            nucleus.clone(),
        ];
        let data: Vec<f32> = (0..settings.len())
            .flat_map(|_| row.iter().copied())
            .collect();
        let logits = Tensor::from_vec(data, (settings.len(), row.len()), &gpu())?;
        let got = sample_rows(&logits, &settings)?;
        assert_eq!(got[0].0, best);
        let mut edited = row.clone();
        edited[best as usize] = f32::NEG_INFINITY;
        assert_eq!(got[1].0, argmax(&edited));
        assert_eq!(got[2].0, 77);
        assert!(reference_distribution(&row, &nucleus)[got[3].0 as usize] > 0.0);
        check(&row, &nucleus, 512, 1e6)?; // support only at this size
        Ok(())
    }

    #[test]
    fn cuda_async_samples_feed_token_ids_on_the_device() -> Result<()> {
        use rserve_kernels::sampling::{sample_rows_async, ReadbackPool};
        // greedy rows whose arg-max is token 10 * r + 3
        let (rows, vocab) = (6usize, 100usize);
        let mut data = vec![0f32; rows * vocab];
        for r in 0..rows {
            data[r * vocab + 10 * r + 3] = 5.0;
        }
        let mut pool = ReadbackPool::default();
        let mut steps = Vec::new();
        for _ in 0..3 {
            // several in flight at once, each with its own host buffer
            let logits = Tensor::from_vec(data.clone(), (rows, vocab), &gpu())?;
            let settings = vec![RowSampling::default(); rows];
            steps.push(sample_rows_async(&logits, &settings, &mut pool)?);
        }
        let ids = Tensor::from_vec(vec![1u32; 8], 8, &gpu())?;
        steps[0].write_tokens(&ids, &[(0, 5), (2, 0), (7, 3)])?;
        assert_eq!(ids.to_vec1::<u32>()?, vec![53, 1, 3, 1, 1, 1, 1, 33]);
        assert!(
            steps[0].write_tokens(&ids, &[(8, 0)]).is_err(),
            "row past the ids"
        );
        assert!(
            steps[0].write_tokens(&ids, &[(0, 6)]).is_err(),
            "row never sampled"
        );
        let want: Vec<u32> = (0..rows as u32).map(|r| 10 * r + 3).collect();
        for step in steps {
            assert_eq!(step.len(), rows);
            let got = step.wait(&mut pool)?;
            assert_eq!(got.iter().map(|x| x.0).collect::<Vec<_>>(), want);
        }
        // the buffers are reused
        let logits = Tensor::from_vec(data, (rows, vocab), &gpu())?;
        let again = sample_rows_async(&logits, &vec![RowSampling::default(); rows], &mut pool)?;
        assert_eq!(again.wait(&mut pool)?.len(), rows);
        Ok(())
    }

    #[test]
    fn cuda_seeded_rows_ignore_the_batch() -> Result<()> {
        let row = random_row(5000, 17);
        let s = RowSampling {
            temperature: 1.0,
            top_p: 0.95,
            seed: 1234,
            ..Default::default()
        };
        let mut picks = Vec::new();
        for batch in [1usize, 3, 64] {
            let mut settings = vec![
                RowSampling {
                    temperature: 0.5,
                    seed: 99,
                    ..Default::default()
                };
                batch
            ];
            settings[batch / 2] = s.clone();
            let other = random_row(5000, 23);
            let data: Vec<f32> = (0..batch)
                .flat_map(|i| {
                    if i == batch / 2 {
                        row.clone()
                    } else {
                        other.clone()
                    }
                })
                .collect();
            let logits = Tensor::from_vec(data, (batch, 5000), &gpu())?;
            picks.push(sample_rows(&logits, &settings)?[batch / 2]);
        }
        assert!(picks.windows(2).all(|w| w[0] == w[1]), "{picks:?}");
        Ok(())
    }
}
