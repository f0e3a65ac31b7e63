//! Hand-built scheduler scenarios with exact expectations.
#![cfg(not(loom))]

mod common;
use common::*;
use rust_scheduler::*;

fn cfg(num_blocks: usize, block_size: usize, budget: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks,
        block_size,
        max_num_batched_tokens: budget,
        max_model_len: 64,
        vocab_size: 50,
        eos_token_ids: vec![0],
        ..SchedulerConfig::default()
    }
}

fn req(id: u64, prompt: Vec<i32>, max_tokens: usize) -> NewRequest {
    NewRequest::new(id, prompt, max_tokens)
}

/// Manual step: schedule, feed `tokens` (one per sample), return events.
fn feed(s: &mut Scheduler, tokens: &[i32]) -> Vec<(u64, i32, i32, u8)> {
    s.schedule().unwrap();
    let o = s.update(tokens).unwrap();
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
    s.check_integrity().unwrap();
    ev
}

fn drain(s: &mut Scheduler, r: &mut FakeRunner) -> Vec<(u64, i32, i32, u8)> {
    let mut all = vec![];
    for _ in 0..1000 {
        if !s.has_unfinished() {
            return all;
        }
        all.extend(step(s, r).1);
    }
    panic!("did not finish");
}

#[test]
fn chunked_prefill_does_not_stall_decodes() {
    let mut s = Scheduler::new(cfg(64, 4, 4)).unwrap();
    let mut r = FakeRunner::new(&s);
    s.submit(req(1, vec![1, 2], 10)).unwrap();
    let (b, ev) = step(&mut s, &mut r);
    assert_eq!((b.num_tokens(), b.num_samples()), (2, 1));
    assert_eq!(ev.len(), 1);
    s.submit(req(2, (1..=10).collect(), 5)).unwrap();
    let mut chunks = vec![];
    for _ in 0..4 {
        let (b, _) = step(&mut s, &mut r);
        assert_eq!(b.seq_req_ids[0], 1, "the decode is scheduled first");
        assert_eq!(b.num_decode_tokens, 1);
        chunks.push(b.num_prefill_tokens);
        assert!(b.num_tokens() <= 4);
    }
    assert_eq!(chunks, vec![3, 3, 3, 1]);
}

#[test]
fn long_prefill_threshold_caps_chunks() {
    let mut c = cfg(64, 4, 100);
    c.long_prefill_token_threshold = 3;
    let mut s = Scheduler::new(c).unwrap();
    let mut r = FakeRunner::new(&s);
    s.submit(req(1, (1..=7).collect(), 2)).unwrap();
    let sizes: Vec<usize> = (0..3)
        .map(|_| step(&mut s, &mut r).0.num_tokens())
        .collect();
    assert_eq!(sizes, vec![3, 3, 1]);
}

#[test]
fn prefix_hit_computes_only_the_rest_and_same_output() {
    let mut s = Scheduler::new(cfg(64, 4, 64)).unwrap();
    let mut r = FakeRunner::new(&s);
    let prompt: Vec<i32> = (1..=9).collect();
    s.submit(req(1, prompt.clone(), 3)).unwrap();
    let a = drain(&mut s, &mut r);
    s.submit(req(2, prompt.clone(), 3)).unwrap();
    let (b, first) = step(&mut s, &mut r);
    assert_eq!(
        b.num_tokens(),
        1,
        "8 of 9 prompt tokens come from the cache"
    );
    assert_eq!(b.positions, vec![8]);
    let st = s.stats();
    assert_eq!(st.prefix_cache_hits_total, 8);
    assert_eq!(st.prefix_cache_queries_total, 18);
    let mut b_all = first;
    b_all.extend(drain(&mut s, &mut r));
    let toks = |ev: &[(u64, i32, i32, u8)], id| {
        ev.iter()
            .filter(|e| e.0 == id)
            .map(|e| e.2)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        toks(&a, 1),
        toks(&b_all, 2),
        "a prefix hit changes nothing computed"
    );
    // A prompt that is exactly two full blocks reuses only the first: >= 1 token is computed.
    s.submit(req(3, (1..=8).collect(), 1)).unwrap();
    assert_eq!(step(&mut s, &mut r).0.num_tokens(), 4);
    // A different salt shares nothing.
    let mut q = req(4, prompt, 1);
    q.cache_salt = Some("tenant-b".into());
    s.submit(q).unwrap();
    assert_eq!(step(&mut s, &mut r).0.num_tokens(), 9);
    drain(&mut s, &mut r);
    assert_eq!(s.stats().num_used_blocks, 0);
}

