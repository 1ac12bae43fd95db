//! The LoRA term of runs of rows that share an adapter (prompt chunks) through cuBLAS, the SGMV
//! form: tensor cores, `A` and `B` read once per run instead of once per row. Each run's
//! `u = x_run A_s^T` goes into a scratch, then for each part `y_run[:, part] += u_p B_{s,part}^T`
//! in place ([`runs`]), or the terms are written first and the product added onto them
//! ([`product_over_terms`]). Shapes as in [`crate::lora`].

use crate::cuda::{storage_view, KernelElem};
use crate::lora::{prompt_terms, LoraRun, PromptTerms};
use candle_core::cuda_backend::cudarc::cublas::{result as blas, sys as blas_sys};
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Result, Tensor};
use std::ffi::c_void;

use blas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};

fn blas_err(e: blas::CublasError) -> candle_core::Error {
    candle_core::Error::Msg(format!("lora: cuBLAS: {e:?}"))
}

fn int(v: usize) -> Result<i32> {
    i32::try_from(v)
        .map_err(|_| candle_core::Error::Msg(format!("lora: {v} overflows a cuBLAS size")))
}

/// One cuBLAS handle and element type for a projection's GEMMs (column-major views of
/// row-major buffers, f32 accumulation).
struct Gemm {
    dev: CudaDevice,
    handle: blas_sys::cublasHandle_t,
    ty: blas_sys::cudaDataType,
    size: u64,
}

impl Gemm {
    fn new<T: KernelElem>(dev: &CudaDevice) -> Result<Self> {
        use blas_sys::cudaDataType::{CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F};
        let ty = match T::DTYPE {
            DType::BF16 => CUDA_R_16BF,
            DType::F16 => CUDA_R_16F,
            DType::F32 => CUDA_R_32F,
            dt => candle_core::bail!("lora: unsupported dtype {dt:?}"),
        };
        Ok(Self {
            dev: dev.clone(),
            handle: *dev.cublas_handle().handle(),
            ty,
            size: std::mem::size_of::<T>() as u64,
        })
    }

    /// The address of element `elems` of the buffer at `ptr`.
    fn at(&self, ptr: u64, elems: usize) -> *mut c_void {
        (ptr + elems as u64 * self.size) as *mut c_void
    }

