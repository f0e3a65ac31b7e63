//! The paged KV block pool: a flat array of blocks, an index-linked free list, ref counts,
//! and the prefix-cache index of which free or used blocks hold a reusable full block.
//!
//! Invariants (checked by [`BlockPool::check_integrity`]):
//! - block 0 is the null block: never in the free list, never handed out, ref count 0;
//! - every other block is either in the free list (ref count 0) or used (ref count > 0);
//! - free = free blocks without a hash, cached = free blocks with a hash, and
//!   free + cached + used == num_blocks - 1;
//! - a block carries a hash iff the prefix cache maps that hash to it.
//!
//! Free-list order is the eviction order: `alloc` takes from the head. Freed blocks without a
//! hash go to the head (reused first); freed cached blocks go to the tail, so cached blocks are
//! evicted least-recently-freed first (LRU). All operations are O(1).

use crate::error::IntegrityError;
use crate::prefix_cache::PrefixCache;

const NIL: u32 = u32::MAX;

/// The null block id (padding in block tables).
pub const NULL_BLOCK: u32 = 0;

/// Fixed-size pool of KV blocks with ref counts and an LRU free list.
#[derive(Debug)]
pub struct BlockPool {
    refcnt: Vec<u32>,
    hash: Vec<Option<u128>>,
    prev: Vec<u32>,
    next: Vec<u32>,
    in_free: Vec<bool>,
    head: u32,
    tail: u32,
    num_free: usize,
    num_cached_free: usize,
    caching: bool,
    /// Hash -> block index and hit counters.
    pub cache: PrefixCache,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks (block 0 reserved); all usable blocks start free.
    pub fn new(num_blocks: usize, enable_prefix_caching: bool) -> Self {
        assert!(
            num_blocks >= 2 && num_blocks < NIL as usize,
            "num_blocks out of range"
        );
        let mut p = BlockPool {
            refcnt: vec![0; num_blocks],
            hash: vec![None; num_blocks],
            prev: vec![NIL; num_blocks],
            next: vec![NIL; num_blocks],
            in_free: vec![false; num_blocks],
            head: NIL,
            tail: NIL,
            num_free: 0,
            num_cached_free: 0,
            caching: enable_prefix_caching,
            cache: PrefixCache::default(),
        };
        for b in 1..num_blocks as u32 {
            p.push_back(b);
        }
        p
    }

    /// Total blocks including the null block.
    #[inline]
    pub fn num_blocks(&self) -> usize {
        self.refcnt.len()
    }

    /// Blocks available to `alloc` (plain free + evictable cached).
    #[inline]
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// Free blocks that still hold a reusable cached block.
    #[inline]
    pub fn num_cached_free(&self) -> usize {
        self.num_cached_free
    }

    /// Blocks with ref count > 0.
    #[inline]
    pub fn num_used(&self) -> usize {
        self.num_blocks() - 1 - self.num_free
    }

    /// Whether prefix caching is on.
    #[inline]
    pub fn caching(&self) -> bool {
        self.caching
    }

    /// Ref count of `b`.
    #[inline]
    pub fn refcount(&self, b: u32) -> u32 {
        self.refcnt[b as usize]
    }

    /// Hash carried by `b`, if it is a cached full block.
    #[inline]
    pub fn block_hash(&self, b: u32) -> Option<u128> {
        self.hash[b as usize]
    }

    fn unlink(&mut self, b: u32) {
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[b as usize] = NIL;
        self.next[b as usize] = NIL;
        self.in_free[b as usize] = false;
        self.num_free -= 1;
        if self.hash[b as usize].is_some() {
            self.num_cached_free -= 1;
        }
    }

    fn push_back(&mut self, b: u32) {
        self.prev[b as usize] = self.tail;
        self.next[b as usize] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.mark_free(b);
    }

    fn push_front(&mut self, b: u32) {
        self.next[b as usize] = self.head;
        self.prev[b as usize] = NIL;
        if self.head == NIL {
            self.tail = b;
        } else {
            self.prev[self.head as usize] = b;
        }
        self.head = b;
        self.mark_free(b);
    }

    fn mark_free(&mut self, b: u32) {
        self.in_free[b as usize] = true;
        self.num_free += 1;
        if self.hash[b as usize].is_some() {
            self.num_cached_free += 1;
        }
    }

