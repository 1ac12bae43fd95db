//! Element access for CPU kernels: one trait over the float dtypes the cache may hold, and helpers
//! that borrow a tensor's CPU storage as a typed, contiguous slice.
//!
//! Invariant: kernels only ever read contiguous tensors; a strided input is an error, not a copy.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Result, Storage, Tensor};
use half::{bf16, f16};

/// A float element the kernels can read and write, converting through `f32`.
pub trait Elem: Copy + Send + Sync + 'static {
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
    fn slice(s: &CpuStorage) -> Option<&[Self]>;
    fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]>;
    fn storage(v: Vec<Self>) -> CpuStorage;
}

macro_rules! impl_elem {
    ($t:ty, $variant:ident, $to:expr, $from:expr) => {
        impl Elem for $t {
            const DTYPE: DType = DType::$variant;
            #[inline(always)]
            fn to_f32(self) -> f32 {
                $to(self)
            }
            #[inline(always)]
            fn from_f32(v: f32) -> Self {
                $from(v)
            }
            fn slice(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(v.as_slice()),
                    _ => None,
                }
            }
            fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(v.as_mut_slice()),
                    _ => None,
                }
            }
            fn storage(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$variant(v)
            }
        }
    };
}

impl_elem!(f32, F32, |x: f32| x, |x: f32| x);
impl_elem!(bf16, BF16, bf16::to_f32, bf16::from_f32);
impl_elem!(f16, F16, f16::to_f32, f16::from_f32);

/// The contiguous range of a layout, or an error naming the op.
pub fn contiguous_range(layout: &Layout, what: &str) -> Result<(usize, usize)> {
    layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{what} must be contiguous")))
}

/// The typed contiguous slice of a CPU storage.
pub fn typed<'a, T: Elem>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [T]> {
    let (a, b) = contiguous_range(l, what)?;
    let v = T::slice(s).ok_or_else(|| {
        candle_core::Error::Msg(format!(
            "{what}: expected {:?}, got {:?}",
            T::DTYPE,
            s.dtype()
        ))
    })?;
    Ok(&v[a..b])
}

/// Runs `f` on the CPU storage of `t`, failing for other backends.
pub fn with_cpu<R>(
    t: &Tensor,
    what: &str,
    f: impl FnOnce(&CpuStorage, &Layout) -> Result<R>,
) -> Result<R> {
    let (guard, layout) = t.storage_and_layout();
    match &*guard {
        Storage::Cpu(s) => f(s, layout),
        _ => Err(candle_core::Error::Msg(format!("{what}: not a CPU tensor"))),
    }
}

/// Whether a `[tokens, heads, dim]` tensor has each token's heads contiguous (rows may be strided).
pub fn token_rows_contiguous(t: &Tensor) -> bool {
    let (dims, stride) = (t.dims(), t.stride());
    dims.len() == 3 && stride[2] == 1 && stride[1] == dims[2]
}

/// `t` itself where a GPU kernel can read it as strided token rows, else a contiguous copy (the CPU
/// kernels read contiguous tensors only).
pub fn for_kernel(t: &Tensor) -> Result<Tensor> {
    if !t.device().is_cpu() && token_rows_contiguous(t) {
        Ok(t.clone())
    } else {
        t.contiguous()
    }
}
