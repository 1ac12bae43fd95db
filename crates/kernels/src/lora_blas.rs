//! The LoRA term of runs of rows that share an adapter (prompt chunks) through cuBLAS, the SGMV
//! form: tensor cores, `A` and `B` read once per run instead of once per row. Each run's
//! `u = x_run A_s^T` goes into a scratch, then for each part `y_run[:, part] += u_p B_{s,part}^T`
//! in place ([`runs`]), or the terms are written first and the product added onto them
//! ([`product_over_terms`]). Shapes as in [`crate::lora`].

use crate::cuda::{cuda_storage, view, KernelElem};
use crate::lora::LoraRun;
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

    /// `run`'s term into its rows of `y` (`[t, n]` at `y`): `u = x_run A_s^T` into the scratch,
    /// then for each part `y[run, part] = u_p B_{s, part}^T + beta y[run, part]`.
    ///
    /// # Safety
    /// As [`Gemm::tn`]: the run's rows of `x` and `y`, slot `run.slot` of `A` and `B` and
    /// `run.len` rows of the scratch lie inside their buffers, all on the handle's stream.
    unsafe fn run_terms(
        &self,
        run: &LoraRun,
        parts: &[usize],
        (r, k, n): (usize, usize, usize),
        ops: &Operands,
        y: u64,
        beta: f32,
    ) -> Result<()> {
        let (s, pr) = (run.slot as usize, parts.len() * r);
        // SAFETY: as the caller promises.
        unsafe {
            // u^T [pr, len] = A_s [pr, k] (row-major, so op T) x^T [k, len]
            self.tn(
                (pr, run.len, k),
                (self.at(ops.a, s * pr * k), k),
                (self.at(ops.x, run.start * k), k),
                (self.at(ops.u, 0), pr),
                0.,
            )?;
            let mut col = 0;
            for (p, &w) in parts.iter().enumerate() {
                // y^T[col .. col + w, run] = B_{s, col..} [w, r] (op T) u_p^T [r, len] + beta y^T
                self.tn(
                    (w, run.len, r),
                    (self.at(ops.b, (s * n + col) * r), r),
                    (self.at(ops.u, p * r), pr),
                    (self.at(y, run.start * n + col), n),
                    beta,
                )?;
                col += w;
            }
        }
        Ok(())
    }
}

/// The device addresses of `x`, `A`, `B` and the `u` scratch of a projection's runs.
struct Operands {
    x: u64,
    a: u64,
    b: u64,
    u: u64,
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
    let pr = parts.len() * r;
    let longest = runs.iter().map(|run| run.len).max().unwrap_or(0);
    let stream = dev.cuda_stream();
    // SAFETY: each run's rows of the scratch are written by its shrink before its expands read
    // them.
    let mut scratch = unsafe { dev.alloc::<T>(longest * pr) }?;
    let (xg, xl) = x.storage_and_layout();
    let (yg, yl) = y.storage_and_layout();
    let (ag, al) = a.storage_and_layout();
    let (bg, bl) = b.storage_and_layout();
    let xv = view::<T>(cuda_storage(&xg, "lora x")?, xl, "lora x")?;
    let yv = view::<T>(cuda_storage(&yg, "lora y")?, yl, "lora y")?;
    let av = view::<T>(cuda_storage(&ag, "lora A")?, al, "lora A")?;
    let bv = view::<T>(cuda_storage(&bg, "lora B")?, bl, "lora B")?;
    let (up, _u) = scratch.device_ptr_mut(&stream);
    let (xp, _x) = xv.device_ptr(&stream);
    let (yp, _y) = yv.device_ptr(&stream);
    let (ap, _a) = av.device_ptr(&stream);
    let (bp, _b) = bv.device_ptr(&stream);
    let g = Gemm::new::<T>(dev)?;
    let ops = Operands {
        x: xp,
        a: ap,
        b: bp,
        u: up,
    };
    for run in runs {
        // SAFETY: the pointers lie inside x, A, B, y and the scratch (runs and slots checked
        // against the shapes by the caller); every buffer is on the handle's stream; the C
        // blocks are the run's rows of y, which the caller handed over.
        unsafe { g.run_terms(run, parts, (r, k, n), &ops, yp, 1.) }?;
    }
    drop((_u, _x, _y, _a, _b));
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
    let pr = parts.len() * r;
    let longest = runs.iter().map(|run| run.len).max().unwrap_or(0);
    let stream = dev.cuda_stream();
    // SAFETY: every row of y is either zeroed below or inside a run, whose parts' GEMMs write
    // all of its n columns (beta = 0); the scratch rows are written by each run's shrink first.
    let mut y = unsafe { dev.alloc::<T>(t * n) }?;
    let mut scratch = unsafe { dev.alloc::<T>(longest * pr) }?;
    {
        let (xg, xl) = x.storage_and_layout();
        let (wg, wl) = w.storage_and_layout();
        let (ag, al) = a.storage_and_layout();
        let (bg, bl) = b.storage_and_layout();
        let xv = view::<T>(cuda_storage(&xg, "lora x")?, xl, "lora x")?;
        let wv = view::<T>(cuda_storage(&wg, "lora W")?, wl, "lora W")?;
        let av = view::<T>(cuda_storage(&ag, "lora A")?, al, "lora A")?;
        let bv = view::<T>(cuda_storage(&bg, "lora B")?, bl, "lora B")?;
        let (yp, _y) = y.device_ptr_mut(&stream);
        let (up, _u) = scratch.device_ptr_mut(&stream);
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
            u: up,
        };
        for run in runs {
            // SAFETY: as in `runs`; the C blocks are the run's rows of the new y (beta = 0).
            unsafe { g.run_terms(run, parts, (r, k, n), &ops, yp, 0.) }?;
        }
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
