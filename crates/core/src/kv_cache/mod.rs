//! The paged KV cache: a pool of fixed-size blocks (pure bookkeeping), per-sequence block tables
//! (pure bookkeeping) and the tensors that hold the keys and values.
//!
//! `block_pool` and `manager` work on integer ids only (no tensors, no locks) so that their unit
//! tests assert exact block ids; `tensors` owns the device memory they describe. `hashing` names
//! a full block's content for the prefix cache.

pub mod block_pool;
pub mod hashing;
pub mod manager;
pub mod tensors;

pub use block_pool::{BlockHash, BlockId, BlockPool, PoolError};
pub use manager::{KvCacheManager, NoFreeBlocks};
pub use tensors::{KvCache, KvCacheDtype, LayerKv};
