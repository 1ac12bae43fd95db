//! The content hashes of a sequence's full KV blocks, for the prefix cache (vLLM v1's scheme):
//! block `i` hashes block `i - 1`'s hash and its own token ids, and the chain starts from a root
//! that hashes the request's extra keys (its LoRA adapter and its `cache_salt`), so equal tokens
//! under another adapter or salt never meet. A block holding any token of an image also hashes
//! that image's content hash (its placeholder tokens are the same for every image), so a prompt
//! with another image shares blocks only up to the first image. Only full blocks of known tokens
//! are hashed.

use super::block_pool::BlockHash;
use sha2::{Digest, Sha256};

/// What besides the tokens makes a block's content: the adapter whose weights computed the keys
/// and values, and a tenant's salt.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExtraKeys<'a> {
    pub adapter: Option<u32>,
    pub salt: Option<&'a str>,
}

/// An image's tokens in a prompt and the hash of its content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageKey {
    pub offset: usize,
    pub len: usize,
    pub hash: [u8; 32],
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

/// The hash of a full block of `tokens` whose predecessor has `parent`, with the content hashes
/// of the images whose tokens it holds.
pub fn block_hash(parent: &BlockHash, tokens: &[u32], images: &[[u8; 32]]) -> BlockHash {
    let mut h = Sha256::new();
    h.update(parent.0);
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    for i in images {
        h.update(b"img");
        h.update(i);
    }
    BlockHash(h.finalize().into())
}

/// Extends `hashes` (those of the first full blocks of `tokens`) to every full block of `tokens`;
/// `images` are the prompt's images.
pub fn extend_hashes(
    hashes: &mut Vec<BlockHash>,
    root: &BlockHash,
    tokens: &[u32],
    images: &[ImageKey],
    block_size: usize,
) {
    let bs = block_size.max(1);
    let full = tokens.len() / bs;
    while hashes.len() < full {
        let i = hashes.len();
        let parent = hashes.last().copied().unwrap_or(*root);
        let (start, end) = (i * bs, (i + 1) * bs);
        let keys: Vec<[u8; 32]> = images
            .iter()
            .filter(|k| k.offset < end && k.offset + k.len > start)
            .map(|k| k.hash)
            .collect();
        hashes.push(block_hash(&parent, &tokens[start..end], &keys));
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
        extend_hashes(&mut a, &root, &toks, &[], 4);
        assert_eq!(a.len(), 2, "the partial third block is not hashed");
        // incremental extension gives the same chain
        let mut b = Vec::new();
        extend_hashes(&mut b, &root, &toks[..5], &[], 4);
        extend_hashes(&mut b, &root, &toks, &[], 4);
        assert_eq!(a, b);
        // a block's hash depends on every earlier token
        let mut other = toks.clone();
        other[0] = 99;
        let mut c = Vec::new();
        extend_hashes(&mut c, &root, &other, &[], 4);
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
            extend_hashes(&mut d, &r, &toks, &[], 4);
            assert!(d.iter().zip(&a).all(|(x, y)| x != y), "{keys:?}");
        }
        // an image changes the blocks holding its tokens and every later one, not earlier ones
        let img = |hash: u8| ImageKey {
            offset: 5,
            len: 2,
            hash: [hash; 32],
        };
        let (mut e, mut f) = (Vec::new(), Vec::new());
        extend_hashes(&mut e, &root, &toks, &[img(1)], 4);
        extend_hashes(&mut f, &root, &toks, &[img(2)], 4);
        assert_eq!(e[0], a[0]);
        assert_ne!(e[1], a[1]);
        assert_ne!(e[1], f[1]);
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
