//! The CUDA side of the kernels: the fat binary built from `csrc/` (SASS for sm_90a plus PTX),
//! loaded once per GPU context, and helpers that borrow candle's CUDA storage as typed slices.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut,
    DeviceRepr, LaunchConfig, SyncOnDrop,
};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage, WrapErr};
use candle_core::{DType, Layout, Result, Storage, WithDType};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/rserve_kernels.fatbin"));

/// An element type a kernel launch takes: candle's CUDA dtype that cudarc can pass.
pub(crate) trait KernelElem: CudaDType + WithDType + DeviceRepr {}
impl<T: CudaDType + WithDType + DeviceRepr> KernelElem for T {}

/// `$f::<T>(args..)` with `T` the element type of the float dtype `$dt` (f32, bf16, f16); any
/// other dtype is an error naming `$op`.
macro_rules! by_float_dtype {
    ($op:literal, $dt:expr, $f:ident, $($arg:expr),*) => {
        match $dt {
            candle_core::DType::F32 => $f::<f32>($($arg),*),
            candle_core::DType::BF16 => $f::<half::bf16>($($arg),*),
            candle_core::DType::F16 => $f::<half::f16>($($arg),*),
            dt => candle_core::bail!("{}: unsupported dtype {dt:?}", $op),
        }
    };
}
pub(crate) use by_float_dtype;

/// Suffix of a kernel's name for `dtype` (kernels are instantiated per element type).
pub(crate) fn dtype_suffix(dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        dt => candle_core::bail!("no CUDA kernel for dtype {dt:?}"),
    })
}

/// The kernel image loaded on one GPU, and the functions looked up in it so far with the dynamic
/// shared memory each was opted into (a launch looks its kernel up by name; the driver lookup and
/// the opt-in are paid once per name).
struct Loaded {
    ordinal: usize,
    module: Arc<CudaModule>,
    functions: HashMap<String, (CudaFunction, usize)>,
}

/// Dynamic shared memory every kernel may use without opting in.
const DEFAULT_SHARED_BYTES: usize = 48 << 10;

/// The kernel `name` on `dev`'s context, loading the module on first use.
pub(crate) fn function(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    function_with_shared(dev, name, 0)
}

/// The kernel `name` on `dev`'s context, allowed `shared_bytes` of dynamic shared memory (the
/// driver's opt-in above 48 KiB is made the first time a size needs it).
pub(crate) fn function_with_shared(
    dev: &CudaDevice,
    name: &str,
    shared_bytes: usize,
) -> Result<CudaFunction> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
    static LOADED: OnceLock<Mutex<Vec<Loaded>>> = OnceLock::new();
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    let ordinal = ctx.ordinal();
    let mut loaded = LOADED
        .get_or_init(|| Mutex::new(Vec::new()))
        .lock()
        .map_err(|_| candle_core::Error::Msg("kernel module lock poisoned".into()))?;
    let i = match loaded.iter().position(|l| l.ordinal == ordinal) {
        Some(i) => i,
        None => {
            let module = ctx.load_module(Ptx::from_binary(FATBIN.to_vec())).w()?;
            loaded.push(Loaded {
                ordinal,
                module,
                functions: HashMap::new(),
            });
            loaded.len() - 1
        }
    };
    let l = &mut loaded[i];
    if !l.functions.contains_key(name) {
        let f = l.module.load_function(name).w()?;
        if let Some(percent) = shared_carveout() {
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                percent,
            )
            .w()?;
        }
        l.functions
            .insert(name.to_string(), (f, DEFAULT_SHARED_BYTES));
    }
    let Some((f, allowed)) = l.functions.get_mut(name) else {
        candle_core::bail!("kernel {name} missing after loading");
    };
    if shared_bytes > *allowed {
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            shared_bytes as i32,
        )
        .w()?;
        *allowed = shared_bytes;
    }
    Ok(f.clone())
}