    /// Takes the head of the free list (evicting its cached hash, if any); ref count becomes 1.
    pub fn alloc(&mut self) -> Option<u32> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.unlink(b);
        if let Some(h) = self.hash[b as usize].take() {
            let removed = self.cache.remove(h);
            debug_assert_eq!(removed, Some(b));
        }
        debug_assert_eq!(self.refcnt[b as usize], 0);
        self.refcnt[b as usize] = 1;
        Some(b)
    }

    /// Adds an owner to a used block, or revives a free cached block (prefix hit).
    pub fn incref(&mut self, b: u32) {
        debug_assert_ne!(b, NULL_BLOCK);
        if self.refcnt[b as usize] == 0 {
            debug_assert!(self.in_free[b as usize]);
            self.unlink(b);
        }
        self.refcnt[b as usize] += 1;
    }

    /// Drops an owner; the last owner returns the block to the free list (cached blocks stay
    /// reusable until evicted).
    pub fn decref(&mut self, b: u32) {
        debug_assert_ne!(b, NULL_BLOCK);
        debug_assert!(self.refcnt[b as usize] > 0, "double free of block {b}");
        self.refcnt[b as usize] -= 1;
        if self.refcnt[b as usize] == 0 {
            if self.hash[b as usize].is_some() {
                self.push_back(b);
            } else {
                self.push_front(b);
            }
        }
    }

    /// Marks used block `b` as holding the full block with hash `h` (no-op when caching is off,
    /// when `b` already has a hash, or when another block already holds `h`).
    pub fn register(&mut self, b: u32, h: u128) {
        debug_assert!(self.refcnt[b as usize] > 0);
        if self.caching && self.hash[b as usize].is_none() && self.cache.insert(h, b) {
            self.hash[b as usize] = Some(h);
        }
    }

    /// Forgets every free block's cached content: their hashes leave the prefix cache and
    /// they become plain free blocks (used blocks keep theirs: running sequences share them).
    /// Returns how many blocks were dropped. O(free blocks).
    pub fn drop_free_cached(&mut self) -> usize {
        let mut dropped = 0;
        let mut b = self.head;
        while b != NIL {
            if let Some(h) = self.hash[b as usize].take() {
                let removed = self.cache.remove(h);
                debug_assert_eq!(removed, Some(b));
                self.num_cached_free -= 1;
                dropped += 1;
            }
            b = self.next[b as usize];
        }
        dropped
    }

    /// Block holding hash `h`, if cached (used or free).
    #[inline]
    pub fn lookup(&self, h: u128) -> Option<u32> {
        if self.caching {
            self.cache.get(h)
        } else {
            None
        }
    }

    /// Verifies the pool's own invariants (see the module header).
    pub fn check_integrity(&self) -> Result<(), IntegrityError> {
        let err = |m: String| Err(IntegrityError(m));
        let n = self.num_blocks();
        if self.refcnt[0] != 0 || self.in_free[0] || self.hash[0].is_some() {
            return err("null block 0 is in use, free or cached".into());
        }
        let (mut count, mut cached, mut prev, mut b) = (0usize, 0usize, NIL, self.head);
        while b != NIL {
            count += 1;
            if count > n {
                return err("free list has a cycle".into());
            }
            if b == NULL_BLOCK || b as usize >= n {
                return err(format!("free list holds invalid block {b}"));
            }
            if !self.in_free[b as usize] || self.refcnt[b as usize] != 0 {
                return err(format!(
                    "free block {b} has refcount {} / flag off",
                    self.refcnt[b as usize]
                ));
            }
            if self.prev[b as usize] != prev {
                return err(format!("free list back link broken at block {b}"));
            }
            cached += self.hash[b as usize].is_some() as usize;
            prev = b;
            b = self.next[b as usize];
        }
        if prev != self.tail {
            return err("free list tail is wrong".into());
        }
        if count != self.num_free || cached != self.num_cached_free {
            return err(format!(
                "free list has {count} blocks ({cached} cached) but counters say {} ({})",
                self.num_free, self.num_cached_free
            ));
        }
        let mut used = 0;
        for b in 1..n {
            if self.refcnt[b] > 0 {
                used += 1;
                if self.in_free[b] {
                    return err(format!("used block {b} is also in the free list"));
                }
            } else if !self.in_free[b] {
                return err(format!("block {b} has refcount 0 but is not free (leaked)"));
            }
            if let Some(h) = self.hash[b] {
                if self.cache.get(h) != Some(b as u32) {
                    return err(format!(
                        "block {b} carries a hash the prefix cache does not map to it"
                    ));
                }
            }
        }
        let plain_free = self.num_free - self.num_cached_free;
        if plain_free + self.num_cached_free + used != n - 1 {
            return err(format!(
                "free {plain_free} + cached {} + used {used} != {}",
                self.num_cached_free,
                n - 1
            ));
        }
        for (&h, &b) in self.cache.iter() {
            if b as usize >= n || self.hash[b as usize] != Some(h) {
                return err(format!(
                    "prefix cache maps a hash to block {b} which does not carry it"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_free_and_null_block() {
        let mut p = BlockPool::new(4, true);
        assert_eq!(p.num_free(), 3);
        let a: Vec<u32> = (0..3).map(|_| p.alloc().unwrap()).collect();
        assert!(!a.contains(&NULL_BLOCK));
        assert!(p.alloc().is_none());
        p.check_integrity().unwrap();
        for &b in &a {
            p.decref(b);
        }
        assert_eq!(p.num_free(), 3);
        p.check_integrity().unwrap();
    }

    #[test]
    fn shared_block_freed_by_last_owner() {
        let mut p = BlockPool::new(3, true);
        let b = p.alloc().unwrap();
        p.incref(b);
        p.decref(b);
        assert_eq!(p.num_used(), 1);
        p.decref(b);
        assert_eq!(p.num_used(), 0);
        p.check_integrity().unwrap();
    }

    #[test]
    fn cached_blocks_evicted_lru_and_revivable() {
        let mut p = BlockPool::new(4, true);
        let (a, b, c) = (p.alloc().unwrap(), p.alloc().unwrap(), p.alloc().unwrap());
        p.register(a, 10);
        p.register(b, 20);
        p.decref(a); // cached, tail
        p.decref(b); // cached, tail (after a)
        p.decref(c); // plain, head
        assert_eq!(p.num_cached_free(), 2);
        // prefix hit on b revives it
        assert_eq!(p.lookup(20), Some(b));
        p.incref(b);
        assert_eq!(p.refcount(b), 1);
        // next allocs: plain c first, then evict a (LRU)
        assert_eq!(p.alloc(), Some(c));
        assert_eq!(p.alloc(), Some(a));
        assert_eq!(p.lookup(10), None);
        assert_eq!(p.lookup(20), Some(b));
        p.check_integrity().unwrap();
    }

    #[test]
    fn caching_off_never_registers() {
        let mut p = BlockPool::new(3, false);
        let a = p.alloc().unwrap();
        p.register(a, 1);
        assert_eq!(p.lookup(1), None);
        p.decref(a);
        assert_eq!(p.num_cached_free(), 0);
        p.check_integrity().unwrap();
    }
}
