//! A fixed arena of KV blocks with reference counts and an index-linked free list.
//!
//! Owns: which blocks are free, in which order they are handed out (FIFO: the block freed first is
//! reused first), and each block's reference count. Does not own: which sequence holds which block
//! (see `manager`). Invariants: a block is on the free list iff its reference count is 0; the list
//! links are consistent; `num_free` equals the list length.

use std::fmt;

/// Index of a block in the cache tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Block {
    ref_count: u32,
    prev_free: u32,
    next_free: u32,
}

/// Misuse of the pool: always a bug in the caller, reported instead of corrupting state.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error("block {0} is not allocated")]
    NotAllocated(BlockId),
    #[error("block {0} does not exist")]
    OutOfRange(BlockId),
}

/// The block arena.
#[derive(Debug, Clone)]
pub struct BlockPool {
    blocks: Vec<Block>,
    head: u32,
    tail: u32,
    num_free: usize,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks, handed out in id order.
    pub fn new(num_blocks: usize) -> Self {
        let n = num_blocks.min(NIL as usize - 1) as u32;
        let blocks = (0..n)
            .map(|i| Block {
                ref_count: 0,
                prev_free: if i == 0 { NIL } else { i - 1 },
                next_free: if i + 1 == n { NIL } else { i + 1 },
            })
            .collect();
        Self {
            blocks,
            head: if n == 0 { NIL } else { 0 },
            tail: if n == 0 { NIL } else { n - 1 },
            num_free: n as usize,
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// Fraction of blocks in use, in [0, 1].
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        1.0 - self.num_free as f64 / self.blocks.len() as f64
    }

    pub fn ref_count(&self, id: BlockId) -> u32 {
        self.blocks.get(id.0 as usize).map_or(0, |b| b.ref_count)
    }

    fn unlink(&mut self, i: u32) {
        let (p, n) = {
            let b = &self.blocks[i as usize];
            (b.prev_free, b.next_free)
        };
        if p == NIL {
            self.head = n;
        } else {
            self.blocks[p as usize].next_free = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.blocks[n as usize].prev_free = p;
        }
        let b = &mut self.blocks[i as usize];
        b.prev_free = NIL;
        b.next_free = NIL;
        self.num_free -= 1;
    }

    fn push_tail(&mut self, i: u32) {
        let t = self.tail;
        {
            let b = &mut self.blocks[i as usize];
            b.prev_free = t;
            b.next_free = NIL;
        }
        if t == NIL {
            self.head = i;
        } else {
            self.blocks[t as usize].next_free = i;
        }
        self.tail = i;
        self.num_free += 1;
    }

    /// Takes `n` blocks from the head of the free list, each with reference count 1; all or none.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let i = self.head;
            self.unlink(i);
            self.blocks[i as usize].ref_count = 1;
            out.push(BlockId(i));
        }
        Some(out)
    }

    /// Adds a reference to an allocated block (sharing between sequences).
    pub fn incref(&mut self, id: BlockId) -> Result<(), PoolError> {
        let b = self
            .blocks
            .get_mut(id.0 as usize)
            .ok_or(PoolError::OutOfRange(id))?;
        if b.ref_count == 0 {
            return Err(PoolError::NotAllocated(id));
        }
        b.ref_count += 1;
        Ok(())
    }

    /// Drops a reference; the block returns to the tail of the free list when none remain.
    pub fn free(&mut self, id: BlockId) -> Result<(), PoolError> {
        let b = self
            .blocks
            .get_mut(id.0 as usize)
            .ok_or(PoolError::OutOfRange(id))?;
        if b.ref_count == 0 {
            return Err(PoolError::NotAllocated(id));
        }
        b.ref_count -= 1;
        if b.ref_count == 0 {
            self.push_tail(id.0);
        }
        Ok(())
    }

    /// The free list from head to tail (for tests and integrity checks).
    pub fn free_list(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.num_free);
        let mut i = self.head;
        while i != NIL && out.len() <= self.blocks.len() {
            out.push(BlockId(i));
            i = self.blocks[i as usize].next_free;
        }
        out
    }

    /// Checks that reference counts equal `expected` (block -> number of holders; absent means 0)
    /// and that the free list holds exactly the unreferenced blocks. Returns every violation found.
    pub fn check_integrity(
        &self,
        expected: &std::collections::HashMap<BlockId, u32>,
    ) -> Vec<String> {
        let mut errs = Vec::new();
        let free = self.free_list();
        if free.len() != self.num_free {
            errs.push(format!(
                "free list has {} entries, counter says {}",
                free.len(),
                self.num_free
            ));
        }
        let mut on_list = vec![false; self.blocks.len()];
        for b in &free {
            if on_list[b.0 as usize] {
                errs.push(format!("block {b} twice on the free list"));
            }
            on_list[b.0 as usize] = true;
        }
        for (i, b) in self.blocks.iter().enumerate() {
            let id = BlockId(i as u32);
            let want = expected.get(&id).copied().unwrap_or(0);
            if b.ref_count != want {
                errs.push(format!(
                    "block {id}: ref count {} but {want} holders",
                    b.ref_count
                ));
            }
            if (b.ref_count == 0) != on_list[i] {
                errs.push(format!(
                    "block {id}: ref count {} but on free list = {}",
                    b.ref_count, on_list[i]
                ));
            }
        }
        errs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn ids(v: &[u32]) -> Vec<BlockId> {
        v.iter().map(|&i| BlockId(i)).collect()
    }

    #[test]
    fn allocates_in_order_and_reuses_fifo() {
        let mut p = BlockPool::new(4);
        assert_eq!(p.allocate(2), Some(ids(&[0, 1])));
        assert_eq!(p.num_free(), 2);
        p.free(BlockId(1)).unwrap();
        p.free(BlockId(0)).unwrap();
        assert_eq!(p.free_list(), ids(&[2, 3, 1, 0]));
        assert_eq!(p.allocate(3), Some(ids(&[2, 3, 1])));
        assert_eq!(p.allocate(2), None, "all or nothing");
        assert_eq!(p.num_free(), 1);
    }

    #[test]
    fn ref_counts_keep_shared_blocks() {
        let mut p = BlockPool::new(2);
        let b = p.allocate(1).unwrap()[0];
        p.incref(b).unwrap();
        assert_eq!(p.ref_count(b), 2);
        p.free(b).unwrap();
        assert_eq!(p.num_free(), 1);
        p.free(b).unwrap();
        assert_eq!(p.num_free(), 2);
        assert_eq!(p.free(b), Err(PoolError::NotAllocated(b)));
        assert_eq!(p.incref(b), Err(PoolError::NotAllocated(b)));
        assert_eq!(p.free(BlockId(9)), Err(PoolError::OutOfRange(BlockId(9))));
    }

    #[test]
    fn integrity_detects_leaks() {
        let mut p = BlockPool::new(3);
        let b = p.allocate(2).unwrap();
        let mut held = HashMap::new();
        held.insert(b[0], 1);
        let errs = p.check_integrity(&held);
        assert_eq!(errs.len(), 1, "{errs:?}");
        held.insert(b[1], 1);
        assert!(p.check_integrity(&held).is_empty());
    }

    #[test]
    fn empty_pool() {
        let mut p = BlockPool::new(0);
        assert_eq!(p.allocate(1), None);
        assert_eq!(p.allocate(0), Some(vec![]));
        assert_eq!(p.usage(), 0.0);
    }
}