#[test]
fn a_new_cache_epoch_shares_no_block_computed_before() {
    // the engine's weight update: a sequence running across it keeps its blocks, but neither
    // they nor cached ones stand in for a sequence admitted after it, even one submitted
    // before; within the new epoch, sharing works as before
    let mut s = Scheduler::new(cfg(64, 4, 64)).unwrap();
    let mut r = FakeRunner::new(&s);
    let prompt: Vec<i32> = (1..=9).collect();
    s.submit(req(1, prompt.clone(), 3)).unwrap();
    drain(&mut s, &mut r); // its blocks are cached and free now
    s.submit(req(2, prompt.clone(), 20)).unwrap();
    assert_eq!(
        step(&mut s, &mut r).0.num_tokens(),
        1,
        "a hit within the epoch"
    );
    s.submit(req(3, prompt.clone(), 2)).unwrap(); // submitted, not admitted yet
    s.set_cache_epoch(1);
    let (b, _) = step(&mut s, &mut r); // request 2 decodes (its blocks held), 3 is admitted
    assert_eq!(b.num_tokens(), 1 + 9, "request 3 computes its whole prompt");
    drain(&mut s, &mut r);
    s.submit(req(4, prompt.clone(), 1)).unwrap();
    assert_eq!(
        step(&mut s, &mut r).0.num_tokens(),
        1,
        "epoch 1's own blocks are shared"
    );
    drain(&mut s, &mut r);
    assert_eq!(s.stats().num_used_blocks, 0);
}

#[test]
fn caching_off_recomputes_everything() {
    let mut c = cfg(64, 4, 64);
    c.enable_prefix_caching = false;
    let mut s = Scheduler::new(c).unwrap();
    let mut r = FakeRunner::new(&s);
    s.submit(req(1, (1..=9).collect(), 1)).unwrap();
    drain(&mut s, &mut r);
    s.submit(req(2, (1..=9).collect(), 1)).unwrap();
    assert_eq!(step(&mut s, &mut r).0.num_tokens(), 9);
    assert_eq!(s.stats().num_cached_blocks, 0);
}

#[test]
fn preemption_recomputes_and_output_is_unchanged() {
    // 6 usable blocks of 2 tokens; two requests that each grow to 10 tokens cannot both fit.
    let mut s = Scheduler::new(cfg(7, 2, 64)).unwrap();
    let mut r = FakeRunner::new(&s);
    let p = RefParams {
        max_tokens: 6,
        min_tokens: 0,
        ignore_eos: true,
        stop_ids: vec![],
        local_model: false,
    };
    for id in 1..=2 {
        let mut q = req(id, vec![id as i32 + 1, 7, 9, 11], 6);
        q.ignore_eos = true;
        s.submit(q).unwrap();
    }
    let ev = drain(&mut s, &mut r);
    assert!(s.stats().num_preemptions_total >= 1);
    for id in 1..=2u64 {
        let got: Vec<i32> = ev.iter().filter(|e| e.0 == id).map(|e| e.2).collect();
        let (want, why) = reference(&[id as i32 + 1, 7, 9, 11], 0, &p, &[0], 50, 64);
        assert_eq!(got, want);
        assert_eq!(
            ev.iter()
                .filter(|e| e.0 == id && e.3 != 0)
                .map(|e| e.3)
                .collect::<Vec<_>>(),
            vec![why]
        );
    }
    assert_eq!(s.stats().num_used_blocks, 0);
}

#[test]
fn preemption_cap_fails_with_a_reason() {
    let mut c = cfg(7, 2, 64);
    c.max_preemptions = 0;
    let mut s = Scheduler::new(c).unwrap();
    let mut r = FakeRunner::new(&s);
    for id in 1..=2 {
        let mut q = req(id, vec![5, 7, 9, 11], 6);
        q.ignore_eos = true;
        s.submit(q).unwrap();
    }
    let mut msgs = vec![];
    let mut ev = vec![];
    while s.has_unfinished() {
        ev.extend(step(&mut s, &mut r).1);
        msgs.extend(s.output().error_messages.clone());
    }
    let failed: Vec<_> = ev.iter().filter(|e| e.3 == 4).collect();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].0, 2, "the newest request is the victim");
    assert_eq!(failed[0].2, -1);
    assert!(msgs[0].1.contains("preempted"), "{msgs:?}");
}

