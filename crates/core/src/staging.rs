//! Checkpoint bytes to the GPU through pinned staging buffers: the bytes of a tensor are copied
//! out of the memory map by several threads into one pinned buffer while the copy engine moves
//! the previous buffer to the device, so reading the page cache, faulting the map in and the
//! transfer overlap (a plain copy from pageable memory does them one after the other, through
//! the driver's own small staging).

use candle_core::cuda_backend::cudarc::driver::{result, CudaEvent, DevicePtrMut, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::{CudaStorage, DType, Result, Shape, Storage, Tensor, WithDType};
use half::{bf16, f16};

/// Bytes of one staging buffer.
const BUF_BYTES: usize = 32 << 20;
/// Buffers in flight.
const BUFS: usize = 4;
/// Tensors smaller than this take the plain copy (one call, nothing to overlap).
pub const MIN_BYTES: usize = 4 << 20;
/// Bytes each thread copies at once.
const PIECE: usize = 1 << 20;

struct Pinned {
    ptr: *mut u8,
    /// The copy reading this buffer, if one may still be running.
    done: Option<CudaEvent>,
}

/// A set of pinned buffers, reused tensor after tensor.
pub struct Staging {
    bufs: Vec<Pinned>,
    next: usize,
}

/// A [`Staging`] made on first use and shared behind a lock (a checkpoint's loader, a vision
/// encoder's pixel uploads).
#[derive(Default)]
pub struct Shared(std::sync::Mutex<Option<Staging>>);

impl Shared {
    /// Runs `f` with the buffers, allocating them on `dev` the first time.
    pub fn with<R>(
        &self,
        dev: &CudaDevice,
        f: impl FnOnce(&mut Staging) -> Result<R>,
    ) -> Result<R> {
        let mut g = self
            .0
            .lock()
            .map_err(|_| candle_core::Error::Msg("staging lock poisoned".into()))?;
        let staging = match g.as_mut() {
            Some(s) => s,
            None => g.insert(Staging::new(dev)?),
        };
        f(staging)
    }
}

// SAFETY: the pinned buffers are owned by this value alone and only touched through `&mut self`.
unsafe impl Send for Staging {}

fn err(e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("staged upload: {e:?}"))
}

impl Staging {
    /// Allocates the pinned buffers (on `dev`'s context).
    pub fn new(dev: &CudaDevice) -> Result<Self> {
        dev.cuda_stream().context().bind_to_thread().map_err(err)?;
        // built first, so that Drop frees what was allocated when a later allocation fails
        let mut staging = Self {
            bufs: Vec::with_capacity(BUFS),
            next: 0,
        };
        for _ in 0..BUFS {
            // SAFETY: a plain page-locked allocation, freed in Drop
            let ptr = unsafe { result::malloc_host(BUF_BYTES, 0) }.map_err(err)? as *mut u8;
            staging.bufs.push(Pinned { ptr, done: None });
        }
        Ok(staging)
    }

    /// `bytes` (a tensor of `dtype` and `shape`, as stored) as a tensor on `dev`.
    pub fn upload(
        &mut self,
        dev: &CudaDevice,
        bytes: &[u8],
        dtype: DType,
        shape: &[usize],
    ) -> Result<Tensor> {
        match dtype {
            DType::BF16 => self.upload_bytes::<bf16>(dev, &[bytes], shape),
            DType::F16 => self.upload_bytes::<f16>(dev, &[bytes], shape),
            DType::F32 => self.upload_bytes::<f32>(dev, &[bytes], shape),
            other => candle_core::bail!("staged upload of {other:?}"),
        }
    }

    /// The values of `parts`, one after another, as one tensor of `shape` on `dev`. The copies
    /// run on the device's stream behind the work already queued there; the call waits only for
    /// a buffer whose earlier copy has not finished.
    pub fn upload_values<T: CudaDType + WithDType + DeviceRepr + Copy + Send + Sync>(
        &mut self,
        dev: &CudaDevice,
        parts: &[&[T]],
        shape: &[usize],
    ) -> Result<Tensor> {
        self.stage::<T, T, T>(dev, parts, shape, |src, dst| dst.copy_from_slice(src))
    }

