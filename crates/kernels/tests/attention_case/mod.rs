//! The harness of the paged-attention tests: each sequence's K/V is written into scrambled cache
//! blocks, then decode tokens, whole prompts and prompt chunks are attended in one call and
//! compared, sequence by sequence, with the textbook formula computed in f32 on the CPU.
#![allow(dead_code, clippy::unwrap_used)]

use candle_core::{DType, Device, Result, Tensor};
use rserve_kernels::{
    paged_attention, reference_attention, reshape_and_cache_scaled, AttentionMetadata, CacheScales,
    PagedAttentionParams, FP8_CACHE_DTYPE,
};

/// One case: heads, KV heads, head dim, block size, (query tokens, context) per sequence.
pub struct Case<'a> {
    pub dtype: DType,
    pub heads: usize,
    pub kvh: usize,
    pub d: usize,
    pub bs: usize,
    pub seqs: &'a [(usize, usize)],
    pub window: Option<usize>,
    pub tol: f32,
    /// Compare only this many last query rows of each sequence (long prompts).
    pub last_rows: Option<usize>,
}

pub fn check(dev: &Device, c: &Case) -> Result<()> {
    check_planned(dev, c, None)
}

/// `check`, with a decode-only step's metadata served from device arrays and its key split
/// planned for contexts up to `split_context` (a decode graph's metadata) when that is given.
pub fn check_planned(dev: &Device, c: &Case, split_context: Option<usize>) -> Result<()> {
    check_cache(dev, c, split_context, None)
}

/// `check` over FP8 caches written with `scales`: the reference attends to the values the cache
/// holds (each K/V value rounded to E4M3 at its scale).
pub fn check_fp8(dev: &Device, c: &Case, scales: CacheScales) -> Result<()> {
    check_cache(dev, c, None, Some(scales))
}

/// `x` as an FP8 cache at `scale` holds it (f32).
fn fp8_rounded(x: &Tensor, scale: f32) -> Result<Tensor> {
    let v = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let r: Vec<f32> = v
        .iter()
        .map(|&x| rserve_kernels::fp8::decode(rserve_kernels::fp8::encode(x / scale)) * scale)
        .collect();
    Tensor::from_vec(r, x.shape(), x.device())
}