#[test]
fn rejects_what_can_never_fit_or_is_malformed() {
    let mut c = cfg(5, 4, 64); // 4 usable blocks = 16 tokens
    c.max_num_seqs = 4;
    let s = Scheduler::new(c).unwrap();
    let bad = |q: NewRequest| matches!(s.submit(q), Err(SchedError::InvalidRequest(_)));
    assert!(bad(req(1, vec![], 1)));
    assert!(bad(req(1, vec![50], 1)));
    assert!(bad(req(1, vec![-1], 1)));
    assert!(bad(req(1, vec![1], 0)));
    assert!(bad(req(1, vec![1; 60], 10)), "over max_model_len");
    assert!(bad(req(1, vec![1; 16], 2)), "needs 5 blocks, pool has 4");
    let mut q = req(1, vec![1], 1);
    q.n = 5;
    assert!(bad(q));
    let mut q = req(1, vec![1], 1);
    q.sampling.top_p = 0.0;
    assert!(bad(q));
    assert!(
        s.submit(req(1, vec![1; 15], 2)).is_ok(),
        "exactly fits (last token never computed)"
    );
    assert!(bad(req(1, vec![1], 1)), "duplicate live id");
    assert_eq!(s.stats().num_waiting, 0, "nothing drained yet");
}

#[test]
fn queue_full_is_reported_and_recoverable() {
    let mut c = cfg(16, 4, 64);
    c.intake_capacity = 2;
    let mut s = Scheduler::new(c).unwrap();
    s.submit(req(1, vec![1], 1)).unwrap();
    s.submit(req(2, vec![1], 1)).unwrap();
    assert!(matches!(
        s.submit(req(3, vec![1], 1)),
        Err(SchedError::QueueFull(_))
    ));
    assert!(!s.intake().is_live(3), "a rejected id is not reserved");
    feed(&mut s, &[4, 4]);
    s.submit(req(3, vec![1], 1)).unwrap();
}

#[test]
fn abort_mid_prefill_and_mid_decode_frees_everything_once() {
    let mut s = Scheduler::new(cfg(64, 4, 4)).unwrap();
    s.submit(req(1, (1..=10).collect(), 5)).unwrap();
    s.submit(req(2, vec![3, 4], 5)).unwrap();
    feed(&mut s, &[]); // 4 tokens of request 1, nothing sampled
    let i = s.intake();
    i.abort(1, None, FinishReason::Abort).unwrap();
    i.abort(1, None, FinishReason::Abort).unwrap(); // idempotent
    i.abort(99, None, FinishReason::Abort).unwrap(); // unknown
    let ev = feed(&mut s, &[7]);
    assert!(ev.contains(&(1, 0, -1, 3)));
    assert_eq!(ev.iter().filter(|e| e.0 == 1).count(), 1);
    i.abort(2, None, FinishReason::Stop).unwrap(); // a stop string found by the engine
    let ev = feed(&mut s, &[]);
    assert_eq!(ev, vec![(2, 0, -1, 1)]);
    assert!(!s.has_unfinished());
    assert_eq!(s.stats().num_used_blocks, 0);
    assert!(!i.is_live(1) && !i.is_live(2));
}

#[test]
fn n_greater_than_one_shares_prompt_and_copies_on_write() {
    let mut s = Scheduler::new(cfg(64, 4, 64)).unwrap();
    let mut r = FakeRunner::new(&s);
    let mut q = req(1, vec![1, 2, 3, 4, 5, 6], 4);
    q.n = 3;
    q.ignore_eos = true;
    s.submit(q).unwrap();
    let (b, ev) = step(&mut s, &mut r);
    assert_eq!(b.num_tokens(), 6, "prompt computed once");
    assert_eq!(b.logits_indices, vec![5, 5, 5]);
    assert_eq!(b.sample_seq_indices, vec![0, 1, 2]);
    assert_eq!(ev.len(), 3);
    assert_eq!(
        s.stats().num_used_blocks,
        2,
        "children share the prompt's blocks"
    );
    let (b, _) = step(&mut s, &mut r);
    assert_eq!(
        b.num_copies(),
        2,
        "two of three writers copy the shared partial block"
    );
    let ev = drain(&mut s, &mut r);
    let p = RefParams {
        max_tokens: 4,
        min_tokens: 0,
        ignore_eos: true,
        stop_ids: vec![],
        local_model: false,
    };
    for k in 0..3 {
        let (want, _) = reference(&[1, 2, 3, 4, 5, 6], k, &p, &[0], 50, 64);
        let got: Vec<i32> = ev.iter().filter(|e| e.1 == k).map(|e| e.2).collect();
        assert_eq!(got[..], want[2..]);
    }
    assert_eq!(s.stats().num_used_blocks, 0);
}

