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
//! - [`widen_to_f32`]: a checkpoint's 16-bit tensor converted to f32 straight from the memory
//!   map, on every core, into a buffer backed by huge pages (one pass; the plain route copies the
//!   bytes into a 16-bit buffer first and converts on one thread).
//! - [`fill_in_parallel`]: one buffer written from several source runs (a batch's images into a
//!   pinned staging buffer), the pieces of all of them spread over rayon's threads at once.

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

/// The values of `bytes`, little-endian `bf16` (`bf16` true) or `f16`, as f32: converted in
/// parallel chunks into a buffer whose whole 2 MiB pages are asked for as transparent huge pages
/// before anything is written (a page fault per 2 MiB instead of per 4 KiB). `None` when
/// `bytes` is not whole values.
pub fn widen_to_f32(bytes: &[u8], bf16: bool) -> Option<Vec<f32>> {
    use rayon::prelude::*;
    if !bytes.len().is_multiple_of(2) {
        return None;
    }
    let n = bytes.len() / 2;
    let mut out: Vec<f32> = Vec::with_capacity(n);
    rserve_kernels::cpu_quant::advise_huge_pages(out.spare_capacity_mut());
    // values per task: large enough that a task's start costs nothing, small enough to balance
    const CHUNK: usize = 1 << 16;
    out.spare_capacity_mut()[..n]
        .par_chunks_mut(CHUNK)
        .zip(bytes.par_chunks(2 * CHUNK))
        .for_each(|(o, b)| {
            for (o, b) in o.iter_mut().zip(b.chunks_exact(2)) {
                o.write(widen(b, bf16));
            }
        });
    // SAFETY: every one of the first `n` values was written above (the chunks of `out` and of
    // `bytes` pair up one to one: `n` values and `2 n` bytes in chunks of CHUNK and 2 CHUNK).
    unsafe { out.set_len(n) };
    Some(out)
}

/// Writes `srcs`, one after another, into the first values of `dst` with `fill` (a source run
/// into as many values), in pieces of at most `piece` values over rayon's threads. The pieces of
/// every source go to the pool together: a batch of images filled one image after another would
/// keep only an image's few pieces in flight at a time. Sources past `dst`'s end are cut off.
pub fn fill_in_parallel<S: Sync, D: Send>(
    srcs: &[&[S]],
    dst: &mut [D],
    piece: usize,
    fill: impl Fn(&[S], &mut [D]) + Sync,
) {
    use rayon::prelude::*;
    let piece = piece.max(1);
    let mut jobs: Vec<(&[S], &mut [D])> = Vec::new();
    let mut rest = dst;
    for src in srcs {
        let n = src.len().min(rest.len());
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(n);
        rest = tail;
        jobs.extend(src[..n].chunks(piece).zip(head.chunks_mut(piece)));
    }
    jobs.into_par_iter().for_each(|(s, d)| fill(s, d));
}

/// The little-endian `bf16` (`bf16` true) or `f16` value in `b`'s first two bytes, as f32.
#[inline]
pub fn widen(b: &[u8], bf16: bool) -> f32 {
    let bits = u16::from_le_bytes([b[0], b[1]]);
    if bf16 {
        f32::from_bits(u32::from(bits) << 16)
    } else {
        half::f16::from_bits(bits).to_f32()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn sources_fill_the_buffer_in_order_across_pieces() {
        let a: Vec<u32> = (0..10).collect();
        let b: Vec<u32> = Vec::new();
        let c: Vec<u32> = (100..107).collect();
        let mut dst = vec![0u64; 17];
        for piece in [1, 3, 4, 100] {
            dst.fill(0);
            super::fill_in_parallel(&[&a, &b, &c], &mut dst, piece, |s, d| {
                d.iter_mut()
                    .zip(s)
                    .for_each(|(d, &v)| *d = u64::from(v) * 2)
            });
            let want: Vec<u64> = a.iter().chain(&c).map(|&v| u64::from(v) * 2).collect();
            assert_eq!(dst, want, "piece {piece}");
        }
        // a buffer shorter than the sources takes their first values
        let mut short = vec![0u64; 12];
        super::fill_in_parallel(&[&a, &c], &mut short, 5, |s, d| {
            d.iter_mut().zip(s).for_each(|(d, &v)| *d = u64::from(v))
        });
        assert_eq!(short[9..], [9, 100, 101]);
    }

    #[test]
    fn sixteen_bit_values_widen_exactly() {
        let vals: Vec<f32> = (0..200_000).map(|i| (i as f32 - 1e5) * 0.37).collect();
        let bf: Vec<u8> = vals
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        let f: Vec<u8> = vals
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect();
        let want_bf: Vec<f32> = vals
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_f32())
            .collect();
        let want_f: Vec<f32> = vals
            .iter()
            .map(|v| half::f16::from_f32(*v).to_f32())
            .collect();
        assert_eq!(super::widen_to_f32(&bf, true), Some(want_bf));
        assert_eq!(super::widen_to_f32(&f, false), Some(want_f));
        assert_eq!(super::widen_to_f32(&[1, 2, 3], true), None);
        assert_eq!(super::widen_to_f32(&[], true), Some(vec![]));
    }
}
