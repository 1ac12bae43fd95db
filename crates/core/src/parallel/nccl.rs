//! [`Collective`] over NCCL: one communicator per rank, on the rank's device and the stream its
//! kernels run on, so collectives order with them and are captured into CUDA graphs with them.
//!
//! `libnccl.so.2` is opened when the first group forms (`RSERVE_NCCL_LIB` names another file),
//! not linked: a server on one GPU never needs it.

use super::Collective;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorageSlice};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, InplaceOp1, Layout, Result, Shape, Tensor};
use half::{bf16, f16};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::OnceLock;

/// `ncclUniqueId`: what every rank of a group joins with.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    internal: [c_char; 128],
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UniqueId(..)")
    }
}

type Comm = *mut c_void;
type GetUniqueId = unsafe extern "C" fn(*mut UniqueId) -> c_int;
type CommInitRank = unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> c_int;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    Comm,
    *mut c_void,
) -> c_int;
type AllGather =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, *mut c_void) -> c_int;
/// `ncclBroadcast`: send buffer, receive buffer, count, datatype, root, comm, stream.
type Broadcast = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    Comm,
    *mut c_void,
) -> c_int;
type CommAbort = unsafe extern "C" fn(Comm) -> c_int;
type ErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

/// The entry points rserve calls.
struct Lib {
    get_unique_id: GetUniqueId,
    comm_init_rank: CommInitRank,
    all_reduce: AllReduce,
    all_gather: AllGather,
    broadcast: Broadcast,
    comm_abort: CommAbort,
    error_string: ErrorString,
}

// ncclDataType_t and ncclRedOp_t values (stable across NCCL 2.x)
const NCCL_UINT32: c_int = 3;
const NCCL_FLOAT16: c_int = 6;
const NCCL_FLOAT32: c_int = 7;
const NCCL_BFLOAT16: c_int = 9;
const NCCL_SUM: c_int = 0;

fn open() -> std::result::Result<Lib, String> {
    let names: Vec<String> = match std::env::var("RSERVE_NCCL_LIB") {
        Ok(p) => vec![p],
        Err(_) => vec!["libnccl.so.2".into(), "libnccl.so".into()],
    };
    let mut handle = std::ptr::null_mut();
    for n in &names {
        let c = CString::new(n.as_str()).map_err(|e| e.to_string())?;
        // SAFETY: a plain dlopen of a shared library by name
        handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if !handle.is_null() {
            break;
        }
    }
    if handle.is_null() {
        return Err(format!(
            "tensor parallelism needs NCCL: none of {} could be opened (pip install \
             nvidia-nccl-cu13 and put its lib directory on LD_LIBRARY_PATH, or set RSERVE_NCCL_LIB)",
            names.join(", ")
        ));
    }
    let sym = |name: &str| -> std::result::Result<*mut c_void, String> {
        let c = CString::new(name).map_err(|e| e.to_string())?;
        // SAFETY: looking a symbol up in the handle opened above
        let p = unsafe { libc::dlsym(handle, c.as_ptr()) };
        if p.is_null() {
            Err(format!("NCCL has no {name}"))
        } else {
            Ok(p)
        }
    };
    // SAFETY: each symbol has the C signature NCCL 2.x declares for it in nccl.h
    unsafe {
        Ok(Lib {
            get_unique_id: std::mem::transmute::<*mut c_void, GetUniqueId>(sym("ncclGetUniqueId")?),
            comm_init_rank: std::mem::transmute::<*mut c_void, CommInitRank>(sym(
                "ncclCommInitRank",
            )?),
            all_reduce: std::mem::transmute::<*mut c_void, AllReduce>(sym("ncclAllReduce")?),
            all_gather: std::mem::transmute::<*mut c_void, AllGather>(sym("ncclAllGather")?),
            broadcast: std::mem::transmute::<*mut c_void, Broadcast>(sym("ncclBroadcast")?),
            comm_abort: std::mem::transmute::<*mut c_void, CommAbort>(sym("ncclCommAbort")?),
            error_string: std::mem::transmute::<*mut c_void, ErrorString>(sym(
                "ncclGetErrorString",
            )?),
        })
    }
}

