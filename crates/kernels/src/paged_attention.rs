//! Attention over the paged KV cache for a flattened batch of query tokens: decode tokens, whole
//! prompts and prompt chunks of many sequences mixed in one call (vLLM v1's unified layout).
//!
//! Query token `i` of sequence `s` (of `q_len` query tokens, context length `seq_len` after this
//! step) sits at position `seq_len - q_len + i` and attends causally to cached positions
//! `[max(0, pos + 1 - window), pos]`. The CPU path is a flash-style loop (online softmax, no score
//! matrix) that accumulates in f32; it is also the reference for the CUDA kernels.
//!
//! The caches hold `q`'s dtype, or FP8 E4M3 bytes (`U8`, see [`crate::cache`]) read back exactly;
//! the caller folds an FP8 cache's key scale into [`PagedAttentionParams::scale`] and multiplies
//! the output by its value scale.

use crate::elem::{for_kernel, typed, with_cpu, Elem};
use crate::metadata::AttentionMetadata;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor, D};
use half::{bf16, f16};

/// Scalars of one attention call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PagedAttentionParams {
    /// Multiplier of `q . k`, usually `1 / sqrt(head_dim)`.
    pub scale: f32,
    /// Keys at most this many positions back (including the query's own) are visible.
    pub sliding_window: Option<usize>,
}

struct PagedAttention<'a> {
    k_cache: &'a Tensor, // [num_blocks, block_size, kv_heads, head_dim]
    v_cache: &'a Tensor, // [num_blocks, block_size, kv_heads, head_dim]
    meta: &'a AttentionMetadata,
    params: PagedAttentionParams,
}

impl PagedAttention<'_> {
    fn dispatch<T: Elem + CacheRead>(
        &self,
        q: &CpuStorage,
        ql: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let q_s = typed::<T>(q, ql, "q")?;
        let out = with_cpu(self.k_cache, "k_cache", |ks, kl| {
            with_cpu(self.v_cache, "v_cache", |vs, vl| match (ks, vs) {
                (CpuStorage::U8(k), CpuStorage::U8(v)) => {
                    let (ka, kb) = crate::elem::contiguous_range(kl, "k_cache")?;
                    let (va, vb) = crate::elem::contiguous_range(vl, "v_cache")?;
                    self.run(q_s, ql.dims(), &k[ka..kb], &v[va..vb], kl.dims())
                }
                _ => {
                    let kc = typed::<T>(ks, kl, "k_cache")?;
                    let vc = typed::<T>(vs, vl, "v_cache")?;
                    self.run(q_s, ql.dims(), kc, vc, kl.dims())
                }
            })
        })?;
        Ok((T::storage(out), ql.shape().clone()))
    }
}

impl CustomOp1 for PagedAttention<'_> {
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

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        ql: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let fp8 = crate::cache::is_fp8_cache(self.k_cache);
        match (q.dtype(), fp8) {
            (DType::F32, false) => self.cuda_run::<f32, f32>(q, ql),
            (DType::BF16, false) => self.cuda_run::<bf16, bf16>(q, ql),
            (DType::F16, false) => self.cuda_run::<f16, f16>(q, ql),
            (DType::F32, true) => self.cuda_run::<f32, u8>(q, ql),
            (DType::BF16, true) => self.cuda_run::<bf16, u8>(q, ql),
            (DType::F16, true) => self.cuda_run::<f16, u8>(q, ql),
            (dt, _) => candle_core::bail!("paged_attention: unsupported dtype {dt:?}"),
        }
    }
}

/// How the CUDA kernel tiles one call (see `csrc/paged_attention.cu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchPlan {
    pub heads_per_cta: usize,
    pub queries_per_cta: usize,
    pub rows_cap: usize,
    pub tile_keys: usize,
    pub shared_bytes: usize,
    /// CTAs per work item: KV heads times head chunks.
    pub grid_y: usize,
}