#[test]
fn abort_one_unforked_child_before_the_fork() {
    let mut s = Scheduler::new(cfg(64, 4, 64)).unwrap();
    let mut q = req(1, vec![1, 2, 3], 2);
    q.n = 3;
    s.submit(q).unwrap();
    s.intake().abort(1, Some(0), FinishReason::Abort).unwrap();
    s.schedule().unwrap();
    assert_eq!(s.batch().sample_seq_indices, vec![1, 2]);
    let o = s.update(&[5, 6]).unwrap().clone();
    assert_eq!(o.req_ids.len(), 3);
    assert_eq!((o.seq_indices[0], o.finish_reasons[0]), (0, 3));
    s.check_integrity().unwrap();
}

#[test]
fn min_tokens_and_stop_rules() {
    let mut s = Scheduler::new(cfg(64, 4, 64)).unwrap();
    let mut q = req(1, vec![1, 2], 10);
    q.min_tokens = 2;
    q.stop_token_ids = vec![9];
    s.submit(q).unwrap();
    s.schedule().unwrap();
    assert_eq!(s.batch().suppress_eos, vec![1]);
    assert_eq!(
        s.update(&[0]).unwrap().finish_reasons,
        vec![0],
        "EOS before min_tokens"
    );
    s.schedule().unwrap();
    assert_eq!(s.batch().suppress_eos, vec![1]);
    assert_eq!(s.batch().sample_output_lens, vec![1]);
    assert_eq!(
        s.update(&[9]).unwrap().finish_reasons,
        vec![0],
        "stop id before min_tokens"
    );
    s.schedule().unwrap();
    assert_eq!(s.batch().suppress_eos, vec![0]);
    assert_eq!(s.update(&[9]).unwrap().finish_reasons, vec![1]);
    // ignore_eos: EOS never stops, max_tokens does.
    let mut q = req(2, vec![1], 2);
    q.ignore_eos = true;
    s.submit(q).unwrap();
    assert_eq!(feed(&mut s, &[0]), vec![(2, 0, 0, 0)]);
    assert_eq!(feed(&mut s, &[0]), vec![(2, 0, 0, 2)]);
    // max_model_len reports length.
    s.submit(req(3, vec![1; 62], 2)).unwrap();
    feed(&mut s, &[4]);
    assert_eq!(feed(&mut s, &[4]), vec![(3, 0, 4, 2)]);
}

#[test]
fn priority_policy_admits_lowest_value_first() {
    let mut c = cfg(64, 4, 64);
    c.policy = Policy::Priority;
    c.max_num_seqs = 1;
    let mut s = Scheduler::new(c).unwrap();
    for (id, prio) in [(1, 5), (2, -1), (3, 0)] {
        let mut q = req(id, vec![1], 1);
        q.priority = prio;
        s.submit(q).unwrap();
    }
    let order: Vec<u64> = (0..3).map(|_| feed(&mut s, &[4])[0].0).collect();
    assert_eq!(order, vec![2, 3, 1]);
}

#[test]
fn protocol_errors_change_nothing() {
    let mut s = Scheduler::new(cfg(64, 4, 64)).unwrap();
    assert!(matches!(s.update(&[]), Err(SchedError::Protocol(_))));
    s.submit(req(1, vec![1], 3)).unwrap();
    s.schedule().unwrap();
    assert!(matches!(s.schedule(), Err(SchedError::Protocol(_))));
    assert!(matches!(s.update(&[1, 2]), Err(SchedError::Protocol(_))));
    assert!(matches!(s.update(&[50]), Err(SchedError::Protocol(_))));
    s.check_integrity().unwrap();
    assert_eq!(s.update(&[1]).unwrap().len(), 1);
}

