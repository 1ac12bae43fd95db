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
use rayon::prelude::*;

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

/// A cache element read as f32: the model's floats, or FP8 E4M3 bytes (`u8`).
pub(crate) trait CacheRead: Copy + Send + Sync + 'static {
    fn value(self) -> f32;
}

macro_rules! cache_read_floats {
    ($($t:ty),*) => {$(
        impl CacheRead for $t {
            #[inline(always)]
            fn value(self) -> f32 {
                self.to_f32()
            }
        }
    )*};
}
cache_read_floats!(f32, bf16, f16);

impl CacheRead for u8 {
    #[inline(always)]
    fn value(self) -> f32 {
        crate::fp8::DECODE_TABLE[self as usize]
    }
}

/// `q . k` with eight independent partial sums so the compiler can use SIMD lanes.
#[inline(always)]
fn dot<T: CacheRead>(q: &[f32], k: &[T]) -> f32 {
    let n = q.len().min(k.len());
    let body = n / 8 * 8;
    let mut acc = [0f32; 8];
    for (qc, kc) in q[..body].chunks_exact(8).zip(k[..body].chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += qc[i] * kc[i].value();
        }
    }
    let mut s = (acc[0] + acc[4]) + (acc[1] + acc[5]) + (acc[2] + acc[6]) + (acc[3] + acc[7]);
    for i in body..n {
        s += q[i] * k[i].value();
    }
    s
}

