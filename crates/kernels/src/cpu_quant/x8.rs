//! The CPU layout of GGML weights: rows in groups of eight, each block's fields interleaved across
//! the group's rows so that one 32-byte load holds four consecutive levels of each of eight rows.
//! A product then keeps one vector lane per weight row (no horizontal sums) and reads the weight
//! as one sequential stream.
//!
//! Each format's block is first rewritten into an "expanded" block (the same bytes, except
//! `q5_0`'s high bits, permuted so that one shift selects the bits of four levels, and `q4_K`'s
//! 6-bit scales and minimums, unpacked to bytes: 148 bytes instead of 144), then cut into fields.
//! A field of `len` bytes with chunk `c` is stored, for every block of the group, as chunk 0 of
//! rows 0..8, chunk 1 of rows 0..8, ...: levels use chunks of 4 bytes, the f16 scales chunks of 2
//! (the eight rows' scales are one 16-byte load) and per-sub-block scales chunks of 1 (the eight
//! rows' scales of one sub-block are 8 consecutive bytes). Each field of a group is one region
//! (`nb` blocks of it), levels first; groups start on 64-byte boundaries.
//!
//! The layout holds exactly the information of ggml's bytes: [`X8Weight::to_ggml`] gives them
//! back bit for bit (tests).

use crate::quantize::BlockType;
use rayon::prelude::*;

/// Rows per group.
pub const ROWS: usize = 8;

/// One field of an expanded block: `off` and `len` bytes within it, stored in chunks of `chunk`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Field {
    pub off: usize,
    pub len: usize,
    pub chunk: usize,
}

const fn f(off: usize, len: usize, chunk: usize) -> Field {
    Field { off, len, chunk }
}

const Q8_0: &[Field] = &[f(2, 32, 4), f(0, 2, 2)]; // qs, d
const Q4_0: &[Field] = &[f(2, 16, 4), f(0, 2, 2)]; // qs, d
const Q5_0: &[Field] = &[f(6, 16, 4), f(2, 4, 4), f(0, 2, 2)]; // qs, qh (permuted), d
/// qs, d, dmin, scales, minimums
const Q4K: &[Field] = &[
    f(20, 128, 4),
    f(0, 2, 2),
    f(2, 2, 2),
    f(4, 8, 1),
    f(12, 8, 1),
];
const Q6K: &[Field] = &[f(0, 128, 4), f(128, 64, 4), f(192, 16, 1), f(208, 2, 2)]; // ql, qh, scales, d

/// The fields of a format's expanded block, in the order of their regions, and the expanded
/// block's size.
pub(crate) fn fields(t: BlockType) -> (&'static [Field], usize) {
    match t {
        BlockType::Q8_0 => (Q8_0, 34),
        BlockType::Q4_0 => (Q4_0, 18),
        BlockType::Q5_0 => (Q5_0, 22),
        BlockType::Q4K => (Q4K, 148),
        BlockType::Q6K => (Q6K, 210),
    }
}

/// `q5_0`'s high bits as the products read them: bit `8i + g` holds the fifth bit of value
/// `4g + i` (ggml's bit `4g + i`). Byte `m` of ggml's bits holds groups `2m` and `2m + 1`, whose
/// bits land at `8i + 2m` and `8i + 2m + 1`: one table lookup per byte.
fn permute_qh(qh: u32) -> u32 {
    qh.to_le_bytes()
        .iter()
        .enumerate()
        .fold(0, |out, (m, &b)| out | (QH_PAIRS[b as usize] << (2 * m)))
}

/// [`permute_qh`] of one byte of groups 0 and 1.
const QH_PAIRS: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut v = 0;
    while v < 256 {
        let mut i = 0;
        while i < 4 {
            t[v] |= ((v as u32 >> i) & 1) << (8 * i);
            t[v] |= ((v as u32 >> (4 + i)) & 1) << (8 * i + 1);
            i += 1;
        }
        v += 1;
    }
    t
};

fn unpermute_qh(p: u32) -> u32 {
    let mut out = 0;
    for g in 0..8 {
        for i in 0..4 {
            out |= ((p >> (8 * i + g)) & 1) << (4 * g + i);
        }
    }
    out
}

/// ggml's block -> the expanded block.
fn expand(t: BlockType, b: &[u8], e: &mut [u8]) {
    match t {
        BlockType::Q5_0 => {
            e[..22].copy_from_slice(&b[..22]);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            e[2..6].copy_from_slice(&permute_qh(qh).to_le_bytes());
        }
        BlockType::Q4K => {
            e[..4].copy_from_slice(&b[..4]);
            for j in 0..8 {
                let (sc, mn) = super::scale_min_k4(j, &b[4..16]);
                e[4 + j] = sc;
                e[12 + j] = mn;
            }
            e[20..148].copy_from_slice(&b[16..144]);
        }
        _ => e.copy_from_slice(b),
    }
}