    /// f32 `parts` as one tensor of `shape` and dtype `dtype` (f32, bf16 or f16) on `dev`: the
    /// values are rounded (to nearest, ties to even, as the device's own conversion does) while
    /// they are staged, so a 16-bit tensor crosses the bus in half the bytes (the pixels of a
    /// batch of images for an encoder in bf16).
    pub fn upload_f32_as(
        &mut self,
        dev: &CudaDevice,
        parts: &[&[f32]],
        shape: &[usize],
        dtype: DType,
    ) -> Result<Tensor> {
        fn round<T: Copy>(f: impl Fn(f32) -> T + Sync) -> impl Fn(&[f32], &mut [T]) + Sync {
            move |src, dst| dst.iter_mut().zip(src).for_each(|(d, &v)| *d = f(v))
        }
        match dtype {
            DType::F32 => self.upload_values(dev, parts, shape),
            DType::BF16 => self.stage::<f32, bf16, bf16>(dev, parts, shape, round(bf16::from_f32)),
            DType::F16 => self.stage::<f32, f16, f16>(dev, parts, shape, round(f16::from_f32)),
            other => candle_core::bail!("staged upload as {other:?}"),
        }
    }

    fn upload_bytes<T: CudaDType + WithDType + DeviceRepr>(
        &mut self,
        dev: &CudaDevice,
        parts: &[&[u8]],
        shape: &[usize],
    ) -> Result<Tensor> {
        self.stage::<u8, u8, T>(dev, parts, shape, |src, dst| dst.copy_from_slice(src))
    }

    /// The elements of `parts` written by `fill` (a run of sources into as many staged values)
    /// into the pinned buffers, each buffer copied to the device as it fills: a tensor of
    /// `shape` of `T`, whose bytes are the staged values' bytes.
    fn stage<S: Sync, D: Copy + Send, T: CudaDType + WithDType + DeviceRepr>(
        &mut self,
        dev: &CudaDevice,
        parts: &[&[S]],
        shape: &[usize],
        fill: impl Fn(&[S], &mut [D]) + Sync,
    ) -> Result<Tensor> {
        let elems: usize = shape.iter().product();
        let (size, staged) = (std::mem::size_of::<T>(), std::mem::size_of::<D>());
        let total: usize = parts.iter().map(|p| p.len() * staged).sum();
        if total != elems * size {
            candle_core::bail!("staged upload: {total} bytes for {shape:?} of {size}-byte values");
        }
        // staged values a buffer holds, and one thread's share of a run
        let (per_buf, piece) = (BUF_BYTES / staged, (PIECE / staged).max(1));
        // SAFETY: every byte is written by the copies below before the tensor is read
        let mut dst = unsafe { dev.alloc::<T>(elems) }?;
        let stream = dev.cuda_stream();
        {
            let (base, _guard) = dst.device_ptr_mut(&stream);
            let mut offset = 0u64;
            // the parts' values in buffer-sized runs: a run may take the ends of several parts
            let mut pieces = parts.iter().flat_map(|p| p.chunks(per_buf)).peekable();
            while pieces.peek().is_some() {
                let slot = &mut self.bufs[self.next];
                self.next = (self.next + 1) % BUFS;
                if let Some(done) = slot.done.take() {
                    done.synchronize().map_err(err)?;
                }
                // this buffer's share of the parts, then filled from all of them at once
                let mut runs: Vec<&[S]> = Vec::new();
                let mut filled = 0;
                while let Some(piece_src) = pieces.peek_mut() {
                    let n = piece_src.len().min(per_buf - filled);
                    if n == 0 {
                        break;
                    }
                    let cur: &[S] = piece_src;
                    let (head, rest) = cur.split_at(n);
                    runs.push(head);
                    filled += n;
                    *piece_src = rest;
                    if piece_src.is_empty() {
                        pieces.next();
                    }
                }
                // SAFETY: values 0..filled lie inside the BUF_BYTES of the buffer (page-aligned,
                // so aligned for D), which no copy reads any more (its event has completed);
                // they are all written here before anything reads them
                let run = unsafe { std::slice::from_raw_parts_mut(slot.ptr.cast::<D>(), filled) };
                crate::host::fill_in_parallel(&runs, run, piece, &fill);
                let bytes = filled * staged;
                // SAFETY: the buffer's first `bytes` bytes, all written above
                let buf = unsafe { std::slice::from_raw_parts(slot.ptr, bytes) };
                // SAFETY: the destination range lies inside `dst`; the buffer stays pinned and
                // untouched until the event recorded after this copy completes
                unsafe { result::memcpy_htod_async(base + offset, buf, stream.cu_stream()) }
                    .map_err(err)?;
                slot.done = Some(stream.record_event(None).map_err(err)?);
                offset += bytes as u64;
            }
        }
        let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(dst, dev.clone()));
        Ok(Tensor::from_storage(
            storage,
            Shape::from(shape.to_vec()),
            candle_core::op::BackpropOp::none(),
            false,
        ))
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        for b in &mut self.bufs {
            if let Some(done) = b.done.take() {
                let _ = done.synchronize();
            }
            // SAFETY: allocated by malloc_host; no copy reads it any more (synchronized above)
            unsafe {
                let _ = result::free_host(b.ptr as *mut std::ffi::c_void);
            }
        }
    }
}
