//! A fixed arena of KV blocks with reference counts, an index-linked free list and the prefix
//! cache's index.
//!
//! Owns: which blocks are free, in which order they are handed out (FIFO: the block freed first is
//! reused first), each block's reference count, and which full blocks hold known content (a
//! [`BlockHash`] -> block map). A hashed block whose last holder lets go stays hashed on the free
//! list: a later request with the same content revives it ([`BlockPool::touch`]); one taken off
//! the head for new content loses its hash (eviction, least recently freed first). Does not own:
//! which sequence holds which block (see `manager`). Invariants: a block is on the free list iff
//! its reference count is 0; the list links are consistent; `num_free` equals the list length;
//! the map and the blocks' hashes agree (each hashed block is the map's entry for its hash).

use std::collections::HashMap;
use std::fmt;

/// The content of a full block: SHA-256 over its parent block's hash, its token ids and, for a
/// sequence's first block, the request's extra keys (see `crate::kv_cache::hashing`). Two
/// different contents with one hash would need a SHA-256 collision (2^128 work by the birthday
/// bound), so a hit is taken without comparing tokens, as vLLM's sha256 mode does.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub [u8; 32]);

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0[..6] {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

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
    hash: Option<BlockHash>,
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
    cached: HashMap<BlockHash, u32>,
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
                hash: None,
            })
            .collect();
        Self {
            blocks,
            head: if n == 0 { NIL } else { 0 },
            tail: if n == 0 { NIL } else { n - 1 },
            num_free: n as usize,
            cached: HashMap::new(),
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

    fn block_mut(&mut self, id: BlockId) -> Result<&mut Block, PoolError> {
        self.blocks
            .get_mut(id.0 as usize)
            .ok_or(PoolError::OutOfRange(id))
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
    /// A cached block taken this way is evicted (its hash forgotten).
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let i = self.head;
            self.unlink(i);
            let b = &mut self.blocks[i as usize];
            b.ref_count = 1;
            if let Some(h) = b.hash.take() {
                self.cached.remove(&h);
            }
            out.push(BlockId(i));
        }
        Some(out)
    }

    /// The block holding the content `hash`, in use or free.
    pub fn cached_block(&self, hash: &BlockHash) -> Option<BlockId> {
        self.cached.get(hash).map(|&i| BlockId(i))
    }

    /// The hash of a block's content, if it is cached.
    pub fn hash_of(&self, id: BlockId) -> Option<BlockHash> {
        self.blocks.get(id.0 as usize).and_then(|b| b.hash)
    }

    /// Blocks with a known content (in use or free).
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// Adds a holder to a cached block, taking it off the free list if it had none (a prefix hit
    /// revives it); an allocated block gains a reference as with [`BlockPool::incref`].
    pub fn touch(&mut self, id: BlockId) -> Result<(), PoolError> {
        let b = self.block_mut(id)?;
        if b.ref_count == 0 {
            if b.hash.is_none() {
                return Err(PoolError::NotAllocated(id));
            }
            self.unlink(id.0);
        }
        self.blocks[id.0 as usize].ref_count += 1;
        Ok(())
    }

    /// Records that an allocated, full block holds the content `hash`. Returns false and changes
    /// nothing when another block already holds that content (the block stays private) or the
    /// block is already hashed.
    pub fn set_hash(&mut self, id: BlockId, hash: BlockHash) -> Result<bool, PoolError> {
        let taken = self.cached.contains_key(&hash);
        let b = self.block_mut(id)?;
        if b.ref_count == 0 {
            return Err(PoolError::NotAllocated(id));
        }
        if b.hash.is_some() || taken {
            return Ok(false);
        }
        b.hash = Some(hash);
        self.cached.insert(hash, id.0);
        Ok(true)
    }

    /// Forgets every block's content (blocks in use stay in use); returns how many were cached.
    pub fn reset_cache(&mut self) -> usize {
        for b in &mut self.blocks {
            b.hash = None;
        }
        std::mem::take(&mut self.cached).len()
    }

    /// Adds a reference to an allocated block (sharing between sequences).
    pub fn incref(&mut self, id: BlockId) -> Result<(), PoolError> {
        let b = self.block_mut(id)?;
        if b.ref_count == 0 {
            return Err(PoolError::NotAllocated(id));
        }
        b.ref_count += 1;
        Ok(())
    }

    /// Drops a reference; the block returns to the tail of the free list when none remain.
    pub fn free(&mut self, id: BlockId) -> Result<(), PoolError> {
        let b = self.block_mut(id)?;
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
            if let Some(h) = b.hash {
                if self.cached.get(&h) != Some(&id.0) {
                    errs.push(format!("block {id}: hash {h:?} not mapped to it"));
                }
            }
        }
        for (h, &i) in &self.cached {
            if self.blocks.get(i as usize).and_then(|b| b.hash) != Some(*h) {
                errs.push(format!(
                    "cached hash {h:?} maps to block {i}, which lacks it"
                ));
            }
        }
        errs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    fn h(i: u8) -> BlockHash {
        BlockHash([i; 32])
    }

    #[test]
    fn freed_hashed_blocks_stay_cached_until_taken_for_new_content() {
        let mut p = BlockPool::new(4);
        let b = p.allocate(3).unwrap();
        assert_eq!(p.set_hash(b[0], h(1)), Ok(true));
        assert_eq!(p.set_hash(b[1], h(2)), Ok(true));
        // one content, one block: a second block with the same content stays private
        assert_eq!(p.set_hash(b[2], h(1)), Ok(false));
        assert_eq!(p.set_hash(b[0], h(3)), Ok(false), "already hashed");
        for &x in b.iter().rev() {
            p.free(x).unwrap();
        }
        assert_eq!(p.free_list(), ids(&[3, 2, 1, 0]));
        assert_eq!(p.cached_block(&h(1)), Some(b[0]));
        assert_eq!(p.num_cached(), 2);
        // a hit revives block 0 from the middle of the free list
        p.touch(b[0]).unwrap();
        assert_eq!(p.ref_count(b[0]), 1);
        assert_eq!(p.free_list(), ids(&[3, 2, 1]));
        // new content takes the head first: the never-hashed 3 and 2, then evicts 1
        assert_eq!(p.allocate(3), Some(ids(&[3, 2, 1])));
        assert_eq!(p.cached_block(&h(2)), None);
        assert_eq!(p.hash_of(b[1]), None);
        assert_eq!(p.cached_block(&h(1)), Some(b[0]));
        let held: HashMap<BlockId, u32> = ids(&[0, 1, 2, 3]).into_iter().map(|i| (i, 1)).collect();
        assert!(
            p.check_integrity(&held).is_empty(),
            "{:?}",
            p.check_integrity(&held)
        );
        // touching an allocated block adds a reference; a free block without content is an error
        p.touch(b[0]).unwrap();
        assert_eq!(p.ref_count(b[0]), 2);
        p.free(BlockId(3)).unwrap();
        assert_eq!(
            p.touch(BlockId(3)),
            Err(PoolError::NotAllocated(BlockId(3)))
        );
        assert_eq!(
            p.set_hash(BlockId(3), h(9)),
            Err(PoolError::NotAllocated(BlockId(3)))
        );
    }

    #[test]
    fn a_reset_forgets_every_content() {
        let mut p = BlockPool::new(2);
        let b = p.allocate(2).unwrap();
        p.set_hash(b[0], h(1)).unwrap();
        p.set_hash(b[1], h(2)).unwrap();
        p.free(b[1]).unwrap();
        assert_eq!(p.reset_cache(), 2);
        assert_eq!((p.cached_block(&h(1)), p.num_cached()), (None, 0));
        let held: HashMap<BlockId, u32> = [(b[0], 1)].into_iter().collect();
        assert!(p.check_integrity(&held).is_empty());
        assert_eq!(p.touch(b[1]), Err(PoolError::NotAllocated(b[1])));
    }

    #[test]
    fn empty_pool() {
        let mut p = BlockPool::new(0);
        assert_eq!(p.allocate(1), None);
        assert_eq!(p.allocate(0), Some(vec![]));
        assert_eq!(p.usage(), 0.0);
    }
}