fn lib() -> Result<&'static Lib> {
    static LIB: OnceLock<std::result::Result<Lib, String>> = OnceLock::new();
    LIB.get_or_init(open)
        .as_ref()
        .map_err(|e| candle_core::Error::Msg(e.clone()))
}

/// An error of NCCL call `what` from its status code.
fn check(lib: &Lib, what: &str, status: c_int) -> Result<()> {
    if status == 0 {
        return Ok(());
    }
    // SAFETY: ncclGetErrorString returns a static string for any code
    let text = unsafe { CStr::from_ptr((lib.error_string)(status)) }.to_string_lossy();
    candle_core::bail!("NCCL {what}: {text} ({status})")
}

/// A new group's identity: rank 0 makes it and every rank joins with it.
pub fn unique_id() -> Result<UniqueId> {
    let lib = lib()?;
    let mut id = UniqueId { internal: [0; 128] };
    // SAFETY: NCCL writes the 128-byte id
    check(lib, "ncclGetUniqueId", unsafe {
        (lib.get_unique_id)(&mut id)
    })?;
    Ok(id)
}

/// One rank's communicator, on its device's stream.
#[derive(Debug)]
pub struct NcclComm {
    comm: Comm,
    world: usize,
    stream: std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
    /// Set once the communicator is aborted: no call reaches NCCL after that.
    aborted: std::sync::Mutex<bool>,
}

// SAFETY: a rank's communicator is used by one thread at a time (its loading thread, then its
// engine or worker thread, which takes over once loading is done), never concurrently; NCCL lets a
// communicator move between threads.
unsafe impl Send for NcclComm {}
// SAFETY: as above: calls on one communicator never overlap.
unsafe impl Sync for NcclComm {}

impl NcclComm {
    /// Joins group `id` as `rank` of `world` on `dev`'s stream; blocks until every rank has
    /// joined.
    pub fn join(dev: &CudaDevice, rank: usize, world: usize, id: UniqueId) -> Result<Self> {
        let lib = lib()?;
        let stream = dev.cuda_stream();
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| candle_core::Error::Msg(format!("{e:?}")))?;
        let mut comm: Comm = std::ptr::null_mut();
        let (n, r) = (world as c_int, rank as c_int);
        // SAFETY: NCCL writes the communicator; the id is passed by value as nccl.h declares
        check(lib, "ncclCommInitRank", unsafe {
            (lib.comm_init_rank)(&mut comm, n, id, r)
        })?;
        Ok(Self {
            comm,
            world,
            stream,
            aborted: std::sync::Mutex::new(false),
        })
    }

    /// Ends the communicator now, from any thread: collectives blocked in it (a peer that failed
    /// will never join them) return, and every later call is an error. Used when a rank fails
    /// and at shutdown, so no thread waits on a group that cannot complete.
    pub fn abort(&self) {
        let mut done = match self.aborted.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if *done {
            return;
        }
        *done = true;
        if let Ok(lib) = lib() {
            // SAFETY: the communicator was made by ncclCommInitRank; `aborted` keeps every later
            // call (and Drop) away from it
            unsafe { (lib.comm_abort)(self.comm) };
        }
    }

    fn is_aborted(&self) -> bool {
        self.aborted.lock().map_or(true, |g| *g)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // abort rather than destroy: destroying waits for every peer and for graphs that still
        // hold the communicator's work, which a shutdown may not provide
        self.abort();
    }
}

impl NcclComm {
    /// The library and the element range of a collective's tensor (laid out `l`), once the
    /// group is known not to be aborted.
    fn call_on(&self, l: &Layout) -> Result<(&'static Lib, (usize, usize))> {
        let lib = lib()?;
        if self.is_aborted() {
            candle_core::bail!("NCCL: the tensor-parallel group was aborted (a rank failed)");
        }
        let range = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("NCCL: the tensor must be contiguous".into()))?;
        Ok((lib, range))
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    AllReduce,
    AllGather,
}

struct Call<'a> {
    comm: &'a NcclComm,
    op: Op,
}

