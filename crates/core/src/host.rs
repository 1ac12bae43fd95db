//! Host process settings the engine relies on for a fast start on small machines.
//!
//! - [`zero_page_allocations`]: large zeroed buffers (the CPU KV cache) taken straight from the
//!   kernel's zero pages, so that gigabytes of cache cost nothing until a block is first written.
//!   glibc's `calloc` otherwise serves them from freed heap memory it must clear first (its
//!   threshold for mapping fresh pages grows to 32 MiB once large buffers have been freed, as
//!   loading does), which cost 0.3-0.6 s for a 2 GB cache on two cores.
//! - [`lowest_priority`]: a background thread that yields its core to any other, so that warm-up
//!   work barely delays loading or the first requests (it still progresses on a busy machine,
//!   unlike the idle scheduling class, so a request waiting on it is not starved).

/// Runs `f` with every allocation of 1 MiB or more mapped from fresh zero pages, then puts back
/// glibc's steady state (32 MiB, the most its own threshold grows to). Elsewhere `f` just runs.
pub fn zero_page_allocations<T>(f: impl FnOnce() -> T) -> T {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes allocator parameters; memory already allocated is
        // unaffected and every chunk keeps the flag that says how it must be freed.
        unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20) };
        let out = f();
        // SAFETY: as above.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 64 << 20);
        }
        out
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    f()
}

/// Gives the calling thread the lowest scheduling priority (nice 19; on Linux a thread's own).
/// Best effort: elsewhere, or if the kernel refuses, nothing changes.
pub fn lowest_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: `who` 0 is the calling thread; no memory is passed.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, 0, 19);
    }
}