/// One query row's sequence facts.
#[derive(Clone, Copy)]
struct RowInfo {
    seq: usize,
    pos: usize,
}

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

    fn run<T: Elem, C: CacheRead>(
        &self,
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
        let width = self.meta.width;
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
                let table = &self.meta.block_tables[r.seq * width..(r.seq + 1) * width];
                for j in lo..=r.pos {
                    let block = table[j / bs] as usize;
                    let base = ((block * bs + j % bs) * kvh + kv_head) * d;
                    let s = dot(qv, &kc[base..base + d]);
                    let v = &vc[base..base + d];
                    if s > m {
                        let c = (m - s).exp();
                        l = l * c + 1.0;
                        for (a, vv) in acc.iter_mut().zip(v) {
                            *a = *a * c + vv.value();
                        }
                        m = s;
                    } else {
                        let e = (s - m).exp();
                        l += e;
                        for (a, vv) in acc.iter_mut().zip(v) {
                            *a += e * vv.value();
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
/// `paged_decode_tc_w<W>_d<D>_<dtype>` in `csrc/decode.cu`).
const DECODE_TC_STAGES: usize = 3;

/// Dynamic shared memory of the tensor-core decode kernel of `warps` warps: per warp and stage a
/// K and a V tile of 16 keys, rows padded by eight elements (the queries borrow warp 0's last
/// stage). With an FP8 cache the stages hold unpadded rows of bytes and each warp has one more,
/// 16-bit stage for the tile it converts.
pub fn decode_tc_shared_bytes(
    warps: usize,
    head_dim: usize,
    elem_bytes: usize,
    fp8_cache: bool,
) -> usize {
    let tile16 = 2 * 16 * (head_dim + 8) * elem_bytes;
    if fp8_cache {
        warps * (tile16 + DECODE_TC_STAGES * 2 * 16 * head_dim)
    } else {
        warps * DECODE_TC_STAGES * tile16
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

#[cfg(feature = "cuda")]
mod launch {
    //! The CUDA launches of [`super::PagedAttention`]: the operands every attention kernel takes
    //! first, and the split buffers the decode and generic kernels take last.
    use crate::cuda::function;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, CudaStream, CudaView, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDevice, WrapErr};
    use candle_core::Result;

    /// The multiprocessor count of the first GPU asked (one kind of GPU per process).
    pub fn multiprocessors(dev: &CudaDevice) -> usize {
        use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
        use std::sync::OnceLock;
        static COUNT: OnceLock<usize> = OnceLock::new();
        *COUNT.get_or_init(|| {
            dev.cuda_stream()
                .context()
                .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .map_or(132, |n| n.max(1) as usize)
        })
    }

    /// Output, q, caches and metadata, then a sequence or work list, then kernel-specific ints,
    /// then scale, window and q's token stride: the leading arguments of every attention kernel.
    pub struct Operands<'a, T, C> {
        pub q: CudaView<'a, T>,
        pub q_stride: i64,
        pub k: &'a CudaSlice<C>,
        pub v: &'a CudaSlice<C>,
        pub tables: &'a CudaSlice<u32>,
        pub lens: &'a CudaSlice<u32>,
        pub starts: &'a CudaSlice<u32>,
        pub scale: f32,
        pub window: i32,
    }

    impl<T: DeviceRepr, C: DeviceRepr> Operands<'_, T, C> {
        pub fn args<'b>(
            &'b self,
            stream: &'b CudaStream,
            func: &'b candle_core::cuda_backend::cudarc::driver::CudaFunction,
            out: &'b mut CudaSlice<T>,
            list: &'b CudaSlice<u32>,
            ints: &'b [i32],
        ) -> LaunchArgs<'b> {
            let mut b = stream.launch_builder(func);
            b.arg(out)
                .arg(&self.q)
                .arg(self.k)
                .arg(self.v)
                .arg(self.tables)
                .arg(self.lens)
                .arg(self.starts)
                .arg(list);
            for v in ints {
                b.arg(v);
            }
            b.arg(&self.scale).arg(&self.window).arg(&self.q_stride);
            b
        }
    }

    /// Flash-decoding partials: per (split, token, head) row an unnormalised accumulator and
    /// (max, sum); one-element placeholders when the launch does not split.
    pub struct Splits {
        pub count: usize,
        keys: i32,
        rows: i64,
        acc: CudaSlice<f32>,
        ml: CudaSlice<f32>,
    }

    impl Splits {
        /// Buffers for `count` slices (1: no split) of `rows` rows; `keys` is the kernel's split
        /// argument (keys per slice, or the fewest keys per slice for the decode kernel).
        pub fn new(
            dev: &CudaDevice,
            count: usize,
            keys: usize,
            rows: usize,
            d: usize,
        ) -> Result<Self> {
            let count = count.max(1);
            let n = if count > 1 { count * rows } else { 1 };
            // SAFETY: a splitting launch writes every (split, row) entry that the merge reads;
            // a launch that does not split never touches them.
            let (acc, ml) = unsafe { (dev.alloc::<f32>(n * d)?, dev.alloc::<f32>(n * 2)?) };
            Ok(Self {
                count,
                keys: if count > 1 { keys as i32 } else { 0 },
                rows: rows as i64,
                acc,
                ml,
            })
        }

        /// The trailing arguments: keys per split (0: none), rows, the partial buffers.
        pub fn push<'b>(&'b mut self, b: &mut LaunchArgs<'b>) {
            b.arg(&self.keys)
                .arg(&self.rows)
                .arg(&mut self.acc)
                .arg(&mut self.ml);
        }

        /// Merges the partials into `out` when the launch split.
        pub fn merge<T: DeviceRepr>(
            &self,
            dev: &CudaDevice,
            suffix: &str,
            out: &mut CudaSlice<T>,
            d: usize,
        ) -> Result<()> {
            if self.count <= 1 {
                return Ok(());
            }
            if self.count > super::MAX_SPLITS {
                candle_core::bail!(
                    "paged_attention: {} key splits (the merge takes {})",
                    self.count,
                    super::MAX_SPLITS
                );
            }
            let combine = function(dev, &format!("paged_attention_combine_{suffix}"))?;
            let stream = dev.cuda_stream();
            let mut c = stream.launch_builder(&combine);
            let (splits_i, d_i) = (self.count as i32, d as i32);
            c.arg(out)
                .arg(&self.acc)
                .arg(&self.ml)
                .arg(&splits_i)
                .arg(&self.rows)
                .arg(&d_i);
            let cfg = LaunchConfig {
                grid_dim: (self.rows as u32, 1, 1),
                block_dim: (d.min(128) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: matches `paged_attention_combine_<dtype>`; every (split, row) entry was
            // written by the split launch before it; at most 512 splits.
            unsafe { c.launch(cfg) }.w()?;
            Ok(())
        }
    }
}

#[cfg(feature = "cuda")]
impl PagedAttention<'_> {
    fn cuda_run<T, C>(
        &self,
        q: &candle_core::CudaStorage,
        ql: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)>
    where
        T: candle_core::cuda_backend::CudaDType
            + candle_core::WithDType
            + candle_core::cuda_backend::cudarc::driver::DeviceRepr,
        C: candle_core::cuda_backend::CudaDType
            + candle_core::WithDType
            + candle_core::cuda_backend::cudarc::driver::DeviceRepr,
    {
        use crate::cuda::{
            cuda_slice, dtype_suffix, function, function_with_shared, keys_as_rows_decode_enabled,
            tensor_core_decode_enabled, token_rows,
        };
        use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
        use candle_core::cuda_backend::WrapErr;
        use launch::{multiprocessors, Operands, Splits};

        let dims = ql.dims();
        let (num_tokens, num_heads, d) = (dims[0], dims[1], dims[2]);
        let (_, bs, kvh, _) = self.k_cache.dims4()?;
        let elem = std::mem::size_of::<T>();
        let group = num_heads / kvh;
        let dev = q.device().clone();
        let suffix = dtype_suffix(T::DTYPE)?;
        let fp8 = C::DTYPE == crate::cache::FP8_CACHE_DTYPE;
        // the attention kernels' suffix: the compute dtype, then `_fp8` for an FP8 cache
        let ksuffix = if fp8 {
            format!("{suffix}_fp8")
        } else {
            suffix.to_string()
        };
        let total_rows = num_tokens * num_heads;
        // SAFETY: every (token, head) row is written below: decode rows by the decode kernel (or
        // its merge), the other rows by a prompt kernel's work items, which cover every token.
        let mut out = unsafe { dev.alloc::<T>(total_rows * d) }?;
        if total_rows == 0 {
            return Ok((T::wrap_cuda_slice(out, dev), Shape::from(dims)));
        }
        let meta = self.meta;
        let max_ctx = meta.seq_lens.iter().copied().max().unwrap_or(0) as usize;
        let num_seqs = meta.num_seqs();
        let decode_bucket =
            decode_group_bucket(group).filter(|_| (d * elem).is_multiple_of(16) && d <= 256);
        let n_dec = if decode_bucket.is_some() {
            meta.num_decode()
        } else {
            0
        };
        let tensor_core = elem == 2
            && PREFILL_HEAD_DIMS.contains(&d)
            && group <= 64
            && bs.is_power_of_two()
            && ql.start_offset().is_multiple_of(8)
            && ql.stride()[0].is_multiple_of(8);

        let arrays = meta.device_arrays()?;
        let (q_view, q_stride) = token_rows::<T>(q, ql, "q")?;
        let (kg, kl) = self.k_cache.storage_and_layout();
        let (vg, vl) = self.v_cache.storage_and_layout();
        if !(kl.is_contiguous() && vl.is_contiguous())
            || kl.start_offset() != 0
            || vl.start_offset() != 0
        {
            candle_core::bail!("paged_attention: caches must be whole contiguous tensors");
        }
        let (tg, _) = arrays.block_tables.storage_and_layout();
        let (lg, _) = arrays.seq_lens.storage_and_layout();
        let (sg, _) = arrays.query_start_loc.storage_and_layout();
        let ops = Operands {
            q: q_view,
            q_stride,
            k: cuda_slice::<C>(&kg, "k_cache")?,
            v: cuda_slice::<C>(&vg, "v_cache")?,
            tables: cuda_slice::<u32>(&tg, "block_tables")?,
            lens: cuda_slice::<u32>(&lg, "seq_lens")?,
            starts: cuda_slice::<u32>(&sg, "query_start_loc")?,
            scale: self.params.scale,
            window: self.params.sliding_window.map_or(0, |w| w as i32),
        };
        let stream = dev.cuda_stream();
        let ints = |v: &[usize]| v.iter().map(|&x| x as i32).collect::<Vec<i32>>();
        let sms = multiprocessors(&dev);
        let width = meta.width;

        if let (Some(g), true) = (decode_bucket, n_dec > 0) {
            let (seqs, _) = meta.decode_seqs()?;
            let (seqs_g, _) = seqs.storage_and_layout();
            let seqs_s = cuda_slice::<u32>(&seqs_g, "decode sequences")?;
            // only a decode-only step splits: the merge rewrites every row of the step
            let count = if n_dec == num_seqs {
                decode_splits(n_dec * kvh, meta.split_context(), sms)
            } else {
                1
            };
            let mut splits = Splits::new(&dev, count, DECODE_MIN_SPLIT_KEYS, total_rows, d)?;
            // tensor cores where the prompt kernel's conditions hold and the group fits 16 rows;
            // that kernel takes the KV head from the grid's x and the sequence from its y
            let tc = tensor_core && group <= 16 && n_dec <= 65_535 && tensor_core_decode_enabled();
            let (name, grid, shared, threads) = if tc {
                let w = decode_tc_warps(kvh * n_dec * splits.count, sms);
                let grid = (kvh as u32, n_dec as u32, splits.count as u32);
                // keys as the products' rows where the group fits their 8 columns
                let layout = if group <= 8 && keys_as_rows_decode_enabled() {
                    "tk"
                } else {
                    "tc"
                };
                (
                    format!("paged_decode_{layout}_w{w}_d{d}_{ksuffix}"),
                    grid,
                    decode_tc_shared_bytes(w, d, elem, fp8),
                    32 * w as u32,
                )
            } else {
                let grid = (n_dec as u32, kvh as u32, splits.count as u32);
                (
                    format!("paged_decode_g{g}_{ksuffix}"),
                    grid,
                    decode_shared_bytes(g, d),
                    128,
                )
            };
            let func = function_with_shared(&dev, &name, shared)?;
            let iv = ints(&[width, num_heads, kvh, d, bs]);
            let cfg = LaunchConfig {
                grid_dim: grid,
                block_dim: (threads, 1, 1),
                shared_mem_bytes: shared as u32,
            };
            {
                let mut b = ops.args(&stream, &func, &mut out, seqs_s, &iv);
                splits.push(&mut b);
                // SAFETY: argument order and types match `paged_decode_g<G>_<dtype>` and
                // `paged_decode_{tc,tk}_w<W>_d<D>_<dtype>` in csrc/decode.cu; the group fits G (16
                // for the tc kernel, 8 for tk, whose head dim and q alignment are checked above),
                // rows are 16-byte multiples, metadata validated.
                unsafe { b.launch(cfg) }.w()?;
            }
            splits.merge(&dev, suffix, &mut out, d)?;
        }
        if n_dec == num_seqs {
            return Ok((T::wrap_cuda_slice(out, dev), Shape::from(dims)));
        }
        // prompt tokens (and, without the decode kernel, decode tokens too)
        let min_len = if decode_bucket.is_some() { 2 } else { 1 };
        if tensor_core {
            let per = (64 / group).max(1);
            let (work, num_work) = meta.work_items(per, min_len)?;
            let (wg, _) = work.storage_and_layout();
            let items = cuda_slice::<u32>(&wg, "work")?;
            let func = function(&dev, &format!("paged_prefill_d{d}_{ksuffix}"))?;
            let iv = ints(&[width, num_heads, kvh, bs, per]);
            let mut b = ops.args(&stream, &func, &mut out, items, &iv);
            let cfg = LaunchConfig {
                grid_dim: (num_work as u32, kvh as u32, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: prefill_shared_bytes(d, fp8) as u32,
            };
            // SAFETY: argument order and types match `paged_prefill_d<D>_<dtype>` in
            // csrc/prefill.cu; 64 / group queries per item keep a CTA within 64 rows.
            unsafe { b.launch(cfg) }.w()?;
            return Ok((T::wrap_cuda_slice(out, dev), Shape::from(dims)));
        }
        let plan = LaunchPlan::new(num_heads, kvh, d, elem)?;
        let (work, num_work) = meta.work_items(plan.queries_per_cta, min_len)?;
        // the generic kernel splits only when it has every row (its merge rewrites them all)
        let split_keys = if decode_bucket.is_none() {
            plan.split_keys(num_work, max_ctx, sms)
        } else {
            0
        };
        let count = if split_keys > 0 {
            max_ctx.div_ceil(split_keys)
        } else {
            1
        };
        let mut splits = Splits::new(&dev, count, split_keys, total_rows, d)?;
        let (wg, _) = work.storage_and_layout();
        let items = cuda_slice::<u32>(&wg, "work")?;
        let func = function(&dev, &format!("paged_attention_{ksuffix}"))?;
        let iv = ints(&[
            width,
            num_heads,
            kvh,
            d,
            bs,
            plan.heads_per_cta,
            plan.queries_per_cta,
            plan.rows_cap,
            plan.tile_keys,
        ]);
        let cfg = LaunchConfig {
            grid_dim: (num_work as u32, plan.grid_y as u32, splits.count as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: plan.shared_bytes as u32,
        };
        {
            let mut b = ops.args(&stream, &func, &mut out, items, &iv);
            splits.push(&mut b);
            // SAFETY: argument order and types match `paged_attention_<dtype>` in
            // csrc/paged_attention.cu; the metadata was validated against the cache shape; the
            // partial buffers hold `splits` rows per (token, head) when split.
            unsafe { b.launch(cfg) }.w()?;
        }
        splits.merge(&dev, suffix, &mut out, d)?;
        Ok((T::wrap_cuda_slice(out, dev), Shape::from(dims)))
    }
}

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
