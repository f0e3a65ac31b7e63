//! The continuous-batching scheduler: `schedule()` builds one step, `update()` applies its
//! sampled tokens.
//!
//! Each sequence carries `num_computed_tokens` toward `num_tokens`; that one counter covers
//! chunked prefill, prefix-cache hits and recompute after preemption. `schedule()` drains the
//! intake, then spends the token budget on running sequences first (1 token, or the next prompt
//! chunk), preempting by recompute when blocks run out (largest (priority, arrival) key first),
//! then admits waiting sequences in key order (a preempted one only once its whole recompute
//! and a block to grow into are free, or nothing else runs; with `admission_batch > 1` only
//! once that many find free slots, or nothing runs, or admission has been held back
//! `admission_max_wait_steps` steps); speculating decodes get their
//! prompt-lookup drafts last, from the budget and free blocks left (none in a step that
//! preempted).
//! `update()` advances the scheduled sequences, caches their newly full blocks, forks `n > 1`
//! children, appends tokens, applies stop rules and frees finished sequences at once. Terminal
//! events from `schedule()` (aborts, preemption cap failures) are reported by the following
//! `update()`.
//!
//! `update()` lives in `update.rs`. Invariants (checked by
//! [`Scheduler::check_integrity`], see `integrity.rs`):
//! - every live sequence is in exactly one of `waiting` / `running`, and in its request group;
//! - a waiting sequence holds no blocks; between steps a running one holds exactly
//!   `ceil(num_computed / block_size)` blocks and has `num_computed < num_tokens`; while a
//!   step is out, a scheduled one holds exactly the blocks for its computed, new and draft
//!   tokens (a draft never holds a block past `update()`);
//! - each block's ref count equals the number of block tables holding it;
//! - every submitted sequence gets exactly one terminal event.

use crate::batch::{StepBatch, StepOutput};
use crate::block_pool::BlockPool;
use crate::config::{Policy, SchedulerConfig};
use crate::error::SchedError;
use crate::intake::{Command, Intake};
use crate::prefix_cache::{extend_hashes, hash_salt, salt_digest};
use crate::request::{FinishReason, NewRequest, RequestGroup, RequestShared, SeqStatus, Sequence};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

/// Prompt lookup searches a sequence's last this many tokens.
const NGRAM_WINDOW: usize = 4096;

/// Waiting-set key: (priority, arrival, seq_index, handle); lower goes first.
pub(crate) type Key = (i64, u64, u32, u32);

#[derive(Debug, Clone, Copy)]
pub(crate) struct Scheduled {
    pub handle: u32,
    /// Tokens of the sequence computed this step.
    pub num_new: usize,
    /// Draft tokens computed after them (speculative decoding): `drafts[draft_start..][..num_draft]`.
    pub draft_start: usize,
    pub num_draft: usize,
}

impl Scheduled {
    fn plain(handle: u32, num_new: usize) -> Self {
        Scheduled {
            handle,
            num_new,
            draft_start: 0,
            num_draft: 0,
        }
    }
}

/// Counters reported by [`Scheduler::stats`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    /// Waiting sequences.
    pub num_waiting: usize,
    /// Running sequences.
    pub num_running: usize,
    /// Free blocks without a cached hash.
    pub num_free_blocks: usize,
    /// Free blocks holding a reusable cached block.
    pub num_cached_blocks: usize,
    /// Blocks with ref count > 0.
    pub num_used_blocks: usize,
    /// Total blocks (including the null block).
    pub num_blocks: usize,
    /// used / (num_blocks - 1).
    pub kv_cache_usage: f64,
    /// Preemptions since start.
    pub num_preemptions_total: u64,
    /// Prompt tokens looked up in the prefix cache (on a sequence's first admission; a
    /// preempted sequence's re-admission is not counted).
    pub prefix_cache_queries_total: u64,
    /// Prompt tokens found in the prefix cache.
    pub prefix_cache_hits_total: u64,
    /// Prompt (and recomputed) tokens computed.
    pub num_prompt_tokens_total: u64,
    /// Tokens generated (appended to sequences).
    pub num_generation_tokens_total: u64,
    /// Draft tokens proposed by prompt lookup and checked by the model.
    pub num_draft_tokens_total: u64,
    /// Draft tokens the model agreed with (each one a token gained without a step of its own).
    pub num_accepted_tokens_total: u64,
    /// Steps in which `admission_batch` kept waiting sequences waiting (free slots left idle).
    pub num_admission_holds_total: u64,
    /// Intake commands not yet drained.
    pub intake_queue_len: usize,
}