/// The shared-memory carveout every kernel prefers, in percent of the unified L1 and shared
/// memory (`RSERVE_CUDA_CARVEOUT`: `max`, or 0-100), or the driver's choice per kernel (unset, the
/// default). An SM holds CTAs of one split at a time, so a programmatic dependent whose split
/// differs from the running kernel's (the decode attention needs most of an SM's shared memory,
/// the products little) cannot start beside it; one split for all kernels lets it.
pub(crate) fn shared_carveout() -> Option<i32> {
    static CARVEOUT: OnceLock<Option<i32>> = OnceLock::new();
    *CARVEOUT.get_or_init(|| {
        let v = std::env::var("RSERVE_CUDA_CARVEOUT").ok()?;
        let parsed = parse_carveout(&v);
        if parsed.is_none() {
            tracing::warn!("RSERVE_CUDA_CARVEOUT={v:?} is neither `max` nor 0-100; ignored");
        }
        parsed
    })
}

/// `max` (100) or a percentage of 0-100.
fn parse_carveout(v: &str) -> Option<i32> {
    match v.trim() {
        "max" => Some(100),
        p => p.parse::<i32>().ok().filter(|p| (0..=100).contains(p)),
    }
}

/// A grid-stride launch over `items` work items: 256 threads a block, blocks enough for one item
/// a thread up to a cap (the kernels loop past it).
pub(crate) fn strided_launch(items: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (items.div_ceil(256).clamp(1, 65535 * 8) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Work items of an element-wise kernel over `n` values in rows of `row_len` `T`s: one per
/// 16-byte vector when rows are whole vectors (the kernel's vector path), else one per value.
pub(crate) fn vector_items<T>(n: usize, row_len: usize) -> u64 {
    let per = 16 / std::mem::size_of::<T>().max(1);
    if row_len.is_multiple_of(per) {
        (n / per) as u64
    } else {
        n as u64
    }
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

/// The CUDA storage behind a tensor's storage guard (an error naming `what` for other tensors).
pub(crate) fn cuda_storage<'a>(s: &'a Storage, what: &str) -> Result<&'a CudaStorage> {
    match s {
        Storage::Cuda(c) => Ok(c),
        _ => candle_core::bail!("{what}: not a CUDA tensor"),
    }
}

/// [`view`] of the CUDA storage behind a tensor's storage guard: the operand as its layout
/// places it (a view into a larger tensor read from its own first element).
pub(crate) fn storage_view<'a, T: CudaDType>(
    s: &'a Storage,
    l: &Layout,
    what: &str,
) -> Result<CudaView<'a, T>> {
    view(cuda_storage(s, what)?, l, what)
}

/// A tensor of `shape` over a freshly written CUDA slice.
pub(crate) fn tensor_from_slice<T: CudaDType + WithDType>(
    slice: CudaSlice<T>,
    dev: &CudaDevice,
    shape: impl Into<candle_core::Shape>,
) -> candle_core::Tensor {
    let storage = Storage::Cuda(T::wrap_cuda_slice(slice, dev.clone()));
    candle_core::Tensor::from_storage(storage, shape, candle_core::op::BackpropOp::none(), false)
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

/// The typed CUDA slice behind a storage guard, for an operand a kernel reads from its
/// storage's first element (caches, per-step arrays, tables). One whose layout starts past that
/// (a view into a larger tensor) is an error rather than a read of the wrong values: such
/// operands go through [`view`].
pub(crate) fn cuda_slice<'a, T: CudaDType + WithDType>(
    s: &'a Storage,
    l: &Layout,
    what: &str,
) -> Result<&'a CudaSlice<T>> {
    if l.start_offset() != 0 {
        candle_core::bail!(
            "{what}: must start at its storage's start, not offset {}",
            l.start_offset()
        );
    }
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

