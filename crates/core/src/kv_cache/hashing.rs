//! The content hashes of a sequence's full KV blocks, for the prefix cache (vLLM v1's scheme):
//! block `i` hashes block `i - 1`'s hash and its own token ids, and the chain starts from a root
//! that hashes the request's extra keys (its LoRA adapter and its `cache_salt`), so equal tokens
//! under another adapter or salt never meet. Only full blocks of known tokens are hashed.

use super::block_pool::BlockHash;
use sha2::{Digest, Sha256};

/// What besides the tokens makes a block's content: the adapter whose weights computed the keys
/// and values, and a tenant's salt.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExtraKeys<'a> {
    pub adapter: Option<u32>,
    pub salt: Option<&'a str>,
}

/// The hash a sequence's first block chains from.
pub fn root_hash(keys: &ExtraKeys<'_>) -> BlockHash {
    let mut h = Sha256::new();
    h.update(b"rserve-kv-root-v1");
    match keys.adapter {
        Some(a) => {
            h.update([1]);
            h.update(a.to_le_bytes());
        }
        None => h.update([0]),
    }
    match keys.salt {
        Some(s) => {
            h.update([1]);
            h.update((s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        }
        None => h.update([0]),
    }
    BlockHash(h.finalize().into())
}

/// The hash of a full block of `tokens` whose predecessor has `parent`.
pub fn block_hash(parent: &BlockHash, tokens: &[u32]) -> BlockHash {
    let mut h = Sha256::new();
    h.update(parent.0);
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    BlockHash(h.finalize().into())
}

/// Extends `hashes` (those of the first full blocks of `tokens`) to every full block of `tokens`.
pub fn extend_hashes(
    hashes: &mut Vec<BlockHash>,
    root: &BlockHash,
    tokens: &[u32],
    block_size: usize,
) {
    let bs = block_size.max(1);
    let full = tokens.len() / bs;
    while hashes.len() < full {
        let i = hashes.len();
        let parent = hashes.last().copied().unwrap_or(*root);
        hashes.push(block_hash(&parent, &tokens[i * bs..(i + 1) * bs]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_chain_over_full_blocks_and_extra_keys() {
        let root = root_hash(&ExtraKeys::default());
        let toks: Vec<u32> = (0..10).collect();
        let mut a = Vec::new();
        extend_hashes(&mut a, &root, &toks, 4);
        assert_eq!(a.len(), 2, "the partial third block is not hashed");
        // incremental extension gives the same chain
        let mut b = Vec::new();
        extend_hashes(&mut b, &root, &toks[..5], 4);
        extend_hashes(&mut b, &root, &toks, 4);
        assert_eq!(a, b);
        // a block's hash depends on every earlier token
        let mut other = toks.clone();
        other[0] = 99;
        let mut c = Vec::new();
        extend_hashes(&mut c, &root, &other, 4);
        assert_ne!(a[0], c[0]);
        assert_ne!(a[1], c[1]);
        // an adapter or a salt changes every block
        for keys in [
            ExtraKeys {
                adapter: Some(0),
                salt: None,
            },
            ExtraKeys {
                adapter: None,
                salt: Some(""),
            },
            ExtraKeys {
                adapter: None,
                salt: Some("tenant"),
            },
        ] {
            let r = root_hash(&keys);
            assert_ne!(r, root, "{keys:?}");
            let mut d = Vec::new();
            extend_hashes(&mut d, &r, &toks, 4);
            assert!(d.iter().zip(&a).all(|(x, y)| x != y), "{keys:?}");
        }
        assert_ne!(
            root_hash(&ExtraKeys {
                adapter: Some(1),
                salt: None
            }),
            root_hash(&ExtraKeys {
                adapter: Some(2),
                salt: None
            })
        );
    }
}
