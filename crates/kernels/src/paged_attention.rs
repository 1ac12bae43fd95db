//! Attention over the paged KV cache for a flattened batch of query tokens: decode tokens, whole
//! prompts and prompt chunks of many sequences mixed in one call (vLLM v1's unified layout).
//!
//! Query token `i` of sequence `s` (of `q_len` query tokens, context length `seq_len` after this
//! step) sits at position `seq_len - q_len + i` and attends causally to cached positions
//! `[max(0, pos + 1 - window), pos]`. The CPU path is a flash-style loop (online softmax, no score
//! matrix) that accumulates in f32; it is also the reference for the CUDA kernels.

use crate::elem::{host_ints, typed, with_cpu, Elem};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor, D};
use half::{bf16, f16};
use rayon::prelude::*;

/// Scalars of one attention call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PagedAttentionParams {
    /// Multiplier of `q . k`, usually `1 / sqrt(head_dim)`.
    pub scale: f32,
    /// Keys at most this many positions back (including the query's own) are visible.
    pub sliding_window: Option<usize>,
}

struct PagedAttention {
    k_cache: Tensor,        // [num_blocks, block_size, kv_heads, head_dim]
    v_cache: Tensor,        // [num_blocks, block_size, kv_heads, head_dim]
    block_tables: Vec<i64>, // [num_seqs, width]
    width: usize,
    seq_lens: Vec<i64>,        // [num_seqs]
    query_start_loc: Vec<i64>, // [num_seqs + 1]
    params: PagedAttentionParams,
}

/// `q . k` with eight independent partial sums so the compiler can use SIMD lanes.
#[inline(always)]
fn dot<T: Elem>(q: &[f32], k: &[T]) -> f32 {
    let n = q.len().min(k.len());
    let body = n / 8 * 8;
    let mut acc = [0f32; 8];
    for (qc, kc) in q[..body].chunks_exact(8).zip(k[..body].chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += qc[i] * kc[i].to_f32();
        }
    }
    let mut s = (acc[0] + acc[4]) + (acc[1] + acc[5]) + (acc[2] + acc[6]) + (acc[3] + acc[7]);
    for i in body..n {
        s += q[i] * k[i].to_f32();
    }
    s
}

/// One query row's sequence facts.
#[derive(Clone, Copy)]
struct RowInfo {
    seq: usize,
    pos: usize,
}

impl PagedAttention {
    fn rows(&self, num_tokens: usize) -> Result<Vec<RowInfo>> {
        let num_seqs = self.seq_lens.len();
        let mut rows = Vec::with_capacity(num_tokens);
        for s in 0..num_seqs {
            let (a, b) = (self.query_start_loc[s], self.query_start_loc[s + 1]);
            let ctx = self.seq_lens[s];
            let q_len = b - a;
            if a < 0 || q_len < 0 || q_len > ctx {
                candle_core::bail!(
                    "paged_attention: bad sequence {s}: query [{a}, {b}), context {ctx}"
                );
            }
            for i in 0..q_len {
                rows.push(RowInfo {
                    seq: s,
                    pos: (ctx - q_len + i) as usize,
                });
            }
        }
        if rows.len() != num_tokens {
            candle_core::bail!(
                "paged_attention: query_start_loc covers {} tokens, q has {num_tokens}",
                rows.len()
            );
        }
        Ok(rows)
    }

    fn run<T: Elem>(
        &self,
        q: &[T],
        q_dims: &[usize],
        kc: &[T],
        vc: &[T],
        c_dims: &[usize],
    ) -> Result<Vec<T>> {
        let (num_tokens, num_heads, d) = (q_dims[0], q_dims[1], q_dims[2]);
        let (num_blocks, bs, kvh) = (c_dims[0], c_dims[1], c_dims[2]);
        if c_dims[3] != d || kvh == 0 || num_heads % kvh != 0 {
            candle_core::bail!("paged_attention: q {q_dims:?} vs cache {c_dims:?}");
        }
        let group = num_heads / kvh;
        let rows = self.rows(num_tokens)?;
        for r in &rows {
            let needed = r.pos / bs + 1;
            if needed > self.width {
                candle_core::bail!(
                    "paged_attention: position {} needs {needed} blocks, table has {}",
                    r.pos,
                    self.width
                );
            }
            for j in 0..needed {
                let b = self.block_tables[r.seq * self.width + j];
                if b < 0 || b as usize >= num_blocks {
                    candle_core::bail!("paged_attention: block id {b} outside the cache");
                }
            }
        }
        let mut out = vec![T::from_f32(0.0); num_tokens * num_heads * d];
        let p = self.params;
        // per-thread scratch (scaled query, accumulator), reused across rows
        let scratch = || (vec![0f32; d], vec![0f32; d]);
        out.par_chunks_mut(d)
            .enumerate()
            .for_each_init(scratch, |(qv, acc), (row_head, o)| {
                let (t, h) = (row_head / num_heads, row_head % num_heads);
                let r = rows[t];
                let kv_head = h / group;
                let q_row = &q[(t * num_heads + h) * d..(t * num_heads + h + 1) * d];
                for (a, x) in qv.iter_mut().zip(q_row) {
                    *a = x.to_f32() * p.scale;
                }
                acc.fill(0.0);
                let lo = p
                    .sliding_window
                    .map_or(0, |w| (r.pos + 1).saturating_sub(w));
                let mut m = f32::NEG_INFINITY;
                let mut l = 0f32;
                let table = &self.block_tables[r.seq * self.width..(r.seq + 1) * self.width];
                for j in lo..=r.pos {
                    let block = table[j / bs] as usize;
                    let base = ((block * bs + j % bs) * kvh + kv_head) * d;
                    let s = dot(qv, &kc[base..base + d]);
                    let v = &vc[base..base + d];
                    if s > m {
                        let c = (m - s).exp();
                        l = l * c + 1.0;
                        for (a, vv) in acc.iter_mut().zip(v) {
                            *a = *a * c + vv.to_f32();
                        }
                        m = s;
                    } else {
                        let e = (s - m).exp();
                        l += e;
                        for (a, vv) in acc.iter_mut().zip(v) {
                            *a += e * vv.to_f32();
                        }
                    }
                }
                let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
                for (o, a) in o.iter_mut().zip(acc.iter()) {
                    *o = T::from_f32(a * inv);
                }
            });
        Ok(out)
    }