/// `n` uninitialised elements of `T` on `dev`'s stream, for a kernel's output or scratch; while a
/// graph with detached allocations is being captured, an allocation of up to
/// [`crate::graph::DETACH_MAX_BYTES`] hangs on the graph's root ([`crate::graph`]).
///
/// # Safety
/// The memory is uninitialised: the caller writes every element before anything reads it.
pub(crate) unsafe fn alloc<T: DeviceRepr>(dev: &CudaDevice, n: usize) -> Result<CudaSlice<T>> {
    let bytes = n * std::mem::size_of::<T>();
    // SAFETY: the caller's contract
    crate::graph::detached(dev, bytes, || unsafe { dev.alloc::<T>(n) })
}

/// Whether weight-streaming kernels launch as programmatic dependents of the kernel before them
/// (on unless `RSERVE_CUDA_PDL=0`): they start streaming weights while that kernel finishes.
pub(crate) fn dependent_launch_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    switched_on(&ON, "RSERVE_CUDA_PDL")
}

/// Whether decode attention over 16-bit caches runs on tensor cores where it can (on unless
/// `RSERVE_CUDA_TC_DECODE=0`, which keeps the direct kernel everywhere, for comparisons).
pub(crate) fn tensor_core_decode_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    switched_on(&ON, "RSERVE_CUDA_TC_DECODE")
}

/// Whether the tensor-core decode attention of groups of up to 8 query heads per KV head takes
/// keys as the products' rows (`paged_decode_tk_*`: half the tensor-core instructions of the
/// heads-as-rows kernel); on unless `RSERVE_CUDA_TK_DECODE=0`, for comparisons.
pub(crate) fn keys_as_rows_decode_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    switched_on(&ON, "RSERVE_CUDA_TK_DECODE")
}

/// Whether the attention's kernels (rotary with the cache writes, the attention, the split merge)
/// launch as programmatic dependents like the rest of a step; on unless
/// `RSERVE_CUDA_PDL_ATTENTION=0`, which launches them plainly (each starts once the kernel before
/// it is done, so none is resident early beside a product streaming its weights), for
/// comparisons.
pub(crate) fn attention_dependents_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    switched_on(&ON, "RSERVE_CUDA_PDL_ATTENTION")
}

/// Whether the batch-1-sized decode attention of decode-only steps asks for its first key tiles
/// before it waits for rotary (`paged_decode_tk_early_*`: every key but the newest was written by
/// an earlier step); off unless `RSERVE_CUDA_EARLY_ATTENTION=1`, until measured in the engine with
/// detached graph allocations.
pub(crate) fn early_attention_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("RSERVE_CUDA_EARLY_ATTENTION").is_ok_and(|v| v.trim() == "1"))
}

/// A switch that is on unless the environment variable `var` is `0`, read once into `cell`.
fn switched_on(cell: &OnceLock<bool>, var: &str) -> bool {
    *cell.get_or_init(|| std::env::var(var).map_or(true, |v| v.trim() != "0"))
}

/// Launches `func` on `stream` as a programmatic dependent of the kernel before it in the stream
/// (or as a plain launch when that is switched off): the kernel may start before that one ends.
/// One-dimensional grid and block, no dynamic shared memory; [`Dependent`] takes any shape.
///
/// # Safety
/// `params` points at the kernel's arguments, in order and of the right types, alive for the
/// call; the kernel calls `pdl_wait()` (csrc/common.cuh) before it reads anything an earlier
/// kernel writes and before it writes anything, and in every block before the block ends (so a
/// kernel ends only after the kernels before it: the peer all-reduce's epochs rely on that).
pub(crate) unsafe fn launch_dependent(
    func: &CudaFunction,
    stream: &CudaStream,
    grid: u32,
    block: u32,
    params: &mut [*mut std::ffi::c_void],
) -> Result<()> {
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the caller's contract
    unsafe { launch_dependent_cfg(func, stream, cfg, true, params) }
}

