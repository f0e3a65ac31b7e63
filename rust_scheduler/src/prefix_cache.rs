//! Prefix-cache index: chained hashes of full blocks -> block ids, plus hit counters.
//!
//! The hash of full block `k` of a sequence is `xxh3_128(hash(k-1) || salt(k==0) || tokens)`,
//! so equal hashes mean (up to a negligible 2^-128 collision chance) the same whole prefix and
//! salt. Invariants (checked by `BlockPool::check_integrity`):
//! - each map entry `h -> b` has `pool.hash[b] == Some(h)`;
//! - every block with a hash is in the map (one block per hash).

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

/// Hash of full block `index` of `tokens`, chained on `parent` (the previous block's hash).
pub fn block_hash(parent: Option<u128>, salt: u64, block: &[i32]) -> u128 {
    // Hashed bytes: parent (16) or marker + salt (24), then the tokens (little endian). Blocks
    // of up to 64 tokens are laid out on the stack (no allocation on the step path).
    const STACK_TOKENS: usize = 64;
    let mut stack = [0u8; 24 + 4 * STACK_TOKENS];
    let mut heap = Vec::new();
    let buf: &mut [u8] = if block.len() <= STACK_TOKENS {
        &mut stack[..24 + 4 * block.len()]
    } else {
        heap.resize(24 + 4 * block.len(), 0);
        &mut heap
    };
    let head = match parent {
        Some(p) => {
            buf[..16].copy_from_slice(&p.to_le_bytes());
            16
        }
        None => {
            buf[..16].fill(0xA5);
            buf[16..24].copy_from_slice(&salt.to_le_bytes());
            24
        }
    };
    let len = head + 4 * block.len();
    for (dst, t) in buf[head..len].chunks_exact_mut(4).zip(block) {
        dst.copy_from_slice(&t.to_le_bytes());
    }
    xxh3_128(&buf[..len])
}

/// 64-bit digest of a cache salt (`0` = no salt).
pub fn salt_digest(salt: Option<&str>) -> u64 {
    match salt {
        None => 0,
        Some(s) => xxh3_64(s.as_bytes()) | 1,
    }
}

/// The salt a sequence's block hashes use: its request's (`salt_digest`), and from cache epoch
/// 1 on the epoch too (a 64-bit hash of both: different pairs collide as unlikely as any
/// two salts).
pub fn hash_salt(salt: u64, epoch: u64) -> u64 {
    if epoch == 0 {
        return salt;
    }
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&salt.to_le_bytes());
    buf[8..].copy_from_slice(&epoch.to_le_bytes());
    xxh3_64(&buf) | 1
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

/// Hasher for the map's keys, which are already xxh3 digests: one folded multiply of the key
/// with per-process random seeds (so crafted prompts cannot aim at buckets) instead of SipHash.
#[derive(Debug, Clone)]
pub struct DigestHasherBuilder {
    k0: u64,
    k1: u64,
}

impl Default for DigestHasherBuilder {
    fn default() -> Self {
        let r = std::collections::hash_map::RandomState::new();
        DigestHasherBuilder {
            k0: r.hash_one(0x5EED_u64) | 1,
            k1: r.hash_one(0xC0DE_u64),
        }
    }
}

impl BuildHasher for DigestHasherBuilder {
    type Hasher = DigestHasher;
    #[inline]
    fn build_hasher(&self) -> DigestHasher {
        DigestHasher {
            k0: self.k0,
            k1: self.k1,
            h: 0,
        }
    }
}

/// See [`DigestHasherBuilder`].
#[derive(Debug)]
pub struct DigestHasher {
    k0: u64,
    k1: u64,
    h: u64,
}

impl Hasher for DigestHasher {
    #[inline]
    fn write_u128(&mut self, v: u128) {
        let m = ((v as u64) ^ self.k0) as u128 * (((v >> 64) as u64) ^ self.k1) as u128;
        self.h ^= (m as u64) ^ ((m >> 64) as u64);
    }

    fn write(&mut self, bytes: &[u8]) {
        // Not used by `u128` keys; kept correct for any other input.
        for c in bytes.chunks(16) {
            let mut b = [0u8; 16];
            b[..c.len()].copy_from_slice(c);
            self.write_u128(u128::from_le_bytes(b) ^ self.h as u128);
        }
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.h
    }
}

/// Map from block hash to the block holding it, with lookup statistics.
#[derive(Debug, Default)]
pub struct PrefixCache {
    map: HashMap<u128, u32, DigestHasherBuilder>,
    /// Prompt tokens looked up on first admissions (vLLM's `prefix_cache_queries`; vLLM counts
    /// preempted re-admissions apart, here they are not counted).
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

    /// The allocation-free `block_hash` hashes exactly the bytes of the original layout.
    #[test]
    fn block_hash_matches_reference_layout() {
        fn reference(parent: Option<u128>, salt: u64, block: &[i32]) -> u128 {
            let mut buf = Vec::new();
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
        for len in [1usize, 4, 16, 63, 64, 65, 200] {
            let block: Vec<i32> = (0..len as i32).map(|k| k * 7919 - 3).collect();
            for parent in [None, Some(0x1234_5678_9abc_def0_u128 << 40)] {
                for salt in [0, salt_digest(Some("s"))] {
                    assert_eq!(
                        block_hash(parent, salt, &block),
                        reference(parent, salt, &block)
                    );
                }
            }
        }
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
