//! CUDA graphs: a sequence of launches recorded once and replayed with one driver call, and the
//! in-place host writes that refresh a graph's input tensors before each replay.
//!
//! A captured graph holds the device addresses of every tensor it touches, so its inputs must be
//! tensors that outlive it and are rewritten in place ([`write_rows`]); everything the recorded
//! work allocates is allocated and freed inside the graph. Capture runs the work twice: once
//! eagerly, which loads kernels and fills candle's cache of small uploads, then recorded. What the
//! capture made (kernels, memory nodes, dependents that overlap the kernel before them) is counted
//! into [`Graph::shape`] (see `graph_shape`).
//!
//! Capture turns every allocation and free between two launches into a memory node between them,
//! and a programmatic dependent behind one waits for the kernel before it to end. A capture with
//! detached allocations ([`CaptureOptions`]) places those nodes itself: the kernels' allocations
//! ([`detached`], through `cuda::alloc`) hang on an empty root node, and each dependent hangs on
//! what the frees captured since the kernel before it hang on ([`graph_shape::past_frees`]), so it
//! overlaps that kernel (only the frees of detached allocations are lifted so). No detached
//! allocation reuses the memory of another, so it is for graphs of few rows; larger allocations
//! stay in the chain, behind the frees before them.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{sys, CudaGraph, DevicePtrMut};
use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle_core::{CpuStorage, CudaStorage, Device, InplaceOp1, Layout, Result, Tensor, WithDType};

use crate::graph_shape::{self, Edge, GraphShape, Kind};

thread_local! {
    /// The functions launched as programmatic dependents while this thread captures a graph.
    static DEPENDENTS: RefCell<Option<HashSet<usize>>> = const { RefCell::new(None) };
    /// While this thread captures a graph with detached allocations: what they hang on and
    /// which they are.
    static DETACHED: RefCell<Option<Detached>> = const { RefCell::new(None) };
}

/// The detached allocations of the graph this thread captures.
#[derive(Default)]
struct Detached {
    /// The empty root node they hang on, once made.
    root: Option<usize>,
    /// Their device addresses: only their frees are lifted ([`lifted`]), so an allocation left in
    /// the chain stays behind the frees before it and may reuse their memory.
    ptrs: HashSet<u64>,
}

/// Clears this thread's capture state when dropped, however the capture ends (a panic included).
struct CaptureState;

impl CaptureState {
    fn begin(detach: bool) -> Self {
        DEPENDENTS.with(|d| *d.borrow_mut() = Some(HashSet::new()));
        DETACHED.with(|d| *d.borrow_mut() = detach.then(Detached::default));
        Self
    }
}

impl Drop for CaptureState {
    fn drop(&mut self) {
        DEPENDENTS.with(|d| *d.borrow_mut() = None);
        DETACHED.with(|d| *d.borrow_mut() = None);
    }
}

/// How [`Graph::capture_with`] records.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CaptureOptions {
    /// Hang the kernels' allocations on the graph's root and each programmatic dependent on the
    /// kernel before it rather than on the frees since (see the module's notes). Each allocation
    /// then has memory of its own for the graph's life.
    pub detach_allocations: bool,
}

/// Whether decode graphs of few rows are captured with detached allocations: off unless
/// `RSERVE_CUDA_GRAPH_DETACH=1`.
pub fn detach_allocations_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("RSERVE_CUDA_GRAPH_DETACH").is_ok_and(|v| v.trim() == "1"))
}

/// Whether this thread is capturing a graph with detached allocations.
fn detaching() -> bool {
    DETACHED.with(|d| d.borrow().is_some())
}

/// The root node of the graph being captured on this thread with detached allocations, or `None`
/// when none is.
fn detached_root(graph: sys::CUgraph) -> Result<Option<sys::CUgraphNode>> {
    DETACHED.with(|d| {
        let mut d = d.borrow_mut();
        let Some(Detached { root, .. }) = d.as_mut() else {
            return Ok(None);
        };
        if let Some(node) = *root {
            return Ok(Some(node as sys::CUgraphNode));
        }
        let mut node: sys::CUgraphNode = std::ptr::null_mut();
        // SAFETY: adds an empty node without dependencies to the graph being captured (nodes may
        // be added to it while the capture runs); writes its handle into `node`.
        unsafe { sys::cuGraphAddEmptyNode(&mut node, graph, std::ptr::null(), 0) }
            .result()
            .w()?;
        *root = Some(node as usize);
        Ok(Some(node))
    })
}

/// A capturing stream's dependency set: the nodes the next captured node will hang on, each with
/// its edge data, and the graph being captured.
type CaptureDeps = (sys::CUgraph, Vec<(sys::CUgraphNode, sys::CUgraphEdgeData)>);

