//! Test harness: a fake model runner that keeps a simulated KV cache (token, position per slot)
//! and samples from the context it *reads back through the block tables*, plus the reference
//! generator that the scheduler's outputs must match. If block tables, slot mapping, prefix
//! hits or copy-on-write were wrong, the context read back would differ and so would outputs.
#![allow(dead_code)]

use rust_scheduler::{Scheduler, StepBatch};

/// Deterministic "model": next token from the whole context and the sequence index. A
/// `local` model copies: it repeats what followed the last earlier occurrence of the last
/// token (hashing only that token when it is new), so prompt-lookup drafts are often right
/// (with the whole context hashed, most drafts are wrong).
pub fn model(ctx: &[i32], seq_index: i32, vocab: usize, local: bool) -> i32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ (seq_index as u64).wrapping_mul(0x9e37_79b9);
    let last = ctx.len() - 1;
    if local {
        if let Some(i) = (0..last).rev().find(|&i| ctx[i] == ctx[last]) {
            return ctx[i + 1];
        }
    }
    let seen = if local { &ctx[last..] } else { ctx };
    for &t in seen {
        h = (h ^ t as u64).wrapping_mul(0x100_0000_01b3);
    }
    h ^= h >> 29;
    (h % vocab as u64) as i32
}

/// The sampler's EOS masking.
pub fn sample(
    ctx: &[i32],
    seq_index: i32,
    vocab: usize,
    eos: &[i32],
    suppress: bool,
    local: bool,
) -> i32 {
    let mut t = model(ctx, seq_index, vocab, local);
    while suppress && eos.contains(&t) {
        t = (t + 1) % vocab as i32;
    }
    t
}

/// Parameters the reference needs.
#[derive(Clone, Debug)]
pub struct RefParams {
    pub max_tokens: usize,
    pub min_tokens: usize,
    pub ignore_eos: bool,
    pub stop_ids: Vec<i32>,
    /// The run's model looks at the last token only (see [`model`]).
    pub local_model: bool,
}

/// Expected output of sequence `k` and its finish reason (1 stop, 2 length).
pub fn reference(
    prompt: &[i32],
    k: i32,
    p: &RefParams,
    eos: &[i32],
    vocab: usize,
    max_model_len: usize,
) -> (Vec<i32>, u8) {
    let mut ctx = prompt.to_vec();
    loop {
        let before = ctx.len() - prompt.len();
        let suppress = !p.ignore_eos && before < p.min_tokens;
        let t = sample(&ctx, k, vocab, eos, suppress, p.local_model);
        ctx.push(t);
        let stop = (!p.ignore_eos && eos.contains(&t)) || p.stop_ids.contains(&t);
        if stop && before >= p.min_tokens {
            return (ctx[prompt.len()..].to_vec(), 1);
        }
        if before + 1 >= p.max_tokens || ctx.len() >= max_model_len {
            return (ctx[prompt.len()..].to_vec(), 2);
        }
    }
}

/// Simulated paged KV cache.
pub struct FakeRunner {
    kv: Vec<(i32, i32)>,
    block_size: usize,
    vocab: usize,
    eos: Vec<i32>,
    /// Block copies applied so far.
    pub copies: u64,
    /// Sample with the last-token model (see [`model`]).
    pub local_model: bool,
}

pub fn runner_copies(r: &FakeRunner) -> u64 {
    r.copies
}

impl FakeRunner {
    pub fn new(s: &Scheduler) -> Self {
        let c = s.config();
        FakeRunner {
            kv: vec![(-1, -1); c.num_blocks * c.block_size],
            block_size: c.block_size,
            vocab: c.vocab_size,
            eos: c.eos_token_ids.clone(),
            copies: 0,
            local_model: false,
        }
    }