/// The step-side scheduler (owns all request and block state).
pub struct Scheduler {
    pub(crate) cfg: Arc<SchedulerConfig>,
    pub(crate) intake: Intake,
    pub(crate) pool: BlockPool,
    pub(crate) seqs: Vec<Option<Sequence>>,
    pub(crate) free_handles: Vec<u32>,
    pub(crate) dead_handles: Vec<u32>,
    pub(crate) groups: HashMap<u64, RequestGroup>,
    pub(crate) waiting: BTreeSet<Key>,
    pub(crate) running: Vec<u32>,
    pub(crate) next_arrival: u64,
    pub(crate) scheduled: Vec<Scheduled>,
    pub(crate) batch: StepBatch,
    pub(crate) output: StepOutput,
    pub(crate) pending: StepOutput,
    pub(crate) awaiting_update: bool,
    pub(crate) retired: Vec<u64>,
    pub(crate) hits_scratch: Vec<u32>,
    pub(crate) cmds_scratch: Vec<Command>,
    pub(crate) max_blocks: usize,
    pub(crate) num_preemptions_total: u64,
    pub(crate) num_prompt_tokens_total: u64,
    pub(crate) num_generation_tokens_total: u64,
    pub(crate) num_draft_tokens_total: u64,
    pub(crate) num_accepted_tokens_total: u64,
    /// This step's draft tokens (see [`Scheduled`]).
    pub(crate) drafts: Vec<i32>,
    /// `schedule_drafts`' list of the scheduled entries asking for drafts.
    pub(crate) askers_scratch: Vec<usize>,
    /// Steps in a row that `admission_batch` held waiting sequences back (0 after an admission).
    pub(crate) admission_held_steps: usize,
    pub(crate) num_admission_holds_total: u64,
    /// Salted into the block hashes of every sequence admitted from now on (see
    /// [`Scheduler::set_cache_epoch`]).
    pub(crate) cache_epoch: u64,
}