    /// `C [m, n] = alpha op(A) B + beta C`, column-major: `op(A)` = A^T of a `[k, m]` (lda)
    /// block, B a `[k, n]` (ldb) block.
    ///
    /// # Safety
    /// The pointers are device buffers on the handle's stream holding the blocks the sizes and
    /// leading dimensions describe.
    #[allow(clippy::too_many_arguments)]
    unsafe fn tn(
        &self,
        (m, n, k): (usize, usize, usize),
        a: (*mut c_void, usize),
        b: (*mut c_void, usize),
        c: (*mut c_void, usize),
        beta: f32,
    ) -> Result<()> {
        let one = 1f32;
        // SAFETY: as the caller promises.
        unsafe {
            blas::gemm_ex(
                self.handle,
                CUBLAS_OP_T,
                CUBLAS_OP_N,
                int(m)?,
                int(n)?,
                int(k)?,
                (&raw const one).cast(),
                a.0,
                self.ty,
                int(a.1)?,
                b.0,
                self.ty,
                int(b.1)?,
                (&raw const beta).cast(),
                c.0,
                self.ty,
                int(c.1)?,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_err)
    }

    /// `run`'s shrink, `u = x_run A_s^T` into the `[len, pr]` rows at `u`, and its expands, for
    /// each part `y[run, part] = u_p B_{s, part}^T + beta y[run, part]` (`y` `[t, n]` at `ops.y`).
    fn run_problems(
        &self,
        run: &LoraRun,
        parts: &[usize],
        (r, k, n): (usize, usize, usize),
        ops: &Operands,
        u: u64,
        beta: f32,
    ) -> (Problem, Vec<Problem>) {
        let (s, pr) = (run.slot as usize, parts.len() * r);
        // u^T [pr, len] = A_s [pr, k] (row-major, so op T) x^T [k, len]
        let shrink = Problem {
            mnk: (pr, run.len, k),
            a: (self.at(ops.a, s * pr * k), k),
            b: (self.at(ops.x, run.start * k), k),
            c: (self.at(u, 0), pr),
            beta: 0.,
        };
        let mut col = 0;
        let expands = parts
            .iter()
            .enumerate()
            .map(|(p, &w)| {
                // y^T[col .. col + w, run] = B_{s, col..} [w, r] (op T) u_p^T [r, len] + beta y^T
                let e = Problem {
                    mnk: (w, run.len, r),
                    a: (self.at(ops.b, (s * n + col) * r), r),
                    b: (self.at(u, p * r), pr),
                    c: (self.at(ops.y, run.start * n + col), n),
                    beta,
                };
                col += w;
                e
            })
            .collect();
        (shrink, expands)
    }

    /// `run`'s terms (shrink, then each part's expand) one GEMM after another.
    ///
    /// # Safety
    /// As [`Gemm::tn`]: the run's rows of `x` and `y`, slot `run.slot` of `A` and `B` and
    /// `run.len` rows of the scratch lie inside their buffers, all on the handle's stream.
    unsafe fn run_terms(
        &self,
        run: &LoraRun,
        parts: &[usize],
        dims: (usize, usize, usize),
        ops: &Operands,
        u: u64,
        beta: f32,
    ) -> Result<()> {
        let (shrink, expands) = self.run_problems(run, parts, dims, ops, u, beta);
        for p in std::iter::once(&shrink).chain(&expands) {
            // SAFETY: as the caller promises.
            unsafe { self.tn(p.mnk, p.a, p.b, p.c, p.beta) }?;
        }
        Ok(())
    }
}

/// One product, `C [m, n] = op(A) B + beta C` as [`Gemm::tn`] takes it, alone or grouped.
struct Problem {
    mnk: (usize, usize, usize),
    a: (*mut c_void, usize),
    b: (*mut c_void, usize),
    c: (*mut c_void, usize),
    beta: f32,
}

impl Gemm {
    /// Every problem in one `cublasGemmGroupedBatchedEx` call, each a group of its own; the
    /// matrices' addresses travel to the device in one copy on the stream.
    ///
    /// # Safety
    /// As [`Gemm::tn`] for every problem.
    unsafe fn grouped(&self, problems: &[Problem]) -> Result<()> {
        use candle_core::cuda_backend::WrapErr;
        let count = problems.len();
        // sizes and leading dimensions: m, n, k, lda, ldb, ldc, one entry per problem each
        let mut dims: [Vec<i32>; 6] = Default::default();
        for p in problems {
            for (d, v) in dims
                .iter_mut()
                .zip([p.mnk.0, p.mnk.1, p.mnk.2, p.a.1, p.b.1, p.c.1])
            {
                d.push(int(v)?);
            }
        }
        let alpha = vec![1f32; count];
        let beta: Vec<f32> = problems.iter().map(|p| p.beta).collect();
        let (ta, tb) = (vec![CUBLAS_OP_T; count], vec![CUBLAS_OP_N; count]);
        let sizes = vec![1i32; count];
        // the address arrays of A, B and C one after another
        let ptrs: Vec<u64> = (0..3)
            .flat_map(|i| {
                problems
                    .iter()
                    .map(move |p| [p.a.0, p.b.0, p.c.0][i] as u64)
            })
            .collect();
        let stream = self.dev.cuda_stream();
        let table = stream.clone_htod(&ptrs).w()?;
        let (base, _t) = table.device_ptr(&stream);
        let at = |i: usize| (base + (i * count * 8) as u64) as *const *const c_void;
        // SAFETY: every host array holds `count` entries, the table the three address arrays on
        // the handle's stream (freed in stream order after the call); the problems as the
        // caller promises.
        unsafe {
            blas_sys::cublasGemmGroupedBatchedEx(
                self.handle,
                ta.as_ptr(),
                tb.as_ptr(),
                dims[0].as_ptr(),
                dims[1].as_ptr(),
                dims[2].as_ptr(),
                alpha.as_ptr().cast(),
                at(0),
                self.ty,
                dims[3].as_ptr(),
                at(1),
                self.ty,
                dims[4].as_ptr(),
                beta.as_ptr().cast(),
                at(2) as *const *mut c_void,
                self.ty,
                dims[5].as_ptr(),
                int(count)?,
                sizes.as_ptr(),
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            )
        }
        .result()
        .map_err(blas_err)
    }