/// `stream`'s [`CaptureDeps`]; `None` when it is not capturing.
fn capture_deps(stream: sys::CUstream) -> Result<Option<CaptureDeps>> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    let mut nodes: *const sys::CUgraphNode = std::ptr::null();
    let mut data: *const sys::CUgraphEdgeData = std::ptr::null();
    let mut n = 0usize;
    // SAFETY: queries the stream's capture; the arrays it points at stay valid until the next
    // call on the stream and are copied below.
    unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            stream,
            &mut status,
            std::ptr::null_mut(),
            &mut graph,
            &mut nodes,
            &mut data,
            &mut n,
        )
    }
    .result()
    .w()?;
    if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE {
        return Ok(None);
    }
    if n == 0 {
        return Ok(Some((graph, Vec::new())));
    }
    let deps = (0..n)
        .map(|i| {
            // SAFETY: `nodes` holds n handles; `data`, when not null, n edge data (null: default
            // edges)
            unsafe {
                let e = if data.is_null() {
                    std::mem::zeroed()
                } else {
                    *data.add(i)
                };
                (*nodes.add(i), e)
            }
        })
        .collect();
    Ok(Some((graph, deps)))
}

fn set_capture_deps(
    stream: sys::CUstream,
    deps: &[(sys::CUgraphNode, sys::CUgraphEdgeData)],
) -> Result<()> {
    let mut nodes: Vec<sys::CUgraphNode> = deps.iter().map(|d| d.0).collect();
    let data: Vec<sys::CUgraphEdgeData> = deps.iter().map(|d| d.1).collect();
    let set = sys::CUstreamUpdateCaptureDependencies_flags::CU_STREAM_SET_CAPTURE_DEPENDENCIES;
    // SAFETY: replaces the capturing stream's dependency set with `deps`, nodes of its graph,
    // with one edge datum each
    unsafe {
        sys::cuStreamUpdateCaptureDependencies_v2(
            stream,
            nodes.as_mut_ptr(),
            data.as_ptr(),
            nodes.len(),
            set as u32,
        )
    }
    .result()
    .w()
}

/// `deps` with each free of a detached allocation replaced by what it hangs on
/// ([`graph_shape::past_frees`]); frees of allocations left in the chain stay.
fn lifted(
    deps: &[(sys::CUgraphNode, sys::CUgraphEdgeData)],
) -> Result<Vec<(sys::CUgraphNode, sys::CUgraphEdgeData)>> {
    let is_free = |node| {
        if node_type(node)? != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_FREE {
            return Ok(false);
        }
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: a free node of the graph being captured; writes the address it frees
        unsafe { sys::cuGraphMemFreeNodeGetParams(node, &mut ptr) }
            .result()
            .w()?;
        Ok(DETACHED.with(|d| d.borrow().as_ref().is_some_and(|d| d.ptrs.contains(&ptr))))
    };
    graph_shape::past_frees(deps, is_free, node_deps)
}

/// Records the address of `node` when it is an allocation node (a detached allocation).
fn note_detached(node: sys::CUgraphNode) -> Result<()> {
    if node_type(node)? != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_ALLOC {
        return Ok(());
    }
    // SAFETY: zeroed parameters are plain data the call overwrites
    let mut params: sys::CUDA_MEM_ALLOC_NODE_PARAMS = unsafe { std::mem::zeroed() };
    // SAFETY: an allocation node of the graph being captured; writes its parameters
    unsafe { sys::cuGraphMemAllocNodeGetParams(node, &mut params) }
        .result()
        .w()?;
    DETACHED.with(|d| {
        if let Some(d) = d.borrow_mut().as_mut() {
            d.ptrs.insert(params.dptr);
        }
    });
    Ok(())
}

/// The type of `node`, a node of a graph this thread holds.
fn node_type(node: sys::CUgraphNode) -> Result<sys::CUgraphNodeType> {
    let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
    // SAFETY: a node of a live graph; writes its type
    unsafe { sys::cuGraphNodeGetType(node, &mut t) }
        .result()
        .w()?;
    Ok(t)
}

/// The nodes `node` hangs on, with their edge data.
fn node_deps(node: sys::CUgraphNode) -> Result<Vec<(sys::CUgraphNode, sys::CUgraphEdgeData)>> {
    let mut n = 0usize;
    // SAFETY: counts the node's dependencies
    unsafe {
        sys::cuGraphNodeGetDependencies_v2(node, std::ptr::null_mut(), std::ptr::null_mut(), &mut n)
    }
    .result()
    .w()?;
    let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); n];
    // SAFETY: zeroed edge data is plain data the call overwrites
    let mut data: Vec<sys::CUgraphEdgeData> = vec![unsafe { std::mem::zeroed() }; n];
    // SAFETY: fills at most n dependencies into buffers of n
    unsafe {
        sys::cuGraphNodeGetDependencies_v2(node, nodes.as_mut_ptr(), data.as_mut_ptr(), &mut n)
    }
    .result()
    .w()?;
    Ok(nodes.into_iter().zip(data).take(n).collect())
}