/// A request with `n = 2` (forked children) arrives before a plain one; the cache is too small
/// for all three sequences. Under FCFS, as under priority scheduling with equal priorities, the
/// newest request is preempted first: the older request's child must not be the victim while
/// the newer request keeps its blocks. (Children used to be appended behind newer requests.)
#[test]
fn fcfs_preempts_the_newest_request_before_an_older_requests_child() {
    for policy in [Policy::Fcfs, Policy::Priority] {
        let mut c = cfg(8, 2, 64); // 7 usable blocks of 2 tokens
        c.max_preemptions = 0; // the first preemption fails its sequence: the victim shows
        c.enable_prefix_caching = false;
        c.policy = policy;
        let mut s = Scheduler::new(c).unwrap();
        let mut r = FakeRunner::new(&s);
        let mut a = req(1, vec![5, 6], 8);
        a.n = 2;
        a.ignore_eos = true;
        s.submit(a).unwrap();
        let mut b = req(2, vec![7, 8], 8);
        b.ignore_eos = true;
        s.submit(b).unwrap();
        let terminal: Vec<_> = drain(&mut s, &mut r)
            .into_iter()
            .filter(|e| e.3 != 0)
            .collect();
        assert_eq!(terminal.len(), 3, "{policy:?}: {terminal:?}");
        assert_eq!(
            (terminal[0].0, terminal[0].3),
            (2, FinishReason::Error as u8),
            "{policy:?}: the newest request is the first victim: {terminal:?}"
        );
    }
}

/// Under FCFS a token budget too small for every running sequence goes to the oldest request
/// first, its forked child included: the newer request must not decode while the older
/// request's child waits (beyond the step that forks it).
#[test]
fn fcfs_budget_serves_an_older_requests_child_before_a_newer_request() {
    for policy in [Policy::Fcfs, Policy::Priority] {
        let mut c = cfg(64, 4, 2); // budget: two tokens per step
        c.policy = policy;
        let mut s = Scheduler::new(c).unwrap();
        let mut r = FakeRunner::new(&s);
        let mut a = req(1, vec![5], 10);
        a.n = 2;
        a.ignore_eos = true;
        s.submit(a).unwrap();
        let mut b = req(2, vec![7], 20);
        b.ignore_eos = true;
        s.submit(b).unwrap();
        let mut child_live = true;
        let mut steps_child_skipped_for_newer = 0;
        for _ in 0..200 {
            if !s.has_unfinished() {
                break;
            }
            let (batch, ev) = step(&mut s, &mut r);
            let ran = |id: u64, k: i32| {
                batch
                    .seq_req_ids
                    .iter()
                    .zip(&batch.seq_indices)
                    .any(|(&i, &j)| (i, j) == (id, k))
            };
            if child_live && ran(2, 0) && !ran(1, 1) {
                steps_child_skipped_for_newer += 1;
            }
            if ev.iter().any(|e| (e.0, e.1) == (1, 1) && e.3 != 0) {
                child_live = false;
            }
        }
        assert!(!s.has_unfinished());
        assert!(
            steps_child_skipped_for_newer <= 1,
            "{policy:?}: request 2 decoded while request 1's child waited in \
             {steps_child_skipped_for_newer} steps"
        );
    }
}

/// The prefix cache's query and hit counters cover first admissions only: a preempted
/// sequence's re-admission finds its own freed blocks (and its generated tokens), which would
/// inflate the reported hit rate.
#[test]
fn prefix_cache_counters_skip_readmissions_after_preemption() {
    let mut s = Scheduler::new(cfg(7, 2, 64)).unwrap(); // 6 usable blocks of 2 tokens
    let mut r = FakeRunner::new(&s);
    for id in 1..=2 {
        let mut q = req(id, vec![id as i32 + 1, 7, 9, 11], 6);
        q.ignore_eos = true;
        s.submit(q).unwrap();
    }
    drain(&mut s, &mut r);
    let st = s.stats();
    assert!(st.num_preemptions_total >= 1, "the scenario must preempt");
    assert_eq!(
        st.prefix_cache_queries_total, 8,
        "the two prompts, once each"
    );
    assert_eq!(
        st.prefix_cache_hits_total, 0,
        "distinct first blocks: nothing to share"
    );
}

