//! A one-shot all-reduce among the GPUs of one process over peer (NVLink) access
//! (`csrc/allreduce.cu`), for the small messages of decode steps: one kernel that copies, meets the
//! other ranks through flags in each other's memory and sums, where NCCL's fixed cost per call
//! is several times the transfer. Larger messages are left to NCCL ([`PeerAllReduce::takes`]).
//!
//! Every rank makes its [`PeerBuffers`], the ranks exchange their [`PeerBuffers::addresses`], turn
//! peer access on ([`enable_peer_access`]) and each builds its [`PeerAllReduce`]. Every rank must
//! then run the same sequence of calls (the kernel's epochs count them), as tensor-parallel ranks
//! do; a rank whose peer never comes stops with a device error after about 30 s.

use crate::cuda::{function, launch_dependent};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    result, sys, CudaContext, CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorage, CudaStorageSlice, WrapErr};
use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Tensor};
use std::ffi::c_void;
use std::sync::Arc;

/// The most ranks a group may have (the kernel's address table).
pub const MAX_WORLD: usize = 8;
/// Blocks of every call: fixed, since each block's epoch counts the calls.
const BLOCKS: u32 = 32;
/// The most rows for which the fused all-reduce and norm is the faster path: one row per block.
/// More rows share the blocks, where the plain all-reduce then `add_rms_norm` (a block per row on
/// every multiprocessor) spread the norm wider.
pub const FUSED_ROWS: usize = BLOCKS as usize;
const THREADS: u32 = 512;
/// The largest message (bytes) the one-shot kernel takes by default: a decode step of 256 rows of
/// an 8192-wide model in bf16.
pub const DEFAULT_MAX_BYTES: usize = 4 << 20;

/// One rank's buffers on its own device: a data buffer of two halves and the flags the other
/// ranks write into. Plain device allocations: memory from a stream-ordered pool (what candle's
/// and cudarc's allocations use where the GPU has one) is not opened to other GPUs by
/// `cuCtxEnablePeerAccess`.
pub struct PeerBuffers {
    ctx: Arc<CudaContext>,
    data: sys::CUdeviceptr,
    flags: sys::CUdeviceptr,
    half_bytes: usize,
}

// SAFETY: the two addresses are device memory owned by this value; freeing binds its context
unsafe impl Send for PeerBuffers {}
// SAFETY: as above; nothing mutates through a shared reference
unsafe impl Sync for PeerBuffers {}

const FLAG_BYTES: usize = BLOCKS as usize * MAX_WORLD * 4;

impl PeerBuffers {
    /// Buffers for messages of up to `max_bytes` (rounded up to 16) on `dev`, zeroed.
    pub fn new(dev: &CudaDevice, max_bytes: usize) -> Result<Self> {
        let half_bytes = max_bytes.div_ceil(16) * 16;
        let ctx = dev.cuda_stream().context().clone();
        ctx.bind_to_thread().w()?;
        // SAFETY: plain allocations on the bound context, each freed once (below or on drop),
        // zeroed synchronously before anyone learns their addresses
        unsafe {
            let data = result::malloc_sync(2 * half_bytes).w()?;
            let flags = match result::malloc_sync(FLAG_BYTES) {
                Ok(f) => f,
                Err(e) => {
                    let _ = result::free_sync(data);
                    return Err(e).w();
                }
            };
            let this = Self {
                ctx,
                data,
                flags,
                half_bytes,
            };
            result::memset_d8_sync(this.data, 0, 2 * half_bytes).w()?;
            result::memset_d8_sync(this.flags, 0, FLAG_BYTES).w()?;
            Ok(this)
        }
    }

    /// The device addresses of the data buffer and of the flags, for the other ranks.
    pub fn addresses(&self) -> (u64, u64) {
        (self.data, self.flags)
    }
}

impl Drop for PeerBuffers {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // this rank's last call has ended before its buffers go
            let _ = self.ctx.synchronize();
            // SAFETY: allocated by `new` on this context and freed only here
            unsafe {
                let _ = result::free_sync(self.data);
                let _ = result::free_sync(self.flags);
            }
        }
    }
}

/// Turns on access from `from`'s kernels to `to`'s memory; `false` when the two GPUs cannot
/// reach each other directly.
pub fn enable_peer_access(from: &CudaDevice, to: &CudaDevice) -> Result<bool> {
    let (a, b) = (
        from.cuda_stream().context().clone(),
        to.cuda_stream().context().clone(),
    );
    if a.ordinal() == b.ordinal() {
        return Ok(true);
    }
    let mut can = 0;
    // SAFETY: both are valid device handles; the driver writes one int
    let r = unsafe { sys::cuDeviceCanAccessPeer(&mut can, a.cu_device(), b.cu_device()) };
    if r != sys::CUresult::CUDA_SUCCESS || can == 0 {
        return Ok(false);
    }
    a.bind_to_thread().w()?;
    // SAFETY: `a`'s context is current on this thread and `b`'s context is alive
    let r = unsafe { sys::cuCtxEnablePeerAccess(b.cu_ctx(), 0) };
    Ok(matches!(
        r,
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
    ))
}

