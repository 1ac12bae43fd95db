//! The CUDA side of [`super::PagedAttention`]: which kernel serves each part of a step (decode
//! rows, prompt tokens, or every row), the operands every attention kernel takes first, and the
//! split buffers the decode and generic kernels take last.
use super::{
    decode_group_bucket, decode_shared_bytes, decode_splits, decode_tc_layout,
    decode_tc_shared_bytes, decode_tc_warps, prefill_shared_bytes, LaunchPlan, PagedAttention,
    DECODE_MIN_SPLIT_KEYS, PREFILL_HEAD_DIMS,
};
use crate::cuda::{function, Dependent};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, DeviceRepr, LaunchConfig,
};
use candle_core::cuda_backend::CudaDevice;
use candle_core::Result;
use candle_core::{Layout, Shape};

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
/// Every attention kernel launches as a programmatic dependent and waits for the kernel before
/// it at entry.
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
        func: &'b CudaFunction,
        out: &'b mut CudaSlice<T>,
        list: &'b CudaSlice<u32>,
        ints: &[i32],
    ) -> Dependent<'b> {
        let mut b = Dependent::new(stream, func);
        b.attention()
            .buf_mut(out)
            .buf(&self.q)
            .buf(self.k)
            .buf(self.v)
            .buf(self.tables)
            .buf(self.lens)
            .buf(self.starts)
            .buf(list);
        for &v in ints {
            b.val(v);
        }
        b.val(self.scale).val(self.window).val(self.q_stride);
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
    pub fn new(dev: &CudaDevice, count: usize, keys: usize, rows: usize, d: usize) -> Result<Self> {
        let count = count.max(1);
        let n = if count > 1 { count * rows } else { 1 };
        // SAFETY: a splitting launch writes every (split, row) entry that the merge reads;
        // a launch that does not split never touches them.
        let (acc, ml) = unsafe {
            (
                crate::cuda::alloc::<f32>(dev, n * d)?,
                crate::cuda::alloc::<f32>(dev, n * 2)?,
            )
        };
        Ok(Self {
            count,
            keys: if count > 1 { keys as i32 } else { 0 },
            rows: rows as i64,
            acc,
            ml,
        })
    }

    /// The trailing arguments: keys per split (0: none), rows, the partial buffers.
    pub fn push<'b>(&'b mut self, b: &mut Dependent<'b>) {
        b.val(self.keys)
            .val(self.rows)
            .buf_mut(&mut self.acc)
            .buf_mut(&mut self.ml);
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
        let mut c = Dependent::new(&stream, &combine);
        c.attention()
            .buf_mut(out)
            .buf(&self.acc)
            .buf(&self.ml)
            .val(self.count as i32)
            .val(self.rows)
            .val(d as i32);
        let cfg = LaunchConfig {
            grid_dim: (self.rows as u32, 1, 1),
            block_dim: (d.min(128) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `paged_attention_combine_<dtype>`; every (split, row) entry was
        // written by the split launch before it (the merge waits for it at entry); at most 512
        // splits.
        unsafe { c.launch(cfg) }?;
        Ok(())
    }
}