/// The largest allocation a capture detaches: activations and split partials of a small step. A
/// larger one (a weight dequantized for one product: 33 MB and up in an 8B model) stays in the
/// chain, where the graph's later allocations may reuse its memory.
pub const DETACH_MAX_BYTES: usize = 8 << 20;

/// Runs `alloc`, one stream-ordered allocation of `bytes` on `dev`'s stream. While this thread
/// captures a graph with detached allocations, an allocation of up to [`DETACH_MAX_BYTES`] hangs
/// on the graph's root node instead of on the work captured before it, and the stream's
/// dependencies afterwards are those from before (past any frees) and the allocation.
pub(crate) fn detached<R>(
    dev: &CudaDevice,
    bytes: usize,
    alloc: impl FnOnce() -> Result<R>,
) -> Result<R> {
    if bytes > DETACH_MAX_BYTES || !detaching() {
        return alloc();
    }
    let stream = dev.cuda_stream().cu_stream();
    let Some((graph, before)) = capture_deps(stream)? else {
        return alloc();
    };
    let Some(root) = detached_root(graph)? else {
        return alloc();
    };
    let mut deps = lifted(&before)?;
    // SAFETY: a zeroed edge datum is the default (full) edge
    let full: sys::CUgraphEdgeData = unsafe { std::mem::zeroed() };
    set_capture_deps(stream, &[(root, full)])?;
    let made = alloc();
    // the stream hangs on what it hung on, and on the allocation
    let restored = (|| {
        let (_, after) = capture_deps(stream)?.unwrap_or_default();
        for d in after.into_iter().filter(|d| d.0 != root) {
            if made.is_ok() {
                note_detached(d.0)?;
            }
            deps.push(d);
        }
        set_capture_deps(stream, &deps)
    })();
    match (made, restored) {
        (Ok(r), Ok(())) => Ok(r),
        (made, restored) => {
            // the allocation's error first (an allocation made is freed here), then the stream
            // back on what it hung on, best effort: the capture fails either way
            let err = made
                .err()
                .or(restored.err())
                .unwrap_or_else(|| candle_core::Error::Msg("detached allocation failed".into()));
            let _ = set_capture_deps(stream, &before);
            Err(err)
        }
    }
}

/// Before a programmatic dependent is launched on `stream` while this thread captures a graph with
/// detached allocations: the stream's dependencies past the frees captured since the kernel before,
/// so the dependent hangs on that kernel by a programmatic edge.
pub(crate) fn lift_past_frees(stream: sys::CUstream) -> Result<()> {
    if !detaching() {
        return Ok(());
    }
    let Some((_, deps)) = capture_deps(stream)? else {
        return Ok(());
    };
    let kept = lifted(&deps)?;
    let same = kept.len() == deps.len() && kept.iter().zip(&deps).all(|(a, b)| a.0 == b.0);
    if same || kept.is_empty() {
        return Ok(());
    }
    set_capture_deps(stream, &kept)
}

/// Notes that `func` is being launched as a programmatic dependent (kept only while capturing).
pub(crate) fn note_dependent(func: sys::CUfunction) {
    DEPENDENTS.with(|d| {
        if let Some(set) = d.borrow_mut().as_mut() {
            set.insert(func as usize);
        }
    });
}

/// A recorded sequence of launches on the calling thread's stream (candle's per-thread stream): it
/// must be launched from the thread that captured it, which also writes its inputs.
pub struct Graph {
    graph: CudaGraph,
    /// what the capture made of the launches (zeros when the graph could not be read)
    pub shape: GraphShape,
}

// SAFETY: the graph's handles belong to the CUDA context, not to a thread; a `Graph` is used by one
// thread at a time (its owner), and CUDA only forbids concurrent use of one graph.
unsafe impl Send for Graph {}

impl Graph {
    /// Runs `work` once eagerly, then records it into a graph. `work` must launch the same kernels
    /// on the same tensors both times and must not copy between host and device.
    pub fn capture(device: &Device, work: impl FnMut() -> Result<()>) -> Result<Self> {
        Self::capture_with(device, CaptureOptions::default(), work)
    }

