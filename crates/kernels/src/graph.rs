//! CUDA graphs: a sequence of launches recorded once and replayed with one driver call, and the
//! in-place host writes that refresh a graph's input tensors before each replay.
//!
//! A captured graph holds the device addresses of every tensor it touches, so its inputs must be
//! tensors that outlive it and are rewritten in place ([`write_rows`]); everything the recorded
//! work allocates is allocated and freed inside the graph. Capture runs the work twice: once
//! eagerly, which loads kernels and fills candle's cache of small uploads, then recorded.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{sys, CudaGraph, DevicePtrMut};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CpuStorage, CudaStorage, Device, InplaceOp1, Layout, Result, Tensor, WithDType};

/// A recorded sequence of launches on the calling thread's stream (candle's per-thread stream): it
/// must be launched from the thread that captured it, which also writes its inputs.
pub struct Graph {
    graph: CudaGraph,
}

// SAFETY: the graph's handles belong to the CUDA context, not to a thread; a `Graph` is used by one
// thread at a time (its owner), and CUDA only forbids concurrent use of one graph.
unsafe impl Send for Graph {}

impl Graph {
    /// Runs `work` once eagerly, then records it into a graph. `work` must launch the same kernels
    /// on the same tensors both times and must not copy between host and device.
    pub fn capture(device: &Device, mut work: impl FnMut() -> Result<()>) -> Result<Self> {
        let Device::Cuda(dev) = device else {
            candle_core::bail!("CUDA graphs need a CUDA device");
        };
        let _cache = dev.enable_cuda_graph_htod_cache();
        work()?;
        let stream = dev.cuda_stream();
        stream.synchronize().w()?;
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .w()?;
        let recorded = work();
        // The capture must end whatever happened, or the stream stays unusable. Errors recorded
        // by frees inside the capture would make cudarc's end_capture return before ending it:
        // they are taken first, and the capture is ended directly if it is still open.
        let freed = stream.context().check_err();
        let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        let open = !matches!(
            stream.capture_status(),
            Ok(sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
        );
        if open {
            let mut partial: sys::CUgraph = std::ptr::null_mut();
            // SAFETY: ends the capture begun above on this thread's stream; the partial graph it
            // may return is destroyed at once. Failures here leave nothing more to undo.
            unsafe {
                if sys::cuStreamEndCapture(stream.cu_stream(), &mut partial)
                    == sys::CUresult::CUDA_SUCCESS
                    && !partial.is_null()
                {
                    sys::cuGraphDestroy(partial);
                }
            }
        }
        recorded?;
        freed.w()?;
        let graph = ended
            .w()?
            .ok_or_else(|| candle_core::Error::Msg("the captured graph is empty".into()))?;
        graph.upload().w()?;
        Ok(Self { graph })
    }

    /// Queues the recorded launches on the stream they were captured on.
    pub fn launch(&self) -> Result<()> {
        self.graph.launch().w()
    }
}

/// Writes `rows` rows of `cols` values from `src` (dense, row after row) into the first `cols`
/// columns of the first `rows` rows of `dst`, a contiguous `[n]` (one row) or `[n, width]` tensor
/// of `T`; the rest of `dst` is left as it was. Queued on the calling thread's stream, so a graph
/// launched after it reads the new values.
pub fn write_rows<T: CudaDType + WithDType>(
    dst: &Tensor,
    src: &[T],
    rows: usize,
    cols: usize,
) -> Result<()> {
    let (n, width) = match dst.dims() {
        [n] => (1, *n),
        [n, w] => (*n, *w),
        d => candle_core::bail!("write_rows: a {d:?} destination"),
    };
    if dst.dtype() != T::DTYPE || !dst.is_contiguous() {
        candle_core::bail!(
            "write_rows: the destination must be contiguous {:?}",
            T::DTYPE
        );
    }
    if rows > n || cols > width || src.len() != rows * cols {
        candle_core::bail!(
            "write_rows: {} values as {rows} x {cols} into {n} x {width}",
            src.len()
        );
    }
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    dst.inplace_op1(&WriteRows {
        src,
        rows,
        cols,
        width,
    })
}

struct WriteRows<'a, T> {
    src: &'a [T],
    rows: usize,
    cols: usize,
    width: usize,
}

impl<T: CudaDType + WithDType> InplaceOp1 for WriteRows<'_, T> {
    fn name(&self) -> &'static str {
        "write-rows"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        candle_core::bail!("write_rows writes device tensors")
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> Result<()> {
        let elem = std::mem::size_of::<T>();
        let base = l.start_offset() * elem;
        let stream = s.device().cuda_stream();
        let slice = s.as_cuda_slice_mut::<T>()?;
        let (ptr, _sync) = slice.device_ptr_mut(&stream);
        let p = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_HOST,
            srcHost: self.src.as_ptr().cast(),
            srcDevice: 0,
            srcArray: std::ptr::null_mut(),
            srcPitch: self.cols * elem,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: ptr + base as u64,
            dstArray: std::ptr::null_mut(),
            dstPitch: self.width * elem,
            WidthInBytes: self.cols * elem,
            Height: self.rows,
        };
        // SAFETY: the source holds rows * cols values (checked by `write_rows`); the destination
        // holds at least rows rows of width values from the layout's start; a copy from pageable
        // memory has read its source when the call returns.
        unsafe { sys::cuMemcpy2DAsync_v2(&p, stream.cu_stream()) }
            .result()
            .w()
    }
}

/// Bytes of device memory the driver holds for the allocations inside graphs on `dev`'s GPU.
pub fn graph_memory(device: &Device) -> Result<usize> {
    let Device::Cuda(dev) = device else {
        return Ok(0);
    };
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    ctx.bind_to_thread().w()?;
    let mut bytes: u64 = 0;
    // SAFETY: the attribute is a 64-bit count written into `bytes`; the device handle is the
    // context's own.
    unsafe {
        sys::cuDeviceGetGraphMemAttribute(
            ctx.cu_device(),
            sys::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT,
            (&mut bytes as *mut u64).cast(),
        )
    }
    .result()
    .w()?;
    Ok(bytes as usize)
}
