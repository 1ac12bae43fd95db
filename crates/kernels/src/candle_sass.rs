//! candle's CUDA modules as SASS, so that nothing is JIT-compiled when serving starts.
//!
//! candle ships its kernels (casts, copies, fills, reductions, indexing, ...) as PTX and hands that
//! text to the driver's `cuModuleLoadData` at their first use, which compiles it: 13-18 s on an
//! H200 when the driver's cache is empty or disabled. The build compiles the same sources to
//! SASS (`build.rs`, sm_90 by default). This file defines `cuModuleLoadData` for the process: an
//! image that is one of candle's PTX modules, byte for byte, is swapped for its SASS; anything
//! else (rserve's own fat binary, other libraries' modules), and a SASS image the GPU cannot run,
//! goes to the driver's function as it came.

use candle_core::cuda_backend::cudarc::driver::sys::{CUmodule, CUresult};
use candle_core::cuda_backend::kernels::Module;
use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

macro_rules! modules {
    ($($name:literal => $module:ident),* $(,)?) => {
        /// (candle's module, the SASS built from the same source)
        static MODULES: &[(&Module, &[u8])] = &[$((
            &candle_core::cuda_backend::kernels::$module,
            include_bytes!(concat!(env!("OUT_DIR"), "/candle_", $name, ".fatbin")),
        )),*];
    };
}

modules! {
    "affine" => AFFINE, "binary" => BINARY, "cast" => CAST, "fill" => FILL,
    "indexing" => INDEXING, "quantized" => QUANTIZED, "reduce" => REDUCE, "sort" => SORT,
    "ternary" => TERNARY, "unary" => UNARY,
}

static SWAPPED: AtomicUsize = AtomicUsize::new(0);

/// How many of candle's modules were loaded as SASS in this process.
pub fn modules_loaded_as_sass() -> usize {
    SWAPPED.load(Ordering::Relaxed)
}

type LoadData = unsafe extern "C" fn(*mut CUmodule, *const c_void) -> CUresult;

/// The driver's own `cuModuleLoadData`: libcuda's definition (already loaded: this binary links
/// it), else the next definition after this one.
fn driver_load_data() -> Option<LoadData> {
    static REAL: OnceLock<usize> = OnceLock::new();
    let addr = *REAL.get_or_init(|| {
        let name = c"cuModuleLoadData";
        // SAFETY: NUL-terminated names; RTLD_NOLOAD only finds a library already loaded, and a
        // handle's lookup starts in that library
        unsafe {
            let lib = libc::dlopen(
                c"libcuda.so.1".as_ptr(),
                libc::RTLD_LAZY | libc::RTLD_NOLOAD,
            );
            let mut sym = if lib.is_null() {
                std::ptr::null_mut()
            } else {
                libc::dlsym(lib, name.as_ptr())
            };
            if sym.is_null() {
                sym = libc::dlsym(libc::RTLD_NEXT, name.as_ptr());
            }
            sym as usize
        }
    });
    // SAFETY: the driver's symbol has this signature (cuda.h)
    (addr != 0).then(|| unsafe { std::mem::transmute::<usize, LoadData>(addr) })
}

/// candle's SASS for `image`, if it is one of candle's PTX modules.
///
/// # Safety
/// `image` is what `cuModuleLoadData` accepts: PTX text is NUL-terminated.
unsafe fn sass_for(image: *const c_void) -> Option<&'static [u8]> {
    if image.is_null() {
        return None;
    }
    // PTX starts with a comment or a directive; fat binaries and cubins do not
    // SAFETY: every image the driver accepts is at least two bytes long
    let head = unsafe { std::slice::from_raw_parts(image as *const u8, 2) };
    if head != b"//" && head[0] != b'.' {
        return None;
    }
    // SAFETY: PTX handed to the driver is a C string (the caller's contract)
    let text = unsafe { CStr::from_ptr(image as *const libc::c_char) }.to_bytes();
    MODULES
        .iter()
        .find(|(m, _)| m.ptx().len() == text.len() && m.ptx().as_bytes() == text)
        .map(|(_, sass)| *sass)
}

/// The driver entry point, seen first by everything linked into this binary.
///
/// # Safety
/// As the driver's `cuModuleLoadData`.
#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut CUmodule, image: *const c_void) -> CUresult {
    let Some(real) = driver_load_data() else {
        return CUresult::CUDA_ERROR_NOT_INITIALIZED;
    };
    // SAFETY: forwarded from the caller's contract
    if let Some(sass) = unsafe { sass_for(image) } {
        // SAFETY: a fat binary image that lives for the whole process
        let r = unsafe { real(module, sass.as_ptr() as *const c_void) };
        if r == CUresult::CUDA_SUCCESS {
            SWAPPED.fetch_add(1, Ordering::Relaxed);
            return r;
        }
        // not for this GPU: the driver compiles the PTX as candle meant
    }
    // SAFETY: forwarded unchanged
    unsafe { real(module, image) }
}