/// The expanded block -> ggml's block.
fn contract(t: BlockType, e: &[u8], b: &mut [u8]) {
    match t {
        BlockType::Q5_0 => {
            b.copy_from_slice(e);
            let p = u32::from_le_bytes([e[2], e[3], e[4], e[5]]);
            b[2..6].copy_from_slice(&unpermute_qh(p).to_le_bytes());
        }
        BlockType::Q4K => {
            b[..4].copy_from_slice(&e[..4]);
            let (sc, mn) = (&e[4..12], &e[12..20]);
            let q = &mut b[4..16];
            // ggml's packing (`scale_min_k4` reads it back)
            for j in 0..4 {
                q[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
                q[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
                q[j + 8] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4);
            }
            b[16..144].copy_from_slice(&e[20..148]);
        }
        _ => b.copy_from_slice(e),
    }
}

/// Copies field `fd` of expanded block `e` into the group for row `j`, chunk by chunk (`C`, the
/// field's chunk, known at compile time so that each copy is a single move).
#[inline(always)]
fn scatter<const C: usize>(grp: &mut [u8], e: &[u8], base: usize, j: usize, fd: &Field) {
    for c in 0..fd.len / C {
        let dst = base + (c * ROWS + j) * C;
        let src = fd.off + c * C;
        grp[dst..dst + C].copy_from_slice(&e[src..src + C]);
    }
}

/// Zeroed bytes starting on a 64-byte boundary. Allocated as plain bytes (`calloc`, which takes
/// large buffers from fresh zero pages) and aligned by an offset: a 64-byte aligned zeroed
/// allocation is written with zeros first by the allocator, a pass over the whole weight. The
/// buffer's whole 2 MiB pages are asked for as transparent huge pages before anything is written.
#[derive(Debug)]
struct Lines {
    raw: Vec<u8>,
    off: usize,
    len: usize,
}

impl Lines {
    fn zeroed(len: usize) -> Self {
        let raw = vec![0u8; len + 63];
        advise_huge_pages(&raw);
        let off = raw.as_ptr().align_offset(64).min(63);
        Self { raw, off, len }
    }

    fn as_slice(&self) -> &[u8] {
        &self.raw[self.off..self.off + self.len]
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.raw[self.off..self.off + self.len]
    }
}

/// Asks Linux to back the whole 2 MiB pages inside `buf` with transparent huge pages (honoured
/// where THP is `always` or `madvise`, the usual default), best before anything is written. A
/// weight streamed once a token then takes a TLB miss every 2 MiB instead of every 4 KiB, and the
/// hardware prefetchers, which stop at page boundaries, run on; a buffer being filled takes a
/// page fault every 2 MiB. A hint only: a refusal changes nothing.
pub fn advise_huge_pages<T>(buf: &[T]) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = buf.as_ptr() as usize;
        let first = start.next_multiple_of(HUGE);
        let end = (start + std::mem::size_of_val(buf)) / HUGE * HUGE;
        if end > first {
            // SAFETY: the range lies inside `buf`'s allocation; the advice changes no contents
            unsafe { libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = buf;
}

impl Clone for Lines {
    fn clone(&self) -> Self {
        let mut c = Self::zeroed(self.len);
        c.as_mut_slice().copy_from_slice(self.as_slice());
        c
    }
}

/// A weight `[n, k]` in the grouped layout. Rows past `n` (up to the next multiple of 8) are
/// zero blocks whose products are dropped.
#[derive(Debug, Clone)]
pub struct X8Weight {
    format: BlockType,
    n: usize,
    k: usize,
    /// 64-byte aligned storage, a whole number of cache lines.
    data: Lines,
}

/// Pointers to one group's regions (one per field), its block count and its bytes per block (the
/// regions are one run from `region[0]`, `share` bytes a block: every field of eight rows).
#[derive(Clone, Copy)]
pub(crate) struct Group {
    pub region: [*const u8; 5],
    pub nb: usize,
    pub share: usize,
}

impl X8Weight {
    /// From ggml's bytes of `n` rows of `k` values.
    pub fn from_ggml(format: BlockType, bytes: &[u8], n: usize, k: usize) -> Result<Self, String> {
        let rb = format.row_bytes(k);
        if bytes.len() != n * rb {
            return Err(format!(
                "{} bytes do not hold [{n}, {k}] in {format:?}",
                bytes.len()
            ));
        }
        Self::from_ggml_parts(format, &[bytes], k)
    }

    /// The rows of several weights of one format and width stacked in order (a fused projection),
    /// from each part's ggml bytes (whole rows of `k` values), written once into the layout.
    pub fn from_ggml_parts(format: BlockType, parts: &[&[u8]], k: usize) -> Result<Self, String> {
        let bv = format.block_values();
        if k == 0 || !k.is_multiple_of(bv) {
            return Err(format!("rows of {k} values are not whole blocks of {bv}"));
        }
        let rb = format.row_bytes(k);
        if let Some(p) = parts.iter().find(|p| !p.len().is_multiple_of(rb)) {
            return Err(format!(
                "{} bytes are not whole rows of {k} values in {format:?}",
                p.len()
            ));
        }
        // where each part's rows start
        let starts: Vec<usize> = parts
            .iter()
            .scan(0, |at, p| {
                let s = *at;
                *at += p.len() / rb;
                Some(s)
            })
            .collect();
        let n = parts.iter().map(|p| p.len() / rb).sum::<usize>();
        let row_of = |r: usize| {
            let i = starts.partition_point(|&s| s <= r) - 1;
            &parts[i][(r - starts[i]) * rb..][..rb]
        };
        let groups = n.div_ceil(ROWS);
        let stride = Self::group_stride(format, k);
        let mut w = Self {
            format,
            n,
            k,
            data: Lines::zeroed(groups * stride),
        };
        let nb = k / bv;
        let (fl, eb) = fields(format);
        let bb = format.block_bytes();
        let out = w.data.as_mut_slice();
        let reshaped = matches!(format, BlockType::Q5_0 | BlockType::Q4K);
        out.par_chunks_mut(stride).enumerate().for_each(|(g, grp)| {
            let mut e = [0u8; 256];
            let e = &mut e[..eb];
            for j in 0..ROWS.min(n - g * ROWS) {
                for (b, blk) in row_of(g * ROWS + j).chunks_exact(bb).enumerate() {
                    // the formats whose expanded block is ggml's own are read in place
                    let src: &[u8] = if reshaped {
                        expand(format, blk, e);
                        e
                    } else {
                        blk
                    };
                    let mut region = 0;
                    for fd in fl {
                        let base = region + b * ROWS * fd.len;
                        match fd.chunk {
                            1 => scatter::<1>(grp, src, base, j, fd),
                            2 => scatter::<2>(grp, src, base, j, fd),
                            4 => scatter::<4>(grp, src, base, j, fd),
                            _ => unreachable!("fields are cut in chunks of 1, 2 or 4 bytes"),
                        }
                        region += nb * ROWS * fd.len;
                    }
                }
            }
        });
        Ok(w)
    }

    /// Bytes per group: every field's region, rounded up to a cache line.
    fn group_stride(format: BlockType, k: usize) -> usize {
        let (fl, _) = fields(format);
        let nb = k / format.block_values();
        let bytes: usize = fl.iter().map(|f| nb * ROWS * f.len).sum();
        bytes.div_ceil(64) * 64
    }

    /// Bytes of one group of eight rows.
    pub fn group_bytes(&self) -> usize {
        Self::group_stride(self.format, self.k)
    }

    fn bytes(&self) -> &[u8] {
        self.data.as_slice()
    }

    pub fn format(&self) -> BlockType {
        self.format
    }

    /// `(n, k)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    pub fn groups(&self) -> usize {
        self.n.div_ceil(ROWS)
    }

    /// Bytes held.
    pub fn size_in_bytes(&self) -> usize {
        self.data.len
    }

    /// Where each group's regions start.
    pub(crate) fn layout(&self) -> Layout {
        let (fl, _) = fields(self.format);
        let nb = self.k / self.format.block_values();
        let mut offsets = [0; 5];
        let mut off = 0;
        for (o, fd) in offsets.iter_mut().zip(fl) {
            *o = off;
            off += nb * ROWS * fd.len;
        }
        Layout {
            base: self.data.as_slice().as_ptr(),
            stride: Self::group_stride(self.format, self.k),
            offsets,
            nb,
            share: off / nb.max(1),
        }
    }

    /// ggml's bytes of group `g`'s rows (8 rows, the padding rows included).
    pub fn group_to_ggml(&self, g: usize, out: &mut Vec<u8>) {
        let format = self.format;
        let stride = Self::group_stride(format, self.k);
        let grp = &self.bytes()[g * stride..(g + 1) * stride];
        let nb = self.k / format.block_values();
        let rb = format.row_bytes(self.k);
        let (fl, eb) = fields(format);
        out.clear();
        out.resize(ROWS * rb, 0);
        let mut e = [0u8; 256];
        let e = &mut e[..eb];
        for j in 0..ROWS {
            for b in 0..nb {
                let mut region = 0;
                for fd in fl {
                    let base = region + b * ROWS * fd.len;
                    for c in 0..fd.len / fd.chunk {
                        let src = base + (c * ROWS + j) * fd.chunk;
                        let dst = fd.off + c * fd.chunk;
                        e[dst..dst + fd.chunk].copy_from_slice(&grp[src..src + fd.chunk]);
                    }
                    region += nb * ROWS * fd.len;
                }
                let blk = &mut out[j * rb + b * format.block_bytes()..][..format.block_bytes()];
                contract(format, e, blk);
            }
        }
    }

    /// ggml's bytes of the whole weight.
    pub fn to_ggml(&self) -> Vec<u8> {
        let rb = self.format.row_bytes(self.k);
        let mut out = Vec::with_capacity(self.n * rb);
        let mut buf = Vec::new();
        for g in 0..self.groups() {
            self.group_to_ggml(g, &mut buf);
            let rows = (self.n - g * ROWS).min(ROWS);
            out.extend_from_slice(&buf[..rows * rb]);
        }
        out
    }
}

/// The regions of every group of a weight: group `g`'s field `f` starts at
/// `base + g * stride + offsets[f]`.
#[derive(Clone, Copy)]
pub(crate) struct Layout {
    base: *const u8,
    stride: usize,
    offsets: [usize; 5],
    nb: usize,
    share: usize,
}

impl Layout {
    /// Group `g`'s regions (`g` below the weight's group count for the pointers to be valid).
    #[inline]
    pub fn group(&self, g: usize) -> Group {
        let base = self.base.wrapping_add(g * self.stride);
        Group {
            region: self.offsets.map(|o| base.wrapping_add(o)),
            nb: self.nb,
            share: self.share,
        }
    }

    /// Where groups `groups` start and how many bytes they take (one contiguous run).
    #[inline]
    pub fn span(&self, groups: std::ops::Range<usize>) -> (*const u8, usize) {
        (
            self.base.wrapping_add(groups.start * self.stride),
            groups.len() * self.stride,
        )
    }
}

// SAFETY: the pointers point into an `X8Weight`'s storage, which is never written after it is
// built
unsafe impl Send for Layout {}
unsafe impl Sync for Layout {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quantize::{quantize, test_values};

    #[test]
    fn the_layout_gives_back_ggml_bytes_bit_for_bit() {
        for format in BlockType::ALL {
            for n in [1, 8, 13, 24] {
                let k = 512;
                let q = quantize(format, &test_values(n * k, n as u64), k).expect("quantize");
                let w = X8Weight::from_ggml(format, &q, n, k).expect("layout");
                assert_eq!(w.to_ggml(), q, "{format:?} n={n}");
                assert_eq!(w.size_in_bytes() % 64, 0);
                assert_eq!(
                    w.bytes().as_ptr() as usize % 64,
                    0,
                    "groups start on cache lines"
                );
            }
        }
    }

    #[test]
    fn weights_from_parts_are_the_weight_of_the_stacked_rows() {
        let k = 256;
        let (a, b) = (16, 13);
        for format in BlockType::ALL {
            let qa = quantize(format, &test_values(a * k, 1), k).expect("quantize");
            let qb = quantize(format, &test_values(b * k, 2), k).expect("quantize");
            // the first part ends inside a group of eight rows
            for (first, second, rows) in [(&qa, &qb, a + b), (&qb, &qa, b + a)] {
                let s = X8Weight::from_ggml_parts(format, &[first, second], k).expect("layout");
                assert_eq!(s.shape(), (rows, k));
                assert_eq!(
                    s.to_ggml(),
                    [first.clone(), second.clone()].concat(),
                    "{format:?}"
                );
            }
            assert!(X8Weight::from_ggml_parts(format, &[&qa[1..]], k).is_err());
        }
    }

    #[test]
    fn q5_0_bit_permutation_is_a_bijection() {
        for v in [0u32, 1, 0x8000_0000, 0xdead_beef, 0x0123_4567, u32::MAX] {
            assert_eq!(unpermute_qh(permute_qh(v)), v);
            for g in 0..8 {
                for i in 0..4 {
                    let bit = (v >> (4 * g + i)) & 1;
                    assert_eq!((permute_qh(v) >> (8 * i + g)) & 1, bit, "{v:#x} {g} {i}");
                }
            }
        }
        // value 4g + i's bit lands on 8i + g
        assert_eq!(permute_qh(1 << 5), 1 << 9); // value 5: g 1, i 1
    }

    #[test]
    fn wrong_sizes_are_errors() {
        assert!(X8Weight::from_ggml(BlockType::Q8_0, &[0; 34], 1, 33).is_err());
        assert!(X8Weight::from_ggml(BlockType::Q8_0, &[0; 34], 2, 32).is_err());
    }
}
