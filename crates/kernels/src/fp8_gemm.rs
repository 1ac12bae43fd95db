//! FP8 tensor-core products through cuBLASLt: `y = (sx ⊗ sw) ∘ (xq wq^T)` for E4M3 activations
//! `xq` `[m, k]` with per-token scales `sx` `[m]` and an E4M3 weight `wq` `[n, k]` with
//! per-channel scales `sw` `[n]`, accumulated in f32 and written in 16 bits.
//!
//! cuBLASLt on Hopper scales FP8 operands per tensor only (its outer-vector scales were refused
//! for sm_90 by cuBLAS 13.1), so the product runs with unit scales and `fp8_scale_outer_*`
//! (csrc/fp8.cu) applies the per-token and per-channel scales to its output: in place for bf16
//! (the unscaled sums, at most 448² k, are within bf16's range), from an f32 output for f16
//! (they are not within f16's). Descriptors, layouts and the chosen algorithm are made once per
//! shape and kept, so a step pays one `cublasLtMatmul` per product; the workspace is allocated
//! once, so the product is captured in CUDA graphs like any kernel.

use crate::cuda::{
    cuda_storage, dtype_suffix, function, launch_dependent, tensor_from_slice, view,
};
use candle_core::cuda_backend::cudarc::cublas::sys as cublas_sys;
use candle_core::cuda_backend::cudarc::cublaslt::{result as lt, sys};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::{DType, Result, Tensor, WithDType};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

/// The workspace cuBLASLt may use per product (NVIDIA's advice for Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

/// One shape's product, ready to run.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

struct State {
    ordinal: usize,
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    plans: HashMap<(usize, usize, usize, DType), Plan>,
}

// SAFETY: the handle and descriptors are used only under the mutex, by one thread at a time, as
// cuBLASLt allows for a handle.
unsafe impl Send for State {}

fn cuda_err(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("cuBLASLt {what}: {e:?}"))
}

fn state() -> &'static Mutex<Vec<State>> {
    static STATE: OnceLock<Mutex<Vec<State>>> = OnceLock::new();
    STATE.get_or_init(|| Mutex::new(Vec::new()))
}

fn set_attr<V>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    v: &V,
) -> Result<()> {
    // SAFETY: `desc` is live; the attribute's value is `V` as cuBLASLt documents it.
    unsafe {
        lt::set_matmul_desc_attribute(
            desc,
            attr,
            (v as *const V).cast::<c_void>(),
            std::mem::size_of::<V>(),
        )
    }
    .map_err(|e| cuda_err("descriptor attribute", e))
}

/// The product's own output type for a `out` result: bf16 itself, else f32.
fn product_type(out: DType) -> sys::cudaDataType {
    match out {
        DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        _ => sys::cudaDataType::CUDA_R_32F,
    }
}

fn plan(
    handle: sys::cublasLtHandle_t,
    (m, n, k): (usize, usize, usize),
    out: DType,
) -> Result<Plan> {
    use sys::cublasLtMatmulDescAttributes_t as A;
    let dt = product_type(out);
    let desc = lt::create_matmul_desc(
        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        sys::cudaDataType::CUDA_R_32F,
    )
    .map_err(|e| cuda_err("descriptor", e))?;
    set_attr(
        desc,
        A::CUBLASLT_MATMUL_DESC_TRANSA,
        &cublas_sys::cublasOperation_t::CUBLAS_OP_T,
    )?;
    set_attr(
        desc,
        A::CUBLASLT_MATMUL_DESC_TRANSB,
        &cublas_sys::cublasOperation_t::CUBLAS_OP_N,
    )?;
    set_attr(desc, A::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &1i8)?;
    // Column-major view: D^T [n, m] = op(A) [n, k] * B [k, m], A = the weight (k x n, ld k,
    // transposed), B = the activations (k x m, ld k), D = y (n x m, ld n).
    let layout = |t, rows: usize, cols: usize| {
        lt::create_matrix_layout(t, rows as u64, cols as u64, rows as i64)
            .map_err(|e| cuda_err("layout", e))
    };
    let e4m3 = sys::cudaDataType::CUDA_R_8F_E4M3;
    let a = layout(e4m3, k, n)?;
    let b = layout(e4m3, k, m)?;
    let d = layout(dt, n, m)?;
    let pref = lt::create_matmul_pref().map_err(|e| cuda_err("preference", e))?;
    let ws = WORKSPACE_BYTES as u64;
    // SAFETY: `pref` is live; the workspace limit is a u64.
    let heuristic = unsafe {
        lt::set_matmul_pref_attribute(
            pref,
            sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            (&raw const ws).cast::<c_void>(),
            std::mem::size_of::<u64>(),
        )
        .and_then(|()| lt::get_matmul_algo_heuristic(handle, desc, a, b, d, d, pref))
    };
    // SAFETY: created above and no longer used.
    let _ = unsafe { lt::destroy_matmul_pref(pref) };
    match heuristic {
        Ok(h) => Ok(Plan {
            desc,
            a,
            b,
            d,
            algo: h.algo,
        }),
        Err(e) => {
            // SAFETY: created above, not shared.
            unsafe {
                let _ = lt::destroy_matmul_desc(desc);
                let _ = lt::destroy_matrix_layout(a);
                let _ = lt::destroy_matrix_layout(b);
                let _ = lt::destroy_matrix_layout(d);
            }
            Err(cuda_err(
                &format!("no FP8 algorithm for m={m} n={n} k={k}"),
                e,
            ))
        }
    }
}