/// [`launch_dependent`] with any grid, block and dynamic shared memory; a plain launch when
/// `dependent` is false.
///
/// # Safety
/// As [`launch_dependent`]; `cfg.shared_mem_bytes` within what `func` was allowed.
unsafe fn launch_dependent_cfg(
    func: &CudaFunction,
    stream: &CudaStream,
    cfg: LaunchConfig,
    dependent: bool,
    params: &mut [*mut std::ffi::c_void],
) -> Result<()> {
    // SAFETY: a zeroed launch attribute is valid plain data; the id and value are set below.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let cfg = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: u32::from(dependent && dependent_launch_enabled()),
    };
    if cfg.numAttrs > 0 {
        crate::graph::note_dependent(func.cu_function());
        crate::graph::lift_past_frees(stream.cu_stream())?;
    }
    // SAFETY: the caller's contract covers the function and its arguments; cfg and attr outlive
    // the call.
    unsafe {
        sys::cuLaunchKernelEx(
            &cfg,
            func.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
    .w()
}

/// The arguments of one kernel launched as a programmatic dependent ([`launch_dependent`]),
/// pushed in the kernel's order: plain values and device buffers (whose stream-order guards are
/// held until the launch is submitted).
pub(crate) struct Dependent<'a> {
    stream: &'a CudaStream,
    func: &'a CudaFunction,
    /// false: a plain launch
    dependent: bool,
    /// each argument's value, boxed so its address stays put until the launch
    values: Vec<Box<dyn std::any::Any>>,
    params: Vec<*mut std::ffi::c_void>,
    guards: Vec<SyncOnDrop<'a>>,
}

impl<'a> Dependent<'a> {
    pub fn new(stream: &'a CudaStream, func: &'a CudaFunction) -> Self {
        Self {
            stream,
            func,
            dependent: true,
            values: Vec::new(),
            params: Vec::new(),
            guards: Vec::new(),
        }
    }

    /// A value argument (an integer, a float, a device pointer).
    pub fn val<V: DeviceRepr + 'static>(&mut self, v: V) -> &mut Self {
        let mut b = Box::new(v);
        self.params.push((&raw mut *b).cast());
        self.values.push(b);
        self
    }

    /// A buffer the kernel reads.
    pub fn buf<T, S: DevicePtr<T>>(&mut self, s: &'a S) -> &mut Self {
        let (p, g) = s.device_ptr(self.stream);
        self.guards.push(g);
        self.val(p)
    }

    /// A buffer the kernel writes.
    pub fn buf_mut<T, S: DevicePtrMut<T>>(&mut self, s: &'a mut S) -> &mut Self {
        let (p, g) = s.device_ptr_mut(self.stream);
        self.guards.push(g);
        self.val(p)
    }

    /// A kernel of the attention (see [`attention_dependents_enabled`]).
    pub fn attention(&mut self) -> &mut Self {
        self.dependent = attention_dependents_enabled();
        self
    }

    /// Submits the launch.
    ///
    /// # Safety
    /// As [`launch_dependent`] for the arguments pushed; `cfg.shared_mem_bytes` within what the
    /// function was allowed.
    pub unsafe fn launch(mut self, cfg: LaunchConfig) -> Result<()> {
        // SAFETY: the caller's contract; the boxed values and the buffers outlive the call
        unsafe {
            launch_dependent_cfg(
                self.func,
                self.stream,
                cfg,
                self.dependent,
                &mut self.params,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn carveout_is_max_or_a_percentage() {
        use super::parse_carveout;
        assert_eq!(parse_carveout("max"), Some(100));
        assert_eq!(parse_carveout(" 50 "), Some(50));
        assert_eq!(parse_carveout("0"), Some(0));
        assert_eq!(parse_carveout("101"), None);
        assert_eq!(parse_carveout("-1"), None);
        assert_eq!(parse_carveout("most"), None);
    }
}