/// One rank's side of the one-shot all-reduce.
pub struct PeerAllReduce {
    dev: CudaDevice,
    /// Kept alive: the other ranks read and write it.
    own: PeerBuffers,
    /// Every rank's data address, then every rank's flags address (`2 * MAX_WORLD`).
    table: CudaSlice<u64>,
    /// This rank's epoch per block, written only by the kernel.
    counters: CudaSlice<u32>,
    rank: usize,
    world: usize,
}

impl std::fmt::Debug for PeerAllReduce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerAllReduce")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("max_bytes", &self.own.half_bytes)
            .finish()
    }
}

impl PeerAllReduce {
    /// Rank `rank` of the group whose ranks' [`PeerBuffers::addresses`] are `all` (in rank order),
    /// with `own` its buffers on `dev`; peer access to every other rank must be on.
    pub fn new(
        dev: &CudaDevice,
        own: PeerBuffers,
        rank: usize,
        all: &[(u64, u64)],
    ) -> Result<Self> {
        let world = all.len();
        if world == 0 || world > MAX_WORLD || rank >= world {
            candle_core::bail!("peer all-reduce: rank {rank} of {world} (at most {MAX_WORLD})");
        }
        let mut table = vec![0u64; 2 * MAX_WORLD];
        for (r, (d, f)) in all.iter().enumerate() {
            table[r] = *d;
            table[MAX_WORLD + r] = *f;
        }
        let stream = dev.cuda_stream();
        let table = stream.clone_htod(&table).w()?;
        let counters = stream.alloc_zeros::<u32>(BLOCKS as usize).w()?;
        // the first call may come from another thread, on that thread's stream
        stream.synchronize().w()?;
        Ok(Self {
            dev: dev.clone(),
            own,
            table,
            counters,
            rank,
            world,
        })
    }

    /// Whether `x` goes through this kernel: a 16-bit or f32 tensor of at most the buffers' size
    /// whose bytes are whole 16-byte vectors. The answer depends only on `x`'s shape and dtype,
    /// so every rank of a step answers alike.
    pub fn takes(&self, x: &Tensor) -> bool {
        let bytes = x.elem_count() * x.dtype().size_in_bytes();
        matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16)
            && starts_aligned(x)
            && bytes > 0
            && bytes.is_multiple_of(16)
            && bytes <= self.own.half_bytes
    }

    /// The element-wise sum of `x` over every rank; every rank must call it with the same shape,
    /// one that [`PeerAllReduce::takes`] (anything else is an error).
    pub fn all_reduce(&self, x: &Tensor) -> Result<Tensor> {
        x.contiguous()?.apply_op1_no_bwd(self)
    }

    /// Whether [`PeerAllReduce::all_reduce_add_rms_norm`] takes `x` `[tokens, hidden]` with
    /// `residual` and `weight`: what [`PeerAllReduce::takes`] takes, with rows of whole 16-byte
    /// vectors, the other two aligned to them as well.
    pub fn takes_rows(&self, x: &Tensor, residual: &Tensor, weight: &Tensor) -> bool {
        let esize = x.dtype().size_in_bytes();
        matches!(x.dims(), &[_, h] if (h * esize).is_multiple_of(16))
            && starts_aligned(residual)
            && starts_aligned(weight)
            && self.takes(x)
    }

    /// The sum of `x` over every rank plus `residual`, and that sum's RMS norm times `weight`
    /// (`eps` inside the root): what [`PeerAllReduce::all_reduce`] then `add_rms_norm` give, bit
    /// for bit, in one kernel. `x` and `residual` are `[tokens, hidden]`, `weight` `[hidden]`, all
    /// of one dtype; every rank calls it with the same shapes, ones [`PeerAllReduce::takes_rows`].
    pub fn all_reduce_add_rms_norm(
        &self,
        x: &Tensor,
        residual: &Tensor,
        weight: &Tensor,
        eps: f64,
    ) -> Result<(Tensor, Tensor)> {
        crate::fused::check_add_rms_norm("peer all-reduce + RMS norm", x, residual, weight)?;
        let out = x.contiguous()?.apply_op3_no_bwd(
            &residual.contiguous()?,
            &weight.contiguous()?,
            &AddRmsNorm {
                ar: self,
                eps: eps as f32,
            },
        )?;
        Ok((out.get(0)?, out.get(1)?))
    }

    fn table_ptr(&self) -> u64 {
        raw(&self.table, &self.dev)
    }

    fn counters_ptr(&self) -> u64 {
        raw(&self.counters, &self.dev)
    }
}

