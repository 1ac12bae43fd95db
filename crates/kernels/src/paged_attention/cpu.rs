//! The CPU kernel: one task per (query token, head) row, over the rayon pool. Each row walks its
//! keys a cache block at a time: the block's scores, one running maximum update and one rescale
//! of the accumulator per block (online softmax), then every value row added with its weight.
//! f32 caches with head dims that are a multiple of 8 take the AVX2 + FMA form where the host
//! has it (chosen at run time); other dtypes, FP8 bytes and other hosts take the portable form,
//! which does the same steps one value at a time (its sums run in another order, so the two
//! agree within rounding).

use super::PagedAttention;
use crate::elem::Elem;
use candle_core::Result;
use half::{bf16, f16};
use rayon::prelude::*;

/// A cache element read as f32: the model's floats, or FP8 E4M3 bytes (`u8`).
pub(crate) trait CacheRead: Copy + Send + Sync + 'static {
    fn value(self) -> f32;

    /// The cache as f32 values when it holds them already.
    fn as_f32(_cache: &[Self]) -> Option<&[f32]> {
        None
    }
}

impl CacheRead for f32 {
    #[inline(always)]
    fn value(self) -> f32 {
        self
    }

    fn as_f32(cache: &[f32]) -> Option<&[f32]> {
        Some(cache)
    }
}

macro_rules! cache_read_halves {
    ($($t:ty),*) => {$(
        impl CacheRead for $t {
            #[inline(always)]
            fn value(self) -> f32 {
                self.to_f32()
            }
        }
    )*};
}
cache_read_halves!(bf16, f16);

impl CacheRead for u8 {
    #[inline(always)]
    fn value(self) -> f32 {
        crate::fp8::DECODE_TABLE[self as usize]
    }
}

/// One query row's sequence facts.
#[derive(Clone, Copy)]
struct RowInfo {
    seq: usize,
    pos: usize,
}

/// The keys one query row sees: positions `lo..=pos` of a sequence whose cache blocks are
/// `table`, in caches of `kvh` heads and `bs` positions a block.
#[derive(Clone, Copy)]
struct Keys<'a> {
    table: &'a [u32],
    bs: usize,
    kvh: usize,
    kv_head: usize,
    lo: usize,
    pos: usize,
}

impl Keys<'_> {
    /// The runs of consecutive positions that share a cache block: (count, offset of the first
    /// one's row in the caches); rows of one run are `kvh * d` apart.
    fn runs(&self, d: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        let mut j = self.lo;
        std::iter::from_fn(move || {
            if j > self.pos {
                return None;
            }
            let end = ((j / self.bs + 1) * self.bs).min(self.pos + 1);
            let block = self.table[j / self.bs] as usize;
            let base = ((block * self.bs + j % self.bs) * self.kvh + self.kv_head) * d;
            let run = (end - j, base);
            j = end;
            Some(run)
        })
    }
}

/// Per-thread scratch reused across rows: the scaled query, the accumulator, a block's scores.
type Scratch = (Vec<f32>, Vec<f32>, Vec<f32>);

