//! Prefix-cache index: chained hashes of full blocks -> block ids, plus hit counters.
//!
//! The hash of full block `k` of a sequence is `xxh3_128(hash(k-1) || salt(k==0) || tokens)`,
//! so equal hashes mean (up to a negligible 2^-128 collision chance) the same whole prefix and
//! salt. Invariants (checked by `BlockPool::check_integrity`):
//! - each map entry `h -> b` has `pool.hash[b] == Some(h)`;
//! - every block with a hash is in the map (one block per hash).

use std::collections::HashMap;
use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

/// Hash of full block `index` of `tokens`, chained on `parent` (the previous block's hash).
pub fn block_hash(parent: Option<u128>, salt: u64, block: &[i32]) -> u128 {
    let mut buf = Vec::with_capacity(24 + block.len() * 4);
    match parent {
        Some(p) => buf.extend_from_slice(&p.to_le_bytes()),
        None => {
            buf.extend_from_slice(&[0xA5; 16]);
            buf.extend_from_slice(&salt.to_le_bytes());
        }
    }
    for t in block {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_128(&buf)
}

/// 64-bit digest of a cache salt (`0` = no salt).
pub fn salt_digest(salt: Option<&str>) -> u64 {
    match salt {
        None => 0,
        Some(s) => xxh3_64(s.as_bytes()) | 1,
    }
}

/// Extends `hashes` with the hashes of every full block of `tokens` not hashed yet,
/// up to (not including) block `limit_blocks`.
pub fn extend_hashes(
    hashes: &mut Vec<u128>,
    tokens: &[i32],
    block_size: usize,
    salt: u64,
    limit_blocks: usize,
) {
    let full = (tokens.len() / block_size).min(limit_blocks);
    while hashes.len() < full {
        let k = hashes.len();
        let parent = if k == 0 { None } else { Some(hashes[k - 1]) };
        hashes.push(block_hash(
            parent,
            salt,
            &tokens[k * block_size..(k + 1) * block_size],
        ));
    }
}

/// Map from block hash to the block holding it, with lookup statistics.
#[derive(Debug, Default)]
pub struct PrefixCache {
    map: HashMap<u128, u32>,
    /// Prompt tokens looked up (vLLM's `prefix_cache_queries`).
    pub queries_total: u64,
    /// Of those, tokens found cached (vLLM's `prefix_cache_hits`).
    pub hits_total: u64,
}

impl PrefixCache {
    /// Block holding `hash`, if cached.
    #[inline]
    pub fn get(&self, hash: u128) -> Option<u32> {
        self.map.get(&hash).copied()
    }

    /// Records `hash -> block`; returns false (and changes nothing) if the hash is already cached.
    #[inline]
    pub fn insert(&mut self, hash: u128, block: u32) -> bool {
        match self.map.entry(hash) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(block);
                true
            }
        }
    }

    /// Forgets `hash` (the block is being reused for something else).
    #[inline]
    pub fn remove(&mut self, hash: u128) -> Option<u32> {
        self.map.remove(&hash)
    }

    /// Number of cached hashes.
    #[inline]
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when nothing is cached.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// All entries (for integrity checks).
    pub fn iter(&self) -> impl Iterator<Item = (&u128, &u32)> {
        self.map.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_and_salt_change_hash() {
        let a = block_hash(None, 0, &[1, 2, 3, 4]);
        assert_eq!(a, block_hash(None, 0, &[1, 2, 3, 4]));
        assert_ne!(a, block_hash(None, salt_digest(Some("x")), &[1, 2, 3, 4]));
        assert_ne!(
            block_hash(Some(a), 0, &[5, 6, 7, 8]),
            block_hash(Some(a + 1), 0, &[5, 6, 7, 8])
        );
        assert_ne!(salt_digest(Some("a")), salt_digest(Some("b")));
        let mut h = Vec::new();
        extend_hashes(&mut h, &[1, 2, 3, 4, 5, 6, 7, 8, 9], 4, 0, usize::MAX);
        assert_eq!(h.len(), 2);
        assert_eq!(h[0], a);
        extend_hashes(&mut h, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4, 0, 2);
        assert_eq!(h.len(), 2);
    }

    #[test]
    fn insert_is_first_wins() {
        let mut c = PrefixCache::default();
        assert!(c.insert(7, 1));
        assert!(!c.insert(7, 2));
        assert_eq!(c.get(7), Some(1));
        assert_eq!(c.remove(7), Some(1));
        assert!(c.is_empty());
    }
}
