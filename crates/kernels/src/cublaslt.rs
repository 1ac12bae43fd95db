//! cuBLASLt products shared by the FP8 products ([`crate::fp8_gemm`]) and the 16-bit products
//! with a bias epilogue ([`crate::bias::linear_bias`]): `y [m, n] = x [m, k] w^T` for a weight
//! `w` `[n, k]`, accumulated in f32. A handle and a workspace per device; per shape and form a
//! descriptor, the layouts and the algorithm cuBLASLt's heuristic chose, made once and kept, so a
//! step pays one `cublasLtMatmul` per product. The workspace is allocated once, so the products
//! are captured in CUDA graphs like any kernel.

use candle_core::cuda_backend::cudarc::cublas::sys as cublas_sys;
use candle_core::cuda_backend::cudarc::cublaslt::{result as lt, sys};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtrMut};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Result};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

/// The workspace cuBLASLt may use per product (NVIDIA's advice for Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

/// What a product multiplies and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Form {
    /// E4M3 operands, unit scales, fast accumulation; the sums in bf16 or f32.
    Fp8 { sums: DType },
    /// bf16 or f16 operands and output, the bias `[n]` (same dtype) added in f32 before the
    /// output's one rounding.
    Bias16 { dtype: DType },
}

impl Form {
    fn types(self) -> Result<(sys::cudaDataType, sys::cudaDataType)> {
        use sys::cudaDataType::{CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F, CUDA_R_8F_E4M3};
        let sixteen = |dt: DType| match dt {
            DType::BF16 => Ok(CUDA_R_16BF),
            DType::F16 => Ok(CUDA_R_16F),
            dt => Err(candle_core::Error::Msg(format!(
                "cuBLASLt product: no {dt:?} operands"
            ))),
        };
        match self {
            Self::Fp8 { sums: DType::BF16 } => Ok((CUDA_R_8F_E4M3, CUDA_R_16BF)),
            Self::Fp8 { .. } => Ok((CUDA_R_8F_E4M3, CUDA_R_32F)),
            Self::Bias16 { dtype } => Ok((sixteen(dtype)?, sixteen(dtype)?)),
        }
    }
}

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
    /// `None` where the heuristic found no algorithm (asked once).
    plans: HashMap<(usize, usize, usize, Form), Option<Plan>>,
}

// SAFETY: the handle and descriptors are used only under the mutex, by one thread at a time, as
// cuBLASLt allows for a handle.
unsafe impl Send for State {}

pub(crate) fn cuda_err(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
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

fn plan(
    handle: sys::cublasLtHandle_t,
    (m, n, k): (usize, usize, usize),
    form: Form,
) -> Result<Plan> {
    use sys::cublasLtMatmulDescAttributes_t as A;
    let (operands, out) = form.types()?;
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
    match form {
        Form::Fp8 { .. } => set_attr(desc, A::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &1i8)?,
        Form::Bias16 { .. } => set_attr(
            desc,
            A::CUBLASLT_MATMUL_DESC_EPILOGUE,
            &sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
        )?,
    }
    // Column-major view: D^T [n, m] = op(A) [n, k] * B [k, m], A = the weight (k x n, ld k,
    // transposed), B = the activations (k x m, ld k), D = y (n x m, ld n).
    let layout = |t, rows: usize, cols: usize| {
        lt::create_matrix_layout(t, rows as u64, cols as u64, rows as i64)
            .map_err(|e| cuda_err("layout", e))
    };
    let a = layout(operands, k, n)?;
    let b = layout(operands, k, m)?;
    let d = layout(out, n, m)?;
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
                &format!("no {form:?} algorithm for m={m} n={n} k={k}"),
                e,
            ))
        }
    }
}

/// Device pointers of one product's buffers.
pub(crate) struct Operands {
    /// The weight, `[n, k]` of the form's operand type.
    pub w: u64,
    /// The activations, `[m, k]`.
    pub x: u64,
    /// The output, `[m, n]` of the form's output type.
    pub y: u64,
    /// [`Form::Bias16`]'s bias, `[n]`.
    pub bias: u64,
}

/// This device's state (made on first use) and the plan of `key` in it, made once.
fn with_plan<R>(
    dev: &CudaDevice,
    key: (usize, usize, usize, Form),
    f: impl FnOnce(sys::cublasLtHandle_t, &mut CudaSlice<u8>, Option<&Plan>) -> Result<R>,
) -> Result<R> {
    let stream = dev.cuda_stream();
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
    if !st.plans.contains_key(&key) {
        let (m, n, k, form) = key;
        let started = std::time::Instant::now();
        let made = plan(st.handle, (m, n, k), form).ok();
        // each shape's first product asks cuBLASLt's heuristic (host time on the step's path)
        tracing::debug!(
            "cuBLASLt plan m={m} n={n} k={k} {form:?} in {} us",
            started.elapsed().as_micros()
        );
        st.plans.insert(key, made);
    }
    let plan = st.plans.get(&key).and_then(Option::as_ref);
    f(st.handle, &mut st.workspace, plan)
}

/// Runs the product `form` of shape `(m, n, k)` on `dev`'s stream: `false` (nothing run) where
/// cuBLASLt has no algorithm for it (asked once per shape and form).
///
/// # Safety
/// The pointers must be device buffers on `dev`, contiguous, of the sizes and types `form` and
/// the shape give, aligned to 256 bytes (cuBLASLt's default for the algorithms it picks), alive
/// until the stream has run the product (the caller holds their guards).
pub(crate) unsafe fn matmul(
    dev: &CudaDevice,
    (m, n, k): (usize, usize, usize),
    form: Form,
    p: &Operands,
) -> Result<bool> {
    let stream = dev.cuda_stream();
    with_plan(dev, (m, n, k, form), |handle, workspace, plan| {
        let Some(plan) = plan else {
            return Ok(false);
        };
        // SAFETY: the caller's contract, passed on.
        unsafe { run(handle, workspace, plan, form, p, &stream) }.map(|()| true)
    })
}

/// # Safety
/// As [`matmul`], with `plan` made for its shape and form.
unsafe fn run(
    handle: sys::cublasLtHandle_t,
    workspace: &mut CudaSlice<u8>,
    plan: &Plan,
    form: Form,
    p: &Operands,
    stream: &std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
) -> Result<()> {
    use sys::cublasLtMatmulDescAttributes_t as A;
    if let Form::Bias16 { .. } = form {
        // the pointer is this call's: set under the lock, right before the product
        set_attr(plan.desc, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias)?;
    }
    let (wsp, _ws) = workspace.device_ptr_mut(stream);
    let (alpha, beta) = (1f32, 0f32);
    // SAFETY: the plan's layouts describe the caller's buffers (its contract), the workspace is
    // the size the plan was chosen for, and everything is on `stream`.
    unsafe {
        lt::matmul(
            handle,
            plan.desc,
            (&raw const alpha).cast(),
            (&raw const beta).cast(),
            p.w as *const c_void,
            plan.a,
            p.x as *const c_void,
            plan.b,
            p.y as *const c_void,
            plan.d,
            p.y as *mut c_void,
            plan.d,
            &raw const plan.algo,
            wsp as *mut c_void,
            WORKSPACE_BYTES,
            stream.cu_stream() as sys::cudaStream_t,
        )
    }
    .map_err(|e| cuda_err("matmul", e))
}