impl PagedAttention<'_> {
    pub(super) fn cuda_run<T, C>(
        &self,
        q: &candle_core::CudaStorage,
        ql: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)>
    where
        T: crate::cuda::KernelElem,
        C: crate::cuda::KernelElem,
    {
        use crate::cuda::{
            cuda_slice, dtype_suffix, early_attention_enabled, function, function_with_shared,
            keys_as_rows_decode_enabled, tensor_core_decode_enabled, token_rows,
        };

        let dims = ql.dims();
        let (num_tokens, num_heads, d) = (dims[0], dims[1], dims[2]);
        let (_, bs, kvh, _) = self.k_cache.dims4()?;
        let elem = std::mem::size_of::<T>();
        let group = num_heads / kvh;
        let dev = q.device().clone();
        let suffix = dtype_suffix(T::DTYPE)?;
        let fp8 = C::DTYPE == crate::cache::FP8_CACHE_DTYPE;
        // the attention kernels' suffix: the compute dtype, then `_fp8` for an FP8 cache
        let ksuffix = crate::cache::cache_suffix(T::DTYPE, C::DTYPE)?;
        let total_rows = num_tokens * num_heads;
        // SAFETY: every (token, head) row is written below: decode rows by the decode kernel (or
        // its merge), the other rows by a prompt kernel's work items, which cover every token.
        let mut out = unsafe { crate::cuda::alloc::<T>(&dev, total_rows * d) }?;
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
        let (tg, tl) = arrays.block_tables.storage_and_layout();
        let (lg, ll) = arrays.seq_lens.storage_and_layout();
        let (sg, sl) = arrays.query_start_loc.storage_and_layout();
        let ops = Operands {
            q: q_view,
            q_stride,
            k: cuda_slice::<C>(&kg, kl, "k_cache")?,
            v: cuda_slice::<C>(&vg, vl, "v_cache")?,
            tables: cuda_slice::<u32>(&tg, tl, "block_tables")?,
            lens: cuda_slice::<u32>(&lg, ll, "seq_lens")?,
            starts: cuda_slice::<u32>(&sg, sl, "query_start_loc")?,
            scale: self.params.scale,
            window: self.params.sliding_window.map_or(0, |w| w as i32),
        };
        let stream = dev.cuda_stream();
        let ints = |v: &[usize]| v.iter().map(|&x| x as i32).collect::<Vec<i32>>();
        let sms = multiprocessors(&dev);
        let width = meta.width;

        if let (Some(g), true) = (decode_bucket, n_dec > 0) {
            let (seqs, _) = meta.decode_seqs()?;
            let (seqs_g, seqs_l) = seqs.storage_and_layout();
            let seqs_s = cuda_slice::<u32>(&seqs_g, seqs_l, "decode sequences")?;
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
                let keys_as_rows = group <= 8 && keys_as_rows_decode_enabled();
                let layout = decode_tc_layout(
                    keys_as_rows,
                    w,
                    n_dec == num_seqs,
                    early_attention_enabled(),
                );
                (
                    format!("paged_decode_{layout}_w{w}_d{d}_{ksuffix}"),
                    grid,
                    decode_tc_shared_bytes(w, d, elem, fp8, keys_as_rows),
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
                // SAFETY: argument order and types match `paged_decode_g<G>_<dtype>` (csrc/decode.cu)
                // and `paged_decode_{tc,tk,tk_early}_w<W>_d<D>_<dtype>` (csrc/decode_tc.cu); the group
                // fits G (16 for the tc kernel, 8 for tk, whose head dim and q alignment are checked
                // above), rows are 16-byte multiples, metadata validated.
                unsafe { b.launch(cfg) }?;
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
            let (wg, wl) = work.storage_and_layout();
            let items = cuda_slice::<u32>(&wg, wl, "work")?;
            let func = function(&dev, &format!("paged_prefill_d{d}_{ksuffix}"))?;
            let iv = ints(&[width, num_heads, kvh, bs, per]);
            let b = ops.args(&stream, &func, &mut out, items, &iv);
            let cfg = LaunchConfig {
                grid_dim: (num_work as u32, kvh as u32, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: prefill_shared_bytes(d, fp8) as u32,
            };
            // SAFETY: argument order and types match `paged_prefill_d<D>_<dtype>` in
            // csrc/prefill.cu; 64 / group queries per item keep a CTA within 64 rows.
            unsafe { b.launch(cfg) }?;
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
        let (wg, wl) = work.storage_and_layout();
        let items = cuda_slice::<u32>(&wg, wl, "work")?;
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
            unsafe { b.launch(cfg) }?;
        }
        splits.merge(&dev, suffix, &mut out, d)?;
        Ok((T::wrap_cuda_slice(out, dev), Shape::from(dims)))
    }
}
