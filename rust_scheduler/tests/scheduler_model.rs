//! Model-based property test of the scheduler: random submit / step / abort sequences on tiny
//! pools (preemption, chunking, prefix hits, n > 1, copy-on-write and speculative drafts, accepted
//! and rejected, all happen often), with `check_integrity()` after every operation and a
//! reference generator as the oracle: drafts must never change an output.
#![cfg(not(loom))]

mod common;
use common::*;
use proptest::prelude::*;
use rust_scheduler::*;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Coverage counters summed over all cases: preemptions, prefix-hit tokens, block copies,
/// failed requests, aborted sequences, n>1 requests finished naturally, accepted drafts,
/// rejected drafts.
static COVER: [AtomicU64; 8] = [const { AtomicU64::new(0) }; 8];

#[derive(Debug, Clone)]
enum Op {
    Submit {
        prefix: usize,
        extra: Vec<i32>,
        max_tokens: usize,
        min_tokens: usize,
        n: usize,
        ignore_eos: bool,
        salt: bool,
        priority: i64,
        speculate: bool,
    },
    Step,
    ResetPrefixCache,
    Abort {
        pick: usize,
        seq: Option<u32>,
        reason: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..3usize, prop::collection::vec(1..16i32, 0..10), 1..10usize, 0..3usize, 1..4usize, any::<bool>(), prop::bool::weighted(0.2), 0..3i64, prop::bool::weighted(0.7))
            .prop_map(|(prefix, extra, max_tokens, min_tokens, n, ignore_eos, salt, priority, speculate)| Op::Submit { prefix, extra, max_tokens, min_tokens, n, ignore_eos, salt, priority, speculate }),
        6 => Just(Op::Step),
        1 => Just(Op::ResetPrefixCache),
        1 => (any::<usize>(), prop::option::weighted(0.3, 0..3u32), 0..3u8).prop_map(|(pick, seq, reason)| Op::Abort { pick, seq, reason }),
    ]
}

fn config() -> impl Strategy<Value = SchedulerConfig> {
    (
        (
            1..5usize,
            3..20usize,
            1..6usize,
            1..20usize,
            any::<bool>(),
            any::<bool>(),
            0..4u32,
            0..6usize,
        ),
        (
            0..5usize,
            1..3usize,
            0..3usize,
            0..4usize,
            0..7usize,
            any::<bool>(),
            1..4usize,
            0..4usize,
        ),
    )
        .prop_map(
            |(
                (bs, nb, seqs, budget, caching, prio, maxp, thr),
                (k, ngram_min, ngram_extra, spec_running, spec_step, adaptive, adm, adm_wait),
            )| SchedulerConfig {
                num_blocks: nb,
                block_size: bs,
                max_num_seqs: seqs,
                max_num_batched_tokens: budget,
                max_model_len: 30,
                vocab_size: 16,
                eos_token_ids: vec![0],
                enable_prefix_caching: caching,
                policy: if prio { Policy::Priority } else { Policy::Fcfs },
                max_preemptions: maxp,
                intake_capacity: 64,
                long_prefill_token_threshold: thr,
                num_speculative_tokens: k.min(budget - 1),
                speculative_ngram_min: ngram_min,
                speculative_ngram_max: ngram_min + ngram_extra,
                speculative_max_running: spec_running,
                speculative_max_step_tokens: spec_step,
                speculative_adaptive: adaptive,
                admission_batch: adm.min(seqs),
                admission_max_wait_steps: adm_wait,
            },
        )
}

struct Req {
    prompt: Vec<i32>,
    params: RefParams,
    n: usize,
    outputs: Vec<Vec<i32>>,
    terminal: Vec<Option<u8>>,
    aborted_as: Vec<Option<u8>>,
}

const PREFIXES: [&[i32]; 3] = [&[], &[3, 1, 4, 1, 5, 9, 2, 6], &[2, 7, 1, 8, 2, 8]];