    /// Checks the batch's shape invariants, "runs" it, and returns the sampled tokens.
    pub fn execute(&mut self, b: &StepBatch) -> Vec<i32> {
        let bs = self.block_size;
        let (t, nb, ns) = (b.num_tokens(), b.num_seqs(), b.num_samples());
        let m = b.max_blocks_per_seq;
        assert_eq!(b.positions.len(), t);
        assert_eq!(b.slot_mapping.len(), t);
        assert_eq!(b.query_start_loc.len(), nb + 1);
        assert_eq!(b.query_start_loc[0], 0);
        assert_eq!(*b.query_start_loc.last().unwrap() as usize, t);
        assert_eq!(b.block_tables.len(), nb * m);
        assert_eq!(
            b.num_prefill_tokens + b.num_decode_tokens + b.num_draft_tokens,
            t
        );
        for v in [&b.sample_seq_indices, &b.sample_output_lens, &b.top_k] {
            assert_eq!(v.len(), ns);
        }
        assert_eq!(b.suppress_eos.len(), ns);
        assert_eq!(b.sample_req_ids.len(), ns);
        // copy-on-write: all reads before writes
        let copies: Vec<(usize, usize)> = b
            .block_copies
            .chunks(2)
            .map(|c| (c[0] as usize, c[1] as usize))
            .collect();
        let saved: Vec<Vec<(i32, i32)>> = copies
            .iter()
            .map(|&(s, _)| self.kv[s * bs..(s + 1) * bs].to_vec())
            .collect();
        self.copies += copies.len() as u64;
        for ((_, d), data) in copies.iter().zip(saved) {
            assert_ne!(*d, 0, "copy into the null block");
            self.kv[d * bs..(d + 1) * bs].copy_from_slice(&data);
        }
        for i in 0..nb {
            let (q0, q1) = (
                b.query_start_loc[i] as usize,
                b.query_start_loc[i + 1] as usize,
            );
            assert!(q1 > q0, "empty sequence in batch");
            let row = &b.block_tables[i * m..(i + 1) * m];
            let len = b.seq_lens[i] as usize;
            assert_eq!(b.positions[q1 - 1] as usize, len - 1);
            for (j, &p) in b.positions[q0..q1].iter().enumerate() {
                assert_eq!(p as usize, len - (q1 - q0) + j);
                let blk = row[p as usize / bs];
                assert_ne!(blk, 0, "token written through the null block");
                assert_eq!(b.slot_mapping[q0 + j], blk * bs as i32 + p % bs as i32);
            }
            for (k, &blk) in row.iter().enumerate() {
                assert_eq!(blk == 0, k >= len.div_ceil(bs), "block table padding");
            }
        }
        for j in 0..t {
            self.kv[b.slot_mapping[j] as usize] = (b.input_ids[j], b.positions[j]);
        }
        let mut out = Vec::with_capacity(ns);
        for r in 0..ns {
            let li = b.logits_indices[r] as usize;
            // the sequence holding the row; a row other than its last is a draft's row
            let i = (0..nb)
                .find(|&i| (b.query_start_loc[i + 1] as usize) > li)
                .expect("logits row inside the batch");
            assert_eq!(b.sample_req_ids[r], b.seq_req_ids[i]);
            let row = &b.block_tables[i * m..(i + 1) * m];
            let ctx: Vec<i32> = (0..=b.positions[li] as usize)
                .map(|p| {
                    let (tok, pos) = self.kv[row[p / bs] as usize * bs + p % bs];
                    assert_eq!(
                        pos as usize, p,
                        "KV slot of position {p} holds position {pos}"
                    );
                    tok
                })
                .collect();
            out.push(sample(
                &ctx,
                b.sample_seq_indices[r],
                self.vocab,
                &self.eos,
                b.suppress_eos[r] == 1,
                self.local_model,
            ));
        }
        out
    }
}

/// One full step: schedule, run, update; returns (batch copy, events as tuples).
pub fn step(s: &mut Scheduler, r: &mut FakeRunner) -> (StepBatch, Vec<(u64, i32, i32, u8)>) {
    let b = s.schedule().expect("schedule").clone();
    s.check_integrity().expect("integrity after schedule");
    let sampled = r.execute(&b);
    let o = s.update(&sampled).expect("update");
    let ev = (0..o.len())
        .map(|i| {
            (
                o.req_ids[i],
                o.seq_indices[i],
                o.token_ids[i],
                o.finish_reasons[i],
            )
        })
        .collect();
    s.check_integrity().expect("integrity after update");
    (b, ev)
}
