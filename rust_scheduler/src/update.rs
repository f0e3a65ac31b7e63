//! `Scheduler::update`: applies one step's sampled tokens.
//!
//! For each scheduled sequence: advance `num_computed_tokens`, offer newly full blocks to the
//! prefix cache (only now, after their K/V were written), and if the step reached the end of
//! the sequence's tokens, fork pending `n > 1` children (sharing every block, ref counts
//! incremented) and append one sampled token to each, applying the stop rules. Finished
//! sequences are released in the same step. Terminal events queued by `schedule()` (aborts,
//! preemption-cap failures) come first in the output. Validation happens before any change,
//! so a rejected `update()` can be retried.
//!
//! A sequence scheduled with draft tokens (speculative decoding) has one sampled row per
//! draft plus one. Row `j` is the token after draft `j - 1`, so it is valid only while every
//! earlier draft matched what the model sampled before it: tokens are appended in order until
//! the first mismatch (that row's token is the correction) or until all drafts matched (the
//! last row is a bonus token). Each matched draft's K/V becomes computed; the blocks the
//! rejected drafts used are freed, and only full blocks of accepted tokens reach the prefix
//! cache. A draft refused outright starts (or lengthens) the sequence's drafting back-off; with
//! `speculative_adaptive` its next drafts number at most one past the tokens accepted now
//! (`num_speculative_tokens` again after drafts accepted in full).

use crate::batch::StepOutput;
use crate::error::SchedError;
use crate::prefix_cache::{extend_hashes, hash_salt};
use crate::request::{FinishReason, SeqStatus, Sequence};
use crate::scheduler::{Scheduled, Scheduler};

/// Back-off after refused drafts grows to 2^(this - 1) decode steps.
const MAX_DRAFT_MISSES: u8 = 4;

impl Scheduler {
    /// Applies the sampled tokens (one per `logits_indices` row of the last batch) and returns
    /// the step's events. On error nothing changes and `update()` may be retried.
    pub fn update(&mut self, sampled: &[i32]) -> Result<&StepOutput, SchedError> {
        if !self.awaiting_update {
            return Err(SchedError::Protocol(
                "update() called without a preceding schedule()".into(),
            ));
        }
        let want = self.batch.num_samples();
        if sampled.len() != want {
            return Err(SchedError::Protocol(format!(
                "update() got {} sampled tokens but the last batch has num_samples = {want}",
                sampled.len()
            )));
        }
        let vocab = self.cfg.vocab_size;
        if let Some((i, &t)) = sampled
            .iter()
            .enumerate()
            .find(|(_, &t)| t < 0 || t as usize >= vocab)
        {
            return Err(SchedError::Protocol(format!(
                "sampled token {t} at index {i} is outside [0, {vocab})"
            )));
        }
        self.awaiting_update = false;
        self.output.clear();
        std::mem::swap(&mut self.output, &mut self.pending);
        self.num_prompt_tokens_total += self.batch.num_prefill_tokens as u64;
        let mut row = 0;
        let scheduled = std::mem::take(&mut self.scheduled);
        for x in &scheduled {
            let h = x.handle;
            let s = self.seqs[h as usize].as_mut().expect("scheduled handle");
            s.num_computed_tokens += x.num_new;
            self.register_full_blocks(h);
            let s = self.seqs[h as usize].as_mut().expect("scheduled handle");
            if s.num_computed_tokens < s.num_tokens() {
                continue; // a prompt chunk: nothing sampled
            }
            if x.num_draft > 0 {
                let rows = &sampled[row..row + x.num_draft + 1];
                row += rows.len();
                self.accept_drafts(x, rows);
                continue;
            }
            let children = std::mem::take(&mut s.unforked);
            let forked: Vec<u32> = children.into_iter().map(|k| self.fork(h, k)).collect();
            self.append(h, sampled[row]);
            row += 1;
            for c in forked {
                self.append(c, sampled[row]);
                row += 1;
            }
        }
        self.scheduled = scheduled;
        debug_assert_eq!(row, want);
        if !self.dead_handles.is_empty() {
            self.running.retain(|&h| self.seqs[h as usize].is_some());
        }
        self.end_of_phase();
        Ok(&self.output)
    }

    /// Offers the blocks of `h` that are now full of computed tokens to the prefix cache.
    fn register_full_blocks(&mut self, h: u32) {
        if !self.pool.caching() {
            return;
        }
        let bs = self.cfg.block_size;
        let s = self.seqs[h as usize].as_mut().expect("live handle");
        let full = s.num_computed_tokens / bs;
        if full > s.num_registered {
            let salt = hash_salt(s.req.salt, s.hash_epoch);
            extend_hashes(&mut s.block_hashes, &s.tokens, bs, salt, full);
            for k in s.num_registered..full {
                self.pool.register(s.blocks[k], s.block_hashes[k]);
            }
            s.num_registered = full;
        }
    }