/// `[m, n]` in `out` (bf16 or f16): the FP8 product of `xq` `[m, k]` (scales `sx` `[m]`) and
/// `wq` `[n, k]` (scales `sw` `[n]`), all contiguous on `dev`; `k` and `n` multiples of 16.
pub fn scaled_mm(
    dev: &CudaDevice,
    xq: &Tensor,
    sx: &Tensor,
    wq: &Tensor,
    sw: &Tensor,
    out: DType,
) -> Result<Tensor> {
    match out {
        DType::BF16 => scaled_mm_as::<half::bf16>(dev, xq, sx, wq, sw),
        DType::F16 => scaled_mm_as::<half::f16>(dev, xq, sx, wq, sw),
        dt => candle_core::bail!("fp8 product: no {dt:?} output"),
    }
}

fn scaled_mm_as<T: CudaDType + WithDType + DeviceRepr>(
    dev: &CudaDevice,
    xq: &Tensor,
    sx: &Tensor,
    wq: &Tensor,
    sw: &Tensor,
) -> Result<Tensor> {
    let (m, k) = xq.dims2()?;
    let (n, wk) = wq.dims2()?;
    if k != wk || k % 16 != 0 || n % 16 != 0 {
        candle_core::bail!("fp8 product: x [{m}, {k}] against weight [{n}, {wk}]");
    }
    let stream = dev.cuda_stream();
    // SAFETY: every element is written by the scaling kernel.
    let mut y = unsafe { dev.alloc::<T>(m * n) }?;
    if m == 0 || n == 0 {
        return Ok(tensor_from_slice(y, dev, (m, n)));
    }
    // the unscaled f32 sums, for a result without bf16's range
    let mut sums = match T::DTYPE {
        DType::BF16 => None,
        // SAFETY: every element is written by the product.
        _ => Some(unsafe { dev.alloc::<f32>(m * n) }?),
    };
    let ordinal = stream.context().ordinal();
    let mut states = state()
        .lock()
        .map_err(|_| candle_core::Error::Msg("cuBLASLt state poisoned".into()))?;
    let i = match states.iter().position(|s| s.ordinal == ordinal) {
        Some(i) => i,
        None => {
            let handle = lt::create_handle().map_err(|e| cuda_err("handle", e))?;
            // SAFETY: scratch memory for cuBLASLt, never read by rserve.
            let workspace = unsafe { dev.alloc::<u8>(WORKSPACE_BYTES) }?;
            states.push(State {
                ordinal,
                handle,
                workspace,
                plans: HashMap::new(),
            });
            states.len() - 1
        }
    };
    let st = &mut states[i];
    let key = (m, n, k, T::DTYPE);
    if !st.plans.contains_key(&key) {
        let p = plan(st.handle, (m, n, k), T::DTYPE)?;
        st.plans.insert(key, p);
    }
    let Some(p) = st.plans.get(&key) else {
        candle_core::bail!("fp8 product: plan missing");
    };
    let (xg, xl) = xq.storage_and_layout();
    let (wg, wl) = wq.storage_and_layout();
    let (sxg, sxl) = sx.storage_and_layout();
    let (swg, swl) = sw.storage_and_layout();
    let xv = view::<u8>(cuda_storage(&xg, "activations")?, xl, "activations")?;
    let wv = view::<u8>(cuda_storage(&wg, "weight")?, wl, "weight")?;
    let sxv = view::<f32>(
        cuda_storage(&sxg, "activation scales")?,
        sxl,
        "activation scales",
    )?;
    let swv = view::<f32>(cuda_storage(&swg, "weight scales")?, swl, "weight scales")?;
    let (xp, _x) = xv.device_ptr(&stream);
    let (wp, _w) = wv.device_ptr(&stream);
    let (sxp, _sx) = sxv.device_ptr(&stream);
    let (swp, _sw) = swv.device_ptr(&stream);
    {
        let (dp, _d, _y) = match sums.as_mut() {
            Some(s) => {
                let (p, g) = s.device_ptr_mut(&stream);
                (p, Some(g), None)
            }
            None => {
                let (p, g) = y.device_ptr_mut(&stream);
                (p, None, Some(g))
            }
        };
        let (wsp, _ws) = st.workspace.device_ptr_mut(&stream);
        let (alpha, beta) = (1f32, 0f32);
        // SAFETY: the plan's layouts describe these buffers (weight [n, k] and activations
        // [m, k] E4M3, the sums [m, n] of the plan's output type, all contiguous, checked
        // above), the workspace is the size the plan was chosen for, and everything is on
        // `stream`.
        unsafe {
            lt::matmul(
                st.handle,
                p.desc,
                (&raw const alpha).cast(),
                (&raw const beta).cast(),
                wp as *const c_void,
                p.a,
                xp as *const c_void,
                p.b,
                dp as *const c_void,
                p.d,
                dp as *mut c_void,
                p.d,
                &raw const p.algo,
                wsp as *mut c_void,
                WORKSPACE_BYTES,
                stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| cuda_err("matmul", e))?;
    }
    scale_outer::<T>(dev, &mut y, sums.as_ref(), sxp, swp, (m, n))?;
    Ok(tensor_from_slice(y, dev, (m, n)))
}

/// `y = sums * sx[i] * sw[j]`, or in place on `y` without `sums` (`fp8_scale_outer_*`).
fn scale_outer<T: CudaDType + WithDType + DeviceRepr>(
    dev: &CudaDevice,
    y: &mut CudaSlice<T>,
    sums: Option<&CudaSlice<f32>>,
    sx: u64,
    sw: u64,
    (m, n): (usize, usize),
) -> Result<()> {
    let stream = dev.cuda_stream();
    let form = if sums.is_some() { "_f32" } else { "" };
    let name = format!("fp8_scale_outer{form}_{}", dtype_suffix(T::DTYPE)?);
    let func = function(dev, &name)?;
    let (mut yp, _y) = y.device_ptr_mut(&stream);
    let (mut dp, _d) = match sums {
        Some(s) => {
            let (p, g) = s.device_ptr(&stream);
            (p, Some(g))
        }
        None => (yp, None),
    };
    let (mut sxp, mut swp) = (sx, sw);
    let mut ni = n as i32;
    let mut params = [
        (&raw mut yp).cast::<c_void>(),
        (&raw mut dp).cast::<c_void>(),
        (&raw mut sxp).cast::<c_void>(),
        (&raw mut swp).cast::<c_void>(),
        (&raw mut ni).cast::<c_void>(),
    ];
    // a thread takes 8 columns (`kScaleCols` = 2,048 per CTA in csrc/fp8.cu)
    let grid = (m * n.div_ceil(8 * 256)) as u32;
    // SAFETY: `fp8_scale_outer[_f32]_<dtype>(y, d, sx, sw, n)` (csrc/fp8.cu): y [m, n] of T, d
    // the sums ([m, n] f32, or y itself), sx [m] and sw [n] f32, alive for the call (the caller
    // holds their guards); m * ceil(n / 2048) CTAs of 256 threads.
    unsafe { launch_dependent(&func, &stream, grid, 256, &mut params) }
}
