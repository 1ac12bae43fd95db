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
//! - [`in_pool`]: the CPU forward pass run on one of rayon's workers, so that its parallel loops
//!   join inside the pool instead of each being handed over from outside it.

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

/// Runs `f` on one of rayon's worker threads (directly when called from one). The parallel loops
/// inside `f` then join within the pool: the running worker takes its share of each loop and
/// the others steal the rest, where a loop started from outside the pool is handed over through
/// its queue and the caller put to sleep until a worker finishes it (a futex wake and wait each
/// way, tens of microseconds for each of the ten or so loops of every layer on the CPU backend).
pub fn in_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}