impl PagedAttention<'_> {
    /// Sequence and position of every query token (metadata was validated on construction).
    fn rows(&self) -> Vec<RowInfo> {
        let m = self.meta;
        let mut rows = Vec::with_capacity(m.num_tokens());
        for s in 0..m.num_seqs() {
            let (a, b) = (m.query_start_loc[s], m.query_start_loc[s + 1]);
            let ctx = m.seq_lens[s];
            for i in 0..b - a {
                rows.push(RowInfo {
                    seq: s,
                    pos: (ctx - (b - a) + i) as usize,
                });
            }
        }
        rows
    }

    pub(super) fn run<T: Elem, C: CacheRead>(
        &self,
        q: &[T],
        q_dims: &[usize],
        kc: &[C],
        vc: &[C],
        c_dims: &[usize],
    ) -> Result<Vec<T>> {
        self.run_with(true, q, q_dims, kc, vc, c_dims)
    }

    /// [`Self::run`] with the AVX2 form allowed or not (`simd` is ignored where the host, the
    /// dtype or the head dim does not allow it).
    fn run_with<T: Elem, C: CacheRead>(
        &self,
        simd: bool,
        q: &[T],
        q_dims: &[usize],
        kc: &[C],
        vc: &[C],
        c_dims: &[usize],
    ) -> Result<Vec<T>> {
        let (num_tokens, num_heads, d) = (q_dims[0], q_dims[1], q_dims[2]);
        let (bs, kvh) = (c_dims[1], c_dims[2]);
        let group = num_heads / kvh;
        let rows = self.rows();
        let mut out = vec![T::from_f32(0.0); num_tokens * num_heads * d];
        let floats = match (C::as_f32(kc), C::as_f32(vc)) {
            (Some(k), Some(v)) if simd && d % 8 == 0 && simd_available() => Some((k, v)),
            _ => None,
        };
        let scratch = || (vec![0f32; d], vec![0f32; d], Vec::with_capacity(bs));
        let width = self.meta.width;
        out.par_chunks_mut(d).enumerate().for_each_init(
            scratch,
            |(qv, acc, scores): &mut Scratch, (row_head, o)| {
                let (t, h) = (row_head / num_heads, row_head % num_heads);
                let r = rows[t];
                for (a, x) in qv.iter_mut().zip(&q[row_head * d..(row_head + 1) * d]) {
                    *a = x.to_f32() * self.params.scale;
                }
                let keys = Keys {
                    table: &self.meta.block_tables[r.seq * width..(r.seq + 1) * width],
                    bs,
                    kvh,
                    kv_head: h / group,
                    lo: self
                        .params
                        .sliding_window
                        .map_or(0, |w| (r.pos + 1).saturating_sub(w)),
                    pos: r.pos,
                };
                let l = match floats {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: AVX2 and FMA are present and `d` is a multiple of 8 (checked above)
                    Some((k, v)) => unsafe { avx2::attend(qv, &keys, k, v, scores, acc) },
                    _ => attend(qv, &keys, kc, vc, scores, acc),
                };
                let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
                for (o, a) in o.iter_mut().zip(acc.iter()) {
                    *o = T::from_f32(a * inv);
                }
            },
        );
        Ok(out)
    }
}

/// Whether the host runs the AVX2 + FMA form.
fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// One query row of one head: `acc` gets the softmax-weighted sum of the values, unnormalized;
/// returns the softmax denominator.
fn attend<C: CacheRead>(
    qv: &[f32],
    keys: &Keys<'_>,
    kc: &[C],
    vc: &[C],
    scores: &mut Vec<f32>,
    acc: &mut [f32],
) -> f32 {
    let d = qv.len();
    online_softmax(
        keys,
        d,
        scores,
        acc,
        |at| {
            qv.iter()
                .zip(&kc[at..at + d])
                .map(|(q, k)| q * k.value())
                .sum()
        },
        |acc, c, p, at| {
            for (a, v) in acc.iter_mut().zip(&vc[at..at + d]) {
                *a = *a * c + p * v.value();
            }
        },
    )
}