/// `n = 4` sequences that fit the pool only one or two at a time. A preempted sibling used to be
/// re-admitted into a block of transient room, be the first victim again when an older sibling
/// grew, and thrash into the preemption cap (error) although each sequence fits on its own.
/// It now comes back only when its whole recompute and a block to grow into are free (or
/// nothing else runs): every sequence finishes, with few preemptions.
#[test]
fn preempted_siblings_do_not_thrash_into_the_preemption_cap() {
    let c = SchedulerConfig {
        num_blocks: 4,
        block_size: 16,
        max_num_batched_tokens: 16,
        max_model_len: 512,
        vocab_size: 50,
        eos_token_ids: vec![0],
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(c).unwrap();
    let mut r = FakeRunner::new(&s);
    let mut q = req(1, (1..=10).collect(), 24);
    q.n = 4;
    q.ignore_eos = true;
    s.submit(q).unwrap();
    let mut terminal: Vec<_> = drain(&mut s, &mut r)
        .into_iter()
        .filter(|e| e.3 != 0)
        .map(|e| (e.1, e.3))
        .collect();
    terminal.sort();
    let length = FinishReason::Length as u8;
    assert_eq!(
        terminal,
        vec![(0, length), (1, length), (2, length), (3, length)]
    );
    assert!(
        s.stats().num_preemptions_total <= 4,
        "{}",
        s.stats().num_preemptions_total
    );
}

/// `admission_batch`: with 4 slots running 4 sequences of different lengths and 6 waiting, the
/// waiting ones join only when 2 slots are free at once (or after `admission_max_wait_steps`
/// held steps), never one by one; once nothing runs they join at once; every request still
/// gets all its tokens (the scenario helpers check integrity after every schedule and update).
#[test]
fn admission_batch_admits_waiting_sequences_in_groups() {
    let run = |batch: usize, max_wait: usize| {
        let mut s = Scheduler::new(SchedulerConfig {
            max_num_seqs: 4,
            admission_batch: batch,
            admission_max_wait_steps: max_wait,
            ..cfg(256, 4, 64)
        })
        .unwrap();
        let mut r = FakeRunner::new(&s);
        let lens = [3usize, 9, 5, 14, 4, 7, 6, 11, 2, 8];
        for (i, &n) in lens.iter().enumerate() {
            let mut q = req(i as u64 + 1, vec![3, 4, 5], n);
            q.ignore_eos = true;
            s.submit(q).unwrap();
        }
        let mut joins: Vec<usize> = vec![]; // sequences admitted per step, when some were
        let mut seen = std::collections::HashSet::new();
        let mut tokens = std::collections::HashMap::new();
        for _ in 0..1000 {
            if !s.has_unfinished() {
                break;
            }
            let (b, ev) = step(&mut s, &mut r);
            let new = b.seq_req_ids.iter().filter(|&&id| seen.insert(id)).count();
            if new > 0 {
                joins.push(new);
            }
            for (id, _, _, _) in ev {
                *tokens.entry(id).or_insert(0usize) += 1;
            }
        }
        assert!(!s.has_unfinished());
        for (i, &n) in lens.iter().enumerate() {
            assert_eq!(tokens[&(i as u64 + 1)], n, "request {} lost tokens", i + 1);
        }
        let holds = s.stats().num_admission_holds_total;
        assert_eq!(holds == 0, batch == 1 || max_wait == 0, "holds {holds}");
        joins
    };
    // plain continuous batching: 4 at first, then refills one by one as slots free
    let plain = run(1, 8);
    assert_eq!(plain[0], 4);
    assert!(plain[1..].contains(&1), "{plain:?}");
    // groups of two (the last refill may hold the one request left)
    let grouped = run(2, 100);
    assert_eq!(grouped[0], 4);
    assert!(
        grouped[1..grouped.len() - 1].iter().all(|&n| n >= 2),
        "{grouped:?}"
    );
    assert!(grouped.len() < plain.len(), "{grouped:?} vs {plain:?}");
    // a zero wait bound holds nothing back
    assert_eq!(run(2, 0), plain);
    // a wait bound of one step: a single free slot is filled after one held step
    let bounded = run(4, 1);
    assert!(bounded[1..].contains(&1), "{bounded:?}");
}

#[test]
fn admission_batch_is_validated() {
    for (batch, ok) in [(0usize, false), (1, true), (4, true), (5, false)] {
        let c = SchedulerConfig {
            max_num_seqs: 4,
            admission_batch: batch,
            ..cfg(64, 4, 16)
        };
        assert_eq!(Scheduler::new(c).is_ok(), ok, "admission_batch {batch}");
    }
}
