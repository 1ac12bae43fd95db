//! Block tables: which blocks each sequence holds, growing them as tokens are scheduled, sharing
//! them between forked samples and copying a shared block before it is written (copy-on-write).
//!
//! Owns the `BlockPool` and one table per live sequence. Does not own tensors: copy-on-write is
//! returned as `(src, dst)` pairs for the model runner to apply before the forward pass.
//! Invariants: every block in a table holds one reference per table that lists it; a failed
//! allocation changes nothing.

use super::block_pool::{BlockId, BlockPool};
use crate::sequence::SeqId;
use std::collections::HashMap;

/// Not enough free blocks for the requested slots (nothing was changed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("not enough free KV blocks: need {needed}, {free} free")]
pub struct NoFreeBlocks {
    pub needed: usize,
    pub free: usize,
}

/// Per-sequence block tables over one pool.
#[derive(Debug, Clone)]
pub struct KvCacheManager {
    block_size: usize,
    pool: BlockPool,
    tables: HashMap<SeqId, Vec<BlockId>>,
}

impl KvCacheManager {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            block_size: block_size.max(1),
            pool: BlockPool::new(num_blocks),
            tables: HashMap::new(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free()
    }

    /// Fraction of blocks in use.
    pub fn usage(&self) -> f64 {
        self.pool.usage()
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Blocks needed to hold `num_tokens` tokens.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// The sequence's block table (empty if it holds none).
    pub fn block_table(&self, seq: SeqId) -> &[BlockId] {
        self.tables.get(&seq).map_or(&[], |t| t.as_slice())
    }

    /// Makes room to write tokens `[num_computed, num_computed + num_new)` of `seq`: appends blocks
    /// and replaces shared blocks in the written range by private copies. Returns the copies
    /// `(src, dst)` the runner must perform before writing, or `NoFreeBlocks` with nothing changed.
    pub fn allocate_slots(
        &mut self,
        seq: SeqId,
        num_computed: usize,
        num_new: usize,
    ) -> Result<Vec<(BlockId, BlockId)>, NoFreeBlocks> {
        let total = num_computed + num_new;
        let needed_blocks = self.blocks_for(total);
        let table = self.tables.get(&seq).map_or(&[][..], |t| t.as_slice());
        let have = table.len();
        let mut shared = Vec::new();
        if num_new > 0 {
            let first = num_computed / self.block_size;
            let last = (total - 1) / self.block_size;
            for (i, b) in table.iter().enumerate().take(last + 1).skip(first) {
                if self.pool.ref_count(*b) > 1 {
                    shared.push(i);
                }
            }
        }
        let new_blocks = needed_blocks.saturating_sub(have);
        let needed = new_blocks + shared.len();
        let fresh = self.pool.allocate(needed).ok_or(NoFreeBlocks {
            needed,
            free: self.pool.num_free(),
        })?;
        let mut fresh = fresh.into_iter();
        let table = self.tables.entry(seq).or_default();
        let mut copies = Vec::with_capacity(shared.len());
        for i in shared {
            if let Some(dst) = fresh.next() {
                let src = table[i];
                // src keeps at least one other holder, so this never frees it
                let _ = self.pool.free(src);
                table[i] = dst;
                copies.push((src, dst));
            }
        }
        table.extend(fresh);
        Ok(copies)
    }

    /// Gives `child` the same blocks as `parent` (one more reference each).
    pub fn fork(&mut self, parent: SeqId, child: SeqId) {
        let table = self.tables.get(&parent).cloned().unwrap_or_default();
        for b in &table {
            // blocks in a live table are allocated, so this cannot fail
            let _ = self.pool.incref(*b);
        }
        if let Some(old) = self.tables.insert(child, table) {
            self.release(old);
        }
    }

    /// Releases every block of `seq` (tail first, so the last-written blocks are reused last).
    pub fn free(&mut self, seq: SeqId) {
        if let Some(table) = self.tables.remove(&seq) {
            self.release(table);
        }
    }

    fn release(&mut self, table: Vec<BlockId>) {
        for b in table.into_iter().rev() {
            let _ = self.pool.free(b);
        }
    }

    /// Every inconsistency between the tables and the pool (empty when sound): leaked blocks,
    /// double frees, shared blocks whose count does not match their holders.
    pub fn check_integrity(&self) -> Vec<String> {
        let mut holders: HashMap<BlockId, u32> = HashMap::new();
        for t in self.tables.values() {
            for b in t {
                *holders.entry(*b).or_default() += 1;
            }
        }
        self.pool.check_integrity(&holders)
    }

    /// Number of sequences holding blocks.
    pub fn num_tables(&self) -> usize {
        self.tables.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(v: &[u32]) -> Vec<BlockId> {
        v.iter().map(|&i| BlockId(i)).collect()
    }

    #[test]
    fn grows_tables_block_by_block() {
        let mut m = KvCacheManager::new(8, 4);
        let s = SeqId(1);
        assert_eq!(m.allocate_slots(s, 0, 6), Ok(vec![]));
        assert_eq!(m.block_table(s), b(&[0, 1]).as_slice());
        assert_eq!(m.allocate_slots(s, 6, 2), Ok(vec![]));
        assert_eq!(m.block_table(s), b(&[0, 1]).as_slice());
        assert_eq!(m.allocate_slots(s, 8, 1), Ok(vec![]));
        assert_eq!(m.block_table(s), b(&[0, 1, 2]).as_slice());
        assert!(m.check_integrity().is_empty());
        m.free(s);
        assert_eq!(m.num_free_blocks(), 8);
        // freed tail first: 2, 1, 0 go to the back of the list after 3..7
        assert_eq!(m.pool().free_list(), b(&[3, 4, 5, 6, 7, 2, 1, 0]));
        assert!(m.check_integrity().is_empty());
    }

    #[test]
    fn failed_allocation_changes_nothing() {
        let mut m = KvCacheManager::new(3, 4);
        m.allocate_slots(SeqId(1), 0, 8).unwrap();
        let err = m.allocate_slots(SeqId(2), 0, 9).unwrap_err();
        assert_eq!(err, NoFreeBlocks { needed: 3, free: 1 });
        assert!(m.block_table(SeqId(2)).is_empty());
        assert_eq!(m.num_free_blocks(), 1);
        assert!(m.check_integrity().is_empty());
    }

    #[test]
    fn fork_shares_and_copy_on_write_splits_the_partial_block() {
        let mut m = KvCacheManager::new(8, 4);
        let (p, c) = (SeqId(1), SeqId(2));
        m.allocate_slots(p, 0, 6).unwrap(); // blocks 0, 1; block 1 holds 2 of 4 tokens
        m.fork(p, c);
        assert_eq!(m.pool().ref_count(BlockId(0)), 2);
        assert_eq!(m.pool().ref_count(BlockId(1)), 2);
        assert!(m.check_integrity().is_empty());
        // the child writes token 6 into shared block 1: it gets a copy
        assert_eq!(
            m.allocate_slots(c, 6, 1),
            Ok(vec![(BlockId(1), BlockId(2))])
        );
        assert_eq!(m.block_table(c), b(&[0, 2]).as_slice());
        // the parent now holds block 1 alone: no copy
        assert_eq!(m.allocate_slots(p, 6, 1), Ok(vec![]));
        assert_eq!(m.block_table(p), b(&[0, 1]).as_slice());
        assert_eq!(m.pool().ref_count(BlockId(0)), 2);
        assert!(m.check_integrity().is_empty());
        m.free(p);
        assert_eq!(m.pool().ref_count(BlockId(0)), 1);
        m.free(c);
        assert_eq!(m.num_free_blocks(), 8);
        assert!(m.check_integrity().is_empty());
    }

    #[test]
    fn copy_on_write_needs_a_free_block() {
        let mut m = KvCacheManager::new(2, 4);
        m.allocate_slots(SeqId(1), 0, 6).unwrap();
        m.fork(SeqId(1), SeqId(2));
        assert_eq!(
            m.allocate_slots(SeqId(2), 6, 1),
            Err(NoFreeBlocks { needed: 1, free: 0 })
        );
        assert!(m.check_integrity().is_empty());
    }

    #[test]
    fn full_shared_blocks_are_not_copied() {
        let mut m = KvCacheManager::new(4, 4);
        m.allocate_slots(SeqId(1), 0, 8).unwrap();
        m.fork(SeqId(1), SeqId(2));
        assert_eq!(m.allocate_slots(SeqId(2), 8, 1), Ok(vec![]));
        assert_eq!(m.block_table(SeqId(2)), b(&[0, 1, 2]).as_slice());
        assert!(m.check_integrity().is_empty());
    }
}