/// The loop of [`attend`] over the runs of `keys`: `score(at)` is the query's product with the
/// key row at offset `at` of the cache, `add(acc, c, p, at)` sets `acc` to `acc * c + p * v` for
/// the value row at `at` (`c` rescales to a new running maximum, folded into the run's first
/// row).
#[inline(always)]
fn online_softmax(
    keys: &Keys<'_>,
    d: usize,
    scores: &mut Vec<f32>,
    acc: &mut [f32],
    mut score: impl FnMut(usize) -> f32,
    mut add: impl FnMut(&mut [f32], f32, f32, usize),
) -> f32 {
    let stride = keys.kvh * d;
    acc.fill(0.0);
    let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
    for (n, base) in keys.runs(d) {
        scores.clear();
        scores.extend((0..n).map(|t| score(base + t * stride)));
        let top = scores.iter().fold(m, |a, &s| a.max(s));
        let mut c = 1.0;
        if top > m {
            c = (m - top).exp();
            l *= c;
            m = top;
        }
        for (t, &s) in scores.iter().enumerate() {
            let p = (s - m).exp();
            l += p;
            add(acc, c, p, base + t * stride);
            c = 1.0;
        }
    }
    l
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{online_softmax, Keys};
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// `q . k` over `q.len()` values (a multiple of 8).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot(q: &[f32], k: *const f32) -> f32 {
        let (q0, d) = (q.as_ptr(), q.len());
        let (mut a, mut b) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        // SAFETY: `q` and the caller's `k` hold `d` values
        unsafe {
            while i + 16 <= d {
                a = _mm256_fmadd_ps(_mm256_loadu_ps(q0.add(i)), _mm256_loadu_ps(k.add(i)), a);
                b = _mm256_fmadd_ps(
                    _mm256_loadu_ps(q0.add(i + 8)),
                    _mm256_loadu_ps(k.add(i + 8)),
                    b,
                );
                i += 16;
            }
            if i < d {
                a = _mm256_fmadd_ps(_mm256_loadu_ps(q0.add(i)), _mm256_loadu_ps(k.add(i)), a);
            }
        }
        hsum(_mm256_add_ps(a, b))
    }

    /// `acc = acc * c + p * v` over `acc.len()` values (a multiple of 8).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn scale_add(acc: &mut [f32], c: f32, p: f32, v: *const f32) {
        let (c, p) = (_mm256_set1_ps(c), _mm256_set1_ps(p));
        for (i, a) in acc.chunks_exact_mut(8).enumerate() {
            // SAFETY: eight values of `acc` and of the caller's `v`
            unsafe {
                let x = _mm256_mul_ps(_mm256_loadu_ps(a.as_ptr()), c);
                let x = _mm256_fmadd_ps(_mm256_loadu_ps(v.add(8 * i)), p, x);
                _mm256_storeu_ps(a.as_mut_ptr(), x);
            }
        }
    }

    /// [`super::attend`] over f32 caches in AVX2.
    ///
    /// # Safety
    /// The host has AVX2 and FMA; `qv.len()` is a multiple of 8.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn attend(
        qv: &[f32],
        keys: &Keys<'_>,
        kc: &[f32],
        vc: &[f32],
        scores: &mut Vec<f32>,
        acc: &mut [f32],
    ) -> f32 {
        let d = qv.len();
        // the rows read are within the caches (slicing checks each)
        online_softmax(
            keys,
            d,
            scores,
            acc,
            // SAFETY: AVX2 and FMA (caller); the slice holds `d` values
            |at| unsafe { dot(qv, kc[at..at + d].as_ptr()) },
            // SAFETY: as above
            |acc, c, p, at| unsafe { scale_add(acc, c, p, vc[at..at + d].as_ptr()) },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metadata::AttentionMetadata;
    use crate::PagedAttentionParams;
    use candle_core::{Device, Tensor};

    /// The AVX2 form against the portable one on mixed decode and prefill rows, with and
    /// without a sliding window.
    #[test]
    #[allow(clippy::unwrap_used)]
    fn both_forms_agree() {
        let (blocks, bs, kvh, heads, d) = (12usize, 16usize, 2usize, 6usize, 64usize);
        let vals = |n: usize, seed: u64| crate::quantize::test_values(n, seed);
        let kc = vals(blocks * bs * kvh * d, 1);
        let vc = vals(blocks * bs * kvh * d, 2);
        let dev = Device::Cpu;
        let cache = Tensor::zeros((blocks, bs, kvh, d), candle_core::DType::F32, &dev).unwrap();
        // two sequences: one decode token at 41 keys, a 20-token chunk ending at 70 keys
        let tables = vec![3, 7, 1, 0, 0, 2, 9, 4, 11, 5];
        let meta =
            AttentionMetadata::new(vec![0; 21], tables, 5, vec![41, 70], vec![0, 1, 21], &dev)
                .unwrap();
        let q = vals(21 * heads * d, 3);
        for window in [None, Some(24)] {
            let op = PagedAttention {
                k_cache: &cache,
                v_cache: &cache,
                meta: &meta,
                params: PagedAttentionParams {
                    scale: 0.125,
                    sliding_window: window,
                },
            };
            let dims = [21, heads, d];
            let cdims = [blocks, bs, kvh, d];
            let fast = op.run_with(true, &q, &dims, &kc, &vc, &cdims).unwrap();
            let slow = op.run_with(false, &q, &dims, &kc, &vc, &cdims).unwrap();
            let err = fast
                .iter()
                .zip(&slow)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(slow.iter().any(|x| x.abs() > 1e-3));
            assert!(err < 1e-5, "{window:?}: {err}");
        }
    }
}