    /// Appends the tokens of a drafted sequence's rows up to the first one that disagrees
    /// with its draft (see the module header), then frees the blocks past the accepted tokens.
    fn accept_drafts(&mut self, x: &Scheduled, rows: &[i32]) {
        let h = x.handle;
        let mut accepted = 0;
        let mut alive = true;
        for (j, &token) in rows.iter().enumerate() {
            alive = self.append(h, token);
            if !alive || j == x.num_draft || token != self.drafts[x.draft_start + j] {
                break;
            }
            accepted += 1;
        }
        self.num_draft_tokens_total += x.num_draft as u64;
        self.num_accepted_tokens_total += accepted as u64;
        if !alive {
            return; // finished: every block was released
        }
        let s = self.seqs[h as usize].as_mut().expect("live handle");
        s.num_computed_tokens += accepted;
        // Text that does not repeat itself keeps matching n-grams whose continuations the
        // model refuses: after each outright refusal the sequence waits 1, 2, 4, then 8 decode
        // steps before drafting again; any accepted draft resets the wait.
        if accepted == 0 {
            s.draft_misses = (s.draft_misses + 1).min(MAX_DRAFT_MISSES);
            s.draft_backoff = 1 << (s.draft_misses - 1);
        } else {
            s.draft_misses = 0;
        }
        let k = self.cfg.num_speculative_tokens;
        if self.cfg.speculative_adaptive {
            // cut short at `accepted`: one more than that next time; accepted in full: all
            let next = if accepted < x.num_draft {
                accepted + 1
            } else {
                k
            };
            s.draft_len = next as u8;
        }
        let keep = s.num_computed_tokens.div_ceil(self.cfg.block_size);
        while s.blocks.len() > keep {
            let b = s.blocks.pop().expect("more blocks than kept");
            self.pool.decref(b);
        }
        self.register_full_blocks(h);
    }

    /// A new running sequence with index `k` sharing all of `h`'s blocks.
    fn fork(&mut self, h: u32, k: u32) -> u32 {
        let p = self.seq(h);
        let child = Sequence {
            req: p.req.clone(),
            seq_index: k,
            tokens: p.tokens.clone(),
            num_computed_tokens: p.num_computed_tokens,
            blocks: p.blocks.clone(),
            block_hashes: p.block_hashes.clone(),
            num_preemptions: 0,
            status: SeqStatus::Running,
            unforked: Vec::new(),
            num_registered: p.num_registered,
            hash_epoch: p.hash_epoch,
            draft_misses: 0,
            draft_backoff: 0,
            draft_len: p.draft_len,
        };
        for &b in &child.blocks {
            self.pool.incref(b);
        }
        let rid = child.req.request_id;
        let c = self.new_handle(child);
        // Behind the parent and its earlier children, where its key sorts: a child pushed to
        // the end would sit behind newer requests, to be preempted or starved before them.
        let seqs = &self.seqs;
        let same_request = |x: u32| {
            seqs[x as usize]
                .as_ref()
                .is_some_and(|s| s.req.request_id == rid)
        };
        let at = match self.running.iter().position(|&x| x == h) {
            Some(p) => {
                p + 1
                    + self.running[p + 1..]
                        .iter()
                        .take_while(|&&x| same_request(x))
                        .count()
            }
            None => self.running.len(),
        };
        self.running.insert(at, c);
        if let Some(g) = self.groups.get_mut(&rid) {
            g.seqs.push(c);
        }
        c
    }

    /// Appends a sampled token and applies the stop rules; finished sequences are released.
    /// Returns whether the sequence is still running.
    fn append(&mut self, h: u32, token: i32) -> bool {
        let max_model_len = self.cfg.max_model_len;
        let s = self.seqs[h as usize].as_mut().expect("live handle");
        let r = &s.req;
        let out_before = s.output_len();
        s.tokens.push(token);
        let is_eos = !r.ignore_eos && self.cfg.eos_token_ids.contains(&token);
        let reason = if (is_eos || r.stop_token_ids.contains(&token)) && out_before >= r.min_tokens
        {
            FinishReason::Stop
        } else if out_before + 1 >= r.max_tokens || s.tokens.len() >= max_model_len {
            FinishReason::Length
        } else {
            FinishReason::Running
        };
        self.output.push(r.request_id, s.seq_index, token, reason);
        self.num_generation_tokens_total += 1;
        if reason != FinishReason::Running {
            self.release(h);
            return false;
        }
        true
    }
}