    /// [`Graph::capture`] as `options` say.
    pub fn capture_with(
        device: &Device,
        options: CaptureOptions,
        mut work: impl FnMut() -> Result<()>,
    ) -> Result<Self> {
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
        let state = CaptureState::begin(options.detach_allocations);
        let recorded = work();
        let dependents = DEPENDENTS
            .with(|d| d.borrow_mut().take())
            .unwrap_or_default();
        drop(state);
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
        let made = recorded.and_then(|()| freed.w()).and_then(|()| {
            let graph = ended
                .w()?
                .ok_or_else(|| candle_core::Error::Msg("the captured graph is empty".into()))?;
            graph.upload().w()?;
            Ok(graph)
        });
        let graph = match made {
            Ok(g) => g,
            Err(e) => {
                // what a failed capture reserved for graph allocations goes back to the device
                // SAFETY: the context's own device; trimming keeps what live graphs use
                unsafe { sys::cuDeviceGraphMemTrim(stream.context().cu_device()) };
                return Err(e);
            }
        };
        let shape = describe(graph.cu_graph(), &dependents).unwrap_or_else(|e| {
            tracing::debug!("the captured graph's nodes not read: {e}");
            GraphShape::default()
        });
        Ok(Self { graph, shape })
    }

    /// Queues the recorded launches on the stream they were captured on.
    pub fn launch(&self) -> Result<()> {
        self.graph.launch().w()
    }
}

/// Counts `graph`'s kernels and memory nodes and how its dependents (kernels whose function is in
/// `dependents`) hang on the nodes before them.
fn describe(graph: sys::CUgraph, dependents: &HashSet<usize>) -> Result<GraphShape> {
    let mut n = 0usize;
    // SAFETY: counts the graph's nodes
    unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) }
        .result()
        .w()?;
    let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); n];
    // SAFETY: fills at most `n` node handles into a buffer of `n`
    unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n) }
        .result()
        .w()?;
    nodes.truncate(n);
    let index: HashMap<usize, usize> = nodes
        .iter()
        .enumerate()
        .map(|(i, &h)| (h as usize, i))
        .collect();
    let mut kinds = Vec::with_capacity(n);
    for &node in &nodes {
        kinds.push(match node_type(node)? {
            sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL => {
                // SAFETY: zeroed kernel parameters are plain data the call overwrites
                let mut p: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
                // SAFETY: a kernel node of this graph; writes its parameters into `p`
                let read = unsafe { sys::cuGraphKernelNodeGetParams_v2(node, &mut p) }.result();
                let func = read.map_or(0, |_| p.func as usize);
                Kind::Kernel {
                    dependent: func != 0 && dependents.contains(&func),
                }
            }
            sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_ALLOC => Kind::Alloc,
            sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_FREE => Kind::Free,
            _ => Kind::Other,
        });
    }
    let mut m = 0usize;
    let none: *mut sys::CUgraphNode = std::ptr::null_mut();
    // SAFETY: counts the graph's edges
    unsafe { sys::cuGraphGetEdges_v2(graph, none, none, std::ptr::null_mut(), &mut m) }
        .result()
        .w()?;
    let mut from: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); m];
    let mut to: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); m];
    // SAFETY: zeroed edge data is plain data the call overwrites
    let mut data: Vec<sys::CUgraphEdgeData> = vec![unsafe { std::mem::zeroed() }; m];
    // SAFETY: fills at most `m` edges into buffers of `m`
    unsafe {
        sys::cuGraphGetEdges_v2(
            graph,
            from.as_mut_ptr(),
            to.as_mut_ptr(),
            data.as_mut_ptr(),
            &mut m,
        )
    }
    .result()
    .w()?;
    let programmatic = sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8;
    let mut edges = Vec::with_capacity(m);
    for i in 0..m.min(from.len()) {
        let (Some(&a), Some(&b)) = (index.get(&(from[i] as usize)), index.get(&(to[i] as usize)))
        else {
            candle_core::bail!("a graph edge between nodes the graph does not list");
        };
        let kind = if data[i].type_ == programmatic {
            Edge::Programmatic
        } else {
            Edge::Full
        };
        edges.push((a, b, kind));
    }
    Ok(graph_shape::shape(&kinds, &edges))
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
    graph_mem_attribute(
        device,
        sys::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT,
    )
}

/// Bytes of device memory the live graphs' allocations on `dev`'s GPU are using.
pub fn graph_memory_in_use(device: &Device) -> Result<usize> {
    graph_mem_attribute(
        device,
        sys::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT,
    )
}

fn graph_mem_attribute(device: &Device, attr: sys::CUgraphMem_attribute) -> Result<usize> {
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
        sys::cuDeviceGetGraphMemAttribute(ctx.cu_device(), attr, (&mut bytes as *mut u64).cast())
    }
    .result()
    .w()?;
    Ok(bytes as usize)
}