impl CustomOp1 for PeerAllReduce {
    fn name(&self) -> &'static str {
        "peer-all-reduce"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("the peer all-reduce takes CUDA tensors")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let (a, b) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("peer all-reduce: not contiguous".into()))?;
        let dev = self.dev.clone();
        let out = match &s.slice {
            CudaStorageSlice::F32(v) => {
                CudaStorage::wrap_cuda_slice(self.launch(v, a..b, "allreduce_oneshot_f32")?, dev)
            }
            CudaStorageSlice::BF16(v) => {
                CudaStorage::wrap_cuda_slice(self.launch(v, a..b, "allreduce_oneshot_bf16")?, dev)
            }
            CudaStorageSlice::F16(v) => {
                CudaStorage::wrap_cuda_slice(self.launch(v, a..b, "allreduce_oneshot_f16")?, dev)
            }
            _ => candle_core::bail!("peer all-reduce: dtype {:?}", s.dtype()),
        };
        Ok((out, l.shape().clone()))
    }
}

impl PeerAllReduce {
    /// Sums elements `range` of `v` over the ranks into a new slice, with `kernel`.
    fn launch<T: DeviceRepr>(
        &self,
        v: &CudaSlice<T>,
        range: std::ops::Range<usize>,
        kernel: &str,
    ) -> Result<CudaSlice<T>> {
        let esize = std::mem::size_of::<T>();
        let input = raw(v, &self.dev) + (range.start * esize) as u64;
        let bytes = range.len() * esize;
        if !input.is_multiple_of(16) || !bytes.is_multiple_of(16) || bytes > self.own.half_bytes {
            candle_core::bail!("peer all-reduce: {bytes} bytes unaligned or above the buffers");
        }
        let stream = self.dev.cuda_stream();
        // SAFETY: every element is written by the kernel before any read
        let mut out = unsafe { stream.alloc::<T>(range.len()) }.w()?;
        let func = function(&self.dev, kernel)?;
        let nvec = (bytes / 16) as i64;
        let (half, rank, world) = (
            self.own.half_bytes as i64,
            self.rank as i32,
            self.world as i32,
        );
        {
            let (optr, _g) = out.device_ptr_mut(&stream);
            let (mut ip, mut op, mut tp, mut cp) =
                (input, optr, self.table_ptr(), self.counters_ptr());
            let (mut nv, mut hb, mut rk, mut wd) = (nvec, half, rank, world);
            let mut params = [
                (&raw mut ip).cast::<c_void>(),
                (&raw mut op).cast::<c_void>(),
                (&raw mut nv).cast::<c_void>(),
                (&raw mut tp).cast::<c_void>(),
                (&raw mut cp).cast::<c_void>(),
                (&raw mut hb).cast::<c_void>(),
                (&raw mut rk).cast::<c_void>(),
                (&raw mut wd).cast::<c_void>(),
            ];
            // SAFETY: matches `allreduce_oneshot_*` in csrc/allreduce.cu: `input` holds `nvec`
            // 16-byte vectors (checked above) and `out` as many; the table holds every rank's
            // buffers of `half` bytes per half and BLOCKS x MAX_WORLD flags; the counters (one
            // per block) are this rank's, written only by these kernels; the kernel waits for the
            // kernel before it before it reads or writes anything
            unsafe { launch_dependent(&func, &stream, BLOCKS, THREADS, &mut params) }?;
        }
        Ok(out)
    }
}

/// The fused all-reduce, residual add and RMS norm (see
/// [`PeerAllReduce::all_reduce_add_rms_norm`]); its output is `[2, tokens, hidden]`.
struct AddRmsNorm<'a> {
    ar: &'a PeerAllReduce,
    eps: f32,
}

impl CustomOp3 for AddRmsNorm<'_> {
    fn name(&self) -> &'static str {
        "peer-all-reduce-add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("the peer all-reduce takes CUDA tensors")
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        r: &CudaStorage,
        rl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let dev = self.ar.dev.clone();
        let (t, h) = (xl.dims()[0], xl.dims()[1]);
        let out = match (&x.slice, &r.slice, &w.slice) {
            (CudaStorageSlice::F32(x), CudaStorageSlice::F32(r), CudaStorageSlice::F32(w)) => {
                let o = self.launch((x, xl), (r, rl), (w, wl), "allreduce_add_rms_norm_f32")?;
                CudaStorage::wrap_cuda_slice(o, dev)
            }
            (CudaStorageSlice::BF16(x), CudaStorageSlice::BF16(r), CudaStorageSlice::BF16(w)) => {
                let o = self.launch((x, xl), (r, rl), (w, wl), "allreduce_add_rms_norm_bf16")?;
                CudaStorage::wrap_cuda_slice(o, dev)
            }
            (CudaStorageSlice::F16(x), CudaStorageSlice::F16(r), CudaStorageSlice::F16(w)) => {
                let o = self.launch((x, xl), (r, rl), (w, wl), "allreduce_add_rms_norm_f16")?;
                CudaStorage::wrap_cuda_slice(o, dev)
            }
            _ => candle_core::bail!("peer all-reduce + RMS norm: dtypes differ or unsupported"),
        };
        Ok((out, Shape::from((2, t, h))))
    }
}