    fn dispatch<T: Elem>(&self, q: &CpuStorage, ql: &Layout) -> Result<(CpuStorage, Shape)> {
        let q_s = typed::<T>(q, ql, "q")?;
        let out = with_cpu(&self.k_cache, "k_cache", |ks, kl| {
            let kc = typed::<T>(ks, kl, "k_cache")?;
            with_cpu(&self.v_cache, "v_cache", |vs, vl| {
                let vc = typed::<T>(vs, vl, "v_cache")?;
                self.run(q_s, ql.dims(), kc, vc, kl.dims())
            })
        })?;
        Ok((T::storage(out), ql.shape().clone()))
    }
}

impl CustomOp1 for PagedAttention {
    fn name(&self) -> &'static str {
        "paged-attention"
    }

    fn cpu_fwd(&self, q: &CpuStorage, ql: &Layout) -> Result<(CpuStorage, Shape)> {
        match q.dtype() {
            DType::F32 => self.dispatch::<f32>(q, ql),
            DType::BF16 => self.dispatch::<bf16>(q, ql),
            DType::F16 => self.dispatch::<f16>(q, ql),
            dt => candle_core::bail!("paged_attention: unsupported dtype {dt:?}"),
        }
    }
}

/// Attention of `q` (`[num_tokens, num_heads, head_dim]`) over the paged cache; returns
/// `[num_tokens, num_heads, head_dim]` in `q`'s dtype. See the module docs for the other shapes.
pub fn paged_attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    block_tables: &Tensor,
    seq_lens: &Tensor,
    query_start_loc: &Tensor,
    params: &PagedAttentionParams,
) -> Result<Tensor> {
    q.dims3()?;
    if k_cache.dims4()? != v_cache.dims4()? {
        candle_core::bail!("paged_attention: k/v cache shapes differ");
    }
    let (num_seqs, width) = block_tables.dims2()?;
    let seq_lens = host_ints(seq_lens, "seq_lens")?;
    let query_start_loc = host_ints(query_start_loc, "query_start_loc")?;
    if seq_lens.len() != num_seqs || query_start_loc.len() != num_seqs + 1 {
        candle_core::bail!(
            "paged_attention: {num_seqs} block tables, {} seq_lens, {} query_start_loc",
            seq_lens.len(),
            query_start_loc.len()
        );
    }
    let op = PagedAttention {
        k_cache: k_cache.clone(),
        v_cache: v_cache.clone(),
        block_tables: host_ints(block_tables, "block_tables")?,
        width,
        seq_lens,
        query_start_loc,
        params: *params,
    };
    q.contiguous()?.apply_op1_no_bwd(&op)
}