    /// Every run's terms in two grouped calls (`u` at each run's rows of a `[t, pr]` scratch):
    /// all shrinks, then every run's expand of every part.
    ///
    /// # Safety
    /// As [`Gemm::run_terms`] for every run, the scratch holding `t` rows of `pr`.
    unsafe fn grouped_terms(
        &self,
        runs: &[LoraRun],
        parts: &[usize],
        (r, k, n): (usize, usize, usize),
        ops: &Operands,
        u: u64,
        beta: f32,
    ) -> Result<()> {
        let pr = parts.len() * r;
        let (shrinks, expands): (Vec<Problem>, Vec<Vec<Problem>>) = runs
            .iter()
            .map(|run| {
                let u_run = u + (run.start * pr) as u64 * self.size;
                self.run_problems(run, parts, (r, k, n), ops, u_run, beta)
            })
            .unzip();
        let expands: Vec<Problem> = expands.into_iter().flatten().collect();
        // SAFETY: as the caller promises; the shrinks write each run's own rows of u before
        // the expands (the next call on the stream) read them.
        unsafe {
            self.grouped(&shrinks)?;
            self.grouped(&expands)
        }
    }
}

/// The device addresses of `x`, `A`, `B` and `y` of a projection's runs.
struct Operands {
    x: u64,
    a: u64,
    b: u64,
    y: u64,
}

/// Each run's term through cuBLAS, added into `y` `[t, n]` in place: `u = x_run A_s^T` into a
/// scratch `[len, pr]`, then the parts' terms.
pub(crate) fn runs<T: KernelElem>(
    dev: &CudaDevice,
    y: &Tensor,
    x: &Tensor,
    (a, b): (&Tensor, &Tensor),
    parts: &[usize],
    runs: &[LoraRun],
    (r, k, n): (usize, usize, usize),
) -> Result<()> {
    let t = x.dim(0)?;
    let stream = dev.cuda_stream();
    let (xg, xl) = x.storage_and_layout();
    let (yg, yl) = y.storage_and_layout();
    let (ag, al) = a.storage_and_layout();
    let (bg, bl) = b.storage_and_layout();
    let xv = storage_view::<T>(&xg, xl, "lora x")?;
    let yv = storage_view::<T>(&yg, yl, "lora y")?;
    let av = storage_view::<T>(&ag, al, "lora A")?;
    let bv = storage_view::<T>(&bg, bl, "lora B")?;
    let (xp, _x) = xv.device_ptr(&stream);
    let (yp, _y) = yv.device_ptr(&stream);
    let (ap, _a) = av.device_ptr(&stream);
    let (bp, _b) = bv.device_ptr(&stream);
    let ops = Operands {
        x: xp,
        a: ap,
        b: bp,
        y: yp,
    };
    // SAFETY: the pointers lie inside x, A, B and y (runs and slots checked against the shapes
    // by the caller); every buffer is on the handle's stream; the C blocks are the runs' rows
    // of y, which the caller handed over.
    unsafe { terms::<T>(dev, &ops, parts, runs, (r, k, n, t), true) }?;
    drop((_x, _y, _a, _b));
    Ok(())
}

/// Runs a step takes one by one under [`PromptTerms::Auto`]; more go through the grouped calls.
/// On an H200 (8,192 rows, the 8B shapes, 32 layers) the terms cost a step the same in either
/// form at 8 runs; at 64 runs of 128 rows 31 ms grouped against 174 ms one by one; at one run
/// the single products take 10 ms less (`examples/lora_gpu_bench.rs`).
const RUNS_ONE_BY_ONE: usize = 8;

/// Each run's terms into its rows of `y` (`ops.y`, `[t, n]`), added (`add`) or written: a
/// cuBLAS shrink into a scratch and an expand per part, for each run in turn or for all runs in
/// two grouped calls ([`PromptTerms`]).
///
/// # Safety
/// As [`Gemm::tn`] for every run: the operands hold the shapes `(r, k, n, t)` describe, on the
/// device's stream, and the runs lie inside them.
unsafe fn terms<T: KernelElem>(
    dev: &CudaDevice,
    ops: &Operands,
    parts: &[usize],
    runs: &[LoraRun],
    (r, k, n, t): (usize, usize, usize, usize),
    add: bool,
) -> Result<()> {
    let pr = parts.len() * r;
    let grouped = match prompt_terms() {
        PromptTerms::Auto => runs.len() > RUNS_ONE_BY_ONE,
        PromptTerms::Grouped => runs.len() > 1,
        PromptTerms::Runs => false,
    };
    let rows = if grouped {
        t
    } else {
        runs.iter().map(|run| run.len).max().unwrap_or(0)
    };
    let stream = dev.cuda_stream();
    // SAFETY: each run's rows of the scratch are written by its shrink before its expands read
    // them.
    let mut scratch = unsafe { crate::cuda::alloc::<T>(dev, rows * pr) }?;
    let (up, _u) = scratch.device_ptr_mut(&stream);
    let g = Gemm::new::<T>(dev)?;
    let beta = if add { 1. } else { 0. };
    if grouped {
        // SAFETY: as the caller promises; the scratch holds t rows of pr.
        return unsafe { g.grouped_terms(runs, parts, (r, k, n), ops, up, beta) };
    }
    for run in runs {
        // SAFETY: as the caller promises; the scratch holds the longest run's u.
        unsafe { g.run_terms(run, parts, (r, k, n), ops, up, beta) }?;
    }
    Ok(())
}

/// `x W^T` plus each run's term for a prompt-sized batch, the terms first: each run's parts'
/// terms written into its rows of a new `y` `[t, n]` (beta = 0; rows outside the runs zeroed),
/// then the product added onto them in its epilogue (beta = 1). The product, bound by its
/// arithmetic, reads `y` as it writes it, where adding the terms after it would read and write
/// all of `y` once more. Rows outside the runs get `x W^T` alone.
pub(crate) fn product_over_terms<T: KernelElem>(
    dev: &CudaDevice,
    x: &Tensor,
    w: &Tensor,
    (a, b): (&Tensor, &Tensor),
    parts: &[usize],
    runs: &[LoraRun],
    (r, k, n): (usize, usize, usize),
) -> Result<Tensor> {
    let t = x.dim(0)?;
    let stream = dev.cuda_stream();
    // SAFETY: every row of y is either zeroed below or inside a run, whose terms write all of
    // its n columns (not added).
    let mut y = unsafe { crate::cuda::alloc::<T>(dev, t * n) }?;
    {
        let (xg, xl) = x.storage_and_layout();
        let (wg, wl) = w.storage_and_layout();
        let (ag, al) = a.storage_and_layout();
        let (bg, bl) = b.storage_and_layout();
        let xv = storage_view::<T>(&xg, xl, "lora x")?;
        let wv = storage_view::<T>(&wg, wl, "lora W")?;
        let av = storage_view::<T>(&ag, al, "lora A")?;
        let bv = storage_view::<T>(&bg, bl, "lora B")?;
        let (yp, _y) = y.device_ptr_mut(&stream);
        let (xp, _x) = xv.device_ptr(&stream);
        let (wp, _w) = wv.device_ptr(&stream);
        let (ap, _a) = av.device_ptr(&stream);
        let (bp, _b) = bv.device_ptr(&stream);
        let g = Gemm::new::<T>(dev)?;
        let mut row = 0;
        let gaps = runs
            .iter()
            .map(|run| (run.start, run.start + run.len))
            .chain([(t, t)]);
        for (start, end) in gaps {
            if start > row {
                let bytes = (start - row) * n * g.size as usize;
                // SAFETY: rows row..start of y, inside it (runs checked against t by the caller).
                unsafe {
                    candle_core::cuda_backend::cudarc::driver::result::memset_d8_async(
                        yp + (row * n) as u64 * g.size,
                        0,
                        bytes,
                        stream.cu_stream(),
                    )
                }
                .map_err(|e| candle_core::Error::Msg(format!("lora: memset: {e:?}")))?;
            }
            row = end;
        }
        let ops = Operands {
            x: xp,
            a: ap,
            b: bp,
            y: yp,
        };
        // SAFETY: as in `runs`; the runs' rows of the new y are written, not added to.
        unsafe { terms::<T>(dev, &ops, parts, runs, (r, k, n, t), false) }?;
        // SAFETY: y^T [n, t] += W [n, k] (op T) x^T [k, t]: W and x contiguous (views), y the
        // new [t, n]; one stream.
        unsafe {
            g.tn(
                (n, t, k),
                (g.at(wp, 0), k),
                (g.at(xp, 0), k),
                (g.at(yp, 0), n),
                1.,
            )
        }?;
    }
    Ok(crate::cuda::tensor_from_slice(y, dev, (t, n)))
}