fn check_cache(
    dev: &Device,
    c: &Case,
    split_context: Option<usize>,
    fp8: Option<CacheScales>,
) -> Result<()> {
    let cpu = Device::Cpu;
    let num_blocks = c
        .seqs
        .iter()
        .map(|&(_, ctx)| ctx.div_ceil(c.bs))
        .sum::<usize>()
        .max(1)
        * 2
        + 3;
    let cache_dtype = if fp8.is_some() {
        FP8_CACHE_DTYPE
    } else {
        c.dtype
    };
    let scales = fp8.unwrap_or_default();
    let kc = Tensor::zeros((num_blocks, c.bs, c.kvh, c.d), cache_dtype, dev)?;
    let vc = Tensor::zeros((num_blocks, c.bs, c.kvh, c.d), cache_dtype, dev)?;
    let width = c
        .seqs
        .iter()
        .map(|&(_, ctx)| ctx.div_ceil(c.bs))
        .max()
        .unwrap_or(1)
        .max(1);
    // a fixed scramble of block ids, distinct across sequences
    let mut next = 0usize;
    let mut tables = vec![0u32; c.seqs.len() * width];
    let (mut qs, mut ks, mut vs) = (vec![], vec![], vec![]);
    let (mut qsl, mut all_slots, mut ctx_qsl) = (vec![0u32], vec![], vec![0u32]);
    for (s, &(q_len, ctx)) in c.seqs.iter().enumerate() {
        for j in 0..ctx.div_ceil(c.bs) {
            tables[s * width + j] = ((next * 37 + 11) % num_blocks) as u32;
            next += 1;
        }
        ks.push(Tensor::randn(0f32, 1., (ctx, c.kvh, c.d), &cpu)?.to_dtype(c.dtype)?);
        vs.push(Tensor::randn(0f32, 1., (ctx, c.kvh, c.d), &cpu)?.to_dtype(c.dtype)?);
        all_slots.extend(
            (0..ctx).map(|p| (tables[s * width + p / c.bs] as usize * c.bs + p % c.bs) as i64),
        );
        qs.push(Tensor::randn(0f32, 1., (q_len, c.heads, c.d), &cpu)?.to_dtype(c.dtype)?);
        qsl.push(qsl[s] + q_len as u32);
        ctx_qsl.push(ctx_qsl[s] + ctx as u32);
    }
    let lens: Vec<u32> = c.seqs.iter().map(|&(_, x)| x as u32).collect();
    // write every sequence's whole context, as a prefill of all of it would
    let write =
        AttentionMetadata::new(all_slots, tables.clone(), width, lens.clone(), ctx_qsl, dev)?;
    let k_all = Tensor::cat(&ks, 0)?.to_device(dev)?;
    let v_all = Tensor::cat(&vs, 0)?.to_device(dev)?;
    reshape_and_cache_scaled(&k_all, &v_all, &kc, &vc, &write, scales)?;
    if fp8.is_some() {
        for s in 0..c.seqs.len() {
            ks[s] = fp8_rounded(&ks[s], scales.k)?;
            vs[s] = fp8_rounded(&vs[s], scales.v)?;
        }
    }

    let q_slots = vec![-1i64; *qsl.last().unwrap() as usize];
    let meta = match split_context {
        None => AttentionMetadata::new(q_slots, tables, width, lens, qsl.clone(), dev)?,
        Some(planned) => {
            let n = lens.len();
            let arrays = rserve_kernels::DeviceArrays {
                slots: Tensor::new(q_slots.as_slice(), dev)?,
                block_tables: Tensor::from_slice(&tables, (n, width), dev)?,
                seq_lens: Tensor::new(lens.as_slice(), dev)?,
                query_start_loc: Tensor::new(qsl.as_slice(), dev)?,
            };
            let seqs: Vec<u32> = (0..n as u32).collect();
            AttentionMetadata::new(q_slots, tables, width, lens, qsl.clone(), &cpu)?.on_device(
                arrays,
                Tensor::new(seqs.as_slice(), dev)?,
                planned,
            )?
        }
    };
    let q = Tensor::cat(&qs, 0)?.to_device(dev)?;
    let params = PagedAttentionParams {
        scale: 1.0 / (c.d as f32).sqrt(),
        sliding_window: c.window,
    };
    // an FP8 cache's key scale joins the score scale, its value scale the output
    let cache_params = PagedAttentionParams {
        scale: params.scale * scales.k,
        ..params
    };
    let out = paged_attention(&q, &kc, &vc, &meta, &cache_params)?;
    let out = if fp8.is_some() {
        (out.to_dtype(DType::F32)? * f64::from(scales.v))?
    } else {
        out
    };
    let out = out.to_device(&cpu)?;
    assert_eq!(out.dims(), q.dims());
    for s in 0..c.seqs.len() {
        let q_len = c.seqs[s].0;
        let rows = c.last_rows.unwrap_or(q_len).min(q_len);
        let got = out
            .narrow(0, qsl[s] as usize + q_len - rows, rows)?
            .to_dtype(DType::F32)?;
        let q_rows = qs[s].narrow(0, q_len - rows, rows)?;
        let want = reference_attention(&q_rows, &ks[s], &vs[s], &params)?;
        let err = (got - want)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        assert!(
            err < c.tol,
            "seq {s} {:?}: max abs error {err} ({:?}, heads {}/{}, d {}, block {})",
            c.seqs[s],
            c.dtype,
            c.heads,
            c.kvh,
            c.d,
            c.bs
        );
    }
    Ok(())
}