impl Call<'_> {
    fn run<T: CudaDType + candle_core::WithDType + DeviceRepr>(
        &self,
        s: &CudaStorage,
        l: &Layout,
        nccl_type: c_int,
    ) -> Result<(CudaStorage, Shape)> {
        let (lib, (a, b)) = self.comm.call_on(l)?;
        let src = s.as_cuda_slice::<T>()?.slice(a..b);
        let dev = s.device().clone();
        let count = b - a;
        let (n, shape) = match self.op {
            Op::AllReduce => (count, l.shape().clone()),
            Op::AllGather => {
                let mut dims = vec![self.comm.world];
                dims.extend_from_slice(l.dims());
                (count * self.comm.world, Shape::from(dims))
            }
        };
        // SAFETY: every element is written by the collective before any read
        let mut dst = unsafe { dev.alloc::<T>(n) }?;
        let stream = &self.comm.stream;
        let (sp, _s) = src.device_ptr(stream);
        let (dp, _d) = dst.device_ptr_mut(stream);
        let cu = stream.cu_stream() as *mut c_void;
        // SAFETY: both buffers live on this rank's device for the call; NCCL reads `count`
        // elements and writes `n`, as allocated above
        let status = unsafe {
            match self.op {
                Op::AllReduce => (lib.all_reduce)(
                    sp as *const c_void,
                    dp as *mut c_void,
                    count,
                    nccl_type,
                    NCCL_SUM,
                    self.comm.comm,
                    cu,
                ),
                Op::AllGather => (lib.all_gather)(
                    sp as *const c_void,
                    dp as *mut c_void,
                    count,
                    nccl_type,
                    self.comm.comm,
                    cu,
                ),
            }
        };
        drop((_s, _d));
        check(lib, "collective", status)?;
        Ok((CudaStorage::wrap_cuda_slice(dst, dev), shape))
    }
}

impl CustomOp1 for Call<'_> {
    fn name(&self) -> &'static str {
        match self.op {
            Op::AllReduce => "nccl-all-reduce",
            Op::AllGather => "nccl-all-gather",
        }
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("NCCL collectives take CUDA tensors")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        match &s.slice {
            CudaStorageSlice::BF16(_) => self.run::<bf16>(s, l, NCCL_BFLOAT16),
            CudaStorageSlice::F16(_) => self.run::<f16>(s, l, NCCL_FLOAT16),
            CudaStorageSlice::F32(_) => self.run::<f32>(s, l, NCCL_FLOAT32),
            _ => candle_core::bail!("NCCL: unsupported dtype {:?}", s.dtype()),
        }
    }
}

/// Rank 0's values written over every rank's, in place.
struct Broadcast0<'a> {
    comm: &'a NcclComm,
}

impl InplaceOp1 for Broadcast0<'_> {
    fn name(&self) -> &'static str {
        "nccl-broadcast"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        candle_core::bail!("NCCL collectives take CUDA tensors")
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> Result<()> {
        let (lib, (a, b)) = self.comm.call_on(l)?;
        let stream = &self.comm.stream;
        let (ptr, esize, nccl_type) = match &mut s.slice {
            CudaStorageSlice::U32(v) => (v.device_ptr_mut(stream).0, 4, NCCL_UINT32),
            CudaStorageSlice::F32(v) => (v.device_ptr_mut(stream).0, 4, NCCL_FLOAT32),
            _ => candle_core::bail!("NCCL broadcast: unsupported dtype {:?}", s.dtype()),
        };
        let p = (ptr + (a * esize) as u64) as *mut c_void;
        // SAFETY: `p` holds `b - a` elements of the type named, on this rank's device; NCCL
        // reads and writes them in place on the rank's stream
        let status = unsafe {
            (lib.broadcast)(
                p,
                p,
                b - a,
                nccl_type,
                0,
                self.comm.comm,
                stream.cu_stream() as *mut c_void,
            )
        };
        check(lib, "broadcast", status)
    }
}

impl Collective for NcclComm {
    fn broadcast_from_first(&self, x: &Tensor) -> Result<()> {
        if !x.is_contiguous() {
            candle_core::bail!("NCCL broadcast: the tensor must be contiguous");
        }
        x.inplace_op1(&Broadcast0 { comm: self })
    }

    fn all_reduce(&self, x: &Tensor) -> Result<Tensor> {
        x.contiguous()?.apply_op1_no_bwd(&Call {
            comm: self,
            op: Op::AllReduce,
        })
    }

    fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        x.contiguous()?.apply_op1_no_bwd(&Call {
            comm: self,
            op: Op::AllGather,
        })
    }
}
