//! Devices: picking one from `--device`, and on GPUs the memory facts the KV cache is sized from.
//!
//! On CUDA every tensor comes from the device's default stream-ordered memory pool. The pool is told
//! to keep what it has (no release at each synchronisation), which also lets the activation peak of
//! a profiling forward pass be read off the pool's high-water mark.

use crate::engine_error::EngineError;
use candle_core::Device;

/// Picks the device from a `--device` value: `cpu`, `cuda` / `cuda:N`, or `auto` (the first GPU
/// when this build has CUDA and a driver answers, else the CPU).
pub fn parse_device(name: &str) -> Result<Device, EngineError> {
    match name {
        "cpu" => Ok(Device::Cpu),
        "auto" => Ok(open_cuda(0).unwrap_or(Device::Cpu)),
        "cuda" | "gpu" => open_cuda(0),
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => open_cuda(n),
            _ => Err(EngineError::InvalidConfig(format!(
                "unknown device `{other}` (use auto, cpu, cuda or cuda:N)"
            ))),
        },
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize) -> Result<Device, EngineError> {
    let opened = std::panic::catch_unwind(|| Device::new_cuda(ordinal)).map_err(|_| {
        EngineError::InvalidConfig(format!("cannot open CUDA device {ordinal}: driver failure"))
    })?;
    let dev = opened.map_err(|e| {
        EngineError::InvalidConfig(format!("cannot open CUDA device {ordinal}: {e}"))
    })?;
    if let Device::Cuda(d) = &dev {
        // SAFETY: each thread that touches tensors uses its own per-thread stream, and the engine
        // synchronises the loading thread's stream before the engine thread takes over, so the
        // per-tensor cross-stream events are never needed.
        unsafe { d.disable_event_tracking() };
        rserve_kernels::cuda::preload(d).map_err(|e| EngineError::Model(e.to_string()))?;
        gpu::keep_pool_memory(d).map_err(EngineError::Model)?;
    }
    Ok(dev)
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_ordinal: usize) -> Result<Device, EngineError> {
    Err(EngineError::InvalidConfig(
        "this build has no CUDA support (build it with `make cuda`); use --device cpu".into(),
    ))
}

/// Memory of a GPU, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuMemory {
    pub free: usize,
    pub total: usize,
    /// Bytes the pool has handed out and not taken back.
    pub pool_used: usize,
}

#[cfg(feature = "cuda")]
pub mod gpu {
    //! Thin wrappers over the driver calls the engine needs (memory info, pool attributes).
    use super::GpuMemory;
    use candle_core::cuda_backend::cudarc::driver::sys;
    use candle_core::cuda_backend::CudaDevice;

    fn check(r: sys::CUresult, what: &str) -> Result<(), String> {
        if r == sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(format!("{what} failed: {r:?}"))
        }
    }

    fn pool(dev: &CudaDevice) -> Result<sys::CUmemoryPool, String> {
        let stream = dev.cuda_stream();
        let ctx = stream.context();
        ctx.bind_to_thread().map_err(|e| e.to_string())?;
        let mut pool = std::ptr::null_mut();
        // SAFETY: plain driver query on a live context's device.
        check(
            unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) },
            "cuDeviceGetDefaultMemPool",
        )?;
        Ok(pool)
    }

    fn pool_attr(dev: &CudaDevice, attr: sys::CUmemPool_attribute) -> Result<u64, String> {
        let p = pool(dev)?;
        let mut v: u64 = 0;
        // SAFETY: the attribute is a u64 per the driver API.
        check(
            unsafe { sys::cuMemPoolGetAttribute(p, attr, (&mut v as *mut u64).cast()) },
            "cuMemPoolGetAttribute",
        )?;
        Ok(v)
    }

    fn set_pool_attr(
        dev: &CudaDevice,
        attr: sys::CUmemPool_attribute,
        mut v: u64,
    ) -> Result<(), String> {
        let p = pool(dev)?;
        // SAFETY: the attribute is a u64 per the driver API.
        check(
            unsafe { sys::cuMemPoolSetAttribute(p, attr, (&mut v as *mut u64).cast()) },
            "cuMemPoolSetAttribute",
        )
    }

    /// The pool keeps freed memory for reuse instead of returning it at every synchronisation.
    pub fn keep_pool_memory(dev: &CudaDevice) -> Result<(), String> {
        set_pool_attr(
            dev,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            u64::MAX,
        )
    }

    /// Free and total device memory and what the pool has handed out.
    pub fn memory(dev: &CudaDevice) -> Result<GpuMemory, String> {
        let stream = dev.cuda_stream();
        stream.synchronize().map_err(|e| e.to_string())?;
        let (free, total) = stream.context().mem_get_info().map_err(|e| e.to_string())?;
        let used = pool_attr(
            dev,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
        )?;
        Ok(GpuMemory {
            free,
            total,
            pool_used: used as usize,
        })
    }

    /// Starts or stops the profiler's collection (`ncu --profile-from-start off` then sees only
    /// the work issued in between).
    pub fn profiler(dev: &CudaDevice, on: bool) -> Result<(), String> {
        let stream = dev.cuda_stream();
        stream.synchronize().map_err(|e| e.to_string())?;
        // SAFETY: plain driver calls on the current context.
        let r = unsafe {
            if on {
                sys::cuProfilerStart()
            } else {
                sys::cuProfilerStop()
            }
        };
        check(r, "cuProfilerStart/Stop")
    }

    /// Starts a new high-water mark of pool use.
    pub fn reset_peak(dev: &CudaDevice) -> Result<(), String> {
        set_pool_attr(
            dev,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            0,
        )
    }

    /// The most the pool has handed out at once since [`reset_peak`].
    pub fn peak(dev: &CudaDevice) -> Result<usize, String> {
        dev.cuda_stream().synchronize().map_err(|e| e.to_string())?;
        pool_attr(dev, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH).map(|v| v as usize)
    }
}