fn run(cfg: SchedulerConfig, local_model: bool, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut s = Scheduler::new(cfg.clone()).unwrap();
    let mut runner = FakeRunner::new(&s);
    runner.local_model = local_model;
    let mut reqs: HashMap<u64, Req> = HashMap::new();
    let mut next_id = 0u64;
    let mut errors: HashMap<u64, String> = HashMap::new();
    // adaptive draft length: the most drafts each sequence may propose next
    let mut draft_limit: HashMap<(u64, usize), usize> = HashMap::new();
    let mut apply = |s: &mut Scheduler,
                     runner: &mut FakeRunner,
                     reqs: &mut HashMap<u64, Req>|
     -> Result<(), TestCaseError> {
        let (b, ev) = step(s, runner);
        // a sequence's rows: its output so far, then one more per draft row before it
        let mut rows_before: HashMap<(u64, usize), usize> = HashMap::new();
        for i in 0..b.num_samples() {
            let r = &reqs[&b.sample_req_ids[i]];
            let k = b.sample_seq_indices[i] as usize;
            let j = rows_before.entry((b.sample_req_ids[i], k)).or_insert(0);
            prop_assert_eq!(b.sample_output_lens[i] as usize, r.outputs[k].len() + *j);
            *j += 1;
        }
        prop_assert_eq!(b.num_samples(), rows_before.len() + b.num_draft_tokens);
        let k_max = cfg.num_speculative_tokens;
        for (key, &rows) in &rows_before {
            let limit = draft_limit.get(key).copied().unwrap_or(k_max);
            prop_assert!(rows - 1 <= k_max);
            prop_assert!(
                !cfg.speculative_adaptive || rows - 1 <= limit,
                "{} drafts > {limit}",
                rows - 1
            );
        }
        let mut appended: HashMap<(u64, usize), usize> = HashMap::new();
        for &(id, k, tok, _) in &ev {
            if tok >= 0 {
                *appended.entry((id, k as usize)).or_insert(0) += 1;
            }
        }
        if b.num_draft_tokens > 0 {
            // drafts only fill what the step left, up to the cap
            prop_assert!(b.input_ids.len() <= cfg.max_num_batched_tokens);
            let cap = cfg.speculative_max_step_tokens;
            prop_assert!(cap == 0 || b.input_ids.len() <= cap);
            prop_assert!(
                cfg.speculative_max_running == 0 || b.seq_lens.len() <= cfg.speculative_max_running
            );
        }
        for (id, k, tok, reason) in ev {
            let r = reqs.get_mut(&id).expect("event for a known request");
            let k = k as usize;
            prop_assert!(k < r.n);
            prop_assert!(r.terminal[k].is_none(), "event after terminal for {id}/{k}");
            if tok >= 0 {
                r.outputs[k].push(tok);
            }
            if reason != 0 {
                r.terminal[k] = Some(reason);
            }
        }
        // drafts cut short at `a` accepted: at most a + 1 next time; accepted in full: K
        for (&(id, k), &rows) in &rows_before {
            if rows > 1 && reqs[&id].terminal[k].is_none() {
                let accepted = appended
                    .get(&(id, k))
                    .copied()
                    .unwrap_or(0)
                    .saturating_sub(1);
                let next = if accepted < rows - 1 {
                    accepted + 1
                } else {
                    k_max
                };
                draft_limit.insert((id, k), next);
            }
        }
        for (id, m) in &s.output().error_messages {
            errors.insert(*id, m.clone());
        }
        Ok(())
    };
    for o in ops {
        match o {
            Op::Submit {
                prefix,
                extra,
                max_tokens,
                min_tokens,
                n,
                ignore_eos,
                salt,
                priority,
                speculate,
            } => {
                let mut prompt = PREFIXES[prefix].to_vec();
                prompt.extend(extra);
                let mut nr = NewRequest::new(next_id, prompt.clone(), max_tokens);
                nr.min_tokens = min_tokens.min(max_tokens);
                nr.n = n;
                nr.ignore_eos = ignore_eos;
                nr.priority = priority;
                nr.stop_token_ids = vec![15];
                nr.cache_salt = salt.then(|| "s".to_string());
                nr.speculate = speculate;
                let params = RefParams {
                    max_tokens,
                    min_tokens: nr.min_tokens,
                    ignore_eos,
                    stop_ids: vec![15],
                    local_model,
                };
                let bad = prompt.is_empty()
                    || prompt.len() + max_tokens > cfg.max_model_len
                    || (prompt.len() + max_tokens - 1).div_ceil(cfg.block_size)
                        > cfg.num_blocks - 1
                    || n > cfg.max_num_seqs;
                match s.submit(nr) {
                    Ok(()) => {
                        prop_assert!(!bad, "accepted a request that cannot fit");
                        reqs.insert(
                            next_id,
                            Req {
                                prompt,
                                params,
                                n,
                                outputs: vec![vec![]; n],
                                terminal: vec![None; n],
                                aborted_as: vec![None; n],
                            },
                        );
                    }
                    Err(SchedError::InvalidRequest(_)) => {
                        prop_assert!(bad, "rejected a valid request")
                    }
                    Err(e) => return Err(TestCaseError::fail(format!("unexpected {e}"))),
                }
                next_id += 1;
            }
            Op::Step => apply(&mut s, &mut runner, &mut reqs)?,
            Op::ResetPrefixCache => {
                let cached = s.stats().num_cached_blocks;
                prop_assert_eq!(s.reset_prefix_cache(), cached);
                prop_assert_eq!(s.stats().num_cached_blocks, 0);
            }
            Op::Abort { pick, seq, reason } => {
                if next_id > 0 {
                    let id = pick as u64 % next_id;
                    let fr = [FinishReason::Abort, FinishReason::Stop, FinishReason::Error]
                        [reason as usize];
                    s.intake().abort(id, seq, fr).unwrap();
                    if let Some(r) = reqs.get_mut(&id) {
                        for k in 0..r.n {
                            if (seq.is_none() || seq == Some(k as u32)) && r.aborted_as[k].is_none()
                            {
                                r.aborted_as[k] = Some(fr as u8);
                            }
                        }
                    }
                }
            }
        }
        s.check_integrity()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
    let mut steps = 0;
    while s.has_unfinished() {
        apply(&mut s, &mut runner, &mut reqs)?;
        steps += 1;
        prop_assert!(steps < 3000, "no progress: livelock");
    }
    let st = s.stats();
    COVER[0].fetch_add(st.num_preemptions_total, Relaxed);
    COVER[1].fetch_add(st.prefix_cache_hits_total, Relaxed);
    COVER[2].fetch_add(runner_copies(&runner), Relaxed);
    COVER[3].fetch_add(errors.len() as u64, Relaxed);
    COVER[4].fetch_add(
        reqs.values()
            .map(|r| r.terminal.iter().filter(|t| **t == Some(3)).count() as u64)
            .sum(),
        Relaxed,
    );
    COVER[5].fetch_add(
        reqs.values()
            .filter(|r| r.n > 1 && r.terminal.iter().all(|t| matches!(t, Some(1) | Some(2))))
            .count() as u64,
        Relaxed,
    );
    prop_assert!(st.num_accepted_tokens_total <= st.num_draft_tokens_total);
    COVER[6].fetch_add(st.num_accepted_tokens_total, Relaxed);
    COVER[7].fetch_add(
        st.num_draft_tokens_total - st.num_accepted_tokens_total,
        Relaxed,
    );
    prop_assert_eq!(st.num_used_blocks, 0);
    prop_assert_eq!(
        st.num_free_blocks + st.num_cached_blocks,
        cfg.num_blocks - 1
    );
    prop_assert_eq!(st.num_running + st.num_waiting, 0);
    for b in 1..cfg.num_blocks as u32 {
        let _ = b; // refcounts are covered by check_integrity (all tables empty => all 0)
    }
    for (id, r) in &reqs {
        for k in 0..r.n {
            let term = r.terminal[k];
            prop_assert!(term.is_some(), "request {id} seq {k} never terminated");
            let term = term.unwrap();
            let (want, why) = reference(
                &r.prompt,
                k as i32,
                &r.params,
                &cfg.eos_token_ids,
                cfg.vocab_size,
                cfg.max_model_len,
            );
            match term {
                1 | 2 if r.aborted_as[k] != Some(1) => {
                    prop_assert_eq!(&r.outputs[k], &want, "request {} seq {} output", id, k);
                    prop_assert_eq!(term, why);
                }
                _ => {
                    prop_assert!(
                        want.starts_with(&r.outputs[k]),
                        "partial output of {id}/{k} diverges"
                    );
                    if term == 4 && r.aborted_as[k] != Some(4) {
                        prop_assert!(errors.contains_key(id), "error without a message");
                    }
                    if term == 3 {
                        prop_assert_eq!(r.aborted_as[k], Some(3));
                    }
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, max_shrink_iters: 2000, ..ProptestConfig::default() })]
    #[test]
    fn scheduler_matches_reference(cfg in config(), local in any::<bool>(), ops in prop::collection::vec(op(), 1..60)) {
        run(cfg, local, ops)?;
    }
}

/// The generated cases must exercise every mechanism (a weak generator would pass vacuously).
#[test]
fn generator_covers_every_mechanism() {
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 300,
        ..ProptestConfig::default()
    });
    runner
        .run(
            &(config(), any::<bool>(), prop::collection::vec(op(), 1..60)),
            |(c, l, o)| run(c, l, o),
        )
        .unwrap();
    let got: Vec<u64> = COVER.iter().map(|c| c.load(Relaxed)).collect();
    eprintln!(
        "coverage (preemptions, prefix-hit tokens, copies, failed, aborted, n>1 done, \
         drafts accepted, drafts rejected): {got:?}"
    );
    assert!(got.iter().all(|&c| c > 0), "{got:?}");
}