impl AddRmsNorm<'_> {
    fn launch<T: DeviceRepr>(
        &self,
        x: (&CudaSlice<T>, &Layout),
        r: (&CudaSlice<T>, &Layout),
        w: (&CudaSlice<T>, &Layout),
        kernel: &str,
    ) -> Result<CudaSlice<T>> {
        let ar = self.ar;
        let esize = std::mem::size_of::<T>();
        let (t, h) = (x.1.dims()[0], x.1.dims()[1]);
        let mut ptrs = [0u64; 3];
        for (p, (v, l)) in ptrs.iter_mut().zip([x, r, w]) {
            let (a, _) = l.contiguous_offsets().ok_or_else(|| {
                candle_core::Error::Msg("peer all-reduce + RMS norm: not contiguous".into())
            })?;
            *p = raw(v, &ar.dev) + (a * esize) as u64;
        }
        let bytes = t * h * esize;
        if ptrs.iter().any(|p| !p.is_multiple_of(16))
            || !(h * esize).is_multiple_of(16)
            || bytes > ar.own.half_bytes
        {
            candle_core::bail!(
                "peer all-reduce + RMS norm: {t} x {h} unaligned or above the buffers"
            );
        }
        let stream = ar.dev.cuda_stream();
        // SAFETY: every element is written by the kernel before any read
        let mut out = unsafe { stream.alloc::<T>(2 * t * h) }.w()?;
        let func = function(&ar.dev, kernel)?;
        // as many threads as add_rms_norm gives the row (one per 16-byte vector), so the norm's
        // sums are taken in the same order
        let lanes = h * esize / 16;
        let threads = lanes.next_multiple_of(32).clamp(32, 1024) as u32;
        {
            let (optr, _g) = out.device_ptr_mut(&stream);
            let [mut xp, mut rp, mut wp] = ptrs;
            let (mut op, mut tp, mut cp) = (optr, ar.table_ptr(), ar.counters_ptr());
            let (mut ti, mut hi, mut e) = (t as i32, h as i32, self.eps);
            let (mut hb, mut rk, mut wd) =
                (ar.own.half_bytes as i64, ar.rank as i32, ar.world as i32);
            let mut params = [
                (&raw mut xp).cast::<c_void>(),
                (&raw mut rp).cast::<c_void>(),
                (&raw mut wp).cast::<c_void>(),
                (&raw mut op).cast::<c_void>(),
                (&raw mut ti).cast::<c_void>(),
                (&raw mut hi).cast::<c_void>(),
                (&raw mut e).cast::<c_void>(),
                (&raw mut tp).cast::<c_void>(),
                (&raw mut cp).cast::<c_void>(),
                (&raw mut hb).cast::<c_void>(),
                (&raw mut rk).cast::<c_void>(),
                (&raw mut wd).cast::<c_void>(),
            ];
            // SAFETY: matches `allreduce_add_rms_norm_*` in csrc/allreduce.cu: x and residual
            // hold t x h values, w h, out 2 x t x h, all 16-byte aligned with rows of whole
            // 16-byte vectors (checked above), t x h values fit a half of the buffers; the table
            // and counters as in `PeerAllReduce::launch`; the kernel waits for the kernel before
            // it before it reads or writes anything
            unsafe { launch_dependent(&func, &stream, BLOCKS, threads, &mut params) }?;
        }
        Ok(out)
    }
}

/// Whether `t`'s data starts on a 16-byte boundary as the kernels get it: a contiguous tensor
/// keeps its offset; another is copied to a fresh (aligned) buffer first.
fn starts_aligned(t: &Tensor) -> bool {
    !t.is_contiguous() || (t.layout().start_offset() * t.dtype().size_in_bytes()).is_multiple_of(16)
}

/// The device address of a slice's first element.
fn raw<T>(v: &CudaSlice<T>, dev: &CudaDevice) -> u64 {
    let stream = dev.cuda_stream();
    let (p, _g) = v.device_ptr(&stream);
    p
}
