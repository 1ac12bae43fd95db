//! The CUDA side of the kernels: the fat binary built from `csrc/` (SASS for sm_90a plus PTX),
//! loaded once per GPU context, and helpers that borrow candle's CUDA storage as typed slices.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaModule, CudaSlice, CudaView};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage, WrapErr};
use candle_core::{DType, Layout, Result, Storage, WithDType};
use std::sync::{Arc, Mutex, OnceLock};

static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/rserve_kernels.fatbin"));

/// Suffix of a kernel's name for `dtype` (kernels are instantiated per element type).
pub(crate) fn dtype_suffix(dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        dt => candle_core::bail!("no CUDA kernel for dtype {dt:?}"),
    })
}

/// The kernel `name` on `dev`'s context, loading the module on first use.
pub(crate) fn function(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    static MODULES: OnceLock<Mutex<Vec<(usize, Arc<CudaModule>)>>> = OnceLock::new();
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    let ordinal = ctx.ordinal();
    let mut modules = MODULES
        .get_or_init(|| Mutex::new(Vec::new()))
        .lock()
        .map_err(|_| candle_core::Error::Msg("kernel module lock poisoned".into()))?;
    let module = match modules.iter().find(|(o, _)| *o == ordinal) {
        Some((_, m)) => m.clone(),
        None => {
            let m = ctx.load_module(Ptx::from_binary(FATBIN.to_vec())).w()?;
            modules.push((ordinal, m.clone()));
            m
        }
    };
    module.load_function(name).w()
}

/// Loads the kernel image on `dev` now (startup), so the first request does not pay for it.
pub fn preload(dev: &CudaDevice) -> Result<()> {
    function(dev, "reshape_and_cache_f32").map(|_| ())
}

/// A contiguous view of `s` as `T`, starting at the layout's offset.
pub(crate) fn view<'a, T: CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
    what: &str,
) -> Result<CudaView<'a, T>> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{what} must be contiguous")))?;
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

/// A `[tokens, heads, dim]` tensor whose rows may be strided (a view into a fused qkv tensor): the
/// view from its first element and the distance between tokens, in elements.
pub(crate) fn token_rows<'a, T: CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
    what: &str,
) -> Result<(CudaView<'a, T>, i64)> {
    let (dims, stride) = (l.dims(), l.stride());
    if dims.len() != 3 || stride[2] != 1 || stride[1] != dims[2] {
        candle_core::bail!(
            "{what}: each token's heads must be contiguous, got {dims:?} / {stride:?}"
        );
    }
    let start = l.start_offset();
    let end = if dims[0] == 0 {
        start
    } else {
        start + (dims[0] - 1) * stride[0] + dims[1] * dims[2]
    };
    Ok((s.as_cuda_slice::<T>()?.slice(start..end), stride[0] as i64))
}

/// The typed CUDA slice behind a storage guard (caches and metadata start at offset 0).
pub(crate) fn cuda_slice<'a, T: CudaDType + WithDType>(
    s: &'a Storage,
    what: &str,
) -> Result<&'a CudaSlice<T>> {
    match s {
        Storage::Cuda(s) => {
            if s.dtype() != T::DTYPE {
                candle_core::bail!("{what}: expected {:?}, got {:?}", T::DTYPE, s.dtype());
            }
            s.as_cuda_slice::<T>()
        }
        _ => candle_core::bail!("{what}: not a CUDA tensor"),
    }
}