impl Scheduler {
    /// A scheduler for a validated configuration.
    pub fn new(cfg: SchedulerConfig) -> Result<Self, SchedError> {
        cfg.validate()?;
        let cfg = Arc::new(cfg);
        Ok(Scheduler {
            intake: Intake::new(cfg.clone()),
            pool: BlockPool::new(cfg.num_blocks, cfg.enable_prefix_caching),
            seqs: Vec::new(),
            free_handles: Vec::new(),
            dead_handles: Vec::new(),
            groups: HashMap::new(),
            waiting: BTreeSet::new(),
            running: Vec::with_capacity(cfg.max_num_seqs),
            next_arrival: 0,
            scheduled: Vec::with_capacity(cfg.max_num_seqs),
            batch: StepBatch::default(),
            output: StepOutput::default(),
            pending: StepOutput::default(),
            awaiting_update: false,
            retired: Vec::new(),
            hits_scratch: Vec::new(),
            cmds_scratch: Vec::new(),
            max_blocks: 0,
            num_preemptions_total: 0,
            num_prompt_tokens_total: 0,
            num_generation_tokens_total: 0,
            num_draft_tokens_total: 0,
            num_accepted_tokens_total: 0,
            drafts: Vec::new(),
            askers_scratch: Vec::new(),
            admission_held_steps: 0,
            num_admission_holds_total: 0,
            cache_epoch: 0,
            cfg,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// A handle for submitting / aborting from any thread.
    pub fn intake(&self) -> Intake {
        self.intake.clone()
    }

    /// Shortcut for `intake().submit(req)`.
    pub fn submit(&self, req: NewRequest) -> Result<(), SchedError> {
        self.intake.submit(req)
    }

    /// True while sequences are waiting or running, or commands are queued.
    pub fn has_unfinished(&self) -> bool {
        !self.groups.is_empty() || self.intake.queue_len() > 0
    }

    /// The batch built by the last `schedule()`.
    pub fn batch(&self) -> &StepBatch {
        &self.batch
    }

    /// The events of the last `update()`.
    pub fn output(&self) -> &StepOutput {
        &self.output
    }

    /// Forgets the prefix cache's free blocks (vLLM's `reset_prefix_cache`): later requests
    /// find no prefix that no running sequence holds. Returns the blocks dropped.
    pub fn reset_prefix_cache(&mut self) -> usize {
        self.pool.drop_free_cached()
    }

    /// Starts cache epoch `epoch` (the engine's weights version): a sequence admitted from now
    /// on hashes its blocks with it, so the KV of blocks computed before (cached, or held by
    /// sequences running across the change) never stands in for its tokens; a waiting
    /// sequence hashed in an earlier epoch is hashed again when admitted.
    pub fn set_cache_epoch(&mut self, epoch: u64) {
        self.cache_epoch = epoch;
    }

    /// Current counters.
    pub fn stats(&self) -> Stats {
        let used = self.pool.num_used();
        Stats {
            num_waiting: self.waiting.len(),
            num_running: self.running.len(),
            num_free_blocks: self.pool.num_free() - self.pool.num_cached_free(),
            num_cached_blocks: self.pool.num_cached_free(),
            num_used_blocks: used,
            num_blocks: self.cfg.num_blocks,
            kv_cache_usage: used as f64 / self.cfg.usable_blocks() as f64,
            num_preemptions_total: self.num_preemptions_total,
            prefix_cache_queries_total: self.pool.cache.queries_total,
            prefix_cache_hits_total: self.pool.cache.hits_total,
            num_prompt_tokens_total: self.num_prompt_tokens_total,
            num_generation_tokens_total: self.num_generation_tokens_total,
            num_draft_tokens_total: self.num_draft_tokens_total,
            num_accepted_tokens_total: self.num_accepted_tokens_total,
            num_admission_holds_total: self.num_admission_holds_total,
            intake_queue_len: self.intake.queue_len(),
        }
    }

    #[inline]
    pub(crate) fn seq(&self, h: u32) -> &Sequence {
        self.seqs[h as usize].as_ref().expect("live handle")
    }

    #[inline]
    pub(crate) fn seq_mut(&mut self, h: u32) -> &mut Sequence {
        self.seqs[h as usize].as_mut().expect("live handle")
    }

    pub(crate) fn new_handle(&mut self, s: Sequence) -> u32 {
        match self.free_handles.pop() {
            Some(h) => {
                self.seqs[h as usize] = Some(s);
                h
            }
            None => {
                self.seqs.push(Some(s));
                (self.seqs.len() - 1) as u32
            }
        }
    }

    // ---------------------------------------------------------------- intake

    fn drain_intake(&mut self) {
        let mut cmds = std::mem::take(&mut self.cmds_scratch);
        self.intake.drain(|c| cmds.push(c));
        for c in cmds.drain(..) {
            match c {
                Command::Submit(r) => self.add_request(*r),
                Command::Abort {
                    request_id,
                    seq_index,
                    reason,
                } => self.abort(request_id, seq_index, reason),
            }
        }
        self.cmds_scratch = cmds;
        // Only a release (pushing to `dead_handles`) can leave a dead handle in `running`.
        if !self.dead_handles.is_empty() {
            self.running.retain(|&h| self.seqs[h as usize].is_some());
        }
    }

    fn add_request(&mut self, r: NewRequest) {
        debug_assert!(!self.groups.contains_key(&r.request_id));
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        let shared = Arc::new(RequestShared {
            request_id: r.request_id,
            prompt_len: r.prompt.len(),
            max_tokens: r.max_tokens,
            min_tokens: r.min_tokens,
            ignore_eos: r.ignore_eos,
            stop_token_ids: r.stop_token_ids,
            priority: if self.cfg.policy == Policy::Priority {
                r.priority
            } else {
                0
            },
            arrival,
            salt: salt_digest(r.cache_salt.as_deref()),
            sampling: r.sampling,
            speculate: r.speculate && r.n == 1,
        });
        let seq = Sequence {
            req: shared,
            seq_index: 0,
            tokens: r.prompt,
            num_computed_tokens: 0,
            blocks: Vec::new(),
            block_hashes: Vec::new(),
            num_preemptions: 0,
            status: SeqStatus::Waiting,
            unforked: (1..r.n as u32).collect(),
            num_registered: 0,
            hash_epoch: self.cache_epoch,
            draft_misses: 0,
            draft_backoff: 0,
            draft_len: self.cfg.num_speculative_tokens as u8,
        };
        let h = self.new_handle(seq);
        self.waiting.insert(self.seq(h).key(h));
        self.groups
            .insert(r.request_id, RequestGroup { seqs: vec![h] });
    }

    /// Applies an abort now (unknown ids / finished sequences are ignored). Running sequences
    /// are left in `running` as dead handles; callers prune `running`.
    fn abort(&mut self, request_id: u64, seq_index: Option<u32>, reason: FinishReason) {
        let Some(group) = self.groups.get(&request_id) else {
            return;
        };
        let handles = group.seqs.clone();
        for h in handles {
            match seq_index {
                None => self.terminate(h, reason, None),
                Some(k) => {
                    let s = self.seq_mut(h);
                    if s.seq_index == k {
                        if s.unforked.is_empty() {
                            self.terminate(h, reason, None);
                        } else {
                            // The carrier takes over the next unforked index.
                            let old_key = s.key(h);
                            let next = s.unforked.remove(0);
                            s.seq_index = next;
                            let new_key = s.key(h);
                            if s.status == SeqStatus::Waiting {
                                self.waiting.remove(&old_key);
                                self.waiting.insert(new_key);
                            }
                            self.pending.push(request_id, k, -1, reason);
                        }
                    } else if let Some(pos) = s.unforked.iter().position(|&u| u == k) {
                        s.unforked.remove(pos);
                        self.pending.push(request_id, k, -1, reason);
                    }
                }
            }
        }
    }

    /// Reports a terminal event (into the pending events) for the sequence and, if it is a
    /// carrier, for its unforked indices; then releases it.
    fn terminate(&mut self, h: u32, reason: FinishReason, error: Option<String>) {
        let s = self.seqs[h as usize].as_ref().expect("live handle");
        let rid = s.req.request_id;
        self.pending.push(rid, s.seq_index, -1, reason);
        for &k in &s.unforked {
            self.pending.push(rid, k, -1, reason);
        }
        if let Some(msg) = error {
            self.pending.error_messages.push((rid, msg));
        }
        self.release(h);
    }

    /// Frees a sequence's blocks and handle slot (the one release path; not idempotent by
    /// design: callers hold live handles only).
    pub(crate) fn release(&mut self, h: u32) {
        let s = self.seqs[h as usize]
            .take()
            .expect("release of a live handle");
        if s.status == SeqStatus::Waiting {
            let removed = self.waiting.remove(&s.key(h));
            debug_assert!(removed);
        }
        for &b in s.blocks.iter().rev() {
            self.pool.decref(b);
        }
        self.dead_handles.push(h);
        let rid = s.req.request_id;
        if let Some(g) = self.groups.get_mut(&rid) {
            g.seqs.retain(|&x| x != h);
            if g.seqs.is_empty() {
                self.groups.remove(&rid);
                self.retired.push(rid);
            }
        }
    }

    pub(crate) fn end_of_phase(&mut self) {
        self.free_handles.append(&mut self.dead_handles);
        self.intake.retire(&mut self.retired);
    }

    // ---------------------------------------------------------------- schedule

    /// Frees a running sequence's blocks and sends it back to waiting (or fails it past the
    /// preemption cap). The caller removes it from `running`.
    fn preempt(&mut self, h: u32) {
        self.num_preemptions_total += 1;
        let max = self.cfg.max_preemptions;
        let s = self.seq_mut(h);
        s.num_preemptions += 1;
        if s.num_preemptions > max {
            let msg = format!(
                "request {} sequence {} was preempted {} times (limit {}): the KV cache is too small for the load",
                s.req.request_id, s.seq_index, s.num_preemptions, max
            );
            self.terminate(h, FinishReason::Error, Some(msg));
            return;
        }
        let blocks = std::mem::take(&mut s.blocks);
        s.num_computed_tokens = 0;
        s.num_registered = 0;
        s.status = SeqStatus::Waiting;
        let key = s.key(h);
        for &b in blocks.iter().rev() {
            self.pool.decref(b);
        }
        self.waiting.insert(key);
    }

    /// Allocates what sequence `h` needs to compute `num_new` more tokens (including a
    /// copy-on-write of a shared partial block); false (and no change) if the pool is short.
    fn try_allocate(&mut self, h: u32, num_new: usize) -> bool {
        let bs = self.cfg.block_size;
        let s = self.seqs[h as usize].as_mut().expect("live handle");
        let start = s.num_computed_tokens;
        let new_blocks = (start + num_new)
            .div_ceil(bs)
            .saturating_sub(s.blocks.len());
        let cow = !start.is_multiple_of(bs) && self.pool.refcount(s.blocks[start / bs]) > 1;
        if self.pool.num_free() < new_blocks + cow as usize {
            return false;
        }
        if cow {
            let src = s.blocks[start / bs];
            let dst = self.pool.alloc().expect("checked free count");
            s.blocks[start / bs] = dst;
            self.pool.decref(src);
            self.batch
                .block_copies
                .extend_from_slice(&[src as i32, dst as i32]);
        }
        for _ in 0..new_blocks {
            let b = self.pool.alloc().expect("checked free count");
            s.blocks.push(b);
        }
        true
    }

    fn chunk(&self, remaining: usize, budget: usize) -> usize {
        let mut n = remaining.min(budget);
        if self.cfg.long_prefill_token_threshold > 0 {
            n = n.min(self.cfg.long_prefill_token_threshold);
        }
        n
    }

    /// Drains the intake and builds the next step's batch. Errors if the previous step's
    /// `update()` has not been called.
    pub fn schedule(&mut self) -> Result<&StepBatch, SchedError> {
        if self.awaiting_update {
            return Err(SchedError::Protocol(
                "schedule() called twice: update() must be called after every schedule()".into(),
            ));
        }
        self.drain_intake();
        self.batch.clear();
        self.scheduled.clear();
        self.drafts.clear();
        self.max_blocks = 0;
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut preempted = false;
        // Running sequences in key order: the budget goes to the oldest first and the victim
        // search below assumes everything before `i` outranks everything after. Under FCFS the
        // list stays in order by construction (admissions come in key order, after every
        // running key; `update()` inserts forked children behind their siblings; checked by
        // `check_integrity`); a priority arrival can outrank running sequences.
        if self.cfg.policy == Policy::Priority {
            let seqs = &self.seqs;
            self.running
                .sort_unstable_by_key(|&h| seqs[h as usize].as_ref().map(|s| s.key(h)));
        }

        // Running sequences first. `slots` counts each scheduled one with the children it will
        // fork; it is used only when every running sequence got scheduled (see below).
        let mut slots: usize = 0;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let h = self.running[i];
            let s = self.seq(h);
            let num_new = self.chunk(s.num_tokens() - s.num_computed_tokens, budget);
            debug_assert!(num_new >= 1);
            let mut ok = false;
            while !ok {
                if self.try_allocate(h, num_new) {
                    ok = true;
                    break;
                }
                // Victim: the largest key among the not-yet-scheduled running sequences.
                let (vi, _) = self.running[i..]
                    .iter()
                    .enumerate()
                    .map(|(j, &v)| (i + j, self.seq(v).key(v)))
                    .max_by_key(|&(_, k)| k)
                    .expect("current sequence is a candidate");
                let victim = self.running.remove(vi);
                self.preempt(victim);
                preempted = true;
                if vi == i {
                    break;
                }
            }
            if ok {
                let s = self.seqs[h as usize].as_ref().expect("live handle");
                self.max_blocks = self.max_blocks.max(s.blocks.len());
                slots += 1 + s.unforked.len();
                self.scheduled.push(Scheduled::plain(h, num_new));
                budget -= num_new;
                i += 1;
            }
        }

        // Then waiting ones, in key order (none after a preemption this step). Slots count the
        // children that running carriers will fork. Without a preemption, budget left over means
        // the loop above scheduled every running sequence, so `slots` covers all of them.
        debug_assert!(
            preempted
                || budget == 0
                || slots
                    == self
                        .running
                        .iter()
                        .map(|&h| 1 + self.seq(h).unforked.len())
                        .sum::<usize>()
        );
        let held = !preempted && budget > 0 && self.holds_admission(slots);
        let mut admitted = 0usize;
        while !preempted && !held && budget > 0 {
            let Some(&key) = self.waiting.first() else {
                break;
            };
            let h = key.3;
            let want_slots = 1 + self.seq(h).unforked.len();
            if slots + want_slots > self.cfg.max_num_seqs {
                break;
            }
            let (num_new, need, cached) = self.plan_admission(h, budget);
            let revive = self
                .hits_scratch
                .iter()
                .filter(|&&b| self.pool.refcount(b) == 0)
                .count();
            if self.pool.num_free() < need + revive + self.readmission_slack(h, need) {
                break;
            }
            self.waiting.remove(&key);
            let hits = std::mem::take(&mut self.hits_scratch);
            for &b in &hits {
                self.pool.incref(b);
            }
            let s = self.seqs[h as usize].as_mut().expect("live handle");
            s.blocks.clear();
            s.blocks.extend_from_slice(&hits);
            s.num_computed_tokens = cached;
            s.num_registered = hits.len();
            s.status = SeqStatus::Running;
            let num_tokens = s.num_tokens() as u64;
            for _ in 0..need {
                let b = self.pool.alloc().expect("checked free count");
                self.seqs[h as usize].as_mut().expect("live").blocks.push(b);
            }
            self.hits_scratch = hits;
            // First admissions only: a preempted sequence coming back finds its own freed
            // blocks (and its generated tokens), which says nothing about the cache's hit rate.
            if self.pool.caching() && self.seq(h).num_preemptions == 0 {
                self.pool.cache.queries_total += num_tokens;
                self.pool.cache.hits_total += cached as u64;
            }
            self.running.push(h);
            self.max_blocks = self.max_blocks.max(self.seq(h).blocks.len());
            self.scheduled.push(Scheduled::plain(h, num_new));
            budget -= num_new;
            slots += want_slots;
            admitted += 1;
        }
        if held {
            self.admission_held_steps += 1;
            self.num_admission_holds_total += 1;
        } else if admitted > 0 || self.waiting.is_empty() {
            self.admission_held_steps = 0;
        }

        // Drafts last: they take only the budget and the blocks nobody else needed this step.
        if !preempted && budget > 0 {
            self.schedule_drafts(budget);
        }

        self.end_of_phase();
        self.fill_batch();
        self.awaiting_update = true;
        Ok(&self.batch)
    }

    /// `admission_batch`: whether this step keeps the waiting sequences waiting, given the
    /// `slots` the running ones take. Never while nothing runs, never once admission has been
    /// held `admission_max_wait_steps` steps in a row; otherwise while fewer than
    /// `min(admission_batch, waiting)` slots are free.
    fn holds_admission(&self, slots: usize) -> bool {
        let batch = self.cfg.admission_batch;
        if batch <= 1 || self.running.is_empty() || self.waiting.is_empty() {
            return false;
        }
        if self.admission_held_steps >= self.cfg.admission_max_wait_steps {
            return false;
        }
        let free = self.cfg.max_num_seqs.saturating_sub(slots);
        free < batch.min(self.waiting.len())
    }

    /// Gives the scheduled sequences that may speculate their prompt-lookup drafts, out of the
    /// step's `budget` left after every running and admitted sequence got its tokens (and within
    /// `speculative_max_step_tokens`). The rows are shared evenly among the sequences asking
    /// (rows a sequence's lookup leaves unused pass to the ones after it), and a sequence gets
    /// blocks for its drafts only from the free pool: drafts never preempt anyone.
    fn schedule_drafts(&mut self, budget: usize) {
        let cfg = &self.cfg;
        if cfg.num_speculative_tokens == 0
            || (cfg.speculative_max_running > 0 && self.running.len() > cfg.speculative_max_running)
        {
            return;
        }
        let step_tokens = cfg.max_num_batched_tokens - budget;
        let mut rows = budget;
        if cfg.speculative_max_step_tokens > 0 {
            rows = rows.min(cfg.speculative_max_step_tokens.saturating_sub(step_tokens));
        }
        let mut askers = std::mem::take(&mut self.askers_scratch);
        askers.clear();
        for i in 0..self.scheduled.len() {
            if self.wants_drafts(self.scheduled[i].handle) {
                askers.push(i);
            }
        }
        for (k, &i) in askers.iter().enumerate() {
            let share = rows.div_ceil(askers.len() - k);
            if share == 0 {
                break;
            }
            let Scheduled {
                handle: h, num_new, ..
            } = self.scheduled[i];
            let draft_start = self.drafts.len();
            let num_draft = self.propose_drafts(h, share);
            if num_draft == 0 {
                continue;
            }
            if !self.try_allocate(h, num_new + num_draft) {
                // no free blocks for them: drop the drafts rather than preempt anyone
                self.drafts.truncate(draft_start);
                continue;
            }
            let blocks = self.seq(h).blocks.len();
            self.max_blocks = self.max_blocks.max(blocks);
            let x = &mut self.scheduled[i];
            x.draft_start = draft_start;
            x.num_draft = num_draft;
            rows -= num_draft;
        }
        self.askers_scratch = askers;
    }

    /// Whether scheduled sequence `h` may draft this step: it speculates, has one token left to
    /// compute, and no back-off is pending (see `accept_drafts`; a pending back-off counts down
    /// here, once per step).
    fn wants_drafts(&mut self, h: u32) -> bool {
        let s = self.seqs[h as usize].as_mut().expect("live handle");
        if !s.req.speculate || s.num_tokens() - s.num_computed_tokens != 1 {
            return false;
        }
        if s.draft_backoff > 0 {
            s.draft_backoff -= 1;
            return false;
        }
        true
    }

    /// Appends at most `rows` prompt-lookup drafts for sequence `h` to `drafts` and returns how
    /// many: never more than its `draft_len` (`num_speculative_tokens` or, when the length
    /// adapts, less), or than the model length or the sequence's `max_tokens` leave room for
    /// (each accepted draft adds a token, and the step adds one more).
    fn propose_drafts(&mut self, h: u32, rows: usize) -> usize {
        let cfg = &self.cfg;
        let s = self.seqs[h as usize].as_ref().expect("live handle");
        let r = &s.req;
        let room = (s.draft_len as usize)
            .min(cfg.num_speculative_tokens)
            .min(rows)
            .min(cfg.max_model_len.saturating_sub(s.num_tokens() + 1))
            .min(r.max_tokens.saturating_sub(s.output_len() + 1));
        crate::ngram::propose(
            &s.tokens,
            cfg.speculative_ngram_min,
            cfg.speculative_ngram_max,
            room,
            NGRAM_WINDOW,
            &mut self.drafts,
        )
    }

    /// Extra free blocks a preempted sequence needs to come back while others run: enough for
    /// its whole recompute and one block to grow into, beyond the first chunk's `need`.
    /// Without it, a sequence re-admitted into a block or two of transient room is the first
    /// victim again when an older one grows, and thrashes into the preemption cap although it
    /// fits on its own. Nothing running: no slack (it fits the pool, so it must come back).
    fn readmission_slack(&self, h: u32, need: usize) -> usize {
        let s = self.seq(h);
        if s.num_preemptions == 0 || self.running.is_empty() {
            return 0;
        }
        let whole = s.num_tokens().div_ceil(self.cfg.block_size) + 1;
        whole.saturating_sub(self.hits_scratch.len() + need)
    }

    /// Prefix lookup for waiting sequence `h` into `hits_scratch`; returns
    /// (tokens to compute now, fresh blocks needed, cached tokens).
    fn plan_admission(&mut self, h: u32, budget: usize) -> (usize, usize, usize) {
        let bs = self.cfg.block_size;
        self.hits_scratch.clear();
        let caching = self.pool.caching();
        let epoch = self.cache_epoch;
        let s = self.seqs[h as usize].as_mut().expect("live handle");
        if caching {
            if s.hash_epoch != epoch {
                // hashed in an earlier epoch (before a weight update): hashed again in this one
                s.block_hashes.clear();
                s.hash_epoch = epoch;
            }
            // Never the whole sequence: at least one token is always computed.
            let limit = (s.num_tokens() - 1) / bs;
            extend_hashes(
                &mut s.block_hashes,
                &s.tokens,
                bs,
                hash_salt(s.req.salt, epoch),
                limit,
            );
            for &hash in &s.block_hashes[..limit.min(s.block_hashes.len())] {
                match self.pool.lookup(hash) {
                    Some(b) => self.hits_scratch.push(b),
                    None => break,
                }
            }
        }
        let cached = self.hits_scratch.len() * bs;
        let s = self.seq(h);
        let num_new = self.chunk(s.num_tokens() - cached, budget);
        let need = (cached + num_new).div_ceil(bs) - self.hits_scratch.len();
        (num_new, need, cached)
    }

    fn fill_batch(&mut self) {
        let bs = self.cfg.block_size as i32;
        let b = &mut self.batch;
        b.max_blocks_per_seq = self.max_blocks.max(1);
        b.query_start_loc.push(0);
        for x in &self.scheduled {
            let s = self.seqs[x.handle as usize]
                .as_ref()
                .expect("scheduled handle");
            let start = s.num_computed_tokens;
            let end = start + x.num_new;
            let draft = &self.drafts[x.draft_start..x.draft_start + x.num_draft];
            b.input_ids.extend_from_slice(&s.tokens[start..end]);
            b.input_ids.extend_from_slice(draft);
            for p in start..end + draft.len() {
                b.positions.push(p as i32);
                b.slot_mapping
                    .push(s.blocks[p / bs as usize] as i32 * bs + (p as i32 % bs));
            }
            if x.num_new == 1 && s.num_tokens() > s.req.prompt_len && end == s.num_tokens() {
                b.num_decode_tokens += 1;
            } else {
                b.num_prefill_tokens += x.num_new;
            }
            b.num_draft_tokens += draft.len();
            b.query_start_loc.push(b.input_ids.len() as i32);
            b.seq_lens.push((end + draft.len()) as i32);
            b.block_tables.extend(s.blocks.iter().map(|&x| x as i32));
            b.block_tables
                .resize(b.seq_lens.len() * b.max_blocks_per_seq, 0);
            b.seq_req_ids.push(s.req.request_id);
            b.seq_indices.push(s.seq_index as i32);
            if end == s.num_tokens() {
                // the last real token's row, then one row per draft token: row j predicts the
                // token after draft j (checked in `update`)
                let last = (b.input_ids.len() - draft.len()) as i32 - 1;
                let r = &s.req;
                let out_len = s.output_len();
                let rows = (0..=draft.len()).map(|j| (last + j as i32, out_len + j, s.seq_index));
                let children = s.unforked.iter().map(|&k| (last, out_len, k));
                for (row, out_len, idx) in rows.chain(children) {
                    let suppress = (!r.ignore_eos && out_len < r.min_tokens) as u8;
                    b.logits_indices.push(row);
                    b.sample_req_ids.push(r.request_id);
                    b.sample_seq_indices.push(idx as i32);
                    b.sample_output_lens.push(out_len as i32);
                    let p = &r.sampling;
                    b.temperature.push(p.temperature);
                    b.top_k.push(p.top_k);
                    b.top_p.push(p.top_p);
                    b.min_p.push(p.min_p);
                    b.repetition_penalty.push(p.repetition_penalty);
                    b.presence_penalty.push(p.presence_penalty);
                    b.frequency_penalty.push(p.frequency_penalty);
                    b.seed.push(p.seed);
                    b.suppress_eos.push(suppress);
                }
            }
        }
    }
}