/// Plain dense causal attention for one sequence, the textbook formula with candle ops:
/// `q` `[q_len, heads, d]` against all of `k`/`v` `[ctx, kv_heads, d]`. Reference for tests.
pub fn reference_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    params: &PagedAttentionParams,
) -> Result<Tensor> {
    let (q_len, heads, d) = q.dims3()?;
    let (ctx, kvh, _) = k.dims3()?;
    let group = heads / kvh;
    let q = q.to_dtype(DType::F32)?.transpose(0, 1)?.contiguous()?; // [heads, q_len, d]
    let expand = |t: &Tensor| -> Result<Tensor> {
        let t = t.to_dtype(DType::F32)?.transpose(0, 1)?; // [kvh, ctx, d]
        t.unsqueeze(1)?
            .expand((kvh, group, ctx, d))?
            .reshape((heads, ctx, d))
    };
    let (k, v) = (expand(k)?, expand(v)?);
    let scores = (q.matmul(&k.t()?)? * f64::from(params.scale))?; // [heads, q_len, ctx]
    let mut mask = vec![0f32; q_len * ctx];
    for i in 0..q_len {
        let pos = ctx - q_len + i;
        let lo = params
            .sliding_window
            .map_or(0, |w| (pos + 1).saturating_sub(w));
        for j in 0..ctx {
            if j > pos || j < lo {
                mask[i * ctx + j] = f32::NEG_INFINITY;
            }
        }
    }
    let mask = Tensor::from_vec(mask, (1, q_len, ctx), q.device())?;
    let s = scores.broadcast_add(&mask)?;
    let e = s.broadcast_sub(&s.max_keepdim(D::Minus1)?)?.exp()?;
    let probs = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    probs.matmul(&v)?.transpose(0, 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::reshape_and_cache;
    use candle_core::Device;

    /// Lays out each sequence's dense K/V into shuffled cache blocks and checks the paged result
    /// against dense reference attention, sequence by sequence.
    #[allow(clippy::too_many_arguments)]
    fn check(
        dtype: DType,
        heads: usize,
        kvh: usize,
        d: usize,
        bs: usize,
        seqs: &[(usize, usize)],
        window: Option<usize>,
        tol: f32,
    ) -> Result<()> {
        let dev = Device::Cpu;
        let num_blocks = 64;
        let kc = Tensor::zeros((num_blocks, bs, kvh, d), dtype, &dev)?;
        let vc = Tensor::zeros((num_blocks, bs, kvh, d), dtype, &dev)?;
        let width = seqs
            .iter()
            .map(|&(_, ctx)| ctx.div_ceil(bs))
            .max()
            .unwrap_or(1);
        // a fixed scramble of block ids, distinct across sequences
        let mut next = 0usize;
        let mut tables = vec![0u32; seqs.len() * width];
        let (mut qs, mut ks, mut vs) = (vec![], vec![], vec![]);
        let mut qsl = vec![0u32];
        for (s, &(q_len, ctx)) in seqs.iter().enumerate() {
            for j in 0..ctx.div_ceil(bs) {
                tables[s * width + j] = ((next * 37 + 11) % num_blocks) as u32;
                next += 1;
            }
            let k = Tensor::randn(0f32, 1., (ctx, kvh, d), &dev)?.to_dtype(dtype)?;
            let v = Tensor::randn(0f32, 1., (ctx, kvh, d), &dev)?.to_dtype(dtype)?;
            let slots: Vec<i64> = (0..ctx)
                .map(|p| (tables[s * width + p / bs] as usize * bs + p % bs) as i64)
                .collect();
            reshape_and_cache(&k, &v, &kc, &vc, &Tensor::new(slots.as_slice(), &dev)?)?;
            qs.push(Tensor::randn(0f32, 1., (q_len, heads, d), &dev)?.to_dtype(dtype)?);
            ks.push(k);
            vs.push(v);
            qsl.push(qsl[s] + q_len as u32);
        }
        let q = Tensor::cat(&qs, 0)?;
        let params = PagedAttentionParams {
            scale: 1.0 / (d as f32).sqrt(),
            sliding_window: window,
        };
        let lens: Vec<u32> = seqs.iter().map(|&(_, c)| c as u32).collect();
        let out = paged_attention(
            &q,
            &kc,
            &vc,
            &Tensor::from_vec(tables, (seqs.len(), width), &dev)?,
            &Tensor::new(lens.as_slice(), &dev)?,
            &Tensor::new(qsl.as_slice(), &dev)?,
            &params,
        )?;
        assert_eq!(out.dims(), q.dims());
        for s in 0..seqs.len() {
            let got = out
                .narrow(0, qsl[s] as usize, seqs[s].0)?
                .to_dtype(DType::F32)?;
            let want = reference_attention(&qs[s], &ks[s], &vs[s], &params)?;
            let err = (got - want)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert!(err < tol, "seq {s}: max abs error {err} (dtype {dtype:?})");
        }
        Ok(())
    }

    #[test]
    fn mixed_decode_and_prefill_f32() -> Result<()> {
        check(
            DType::F32,
            4,
            2,
            16,
            16,
            &[(1, 1), (1, 37), (20, 20), (5, 50), (1, 16)],
            None,
            1e-5,
        )
    }

    #[test]
    fn mqa_block32_head64() -> Result<()> {
        check(DType::F32, 8, 1, 64, 32, &[(3, 70), (1, 33)], None, 1e-5)
    }

    #[test]
    fn sliding_window() -> Result<()> {
        check(
            DType::F32,
            4,
            4,
            8,
            16,
            &[(12, 40), (1, 9), (1, 3)],
            Some(8),
            1e-5,
        )
    }

    #[test]
    fn half_precision() -> Result<()> {
        check(DType::BF16, 4, 2, 32, 16, &[(7, 30), (1, 45)], None, 2e-2)?;
        check(
            DType::F16,
            4,
            2,
            32,
            16,
            &[(7, 30), (1, 45)],
            Some(10),
            5e-3,
        )
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
        let r = paged_attention(
            &q,
            &c,
            &c,
            &Tensor::new(&[[7u32]], &dev)?,
            &Tensor::new(&[1u32], &dev)?,
            &Tensor::new(&[0u32, 1], &dev)?,
            &p,
        );
        assert!(r.is_err());
        Ok(())
    }
}
