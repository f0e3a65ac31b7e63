//! Model-based property test of the block pool: random alloc / share / free / register /
//! revive / drop-cached sequences against a plain reference model (ref counts, hash map, LRU list), with
//! `check_integrity()` after every operation.
#![cfg(not(loom))]

use proptest::prelude::*;
use rust_scheduler::block_pool::{BlockPool, NULL_BLOCK};
use std::collections::{HashMap, VecDeque};

#[derive(Debug, Clone)]
enum Op {
    Alloc,
    Share(usize),
    Free(usize),
    Register(usize, u8),
    Revive(u8),
    DropCached,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => Just(Op::Alloc),
        1 => any::<usize>().prop_map(Op::Share),
        3 => any::<usize>().prop_map(Op::Free),
        2 => (any::<usize>(), 0..6u8).prop_map(|(i, h)| Op::Register(i, h)),
        1 => (0..6u8).prop_map(Op::Revive),
        1 => Just(Op::DropCached),
    ]
}

/// Reference: owners list (one entry per reference), hash per block, LRU of free cached blocks.
#[derive(Default)]
struct Model {
    owners: Vec<u32>,
    refs: HashMap<u32, u32>,
    hash_of: HashMap<u32, u128>,
    block_of: HashMap<u128, u32>,
    plain_free: usize,
    cached_lru: VecDeque<u32>,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]
    #[test]
    fn pool_matches_model(nb in 2..12usize, caching in any::<bool>(), ops in prop::collection::vec(op(), 1..120)) {
        let mut p = BlockPool::new(nb, caching);
        let mut m = Model { plain_free: nb - 1, ..Model::default() };
        for o in ops {
            match o {
                Op::Alloc => match p.alloc() {
                    None => prop_assert_eq!(m.plain_free + m.cached_lru.len(), 0),
                    Some(b) => {
                        prop_assert_ne!(b, NULL_BLOCK);
                        prop_assert_eq!(m.refs.get(&b).copied().unwrap_or(0), 0, "handed out a used block");
                        if m.plain_free > 0 {
                            prop_assert!(!m.hash_of.contains_key(&b), "evicted a cached block while plain ones were free");
                            m.plain_free -= 1;
                        } else {
                            prop_assert_eq!(m.cached_lru.pop_front(), Some(b), "eviction is not LRU");
                            let h = m.hash_of.remove(&b).unwrap();
                            m.block_of.remove(&h);
                        }
                        m.refs.insert(b, 1);
                        m.owners.push(b);
                    }
                },
                Op::Share(i) if !m.owners.is_empty() => {
                    let b = m.owners[i % m.owners.len()];
                    p.incref(b);
                    *m.refs.get_mut(&b).unwrap() += 1;
                    m.owners.push(b);
                }
                Op::Free(i) if !m.owners.is_empty() => {
                    let b = m.owners.swap_remove(i % m.owners.len());
                    p.decref(b);
                    let r = m.refs.get_mut(&b).unwrap();
                    *r -= 1;
                    if *r == 0 {
                        if m.hash_of.contains_key(&b) { m.cached_lru.push_back(b) } else { m.plain_free += 1 }
                    }
                }
                Op::Register(i, h) if !m.owners.is_empty() => {
                    let b = m.owners[i % m.owners.len()];
                    p.register(b, h as u128);
                    if caching && !m.hash_of.contains_key(&b) && !m.block_of.contains_key(&(h as u128)) {
                        m.hash_of.insert(b, h as u128);
                        m.block_of.insert(h as u128, b);
                    }
                }
                Op::Revive(h) => {
                    let got = p.lookup(h as u128);
                    prop_assert_eq!(got, m.block_of.get(&(h as u128)).copied());
                    if let Some(b) = got {
                        p.incref(b);
                        let r = m.refs.entry(b).or_insert(0);
                        if *r == 0 {
                            m.cached_lru.retain(|&x| x != b);
                        }
                        *r += 1;
                        m.owners.push(b);
                    }
                }
                Op::DropCached => {
                    prop_assert_eq!(p.drop_free_cached(), m.cached_lru.len());
                    for b in std::mem::take(&mut m.cached_lru) {
                        let h = m.hash_of.remove(&b).unwrap();
                        m.block_of.remove(&h);
                        m.plain_free += 1;
                    }
                }
                _ => {}
            }
            p.check_integrity().map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(p.num_free(), m.plain_free + m.cached_lru.len());
            prop_assert_eq!(p.num_cached_free(), m.cached_lru.len());
            for (&b, &r) in &m.refs {
                prop_assert_eq!(p.refcount(b), r);
            }
        }
        // Free everything: the pool is whole again, every refcount 0.
        for b in std::mem::take(&mut m.owners) {
            p.decref(b);
        }
        p.check_integrity().map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(p.num_free(), nb - 1);
        prop_assert_eq!(p.num_used(), 0);
    }
}