impl LaunchPlan {
    /// Rows (query, head pairs) per CTA hold at most 4096 query floats and 16 accumulator slots per
    /// thread; a K/V tile holds at most 8 KiB per cache. Head dims must be even and at most 256.
    pub fn new(
        num_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        elem_bytes: usize,
    ) -> Result<Self> {
        if head_dim == 0 || !head_dim.is_multiple_of(2) || head_dim > 256 {
            candle_core::bail!(
                "paged_attention on CUDA: head_dim {head_dim} (must be even, <= 256)"
            );
        }
        if kv_heads == 0 || !num_heads.is_multiple_of(kv_heads) {
            candle_core::bail!("paged_attention: {num_heads} heads over {kv_heads} KV heads");
        }
        let groups = 128 / (head_dim / 2);
        let rows_cap = (4096 / head_dim).min(16 * groups).min(64);
        let group = num_heads / kv_heads;
        let heads_per_cta = group.min(rows_cap);
        let queries_per_cta = (rows_cap / heads_per_cta).max(1);
        let tile_keys = (8192 / (head_dim * elem_bytes)).clamp(8, 32);
        let pad = if elem_bytes == 4 { 1 } else { 2 };
        let shared_bytes = 4 * (rows_cap * head_dim + rows_cap * (tile_keys + 1) + 3 * rows_cap)
            + 2 * tile_keys * (head_dim + pad) * elem_bytes;
        Ok(Self {
            heads_per_cta,
            queries_per_cta,
            rows_cap,
            tile_keys,
            shared_bytes,
            grid_y: kv_heads * group.div_ceil(heads_per_cta),
        })
    }
}

impl LaunchPlan {
    /// Keys per split for flash-decoding (0: no split): when `work_items` work items give fewer
    /// than two CTAs per multiprocessor and contexts are long, each CTA takes a slice of at least
    /// 256 keys (a multiple of the key tile) and a second pass merges the slices.
    pub fn split_keys(
        &self,
        work_items: usize,
        max_context: usize,
        multiprocessors: usize,
    ) -> usize {
        let ctas = work_items * self.grid_y;
        if ctas == 0 || ctas >= 2 * multiprocessors || max_context < 512 {
            return 0;
        }
        let want = (2 * multiprocessors).div_ceil(ctas);
        let splits = want.min(max_context / 256).max(1);
        if splits < 2 {
            return 0;
        }
        max_context
            .div_ceil(splits)
            .next_multiple_of(self.tile_keys)
    }
}

/// Fewest keys in one slice of a split decode (the kernel sizes slices per sequence).
pub const DECODE_MIN_SPLIT_KEYS: usize = 64;

/// Key slices per sequence of the decode kernel (1: no split): when `ctas` (sequence, KV head)
/// pairs fill fewer than two CTAs per multiprocessor, contexts of up to `max_context` keys are cut
/// into slices of at least [`DECODE_MIN_SPLIT_KEYS`] keys so the grid does; a second pass merges
/// the slices. The kernel cuts each sequence's own context, so the count may be planned for the
/// longest context a captured graph will see.
pub fn decode_splits(ctas: usize, max_context: usize, multiprocessors: usize) -> usize {
    if ctas == 0 || ctas >= 2 * multiprocessors {
        return 1;
    }
    let splits = (2 * multiprocessors)
        .div_ceil(ctas)
        .min(max_context / DECODE_MIN_SPLIT_KEYS)
        .min(MAX_SPLITS);
    splits.max(1)
}

/// Most key splits the merge kernel takes (`kMaxSplits` in `csrc/paged_attention.cu`).
const MAX_SPLITS: usize = 512;

/// Query heads per KV head the decode kernel is instantiated for (the group rounded up), if any.
pub fn decode_group_bucket(group: usize) -> Option<usize> {
    [1, 4, 8, 16].into_iter().find(|&g| group <= g)
}

/// Key stages per warp of the tensor-core decode kernel (`S` of
/// `paged_decode_tc_w<W>_d<D>_<dtype>` in `csrc/decode_tc.cu`).
const DECODE_TC_STAGES: usize = 3;

/// Dynamic shared memory of the tensor-core decode kernel of `warps` warps: per warp and stage a
/// K and a V tile of 16 keys, rows padded by eight elements (the queries borrow warp 0's last
/// stage). With an FP8 cache the stages hold unpadded rows of bytes; with heads as the products'
/// rows (`keys_as_rows` false) each warp has one more, 16-bit stage for the tile it converts.
pub fn decode_tc_shared_bytes(
    warps: usize,
    head_dim: usize,
    elem_bytes: usize,
    fp8_cache: bool,
    keys_as_rows: bool,
) -> usize {
    let tile16 = 2 * 16 * (head_dim + 8) * elem_bytes;
    let tile8 = 2 * 16 * head_dim;
    match (fp8_cache, keys_as_rows) {
        (true, true) => warps * DECODE_TC_STAGES * tile8,
        (true, false) => warps * (tile16 + DECODE_TC_STAGES * tile8),
        (false, _) => warps * DECODE_TC_STAGES * tile16,
    }
}

