//! Checkpoint bytes to the GPU through pinned staging buffers: the bytes of a tensor are copied
//! out of the memory map by several threads into one pinned buffer while the copy engine moves
//! the previous buffer to the device, so reading the page cache, faulting the map in and the
//! transfer overlap (a plain copy from pageable memory does them one after the other, through
//! the driver's own small staging).

use candle_core::cuda_backend::cudarc::driver::{result, CudaEvent, DevicePtrMut, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::{CudaStorage, DType, Result, Shape, Storage, Tensor, WithDType};
use half::{bf16, f16};
use rayon::prelude::*;

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
            DType::BF16 => self.upload_as::<bf16>(dev, bytes, shape),
            DType::F16 => self.upload_as::<f16>(dev, bytes, shape),
            DType::F32 => self.upload_as::<f32>(dev, bytes, shape),
            other => candle_core::bail!("staged upload of {other:?}"),
        }
    }

    fn upload_as<T: CudaDType + WithDType + DeviceRepr>(
        &mut self,
        dev: &CudaDevice,
        bytes: &[u8],
        shape: &[usize],
    ) -> Result<Tensor> {
        let elems: usize = shape.iter().product();
        let size = std::mem::size_of::<T>();
        if bytes.len() != elems * size {
            candle_core::bail!(
                "staged upload: {} bytes for {shape:?} of {size}-byte values",
                bytes.len()
            );
        }
        // SAFETY: every byte is written by the copies below before the tensor is read
        let mut dst = unsafe { dev.alloc::<T>(elems) }?;
        let stream = dev.cuda_stream();
        {
            let (base, _guard) = dst.device_ptr_mut(&stream);
            let mut offset = 0u64;
            for chunk in bytes.chunks(BUF_BYTES) {
                let slot = &mut self.bufs[self.next];
                self.next = (self.next + 1) % BUFS;
                if let Some(done) = slot.done.take() {
                    done.synchronize().map_err(err)?;
                }
                // SAFETY: the buffer holds BUF_BYTES >= chunk.len() bytes and no copy reads it
                // any more (its event has completed)
                let buf = unsafe { std::slice::from_raw_parts_mut(slot.ptr, chunk.len()) };
                buf.par_chunks_mut(PIECE)
                    .zip(chunk.par_chunks(PIECE))
                    .for_each(|(d, s)| d.copy_from_slice(s));
                // SAFETY: the destination range lies inside `dst`; the buffer stays pinned and
                // untouched until the event recorded after this copy completes
                unsafe { result::memcpy_htod_async(base + offset, buf, stream.cu_stream()) }
                    .map_err(err)?;
                slot.done = Some(stream.record_event(None).map_err(err)?);
                offset += chunk.len() as u64;
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
