//! Block tables: which blocks each sequence holds, growing them as tokens are scheduled, sharing
//! them between forked samples and copying a shared block before it is written (copy-on-write).
//!
//! Owns the `BlockPool` and one table per live sequence. Does not own tensors: copy-on-write is
//! returned as `(src, dst)` pairs for the model runner to apply before the forward pass.
//! Invariants: every block in a table holds one reference per table that lists it; a failed
//! allocation changes nothing.
//!
//! Prefix caching: a sequence's computed full blocks are registered with their content hashes
//! ([`KvCacheManager::cache_full_blocks`]); a new sequence starts its table with the longest run
//! of cached blocks matching its own hashes ([`KvCacheManager::cached_prefix`],
//! [`KvCacheManager::adopt_prefix`]) and computes only the rest. A registered block is full and
//! computed, so no later write (and no copy-on-write) touches it.

use super::block_pool::{BlockHash, BlockId, BlockPool, PoolError};
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
    /// How many leading blocks of each table were offered to the prefix cache.
    hashed: HashMap<SeqId, usize>,
}

impl KvCacheManager {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            block_size: block_size.max(1),
            pool: BlockPool::new(num_blocks),
            tables: HashMap::new(),
            hashed: HashMap::new(),
        }
    }

    /// The longest run of cached blocks holding the contents `hashes`, from the first.
    pub fn cached_prefix(&self, hashes: &[BlockHash]) -> Vec<BlockId> {
        hashes
            .iter()
            .map_while(|h| self.pool.cached_block(h))
            .collect()
    }

    /// Starts the table of `seq` with `prefix` (blocks from [`Self::cached_prefix`]): one more
    /// reference each, free ones taken off the free list. A table `seq` held is released first.
    /// All or nothing.
    pub fn adopt_prefix(&mut self, seq: SeqId, prefix: &[BlockId]) -> Result<(), PoolError> {
        self.free(seq);
        for (i, &b) in prefix.iter().enumerate() {
            if let Err(e) = self.pool.touch(b) {
                self.release(prefix[..i].to_vec());
                return Err(e);
            }
        }
        self.tables.insert(seq, prefix.to_vec());
        self.hashed.insert(seq, prefix.len());
        Ok(())
    }

    /// Registers the contents of the first `num_full` blocks of `seq` (full and computed),
    /// `hashes[i]` for block `i`; blocks offered before are skipped. A block whose content another
    /// block already holds stays private.
    pub fn cache_full_blocks(&mut self, seq: SeqId, hashes: &[BlockHash], num_full: usize) {
        let Some(table) = self.tables.get(&seq) else {
            return;
        };
        let done = self.hashed.entry(seq).or_default();
        let end = num_full.min(hashes.len()).min(table.len());
        for i in *done..end {
            // a block in a live table is allocated, so this cannot fail
            let _ = self.pool.set_hash(table[i], hashes[i]);
        }
        *done = (*done).max(end);
    }

    /// Forgets every cached content (blocks in use stay with their sequences); returns how many
    /// blocks were cached.
    pub fn reset_prefix_cache(&mut self) -> usize {
        self.pool.reset_cache()
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
        let hashed = self.hashed.get(&parent).copied().unwrap_or(0);
        self.hashed.insert(child, hashed);
    }

    /// Releases every block of `seq`, tail first: the free list's order is the eviction order,
    /// so a prefix's deeper blocks (shared by fewer requests) are evicted before its first ones.
    pub fn free(&mut self, seq: SeqId) {
        self.hashed.remove(&seq);
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

    fn hashes(n: u8) -> Vec<BlockHash> {
        (1..=n).map(|i| BlockHash([i; 32])).collect()
    }

    #[test]
    fn computed_blocks_are_found_by_content_and_shared() {
        let mut m = KvCacheManager::new(8, 4);
        let (s1, s2, s3) = (SeqId(1), SeqId(2), SeqId(3));
        let h = hashes(3);
        m.allocate_slots(s1, 0, 10).unwrap(); // blocks 0, 1 full, 2 partial
        m.cache_full_blocks(s1, &h[..2], 2);
        assert_eq!(m.cached_prefix(&h), b(&[0, 1]));
        // a second sequence with the same first block and a different second one
        let other = [h[0], BlockHash([9; 32])];
        let hit = m.cached_prefix(&other);
        assert_eq!(hit, b(&[0]));
        m.adopt_prefix(s2, &hit).unwrap();
        assert_eq!(m.allocate_slots(s2, 4, 5), Ok(vec![]));
        assert_eq!(m.block_table(s2), b(&[0, 3, 4]).as_slice());
        assert_eq!(m.pool().ref_count(BlockId(0)), 2);
        assert!(m.check_integrity().is_empty());
        // both end: the blocks stay cached on the free list, tail blocks first in line
        m.free(s1);
        m.free(s2);
        assert_eq!(m.num_free_blocks(), 8);
        assert_eq!(m.pool().free_list(), b(&[5, 6, 7, 2, 1, 4, 3, 0]));
        // a third sequence revives both cached blocks and computes the rest
        let hit = m.cached_prefix(&h);
        assert_eq!(hit, b(&[0, 1]));
        m.adopt_prefix(s3, &hit).unwrap();
        assert_eq!(m.allocate_slots(s3, 8, 4), Ok(vec![]));
        assert_eq!(m.block_table(s3), b(&[0, 1, 5]).as_slice());
        assert_eq!(m.pool().free_list(), b(&[6, 7, 2, 4, 3]));
        assert!(m.check_integrity().is_empty());
    }

    #[test]
    fn new_content_evicts_the_least_recently_freed_cached_blocks() {
        let mut m = KvCacheManager::new(4, 2);
        let h = hashes(4);
        m.allocate_slots(SeqId(1), 0, 8).unwrap();
        m.cache_full_blocks(SeqId(1), &h, 4);
        m.free(SeqId(1));
        assert_eq!(m.pool().free_list(), b(&[3, 2, 1, 0]));
        // two blocks of new content take 3 and 2: the prefix's first two blocks survive
        m.allocate_slots(SeqId(2), 0, 4).unwrap();
        assert_eq!(m.cached_prefix(&h), b(&[0, 1]));
        assert_eq!(m.pool().num_cached(), 2);
        assert!(m.check_integrity().is_empty());
    }

    #[test]
    fn an_adopted_prefix_is_given_back_when_the_rest_does_not_fit() {
        let mut m = KvCacheManager::new(3, 2);
        let h = hashes(1);
        m.allocate_slots(SeqId(1), 0, 2).unwrap();
        m.cache_full_blocks(SeqId(1), &h, 1);
        m.free(SeqId(1));
        let hit = m.cached_prefix(&h);
        m.adopt_prefix(SeqId(2), &hit).unwrap();
        assert_eq!(m.num_free_blocks(), 2);
        assert!(m.allocate_slots(SeqId(2), 2, 6).is_err());
        m.free(SeqId(2));
        assert_eq!(m.num_free_blocks(), 3);
        assert_eq!(m.cached_prefix(&h), b(&[0]), "still cached");
        assert!(m.check_integrity().is_empty());
        // a stale block id (evicted meanwhile) is refused with nothing changed
        m.allocate_slots(SeqId(3), 0, 6).unwrap();
        assert_eq!(
            m.adopt_prefix(SeqId(4), &[BlockId(1), BlockId(7)]),
            Err(PoolError::OutOfRange(BlockId(7)))
        );
        assert!(m.block_table(SeqId(4)).is_empty());
        assert!(m.check_integrity().is_empty());
    }

    #[test]
    fn duplicates_stay_private_and_a_reset_forgets_contents() {
        let mut m = KvCacheManager::new(4, 2);
        let h = hashes(1);
        // two sequences computed the same block side by side: the first one's is cached
        m.allocate_slots(SeqId(1), 0, 2).unwrap();
        m.allocate_slots(SeqId(2), 0, 2).unwrap();
        m.cache_full_blocks(SeqId(1), &h, 1);
        m.cache_full_blocks(SeqId(2), &h, 1);
        assert_eq!(m.cached_prefix(&h), b(&[0]));
        assert_eq!(m.pool().hash_of(BlockId(1)), None);
        // forks inherit what was offered: nothing is registered twice
        m.fork(SeqId(1), SeqId(3));
        m.cache_full_blocks(SeqId(3), &h, 1);
        assert_eq!(m.reset_prefix_cache(), 1);
        assert!(m.cached_prefix(&h).is_empty());
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