/// Warps per CTA of the tensor-core decode kernel for a grid of `ctas` CTAs on `sms`
/// multiprocessors: 2 (four CTAs per SM) once there are more than two CTAs per SM, where more,
/// longer CTAs per SM hide each one's start and end; 4 for smaller grids (few sequences, their
/// keys split), which 4 warps per CTA spread over more of the GPU.
pub fn decode_tc_warps(ctas: usize, sms: usize) -> usize {
    if ctas > 2 * sms {
        2
    } else {
        4
    }
}

/// The layout part of a tensor-core decode kernel's name (`paged_decode_<layout>_w<W>_...`): keys
/// as the products' rows (`tk`) where the group fits their 8 columns (`keys_as_rows`), else heads
/// as rows (`tc`); the keys-as-rows form of 4 warps that asks for its first key tiles before its
/// wait (`tk_early`) when `early` is asked for and the step is decode-only (every key but each
/// sequence's newest then comes from an earlier step).
pub fn decode_tc_layout(
    keys_as_rows: bool,
    warps: usize,
    decode_only: bool,
    early: bool,
) -> &'static str {
    match (keys_as_rows, early && warps == 4 && decode_only) {
        (true, true) => "tk_early",
        (true, false) => "tk",
        (false, _) => "tc",
    }
}

/// Head dims of the tensor-core prompt kernel (16-bit types only).
pub const PREFILL_HEAD_DIMS: [usize; 2] = [64, 128];

/// Dynamic shared memory of the tensor-core prompt kernel (see `csrc/prefill.cu`): two stages of
/// a K and a V tile of `4096 / head_dim` keys, rows padded by eight 16-bit elements; with an FP8
/// cache, one such 16-bit stage and two stages of unpadded rows of bytes.
pub fn prefill_shared_bytes(head_dim: usize, fp8_cache: bool) -> usize {
    let stage16 = 16384 * (head_dim + 8) / head_dim;
    if fp8_cache {
        stage16 + 2 * 2 * 4096
    } else {
        2 * stage16
    }
}

/// Keys per chunk of the decode kernel (`kChunk` in `csrc/decode.cu`).
const DECODE_CHUNK: usize = 256;

/// Dynamic shared memory of the decode kernel instantiated for `group_bucket` heads per KV head:
/// scaled queries, one chunk's scores per head, three running statistics per head, slots.
pub fn decode_shared_bytes(group_bucket: usize, head_dim: usize) -> usize {
    let g = group_bucket;
    4 * (g * head_dim + g * DECODE_CHUNK + 3 * g + DECODE_CHUNK)
}

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;

use cpu::CacheRead;

/// Attention of `q` (`[num_tokens, num_heads, head_dim]`) over the paged cache; returns
/// `[num_tokens, num_heads, head_dim]` in `q`'s dtype. See the module docs for the other shapes.
pub fn paged_attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    meta: &AttentionMetadata,
    params: &PagedAttentionParams,
) -> Result<Tensor> {
    let (num_tokens, num_heads, d) = q.dims3()?;
    let (num_blocks, bs, kvh, cd) = k_cache.dims4()?;
    if v_cache.dims4()? != (num_blocks, bs, kvh, cd) {
        candle_core::bail!("paged_attention: k/v cache shapes differ");
    }
    let fp8 = crate::cache::is_fp8_cache(k_cache);
    if v_cache.dtype() != k_cache.dtype() || !(fp8 || k_cache.dtype() == q.dtype()) {
        candle_core::bail!(
            "paged_attention: {:?}/{:?} caches for {:?} queries",
            k_cache.dtype(),
            v_cache.dtype(),
            q.dtype()
        );
    }
    if cd != d || kvh == 0 || num_heads % kvh != 0 {
        candle_core::bail!(
            "paged_attention: q {:?} vs cache {:?}",
            q.shape(),
            k_cache.shape()
        );
    }
    if num_tokens != meta.num_tokens() {
        candle_core::bail!(
            "paged_attention: q has {num_tokens} tokens, metadata {}",
            meta.num_tokens()
        );
    }
    meta.validate(num_blocks, bs)?;
    let op = PagedAttention {
        k_cache,
        v_cache,
        meta,
        params: *params,
    };
    for_kernel(q)?.apply_op1_no_bwd(&op)
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
